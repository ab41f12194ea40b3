//! Ids the router mints: for requests that came without one, and for KV transfers.

/// A request id for a request that came without one.
pub(crate) fn fresh_request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A KV transfer's id, which the decode node's reservation and the prefill node's push share.
pub(crate) fn transfer_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}
