//! The decode node: Decode service, continuous-batching scheduler and session cache, as `run(listener, config, shutdown)`. Empty until the disaggregated-serving issue adds it.
