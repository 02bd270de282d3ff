//! KV cache geometry: the one paged layout that the CPU and CUDA kernels share, host storage and swap space.
