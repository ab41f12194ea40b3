//! The harness that spawns real servers on 127.0.0.1:0, and the scenario, compose and chaos suites. Empty until there are servers to test.
