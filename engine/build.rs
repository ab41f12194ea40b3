//! One name for the instruction sets the hand-written SIMD paths are compiled for: `x86_v3`
//! when the target is x86-64 with AVX2, FMA and F16C enabled at compile time (the workspace
//! builds for x86-64-v3; see `.cargo/config.toml`). Every other target takes the portable code.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(x86_v3)");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let has = |f: &str| features.split(',').any(|x| x == f);
    if arch == "x86_64" && ["avx2", "fma", "f16c"].iter().all(|f| has(f)) {
        println!("cargo::rustc-cfg=x86_v3");
    }
}
