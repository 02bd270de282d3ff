//! CUDA run time: device probe, FFI to kernels/pagedkv.h, device KV cache and safe launch wrappers.
