//! Peer fetch, called directly: a decode node fetches the KV of a prompt's first tokens from the
//! peer whose session cache holds them, or from the prefill node whose prefix cache does,
//! computes only what follows, and says exactly what the holder said; a holder that cannot be
//! reached costs the fetch and nothing else (the tokens are computed).

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy, metrics, sample};
use tandem_proto::v1 as pb;

fn request(prompt: &[u32], fetch_addr: String, fetch_tokens: u32) -> pb::DecodeRequest {
    pb::DecodeRequest {
        request_id: format!("fetch-{:08x}", rand::random::<u32>()),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(pb::SamplingParams {
            max_tokens: 12,
            ignore_eos: true,
            ..Default::default()
        }),
        local_prefill: true,
        fetch_addr,
        fetch_tokens,
        ..Default::default()
    }
}

/// The admission and the tokens of one direct decode call.
async fn decode(
    node: &tandem_integration_tests::Node,
    r: pb::DecodeRequest,
) -> (pb::DecodeAdmitted, Vec<u32>) {
    let mut client = pb::decode_client::DecodeClient::new(node.channel());
    let mut frames = client.generate(r).await.expect("generate").into_inner();
    let mut admitted = None;
    let mut tokens = Vec::new();
    while let Some(f) = frames.message().await.expect("frame") {
        match f.event {
            Some(pb::decode_response::Event::Admitted(a)) => admitted = Some(a),
            Some(pb::decode_response::Event::Tokens(t)) => tokens.extend(t.token_ids),
            None => {}
        }
    }
    (admitted.expect("admitted"), tokens)
}

/// A cluster of the tiny model: a prefill node and two decode nodes.
async fn two_decode_nodes() -> Cluster {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    Cluster::start(ClusterConfig {
        decode: 2,
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_node_fetches_a_prompt_from_the_peer_that_holds_it() {
    let cluster = two_decode_nodes().await;
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 13) % 200).collect();
    let (holder, fetcher) = (&cluster.decode[0], &cluster.decode[1]);

    let (first, want) = decode(holder, request(&prompt, String::new(), 0)).await;
    assert_eq!(first.cached_tokens, 0);

    // The holder keeps the prompt's 4 whole blocks; the fetcher asks for them.
    let (admitted, got) = decode(fetcher, request(&prompt, holder.addr.to_string(), 64)).await;
    assert_eq!(admitted.fetched_tokens, 64, "{admitted:?}");
    assert_eq!(admitted.cached_tokens, 64);
    assert!(admitted.fetched_bytes > 0 && admitted.fetch_ms > 0.0);
    assert_eq!(got, want, "the same tokens as the holder's");
    let text = metrics(fetcher.addr).await.expect("metrics");
    assert_eq!(
        sample(&text, "tandem_decode_fetched_tokens_total"),
        Some(64.0)
    );
    assert_eq!(
        sample(&text, "tandem_decode_local_prefill_tokens_total"),
        Some(6.0)
    );
    let text = metrics(holder.addr).await.expect("metrics");
    assert_eq!(
        sample(&text, "tandem_kv_fetch_served_bytes_total"),
        Some(admitted.fetched_bytes as f64)
    );

    // Asked for more than it holds, a holder sends what it has; a holder nobody can reach
    // costs only the fetch.
    let other: Vec<u32> = prompt.iter().map(|t| t + 1).collect();
    let (admitted, _) = decode(fetcher, request(&other, holder.addr.to_string(), 64)).await;
    assert_eq!((admitted.fetched_tokens, admitted.cached_tokens), (0, 0));
    let (admitted, got) = decode(fetcher, request(&prompt, "127.0.0.1:1".into(), 64)).await;
    assert_eq!(admitted.fetched_tokens, 0);
    assert_eq!(
        admitted.cached_tokens, 64,
        "its own cache holds the prompt now"
    );
    assert_eq!(got, want);
    let text = metrics(fetcher.addr).await.expect("metrics");
    assert_eq!(
        sample(&text, "tandem_decode_fetch_failures_total"),
        Some(1.0)
    );
    cluster.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_node_fetches_a_prompt_from_a_prefill_nodes_prefix_cache() {
    let cluster = two_decode_nodes().await;
    let prompt: Vec<u32> = (0..70).map(|i| 5 + (i * 11) % 200).collect();
    // Through the router, a cold prompt is computed on the prefill node, which keeps its 4
    // whole blocks in its prefix cache.
    let mut through = greedy(prompt.clone(), 12);
    if let Some(s) = through.sampling.as_mut() {
        s.ignore_eos = true;
    }
    let want = collect(&mut cluster.client(), through)
        .await
        .expect("generate");
    let route = want.last.route.expect("route");
    assert_eq!(route.disaggregation, "remote", "{route:?}");
    let prefill = &cluster.prefill[0];
    let fetcher = cluster
        .decode
        .iter()
        .find(|d| d.addr.to_string() != route.decode)
        .expect("the decode node the prompt did not go to");

    let (admitted, got) = decode(fetcher, request(&prompt, prefill.addr.to_string(), 64)).await;
    assert_eq!(admitted.fetched_tokens, 64, "{admitted:?}");
    assert_eq!(admitted.cached_tokens, 64);
    assert_eq!(got, want.token_ids, "the same tokens as the first run's");
    let text = metrics(prefill.addr).await.expect("metrics");
    assert_eq!(
        sample(&text, "tandem_kv_fetch_served_bytes_total"),
        Some(admitted.fetched_bytes as f64)
    );
    cluster.stop().await.expect("stop");
}
