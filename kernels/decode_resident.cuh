// decode_resident.cuh: thread blocks of each decode body resident per SM, as the Auto plan's
// fill and wave rules count them (decode_plan, paged_attention.cu) and as the one-head 16-bit
// body's __launch_bounds__ holds it (SimtDecode::MIN_BLOCKS). The figures are ptxas's: each
// body's registers at sm_90 (65536 per SM, allocated in multiples of 8 per thread: 99 take 104,
// so 4 blocks of DEC_THREADS, not 5), and scripts/check-decode-resident.sh (run by CI) fails
// when an instance's registers stop matching its entry here, or when one spills.
#pragma once

namespace pkv {

// f16 / bf16 caches, by the query heads a block serves: 1 (the CUDA-core MHA body, held to its
// entry by __launch_bounds__), 8 or 16 (the tensor-core GQA body); head dims 64 / 80 / 96 /
// 112 / 128 / 256. Registers at sm_90 (nvcc 13.0.88): one head 80 / 72 / 72 / 72 / 72 / 80,
// 8 heads 90 / 100 / 124 / 127 / 159 / 166, 16 heads 138 / 146 / 180 / 188 / 207.
__host__ __device__ constexpr int decode_resident(int gt, int head_dim) {
  if (gt == 1) return head_dim <= 64 || head_dim > 128 ? 6 : 7;
  if (gt == 16) return head_dim <= 80 ? 3 : 2;
  if (head_dim <= 64) return 5;
  if (head_dim <= 112) return 4;
  return 3;
}

// f32 caches, whose bodies are all CUDA-core ones of 1, 4 or 8 heads. Registers at sm_90: one
// head 64 / 64 / 64 / 64 / 67 / 78, four 124 / 117 / 117 / 117 / 127 / 156, eight 166 / 168 /
// 168 / 168 / 166 / 210 (190 - 213 before the partition length moved to 64 bits: 2 blocks
// per SM up to d128 then).
__host__ __device__ constexpr int decode_resident_f32(int gt, int head_dim) {
  if (gt == 1) return head_dim <= 112 ? 8 : head_dim <= 128 ? 7 : 6;
  if (gt == 4) return head_dim <= 128 ? 4 : 3;
  return head_dim <= 128 ? 3 : 2;
}

}  // namespace pkv
