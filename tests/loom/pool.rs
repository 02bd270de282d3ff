//! loom models: pool (see tests/loom.rs).
