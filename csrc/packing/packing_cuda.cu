// Packing family, CUDA half (named *_cuda.cu: a .cpp and a .cu with one stem would both build
// <stem>.o in the same ninja file): THD pack / unpack as load-balanced segmented copies.
// Layout and semantics: packing.h. Built only when setup.py finds CUDA (MEGATRON_RL_WITH_CUDA).
//
// Every sequence is contiguous in both the source and the packed buffer, so each kernel is a
// batched memcpy. Work is split over the *packed* rows so that one long sequence does not leave
// one thread block copying it alone: a block owns `rows_per_block` packed rows, finds the segment
// of its first row by binary search over cu_seqlens, and walks forward from there. Rows are moved
// as 16/8/4/2/1-byte vectors, the widest that divides the row size and both base pointers.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "packing/packing.h"

namespace megatron_rl {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kVecsPerBlock = kThreads * 8;  // vectors copied per block (8 per thread)

template <int kBytes>
struct Vec;
template <> struct Vec<16> { using T = uint4; };
template <> struct Vec<8> { using T = uint2; };
template <> struct Vec<4> { using T = uint32_t; };
template <> struct Vec<2> { using T = uint16_t; };
template <> struct Vec<1> { using T = uint8_t; };

// kToPacked: true = pack (src rows -> packed rows), false = unpack (packed rows -> dst rows).
template <int kBytes, bool kToPacked>
__global__ void segmented_copy_kernel(const char* __restrict__ in, char* __restrict__ out,
                                      const int64_t* __restrict__ starts,
                                      const int32_t* __restrict__ cu, int64_t num_segments,
                                      int64_t total_rows, int64_t row_vecs,
                                      int64_t rows_per_block) {
  using V = typename Vec<kBytes>::T;
  const V* vin = reinterpret_cast<const V*>(in);
  V* vout = reinterpret_cast<V*>(out);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  if (row0 >= total_rows) return;
  const int64_t rows = min(rows_per_block, total_rows - row0);
  __shared__ int64_t seg0;
  if (threadIdx.x == 0) {  // last segment with cu[s] <= row0 (skips empty segments)
    int64_t lo = 0, hi = num_segments - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) >> 1;
      if (cu[mid] <= row0) lo = mid; else hi = mid - 1;
    }
    seg0 = lo;
  }
  __syncthreads();
  // Block-local indices fit 32 bits (rows_per_block * row_vecs <= max(kVecsPerBlock, row_vecs)),
  // and 32-bit division is far cheaper than 64-bit on the GPU. Each thread issues kUnroll loads
  // before its stores so that enough bytes are in flight for narrow (8-byte) rows.
  const uint32_t rv = static_cast<uint32_t>(row_vecs);
  const uint32_t work = static_cast<uint32_t>(rows) * rv;
  for (uint32_t base = threadIdx.x; base < work; base += blockDim.x * kUnroll) {
    V vals[kUnroll];
    int64_t dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + u * blockDim.x;
      dst[u] = -1;
      if (i < work) {
        const uint32_t r = rv == 1 ? i : i / rv;
        const uint32_t v = i - r * rv;
        const int64_t row = row0 + r;
        int64_t s = seg0;
        while (cu[s + 1] <= row) ++s;
        const int64_t other = starts[s] + (row - cu[s]);
        const int64_t from = (kToPacked ? other : row) * row_vecs + v;
        dst[u] = (kToPacked ? row : other) * row_vecs + v;
        vals[u] = vin[from];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (dst[u] >= 0) vout[dst[u]] = vals[u];
  }
}

template <bool kToPacked>
void launch_segmented_copy(const at::Tensor& in, at::Tensor& out, const at::Tensor& starts,
                           const at::Tensor& cu, int64_t packed_rows, int64_t row_bytes) {
  const int64_t n = starts.size(0);
  if (n == 0 || packed_rows == 0 || row_bytes == 0) return;
  const auto in_addr = reinterpret_cast<uintptr_t>(in.data_ptr());
  const auto out_addr = reinterpret_cast<uintptr_t>(out.data_ptr());
  int bytes = 16;
  while (bytes > 1 && (row_bytes % bytes || in_addr % bytes || out_addr % bytes)) bytes /= 2;
  const int64_t row_vecs = row_bytes / bytes;
  TORCH_CHECK(row_vecs < (int64_t{1} << 31), "megatron_rl pack/unpack: rows too wide");
  const int64_t rows_per_block = std::max<int64_t>(1, kVecsPerBlock / row_vecs);
  const int64_t blocks = (packed_rows + rows_per_block - 1) / rows_per_block;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "megatron_rl pack/unpack: too many rows");
  auto stream = at::cuda::getCurrentCUDAStream();
  const char* ip = static_cast<const char*>(in.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
#define MRL_LAUNCH(B)                                                                   \
  segmented_copy_kernel<B, kToPacked><<<blocks, kThreads, 0, stream>>>(                 \
      ip, op, starts.data_ptr<int64_t>(), cu.data_ptr<int32_t>(), n, packed_rows, row_vecs, \
      rows_per_block)
  switch (bytes) {
    case 16: MRL_LAUNCH(16); break;
    case 8: MRL_LAUNCH(8); break;
    case 4: MRL_LAUNCH(4); break;
    case 2: MRL_LAUNCH(2); break;
    default: MRL_LAUNCH(1); break;
  }
#undef MRL_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

__global__ void position_ids_kernel(const int32_t* __restrict__ cu, int64_t num_segments,
                                    int64_t total, int64_t* __restrict__ out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= total) return;
  int64_t lo = 0, hi = num_segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= row) lo = mid; else hi = mid - 1;
  }
  out[row] = row - cu[lo];
}

// Index ranges are not validated on the device (that would need a host sync); the CPU kernels
// and the Python API validate them. Out-of-range starts are undefined behaviour here.
at::Tensor pack_cuda(const at::Tensor& src_in, const at::Tensor& src_starts,
                     const at::Tensor& cu_seqlens, int64_t total) {
  check_pack_args(src_in, src_starts, cu_seqlens, "megatron_rl::pack");
  const c10::cuda::CUDAGuard guard(src_in.device());
  const at::Tensor src = src_in.contiguous();
  auto sizes = src.sizes().vec();
  sizes[0] = total;
  at::Tensor out = at::empty(sizes, src.options());
  const int64_t row_bytes = src.size(0) == 0 ? 0 : src.nbytes() / src.size(0);
  launch_segmented_copy<true>(src, out, src_starts.contiguous(), cu_seqlens.contiguous(), total,
                              row_bytes);
  return out;
}

at::Tensor unpack_cuda(const at::Tensor& packed_in, const at::Tensor& dst_starts,
                       const at::Tensor& cu_seqlens, int64_t num_rows, const at::Scalar& fill) {
  check_pack_args(packed_in, dst_starts, cu_seqlens, "megatron_rl::unpack");
  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = packed_in.contiguous();
  auto sizes = packed.sizes().vec();
  sizes[0] = num_rows;
  at::Tensor out = at::full(sizes, fill, packed.options());
  const int64_t row_bytes = packed.size(0) == 0 ? 0 : packed.nbytes() / packed.size(0);
  launch_segmented_copy<false>(packed, out, dst_starts.contiguous(), cu_seqlens.contiguous(),
                               packed.size(0), row_bytes);
  return out;
}

at::Tensor position_ids_cuda(const at::Tensor& cu_seqlens_in, int64_t total) {
  TORCH_CHECK(cu_seqlens_in.dim() == 1 && cu_seqlens_in.scalar_type() == at::kInt,
              "megatron_rl::position_ids: cu_seqlens must be a 1-D int32 tensor");
  const c10::cuda::CUDAGuard guard(cu_seqlens_in.device());
  const at::Tensor cu = cu_seqlens_in.contiguous();
  at::Tensor out = at::empty({total}, cu.options().dtype(at::kLong));
  const int64_t n = cu.size(0) - 1;
  if (total == 0 || n <= 0) return out;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  position_ids_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      cu.data_ptr<int32_t>(), n, total, out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_rl, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
  m.impl("position_ids", &position_ids_cuda);
}

}  // namespace megatron_rl
