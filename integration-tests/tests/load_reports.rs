//! A worker's load reports (`Worker.WatchLoad`), which the router follows: the first at once,
//! then one as the load changes, and while nothing changes only the heartbeat, the same report
//! again.

use std::time::{Duration, Instant};

use tandem_integration_tests::{Cluster, ClusterConfig, collect};
use tandem_proto::v1 as pb;
use tokio_stream::StreamExt;
use tonic::Streaming;

async fn next(reports: &mut Streaming<pb::LoadResponse>) -> pb::LoadResponse {
    tokio::time::timeout(Duration::from_secs(30), reports.next())
        .await
        .expect("a report within 30 s")
        .expect("the stream open")
        .expect("a report")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_follow_the_load_and_repeat_on_the_heartbeat() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let mut worker = pb::worker_client::WorkerClient::new(cluster.decode[0].channel());
    let heartbeat = Duration::from_millis(600);
    let mut reports = worker
        .watch_load(pb::WatchLoadRequest {
            interval_ms: 10,
            heartbeat_ms: 600,
        })
        .await
        .expect("watch")
        .into_inner();
    let first = next(&mut reports).await;
    assert_eq!(first.active + first.queued, 0, "{first:?}");
    assert!(first.capacity > 0, "{first:?}");

    // Idle, nothing changes: the next report is the heartbeat, the same one.
    let waited = Instant::now();
    let again = next(&mut reports).await;
    assert!(
        waited.elapsed() >= heartbeat / 2,
        "an unchanged load reported after {:?}",
        waited.elapsed()
    );
    assert_eq!(again, first);

    // A long generation: a report shows it running, and a later one shows it gone.
    let mut client = cluster.client();
    let generation = tokio::spawn(async move {
        let request = pb::GenerateRequest {
            token_ids: (7..200).collect(),
            sampling: Some(pb::SamplingParams {
                max_tokens: 400,
                ignore_eos: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        collect(&mut client, request).await
    });
    loop {
        let r = next(&mut reports).await;
        if r.active + r.queued > 0 {
            break;
        }
    }
    let done = generation.await.expect("joined").expect("generated");
    assert_eq!(done.token_ids.len(), 400);
    loop {
        let r = next(&mut reports).await;
        if r.active + r.queued == 0 {
            break;
        }
    }
    cluster.stop().await.expect("stop");
}
