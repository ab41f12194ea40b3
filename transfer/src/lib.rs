//! KV wire format v1 and the KvTransfer service and client. Never links candle: bytes in, bytes out. Empty until the disaggregated-serving issue adds it.
