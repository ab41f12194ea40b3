//! The CPU's instruction sets beyond what the build targets, detected once: every kernel that
//! picks a path at run time asks here. The build's own level is the `x86_v3` cfg (AVX2, FMA and
//! F16C, see `build.rs`); without it no wider path is compiled, and every answer is `false`.
//! `TANDEM_MAX_CPU_ISA=avx2` caps the answers at the build's level, so an AVX-512 machine runs
//! (and measures) the paths of an AVX2-only one.
//! And the compute threads' share of the CPU beside other processes ([`lower_thread_priority`]).

use std::sync::OnceLock;

/// The run-time-detected features the kernels choose by.
#[derive(Clone, Copy, Debug, Default)]
struct Features {
    /// AVX-512 Foundation: the 512-bit attention and `exp` paths.
    avx512f: bool,
    /// AVX-512 F, BW and VNNI together: the 512-bit `vpdpbusd` matmul kernels.
    avx512_vnni: bool,
}

fn features() -> Features {
    static FEATURES: OnceLock<Features> = OnceLock::new();
    *FEATURES.get_or_init(|| {
        let cap = std::env::var("TANDEM_MAX_CPU_ISA");
        match cap.as_deref() {
            Ok("avx2") => Features::default(),
            Ok("avx512") | Err(std::env::VarError::NotPresent) => detect(),
            _ => {
                tracing::warn!(
                    value = ?cap,
                    "TANDEM_MAX_CPU_ISA is `avx2` or `avx512`; using what the CPU has"
                );
                detect()
            }
        }
    })
}

#[cfg(x86_v3)]
fn detect() -> Features {
    use std::arch::is_x86_feature_detected;
    let avx512f = is_x86_feature_detected!("avx512f");
    Features {
        avx512f,
        avx512_vnni: avx512f
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni"),
    }
}

#[cfg(not(x86_v3))]
fn detect() -> Features {
    Features::default()
}

/// Whether the CPU has AVX-512F (and the build x86-64-v3 beneath it).
pub(crate) fn has_avx512f() -> bool {
    features().avx512f
}

/// Whether the CPU has AVX-512 F, BW and VNNI (and the build x86-64-v3 beneath them).
pub(crate) fn has_avx512_vnni() -> bool {
    features().avx512_vnni
}

/// Lowers the calling thread's OS priority to `nice` (Linux gives each thread its own; raising
/// the value needs no privilege, and threads it starts inherit it). A failure is logged: the
/// thread then keeps its priority.
pub(crate) fn lower_thread_priority(nice: i32) {
    // SAFETY: setpriority only reads its integer arguments; `who` 0 is the calling thread.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS as _, 0, nice) };
    if rc != 0 {
        tracing::warn!(
            nice,
            error = %std::io::Error::last_os_error(),
            "cannot lower a compute thread's priority"
        );
    }
}
