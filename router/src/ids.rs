//! Ids the router mints.

/// A random 128-bit id in hex: for a request that came without one, and for a KV transfer
/// (which the decode node's reservation and the prefill node's push share).
pub(crate) fn fresh_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}
