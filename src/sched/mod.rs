//! Continuous-batching scheduler and lock-free admission queues.

pub mod admission;
