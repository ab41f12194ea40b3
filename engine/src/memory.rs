//! Memory helpers for the hot loops: large buffers backed by transparent huge pages, and
//! software prefetch.
//!
//! The packed weights (about 100 MB) are streamed once per forward pass and the KV pool's
//! slabs are read from blocks hundreds of KB apart: with 4 KiB pages, nearly every slab and
//! every few weight rows cost a TLB miss. Linux backs memory with 2 MiB pages when asked
//! (`MADV_HUGEPAGE`, for systems where transparent huge pages are set to `madvise`); the advice
//! applies to pages not yet touched, so it is given before the first write. Where the kernel
//! declines, nothing changes but speed.

use bytemuck::Zeroable;

/// `n` zeroed values in a fresh allocation advised for huge pages. Pages are committed on
/// first write, as with any zeroed allocation.
pub fn zeroed_vec<T: Zeroable>(n: usize) -> Vec<T> {
    let v: Vec<T> = bytemuck::zeroed_vec(n);
    advise(&v);
    v
}

fn advise<T>(data: &[T]) {
    #[cfg(target_os = "linux")]
    {
        use nix::sys::mman::{MmapAdvise, madvise};
        const PAGE: usize = 4096;
        let start = data.as_ptr() as usize;
        let end = start + std::mem::size_of_val(data);
        let aligned = start.next_multiple_of(PAGE);
        if let Some(ptr) = std::ptr::NonNull::new(aligned as *mut std::ffi::c_void)
            && end > aligned + PAGE
        {
            // SAFETY: the range lies inside `data`'s allocation; MADV_HUGEPAGE changes how
            // pages are backed, never their contents.
            let advised = unsafe { madvise(ptr, end - aligned, MmapAdvise::MADV_HUGEPAGE) };
            if let Err(e) = advised {
                tracing::debug!("madvise(MADV_HUGEPAGE): {e}");
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = data;
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
