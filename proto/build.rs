//! Compiles `tandem/v1/*.proto` with protox (pure Rust, so no protoc is needed) and generates
//! prost messages and tonic services with `bytes::Bytes` payloads. The descriptor set is kept for
//! server reflection.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "tandem/v1/generation.proto",
    "tandem/v1/worker.proto",
    "tandem/v1/transfer.proto",
    "tandem/v1/peer.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(PROTOS, ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("tandem_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure().bytes(".").compile_fds(fds)?;
    Ok(())
}
