//! The `tandem` binary's contract with the tools that call it: flags, JSON fields, exit codes
//! and error messages. Runs on the built-in tiny model.

use std::process::Command;

use serde_json::Value;

fn tandem(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .env_remove("TANDEM_MODEL")
        .output()
        .expect("run tandem");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `tandem up --model tiny` on free ports, stopped (SIGTERM, checked) by [`Up::stop`].
struct Up {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    grpc: String,
    http: String,
    /// Each node's name and gRPC address, as `up` lists them.
    nodes: Vec<(String, String)>,
}

impl Up {
    fn start() -> Self {
        Self::start_with(None, &[])
    }

    /// With `log`, every node logs JSON at debug level into that file; `extra` are more flags
    /// for `tandem up`.
    fn start_with(log: Option<&std::path::Path>, extra: &[&str]) -> Self {
        Self::start_in(log, extra, &[])
    }

    /// [`Up::start_with`], with `env` set for every node. The disk tier is a temporary one
    /// (each test starts cold) unless `extra` names a `--kv-spill` flag.
    fn start_in(log: Option<&std::path::Path>, extra: &[&str], env: &[(&str, &str)]) -> Self {
        use std::io::BufRead;
        let mut command = Command::new(env!("CARGO_BIN_EXE_tandem"));
        command.envs(env.iter().copied());
        match log {
            Some(path) => {
                let file = std::fs::File::create(path).expect("log file");
                command
                    .env("TANDEM_LOG_JSON", "true")
                    .env("RUST_LOG", "debug,h2=warn,tower=warn,hyper=warn,tonic=warn")
                    .stderr(file);
            }
            None => {
                command.stderr(std::process::Stdio::null());
            }
        }
        let mut child = command
            .args([
                "up",
                "--model",
                "tiny",
                "--port",
                "0",
                "--http-port",
                "0",
                "--threads",
                "1",
            ])
            .args(extra)
            .args(
                (!extra.iter().any(|a| a.starts_with("--kv-spill")))
                    .then_some("--kv-spill-temporary"),
            )
            .env_remove("TANDEM_MODEL")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start tandem up");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = std::io::BufReader::new(stdout).lines();
        let mut grpc = None;
        let mut nodes = Vec::new();
        let http = loop {
            let line = lines.next().expect("tandem up exited early").expect("line");
            if let Some(node) = line.strip_prefix("  ") {
                let mut parts = node.split_whitespace();
                if let (Some(name), Some(addr)) = (parts.next(), parts.next()) {
                    nodes.push((name.to_string(), addr.to_string()));
                }
            }
            if let Some(addr) = line.strip_prefix("router (gRPC tandem.v1.Generation): ") {
                grpc = Some(addr.to_string());
            }
            if let Some(url) = line.strip_prefix("router (OpenAI HTTP): ") {
                break url.to_string();
            }
        };
        Self {
            child,
            lines,
            grpc: grpc.expect("the gRPC address is printed first"),
            http,
            nodes,
        }
    }

    /// SIGTERM; the cluster must exit cleanly and nothing may have panicked.
    fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "tandem up exited with {status}");
        let rest: Vec<String> = self.lines.map_while(Result::ok).collect();
        assert!(rest.iter().all(|l| !l.contains("panicked")), "{rest:?}");
    }
}

fn json(stdout: &str) -> Value {
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout:?}"))
}

#[test]
fn tokenize_json_parses_special_tokens() {
    let (ok, out, err) = tandem(&[
        "tokenize",
        "--model",
        "tiny",
        "--text",
        "<|im_start|>hi",
        "--json",
    ]);
    assert!(ok, "{err}");
    let ids: Vec<u64> = json(&out)["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect();
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[0], 1, "<|im_start|> is one id");
}

/// A sampled (not greedy) generation with every sampling flag set.
const SEEDED: &[&str] = &[
    "generate",
    "--model",
    "tiny",
    "--messages",
    r#"[{"role":"user","content":"Hi"}]"#,
    "--max-tokens",
    "5",
    "--temperature",
    "0.7",
    "--top-k",
    "20",
    "--top-p",
    "0.9",
    "--seed",
    "3",
    "--json",
];

#[test]
fn generate_json_has_the_documented_fields() {
    let (ok, out, err) = tandem(SEEDED);
    assert!(ok, "{err}");
    let v = json(&out);
    let generated = v["token_ids"].as_array().expect("token_ids");
    assert!(generated.len() <= 5);
    assert!(
        !v["prompt_token_ids"]
            .as_array()
            .expect("prompt ids")
            .is_empty()
    );
    assert!(v["text"].is_string());
    let reason = v["finish_reason"].as_str().expect("finish_reason");
    assert!(
        reason == "length" && generated.len() == 5 || reason == "stop",
        "{v}"
    );
    assert!(v["prefill_ms"].as_f64().expect("prefill_ms") > 0.0);
    assert!(v["decode_ms"].as_f64().expect("decode_ms") >= 0.0);
    // The same seed gives the same output.
    let (_, again, _) = tandem(SEEDED);
    assert_eq!(json(&again)["token_ids"], v["token_ids"]);
}

/// A generation held to a regular expression, with each token's log-probabilities.
const CONSTRAINED: &[&str] = &[
    "generate",
    "--model",
    "tiny",
    "--prompt",
    "hi",
    "--max-tokens",
    "6",
    "--temperature",
    "0.9",
    "--seed",
    "5",
    "--regex",
    "[ab]+",
    "--logprobs",
    "2",
    "--json",
];

#[test]
fn generate_holds_to_a_grammar_and_reports_logprobs() {
    let (ok, out, err) = tandem(CONSTRAINED);
    assert!(ok, "{err}");
    let v = json(&out);
    let text = v["text"].as_str().expect("text");
    assert!(
        !text.is_empty() && text.chars().all(|c| c == 'a' || c == 'b'),
        "{v}"
    );
    let tokens = v["token_ids"].as_array().expect("token_ids");
    let logprobs = v["logprobs"].as_array().expect("logprobs");
    assert_eq!(logprobs.len(), tokens.len(), "{v}");
    for l in logprobs {
        assert!(l["logprob"].as_f64().expect("logprob") <= 0.0);
        assert_eq!(l["top"].as_array().expect("top").len(), 2, "{l}");
    }
    let (ok, _, err) = tandem(&[CONSTRAINED, &["--lark", "start: /a/"]].concat());
    assert!(!ok && err.contains("cannot be used with"), "{err}");
}

#[test]
fn bad_input_fails_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--model", "tiny", "--prompt", "x", "--temperature", "-1"],
            "temperature",
        ),
        (&["--model", "tiny", "--messages", "not json"], "--messages"),
        (
            &["--model", "/nonexistent/m.gguf", "--prompt", "x"],
            "/nonexistent/m.gguf",
        ),
        (
            &["--model", "tiny", "--prompt", "x", "--max-tokens", "5000"],
            "max_tokens",
        ),
        (
            &["--model", "tiny", "--prompt", "x", "--regex", "(x"],
            "unclosed group",
        ),
        (
            &[
                "--model",
                "tiny",
                "--prompt",
                "x",
                "--json-schema",
                "@/nonexistent/s.json",
            ],
            "/nonexistent/s.json",
        ),
        (
            &["--model", "tiny", "--prompt", "x", "--logprobs", "21"],
            "--logprobs",
        ),
    ];
    for (args, needle) in cases {
        let argv: Vec<&str> = std::iter::once("generate")
            .chain(args.iter().copied())
            .collect();
        let (ok, _, err) = tandem(&argv);
        assert!(!ok, "{args:?} must fail");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // The benchmarks' old command names their binary.
    let (ok, _, err) = tandem(&["bench", "engine", "--model", "tiny"]);
    assert!(
        !ok && err.contains("`tandem-bench engine --model tiny`"),
        "{err}"
    );
}

/// `tandem chat --server ROUTER` with `flags`, given `turns` on stdin, run to its end.
fn run_chat(router: &str, flags: &[&str], turns: &[u8]) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut chat = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["chat", "--server", router])
        .args(flags)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chat");
    let mut stdin = chat.stdin.take().expect("stdin");
    stdin.write_all(turns).expect("write turns");
    drop(stdin);
    chat.wait_with_output().expect("chat")
}

/// `tandem up` starts a cluster, `generate --server` through it prints the same JSON fields and
/// the same tokens as the local command (sampled, with every sampling flag), and SIGTERM stops
/// every process cleanly.
#[test]
fn up_serves_generate_server_like_local_and_stops_on_sigterm() {
    let up = Up::start();
    let router = up.grpc.clone();
    let (ok, local, err) = tandem(SEEDED);
    assert!(ok, "{err}");
    let (ok, remote, err) = tandem(&[SEEDED, &["--server", &router]].concat());
    assert!(ok, "{err}");
    let (local, remote) = (json(&local), json(&remote));
    for field in ["prompt_token_ids", "token_ids", "text", "finish_reason"] {
        assert_eq!(local[field], remote[field], "{field}");
    }
    assert!(remote["prefill_ms"].as_f64().is_some() && remote["decode_ms"].as_f64().is_some());
    // Held to a grammar, with log-probabilities: the cluster's tokens and figures are the
    // local ones.
    let (ok, local, err) = tandem(CONSTRAINED);
    assert!(ok, "{err}");
    let (ok, remote, err) = tandem(&[CONSTRAINED, &["--server", &router]].concat());
    assert!(ok, "{err}");
    let (local, remote) = (json(&local), json(&remote));
    for field in ["token_ids", "text", "logprobs"] {
        assert_eq!(local[field], remote[field], "{field}");
    }

    let (ok, _, err) = tandem(&[
        "generate",
        "--server",
        &router,
        "--prompt",
        "",
        "--max-tokens",
        "3",
    ]);
    assert!(!ok);
    assert!(
        err.contains("InvalidArgument") && err.contains("prompt"),
        "{err}"
    );

    // Two chat turns over stdin; an empty line ends the session.
    let chat = run_chat(&router, &["--max-tokens", "4"], b"Hi\nAnd again\n\n");
    let chat_err = String::from_utf8_lossy(&chat.stderr);
    assert!(chat.status.success(), "{chat_err}");
    assert!(!chat_err.contains("error"), "{chat_err}");
    assert_eq!(
        String::from_utf8_lossy(&chat.stdout).lines().count(),
        2,
        "one line per reply"
    );
    // `--model` names the model; one the cluster does not serve is refused by name.
    for (model, served) in [("tiny", true), ("nope", false)] {
        let chat = run_chat(&router, &["--max-tokens", "2", "--model", model], b"Hi\n\n");
        let err = String::from_utf8_lossy(&chat.stderr);
        if served {
            assert!(chat.status.success(), "{err}");
        } else {
            assert!(err.contains("'nope' does not exist"), "{err}");
        }
    }

    up.stop();
}

/// `tandem up` keeps its workers' disk tier under the user's cache directory: a cluster started
/// again reads the last one's blocks back instead of computing them, only the owner may read
/// the files, and `--kv-spill-clear` empties it.
#[test]
fn up_keeps_its_disk_tier_across_a_restart() {
    use std::os::unix::fs::PermissionsExt;
    let home = std::env::temp_dir().join(format!("tandem-home-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    let env = [("HOME", home.to_str().expect("utf-8"))];
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let cached = |up: &Up| -> u64 {
        rt.block_on(async {
            let body: Value = reqwest::Client::new()
                .post(format!("{}/completions", up.http))
                .json(&serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}))
                .send()
                .await
                .expect("POST")
                .json()
                .await
                .expect("JSON");
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("no cached_tokens: {body}"))
        })
    };
    let flags = ["--kv-spill-mb", "64"];
    let up = Up::start_in(None, &flags, &env);
    assert_eq!(cached(&up), 0, "a first start is cold");
    up.stop();
    let tier = home.join(".cache/tandem/kv/tiny/prefill-0/slot-0");
    let blocks: Vec<_> = std::fs::read_dir(&tier)
        .expect("the prefill node's tier")
        .flatten()
        .filter(|e| e.path().is_dir())
        .flat_map(|d| std::fs::read_dir(d.path()).expect("tier").flatten())
        .filter(|f| f.path().extension().is_some_and(|x| x == "kv"))
        .collect();
    assert!(!blocks.is_empty(), "the cache was written out at the stop");
    for b in &blocks {
        let mode = b.metadata().expect("metadata").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", b.path().display());
    }
    let up = Up::start_in(None, &flags, &env);
    assert!(cached(&up) > 0, "started again, the prompt is read back");
    up.stop();
    let up = Up::start_in(None, &[&flags[..], &["--kv-spill-clear"]].concat(), &env);
    assert_eq!(cached(&up), 0, "--kv-spill-clear starts cold");
    up.stop();
    let _ = std::fs::remove_dir_all(&home);
}

/// With `--log-json`, a request's log lines on the router, the prefill node and the decode node
/// all carry its request id (the router names requests that come without one).
#[test]
fn json_logs_carry_the_request_id_across_nodes() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("json-logs");
    std::fs::create_dir_all(&dir).expect("dir");
    let log = dir.join("up.log");
    let up = Up::start_with(Some(&log), &[]);
    let (ok, _, err) = tandem(&[
        "generate",
        "--server",
        &up.grpc,
        "--prompt",
        "hello there",
        "--max-tokens",
        "3",
    ]);
    assert!(ok, "{err}");
    up.stop();
    let text = std::fs::read_to_string(&log).expect("log");
    // `tandem up`'s own messages to the terminal are plain text; the nodes log JSON.
    let lines: Vec<Value> = text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: not JSON: {l}")))
        .collect();
    let line = |message: &str| {
        lines
            .iter()
            .find(|l| l["fields"]["message"] == message)
            .unwrap_or_else(|| panic!("no {message:?} line in {text}"))
    };
    let id = line("dispatching")["span"]["request_id"]
        .as_str()
        .expect("the router's line has a request_id")
        .to_string();
    assert_eq!(id.len(), 32, "{id}");
    for (message, target) in [
        ("dispatching", "tandem_router"),
        ("prefilled and pushed", "tandem_prefill_server"),
        ("generation finished", "tandem_decode_server"),
    ] {
        let l = line(message);
        assert!(
            l["target"].as_str().is_some_and(|t| t.starts_with(target)),
            "{l}"
        );
        assert_eq!(l["span"]["request_id"], id.as_str(), "{l}");
    }
}

/// `tandem up --routers 2` starts two routers over the same workers and lists both; each one
/// serves requests.
#[test]
fn up_starts_several_routers_over_the_same_workers() {
    let up = Up::start_with(None, &["--routers", "2"]);
    let routers: Vec<&(String, String)> = up
        .nodes
        .iter()
        .filter(|(name, _)| name.starts_with("router"))
        .collect();
    assert_eq!(routers.len(), 2, "{:?}", up.nodes);
    assert_ne!(routers[0].1, routers[1].1);
    for (name, addr) in routers {
        let (ok, out, err) = tandem(&[
            "generate",
            "--server",
            addr,
            "--prompt",
            "hello there",
            "--max-tokens",
            "3",
        ]);
        assert!(ok, "{name}: {err}");
        assert!(!out.is_empty(), "{name}");
    }
    up.stop();
}

/// `generate --batch` decodes every line in one batch and prints, per line, what the single
/// command prints for the same prompt and seed; a bad line is named.
#[test]
fn generate_batch_matches_single_requests() {
    let flags = [
        "--model",
        "tiny",
        "--max-tokens",
        "6",
        "--temperature",
        "0.7",
    ];
    let single = |prompt: &str, seed: &str| {
        let (ok, out, err) = tandem(
            &[
                &["generate", "--prompt", prompt, "--seed", seed, "--json"][..],
                &flags[..],
            ]
            .concat(),
        );
        assert!(ok, "{err}");
        json(&out)
    };
    let a = single("Once upon a time", "4");
    let b = single("The sea", "9");
    let dir = std::env::temp_dir().join(format!("tandem-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("batch.jsonl");
    std::fs::write(
        &file,
        format!(
            "{{\"prompt\":\"Once upon a time\",\"seed\":4}}\n\n{{\"token_ids\":{},\"seed\":9}}\n",
            b["prompt_token_ids"]
        ),
    )
    .expect("write");
    let path = file.to_string_lossy().to_string();
    let (ok, out, err) = tandem(&[&["generate", "--batch", &path][..], &flags[..]].concat());
    assert!(ok, "{err}");
    let lines: Vec<Value> = out.lines().map(json).collect();
    assert_eq!(lines.len(), 2);
    for (got, want) in lines.iter().zip([&a, &b]) {
        for field in ["prompt_token_ids", "token_ids", "text", "finish_reason"] {
            assert_eq!(got[field], want[field], "{field}");
        }
    }

    std::fs::write(&file, "{\"prompt\":\"x\"}\n{\"tokens\":[1]}\n").expect("write");
    let (ok, _, err) = tandem(&[&["generate", "--batch", &path][..], &flags[..]].concat());
    assert!(!ok);
    assert!(
        err.contains("line 2") && err.contains("unknown field"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tandem keys new` writes only the key's hash; `tandem up --api-keys` makes the router
/// require it, and `generate --server` sends it (`tandem-bench serve`'s `--api-key` is tested
/// in its crate).
#[test]
fn keys_new_and_clients_that_send_the_key() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("keys-cli");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("keys");
    let file = file.to_str().expect("utf-8");
    let (ok, _, err) = tandem(&["keys", "new", "--file", file, "--tenant", "no spaces"]);
    assert!(!ok && err.contains("a tenant is"), "{err}");
    let (ok, key, err) = tandem(&[
        "keys", "new", "--file", file, "--tenant", "alice", "--rpm", "600",
    ]);
    assert!(ok, "{err}");
    let key = key.trim().to_string();
    assert!(key.starts_with("tk-") && key.len() > 60, "{key}");
    let stored = std::fs::read_to_string(file).expect("key file");
    assert!(
        stored.starts_with("alice sha256:") && stored.contains("rpm=600"),
        "{stored}"
    );
    assert!(!stored.contains(&key), "the file holds only the hash");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(file).expect("meta").permissions().mode();
    assert_eq!(mode & 0o077, 0, "owner-only: {mode:o}");

    let up = Up::start_with(None, &["--api-keys", file]);
    let ask = [
        "generate",
        "--server",
        &up.grpc,
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ];
    let (ok, _, err) = tandem(&ask);
    assert!(!ok && err.contains("Unauthenticated"), "{err}");
    let (ok, _, err) = tandem(&[&ask[..], &["--api-key", &key]].concat());
    assert!(ok, "{err}");
    up.stop();
}

/// `tandem certs init` writes a CA and a key pair per role; `tandem up --tls-dir` runs every
/// internal hop over mutual TLS with them, and a worker's health check needs a certificate.
#[test]
fn certs_init_and_a_cluster_over_mutual_tls() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("certs-cli");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().expect("utf-8");
    let (ok, out, err) = tandem(&["certs", "init", d, "--name", "decode.example"]);
    assert!(ok, "{err}");
    for f in [
        "ca.pem",
        "ca.key",
        "router.pem",
        "prefill.key",
        "decode.pem",
        "client.key",
    ] {
        assert!(out.lines().any(|l| l.ends_with(f)), "{f} in {out}");
    }
    let (ok, _, err) = tandem(&["certs", "init", d]);
    assert!(!ok && err.contains("--force"), "{err}");

    let up = Up::start_with(None, &["--tls-dir", d]);
    let (ok, out, err) = tandem(&[SEEDED, &["--server", &up.grpc]].concat());
    assert!(ok, "{err}");
    assert!(!json(&out)["token_ids"].as_array().expect("ids").is_empty());
    let decode = &up
        .nodes
        .iter()
        .find(|(n, _)| n.starts_with("decode"))
        .expect("a decode node")
        .1;
    let (ok, _, err) = tandem(&["healthcheck", "--addr", decode, "--tls-dir", d]);
    assert!(ok, "{err}");
    let (ok, _, err) = tandem(&["healthcheck", "--addr", decode]);
    assert!(!ok, "a plaintext health check of a TLS worker fails");
    assert!(
        err.contains("requires TLS") && err.contains("--tls-dir"),
        "{err}"
    );
    up.stop();
}

/// `GET path` over HTTPS to `url`'s host and port (`https://127.0.0.1:PORT/v1`), trusting only
/// the CA in `ca`; returns the status line and the body.
fn https_get(url: &str, path: &str, ca: &std::path::Path) -> std::io::Result<(String, String)> {
    use rustls::pki_types::pem::PemObject;
    use std::io::{Read, Write};
    let host = url
        .strip_prefix("https://")
        .and_then(|rest| rest.split('/').next())
        .expect("an https URL");
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_file(ca).expect("ca.pem"))
        .expect("a CA certificate");
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("a name");
    let mut conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name)
        .map_err(std::io::Error::other)?;
    let mut tcp = std::net::TcpStream::connect(host)?;
    let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = String::new();
    // The server closes without close_notify under HTTP/1.1 `Connection: close` at times;
    // what arrived before counts.
    if let Err(e) = tls.read_to_string(&mut reply)
        && (e.kind() != std::io::ErrorKind::UnexpectedEof || reply.is_empty())
    {
        return Err(e);
    }
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    Ok((
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    ))
}

#[test]
fn the_client_api_over_tls() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("certs-api-tls");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().expect("utf-8");
    let (ok, _, err) = tandem(&["certs", "init", d]);
    assert!(ok, "{err}");
    let ca = dir.join("ca.pem");
    let ca = ca.to_str().expect("utf-8");

    let up = Up::start_with(None, &["--tls-dir", d, "--api-tls"]);
    let addr = up
        .grpc
        .strip_prefix("https://")
        .unwrap_or_else(|| panic!("an https address: {}", up.grpc));
    assert!(up.http.starts_with("https://"), "{}", up.http);

    let (ok, out, err) = tandem(&[SEEDED, &["--server", &up.grpc, "--ca-cert", ca]].concat());
    assert!(ok, "{err}");
    let over_tls = json(&out)["token_ids"].clone();
    assert!(!over_tls.as_array().expect("ids").is_empty());
    // The same, named by address and with the name to verify given apart.
    let (ok, out, err) = tandem(
        &[
            SEEDED,
            &["--server", addr, "--ca-cert", ca, "--tls-name", "localhost"],
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    assert_eq!(json(&out)["token_ids"], over_tls);

    // The system's roots do not trust the development CA; a plaintext client gets nowhere.
    let (ok, _, err) = tandem(&[SEEDED, &["--server", &up.grpc]].concat());
    assert!(!ok, "a client that does not trust the CA is refused");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    let (ok, _, err) = tandem(&[SEEDED, &["--server", addr]].concat());
    assert!(!ok, "a plaintext client of a TLS port fails");
    assert!(
        err.contains(&format!("serves TLS: give the address as https://{addr}")),
        "{err}"
    );
    let (ok, _, err) =
        tandem(&[SEEDED, &["--server", addr, "--ca-cert", "/nonexistent.pem"]].concat());
    assert!(!ok && err.contains("/nonexistent.pem"), "{err}");

    // The OpenAI HTTP API and the gRPC port's /metrics, over HTTPS with HTTP/1.1.
    let (status, body) = https_get(&up.http, "/v1/models", &dir.join("ca.pem")).expect("https");
    assert!(status.ends_with("200 OK"), "{status}");
    assert!(body.contains("\"tiny\""), "{body}");
    let (status, body) = https_get(&up.grpc, "/metrics", &dir.join("ca.pem")).expect("https");
    assert!(status.ends_with("200 OK"), "{status}");
    assert!(body.contains("tandem_router_"), "{body}");
    up.stop();
}

/// Spans of every node reach an OTLP collector (a receiver built from the official
/// `opentelemetry-proto` definitions) when `OTEL_EXPORTER_OTLP_ENDPOINT` is set: one request
/// sent with a client's `traceparent` is one trace holding the router's, the prefill node's and
/// the decode node's spans, each process under its own `service.name`, and the router's
/// request span carries the GenAI attributes.
#[test]
fn one_request_is_one_trace_across_the_nodes() {
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
    use std::sync::{Arc, Mutex};

    /// Every span received: its process's service name, trace id, name and attributes.
    type Received = Arc<Mutex<Vec<(String, Vec<u8>, String, Vec<(String, String)>)>>>;
    struct Receiver(Received);

    #[tonic::async_trait]
    impl TraceService for Receiver {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let text = |v: &Option<Any>| match v {
                Some(Any::StringValue(s)) => s.clone(),
                Some(Any::IntValue(i)) => i.to_string(),
                Some(Any::DoubleValue(d)) => d.to_string(),
                Some(Any::BoolValue(b)) => b.to_string(),
                _ => String::new(),
            };
            let mut got = self.0.lock().expect("lock");
            for rs in request.into_inner().resource_spans {
                let attrs = rs.resource.map(|r| r.attributes).unwrap_or_default();
                let service = attrs
                    .iter()
                    .find(|a| a.key == "service.name")
                    .map(|a| text(&a.value.as_ref().and_then(|v| v.value.clone())))
                    .unwrap_or_default();
                for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                    let attributes = span
                        .attributes
                        .iter()
                        .map(|a| {
                            (
                                a.key.clone(),
                                text(&a.value.as_ref().and_then(|v| v.value.clone())),
                            )
                        })
                        .collect();
                    got.push((service.clone(), span.trace_id, span.name, attributes));
                }
            }
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let received = Received::default();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let collector = listener.local_addr().expect("addr");
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Receiver(received.clone())))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let endpoint = format!("http://{collector}");
    let up = Up::start_in(
        None,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    // The client's own trace: the request continues it.
    let trace_hex = "4bf92f3577b34da6a3ce929d0e0e4736";
    let trace_id: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&trace_hex[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    // The router is ready once it sees a decode replica; the prompt goes to the prefill node
    // only once it sees that one too (before, the decode node computes it).
    let metrics = format!("http://{}/metrics", up.grpc);
    let prefill_up = || {
        rt.block_on(async {
            let text = reqwest::get(&metrics).await.ok()?.text().await.ok()?;
            Some(text.lines().any(|l| {
                l.starts_with("tandem_router_replica_up{")
                    && l.contains("prefill")
                    && l.ends_with(" 1")
            }))
        }) == Some(true)
    };
    let started = std::time::Instant::now();
    while !prefill_up() {
        assert!(
            started.elapsed().as_secs() < 20,
            "the router never saw the prefill node"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let status = rt.block_on(async {
        reqwest::Client::new()
            .post(format!("{}/completions", up.http))
            .header("traceparent", format!("00-{trace_hex}-00f067aa0ba902b7-01"))
            .json(&serde_json::json!({"model": "tiny", "prompt": "hello there", "max_tokens": 3}))
            .send()
            .await
            .expect("POST")
            .status()
    });
    assert_eq!(status, 200);
    let want = ["tandem-router", "tandem-prefill", "tandem-decode"];
    let started = std::time::Instant::now();
    let spans = loop {
        let spans: Vec<_> = (received.lock().expect("lock").iter())
            .filter(|s| s.1 == trace_id)
            .cloned()
            .collect();
        if want.iter().all(|w| spans.iter().any(|s| s.0 == *w)) {
            break spans;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "the trace's spans by then: {spans:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    up.stop();
    let request = spans
        .iter()
        .find(|s| s.0 == "tandem-router" && s.2 == "request")
        .unwrap_or_else(|| panic!("no request span: {spans:?}"));
    let attr = |key: &str| {
        request
            .3
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {key} on {request:?}"))
    };
    assert_eq!(attr("gen_ai.request.model"), "tiny");
    assert_eq!(attr("gen_ai.operation.name"), "text_completion");
    assert!(attr("gen_ai.usage.input_tokens").parse::<u64>().expect("n") > 0);
    assert_eq!(attr("gen_ai.usage.output_tokens"), "3");
    // The attempt and its replicas, and the KV push on the decode node, are spans of it too.
    for (service, name) in [
        ("tandem-router", "attempt"),
        ("tandem-router", "prefill"),
        ("tandem-prefill", "prefill"),
        ("tandem-decode", "generate"),
        ("tandem-decode", "push"),
    ] {
        assert!(
            spans.iter().any(|s| s.0 == service && s.2 == name),
            "no {name} span from {service}: {spans:?}"
        );
    }
    let ttft = spans
        .iter()
        .filter(|s| s.2 == "attempt")
        .flat_map(|s| &s.3)
        .find(|(k, _)| k == "gen_ai.server.time_to_first_token");
    assert!(ttft.is_some(), "{spans:?}");
}
