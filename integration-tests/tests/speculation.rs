//! Speculative decoding through the cluster, on the real model: the decode node's speculation
//! changes no token, its frames carry several tokens where drafts were accepted (with indices
//! still gap-free), and the final frame and the metrics report what was drafted and accepted.

use tandem_engine::{EngineConfig, SpeculateConfig};
use tandem_integration_tests::{Cluster, ClusterConfig, collect, metrics, sample, smollm2_model};
use tandem_proto::v1 as pb;

fn copy_request() -> pb::GenerateRequest {
    pb::GenerateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "Continue this list in the same format up to item 12.\n\n1. Apple - a red \
                      fruit that grows on trees.\n2. Banana - a yellow fruit that grows on \
                      plants.\n3. Cherry - a red fruit that grows on trees.\n4. Grape - a green \
                      fruit that grows on vines.\n5. Lemon - a yellow fruit that grows on trees."
                .into(),
            ..Default::default()
        }],
        sampling: Some(pb::SamplingParams {
            max_tokens: 96,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn run(speculate: SpeculateConfig) -> (tandem_integration_tests::Collected, String) {
    let model = smollm2_model().expect("the real model (tandem model fetch)");
    let base = ClusterConfig::new(model);
    let cluster = Cluster::start(ClusterConfig {
        engine: EngineConfig {
            speculate,
            ..base.engine.clone()
        },
        ..base
    })
    .await
    .expect("cluster");
    let out = collect(&mut cluster.client(), copy_request())
        .await
        .expect("generation");
    let text = metrics(cluster.decode[0].addr).await.expect("metrics");
    cluster.stop().await.expect("stop");
    (out, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_streams_several_tokens_a_frame_and_changes_none() {
    let (off, off_metrics) = run(SpeculateConfig::off()).await;
    let (on, on_metrics) = run(SpeculateConfig::on()).await;
    assert_eq!(on.token_ids, off.token_ids);
    assert_eq!(on.text, off.text);
    assert!(on.token_ids.len() > 20, "{:?}", on.text);

    // Off: a frame per token (the last may carry only the end). On: fewer frames than tokens.
    assert!(off.frames >= off.token_ids.len(), "{} frames", off.frames);
    assert!(
        on.frames < on.token_ids.len(),
        "{} frames for {} tokens",
        on.frames,
        on.token_ids.len()
    );

    let timings = |c: &tandem_integration_tests::Collected| c.last.timings.expect("timings");
    assert_eq!(timings(&off).draft_tokens, 0);
    let t = timings(&on);
    assert!(
        t.accepted_draft_tokens > 0 && t.accepted_draft_tokens <= t.draft_tokens,
        "{t:?}"
    );
    let counter = |text: &str, name: &str| sample(text, name).unwrap_or_default();
    assert_eq!(
        counter(&off_metrics, "tandem_decode_draft_tokens_total"),
        0.0
    );
    assert_eq!(
        counter(&on_metrics, "tandem_decode_draft_tokens_total"),
        f64::from(t.draft_tokens)
    );
    assert_eq!(
        counter(&on_metrics, "tandem_decode_accepted_draft_tokens_total"),
        f64::from(t.accepted_draft_tokens)
    );
    assert_eq!(
        counter(&on_metrics, "tandem_decode_tokens_total"),
        counter(&off_metrics, "tandem_decode_tokens_total")
    );
}
