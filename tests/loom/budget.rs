//! loom models: budget (see tests/loom.rs).
