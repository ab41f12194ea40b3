//! Memory helpers for the hot loops: large buffers backed by transparent huge pages, and
//! software prefetch.
//!
//! The packed weights (hundreds of MB) are streamed once per forward pass and the KV pool's
//! slabs are read from blocks hundreds of KB apart: with 4 KiB pages, nearly every slab and
//! every few weight rows cost a TLB miss. Linux backs memory with 2 MiB pages when asked
//! (`MADV_HUGEPAGE`, for systems where transparent huge pages are set to `madvise`), but only
//! for whole 2 MiB-aligned ranges whose pages nothing has touched yet. The allocator cannot
//! promise either: an over-aligned zeroed allocation (the packed blocks are 32- or 64-byte
//! aligned) comes from `posix_memalign` and a `memset`, which backs every page before any
//! advice. So [`HugeBuf`] maps its own memory. Where the kernel declines, nothing changes but
//! speed.

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use bytemuck::Zeroable;
use nix::sys::mman::{MapFlags, ProtFlags, mmap_anonymous, munmap};

mod commit;

/// The size and alignment of a transparent huge page on x86-64, and of a base page.
const HUGE_PAGE: usize = 2 << 20;
const PAGE: usize = 4096;

/// A fixed number of values, zeroed, in an anonymous mapping of its own that is advised for
/// huge pages before anything touches it and starts on a 2 MiB boundary when it is at least
/// that large. Pages are committed on first write, so a pool that is mostly never written
/// (the KV cache) costs only what is used.
pub struct HugeBuf<T> {
    data: NonNull<T>,
    len: usize,
    /// Bytes mapped from `data` (`len` values rounded up to whole pages); 0 if none.
    mapped: usize,
    /// Commits pages ahead of their first write ([`HugeBuf::commit_to`]).
    committer: Option<commit::Committer>,
}

// SAFETY: a `HugeBuf` owns its values as a `Vec` does.
unsafe impl<T: Send> Send for HugeBuf<T> {}
unsafe impl<T: Sync> Sync for HugeBuf<T> {}

impl<T: Zeroable> HugeBuf<T> {
    /// `len` zeroed values. Panics if the memory cannot be mapped, as an allocation would.
    pub fn zeroed(len: usize) -> Self {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("buffer size overflows");
        let Some(size) = NonZeroUsize::new(bytes) else {
            return Self {
                data: NonNull::dangling(),
                len,
                mapped: 0,
                committer: None,
            };
        };
        // Mapped with room to move the start to a huge-page boundary; the room before and
        // after the data is unmapped again, so that no huge page reaches past the data.
        let align = if bytes >= HUGE_PAGE { HUGE_PAGE } else { PAGE };
        let map_len = size.saturating_add(align - PAGE);
        // SAFETY: a fresh private anonymous mapping aliases nothing.
        let map = unsafe {
            mmap_anonymous(
                None,
                map_len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .unwrap_or_else(|e| panic!("mapping {bytes} bytes: {e}"));
        let at = map.as_ptr() as usize;
        let (head, mapped) = (
            at.next_multiple_of(align) - at,
            bytes.next_multiple_of(PAGE),
        );
        let tail = map_len.get().next_multiple_of(PAGE) - head - mapped;
        // SAFETY: `head + mapped + tail` is the whole mapping, in whole pages; the head and
        // tail are this function's own and nothing refers to them.
        let data = unsafe {
            let data = map.byte_add(head);
            for (start, len) in [(map, head), (data.byte_add(mapped), tail)] {
                if len > 0 {
                    munmap(start, len).unwrap_or_else(|e| panic!("unmapping {len} bytes: {e}"));
                }
            }
            data
        };
        advise(data, mapped);
        Self {
            // Page-aligned, so aligned for any `T` with alignment up to 4 KiB.
            data: data.cast(),
            len,
            mapped,
            committer: None,
        }
    }
}

impl<T> HugeBuf<T> {
    /// Has the pages of the first `bytes` bytes committed, on a thread of the buffer's own
    /// (started by the first call), without waiting; the values stay as they are. Writes there
    /// then find their pages instead of faulting them in one by one ([`commit`] has the costs).
    pub fn commit_to(&mut self, bytes: usize) {
        let bytes = bytes.min(self.mapped).next_multiple_of(PAGE);
        if bytes == 0 {
            return;
        }
        let (start, mapped) = (self.data.as_ptr() as usize, self.mapped);
        (self.committer)
            .get_or_insert_with(|| commit::Committer::start(start, mapped))
            .ask(bytes);
    }
}

impl<T> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        // The committer's thread ends before the mapping goes.
        self.committer = None;
        if self.mapped > 0 {
            // SAFETY: the mapping is this buffer's own and nothing borrows it any more.
            if let Err(e) = unsafe { munmap(self.data.cast(), self.mapped) } {
                tracing::warn!("munmap of {} bytes: {e}", self.mapped);
            }
        }
    }
}

impl<T> Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `data` holds `len` initialised (zeroed, then written) values, aligned.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.len) }
    }
}

impl<T> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_ptr(), self.len) }
    }
}

impl<T> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HugeBuf({} x {} bytes)",
            self.len,
            std::mem::size_of::<T>()
        )
    }
}

/// Asks for huge pages for `len` bytes from `start`.
fn advise(start: NonNull<c_void>, len: usize) {
    #[cfg(target_os = "linux")]
    {
        use nix::sys::mman::{MmapAdvise, madvise};
        // SAFETY: the range lies inside a mapping the caller owns; MADV_HUGEPAGE changes how
        // pages are backed, never their contents.
        if let Err(e) = unsafe { madvise(start, len, MmapAdvise::MADV_HUGEPAGE) } {
            tracing::debug!("madvise(MADV_HUGEPAGE): {e}");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, len);
}

/// Asks the CPU to start loading `data` into its cache, one request per 64-byte line: for data
/// the hot loop will need next, at an address the hardware prefetcher cannot guess (the next
/// KV slabs of a sequence).
pub fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let start = data.as_ptr().cast::<i8>();
        for offset in (0..std::mem::size_of_val(data)).step_by(64) {
            // SAFETY: a prefetch never faults and has no effect on memory; the address is
            // inside `data`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// glibc's malloc raises its mmap threshold to the largest block freed so far (up to 32 MB), so
/// after one prefill the multi-megabyte buffers of later passes come from the heap, and what they
/// leave free there stays resident: 30-40 MB on Gemma 3 270M, above its weights and KV. A fixed
/// threshold (which fixes the trim threshold too) maps such buffers and hands them back when
/// freed; below it stay the per-step ones (a batch-1 step's logits, up to 1 MB). Each binary
/// that runs the engine calls it first thing in `main`.
#[cfg(target_env = "gnu")]
pub fn bound_freed_memory() {
    // SAFETY: mallopt takes two integers and only sets the allocator's parameters, under its
    // own lock.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 2 << 20) };
}

#[cfg(not(target_env = "gnu"))]
pub fn bound_freed_memory() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_zeroed_writable_and_aligned() {
        for len in [0, 1, 1000, HUGE_PAGE / 4 + 3] {
            let mut b = HugeBuf::<u32>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&v| v == 0));
            b.iter_mut().enumerate().for_each(|(i, v)| *v = i as u32);
            assert!(b.iter().enumerate().all(|(i, &v)| v == i as u32));
            let align = if len * 4 >= HUGE_PAGE {
                HUGE_PAGE
            } else {
                PAGE
            };
            assert!(
                len == 0 || (b.as_ptr() as usize).is_multiple_of(align),
                "len {len}"
            );
        }
    }

    #[test]
    fn committing_ahead_keeps_the_values_and_ends_with_the_buffer() {
        let mut b = HugeBuf::<u32>::zeroed(3 * HUGE_PAGE / 4 + 5);
        b[..1000]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = i as u32);
        b.commit_to(usize::MAX);
        // Writes go on while the thread commits.
        let tail = b.len() - 1;
        b[tail] = 7;
        b.commit_to(HUGE_PAGE);
        #[cfg(target_os = "linux")]
        wait_resident(b.as_ptr() as usize, b.len() * 4 / PAGE * PAGE);
        drop(b.committer.take());
        assert!(b[..1000].iter().enumerate().all(|(i, &v)| v == i as u32));
        assert!(b[1000..tail].iter().all(|&v| v == 0));
        assert_eq!(b[tail], 7);
        // A buffer dropped while its thread may still commit waits for it.
        let mut big = HugeBuf::<u8>::zeroed(64 * HUGE_PAGE);
        big.commit_to(usize::MAX);
    }

    /// Waits (up to a minute) until the `bytes` (whole pages) from `start` are resident, by
    /// `mincore`.
    #[cfg(target_os = "linux")]
    fn wait_resident(start: usize, bytes: usize) {
        let resident = || {
            let mut pages = vec![0u8; bytes / PAGE];
            // SAFETY: the range is whole pages of a live mapping, and `pages` has a byte for
            // each of them.
            let rc = unsafe { libc::mincore(start as *mut _, bytes, pages.as_mut_ptr()) };
            assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
            pages.iter().filter(|&&p| p & 1 == 1).count() * PAGE
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while resident() < bytes {
            assert!(
                std::time::Instant::now() < deadline,
                "{} of {bytes} bytes resident",
                resident()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
