//! Grouped-query paged attention and KV-cache kernels on the CPU: the fallback path and the oracle every CUDA kernel is tested against.
