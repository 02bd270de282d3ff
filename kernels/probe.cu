// probe.cu: runtime/device probe and status strings.
#include "common.cuh"

namespace {
// A trivial kernel whose attributes tell whether this build has an image for the device.
__global__ void pkv_probe_kernel(int *x) {
  if (x != nullptr) *x = 1;
}
}  // namespace

extern "C" int pkv_probe(int32_t *runtime_version, int32_t *compute_capability,
                         int32_t *sm_count) {
  if (runtime_version == nullptr || compute_capability == nullptr || sm_count == nullptr)
    return PKV_ERR_NULL_POINTER;
  int rt = 0, dev = 0, major = 0, minor = 0, sms = 0;
  cudaError_t e = cudaRuntimeGetVersion(&rt);
  if (e == cudaSuccess) e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) {
    cudaFuncAttributes attr;
    e = cudaFuncGetAttributes(&attr, pkv_probe_kernel);
  }
  *runtime_version = rt;
  *compute_capability = major * 10 + minor;
  *sm_count = sms;
  return pkv::status_of(e);
}

extern "C" const char *pkv_status_string(int status) {
  switch (status) {
    case PKV_OK: return "success";
    case PKV_ERR_DTYPE: return "unsupported dtype";
    case PKV_ERR_HEAD_DIM: return "unsupported head_dim (64, 80, 96, 112, 128, 256)";
    case PKV_ERR_BLOCK_SIZE: return "unsupported block_size (a power of two from 8 to 256)";
    case PKV_ERR_INVALID_ARG: return "invalid argument";
    case PKV_ERR_WORKSPACE: return "decode workspace missing, misaligned or too small";
    case PKV_ERR_NULL_POINTER: return "null pointer argument";
    case PKV_ERR_PAGE_STRIDE:
      return "page stride smaller than one block of the geometry (or the pages overflow 64 bits)";
    case PKV_ERR_PAGE_ALIGN: return "page stride is not a multiple of 16 bytes";
    case PKV_ERR_ROW_STRIDE:
      return "query/out view off the 16-byte grid or token stride smaller than a row";
    case PKV_ERR_PLAN: return "decode plan does not fit the launch (heads, head_dim, capacity)";
    default: return cudaGetErrorString(static_cast<cudaError_t>(status));
  }
}
