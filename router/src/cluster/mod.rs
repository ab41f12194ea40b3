//! The cluster view: what the router knows of its workers and how it picks them.
//!
//! ```text
//! peers (the other routers: their sessions, load and running generations) ─▶ sessions, replicas
//! sessions (open agent sessions: when their KV goes to disk or is released) ─┐
//! discovery ─▶ replicas (the set: health, load, monitoring) ◀───────────────┘
//!                 │  ─▶ migrate (a drain's moves)
//!                 │                                   policy (which replicas serve a request)
//!                 ├─ scaling (desired replicas per model and role)
//!                 └─ replica (one worker) ─▶ index (its cache, from its events), frontend
//! ```
//!
//! Imports run down this list: a module uses only those below it, and the shared modules.

pub mod discovery;
pub mod frontend;
pub mod handoffs;
pub mod index;
pub mod migrate;
pub mod peers;
pub mod policy;
pub mod replica;
pub mod replicas;
pub mod scaling;
pub mod sessions;
