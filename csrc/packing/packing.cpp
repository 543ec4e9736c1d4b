// Packing family, CPU half: the micro-batch planner and the THD pack / unpack kernels.
// See packing.h for the layout; ops/reference.py holds the pure-Python/PyTorch twins.
#include "packing/packing.h"

#include "check.h"

// The per-op headers, not <ATen/ATen.h> (every op: a quarter of the compile time).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace megatron_rl {
namespace {

// splitmix64: seed-stable tie-break keys (the same on every platform).
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// "Smallest key >= x" over keys 0..n-1 in O(levels) via a 64-ary hierarchy of bit words.
class NextSetBit {
 public:
  explicit NextSetBit(int64_t n) {
    int64_t size = n;
    do {
      size = (size + 63) / 64;
      levels_.emplace_back(size, 0ull);
    } while (size > 1);
  }
  void set(int64_t i) {
    for (auto& lvl : levels_) {
      const bool was_empty = lvl[i >> 6] == 0;
      lvl[i >> 6] |= 1ull << (i & 63);
      if (!was_empty) return;
      i >>= 6;
    }
  }
  void reset(int64_t i) {
    for (auto& lvl : levels_) {
      lvl[i >> 6] &= ~(1ull << (i & 63));
      if (lvl[i >> 6] != 0) return;
      i >>= 6;
    }
  }
  // Returns -1 when no key >= i is set.
  int64_t next(int64_t i) const { return next_at(0, i); }

 private:
  int64_t next_at(size_t level, int64_t i) const {
    const auto& lvl = levels_[level];
    int64_t w = i >> 6;
    if (w >= static_cast<int64_t>(lvl.size())) return -1;
    uint64_t bits = lvl[w] & (~0ull << (i & 63));
    if (bits) return (w << 6) | __builtin_ctzll(bits);
    if (level + 1 == levels_.size()) return -1;
    const int64_t up = next_at(level + 1, w + 1);
    if (up < 0) return -1;
    return (up << 6) | __builtin_ctzll(lvl[up]);
  }
  std::vector<std::vector<uint64_t>> levels_;
};

// Best-fit decreasing of `items` (already sorted by length, longest first) into bins of
// `capacity`. Each sample goes to the open bin with the least room that still fits it, so long
// samples share bins with long ones and short samples fill the gaps.
std::vector<std::vector<int64_t>> best_fit_decreasing(const std::vector<int64_t>& items,
                                                      const std::vector<int64_t>& lengths,
                                                      int64_t capacity, NextSetBit& free_by_room,
                                                      std::vector<int32_t>& head) {
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> room;
  std::vector<int32_t> next;  // intrusive list of bins with equal room
  std::vector<int64_t> touched;
  for (const int64_t idx : items) {
    const int64_t len = lengths[idx];
    const int64_t r = free_by_room.next(len);
    int32_t bin;
    if (r < 0) {
      bin = static_cast<int32_t>(bins.size());
      bins.emplace_back();
      room.push_back(capacity);
      next.push_back(-1);
    } else {
      bin = head[r];
      head[r] = next[bin];
      if (head[r] < 0) free_by_room.reset(r);
    }
    bins[bin].push_back(idx);
    room[bin] -= len;
    const int64_t nr = room[bin];
    if (nr > 0) {
      if (head[nr] < 0) {
        free_by_room.set(nr);
        touched.push_back(nr);
      }
      next[bin] = head[nr];
      head[nr] = bin;
    }
  }
  for (const int64_t r : touched) {  // leave the scratch structures empty for the next rank
    if (head[r] >= 0) free_by_room.reset(r);
    head[r] = -1;
  }
  return bins;
}

}  // namespace

std::vector<std::vector<std::vector<int64_t>>> plan_microbatches(
    const std::vector<int64_t>& lengths, int64_t max_tokens, int64_t num_ranks, uint64_t seed) {
  if (max_tokens <= 0 || max_tokens > (int64_t{1} << 31))
    throw std::invalid_argument("max_tokens must be in [1, 2^31], got " + std::to_string(max_tokens));
  if (num_ranks <= 0)
    throw std::invalid_argument("num_ranks must be positive, got " + std::to_string(num_ranks));
  const int64_t n = static_cast<int64_t>(lengths.size());
  double total_tokens = 0.0, total_attn = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = lengths[i];
    if (len <= 0)
      throw std::invalid_argument("sample " + std::to_string(i) + " has length " +
                                  std::to_string(len) + "; lengths must be positive");
    if (len > max_tokens)
      throw std::invalid_argument("sample " + std::to_string(i) + " has " + std::to_string(len) +
                                  " tokens, more than max_tokens=" + std::to_string(max_tokens));
    total_tokens += static_cast<double>(len);
    total_attn += static_cast<double>(len) * static_cast<double>(len);
  }

  // Longest first; equal lengths in a seed-dependent order. Key: (max - len) << 32 | hash.
  std::vector<std::pair<uint64_t, int64_t>> order(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t tie = mix64(seed * 0x100000001B3ull + static_cast<uint64_t>(i)) & 0xFFFFFFFFull;
    order[i] = {(static_cast<uint64_t>(max_tokens - lengths[i]) << 32) | tie, i};
  }
  std::sort(order.begin(), order.end());

  // Longest-processing-time assignment to ranks on two costs at once: each sample goes to the
  // rank whose worse normalized load (tokens, sum len^2) stays lowest after taking it.
  const double tok_mean = std::max(total_tokens / num_ranks, 1.0);
  const double att_mean = std::max(total_attn / num_ranks, 1.0);
  std::vector<double> tok(num_ranks, 0.0), att(num_ranks, 0.0);
  std::vector<std::vector<int64_t>> per_rank(num_ranks);
  for (auto& r : per_rank) r.reserve(n / num_ranks + 1);
  for (const auto& [key, idx] : order) {
    const double len = static_cast<double>(lengths[idx]);
    int64_t best = 0;
    double best_worst = 0.0, best_sum = 0.0;
    for (int64_t r = 0; r < num_ranks; ++r) {
      const double t = (tok[r] + len) / tok_mean, a = (att[r] + len * len) / att_mean;
      const double worst = std::max(t, a), sum = t + a;
      if (r == 0 || worst < best_worst || (worst == best_worst && sum < best_sum)) {
        best = r;
        best_worst = worst;
        best_sum = sum;
      }
    }
    tok[best] += len;
    att[best] += len * len;
    per_rank[best].push_back(idx);
  }

  NextSetBit free_by_room(max_tokens + 1);
  std::vector<int32_t> head(max_tokens + 1, -1);
  std::vector<std::vector<std::vector<int64_t>>> plan(num_ranks);
  for (int64_t r = 0; r < num_ranks; ++r)
    plan[r] = best_fit_decreasing(per_rank[r], lengths, max_tokens, free_by_room, head);
  return plan;
}

void check_pack_args(const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& cu_seqlens,
                     const char* op) {
  TORCH_CHECK(rows.dim() >= 1, op, ": rows must have at least one dim");
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong, op,
              ": starts must be a 1-D int64 tensor");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kInt, op,
              ": cu_seqlens must be a 1-D int32 tensor");
  TORCH_CHECK(cu_seqlens.size(0) == starts.size(0) + 1, op,
              ": cu_seqlens must have len(starts) + 1 entries");
  TORCH_CHECK(starts.device() == rows.device() && cu_seqlens.device() == rows.device(), op,
              ": all tensors must be on the same device");
}

namespace {

// Validates every index range on the calling thread, before the output is allocated and before
// any parallel region: the copy loops then run unchecked and nothing throws from a worker thread.
// Comparisons are overflow-free (a start near INT64_MAX must not wrap to a small end).
void check_segments_cpu(const int64_t* starts, const int32_t* cu, int64_t n, int64_t total,
                        int64_t num_rows, const char* op) {
  MRL_CHECK(cu[0] == 0, op, ": cu_seqlens[0] must be 0, got ", cu[0]);
  MRL_CHECK(cu[n] == total, op, ": cu_seqlens[-1]=", cu[n], " but total=", total);
  MRL_CHECK(num_rows >= 0, op, ": negative row count ", num_rows);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t len = int64_t{cu[s + 1]} - cu[s];
    MRL_CHECK(len >= 0, op, ": cu_seqlens must be non-decreasing (segment ", s, ")");
    MRL_CHECK(starts[s] >= 0 && starts[s] <= num_rows - len, op, ": segment ", s, " (start ",
              starts[s], ", length ", len, ") is outside the ", num_rows, " source rows");
  }
}

}  // namespace

at::Tensor pack_cpu(const at::Tensor& src_in, const at::Tensor& src_starts_in,
                    const at::Tensor& cu_seqlens_in, int64_t total) {
  check_pack_args(src_in, src_starts_in, cu_seqlens_in, "megatron_rl::pack");
  const at::Tensor src = src_in.contiguous();
  const at::Tensor starts = src_starts_in.contiguous();
  const at::Tensor cu = cu_seqlens_in.contiguous();
  const int64_t n = starts.size(0);
  check_segments_cpu(starts.data_ptr<int64_t>(), cu.data_ptr<int32_t>(), n, total, src.size(0),
                     "megatron_rl::pack");
  auto sizes = src.sizes().vec();
  sizes[0] = total;
  at::Tensor out = at::empty(sizes, src.options());
  const int64_t row_bytes = src.numel() == 0 ? 0 : src.nbytes() / src.size(0);
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* dp = static_cast<char*>(out.data_ptr());
  const int64_t* st = starts.data_ptr<int64_t>();
  const int32_t* c = cu.data_ptr<int32_t>();
  // One contiguous memcpy per sequence; grain keeps tiny batches single-threaded.
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      const int64_t len = c[s + 1] - c[s];
      if (len > 0)
        std::memcpy(dp + int64_t{c[s]} * row_bytes, sp + st[s] * row_bytes, len * row_bytes);
    }
  });
  return out;
}

at::Tensor unpack_cpu(const at::Tensor& packed_in, const at::Tensor& dst_starts_in,
                      const at::Tensor& cu_seqlens_in, int64_t num_rows, const at::Scalar& fill) {
  check_pack_args(packed_in, dst_starts_in, cu_seqlens_in, "megatron_rl::unpack");
  const at::Tensor packed = packed_in.contiguous();
  const at::Tensor starts = dst_starts_in.contiguous();
  const at::Tensor cu = cu_seqlens_in.contiguous();
  const int64_t n = starts.size(0);
  check_segments_cpu(starts.data_ptr<int64_t>(), cu.data_ptr<int32_t>(), n, packed.size(0),
                     num_rows, "megatron_rl::unpack");
  auto sizes = packed.sizes().vec();
  sizes[0] = num_rows;
  at::Tensor out = at::full(sizes, fill, packed.options());
  const int64_t row_bytes = packed.numel() == 0 ? 0 : packed.nbytes() / packed.size(0);
  const char* sp = static_cast<const char*>(packed.data_ptr());
  char* dp = static_cast<char*>(out.data_ptr());
  const int64_t* st = starts.data_ptr<int64_t>();
  const int32_t* c = cu.data_ptr<int32_t>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      const int64_t len = c[s + 1] - c[s];
      if (len > 0)
        std::memcpy(dp + st[s] * row_bytes, sp + int64_t{c[s]} * row_bytes, len * row_bytes);
    }
  });
  return out;
}

at::Tensor position_ids_cpu(const at::Tensor& cu_seqlens_in, int64_t total) {
  TORCH_CHECK(cu_seqlens_in.dim() == 1 && cu_seqlens_in.scalar_type() == at::kInt,
              "megatron_rl::position_ids: cu_seqlens must be a 1-D int32 tensor");
  const at::Tensor cu = cu_seqlens_in.contiguous();
  const int64_t n = cu.size(0) - 1;
  const int32_t* c = cu.data_ptr<int32_t>();
  TORCH_CHECK(n >= 0 && c[n] == total && c[0] == 0,
              "megatron_rl::position_ids: cu_seqlens must start at 0 and end at total");
  for (int64_t s = 0; s < n; ++s)  // validated here: never throw from a parallel_for worker
    TORCH_CHECK(c[s + 1] >= c[s], "megatron_rl::position_ids: cu_seqlens must be non-decreasing");
  at::Tensor out = at::empty({total}, cu.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s)
      for (int32_t t = c[s]; t < c[s + 1]; ++t) o[t] = t - c[s];
  });
  return out;
}

}  // namespace megatron_rl
