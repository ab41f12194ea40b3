//! One cluster serving two models: each worker serves one, the router keeps a pool per model
//! (learned from each worker's `Worker.Info`), lists both, sends each request to its own
//! model's nodes, and refuses an unknown model (404 / NOT_FOUND) or, with several served and
//! no default, a request that names none, naming the models served.

use std::time::Duration;

use tandem_engine::{Arch, Engine, EngineConfig, GenerateParams, GenerateRequest, ModelSource};
use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy, metrics, sample};
use tandem_proto::v1 as pb;

fn on(model: &str, mut request: pb::GenerateRequest) -> pb::GenerateRequest {
    request.model = model.to_string();
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_runs_on_its_own_models_nodes() {
    let llama = ModelSource::TINY.load().expect("tiny");
    let gemma = ModelSource::Tiny(Arch::Gemma3).load().expect("tiny gemma3");
    let (llama_id, gemma_id) = (llama.name.clone(), gemma.name.clone());
    let config = ClusterConfig {
        more_models: vec![gemma.clone()],
        ..ClusterConfig::new(llama.clone())
    };
    let cluster = Cluster::start(config).await.expect("cluster");
    // Nodes in model order: the first model's prefill and decode node, then the second's.
    let addr = |nodes: &[tandem_integration_tests::Node], i: usize| nodes[i].addr.to_string();
    let nodes_of = |m: usize| (addr(&cluster.prefill, m), addr(&cluster.decode, m));

    let http = reqwest::Client::new();
    let base = format!("http://{}/v1", cluster.http);
    let listed: serde_json::Value = (http.get(format!("{base}/models")).send().await)
        .expect("GET /v1/models")
        .json()
        .await
        .expect("json");
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    // By id: "tiny" before "tiny-gemma3".
    assert_eq!(ids, [llama_id.as_str(), gemma_id.as_str()], "{listed}");

    // Each model's requests go to its own prefill and decode nodes, and get what its engine
    // alone gives.
    let mut client = cluster.client();
    let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 11) % 200).collect();
    for (m, model) in [&llama, &gemma].into_iter().enumerate() {
        let got = collect(&mut client, on(&model.name, greedy(prompt.clone(), 8)))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", model.name));
        let route = got.last.route.clone().expect("a route");
        assert_eq!(
            (route.prefill, route.decode),
            nodes_of(m),
            "{} ran on its own nodes",
            model.name
        );
        let mut engine =
            Engine::new(model.clone(), EngineConfig::default()).expect("an engine alone");
        let alone = engine
            .generate_batch(&[GenerateRequest {
                prompt: prompt.clone(),
                params: GenerateParams {
                    max_tokens: 8,
                    ..GenerateParams::default()
                },
            }])
            .expect("local generation");
        assert_eq!(
            got.token_ids, alone[0].token_ids,
            "{}'s own output",
            model.name
        );
    }
    // Per-model metrics count each model's request (once its generation task has ended, which
    // may be just after the client read its last frame).
    let oks = [&llama_id, &gemma_id]
        .map(|id| format!("tandem_model_requests_total{{model=\"{id}\",code=\"Ok\"}}"));
    let started = std::time::Instant::now();
    let text = loop {
        let text = metrics(cluster.router.addr).await.expect("metrics");
        if oks.iter().all(|ok| sample(&text, ok) == Some(1.0)) {
            break text;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{oks:?}:\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    for id in [&llama_id, &gemma_id] {
        let up = format!("tandem_router_model_replicas{{model=\"{id}\",role=\"decode\"}}");
        assert_eq!(sample(&text, &up), Some(1.0), "{up}");
        // Idle, each role of each model wants the one replica it has.
        for role in ["prefill", "decode"] {
            let desired =
                format!("tandem_router_desired_replicas{{model=\"{id}\",role=\"{role}\"}}");
            assert_eq!(sample(&text, &desired), Some(1.0), "{desired}");
        }
    }

    // An unknown model is NOT_FOUND (HTTP 404 model_not_found), naming the models served; with
    // two served and no default, a request naming none is refused, naming them too.
    let unknown = collect(&mut client, on("gpt-4o", greedy(prompt.clone(), 4)))
        .await
        .expect_err("an unknown model");
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    for id in [&llama_id, &gemma_id] {
        assert!(unknown.message().contains(id.as_str()), "{unknown:?}");
    }
    let unnamed = collect(&mut client, greedy(prompt.clone(), 4))
        .await
        .expect_err("no model named");
    assert_eq!(unnamed.code(), tonic::Code::InvalidArgument, "{unnamed:?}");
    assert!(unnamed.message().contains(&gemma_id), "{unnamed:?}");
    let response = http
        .post(format!("{base}/completions"))
        .json(&serde_json::json!({"model": "gpt-4o", "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 404);
    let body: serde_json::Value = response.json().await.expect("json");
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
    assert_eq!(body["error"]["param"], "model", "{body}");
    let named = http
        .post(format!("{base}/completions"))
        .json(&serde_json::json!({"model": gemma_id, "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("POST");
    assert_eq!(named.status(), 200);
    let body: serde_json::Value = named.json().await.expect("json");
    assert_eq!(body["model"], gemma_id.as_str(), "{body}");

    // One model's nodes gone, the other model is still served; the gone one is UNAVAILABLE.
    let mut cluster = cluster;
    let gemma_decode = cluster.decode.remove(1);
    gemma_decode.stop().await.expect("stop");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let refused = loop {
        match collect(&mut client, on(&gemma_id, greedy(prompt.clone(), 4))).await {
            Err(e) => break e,
            Ok(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(_) => panic!("the second model was still served without its decode node"),
        }
    };
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    collect(&mut client, on(&llama_id, greedy(prompt, 4)))
        .await
        .expect("the first model is still served");
    cluster.stop().await.expect("stop");
}
