//! Agent sessions through what clusters do to them, over Anthropic's Messages API on the
//! default model (the 0.5B Qwen2.5-Coder), as Claude Code drives it: sessions named by
//! `x-claude-code-session-id`, a system prompt and a tool list resent every turn, and the
//! history growing. A session whose decode node is drained goes on on the peer with its KV, and
//! one that sat idle comes back from the disk tier (the next turn reads its whole first turn
//! from a cache, `cache_read_input_tokens`, none of it recomputed); each says exactly what a
//! cluster without caches says. A session's end releases its KV.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_engine::{KvDtype, SpillConfig};
use tandem_integration_tests::{Cluster, ClusterConfig, SpillDir, metrics, qwen_model, sample};

/// A Claude-Code-like session's request: its system prompt and tools, and `messages`.
fn request(model: &str, messages: &[Value]) -> Value {
    json!({
        "model": model,
        "max_tokens": 24,
        "temperature": 0,
        "system": [{"type": "text", "text": "You are a coding agent. Read files with the tools \
                    given, then answer in one short sentence.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [
            {"name": "read_file", "description": "Read a file of the repository.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                              "required": ["path"]}},
            {"name": "list_dir", "description": "List a directory of the repository.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                              "required": ["path"]}},
        ],
        "messages": messages,
    })
}

/// Sends a Messages request under `session`; the reply's text and usage.
async fn turn(http: &reqwest::Client, base: &str, session: &str, body: &Value) -> Value {
    let r = http
        .post(format!("{base}/v1/messages"))
        .header("x-claude-code-session-id", session)
        .json(body)
        .send()
        .await
        .expect("messages request");
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    r.json().await.expect("a message")
}

fn text(reply: &Value) -> String {
    reply["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b["text"].as_str())
        .collect()
}

/// An HTTP client for `cluster`'s router, its base address, and the model's id there.
async fn connect(cluster: &Cluster) -> (reqwest::Client, String, String) {
    let http = reqwest::Client::new();
    let base = format!("http://{}", cluster.http);
    let name = tandem_integration_tests::http_model(&http, &format!("{base}/v1"))
        .await
        .expect("the model's id");
    (http, base, name)
}

/// Turn 1's history and turn 2's question, for session `s`.
fn histories(s: usize, first: &Value) -> (Vec<Value>, Vec<Value>) {
    let ask = vec![json!({"role": "user", "content": format!(
        "Session {s}: what does the file src/main_{s}.rs do? Check before you answer.")})];
    let mut next = ask.clone();
    next.push(json!({"role": "assistant", "content": first["content"]}));
    // Each call answered, as an agent answers it, then the next question.
    let mut answer: Vec<Value> = first["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| {
            json!({"type": "tool_result", "tool_use_id": b["id"],
                        "content": "fn main() { println!(\"hello\"); }"})
        })
        .collect();
    answer.push(json!({"type": "text", "text": "Now say which directory it is in."}));
    next.push(json!({"role": "user", "content": answer}));
    (ask, next)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_agent_session_goes_on_with_its_kv() {
    let model = qwen_model().expect("the 0.5B Qwen (run `tandem model fetch qwen2.5-coder-0.5b`)");
    let mut cluster = Cluster::start(ClusterConfig {
        decode: 2,
        ..ClusterConfig::new(model.clone())
    })
    .await
    .expect("cluster");
    let (http, base, name) = connect(&cluster).await;

    // Turn 1 of two sessions; then the decode node holding the first is drained.
    let mut firsts = Vec::new();
    for s in 0..2 {
        let ask = histories(s, &json!({})).0;
        let first = turn(&http, &base, &format!("session-{s}"), &request(&name, &ask)).await;
        firsts.push(first);
    }
    let mut holders = Vec::new();
    for node in &cluster.decode {
        let m = metrics(node.addr).await.expect("metrics");
        holders.push(sample(&m, "tandem_decode_kv_blocks_cached").unwrap_or(0.0));
    }
    let drained = if holders[0] >= holders[1] { 0 } else { 1 };
    assert!(
        holders[drained] > 0.0,
        "a decode node holds a session: {holders:?}"
    );
    eprintln!("blocks cached per decode node {holders:?}; draining node {drained}");
    cluster
        .decode
        .remove(drained)
        .stop()
        .await
        .expect("the drained node stops cleanly once its sessions moved");

    // Turn 2 of each reads its whole first turn's prompt from the cache, wherever it lives.
    let mut seconds = Vec::new();
    for (s, first) in firsts.iter().enumerate() {
        let next = histories(s, first).1;
        let second = turn(
            &http,
            &base,
            &format!("session-{s}"),
            &request(&name, &next),
        )
        .await;
        let prompt = first["usage"]["input_tokens"].as_u64().unwrap_or(0)
            + first["usage"]["cache_read_input_tokens"]
                .as_u64()
                .unwrap_or(0);
        let read = second["usage"]["cache_read_input_tokens"]
            .as_u64()
            .unwrap_or(0);
        eprintln!(
            "session {s}: turn 1's prompt {prompt} tokens, turn 2 read {read} from the cache"
        );
        assert!(
            read >= prompt / 16 * 16,
            "session {s}'s turn 2 read {read} tokens from the cache; turn 1's prompt was {prompt}"
        );
        seconds.push((next, text(&second)));
    }
    cluster.stop().await.expect("stop");
    cold_says(model, &seconds).await;
}

/// Asserts that a cluster without caches answers each `(messages, text)` of session `i` (named
/// `session-i`) with that text.
async fn cold_says(model: Arc<tandem_engine::Model>, turns: &[(Vec<Value>, String)]) {
    let cold = Cluster::start(ClusterConfig {
        prefix_cache: false,
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cold cluster");
    let (http, base, name) = connect(&cold).await;
    for (s, (messages, said)) in turns.iter().enumerate() {
        let reply = turn(
            &http,
            &base,
            &format!("session-{s}"),
            &request(&name, messages),
        )
        .await;
        assert_eq!(&text(&reply), said, "session {s}'s turn");
    }
    cold.stop().await.expect("stop");
}

/// A cluster of one prefill and one decode node with a disk tier under `dir`, and KV pools of
/// `pool_blocks` blocks (the default when `None`).
fn with_disk_tier(
    model: Arc<tandem_engine::Model>,
    dir: &SpillDir,
    pool_blocks: Option<usize>,
) -> ClusterConfig {
    let block = model.config.kv_layout(KvDtype::F16).block_bytes();
    let base = ClusterConfig::new(model);
    ClusterConfig {
        engine: tandem_engine::EngineConfig {
            spill: Some(SpillConfig {
                dir: dir.0.clone(),
                max_bytes: 1 << 30,
            }),
            kv_budget_bytes: pool_blocks.map_or(base.engine.kv_budget_bytes, |n| n * block),
            ..base.engine.clone()
        },
        ..base
    }
}

/// What the router's per-turn histogram says came from `source`, summed over the turns.
async fn turn_tokens(router: std::net::SocketAddr, source: &str) -> f64 {
    let name = format!("tandem_router_session_turn_tokens_sum{{source=\"{source}\"}}");
    now(router, &name).await
}

/// Polls the metrics at `addr` until `name` reaches `at_least` (30 s at most); its value.
async fn until(addr: std::net::SocketAddr, name: &str, at_least: f64) -> f64 {
    let start = Instant::now();
    loop {
        let m = metrics(addr).await.expect("metrics");
        let v = sample(&m, name).unwrap_or(0.0);
        if v >= at_least {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{name} stayed at {v}, below {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of `name` at `addr` now.
async fn now(addr: std::net::SocketAddr, name: &str) -> f64 {
    sample(&metrics(addr).await.expect("metrics"), name).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_agent_session_goes_to_disk_and_comes_back() {
    let model = qwen_model().expect("the 0.5B Qwen (run `tandem model fetch qwen2.5-coder-0.5b`)");
    let dir = SpillDir::new();
    let cluster = Cluster::start(ClusterConfig {
        sessions: tandem_router::SessionConfig {
            idle: Duration::from_millis(500),
            ..tandem_router::SessionConfig::default()
        },
        ..with_disk_tier(model.clone(), &dir, None)
    })
    .await
    .expect("cluster");
    let (http, base, name) = connect(&cluster).await;
    let (router, prefill, decode) = (
        cluster.router.addr,
        cluster.prefill[0].addr,
        cluster.decode[0].addr,
    );

    let ask = histories(0, &json!({})).0;
    let first = turn(&http, &base, "session-0", &request(&name, &ask)).await;
    assert!(now(decode, "tandem_decode_kv_blocks_cached").await > 0.0);
    // Idle past half a second, its KV leaves both pools for their disk tiers.
    until(
        router,
        "tandem_router_session_releases_total{reason=\"idle_to_disk\"}",
        1.0,
    )
    .await;
    let start = Instant::now();
    while now(decode, "tandem_decode_kv_blocks_cached").await > 0.0
        || now(prefill, "tandem_prefill_prefix_cache_blocks").await > 0.0
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the idle session's KV stayed in the pools"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let prompt = first["usage"]["input_tokens"].as_u64().unwrap_or(0) as f64;
    let whole = (prompt / 16.0).floor();
    let spilled = until(decode, "tandem_decode_kv_spill_stored_blocks_total", whole).await;
    eprintln!("turn 1's prompt {prompt} tokens; the decode node wrote {spilled} blocks to disk");

    // Turn 2 reads turn 1 back from disk: nothing it had is computed again.
    let next = histories(0, &first).1;
    let second = turn(&http, &base, "session-0", &request(&name, &next)).await;
    let read = second["usage"]["cache_read_input_tokens"]
        .as_u64()
        .unwrap_or(0) as f64;
    let disk = turn_tokens(router, "disk").await;
    let recomputed = turn_tokens(router, "recomputed").await;
    eprintln!("turn 2 read {read} tokens from a cache, {disk} from disk; {recomputed} recomputed");
    assert!(read >= whole * 16.0, "turn 2 read {read} cached tokens");
    assert!(disk >= whole * 16.0, "turn 2 came back from disk");
    assert_eq!(recomputed, 0.0, "nothing was computed again");

    // Its end releases what the pools hold of it; a second end finds nothing.
    assert!(now(decode, "tandem_decode_kv_blocks_cached").await > 0.0);
    let end = |id: &str| http.delete(format!("{base}/v1/sessions/{id}")).send();
    let ended = end("session-0").await.expect("delete");
    assert_eq!(ended.status(), 200);
    let ended: Value = ended.json().await.expect("json");
    assert!(
        ended["released_tokens"].as_u64().unwrap_or(0) > 0,
        "{ended}"
    );
    assert_eq!(now(decode, "tandem_decode_kv_blocks_cached").await, 0.0);
    assert_eq!(now(router, "tandem_router_sessions_open").await, 0.0);
    assert_eq!(end("session-0").await.expect("delete").status(), 404);
    cluster.stop().await.expect("stop");
    cold_says(model, &[(next, text(&second))]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_session_pushed_out_by_others_comes_back_from_disk() {
    let model = qwen_model().expect("the 0.5B Qwen (run `tandem model fetch qwen2.5-coder-0.5b`)");
    let dir = SpillDir::new();
    // Pools of 28 blocks: the shared system prompt and tools (about 13 blocks) and a few
    // sessions' own turns.
    let cluster = Cluster::start(with_disk_tier(model.clone(), &dir, Some(28)))
        .await
        .expect("cluster");
    let (http, base, name) = connect(&cluster).await;
    let (router, decode) = (cluster.router.addr, cluster.decode[0].addr);

    let ask = histories(0, &json!({})).0;
    let first = turn(&http, &base, "session-0", &request(&name, &ask)).await;
    // Eight other sessions take the pools; the first one's own blocks go to disk.
    for s in 1..9 {
        let ask = histories(s, &json!({})).0;
        turn(&http, &base, &format!("session-{s}"), &request(&name, &ask)).await;
    }
    let spilled = until(decode, "tandem_decode_kv_spill_stored_blocks_total", 1.0).await;
    let disk_before = turn_tokens(router, "disk").await;

    let next = histories(0, &first).1;
    let second = turn(&http, &base, "session-0", &request(&name, &next)).await;
    let prompt = first["usage"]["input_tokens"].as_u64().unwrap_or(0);
    let read = second["usage"]["cache_read_input_tokens"]
        .as_u64()
        .unwrap_or(0);
    let disk = turn_tokens(router, "disk").await - disk_before;
    let recomputed = turn_tokens(router, "recomputed").await;
    eprintln!(
        "{spilled} blocks spilled by the decode node; turn 1's prompt {prompt} tokens, turn 2 \
         read {read} from a cache, {disk} of them from disk; {recomputed} recomputed"
    );
    assert!(read >= prompt / 16 * 16, "turn 2 read {read} cached tokens");
    assert!(disk > 0.0, "turn 2 read some of its history back from disk");
    assert_eq!(
        recomputed, 0.0,
        "nothing any session had was computed again"
    );
    cluster.stop().await.expect("stop");
    cold_says(model, &[(next, text(&second))]).await;
}
