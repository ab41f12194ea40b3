use std::collections::HashMap;

use super::*;

fn claim(class: Class, tenant: &str) -> Claim {
    Claim {
        class,
        tenant: tenant.into(),
        begun: false,
    }
}

/// The order `q` serves its entries in, all at `now`.
fn order(q: &mut FairQueue<u32>) -> Vec<u32> {
    let now = Instant::now();
    std::iter::from_fn(|| q.pop_first(now, |_| true).map(|e| e.item)).collect()
}

#[test]
fn classes_round_trip_their_names_and_the_wire() {
    for class in Class::ALL {
        assert_eq!(Class::parse(class.name()), Some(class));
        assert_eq!(Class::from_pb(class.to_pb() as i32), Some(class));
        assert_eq!(Class::ALL[class.slot()], class);
    }
    assert_eq!(
        Class::from_pb(pb::Priority::Unspecified as i32),
        Some(Class::Standard)
    );
    assert_eq!(Class::from_pb(17), None);
    assert_eq!(Class::parse("urgent"), None);
}

#[test]
fn a_wait_ages_a_class_per_step_up_to_the_highest() {
    let ms = Duration::from_millis;
    assert_eq!(Class::Batch.aged(AGE_STEP - ms(1)), Class::Batch);
    assert_eq!(Class::Batch.aged(AGE_STEP), Class::Standard);
    assert_eq!(Class::Batch.aged(2 * AGE_STEP), Class::Interactive);
    assert_eq!(Class::Batch.aged(Duration::MAX), Class::Interactive);
    assert_eq!(Class::Interactive.aged(AGE_STEP), Class::Interactive);
}

/// Classes go in strict order, then a begun stream before a fresh one, then arrival.
#[tokio::test(start_paused = true)]
async fn entries_go_by_class_then_begun_then_arrival() {
    let mut q = FairQueue::default();
    let step = Duration::from_millis(1);
    for (item, class, begun) in [
        (1, Class::Batch, false),
        (2, Class::Standard, false),
        (3, Class::Batch, true),
        (4, Class::Interactive, false),
        (5, Class::Standard, false),
    ] {
        let tenant = "t".into();
        q.push(
            Claim {
                class,
                tenant,
                begun,
            },
            item,
        );
        tokio::time::advance(step).await;
    }
    assert_eq!(order(&mut q), [4, 2, 5, 3, 1]);
}

/// A waiting entry rises a class per step: batch waiting two steps goes before a standard
/// newcomer, then before an interactive one.
#[tokio::test(start_paused = true)]
async fn waiting_entries_age_into_higher_classes() {
    let mut q = FairQueue::default();
    let batch = q.push(claim(Class::Batch, "a"), ());
    let ahead_of = |q: &FairQueue<()>, class| {
        let now = Instant::now();
        q.any_ahead(q.newcomer(&claim(class, "b"), now), None, now, |_| true)
    };
    assert!(!ahead_of(&q, Class::Standard));
    tokio::time::advance(AGE_STEP).await;
    assert!(
        ahead_of(&q, Class::Standard),
        "aged to standard, and came first"
    );
    assert!(!ahead_of(&q, Class::Interactive));
    tokio::time::advance(AGE_STEP).await;
    assert!(ahead_of(&q, Class::Interactive));
    let now = Instant::now();
    let own = q.rank(q.get(batch).expect("waiting"), now);
    assert!(!q.any_ahead(own, Some(batch), now, |_| true));
}

/// Within a class the tenant served fewer tokens per weight goes first, whatever the arrival
/// order; one that comes back after idling starts at the least counter waiting.
#[tokio::test(start_paused = true)]
async fn tenants_share_by_tokens_served_over_their_weight() {
    let mut q = FairQueue::default();
    let (flood, light, heavy) = ("flood".into(), "light".into(), "heavy".into());
    q.push(claim(Class::Standard, "flood"), 1);
    tokio::time::advance(Duration::from_millis(1)).await;
    let second = q.push(claim(Class::Standard, "light"), 2);
    q.charge(&flood, 1.0, 10_000);
    q.charge(&light, 1.0, 1_000);
    assert_eq!(q.first(Instant::now(), |_| true).expect("waiting").item, 2);
    // Weighted: 20000 tokens at weight 20 count 1000, under flood's 10000.
    q.push(claim(Class::Standard, "heavy"), 3);
    q.charge(&heavy, 20.0, 20_000);
    q.remove(second);
    assert_eq!(q.first(Instant::now(), |_| true).expect("waiting").item, 3);
    // A tenant never served starts at the least counter waiting (heavy's: it joined at light's
    // 1000 and was charged 1000 more), not at 0: no first place for having been away.
    let now = Instant::now();
    let idle = q.newcomer(&claim(Class::Standard, "idle"), now);
    assert!(q.any_ahead(idle, None, now, |_| true), "after heavy");
    q.push(claim(Class::Standard, "idle"), 4);
    assert_eq!(q.served("idle"), 2_000.0);
    // Another class's counters do not lift it.
    q.push(claim(Class::Batch, "fresh"), 5);
    assert_eq!(q.served("fresh"), 0.0);
}

/// Simulated: two tenants of equal weight keep entries waiting, one with ten times the other's
/// tokens per request. Served first-of-the-queue, each gets about half the tokens.
#[tokio::test(start_paused = true)]
async fn a_tenant_that_floods_gets_its_share() {
    let mut q: FairQueue<u64> = FairQueue::default();
    let mut served: HashMap<Arc<str>, u64> = HashMap::new();
    let tenants: [(Arc<str>, u64); 2] = [("big".into(), 1000), ("small".into(), 100)];
    for (tenant, cost) in &tenants {
        for _ in 0..4 {
            q.push(claim(Class::Standard, tenant), *cost);
        }
    }
    for _ in 0..2000 {
        let next = q.pop_first(Instant::now(), |_| true).expect("waiting");
        let tenant = next.claim.tenant.clone();
        q.charge(&tenant, 1.0, next.item);
        *served.entry(tenant.clone()).or_default() += next.item;
        q.push(next.claim, next.item);
    }
    let total = (served.values().sum::<u64>()) as f64;
    let small_share = served[&tenants[1].0] as f64 / total;
    eprintln!("the small tenant's share of the tokens served: {small_share:.3}");
    assert!(small_share >= 0.4, "small got {small_share:.3}");
}

/// Every bound refuses just past its ends and NaN, and accepts its ends where they are
/// included.
#[test]
fn sampling_bounds_refuse_what_is_out_and_name_the_field() {
    let ok = pb::SamplingParams {
        temperature: 0.7,
        top_p: Some(1.0),
        min_p: Some(0.0),
        repetition_penalty: Some(10.0),
        frequency_penalty: Some(-2.0),
        presence_penalty: Some(2.0),
        logit_bias: [(5, -100.0), (6, 100.0)].into(),
        logprobs: Some(crate::MAX_TOP_LOGPROBS),
        stop: vec!["\n".into()],
        ..Default::default()
    };
    assert_eq!(check_sampling(&ok), Ok(()));
    type Edit = fn(&mut pb::SamplingParams);
    let cases: [(Edit, &str); 12] = [
        (|s| s.temperature = -0.1, "sampling.temperature"),
        (|s| s.temperature = f32::INFINITY, "sampling.temperature"),
        (|s| s.temperature = f32::NAN, "sampling.temperature"),
        (|s| s.top_p = Some(0.0), "sampling.top_p"),
        (|s| s.top_p = Some(1.01), "sampling.top_p"),
        (|s| s.min_p = Some(1.5), "sampling.min_p"),
        (
            |s| s.repetition_penalty = Some(0.0),
            "sampling.repetition_penalty",
        ),
        (
            |s| s.frequency_penalty = Some(2.5),
            "sampling.frequency_penalty",
        ),
        (
            |s| s.presence_penalty = Some(f32::NAN),
            "sampling.presence_penalty",
        ),
        (
            |s| s.logit_bias = [(1, 101.0)].into(),
            "sampling.logit_bias",
        ),
        (|s| s.stop = vec![String::new()], "sampling.stop"),
        (|s| s.logprobs = Some(21), "sampling.logprobs"),
    ];
    for (edit, field) in cases {
        let mut bad = ok.clone();
        edit(&mut bad);
        let (got, reason) = check_sampling(&bad).expect_err(field);
        assert_eq!(got, field, "{reason}");
    }
    assert_eq!(
        TOP_P.refusal(0.0),
        "must be in (0, 1], got 0",
        "the message names the range"
    );
    assert_eq!(
        TEMPERATURE.refusal(-1.0),
        "must be a finite number at least 0, got -1"
    );
}
