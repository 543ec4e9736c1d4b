// Packing kernel family: token-budget micro-batch planner (host) and THD pack / unpack (CPU + CUDA).
//
// Layout
//   src      [M, *]   rows of any dtype; sequence s occupies rows src_starts[s] .. src_starts[s]+len_s
//                     (a padded [B, T, *] batch is passed flattened to [B*T, *] with starts b*T).
//   packed   [total, *] the THD buffer: sequence s occupies rows cu_seqlens[s] .. cu_seqlens[s+1].
//   cu_seqlens [n+1] int32, cu_seqlens[0] == 0, non-decreasing, cu_seqlens[n] == total.
//   src_starts [n]   int64 row offsets into src (dst offsets for unpack).
// pack:   packed[cu[s] + t] = src[starts[s] + t]                    for t < len_s
// unpack: out = fill; out[starts[s] + t] = packed[cu[s] + t]        (out has num_rows rows)
// position_ids: pos[cu[s] + t] = t (int64).
// Tolerance: exact (pure data movement; bitwise equal to ops/reference.py).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace megatron_rl {

// Host planner (plain C++, exposed through pybind11). Returns, for each rank, a list of
// micro-batches, each a list of sample indices. Throws std::invalid_argument (-> ValueError)
// naming the first sample longer than max_tokens. Deterministic for a seed.
std::vector<std::vector<std::vector<int64_t>>> plan_microbatches(
    const std::vector<int64_t>& lengths, int64_t max_tokens, int64_t num_ranks, uint64_t seed);

at::Tensor pack_cpu(const at::Tensor& src, const at::Tensor& src_starts,
                    const at::Tensor& cu_seqlens, int64_t total);
at::Tensor unpack_cpu(const at::Tensor& packed, const at::Tensor& dst_starts,
                      const at::Tensor& cu_seqlens, int64_t num_rows, const at::Scalar& fill);
at::Tensor position_ids_cpu(const at::Tensor& cu_seqlens, int64_t total);

// Shared argument checks (device-agnostic), used by the CPU and CUDA entry points.
void check_pack_args(const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& cu_seqlens,
                     const char* op);

}  // namespace megatron_rl
