//! The prefill node: Prefill service and prefix cache, as `run(listener, config, shutdown)`. Empty until the disaggregated-serving issue adds it.
