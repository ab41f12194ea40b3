//! Where a paused stream's KV waits (preemption, [`crate::classes`]), and how it comes back.
//!
//! - **Pinned**: the sequence stays in the pool, out of the batch. Nothing is copied; it costs
//!   the pool's room, which the session cache would otherwise use. Chosen while the pinned
//!   streams' KV stays within the node's bound (`--park-pinned-bytes`), and always without a disk
//!   tier or a session cache.
//! - **Disk**: the sequence's whole blocks go into the session cache under their block hashes
//!   and then to the disk tier (the blocks other cached sequences share stay in the pool, where
//!   they already were); the rest of its KV, less than a block, is copied out and kept here. The
//!   sequence leaves the pool. Resuming reads the blocks back, as a follow-up turn's prefix
//!   would be, and appends the kept rest: the KV is the same bytes, so the stream goes on
//!   exactly where it stood. A block the tier lost (its bound, a damaged file, a full write
//!   queue) is computed again from the stream's tokens, and counted.
//!
//! Either way the request keeps its admission (its place and its worst-case KV blocks), so a
//! paused stream always has room to come back.

use tandem_engine::{BLOCK_TOKENS, Decoding, Engine, KvExport};

/// A paused stream's KV.
#[derive(Debug)]
pub enum Parked {
    Pinned,
    Disk {
        /// The block hashes of its whole blocks.
        hashes: Vec<u64>,
        /// The KV after its whole blocks.
        tail: KvExport,
    },
}

/// What a park cost.
#[derive(Debug)]
pub struct Parking {
    pub parked: Parked,
    /// The stream's KV, in bytes.
    pub bytes: u64,
    /// Of those, written to the disk tier.
    pub to_disk: u64,
}

/// What a resume did besides reading the KV back.
#[derive(Debug, Default)]
pub struct Resumed {
    /// Tokens computed again (the tier no longer had them).
    pub recomputed: usize,
}

/// Takes `decoding`'s KV out of the batch: pinned when it fits the `room` pinned streams have
/// left (or when nothing else can keep it), else to the disk tier. An engine error leaves it
/// pinned.
pub fn park(engine: &mut Engine, decoding: &Decoding, cache_salt: &str, room: u64) -> Parking {
    let seq = decoding.seq;
    let held = engine.seq_len(seq).unwrap_or(0).min(decoding.tokens.len());
    let bytes = (held * engine.kv_layout().token_bytes()) as u64;
    let pinned = Parking {
        parked: Parked::Pinned,
        bytes,
        to_disk: 0,
    };
    let no_tier = engine.config().spill.is_none() || !engine.prefix_cache_enabled();
    if bytes <= room || no_tier {
        return pinned;
    }
    let whole = held / BLOCK_TOKENS * BLOCK_TOKENS;
    let hashes = tandem_worker::block_hashes(engine.model(), cache_salt, &decoding.tokens[..whole]);
    let tail = match engine.export_kv(seq, whole..held) {
        Ok(tail) => tail,
        Err(e) => {
            tracing::warn!(error = %e, "cannot copy a paused stream's KV; keeping it pinned");
            return pinned;
        }
    };
    if let Err(e) = engine.cache_sequence(seq, &hashes) {
        tracing::warn!(error = %e, "cannot cache a paused stream's KV; keeping it pinned");
        return pinned;
    }
    let _ = engine.free(seq);
    let left = engine.release_cached(&hashes, true);
    Parking {
        parked: Parked::Disk { hashes, tail },
        bytes,
        to_disk: (left * engine.kv_layout().block_bytes()) as u64,
    }
}

/// Whether a stream parked on disk can come back without computing anything again: every one of
/// its blocks is in the pool's cache or written to the tier (writes finish a moment after the
/// park).
pub fn settled(engine: &Engine, parked: &Parked) -> bool {
    match parked {
        Parked::Pinned => true,
        Parked::Disk { hashes, .. } => engine.cached_prefix(hashes) == hashes.len(),
    }
}

/// Puts a paused stream's KV back into a sequence, `decoding.seq`, ready for the next step.
pub fn resume(
    engine: &mut Engine,
    decoding: &mut Decoding,
    parked: Parked,
) -> tandem_engine::Result<Resumed> {
    let Parked::Disk { hashes, tail } = parked else {
        return Ok(Resumed::default());
    };
    let (seq, reused) = engine.new_sequence_cached(&hashes);
    let whole = hashes.len() * BLOCK_TOKENS;
    let have = reused.tokens.min(whole);
    let rebuilt = (|| {
        if have < whole {
            engine.prefill(seq, &decoding.tokens[have..whole])?;
        }
        if !tail.tokens.is_empty() {
            engine.import_kv(seq, &tail)?;
        }
        Ok(())
    })();
    if let Err(e) = rebuilt {
        let _ = engine.free(seq);
        return Err(e);
    }
    decoding.seq = seq;
    Ok(Resumed {
        recomputed: whole - have,
    })
}
