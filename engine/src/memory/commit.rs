//! Committing a mapping's pages ahead of their first write, on a thread of its own.
//!
//! The first write to a page of a fresh anonymous mapping faults: the kernel takes a page,
//! zeroes it, and maps it, a few microseconds per 4 KiB page (more in a VM whose host backs
//! guest memory lazily). Left to the first write, a decode node pays it on its scheduler's
//! thread when a pushed KV (tens of MB) lands in blocks the pool has not used yet: a stall of
//! tens of milliseconds between two steps of every running stream. `MADV_POPULATE_WRITE`
//! (Linux 5.14) commits a range as those writes would, without touching its bytes, so another
//! thread can do it ahead of the writer.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use super::HUGE_PAGE;

/// Commits pages of a mapping, from its start up to what it is asked. It keeps the priority of
/// the thread that started it: at a lower one it falls behind whenever the cores are busy,
/// which is when the writer needs it ahead. Dropping it stops the thread (within a 2 MiB piece)
/// and waits for it: the mapping must outlive it.
pub(super) struct Committer {
    to: Option<mpsc::Sender<usize>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The furthest byte asked for so far.
    asked: usize,
}

impl Committer {
    /// A committer for the `mapped` bytes (whole pages) from address `start`.
    pub(super) fn start(start: usize, mapped: usize) -> Self {
        let (to, asks) = mpsc::channel::<usize>();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tandem-commit".into())
            .spawn(move || {
                let mut done = 0;
                while let Ok(mut to) = asks.recv() {
                    to = asks.try_iter().fold(to, usize::max).min(mapped);
                    while done < to {
                        if stopped.load(Ordering::Relaxed) {
                            return;
                        }
                        let end = (done + HUGE_PAGE).min(to);
                        if let Err(e) = populate_write(start + done, end - done) {
                            tracing::debug!("madvise(MADV_POPULATE_WRITE): {e}");
                            return;
                        }
                        done = end;
                    }
                }
            })
            .ok();
        if thread.is_none() {
            tracing::debug!("no thread to commit pages ahead");
        }
        Self {
            to: Some(to),
            stop,
            thread,
            asked: 0,
        }
    }

    /// Asks for the pages up to byte `bytes` (rounded up to a page by the caller) without
    /// waiting for them.
    pub(super) fn ask(&mut self, bytes: usize) {
        if bytes > self.asked
            && let Some(to) = &self.to
        {
            self.asked = bytes;
            let _ = to.send(bytes);
        }
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.to = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Commits `len` bytes of pages from `start` as writes would, leaving their bytes as they are.
#[cfg(target_os = "linux")]
fn populate_write(start: usize, len: usize) -> nix::Result<()> {
    use nix::sys::mman::{MmapAdvise, madvise};
    let Some(at) = std::ptr::NonNull::new(start as *mut std::ffi::c_void) else {
        return Ok(());
    };
    // SAFETY: the range lies inside a mapping that outlives this thread (the committer is
    // dropped, and this thread joined, before the mapping is unmapped). MADV_POPULATE_WRITE
    // faults pages in as a write would but writes nothing: a page already present keeps its
    // bytes, and a new one is the zeroed page the first write would have found, so the
    // engine's own reads and writes of the range at the same time are unaffected.
    unsafe { madvise(at, len, MmapAdvise::MADV_POPULATE_WRITE) }
}

#[cfg(not(target_os = "linux"))]
fn populate_write(_start: usize, _len: usize) -> Result<(), std::io::Error> {
    Err(std::io::ErrorKind::Unsupported.into())
}
