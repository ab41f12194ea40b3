//! Preemption that keeps the KV. On SmolLM2 with one decode slot and nothing pinned, a batch
//! stream that runs when an interactive request comes is paused: its KV goes to the disk tier,
//! the interactive stream takes the slot, and the batch stream resumes where it stood once the
//! slot is free again. Its client sees a gap and the same tokens as an uninterrupted run of the
//! same seed; the node counts the pause, the bytes parked on disk, the resume, and no token
//! computed again; and the steps it waited through beside the interactive stream.

use tandem_engine::{EngineConfig, SpillConfig};
use tandem_integration_tests::{
    Cluster, ClusterConfig, SpillDir, collect, finish, metrics, open, sample, smollm2_model,
};
use tandem_proto::v1 as pb;

fn request(id: &str, prompt: Vec<u32>, max_tokens: u32, priority: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.into(),
        token_ids: prompt,
        sampling: Some(pb::SamplingParams {
            max_tokens,
            min_tokens: max_tokens,
            temperature: 0.9,
            seed: 7,
            ..Default::default()
        }),
        priority: priority.into(),
        ..Default::default()
    }
}

fn prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| 900 + (i * 7 + salt * 13) % 3000).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_stream_parks_its_kv_on_disk_and_resumes_exactly() {
    let spill = SpillDir::new();
    let base = ClusterConfig::new(smollm2_model().expect("SmolLM2"));
    let cluster = Cluster::start(ClusterConfig {
        decode_slots: 1,
        park_pinned_bytes: 0,
        engine: EngineConfig {
            spill: Some(SpillConfig {
                dir: spill.0.clone(),
                max_bytes: 1 << 30,
            }),
            ..base.engine.clone()
        },
        ..base
    })
    .await
    .expect("cluster");
    let mut client = cluster.client();
    let batch_prompt = prompt(70, 1);

    // A batch stream, running when an interactive request comes.
    let (frames, begun) = open(
        &mut client,
        request("paused", batch_prompt.clone(), 150, "batch"),
        12,
    )
    .await
    .expect("the batch stream");
    let interactive = collect(
        &mut cluster.client(),
        request("interactive", prompt(30, 2), 24, "interactive"),
    )
    .await
    .expect("the interactive stream");
    assert_eq!(interactive.token_ids.len(), 24);
    let decode = metrics(cluster.decode[0].addr).await.expect("metrics");
    let resumed = finish(frames, begun)
        .await
        .expect("the batch stream resumes");
    // The same stream alone, uninterrupted (after: before, its KV would have stayed in the
    // session cache, and the paused stream's blocks, which it shares, in the pool).
    let alone = collect(&mut client, request("alone", batch_prompt, 150, "batch"))
        .await
        .expect("the uninterrupted run");
    assert_eq!(alone.token_ids.len(), 150);

    assert_eq!(
        resumed.token_ids, alone.token_ids,
        "the paused stream's tokens differ from its uninterrupted run's"
    );
    assert_eq!(resumed.text, alone.text);
    let counter = |name: &str| sample(&decode, name).unwrap_or(0.0);
    assert!(
        counter("tandem_decode_preemptions_total") >= 1.0,
        "no stream was paused:\n{decode}"
    );
    assert!(
        counter("tandem_decode_parked_disk_bytes_total") > 0.0,
        "nothing was parked on disk:\n{decode}"
    );
    // Every step of the interactive stream left the paused batch stream out.
    assert!(
        counter("tandem_decode_held_back_steps_total") >= 23.0,
        "the steps beside the interactive stream are not counted:\n{decode}"
    );
    assert_eq!(
        counter("tandem_decode_held_back_rows_total"),
        counter("tandem_decode_held_back_steps_total"),
        "one batch stream held per step"
    );
    let after = metrics(cluster.decode[0].addr).await.expect("metrics");
    let counter = |name: &str| sample(&after, name).unwrap_or(0.0);
    assert!(
        counter("tandem_decode_resume_seconds_count") >= 1.0,
        "no resume was counted:\n{after}"
    );
    assert_eq!(
        counter("tandem_decode_recomputed_tokens_total"),
        0.0,
        "a resume computed tokens again:\n{after}"
    );
    assert_eq!(counter("tandem_decode_parked_streams"), 0.0);
    cluster.stop().await.expect("stop");
}
