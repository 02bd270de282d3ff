//! loom models: table (see tests/loom.rs).
