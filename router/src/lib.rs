//! The router: client gRPC API, routing policy, cache index and health. Never links candle. Empty until the disaggregated-serving issue adds it.
