//! Request policy, in one place for every process that applies it: the priority classes and how
//! a wait ages them ([`Class`]), the fair queue the router's admission order, the prefill
//! node's waiting prompts and the decode node's waiting sequences all rank by ([`FairQueue`]),
//! and the bounds of a request's sampling ([`check_sampling`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::v1 as pb;

/// A request's priority class, highest first: queues serve them in this order, aged by the
/// wait ([`Class::aged`]). The router settles it (a key's class, lowered by `x-priority`) and
/// tells the workers (`Priority` in the worker contract).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Interactive = 0,
    #[default]
    Standard = 1,
    Batch = 2,
}

impl Class {
    /// Every class, highest first.
    pub const ALL: [Class; 3] = [Class::Interactive, Class::Standard, Class::Batch];
    /// How many classes there are: the length of an array by class ([`Class::slot`]).
    pub const COUNT: usize = Self::ALL.len();

    pub fn name(self) -> &'static str {
        match self {
            Class::Interactive => "interactive",
            Class::Standard => "standard",
            Class::Batch => "batch",
        }
    }

    /// The class named `name` (as `x-priority` and a key file's `class=` spell it).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Its index in an array by class, highest first.
    pub fn slot(self) -> usize {
        self as usize
    }

    /// The class as the worker contract names it (`Priority`).
    pub fn to_pb(self) -> pb::Priority {
        match self {
            Class::Interactive => pb::Priority::Interactive,
            Class::Standard => pb::Priority::Standard,
            Class::Batch => pb::Priority::Batch,
        }
    }

    /// The class of a worker request's `priority` field: unset is standard; `None` for a value
    /// no class has.
    pub fn from_pb(priority: i32) -> Option<Self> {
        Some(match pb::Priority::try_from(priority).ok()? {
            pb::Priority::Interactive => Class::Interactive,
            pb::Priority::Unspecified | pb::Priority::Standard => Class::Standard,
            pb::Priority::Batch => Class::Batch,
        })
    }

    /// The class one ranks as after waiting `waited`: one higher per [`AGE_STEP`], up to the
    /// highest, so that no class is starved for good.
    pub fn aged(self, waited: Duration) -> Self {
        let steps = (waited.as_secs_f64() / AGE_STEP.as_secs_f64()).min(Self::COUNT as f64);
        Self::ALL[(self as usize).saturating_sub(steps as usize)]
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How long a request waits for its turn before it ranks one class higher: the router's
/// admission order, the prefill node's queue and the decode node's batch slots all age by it.
pub const AGE_STEP: Duration = Duration::from_secs(10);

/// Where an entry of a [`FairQueue`] stands: lower goes first. Compared field by field: the
/// class aged by the wait, then whether its stream has begun (a begun one first), then its
/// tenant's tokens served per weight, then since when it waits, then the order it came in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rank {
    pub class: Class,
    fresh: bool,
    served: f64,
    since: Instant,
    id: u64,
}

impl Eq for Rank {}

impl PartialOrd for Rank {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Rank {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.class.cmp(&o.class))
            .then(self.fresh.cmp(&o.fresh))
            .then(self.served.total_cmp(&o.served))
            .then(self.since.cmp(&o.since))
            .then(self.id.cmp(&o.id))
    }
}

/// Who waits in a [`FairQueue`], and how.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Claim {
    pub class: Class,
    /// Who the request is for (the router's tenant; one shared tenant without keys).
    pub tenant: Arc<str>,
    /// Its stream has begun (a decode sequence paused by a preemption): it goes before fresh
    /// ones of its rank, its client already reading.
    pub begun: bool,
}

/// A waiting entry of a [`FairQueue`].
#[derive(Debug)]
pub struct Entry<T> {
    pub claim: Claim,
    /// When it began waiting.
    pub since: Instant,
    pub item: T,
    id: u64,
}

impl<T> Entry<T> {
    /// Its id in the queue (in the order entries came in).
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// Waiting requests, served in the order of their [`Rank`]:
///
/// ```text
/// rank = (class, less the classes it has aged; begun before fresh; tokens its tenant was served ÷ its weight; arrival)
/// ```
///
/// - **Classes in strict order**, a wait of [`AGE_STEP`] ranking one class higher, and one more
///   per further step.
/// - **Within a class, fairness between tenants by tokens served** (a virtual token counter,
///   after Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): each tenant is
///   charged what it was served, divided by its weight ([`FairQueue::charge`]), and the tenant
///   charged least goes first. A tenant that starts waiting in a class where it had nothing
///   waiting is lifted to the least counter among those waiting there, so idling earns no
///   credit: a tenant that floods gets its weighted share, and one that comes back is not
///   starved by a history it did not use.
/// - Then arrival.
///
/// Every operation is a pass over the waiting entries: queues hold hundreds, not millions.
#[derive(Debug)]
pub struct FairQueue<T> {
    entries: Vec<Entry<T>>,
    /// Tokens served per tenant, divided by its weight.
    served: HashMap<Arc<str>, f64>,
    next: u64,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            served: HashMap::new(),
            next: 0,
        }
    }
}

impl<T> FairQueue<T> {
    fn served(&self, tenant: &str) -> f64 {
        self.served.get(tenant).copied().unwrap_or(0.0)
    }

    /// `claim`'s counter as it starts waiting: a tenant with nothing waiting in the class starts
    /// at least at the least counter of those that have.
    fn joining(&self, claim: &Claim) -> f64 {
        let own = self.served(&claim.tenant);
        let in_class = |e: &&Entry<T>| e.claim.class == claim.class;
        if (self.entries.iter().filter(in_class)).any(|e| e.claim.tenant == claim.tenant) {
            return own;
        }
        let floor = (self.entries.iter().filter(in_class))
            .map(|e| self.served(&e.claim.tenant))
            .min_by(f64::total_cmp);
        floor.map_or(own, |floor| own.max(floor))
    }

    /// Adds `item` for `claim`, waiting from now; returns its id.
    pub fn push(&mut self, claim: Claim, item: T) -> u64 {
        self.push_since(claim, Instant::now(), item)
    }

    /// Adds `item` for `claim`, waiting since `since`; returns its id.
    pub fn push_since(&mut self, claim: Claim, since: Instant, item: T) -> u64 {
        let served = self.joining(&claim);
        self.served.insert(claim.tenant.clone(), served);
        let id = self.next;
        self.next += 1;
        self.entries.push(Entry {
            claim,
            since,
            item,
            id,
        });
        id
    }

    /// The rank of a waiting entry at `now`.
    pub fn rank(&self, entry: &Entry<T>, now: Instant) -> Rank {
        Rank {
            class: entry
                .claim
                .class
                .aged(now.saturating_duration_since(entry.since)),
            fresh: !entry.claim.begun,
            served: self.served(&entry.claim.tenant),
            since: entry.since,
            id: entry.id,
        }
    }

    /// The rank `claim` would have if it began waiting at `now`: after every entry of its rank.
    pub fn newcomer(&self, claim: &Claim, now: Instant) -> Rank {
        Rank {
            class: claim.class,
            fresh: !claim.begun,
            served: self.joining(claim),
            since: now,
            id: u64::MAX,
        }
    }

    /// Whether an entry that `among` lets, other than `own`, ranks before `rank`.
    pub fn any_ahead(
        &self,
        rank: Rank,
        own: Option<u64>,
        now: Instant,
        among: impl Fn(&Entry<T>) -> bool,
    ) -> bool {
        (self.entries.iter())
            .filter(|e| Some(e.id) != own && among(e))
            .any(|e| self.rank(e, now) < rank)
    }

    /// The entry that goes first of those `among` lets.
    pub fn first(&self, now: Instant, among: impl Fn(&Entry<T>) -> bool) -> Option<&Entry<T>> {
        (self.entries.iter())
            .filter(|e| among(e))
            .min_by_key(|e| self.rank(e, now))
    }

    /// Takes the entry that goes first of those `among` lets.
    pub fn pop_first(
        &mut self,
        now: Instant,
        among: impl Fn(&Entry<T>) -> bool,
    ) -> Option<Entry<T>> {
        let id = self.first(now, among)?.id;
        self.remove(id)
    }

    /// Takes the entry of id `id`.
    pub fn remove(&mut self, id: u64) -> Option<Entry<T>> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        Some(self.entries.swap_remove(i))
    }

    pub fn get(&self, id: u64) -> Option<&Entry<T>> {
        self.entries.iter().find(|e| e.id == id)
    }

    /// The waiting entries, in no order.
    pub fn iter(&self) -> impl Iterator<Item = &Entry<T>> {
        self.entries.iter()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Charges `tenant` for `tokens` served, at its `weight`.
    pub fn charge(&mut self, tenant: &Arc<str>, weight: f64, tokens: u64) {
        *self.served.entry(tenant.clone()).or_insert(0.0) += tokens as f64 / weight.max(1e-3);
    }
}

/// A range a sampling value must be in: from `low` (excluded if `low_open`) to `high`
/// (included).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound {
    pub low: f32,
    pub low_open: bool,
    pub high: f32,
}

impl Bound {
    pub fn contains(self, v: f32) -> bool {
        let above = if self.low_open {
            v > self.low
        } else {
            v >= self.low
        };
        above && v <= self.high
    }

    /// Why `v` is out of it, for an error message.
    pub fn refusal(self, v: f32) -> String {
        format!("must be {self}, got {v}")
    }
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.high == f32::MAX {
            let at = if self.low_open { "above" } else { "at least" };
            return write!(f, "a finite number {at} {}", self.low);
        }
        let open = if self.low_open { '(' } else { '[' };
        write!(f, "in {open}{}, {}]", self.low, self.high)
    }
}

/// The range from `low` to `high`, both included.
pub const fn closed(low: f32, high: f32) -> Bound {
    Bound {
        low,
        low_open: false,
        high,
    }
}

/// `temperature`: 0 is greedy.
pub const TEMPERATURE: Bound = closed(0.0, f32::MAX);
/// OpenAI's temperature, 0 to 2: what its HTTP APIs accept, and a server's defaults may set.
pub const OPENAI_TEMPERATURE: Bound = closed(0.0, 2.0);
/// `frequency_penalty` and `presence_penalty` (OpenAI's range).
pub const PENALTY: Bound = closed(-2.0, 2.0);
/// `repetition_penalty`: 1 is off.
pub const REPETITION_PENALTY: Bound = Bound {
    low: 0.0,
    low_open: true,
    high: 10.0,
};
/// `top_p`: 1 keeps every token.
pub const TOP_P: Bound = Bound {
    low: 0.0,
    low_open: true,
    high: 1.0,
};
/// `min_p`: 0 is off.
pub const MIN_P: Bound = closed(0.0, 1.0);
/// Each `logit_bias` value.
pub const LOGIT_BIAS: Bound = closed(-100.0, 100.0);

/// A request's sampling within its bounds: temperature, penalties, top-p, min-p, logit
/// biases, stop strings and the log-probabilities asked for. What depends on the model or on
/// the defaults filled in (token ids within the vocabulary, `max_tokens` and `min_tokens`
/// against the context) is checked by whoever knows them. The error names the field
/// (`sampling.…`) and why.
pub fn check_sampling(s: &pb::SamplingParams) -> Result<(), (&'static str, String)> {
    let values = [
        ("sampling.temperature", Some(s.temperature), TEMPERATURE),
        ("sampling.frequency_penalty", s.frequency_penalty, PENALTY),
        ("sampling.presence_penalty", s.presence_penalty, PENALTY),
        (
            "sampling.repetition_penalty",
            s.repetition_penalty,
            REPETITION_PENALTY,
        ),
        ("sampling.top_p", s.top_p, TOP_P),
        ("sampling.min_p", s.min_p, MIN_P),
    ];
    for (field, value, bound) in values {
        if let Some(v) = value.filter(|&v| !bound.contains(v)) {
            return Err((field, bound.refusal(v)));
        }
    }
    if let Some((id, &bias)) = (s.logit_bias.iter()).find(|(_, b)| !LOGIT_BIAS.contains(**b)) {
        return Err((
            "sampling.logit_bias",
            format!("token {id}: {}", LOGIT_BIAS.refusal(bias)),
        ));
    }
    if s.stop.iter().any(String::is_empty) {
        return Err(("sampling.stop", "stop strings must not be empty".into()));
    }
    if s.logprobs.is_some_and(|k| k > crate::MAX_TOP_LOGPROBS) {
        return Err((
            "sampling.logprobs",
            format!("at most {} alternatives", crate::MAX_TOP_LOGPROBS),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
