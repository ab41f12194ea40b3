//! The session table's rules, on paused time.

use super::*;

fn sessions(config: SessionConfig) -> Sessions {
    let mut registry = prometheus_client::registry::Registry::default();
    Sessions::new(config, RouterMetrics::register(&mut registry))
}

fn turn<'a>(tenant: &'a Arc<str>, id: &'a str, prompt: &'a [u32]) -> Turn<'a> {
    Turn {
        tenant,
        session_id: id,
        cache_salt: "salt",
        prompt,
        reply: &[7, 8],
        cached: 0,
        restored: 0,
    }
}

#[tokio::test(start_paused = true)]
async fn idle_sessions_go_to_disk_then_end() {
    let s = sessions(SessionConfig {
        idle: Duration::from_secs(10),
        ttl: Duration::from_secs(60),
        per_key: 8,
    });
    let a: Arc<str> = "a".into();
    assert!(s.turn(turn(&a, "s1", &[1, 2, 3])).is_none());
    assert!(s.sweep(Instant::now()).is_empty(), "active");
    tokio::time::advance(Duration::from_secs(11)).await;
    let moved = s.sweep(Instant::now());
    assert_eq!(moved.len(), 1);
    assert_eq!(moved[0].why, Release::Idle);
    assert_eq!(
        moved[0].session.token_ids,
        [1, 2, 3, 7, 8],
        "prompt and reply"
    );
    assert!(s.sweep(Instant::now()).is_empty(), "moved once");
    tokio::time::advance(Duration::from_secs(50)).await;
    let ended = s.sweep(Instant::now());
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].why, Release::Expired);
    assert!(s.end(&a, "s1").is_none(), "already ended");
    assert_eq!(s.metrics.sessions_open.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_key_over_its_bound_ends_its_least_recent_session() {
    let s = sessions(SessionConfig {
        per_key: 2,
        ..SessionConfig::default()
    });
    let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
    assert!(s.turn(turn(&a, "s1", &[1])).is_none());
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(s.turn(turn(&a, "s2", &[2])).is_none());
    assert!(s.turn(turn(&b, "s1", &[3])).is_none(), "another key's");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(
        s.turn(turn(&a, "s1", &[1, 4])).is_none(),
        "a turn of an open one"
    );
    let ended = s.turn(turn(&a, "s3", &[5])).expect("over the bound");
    assert_eq!(ended.why, Release::KeyLimit);
    assert_eq!(
        ended.session.token_ids,
        [2, 7, 8],
        "s2 was the least recent"
    );
    assert_eq!(s.metrics.sessions_open.get(), 3);
    assert!(s.end(&b, "s2").is_none(), "a key ends only its own");
    assert!(s.end(&a, "s3").is_some());
}

/// Two routers' tables: each learns the other's sessions, only the router a session's
/// last turn went through runs its clocks, and an end reaches the other.
#[tokio::test(start_paused = true)]
async fn peers_learn_each_others_sessions_and_one_runs_their_clocks() {
    let config = SessionConfig {
        idle: Duration::from_secs(10),
        ttl: Duration::from_secs(60),
        per_key: 8,
    };
    let (a, b) = (sessions(config), sessions(config));
    let (name_a, name_b): (Arc<str>, Arc<str>) = ("10.0.0.1:1".into(), "10.0.0.2:1".into());
    let t: Arc<str> = "t".into();
    a.turn(turn(&t, "s", &[1, 2, 3]));
    let all = a.changes(0);
    assert!(all.full, "a first ask gets the whole table");
    assert_eq!(all.sessions.len(), 1);
    let mut since_a = all.seq;
    b.learn(&name_a, all);
    assert_eq!(b.metrics.sessions_open.get(), 1, "b holds a's session");
    let none = a.changes(since_a);
    assert!(!none.full && none.sessions.is_empty() && none.ended.is_empty());

    // Idle past `idle`: a moves it to disk, once; b leaves it alone and learns the move.
    tokio::time::advance(Duration::from_secs(11)).await;
    assert!(
        b.sweep(Instant::now()).is_empty(),
        "a's session is a's to move"
    );
    let moved = a.sweep(Instant::now());
    assert_eq!(moved.len(), 1);
    assert_eq!(moved[0].why, Release::Idle);
    let changed = a.changes(since_a);
    assert!(!changed.full);
    assert!(changed.sessions[0].on_disk);
    assert_eq!(changed.sessions[0].idle_ms, 11_000);
    since_a = changed.seq;
    b.learn(&name_a, changed);

    // The next turn goes through b: measured against a's sequence, and b's from now on.
    b.turn(Turn {
        cached: 0,
        ..turn(&t, "s", &[1, 2, 3, 7, 8, 9])
    });
    assert_eq!(b.metrics.session_turn_tokens("recomputed").sum(), 0.0);
    a.learn(&name_b, b.changes(0));
    tokio::time::advance(Duration::from_secs(11)).await;
    assert!(a.sweep(Instant::now()).is_empty(), "now b's to move");
    assert_eq!(b.sweep(Instant::now()).len(), 1);
    assert!(
        a.changes(since_a).sessions.is_empty(),
        "a no longer lists it"
    );

    // b ends it: a learns the end.
    let since_b = b.changes(0).seq;
    assert!(b.end(&t, "s").is_some());
    let ended = b.changes(since_b);
    assert_eq!(ended.ended.len(), 1);
    a.learn(&name_b, ended);
    assert_eq!(a.metrics.sessions_open.get(), 0);
}

/// A peer that is gone leaves its sessions to this router, whose clocks then run them.
#[tokio::test(start_paused = true)]
async fn a_gone_peers_sessions_are_adopted() {
    let config = SessionConfig {
        idle: Duration::from_secs(10),
        ttl: Duration::from_secs(60),
        per_key: 8,
    };
    let (a, b) = (sessions(config), sessions(config));
    let name_a: Arc<str> = "10.0.0.1:1".into();
    let t: Arc<str> = "t".into();
    a.turn(turn(&t, "s", &[1, 2, 3]));
    b.learn(&name_a, a.changes(0));
    let since_b = b.changes(0).seq;
    b.adopt(&name_a);
    let adopted = b.changes(since_b);
    assert_eq!(adopted.sessions.len(), 1, "b's peers learn it as b's");
    tokio::time::advance(Duration::from_secs(61)).await;
    let swept = b.sweep(Instant::now());
    assert_eq!(swept.len(), 1);
    assert_eq!(swept[0].why, Release::Expired);
}

/// A full table from a peer replaces what was learned from it before.
#[test]
fn a_full_table_replaces_a_peers_sessions() {
    let (a, b) = (
        sessions(SessionConfig::default()),
        sessions(SessionConfig::default()),
    );
    let name_a: Arc<str> = "10.0.0.1:1".into();
    let t: Arc<str> = "t".into();
    a.turn(turn(&t, "s1", &[1]));
    b.learn(&name_a, a.changes(0));
    a.end(&t, "s1");
    a.turn(turn(&t, "s2", &[2]));
    b.learn(&name_a, a.changes(0));
    assert_eq!(b.metrics.sessions_open.get(), 1, "only s2");
}

#[test]
fn recomputed_tokens_are_the_shared_whole_blocks_no_cache_supplied() {
    let s = sessions(SessionConfig::default());
    let a: Arc<str> = "a".into();
    let first: Vec<u32> = (0..40).collect();
    s.turn(turn(&a, "s", &first));
    // The next turn shares the first 40 tokens and the reply's 2: two whole blocks of 16.
    let mut next = first.clone();
    next.extend([7, 8, 99, 100]);
    s.turn(Turn {
        cached: 16,
        restored: 16,
        ..turn(&a, "s", &next)
    });
    let m = &s.metrics;
    assert_eq!(m.session_turn_tokens("recomputed").sum(), 16.0);
    assert_eq!(m.session_turn_tokens("disk").sum(), 16.0);
    assert_eq!(m.session_turn_tokens("pool").sum(), 0.0);
}

/// A table too large for one message answers, whole, with its most recently used sessions that
/// fit, and its peer takes that in.
#[tokio::test(start_paused = true)]
async fn a_full_answer_fits_in_one_message() {
    let s = sessions(SessionConfig {
        per_key: 1000,
        ..SessionConfig::default()
    });
    let a: Arc<str> = "a".into();
    let prompt: Vec<u32> = (0..8000).collect();
    for i in 0..300 {
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(s.turn(turn(&a, &format!("s{i}"), &prompt)).is_none());
    }
    let c = s.changes(0);
    assert!(c.full);
    let kept = c.sessions.len();
    assert!((100..300).contains(&kept), "{kept} of 300 kept");
    let bytes: usize = c.sessions.iter().map(prost::Message::encoded_len).sum();
    assert!(bytes <= ANSWER_BYTES, "{bytes} bytes");
    let newest = |c: &Changes| {
        c.sessions
            .iter()
            .any(|p| p.key.as_ref().is_some_and(|k| k.session_id == "s299"))
    };
    assert!(newest(&c), "the most recent is kept");
    // Caught up, the next answer holds only what changed.
    assert!(s.turn(turn(&a, "s0", &[1, 2])).is_none());
    let next = s.changes(c.seq);
    assert!(!next.full);
    assert_eq!(next.sessions.len(), 1);
}
