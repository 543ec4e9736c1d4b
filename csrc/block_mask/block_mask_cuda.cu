// Diffusion block-masking family, CUDA half. Contract and layout: block_mask.h.
//
// block_diffusion_structure: one thread block per q tile. Threads first compute the (at most
// two) key intervals of each of the tile's rows into shared memory, then each thread classifies
// kv tiles (empty / partial / full) against all rows, and warps 0 and 1 compact the partial and
// full tiles into create_block_mask's order with ballot prefix sums. No L x L mask is built.
// diffusion_mask_tokens: one thread per packed token; the sample is found by binary search.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "block_mask/block_mask.h"
#include "check.h"

namespace megatron_rl {
namespace {

constexpr int kStructThreads = 128;

__device__ __forceinline__ int64_t last_le(const int64_t* __restrict__ a, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n - 1;  // largest s in [0, n) with a[s] <= x
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (a[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void structure_kernel(const int64_t* __restrict__ lens,
                                 const int64_t* __restrict__ prompts,
                                 const int64_t* __restrict__ off2, int64_t n, int64_t L,
                                 int64_t T, int tile, int64_t block_size, bool response_origin,
                                 int32_t* __restrict__ kv_num, int32_t* __restrict__ kv_idx,
                                 int32_t* __restrict__ full_num, int32_t* __restrict__ full_idx) {
  extern __shared__ int64_t smem[];
  int64_t* iv = smem;                                                 // [tile][4]
  uint8_t* kind = reinterpret_cast<uint8_t*>(smem + 4 * int64_t{tile});  // [T]
  const int64_t qt = blockIdx.x;
  for (int r = threadIdx.x; r < tile; r += blockDim.x) {
    const int64_t q = qt * tile + r;
    int64_t a0 = 0, b0 = 0, a1 = 0, b1 = 0;
    if (q < L) {
      const int64_t s = last_le(off2, n, q);
      mrl_row_intervals(q, off2[s], lens[s], prompts[s], block_size, response_origin, &a0, &b0,
                        &a1, &b1);
    }
    iv[4 * r] = a0;
    iv[4 * r + 1] = b0;
    iv[4 * r + 2] = a1;
    iv[4 * r + 3] = b1;
  }
  __syncthreads();
  for (int64_t kt = threadIdx.x; kt < T; kt += blockDim.x) {
    const int64_t k0 = kt * tile, k1 = k0 + tile;
    bool touched = false, full = true;
    for (int r = 0; r < tile; ++r) {
      const int64_t a0 = iv[4 * r], b0 = iv[4 * r + 1], a1 = iv[4 * r + 2], b1 = iv[4 * r + 3];
      touched |= (a0 < k1 && k0 < b0) || (a1 < k1 && k0 < b1);
      full &= (a0 <= k0 && k1 <= b0) || (a1 <= k0 && k1 <= b1);
    }
    kind[kt] = full ? 2 : (touched ? 1 : 0);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp > 1) return;
  const uint8_t want = warp == 0 ? 1 : 2;
  int32_t* row = (warp == 0 ? kv_idx : full_idx) + qt * T;
  int32_t count = 0;
  for (int64_t base = 0; base < T; base += 32) {
    const int64_t kt = base + lane;
    count += __popc(__ballot_sync(0xffffffffu, kt < T && kind[kt] == want));
  }
  int32_t sel = 0, rest = 0;
  const unsigned lane_lt = (1u << lane) - 1u;
  for (int64_t base = 0; base < T; base += 32) {
    const int64_t kt = base + lane;
    const bool f = kt < T && kind[kt] == want;
    const unsigned m = __ballot_sync(0xffffffffu, f);
    const int before = __popc(m & lane_lt);
    if (kt < T) row[f ? sel + before : count + rest + (lane - before)] = static_cast<int32_t>(kt);
    const int valid = T - base < 32 ? static_cast<int>(T - base) : 32;
    sel += __popc(m);
    rest += valid - __popc(m);
  }
  if (lane == 0) (warp == 0 ? kv_num : full_num)[qt] = count;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_diffusion_structure_cuda(
    const at::Tensor& seq_lens_in, const at::Tensor& prompt_lens_in, int64_t block_size,
    bool response_origin, int64_t tile, int64_t total) {
  check_structure_args(seq_lens_in, prompt_lens_in, block_size, tile);
  const c10::cuda::CUDAGuard guard(seq_lens_in.device());
  const at::Tensor lens = seq_lens_in.contiguous(), prompts = prompt_lens_in.contiguous();
  const int64_t n = lens.size(0);
  const int64_t L = 2 * total, T = (L + tile - 1) / tile;
  const auto opts = lens.options().dtype(at::kInt);
  at::Tensor kv_num = at::zeros({1, 1, T}, opts), kv_idx = at::empty({1, 1, T, T}, opts);
  at::Tensor full_num = at::zeros({1, 1, T}, opts), full_idx = at::empty({1, 1, T, T}, opts);
  if (T == 0 || n == 0) return {kv_num, kv_idx, full_num, full_idx};
  // Exclusive prefix sum of 2 * len (row offsets); sum(lens) == total is the caller's contract.
  at::Tensor off2 = at::zeros({n + 1}, lens.options());
  off2.slice(0, 1).copy_(at::cumsum(lens * 2, 0));
  const size_t smem = sizeof(int64_t) * 4 * tile + static_cast<size_t>(T);
  MRL_CHECK(smem <= 48 * 1024, "block_diffusion_structure: sequence too long for one q tile's "
            "shared memory (", T, " kv tiles)");
  structure_kernel<<<T, kStructThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      lens.data_ptr<int64_t>(), prompts.data_ptr<int64_t>(), off2.data_ptr<int64_t>(), n, L, T,
      static_cast<int>(tile), block_size, response_origin, kv_num.data_ptr<int32_t>(),
      kv_idx.data_ptr<int32_t>(), full_num.data_ptr<int32_t>(), full_idx.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {kv_num, kv_idx, full_num, full_idx};
}

template <typename scalar_t>
__global__ void mask_tokens_kernel(scalar_t* __restrict__ ids, float* __restrict__ weights,
                                   const int32_t* __restrict__ cu, int64_t n,
                                   const int64_t* __restrict__ prompts,
                                   const float* __restrict__ ratios, int64_t nb,
                                   const int64_t* __restrict__ seeds, int64_t total,
                                   int64_t block_size, bool response_origin, int64_t mask_id,
                                   bool complement) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= total) return;
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t s = lo, len = cu[s + 1] - cu[s], i = t - cu[s];
  float w = 0.0f;
  if (i >= prompts[s]) {
    int64_t b = 0, bs, be;
    if (block_size > 0) mrl_block_of(i, len, prompts[s], block_size, response_origin, &b, &bs, &be);
    const float p = b < nb ? ratios[s * nb + b] : 0.0f;
    const float u = mrl_uniform24(seeds[s], i);
    if (complement ? u >= p : u < p) {
      ids[t] = static_cast<scalar_t>(mask_id);
      w = __frcp_rn(complement ? 1.0f - p : p);  // correctly rounded: bitwise equal to the CPU
    }
  }
  weights[t] = w;
}

std::tuple<at::Tensor, at::Tensor> diffusion_mask_tokens_cuda(
    const at::Tensor& input_ids, const at::Tensor& cu_seqlens_in, const at::Tensor& prompt_lens,
    const at::Tensor& ratios_in, const at::Tensor& seeds, int64_t block_size,
    bool response_origin, int64_t mask_id, bool complement) {
  check_noise_args(input_ids, cu_seqlens_in, prompt_lens, ratios_in, seeds, block_size);
  const c10::cuda::CUDAGuard guard(input_ids.device());
  at::Tensor out_ids = input_ids.contiguous().clone();
  const int64_t total = out_ids.size(0), n = cu_seqlens_in.size(0) - 1;
  at::Tensor weights = at::empty({total}, out_ids.options().dtype(at::kFloat));
  if (total == 0 || n == 0) return {out_ids, weights.zero_()};
  const at::Tensor cu = cu_seqlens_in.contiguous(), ratios = ratios_in.contiguous();
  const at::Tensor pr = prompt_lens.contiguous(), sd = seeds.contiguous();
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  AT_DISPATCH_INTEGRAL_TYPES(out_ids.scalar_type(), "diffusion_mask_tokens_cuda", [&] {
    mask_tokens_kernel<scalar_t><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        out_ids.data_ptr<scalar_t>(), weights.data_ptr<float>(), cu.data_ptr<int32_t>(), n,
        pr.data_ptr<int64_t>(), ratios.data_ptr<float>(), ratios.size(1),
        sd.data_ptr<int64_t>(), total, block_size, response_origin, mask_id, complement);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out_ids, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_rl, CUDA, m) {
  m.impl("block_diffusion_structure", &block_diffusion_structure_cuda);
  m.impl("diffusion_mask_tokens", &diffusion_mask_tokens_cuda);
}

}  // namespace megatron_rl
