//! The prefix cache's disk tier: a block evicted from the pool is written to a directory, named
//! by its block hash, and read back when a later sequence's prefix goes on past what the pool
//! holds, instead of being computed again.
//!
//! - The configured directory holds slots (`slot-0`, `slot-1`, ...), one per node that uses it
//!   at once: a node takes the first slot whose lock it can hold, so replicas that share one
//!   volume each get their own, and a restarted node gets one back with the KV a node of the
//!   same model left there.
//! - One directory per model and KV layout in a slot (`<fingerprint>-<dtype>`); the other
//!   models' directories are removed at start, and the files of this one are kept, so that a
//!   restarted node still has them.
//! - Only the owner may read it: directories are made 0700 and files 0600 (a block holds what a
//!   prompt said).
//! - A file is a header (magic, fingerprint, layout, hash), the block's bytes as the pool holds
//!   them, and a CRC32C of both. A file whose CRC, size or header does not match is never
//!   restored: it is deleted, and the prefix is computed from there.
//! - Writes happen on the tier's own thread, fed by a bounded queue: the step loop only copies the
//!   block out. A block the queue has no room for is not spilled (counted).
//! - Bounded by bytes: past the bound, the least recently used files go.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::kv::{KvDtype, KvLayout};

/// Where the disk tier lives and how large it may grow.
#[derive(Clone, Debug)]
pub struct SpillConfig {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

const MAGIC: &[u8; 8] = b"TANDMKV1";
/// Most nodes that use one directory at once, each in a slot of its own.
pub const SLOTS: usize = 64;
/// Bytes queued for the writer at most; a block beyond them is not spilled.
const QUEUE_BYTES: usize = 32 << 20;

/// What the tier has done since the engine started.
#[derive(Debug, Default)]
pub struct SpillStats {
    /// Blocks written to disk.
    pub stored: AtomicU64,
    /// Blocks read back into the pool, and the time their reads took.
    pub restored: AtomicU64,
    pub restore_nanos: AtomicU64,
    /// Files found damaged on read (deleted; their prefix was computed again).
    pub corrupt: AtomicU64,
    /// Blocks not spilled because the writer was behind.
    pub dropped: AtomicU64,
    /// Bytes on disk now.
    pub bytes: AtomicU64,
}

#[derive(Debug, Default)]
struct Index {
    /// Each stored block's file size and when it was last used.
    entries: HashMap<u64, (u64, u64)>,
    /// `(last_used, hash)`, least recent first.
    lru: BTreeSet<(u64, u64)>,
    clock: u64,
    bytes: u64,
}

impl Index {
    fn touch(&mut self, hash: u64) -> bool {
        self.clock += 1;
        let clock = self.clock;
        let Some(entry) = self.entries.get_mut(&hash) else {
            return false;
        };
        self.lru.remove(&(entry.1, hash));
        entry.1 = clock;
        self.lru.insert((clock, hash));
        true
    }

    /// Makes a stored block the least recently used, the first to go for room.
    fn demote(&mut self, hash: u64) -> bool {
        let Some(entry) = self.entries.get_mut(&hash) else {
            return false;
        };
        self.lru.remove(&(entry.1, hash));
        entry.1 = 0;
        self.lru.insert((0, hash));
        true
    }

    fn insert(&mut self, hash: u64, size: u64) {
        self.remove(hash);
        self.clock += 1;
        self.entries.insert(hash, (size, self.clock));
        self.lru.insert((self.clock, hash));
        self.bytes += size;
    }

    fn remove(&mut self, hash: u64) -> bool {
        match self.entries.remove(&hash) {
            Some((size, used)) => {
                self.lru.remove(&(used, hash));
                self.bytes -= size;
                true
            }
            None => false,
        }
    }

    /// The least recently used block, taken out.
    fn pop_oldest(&mut self) -> Option<u64> {
        let (_, hash) = self.lru.pop_first()?;
        let (size, _) = self.entries.remove(&hash)?;
        self.bytes -= size;
        Some(hash)
    }
}

impl SpillStats {
    /// Tokens read back per second, over every read so far; 0 before the first.
    pub fn restore_tokens_per_second(&self) -> f64 {
        let nanos = self.restore_nanos.load(Ordering::Relaxed);
        let tokens = self.restored.load(Ordering::Relaxed) * crate::BLOCK_TOKENS as u64;
        if nanos == 0 {
            0.0
        } else {
            tokens as f64 / (nanos as f64 / 1e9)
        }
    }
}

/// What the tier and its writer thread share.
#[derive(Debug)]
struct Shared {
    dir: PathBuf,
    max_bytes: u64,
    index: Mutex<Index>,
    stats: Arc<SpillStats>,
    /// Blocks that left the tier (deleted for room, found damaged, or never written) since the
    /// engine last asked: its cache events announce them.
    gone: Mutex<Vec<u64>>,
}

impl Shared {
    fn index(&self) -> MutexGuard<'_, Index> {
        // The index stays consistent under every step of its methods; a panic elsewhere
        // cannot leave it half-changed.
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}.kv"))
    }

    fn gone(&self) -> MutexGuard<'_, Vec<u64>> {
        self.gone.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn forget(&self, hash: u64) {
        let mut index = self.index();
        if index.remove(hash) {
            let _ = fs::remove_file(self.path(hash));
        }
        self.stats.bytes.store(index.bytes, Ordering::Relaxed);
        self.gone().push(hash);
    }

    /// Writes one file (to a temporary name, renamed once whole), then keeps the tier within
    /// its bound.
    fn write(&self, hash: u64, file: &[u8]) {
        let path = self.path(hash);
        let tmp = path.with_extension("tmp");
        let written = private_file(&tmp)
            .and_then(|mut f| f.write_all(file))
            .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!(error = %e, path = %tmp.display(), "cannot spill a KV block");
            let _ = fs::remove_file(&tmp);
            self.gone().push(hash);
            return;
        }
        let mut index = self.index();
        index.insert(hash, file.len() as u64);
        self.trim(&mut index);
        self.stats.stored.fetch_add(1, Ordering::Relaxed);
    }

    /// Deletes the least recently used files until the tier is within its bound.
    fn trim(&self, index: &mut Index) {
        let mut gone = Vec::new();
        while index.bytes > self.max_bytes {
            let Some(old) = index.pop_oldest() else { break };
            let _ = fs::remove_file(self.path(old));
            gone.push(old);
        }
        self.stats.bytes.store(index.bytes, Ordering::Relaxed);
        self.gone().extend(gone);
    }
}

/// The disk tier of one engine.
#[derive(Debug)]
pub(crate) struct Spill {
    shared: Arc<Shared>,
    /// What every file of this tier starts with, up to the hash.
    header: Vec<u8>,
    block_bytes: usize,
    jobs: Option<SyncSender<(u64, Vec<u8>)>>,
    writer: Option<JoinHandle<()>>,
    /// Held for the engine's life: the lock that keeps a second node out of the directory.
    _lock: File,
}

impl Spill {
    /// Opens the tier for `fingerprint` and `layout` under `config.dir`, keeping the files a
    /// previous run of the same model left within the bound, and removing other models'.
    pub fn open(
        config: &SpillConfig,
        fingerprint: &[u8; 32],
        layout: KvLayout,
        stats: Arc<SpillStats>,
    ) -> Result<Self> {
        let io = |what: &str, path: &Path, e: std::io::Error| Error::InvalidArgument {
            field: "kv_spill_dir",
            reason: format!("{what} {}: {e}", path.display()),
        };
        let (slot, lock) =
            take_slot(&config.dir).map_err(|(path, e)| io("cannot use", &path, e))?;
        let fp: String = fingerprint[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let name = format!("{fp}-{}", layout.dtype.name());
        let dir = slot.join(&name);
        let entries = fs::read_dir(&slot).map_err(|e| io("cannot read", &slot, e))?;
        for entry in entries.flatten() {
            let path = entry.path();
            let other = entry
                .file_name()
                .to_str()
                .is_some_and(|n| n != name && is_tier_dir(n));
            if other && path.is_dir() {
                tracing::info!(dir = %path.display(), "removing another model's spilled KV");
                let _ = fs::remove_dir_all(&path);
            }
        }
        private_dir(&dir).map_err(|e| io("cannot create", &dir, e))?;

        let mut header = MAGIC.to_vec();
        header.extend_from_slice(fingerprint);
        for v in [layout.n_layers, layout.n_kv_heads, layout.head_dim] {
            header.extend_from_slice(&(v as u32).to_le_bytes());
        }
        header.extend_from_slice(layout.dtype.name().as_bytes());
        let block_bytes = layout.block_bytes();
        let (index, damaged) = scan(&dir, header.len() + 8 + block_bytes + 4);
        stats.corrupt.fetch_add(damaged, Ordering::Relaxed);
        let shared = Arc::new(Shared {
            index: Mutex::new(index),
            dir,
            max_bytes: config.max_bytes,
            stats,
            gone: Mutex::default(),
        });
        {
            let mut index = shared.index();
            shared.trim(&mut index);
            // Nobody has heard of these: there is nothing to take back.
            shared.gone().clear();
            if !index.entries.is_empty() {
                tracing::info!(
                    blocks = index.entries.len(),
                    bytes = index.bytes,
                    dir = %shared.dir.display(),
                    "spilled KV kept from an earlier run"
                );
            }
        }
        let (jobs, queue) =
            mpsc::sync_channel::<(u64, Vec<u8>)>((QUEUE_BYTES / block_bytes.max(1)).max(4));
        let writer = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("tandem-kv-spill".into())
                .spawn(move || {
                    for (hash, file) in queue {
                        shared.write(hash, &file);
                    }
                })
                .map_err(|e| io("cannot start the writer for", &config.dir, e))?
        };
        Ok(Self {
            shared,
            header,
            block_bytes,
            jobs: Some(jobs),
            writer: Some(writer),
            _lock: lock,
        })
    }

    /// Whether a block is on disk, marking it as just used.
    pub fn contains(&self, hash: u64) -> bool {
        self.shared.index().touch(hash)
    }

    /// Whether a block is on disk, making it the first to go when the tier needs room: a
    /// released sequence's block, which another spilled sequence may still share.
    pub fn demote(&self, hash: u64) -> bool {
        self.shared.index().demote(hash)
    }

    /// Queues a block's bytes to be written, never waiting; `false` when the queue had no room
    /// (the block is then not spilled).
    pub fn store(&self, hash: u64, block: &[u8]) -> bool {
        let Some(jobs) = &self.jobs else { return false };
        let queued = jobs.try_send((hash, self.file(hash, block))).is_ok();
        if !queued {
            self.shared.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
        queued
    }

    /// Every block on disk now.
    pub fn hashes(&self) -> Vec<u64> {
        self.shared.index().entries.keys().copied().collect()
    }

    /// The blocks that left the tier since the last call.
    pub fn take_gone(&self) -> Vec<u64> {
        std::mem::take(&mut *self.shared.gone())
    }

    /// Queues a block's bytes to be written, waiting for room in the queue.
    pub fn store_waiting(&self, hash: u64, block: &[u8]) {
        if let Some(jobs) = &self.jobs
            && jobs.send((hash, self.file(hash, block))).is_err()
        {
            self.shared.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A block's file: header, hash, bytes, CRC32C of all three.
    fn file(&self, hash: u64, block: &[u8]) -> Vec<u8> {
        debug_assert_eq!(block.len(), self.block_bytes);
        let mut file = Vec::with_capacity(self.header.len() + 8 + block.len() + 4);
        file.extend_from_slice(&self.header);
        file.extend_from_slice(&hash.to_le_bytes());
        file.extend_from_slice(block);
        let crc = crc32c::crc32c(&file);
        file.extend_from_slice(&crc.to_le_bytes());
        file
    }

    /// Reads a block back into `out`; `false` when it is not there or is damaged (a damaged
    /// file is deleted).
    pub fn load(&self, hash: u64, out: &mut [u8]) -> bool {
        let started = std::time::Instant::now();
        let Ok(file) = fs::read(self.shared.path(hash)) else {
            self.shared.forget(hash);
            return false;
        };
        let body = self.header.len() + 8;
        let whole = file.len() == body + self.block_bytes + 4
            && file[..self.header.len()] == self.header[..]
            && file[self.header.len()..body] == hash.to_le_bytes()
            && {
                let (data, crc) = file.split_at(file.len() - 4);
                crc32c::crc32c(data).to_le_bytes() == crc
            };
        if !whole {
            tracing::warn!(
                hash = format!("{hash:016x}"),
                "a spilled KV block is damaged; computing it again"
            );
            self.shared.stats.corrupt.fetch_add(1, Ordering::Relaxed);
            self.shared.forget(hash);
            return false;
        }
        out.copy_from_slice(&file[body..body + self.block_bytes]);
        let stats = &self.shared.stats;
        stats.restored.fetch_add(1, Ordering::Relaxed);
        stats
            .restore_nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        true
    }
}

impl Drop for Spill {
    fn drop(&mut self) {
        // The writer finishes the queue, then ends.
        self.jobs = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Whether `name` is a tier's directory (`<16 hex digits>-<dtype>`): the only directories
/// removed at start, so that a tier pointed at a directory that holds anything else never
/// deletes it.
fn is_tier_dir(name: &str) -> bool {
    name.split_once('-').is_some_and(|(fp, dtype)| {
        fp.len() == 16
            && fp.bytes().all(|b| b.is_ascii_hexdigit())
            && [KvDtype::F16, KvDtype::Q8]
                .iter()
                .any(|d| d.name() == dtype)
    })
}

/// The first slot of `dir` whose lock this node can take (made if missing), and that lock, to
/// hold for the node's life.
fn take_slot(dir: &Path) -> std::result::Result<(PathBuf, File), (PathBuf, std::io::Error)> {
    private_dir(dir).map_err(|e| (dir.to_path_buf(), e))?;
    for n in 0..SLOTS {
        let slot = dir.join(format!("slot-{n}"));
        private_dir(&slot).map_err(|e| (slot.clone(), e))?;
        let lock_path = slot.join("LOCK");
        let lock = private_file(&lock_path).map_err(|e| (lock_path, e))?;
        if lock.try_lock().is_ok() {
            return Ok((slot, lock));
        }
    }
    Err((
        dir.to_path_buf(),
        std::io::Error::other(format!(
            "all {SLOTS} slots are in use by other nodes: give this one a directory of its own"
        )),
    ))
}

/// Makes `dir` and its missing parents, readable by the owner only.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Opens `path` for writing (made, or emptied), readable by the owner only.
fn private_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

/// The index of the files a directory holds: whole-sized `<hash>.kv` files, oldest first by
/// modification time, and how many `.kv` files were damaged (the wrong size: removed, as is
/// anything else there, such as a torn temporary); contents are checked when read.
fn scan(dir: &Path, file_bytes: usize) -> (Index, u64) {
    let mut damaged = 0;
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        let hash = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".kv"))
            .and_then(|h| u64::from_str_radix(h, 16).ok());
        let meta = entry.metadata().ok();
        match (hash, meta) {
            (Some(hash), Some(meta)) if meta.len() == file_bytes as u64 => {
                found.push((meta.modified().ok(), hash, meta.len()));
            }
            (hash, _) => {
                damaged += u64::from(hash.is_some());
                let _ = fs::remove_file(&path);
            }
        }
    }
    found.sort();
    let mut index = Index::default();
    for (_, hash, size) in found {
        index.insert(hash, size);
    }
    (index, damaged)
}

#[cfg(test)]
mod tests;
