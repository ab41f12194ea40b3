//! Client API keys and what each key may use: authentication (`authorization: Bearer KEY` on
//! gRPC and HTTP), the tenant a key belongs to (which partitions the prefix caches), and
//! per-key token-bucket rate limits and concurrent streams.
//!
//! The key file holds one key per line, only as its SHA-256:
//!
//! ```text
//! # tenant  key hash                                                                  limits
//! alice     sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  rpm=60 tpm=20000 streams=4
//! bob       sha256:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752
//! ```
//!
//! `rpm` (requests per minute), `tpm` (prompt plus completion tokens per minute) and `streams`
//! (concurrent generations) override the router's defaults for that key; 0 means unlimited.
//! `class` (`interactive`, `standard`, `batch`) is the highest priority class the key's requests
//! may ask for and the one they get without `x-priority`, and `weight` (a whole number, 1 by
//! default) its share of the tokens served within its class ([`crate::dispatch`]'s order).
//! `tandem keys new` adds a line and prints the key once. The file is read again whenever it
//! changes, so keys are added, revoked and re-limited without a restart; a file that no longer
//! parses is reported and the keys already loaded stay in force.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// The longest tenant name.
pub const MAX_TENANT_BYTES: usize = 64;
/// How often the key file is checked for changes.
const RELOAD_POLL: Duration = Duration::from_secs(1);

mod keyfile;

pub use keyfile::{KeyEntry, cache_partition, hash_key, key_line, parse_key_file, valid_tenant};

pub use tandem_proto::policy::Class;

/// Per-key limits (`None` is unlimited), and the key's standing among the others: its priority
/// class (the highest its requests may ask for; `standard` when unset) and its weight within the
/// class (its share of the tokens served; 1 when unset).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u32>,
    pub streams: Option<u32>,
    pub class: Option<Class>,
    pub weight: Option<u32>,
}

impl KeyLimits {
    fn from_flags(rpm: u32, tpm: u32, streams: u32) -> Self {
        let some = |n: u32| (n > 0).then_some(n);
        Self {
            requests_per_minute: some(rpm),
            tokens_per_minute: some(tpm),
            streams: some(streams),
            class: None,
            weight: None,
        }
    }
}

/// The router's authentication settings.
#[derive(Clone, Debug, Default)]
pub struct AuthConfig {
    /// The key file; `None` serves every client without a key (one shared tenant).
    pub key_file: Option<PathBuf>,
    /// Limits for keys whose line sets none.
    pub defaults: KeyLimits,
}

impl AuthConfig {
    /// Defaults from flag values, where 0 means unlimited.
    pub fn with_defaults(key_file: Option<PathBuf>, rpm: u32, tpm: u32, streams: u32) -> Self {
        Self {
            key_file,
            defaults: KeyLimits::from_flags(rpm, tpm, streams),
        }
    }
}

/// A token bucket that may go into debt. Written here rather than taken from `governor`, whose
/// GCRA cells cannot be returned or overdrawn: a generation reserves its `max_tokens` when it is
/// admitted and gives back what it did not generate when it ends.
#[derive(Debug)]
struct Bucket {
    per_minute: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: u32, now: Instant) -> Self {
        Self {
            per_minute: f64::from(per_minute),
            level: f64::from(per_minute),
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + elapsed * self.per_minute / 60.0).min(self.per_minute);
        self.at = now;
    }

    /// How long until `cost` (at most a full bucket) is available; zero when it is now.
    fn wait_for(&mut self, cost: f64, now: Instant) -> Duration {
        self.refill(now);
        let short = cost.min(self.per_minute) - self.level;
        if short <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(short * 60.0 / self.per_minute)
        }
    }

    fn set_rate(&mut self, per_minute: u32, now: Instant) {
        self.refill(now);
        self.per_minute = f64::from(per_minute);
        self.level = self.level.min(self.per_minute);
    }
}

/// The running state of one key: its limits, buckets and streams, shared by all its
/// connections and kept across reloads of the key file.
#[derive(Debug, Default)]
struct KeyUsage {
    /// Only `streams` is read from here; the rates live in the buckets.
    limits: KeyLimits,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    streams: u32,
}

impl KeyUsage {
    /// Applies a key's (re)loaded limits: a bucket appears full, keeps its level under a new
    /// rate, or goes away with its limit.
    fn set_limits(&mut self, limits: KeyLimits, now: Instant) {
        let sync = |bucket: &mut Option<Bucket>, rate: Option<u32>| match (bucket.as_mut(), rate) {
            (_, None) => *bucket = None,
            (None, Some(r)) => *bucket = Some(Bucket::new(r, now)),
            (Some(b), Some(r)) => b.set_rate(r, now),
        };
        sync(&mut self.requests, limits.requests_per_minute);
        sync(&mut self.tokens, limits.tokens_per_minute);
        self.limits = limits;
    }
}

#[derive(Debug, Default)]
struct KeyState {
    usage: Mutex<KeyUsage>,
}

impl KeyState {
    fn usage(&self) -> std::sync::MutexGuard<'_, KeyUsage> {
        self.usage.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Who a request comes from: the tenant (empty without a key file) and its key's state.
#[derive(Clone, Debug)]
pub struct Principal {
    pub tenant: Arc<str>,
    state: Option<Arc<KeyState>>,
}

impl Principal {
    /// The principal of every request when no key file is configured.
    pub fn anonymous() -> Self {
        Self {
            tenant: Arc::from(""),
            state: None,
        }
    }

    /// The priority class of a request that asked for `asked` (`x-priority`), or none, and its
    /// key's weight within the class. The class is the key's, or a lower one it asked for;
    /// without a key file, what it asked for (`standard` when nothing). The weight is the key's
    /// `weight=`, else 1.
    pub fn standing(&self, asked: Option<Class>) -> (Class, u32) {
        match &self.state {
            Some(state) => {
                let limits = state.usage().limits;
                let key = limits.class.unwrap_or_default();
                (
                    asked.map_or(key, |asked| asked.max(key)),
                    limits.weight.unwrap_or(1),
                )
            }
            None => (asked.unwrap_or_default(), 1),
        }
    }

    /// Admits one generation of `prompt_tokens` that may generate `max_tokens` against the
    /// key's limits, or says how long to wait.
    pub fn admit(&self, prompt_tokens: usize, max_tokens: u32) -> Result<Grant> {
        let Some(state) = &self.state else {
            return Ok(Grant::default());
        };
        let cost = (prompt_tokens + max_tokens as usize) as f64;
        let now = Instant::now();
        let mut usage = state.usage();
        if let Some(max) = usage.limits.streams
            && usage.streams >= max
        {
            return Err(Error::RateLimited {
                what: "concurrent streams",
                retry_after: Duration::from_secs(1),
            });
        }
        if let Some(b) = &mut usage.requests {
            let wait = b.wait_for(1.0, now);
            if !wait.is_zero() {
                return Err(Error::RateLimited {
                    what: "requests per minute",
                    retry_after: wait,
                });
            }
        }
        if let Some(b) = &mut usage.tokens {
            let wait = b.wait_for(cost, now);
            if !wait.is_zero() {
                return Err(Error::RateLimited {
                    what: "tokens per minute",
                    retry_after: wait,
                });
            }
        }
        if let Some(b) = &mut usage.requests {
            b.level -= 1.0;
        }
        if let Some(b) = &mut usage.tokens {
            b.level -= cost;
        }
        usage.streams += 1;
        Ok(Grant {
            state: Some(state.clone()),
            reserved: max_tokens,
        })
    }
}

/// One admitted generation's hold on its key: a stream, and the completion tokens it reserved.
/// Dropping it frees the stream; [`Grant::finish`] first returns the tokens not generated.
#[derive(Debug, Default)]
pub struct Grant {
    state: Option<Arc<KeyState>>,
    reserved: u32,
}

impl Grant {
    pub fn finish(self, generated: usize) {
        if let Some(state) = &self.state
            && let Some(b) = &mut state.usage().tokens
        {
            let unused = f64::from(self.reserved) - generated as f64;
            b.level = (b.level + unused.max(0.0)).min(b.per_minute);
        }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(state) = &self.state {
            let mut usage = state.usage();
            usage.streams = usage.streams.saturating_sub(1);
        }
    }
}

/// A key in force.
#[derive(Debug)]
struct LoadedKey {
    hash: [u8; 32],
    tenant: Arc<str>,
    /// Carried over from the previous load of the same hash, so that a re-read file refills
    /// nobody's buckets.
    state: Arc<KeyState>,
}

#[derive(Debug, Default)]
struct Loaded {
    keys: Vec<LoadedKey>,
    /// The file's text when last read, parsed or not: a reload happens (and a parse error is
    /// reported) once per change of it, whatever the file system's timestamps say.
    text: String,
}

/// The router's keys, reloaded as their file changes.
#[derive(Debug)]
pub struct KeyStore {
    config: AuthConfig,
    loaded: RwLock<Loaded>,
}

impl KeyStore {
    /// Reads the key file, if one is configured; a missing or malformed file is an error.
    pub fn open(config: AuthConfig) -> Result<Arc<Self>> {
        let store = Self {
            config,
            loaded: RwLock::default(),
        };
        if store.config.key_file.is_some() {
            store.reload()?;
        }
        Ok(Arc::new(store))
    }

    /// Whether clients must present a key.
    pub fn required(&self) -> bool {
        self.config.key_file.is_some()
    }

    fn loaded(&self) -> std::sync::RwLockReadGuard<'_, Loaded> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner())
    }

    /// How many keys are loaded.
    pub fn key_count(&self) -> usize {
        self.loaded().keys.len()
    }

    fn reload(&self) -> Result<bool> {
        let Some(path) = &self.config.key_file else {
            return Ok(false);
        };
        let failed = |reason: String| Error::InvalidArgument {
            field: "api_keys",
            reason: format!("{}: {reason}", path.display()),
        };
        let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
        let mut loaded = self.loaded.write().unwrap_or_else(|e| e.into_inner());
        if loaded.text == text {
            return Ok(false);
        }
        let entries = parse_key_file(&text);
        loaded.text = text;
        let now = Instant::now();
        let keys = entries
            .map_err(failed)?
            .into_iter()
            .map(|e| {
                let state = loaded
                    .keys
                    .iter()
                    .find(|k| k.hash == e.hash)
                    .map_or_else(Arc::default, |k| k.state.clone());
                state.usage().set_limits(self.limits_of(&e), now);
                LoadedKey {
                    hash: e.hash,
                    tenant: Arc::from(e.tenant),
                    state,
                }
            })
            .collect();
        loaded.keys = keys;
        Ok(true)
    }

    fn limits_of(&self, e: &KeyEntry) -> KeyLimits {
        let d = self.config.defaults;
        let pick = |own: Option<u32>, default: Option<u32>| match own {
            Some(0) => None,
            Some(n) => Some(n),
            None => default,
        };
        KeyLimits {
            requests_per_minute: pick(e.limits.requests_per_minute, d.requests_per_minute),
            tokens_per_minute: pick(e.limits.tokens_per_minute, d.tokens_per_minute),
            streams: pick(e.limits.streams, d.streams),
            class: e.limits.class,
            weight: e.limits.weight,
        }
    }

    /// Checks the key file for changes every second until `cancel`.
    pub async fn watch(self: Arc<Self>, cancel: CancellationToken) {
        if !self.required() {
            return;
        }
        loop {
            tokio::select! {
                () = tokio::time::sleep(RELOAD_POLL) => {}
                () = cancel.cancelled() => return,
            }
            match self.reload() {
                Ok(true) => tracing::info!(keys = self.key_count(), "API keys reloaded"),
                Ok(false) => {}
                Err(e) => tracing::error!(error = %e, "API keys not reloaded; the old ones stay"),
            }
        }
    }

    /// The principal for an `authorization` header value. Every stored hash is compared, in
    /// constant time, so the time taken tells nothing about which key, or how much of one,
    /// matched.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal> {
        if !self.required() {
            return Ok(Principal::anonymous());
        }
        let key = authorization
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(Error::Unauthenticated)?;
        let hash = hash_key(key);
        let loaded = self.loaded();
        let mut found = None;
        for k in &loaded.keys {
            if bool::from(k.hash.ct_eq(&hash)) {
                found = Some(k);
            }
        }
        let key = found.ok_or(Error::Unauthenticated)?;
        Ok(Principal {
            tenant: key.tenant.clone(),
            state: Some(key.state.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_refill_over_a_minute_and_may_go_into_debt() {
        let t0 = Instant::now();
        let mut b = Bucket::new(60, t0);
        assert_eq!(b.wait_for(60.0, t0), Duration::ZERO);
        b.level -= 100.0; // a reservation larger than the bucket is still admitted when full
        // 41 short of 1 at 1 per second.
        let wait = b.wait_for(1.0, t0);
        assert!((wait.as_secs_f64() - 41.0).abs() < 1e-6, "{wait:?}");
        assert_eq!(
            b.wait_for(1.0, t0 + Duration::from_secs(41)),
            Duration::ZERO
        );
        // Refills stop at the rate.
        assert_eq!(
            b.wait_for(60.0, t0 + Duration::from_secs(3600)),
            Duration::ZERO
        );
        assert!((b.level - 60.0).abs() < 1e-9);
    }
}
