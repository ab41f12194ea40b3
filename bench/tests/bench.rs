//! The `tandem-bench` binary's contract with the scripts that call it: flags, JSON fields and
//! error messages. Runs on the built-in tiny model.

use std::process::Command;

use serde_json::Value;
use tandem_integration_tests::{Cluster, ClusterConfig};
use tandem_router::auth::key_line;
use tandem_router::{AuthConfig, KeyLimits};

fn bench(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-bench"))
        .args(args)
        .env_remove("TANDEM_MODEL")
        .output()
        .expect("run tandem-bench");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(stdout: &str) -> Value {
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout:?}"))
}

/// `bench fetch` runs end to end: the next turn fetches the whole history from the holder.
#[test]
fn bench_fetch_reports_a_turn_through_a_fetch_against_a_cold_one() {
    let (ok, out, err) = bench(&[
        "fetch",
        "--model",
        "tiny",
        "--runs",
        "2",
        "--history-tokens",
        "48",
        "--turn-tokens",
        "4",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["prompt_tokens"], 52);
    for run in v["runs"].as_array().expect("runs") {
        assert_eq!(run["fetched_tokens"], 48, "{run}");
        assert!(
            run["fetched_bytes"].as_u64().is_some_and(|b| b > 0),
            "{run}"
        );
    }
    assert!(v["ratio"].as_f64().is_some_and(|r| r > 0.0), "{v}");
    let (ok, _, err) = bench(&["fetch", "--model", "tiny", "--history-tokens", "8"]);
    assert!(!ok && err.contains("--history-tokens"), "{err}");
}

#[test]
fn bench_engine_json_shape() {
    let (ok, out, err) = bench(&[
        "engine",
        "--model",
        "tiny",
        "--prompt-tokens",
        "64",
        "--gen-tokens",
        "8",
        "--batch",
        "1,3",
        "--context-tokens",
        "40",
        "--kv-dtype",
        "f16,q8",
        "--kv-budget-mb",
        "16",
        "--runs",
        "1",
        "--threads",
        "1",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["threads"], 1);
    assert_eq!(v["context_tokens"], 40);
    let kv = v["kv"].as_array().expect("kv");
    assert_eq!(kv.len(), 2);
    for (k, dtype) in kv.iter().zip(["f16", "q8"]) {
        assert_eq!(k["kv_dtype"], dtype);
        assert!(k["prefill_tok_s"].as_f64().expect("prefill") > 0.0);
        let decode = k["decode"].as_array().expect("decode");
        assert_eq!(decode.len(), 2);
        assert_eq!(decode[1]["batch"], 3);
        assert!(decode[1]["tok_s"].as_f64().expect("tok_s") > 0.0);
    }
    let num = |i: usize, f: &str| kv[i][f].as_f64().expect(f);
    // q8 rows are head_dim + 2 bytes against f16's 2·head_dim: a little over half.
    let ratio = num(1, "kv_bytes_per_token") / num(0, "kv_bytes_per_token");
    assert!((0.5..0.6).contains(&ratio), "{ratio}");
    assert!(num(1, "pool_sequences") > num(0, "pool_sequences") * 1.6);
}

/// `bench fidelity` compares the dtypes on a fixture file (here one made for the tiny model) and
/// refuses fixtures of another model by name.
#[test]
fn bench_fidelity_compares_kv_dtypes() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fidelity-fixtures");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("smollm2-greedy.jsonl"),
        r#"{"prompt_text":"x","prompt_token_ids":[5,6,7,8],"generated_token_ids":[9,10,11],"first_position_logits":{"top20":[[9,1.5],[10,0.5]]}}"#,
    )
    .expect("fixture");
    let fixtures = dir.display().to_string();
    let args = ["fidelity", "--model", "tiny", "--fixtures", &fixtures];
    let (ok, out, err) = bench(&[&args[..], &["--long-tokens", "4", "--json"]].concat());
    assert!(ok, "{err}");
    let v = json(&out);
    let runs = v["fixtures"][0]["runs"].as_array().expect("runs");
    assert_eq!(
        (&runs[0]["kv_dtype"], &runs[1]["kv_dtype"]),
        (&"f16".into(), &"q8".into())
    );
    assert!(runs[0]["vs_first"].is_null());
    assert_eq!(runs[1]["vs_first"]["of"], 3);
    let long = v["long"].as_array().expect("long");
    assert!(!long.is_empty());
    for l in long {
        let q8 = &l["vs_first"][0];
        assert_eq!(q8["kv_dtype"], "q8");
        let agree = q8["top1_agreement"].as_f64().expect("agreement");
        assert!((0.0..=1.0).contains(&agree), "{agree}");
    }

    std::fs::write(
        dir.join("smollm2-greedy.jsonl"),
        r#"{"prompt_text":"x","prompt_token_ids":[9690],"generated_token_ids":[9],"first_position_logits":{"top20":[[9,1.5]]}}"#,
    )
    .expect("fixture");
    let (ok, _, err) = bench(&args);
    assert!(!ok);
    assert!(err.contains("belong to another model"), "{err}");
}

/// `tandem-bench serve` drives a running cluster (the harness's, on the tiny model, requiring an
/// API key) over gRPC and over its OpenAI HTTP API with `--api-key` and reports every figure;
/// `plot` draws both; `transfer` measures the KV push.
#[test]
fn bench_serve_drives_both_apis_and_plots() {
    // The cluster's servers run on the runtime's threads while this one runs the benchmark.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-serve");
    std::fs::create_dir_all(&dir).expect("dir");
    let key = "tk-bench";
    let keys = dir.join("keys");
    let line = key_line("bench", key, KeyLimits::default());
    std::fs::write(&keys, format!("{line}\n")).expect("key file");
    let config = ClusterConfig {
        auth: AuthConfig {
            key_file: Some(keys),
            ..AuthConfig::default()
        },
        ..ClusterConfig::new(model)
    };
    let cluster = rt.block_on(Cluster::start(config)).expect("cluster");
    let grpc = cluster.router.addr.to_string();
    let http = format!("http://{}", cluster.http);
    let common = [
        "serve",
        "--concurrency",
        "1,2",
        "--requests",
        "3",
        "--max-tokens",
        "4",
        "--prompt-words",
        "20",
        "--warmup",
        "1",
        "--seed",
        "1",
        "--json",
    ];
    for (flag, target, label) in [
        ("--server", grpc.as_str(), "grpc"),
        ("--openai", http.as_str(), "http"),
    ] {
        let out_file = dir.join(format!("{label}.json"));
        let out_path = out_file.to_str().expect("utf-8");
        let (ok, out, err) = bench(
            &[
                &common[..],
                &[flag, target, "--api-key", key, "--label", label],
                &["--out", out_path],
            ]
            .concat(),
        );
        assert!(ok, "{label}: {err}");
        let v = json(&out);
        assert_eq!(v, json(&std::fs::read_to_string(&out_file).expect("--out")));
        let levels = v["levels"].as_array().expect("levels");
        assert_eq!(levels.len(), 2, "two concurrency levels");
        for l in levels {
            assert_eq!(l["completed"], 3, "{l}");
            assert!(l["ttft_ms"]["p50"].as_f64().is_some_and(|x| x > 0.0), "{l}");
            assert!(l["itl_ms"]["p99"].as_f64().is_some_and(|x| x > 0.0), "{l}");
            assert!(l["output_tok_s"].as_f64().is_some_and(|x| x > 0.0), "{l}");
            assert_eq!(l["samples"]["ttft_ms"].as_array().map(Vec::len), Some(3));
            // The router's own timings come only with gRPC.
            assert_eq!(l["tandem"].is_object(), label == "grpc", "{l}");
        }
    }
    let plots = dir.join("plots");
    let (ok, out, err) = bench(&[
        "plot",
        dir.join("grpc.json").to_str().expect("utf-8"),
        dir.join("http.json").to_str().expect("utf-8"),
        "--out",
        plots.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{err}");
    for name in ["ttft_cdf", "itl_cdf", "frontier"] {
        for ext in ["png", "svg"] {
            let f = plots.join(format!("{name}.{ext}"));
            assert!(out.contains(f.to_str().expect("utf-8")), "{out}");
            let bytes = std::fs::read(&f).expect("plot written");
            match ext {
                "png" => assert!(bytes.starts_with(b"\x89PNG"), "{}", f.display()),
                _ => {
                    // One line per system, its levels named.
                    let svg = String::from_utf8_lossy(&bytes);
                    for text in ["grpc", "http", "c=2"] {
                        assert!(svg.contains(text), "{} lacks {text}", f.display());
                    }
                }
            }
        }
    }
    rt.block_on(cluster.stop())
        .expect("the cluster stops cleanly");

    let (ok, out, err) = bench(&[
        "transfer",
        "--model",
        "tiny",
        "--tokens",
        "300",
        "--runs",
        "2",
        "--threads",
        "1",
        "--kv-dtype",
        "f16,q8",
        "--json",
    ]);
    assert!(ok, "{err}");
    // One object per dtype; q8 sends a little over half of f16's bytes.
    let runs: Vec<Value> = out.lines().map(json).collect();
    assert_eq!(runs.len(), 2, "{out}");
    for (t, dtype) in runs.iter().zip(["f16", "q8"]) {
        assert_eq!(t["kv_dtype"], dtype);
        assert_eq!(t["tokens"], 300);
        assert!(t["grpc_mb_s"].as_f64().is_some_and(|x| x > 0.0) && t["ratio"].as_f64().is_some());
        assert!(t["grpc_ms"].as_f64().is_some_and(|x| x > 0.0));
    }
    let bytes = |r: &Value| r["bytes"].as_f64().expect("bytes");
    let ratio = bytes(&runs[1]) / bytes(&runs[0]);
    assert!((0.5..0.6).contains(&ratio), "{ratio}");
}
