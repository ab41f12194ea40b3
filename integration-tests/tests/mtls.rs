//! Mutual TLS between the nodes: a cluster whose every internal hop is TLS serves as before
//! (router to workers, prefill to decode's KvTransfer), and each role may call only what it
//! needs. A peer without a certificate from the cluster's CA is refused at the handshake: no
//! call of its reaches the node, which the node's own call counter shows.

use std::path::{Path, PathBuf};

use tandem_integration_tests::{
    Cluster, ClusterConfig, collect, greedy, metrics_over, sample, stray_push,
};
use tandem_net::tls::{Role, Tls, write_dev_certs};
use tandem_proto::v1 as pb;
use tonic::Code;
use tonic::transport::Channel;

fn certs(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("mtls-{name}-{}", std::process::id()));
    write_dev_certs(&dir, &[], 1).expect("certificates");
    dir
}

fn channel(addr: std::net::SocketAddr, dir: &Path, role: Role) -> Channel {
    let tls = Tls::load(dir, role).expect("tls files");
    tandem_net::channel(&addr.to_string(), Some(tls.client_config())).expect("channel")
}

async fn load(channel: Channel) -> Result<pb::LoadResponse, tonic::Status> {
    let mut worker = pb::worker_client::WorkerClient::new(channel);
    worker
        .load(pb::LoadRequest {})
        .await
        .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_speak_mutual_tls_and_each_role_calls_only_what_it_needs() {
    let dir = certs("cluster");
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let cluster = Cluster::start(ClusterConfig {
        tls_dir: Some(dir.clone()),
        ..ClusterConfig::new(model.clone())
    })
    .await
    .expect("cluster");

    // A generation crosses every hop: router to decode and prefill, prefill's KV push to decode.
    let out = collect(&mut cluster.client(), greedy(vec![5, 6, 7, 8, 9, 10], 4))
        .await
        .expect("a generation over TLS");
    let route = out.last.route.expect("route");
    assert_eq!(route.disaggregation, "remote", "{route:?}");
    assert!(!route.prefill.is_empty());
    let plain = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let same = collect(&mut plain.client(), greedy(vec![5, 6, 7, 8, 9, 10], 4))
        .await
        .expect("plaintext");
    assert_eq!(out.token_ids, same.token_ids);
    // Tandem's own clients can tell a port that needs TLS from one that does not.
    let probe = std::time::Duration::from_secs(2);
    let plain_decode = plain.decode[0].addr.to_string();
    assert!(!tandem_net::requires_tls(&plain_decode, probe).await);
    plain.stop().await.expect("stop");

    let (prefill, decode) = (cluster.prefill[0].addr, cluster.decode[0].addr);
    // The router may read a worker's load; a client's certificate may not.
    assert!(load(channel(decode, &dir, Role::Router)).await.is_ok());
    let denied = load(channel(decode, &dir, Role::Client))
        .await
        .expect_err("a client reading a worker's load");
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(
        denied
            .message()
            .contains("client may not call tandem.v1.Worker")
    );

    // A decode node's certificate cannot ask for a prefill.
    let mut p = pb::prefill_client::PrefillClient::new(channel(prefill, &dir, Role::Decode));
    let denied = p
        .prefill(pb::PrefillRequest {
            request_id: "r".into(),
            transfer_id: "t".into(),
            token_ids: vec![5, 6, 7],
            decode_addr: decode.to_string(),
            ..Default::default()
        })
        .await
        .expect_err("decode calling Prefill");
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");

    // Neither a client's nor the router's certificate can push KV; health is open to all roles.
    for role in [Role::Client, Role::Router] {
        match stray_push(channel(decode, &dir, role), "t").await {
            tandem_transfer::Error::Transport { code, .. } => {
                assert_eq!(code, Code::PermissionDenied, "{role:?}")
            }
            other => panic!("{role:?}: {other}"),
        }
    }
    let mut health =
        tonic_health::pb::health_client::HealthClient::new(channel(decode, &dir, Role::Client));
    let serving = health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health over TLS")
        .into_inner();
    assert_eq!(serving.status, 1, "SERVING");

    // The role refusals above reached the node's authorization and were counted there.
    let text = metrics_over(channel(decode, &dir, Role::Client))
        .await
        .expect("metrics over TLS");
    let kv_calls = |text: &str, role: &str, outcome: &str| {
        sample(
            text,
            &format!(
                "tandem_node_calls_total{{service=\"tandem.v1.KvTransfer\",role=\"{role}\",outcome=\"{outcome}\"}}"
            ),
        )
    };
    assert_eq!(kv_calls(&text, "client", "refused"), Some(1.0), "{text}");
    assert_eq!(kv_calls(&text, "router", "refused"), Some(1.0), "{text}");
    let before = kv_pushes(&text);

    // No certificate, or one from another CA (with the one role that may push KV): the handshake
    // refuses the peer, so no call reaches the node. How the client library reports that varies
    // (UNAVAILABLE, CANCELLED, UNKNOWN "transport error", or an HTTP/2 protocol error when it
    // reads the TLS alert as a frame); what must hold is that the push fails and the node
    // counted no call.
    let plaintext = tandem_net::channel(&decode.to_string(), None).expect("channel");
    stray_push(plaintext, "plaintext").await;
    let stranger = certs("stranger");
    stray_push(channel(decode, &stranger, Role::Prefill), "stranger").await;
    let text = metrics_over(channel(decode, &dir, Role::Client))
        .await
        .expect("metrics over TLS");
    assert_eq!(kv_pushes(&text), before, "{text}");
    assert!(tandem_net::requires_tls(&decode.to_string(), probe).await);
    cluster.stop().await.expect("stop");
}

/// Every KvTransfer call the node counted, whoever made it and however it ended.
fn kv_pushes(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("tandem_node_calls_total{service=\"tandem.v1.KvTransfer\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as usize)
        .sum()
}

#[test]
fn every_certificate_names_exactly_its_role() {
    let dir = certs("roles");
    for role in Role::ALL {
        let pem = std::fs::read_to_string(dir.join(format!("{}.pem", role.name()))).expect("pem");
        let der = pem_to_der(&pem);
        assert_eq!(tandem_net::tls::peer_role(&der), Some(role));
        use std::os::unix::fs::PermissionsExt;
        let key = std::fs::metadata(dir.join(format!("{}.key", role.name()))).expect("key");
        assert_eq!(
            key.permissions().mode() & 0o077,
            0,
            "{role:?}'s key is owner-only"
        );
    }
    let ca = pem_to_der(&std::fs::read_to_string(dir.join("ca.pem")).expect("ca"));
    assert_eq!(tandem_net::tls::peer_role(&ca), None, "the CA is no node");
}

/// The DER inside a one-certificate PEM file.
fn pem_to_der(pem: &str) -> Vec<u8> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).expect("PEM");
    pem.contents
}
