//! `n` choices of one request through a cluster: the prompt is computed once (the later choices
//! reuse its KV from the decode node's cache), each choice equals a one-choice request with its
//! own seed (`tandem_proto::choice_seed`), and every choice's frames are gap-free and end with
//! their own final frame.

use tandem_integration_tests::{Cluster, ClusterConfig, collect, collect_choices, metrics, sample};
use tandem_proto::v1 as pb;

const PROMPT: usize = 40;
const CHOICES: u32 = 3;

fn request(prompt: &[u32], seed: u64, n: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        token_ids: prompt.to_vec(),
        n,
        sampling: Some(pb::SamplingParams {
            temperature: 1.0,
            seed,
            max_tokens: 12,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Prompt tokens the cluster has computed: the prefill nodes' and the decode nodes' own.
async fn computed(cluster: &Cluster) -> f64 {
    let mut total = 0.0;
    for (node, counter) in [
        (&cluster.prefill, "tandem_prefill_tokens_total"),
        (&cluster.decode, "tandem_decode_local_prefill_tokens_total"),
    ] {
        for n in node.iter() {
            let text = metrics(n.addr).await.expect("metrics");
            total += sample(&text, counter).unwrap_or(0.0);
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn choices_share_one_prefill_and_each_is_its_own_seeds_run() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let mut client = cluster.client();
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| 3 + (i * 13) % 200).collect();

    let choices = collect_choices(&mut client, request(&prompt, 7, CHOICES), CHOICES as usize)
        .await
        .expect("three choices");
    // The later choices found the prompt's full blocks (all but the last token's block) on the
    // decode node, and computed only the 8 tokens after them.
    let reusable = (PROMPT - 1) / 16 * 16;
    assert_eq!(
        computed(&cluster).await,
        (PROMPT + (CHOICES as usize - 1) * (PROMPT - reusable)) as f64,
        "the prompt is computed once"
    );
    for (i, c) in choices.iter().enumerate() {
        let usage = c.last.usage.as_ref().expect("usage");
        assert_eq!(usage.prompt_tokens as usize, PROMPT);
        assert_eq!(usage.completion_tokens as usize, c.token_ids.len());
        let want = if i == 0 { 0 } else { reusable };
        assert_eq!(usage.decode_cached_tokens as usize, want, "choice {i}");
        assert!(c.last.route.is_some(), "choice {i} has its route");
    }
    assert_ne!(choices[0].token_ids, choices[1].token_ids);
    assert_ne!(choices[1].token_ids, choices[2].token_ids);

    // Each choice is the one-choice request with its seed.
    for (i, c) in choices.iter().enumerate() {
        let seed = tandem_proto::choice_seed(7, i as u32);
        let alone = collect(&mut client, request(&prompt, seed, 1))
            .await
            .expect("one choice");
        assert_eq!(alone.token_ids, c.token_ids, "choice {i}");
        assert_eq!(alone.text, c.text, "choice {i}");
    }
    cluster.stop().await.expect("clean stop");
}
