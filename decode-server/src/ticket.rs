//! The scheduler's name for one admitted request.

/// Identifies one admitted request to the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);
