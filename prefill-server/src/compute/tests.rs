use super::*;

fn share(class: Class) -> Share {
    Share {
        class,
        tenant: "".into(),
        weight: 1,
    }
}

/// Within a class, the tenant served fewer prompt tokens per weight goes first; one that
/// starts waiting again starts at the least counter waiting.
#[tokio::test(start_paused = true)]
async fn tenants_share_a_class_by_prompt_tokens() {
    let mut w = Waiting::default();
    let tenant = |t: &str, weight| Share {
        class: Class::Standard,
        tenant: t.into(),
        weight,
    };
    for i in 0..3 {
        w.push(&tenant("heavy", 1), 1000, format!("heavy-{i}"));
    }
    let now = tokio::time::Instant::now();
    assert_eq!(w.pop(now).as_deref(), Some("heavy-0"));
    w.push(&tenant("light", 1), 100, "light-0".to_string());
    w.push(&tenant("light", 1), 100, "light-1".to_string());
    // light starts at heavy's 1000 (idling earns nothing); equal counters go by arrival.
    assert_eq!(w.pop(now).as_deref(), Some("heavy-1"));
    assert_eq!(w.pop(now).as_deref(), Some("light-0"));
    assert_eq!(w.pop(now).as_deref(), Some("light-1"));
    assert_eq!(w.pop(now).as_deref(), Some("heavy-2"));

    // Weight 10: 1000 tokens count 100, so the weighted tenant's second goes before the
    // other's (at weight 1 they would tie, and arrival would put the other's first).
    let mut w = Waiting::default();
    for i in 0..2 {
        w.push(&tenant("a", 1), 1000, format!("a-{i}"));
        w.push(&tenant("b", 10), 1000, format!("b-{i}"));
    }
    let order: Vec<_> = std::iter::from_fn(|| w.pop(now)).collect();
    assert_eq!(order, ["a-0", "b-0", "b-1", "a-1"]);
}

/// Queued prompts go by class, then arrival; one that has waited an age step ranks a class
/// higher, so a batch prompt waiting 20 s goes before an interactive one.
#[tokio::test(start_paused = true)]
async fn queued_prompts_go_by_class_aged_then_arrival() {
    let mut w = Waiting::default();
    for (job, class) in [
        ("batch", Class::Batch),
        ("standard-1", Class::Standard),
        ("interactive", Class::Interactive),
        ("standard-2", Class::Standard),
    ] {
        w.push(&share(class), 1, job);
    }
    let now = tokio::time::Instant::now();
    let order: Vec<_> = std::iter::from_fn(|| w.pop(now)).collect();
    assert_eq!(order, ["interactive", "standard-1", "standard-2", "batch"]);

    w.push(&share(Class::Batch), 1, "batch");
    tokio::time::advance(tandem_proto::policy::AGE_STEP).await;
    w.push(&share(Class::Standard), 1, "standard");
    w.push(&share(Class::Interactive), 1, "interactive");
    assert_eq!(w.pop(tokio::time::Instant::now()), Some("interactive"));
    assert_eq!(w.pop(tokio::time::Instant::now()), Some("batch"));
    w.push(&share(Class::Batch), 1, "batch");
    tokio::time::advance(2 * tandem_proto::policy::AGE_STEP).await;
    w.push(&share(Class::Interactive), 1, "interactive");
    assert_eq!(w.pop(tokio::time::Instant::now()), Some("standard"));
    assert_eq!(w.pop(tokio::time::Instant::now()), Some("batch"));
    assert_eq!(w.pop(tokio::time::Instant::now()), Some("interactive"));
    assert_eq!(w.pop(tokio::time::Instant::now()), None);

    // Between its chunks, a standard prompt yields to a higher class only.
    w.push(&share(Class::Standard), 1, "standard");
    w.push(&share(Class::Batch), 1, "batch");
    let now = tokio::time::Instant::now();
    assert_eq!(w.pop_above(Class::Standard, now), None);
    w.push(&share(Class::Interactive), 1, "interactive");
    assert_eq!(w.pop_above(Class::Standard, now), Some("interactive"));
    assert_eq!(w.pop_above(Class::Standard, now), None);
}

/// The rule the queued pushes' heartbeats follow: they beat while the compute thread
/// waits for work or moved within [`STALLED_AFTER`], and fall silent once it has not, so a
/// decode node gives up on a stuck prefill node by its own bound on silence.
#[tokio::test(start_paused = true)]
async fn the_pulse_says_idle_or_recent_and_falls_silent_once_stuck() {
    let pulse = Pulse::default();
    assert!(
        pulse.within(Duration::ZERO),
        "waiting for work is not stuck"
    );
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert!(pulse.within(Duration::ZERO), "however long it waits");
    pulse.beat();
    tokio::time::advance(STALLED_AFTER - Duration::from_millis(1)).await;
    assert!(pulse.within(STALLED_AFTER), "a chunk still computing");
    tokio::time::advance(Duration::from_millis(2)).await;
    assert!(!pulse.within(STALLED_AFTER), "no move for longer: stuck");
    pulse.beat();
    assert!(pulse.within(STALLED_AFTER), "a move clears it");
    pulse.idle();
    tokio::time::advance(STALLED_AFTER * 2).await;
    assert!(pulse.within(STALLED_AFTER));
}
