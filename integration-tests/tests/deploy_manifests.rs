//! The deployment files parse and say what the docs promise: the compose file (format 2.4,
//! router after healthy workers, 1 s healthchecks through `tandem healthcheck`, pinned CPUs)
//! and the Kubernetes manifests (a Deployment per role with gRPC probes and resource requests,
//! headless Services the router discovers the workers through). No cluster is needed; the
//! chaos suite (`scripts/chaos.sh`) runs the compose file for real.

use std::path::PathBuf;

use serde_norway::Value;

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn documents(path: &PathBuf) -> Vec<Value> {
    let text = std::fs::read_to_string(path).expect("read");
    serde_norway::Deserializer::from_str(&text)
        .map(|d| {
            serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .collect()
}

fn s<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| &v[*k])
}

#[test]
fn the_compose_file_runs_healthy_workers_before_the_router() {
    let mut compose = documents(&deploy().join("docker-compose.yml")).remove(0);
    // The workers share their settings through a YAML merge key (`<<: *worker`).
    compose.apply_merge().expect("merge keys");
    assert_eq!(compose["version"].as_str(), Some("2.4"));
    let services = &compose["services"];
    for (name, port) in [
        ("prefill", 50052),
        ("decode", 50053),
        ("router", 50051),
        ("router-2", 50051),
    ] {
        let svc = &services[name];
        let check: Vec<&str> = s(svc, &["healthcheck", "test"])
            .as_sequence()
            .unwrap_or_else(|| panic!("{name} has a healthcheck"))
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(&check[..3], ["CMD", "/tandem", "healthcheck"], "{name}");
        assert!(
            check.contains(&format!("127.0.0.1:{port}").as_str()),
            "{name}"
        );
        assert_eq!(s(svc, &["healthcheck", "interval"]).as_str(), Some("1s"));
        // The router's container has TANDEM_TLS_DIR for its calls to the workers, but its
        // client port is plaintext: its check must not speak the nodes' mutual TLS.
        let router = name.starts_with("router");
        assert_eq!(check.contains(&"--plaintext"), router, "{name}");
    }
    for worker in ["prefill", "decode"] {
        let svc = &services[worker];
        assert_eq!(svc["scale"].as_u64(), Some(2), "{worker}");
        assert!(svc["cpuset"].as_str().is_some(), "{worker} is pinned");
        let volumes = svc["volumes"].as_sequence().expect("volumes");
        assert!(
            volumes
                .iter()
                .filter_map(Value::as_str)
                .any(|v| v.ends_with(":/models:ro")),
            "{worker} mounts the model read-only"
        );
        for router in ["router", "router-2"] {
            assert_eq!(
                s(&services[router], &["depends_on", worker, "condition"]).as_str(),
                Some("service_healthy")
            );
        }
    }
    // Every node speaks mutual TLS with the certificates mounted read-only.
    for name in ["prefill", "decode", "router", "router-2"] {
        let svc = &services[name];
        assert_eq!(
            s(svc, &["environment", "TANDEM_TLS_DIR"]).as_str(),
            Some("/certs"),
            "{name}"
        );
        let volumes = svc["volumes"].as_sequence().expect("volumes");
        assert!(
            volumes
                .iter()
                .filter_map(Value::as_str)
                .any(|v| v.ends_with(":/certs:ro")),
            "{name} mounts the certificates read-only"
        );
    }
    // Two routers over the same workers, each the other's peer, on ports of their own.
    let mut published = Vec::new();
    for router in ["router", "router-2"] {
        let env = &services[router]["environment"];
        assert_eq!(env["TANDEM_PREFILL"].as_str(), Some("prefill:50052"));
        assert_eq!(env["TANDEM_DECODE"].as_str(), Some("decode:50053"));
        assert_eq!(env["TANDEM_PEER_LISTEN"].as_str(), Some("0.0.0.0:50060"));
        assert_eq!(
            env["TANDEM_PEERS"].as_str(),
            Some("router:50060,router-2:50060")
        );
        published.extend(
            format!("{:?}", services[router]["ports"])
                .split(',')
                .map(str::to_string),
        );
    }
    let distinct: std::collections::HashSet<&String> = published.iter().collect();
    assert_eq!(distinct.len(), published.len(), "{published:?}");
}

/// The disk tier's file, given after the main one: each worker role gets a named volume of its
/// own at `/kv`, and the tier's directory there.
#[test]
fn the_kv_spill_file_gives_each_role_a_kept_tier() {
    let compose = documents(&deploy().join("docker-compose.kv-spill.yml")).remove(0);
    assert_eq!(compose["version"].as_str(), Some("2.4"));
    for role in ["prefill", "decode"] {
        let svc = &compose["services"][role];
        let volume = format!("kv-{role}");
        let volumes = format!("{:?}", svc["volumes"]);
        assert!(
            volumes.contains(&format!("{volume}:/kv")),
            "{role}: {volumes}"
        );
        assert!(
            compose["volumes"].get(&volume).is_some(),
            "{volume} is declared"
        );
        assert_eq!(
            s(svc, &["environment", "TANDEM_KV_SPILL_DIR"]).as_str(),
            Some("/kv")
        );
    }
}

/// The second model's file, given after the main one: its nodes are checked and mounted as the
/// first model's, and the router lists them after the first model's and waits for them.
#[test]
fn the_two_models_file_adds_a_second_models_nodes() {
    let mut compose = documents(&deploy().join("docker-compose.two-models.yml")).remove(0);
    compose.apply_merge().expect("merge keys");
    assert_eq!(compose["version"].as_str(), Some("2.4"));
    let services = &compose["services"];
    for (name, role, port) in [
        ("prefill-b", "prefill", 50052),
        ("decode-b", "decode", 50053),
    ] {
        let svc = &services[name];
        let command: Vec<&str> = (svc["command"].as_sequence())
            .unwrap_or_else(|| panic!("{name} has a command"))
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(
            command,
            [role, "--model", "${TANDEM_MODEL_B:-gemma-3-270m}"],
            "{name}"
        );
        let check = format!("{:?}", s(svc, &["healthcheck", "test"]));
        assert!(check.contains(&format!("127.0.0.1:{port}")), "{name}");
        let volumes = format!("{:?}", svc["volumes"]);
        assert!(
            volumes.contains(":/models:ro") && volumes.contains(":/certs:ro"),
            "{name}"
        );
        assert_eq!(
            s(svc, &["environment", "TANDEM_TLS_DIR"]).as_str(),
            Some("/certs")
        );
        for router in ["router", "router-2"] {
            assert_eq!(
                s(&services[router], &["depends_on", name, "condition"]).as_str(),
                Some("service_healthy")
            );
        }
    }
    for router in ["router", "router-2"] {
        let env = &services[router]["environment"];
        assert_eq!(
            env["TANDEM_PREFILL"].as_str(),
            Some("prefill:50052,prefill-b:50052")
        );
        assert_eq!(
            env["TANDEM_DECODE"].as_str(),
            Some("decode:50053,decode-b:50053")
        );
    }
}

#[test]
fn the_kubernetes_manifests_have_probes_requests_and_headless_services() {
    let mut docs = Vec::new();
    for file in ["models.yaml", "prefill.yaml", "decode.yaml", "router.yaml"] {
        docs.extend(documents(&deploy().join("k8s").join(file)));
    }
    for d in &docs {
        assert!(d["apiVersion"].as_str().is_some(), "{d:?}");
        assert!(s(d, &["metadata", "name"]).as_str().is_some(), "{d:?}");
    }
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| {
                d["kind"].as_str() == Some(kind)
                    && s(d, &["metadata", "name"]).as_str() == Some(name)
            })
            .unwrap_or_else(|| panic!("{kind} {name}"))
    };
    for (role, port) in [("prefill", 50052), ("decode", 50053), ("router", 50051)] {
        let deployment = find("Deployment", &format!("tandem-{role}"));
        let spec = s(deployment, &["spec", "template", "spec"]);
        let container = &spec["containers"][0];
        assert_eq!(container["image"].as_str(), Some("tandem:latest"));
        assert_eq!(container["args"][0].as_str(), Some(role));
        for probe in ["readinessProbe", "livenessProbe"] {
            if role == "router" {
                // The client port is plaintext: the kubelet's own gRPC probe.
                assert_eq!(
                    s(container, &[probe, "grpc", "port"]).as_u64(),
                    Some(port),
                    "{role} {probe}"
                );
            } else {
                // Workers speak mutual TLS, which the kubelet's gRPC probe cannot: the image's
                // health check, with the certificates from TANDEM_TLS_DIR.
                let command: Vec<&str> = s(container, &[probe, "exec", "command"])
                    .as_sequence()
                    .unwrap_or_else(|| panic!("{role} {probe} runs a command"))
                    .iter()
                    .filter_map(Value::as_str)
                    .collect();
                assert_eq!(&command[..2], ["/tandem", "healthcheck"], "{role} {probe}");
                assert!(command.contains(&format!("127.0.0.1:{port}").as_str()));
            }
        }
        // Every node has the certificates, from the tandem-certs Secret.
        let env = container["env"].as_sequence().expect("env");
        assert!(
            env.iter()
                .any(|e| e["name"].as_str() == Some("TANDEM_TLS_DIR")
                    && e["value"].as_str() == Some("/certs")),
            "{role} names its TLS directory"
        );
        let mounted = container["volumeMounts"]
            .as_sequence()
            .expect("volume mounts")
            .iter()
            .any(|m| {
                m["mountPath"].as_str() == Some("/certs") && m["readOnly"].as_bool() == Some(true)
            });
        assert!(mounted, "{role} mounts the certificates read-only");
        let secret = spec["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .any(|v| s(v, &["secret", "secretName"]).as_str() == Some("tandem-certs"));
        assert!(
            secret,
            "{role}'s certificates come from the tandem-certs Secret"
        );
        assert!(
            s(container, &["resources", "requests", "cpu"])
                .as_str()
                .is_some()
        );
        assert!(
            s(container, &["resources", "requests", "memory"])
                .as_str()
                .is_some()
        );
        // The Deployment's pods are what its Service selects.
        let labels = s(deployment, &["spec", "template", "metadata", "labels"]);
        let service = find("Service", &format!("tandem-{role}"));
        assert_eq!(&service["spec"]["selector"], labels, "{role}");
        if role != "router" {
            assert_eq!(
                s(service, &["spec", "clusterIP"]).as_str(),
                Some("None"),
                "{role} is headless"
            );
        }
    }
    let router = s(
        find("Deployment", "tandem-router"),
        &["spec", "template", "spec", "containers"],
    );
    let env: Vec<(&str, &str)> = router[0]["env"]
        .as_sequence()
        .expect("env")
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?, e["value"].as_str()?)))
        .collect();
    assert!(env.contains(&("TANDEM_PREFILL", "tandem-prefill:50052")));
    assert!(env.contains(&("TANDEM_DECODE", "tandem-decode:50053")));
    // The router replicas find each other through a headless Service of their peer ports.
    assert!(env.contains(&("TANDEM_PEER_LISTEN", "0.0.0.0:50060")));
    assert!(env.contains(&("TANDEM_PEERS", "tandem-router-peers:50060")));
    let peers = find("Service", "tandem-router-peers");
    assert_eq!(s(peers, &["spec", "clusterIP"]).as_str(), Some("None"));
    assert_eq!(
        s(peers, &["spec", "ports"])[0]["port"].as_u64(),
        Some(50060)
    );
    assert_eq!(
        s(peers, &["spec", "selector"]),
        s(
            find("Deployment", "tandem-router"),
            &["spec", "template", "metadata", "labels"]
        )
    );
}
