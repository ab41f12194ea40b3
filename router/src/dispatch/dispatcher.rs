//! The dispatcher: everything one generation's dispatch needs, shared by every request. Its
//! steps live beside it: admission ([`crate::dispatch::admit`]) and the attempts
//! ([`crate::dispatch::run`]).

use std::sync::Arc;
use std::time::Duration;

use crate::cluster::peers::Peers;
use crate::cluster::policy::Policy;
use crate::cluster::replicas::Replicas;
use crate::cluster::sessions::Sessions;
use crate::dispatch::calibration::Calibration;
use crate::dispatch::order::Order;
use crate::dispatch::queue::QueuePace;
use crate::dispatch::retry::RetryBudget;
use crate::metrics::RouterMetrics;

/// How a generation ended: its status code and the tokens it delivered.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub code: tonic::Code,
    pub generated: usize,
}

/// Everything one dispatch needs.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pub replicas: Arc<Replicas>,
    pub policy: Arc<Policy>,
    pub metrics: RouterMetrics,
    pub kv_wait: Duration,
    /// How long a decode node's stream may be silent once it has its KV (before the first
    /// frame of a local prefill, plus twice the prefill's estimated time) before the router
    /// checks that the node still serves; see [`Dispatcher::next_frame`].
    pub token_gap: Duration,
    pub budget: Arc<RetryBudget>,
    pub pace: Arc<QueuePace>,
    /// The TTFT estimate's recent errors, which a TTFT target's check adds to it.
    pub calibration: Arc<Calibration>,
    /// Which waiting request takes the next place ([`crate::dispatch::order`]).
    pub order: Arc<Order>,
    /// The open agent sessions, which each completed turn updates.
    pub sessions: Arc<Sessions>,
    /// The other routers over the same workers.
    pub peers: Arc<Peers>,
}

impl Dispatcher {
    /// Charges `tenant` for `tokens` served (the prompt at admission, the reply at the end), in
    /// the admission order's fair shares at its `weight`, and in its served-tokens counter.
    pub fn charge(&self, tenant: &Arc<str>, weight: u32, tokens: u64) {
        self.order.charge(tenant, f64::from(weight), tokens);
        self.metrics.tenant_served(tenant, tokens);
    }
}
