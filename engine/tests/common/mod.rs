//! What the fidelity tests share: reading `../shared/fixtures/`.

use std::path::PathBuf;

use serde_json::Value;

/// `$TANDEM_FIXTURES_DIR`, else `shared/fixtures` beside the checkout.
pub fn fixtures_dir() -> PathBuf {
    std::env::var_os("TANDEM_FIXTURES_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"),
        PathBuf::from,
    )
}

/// A JSON-lines fixture's records.
pub fn records(name: &str) -> Vec<Value> {
    let path = fixtures_dir().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read fixture {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture line is JSON"))
        .collect()
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}
