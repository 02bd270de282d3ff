//! loom models: admission (see tests/loom.rs).
