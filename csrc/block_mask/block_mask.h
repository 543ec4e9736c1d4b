// Diffusion block-masking kernel family: the flex_attention block structure of the BD3-LM
// training mask (docs/algorithms.md C.2) and the masking noise of C.0 / C.5.2 (CPU + CUDA).
//
// Layout (C.2): packed samples of valid lengths N_s as [noisy_1, clean_1, noisy_2, clean_2, ...],
// L = 2 * sum(N_s). Token i of a sample (0 <= i < N) sits at 2*off_s + i (noisy) and
// 2*off_s + N + i (clean). Block of token i: global origin b = i / S; response origin (prompt
// length P) b = i / S for i < P, else ceil(P / S) + (i - P) / S. Because block ids grow with i,
// "bk < bq" is "k lies before the start of q's block", so every query row attends to at most two
// key intervals:
//   noisy q (block [bs, be)): noisy [2off+bs, 2off+be) and clean prefix [2off+N, 2off+N+bs)
//   clean q:                  clean prefix [2off+N, 2off+N+be)
// block_diffusion_structure classifies each (q tile, kv tile) of `tile` x `tile` positions as
// empty / partial / full from these intervals (never materializing the L x L mask) and returns
// BlockMask's kv_num_blocks [1,1,T], kv_indices [1,1,T,T], full_kv_num_blocks, full_kv_indices
// (int32, T = ceil(L / tile)), ordered exactly as create_block_mask orders them: selected tiles
// ascending, then the others ascending. Positions >= L count as masked (a tile holding them is
// never full), as in create_block_mask.
//
// Masking noise: for sample s and response token i (i >= P_s), u = uniform24(seed_s, i) in [0, 1)
// (splitmix64 counter hash, 24-bit mantissa, identical on CPU and CUDA); p = ratios[s, b] with
// b = 0 when block_size == 0, else the block of i (blocks past ratios.size(1) use p = 0).
// masked = u < p (complement: u >= p); masked ids -> mask_id; weight 1/p (complement 1/(1-p)) on
// masked tokens, 0 elsewhere (prompt tokens are never masked). A (mask, complement) pair scores
// every response token exactly once (coupled-GRPO, C.5.2).
// Tolerance: exact (integer logic; weights are one correctly rounded float32 division).
#pragma once

#include <cstdint>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace megatron_rl {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_diffusion_structure_cpu(
    const at::Tensor& seq_lens, const at::Tensor& prompt_lens, int64_t block_size,
    bool response_origin, int64_t tile, int64_t total);

std::tuple<at::Tensor, at::Tensor> diffusion_mask_tokens_cpu(
    const at::Tensor& input_ids, const at::Tensor& cu_seqlens, const at::Tensor& prompt_lens,
    const at::Tensor& ratios, const at::Tensor& seeds, int64_t block_size, bool response_origin,
    int64_t mask_id, bool complement);

void check_structure_args(const at::Tensor& seq_lens, const at::Tensor& prompt_lens,
                          int64_t block_size, int64_t tile);
void check_noise_args(const at::Tensor& input_ids, const at::Tensor& cu_seqlens,
                      const at::Tensor& prompt_lens, const at::Tensor& ratios,
                      const at::Tensor& seeds, int64_t block_size);

// Device-agnostic helpers shared with block_mask.cu (host and device).
#if defined(__CUDACC__)
#define MRL_HD __host__ __device__ __forceinline__
#else
#define MRL_HD inline
#endif

MRL_HD uint64_t mrl_mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) with 24 random bits: exact in float32 on every device.
MRL_HD float mrl_uniform24(int64_t seed, int64_t i) {
  const uint64_t h = mrl_mix64(static_cast<uint64_t>(seed) ^ mrl_mix64(static_cast<uint64_t>(i)));
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}

// Block [start, end) of token i in a sample of n tokens with prompt length p.
MRL_HD void mrl_block_of(int64_t i, int64_t n, int64_t p, int64_t s, bool response_origin,
                         int64_t* block, int64_t* start, int64_t* end) {
  if (!response_origin) {
    *block = i / s;
    *start = *block * s;
    *end = *start + s < n ? *start + s : n;
  } else if (i < p) {
    *block = i / s;
    *start = *block * s;
    *end = *start + s < p ? *start + s : p;
  } else {
    const int64_t r = (i - p) / s;
    *block = (p + s - 1) / s + r;
    *start = p + r * s;
    *end = *start + s < n ? *start + s : n;
  }
}

// The (at most two, merged when adjacent) key intervals of query row q; see the header comment.
// `sample` is the row's sample, `off2` its first row (2 * token offset), n its length.
MRL_HD void mrl_row_intervals(int64_t q, int64_t off2, int64_t n, int64_t p, int64_t s,
                              bool response_origin, int64_t* a0, int64_t* b0, int64_t* a1,
                              int64_t* b1) {
  const int64_t local = q - off2;
  const bool clean = local >= n;
  const int64_t i = clean ? local - n : local;
  int64_t block, bs, be;
  mrl_block_of(i, n, p, s, response_origin, &block, &bs, &be);
  if (clean) {
    *a0 = off2 + n;
    *b0 = off2 + n + be;
    *a1 = *b1 = 0;
  } else if (be == n && bs > 0) {  // last noisy block touches the clean copy: one interval
    *a0 = off2 + bs;
    *b0 = off2 + n + bs;
    *a1 = *b1 = 0;
  } else {
    *a0 = off2 + bs;
    *b0 = off2 + be;
    *a1 = off2 + n;
    *b1 = off2 + n + bs;
  }
}

}  // namespace megatron_rl
