// Diffusion block-masking family, CPU half. Contract and layout: block_mask.h.
#include "block_mask/block_mask.h"

#include "check.h"

// The per-op headers, not <ATen/ATen.h> (every op: a quarter of the compile time).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

namespace megatron_rl {

void check_structure_args(const at::Tensor& seq_lens, const at::Tensor& prompt_lens,
                          int64_t block_size, int64_t tile) {
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong,
              "block_diffusion_structure: seq_lens must be a 1-D int64 tensor");
  TORCH_CHECK(prompt_lens.dim() == 1 && prompt_lens.scalar_type() == at::kLong &&
                  prompt_lens.size(0) == seq_lens.size(0),
              "block_diffusion_structure: prompt_lens must be int64 with one entry per sample");
  TORCH_CHECK(prompt_lens.device() == seq_lens.device(),
              "block_diffusion_structure: seq_lens and prompt_lens must share a device");
  TORCH_CHECK(block_size > 0, "block_diffusion_structure: block_size must be positive");
  TORCH_CHECK(tile > 0 && tile <= 1024, "block_diffusion_structure: tile must be in [1, 1024]");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_diffusion_structure_cpu(
    const at::Tensor& seq_lens_in, const at::Tensor& prompt_lens_in, int64_t block_size,
    bool response_origin, int64_t tile, int64_t total) {
  check_structure_args(seq_lens_in, prompt_lens_in, block_size, tile);
  const at::Tensor lens_t = seq_lens_in.contiguous();
  const at::Tensor prompt_t = prompt_lens_in.contiguous();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  const int64_t* prompts = prompt_t.data_ptr<int64_t>();
  const int64_t n = lens_t.size(0);
  std::vector<int64_t> off2(n + 1, 0);
  for (int64_t s = 0; s < n; ++s) {
    MRL_CHECK(lens[s] >= 0 && prompts[s] >= 0 && prompts[s] <= lens[s],
              "block_diffusion_structure: sample ", s, " needs 0 <= prompt_len <= seq_len");
    off2[s + 1] = off2[s] + 2 * lens[s];
  }
  MRL_CHECK(off2[n] == 2 * total, "block_diffusion_structure: total=", total,
            " but sum(seq_lens)=", off2[n] / 2);
  const int64_t L = 2 * total;
  const int64_t T = (L + tile - 1) / tile;
  const auto opts = at::TensorOptions().dtype(at::kInt);
  at::Tensor kv_num = at::empty({1, 1, T}, opts), kv_idx = at::empty({1, 1, T, T}, opts);
  at::Tensor full_num = at::empty({1, 1, T}, opts), full_idx = at::empty({1, 1, T, T}, opts);
  int32_t* kn = kv_num.data_ptr<int32_t>();
  int32_t* ki = kv_idx.data_ptr<int32_t>();
  int32_t* fn = full_num.data_ptr<int32_t>();
  int32_t* fi = full_idx.data_ptr<int32_t>();

  at::parallel_for(0, T, 1, [&](int64_t qb, int64_t qe) {
    // Difference arrays over kv tiles: rows touching a tile, rows covering it whole.
    std::vector<int32_t> touch(T + 1), cover(T + 1);
    std::vector<uint8_t> kind(T);  // 0 empty, 1 partial, 2 full
    int64_t sample = 0;
    for (int64_t qt = qb; qt < qe; ++qt) {
      std::fill(touch.begin(), touch.end(), 0);
      std::fill(cover.begin(), cover.end(), 0);
      auto add = [&](int64_t a, int64_t b) {
        if (a >= b) return;
        ++touch[a / tile];
        --touch[(b - 1) / tile + 1];
        const int64_t c0 = (a + tile - 1) / tile, c1 = b / tile;  // tiles inside [a, b)
        if (c0 < c1) {
          ++cover[c0];
          --cover[c1];
        }
      };
      const int64_t q_end = std::min(L, (qt + 1) * tile);
      for (int64_t q = qt * tile; q < q_end; ++q) {
        while (off2[sample + 1] <= q) ++sample;  // rows only grow within a chunk
        int64_t a0, b0, a1, b1;
        mrl_row_intervals(q, off2[sample], lens[sample], prompts[sample], block_size,
                          response_origin, &a0, &b0, &a1, &b1);
        add(a0, b0);
        add(a1, b1);
      }
      int32_t t_run = 0, c_run = 0, num_partial = 0, num_full = 0;
      for (int64_t kt = 0; kt < T; ++kt) {
        t_run += touch[kt];
        c_run += cover[kt];
        kind[kt] = c_run == tile ? 2 : (t_run > 0 ? 1 : 0);
        num_partial += kind[kt] == 1;
        num_full += kind[kt] == 2;
      }
      kn[qt] = num_partial;
      fn[qt] = num_full;
      int32_t* krow = ki + qt * T;
      int32_t* frow = fi + qt * T;
      int32_t pk = 0, pk_rest = num_partial, pf = 0, pf_rest = num_full;
      for (int64_t kt = 0; kt < T; ++kt) {
        krow[kind[kt] == 1 ? pk++ : pk_rest++] = static_cast<int32_t>(kt);
        frow[kind[kt] == 2 ? pf++ : pf_rest++] = static_cast<int32_t>(kt);
      }
    }
  });
  return {kv_num, kv_idx, full_num, full_idx};
}

void check_noise_args(const at::Tensor& input_ids, const at::Tensor& cu_seqlens,
                      const at::Tensor& prompt_lens, const at::Tensor& ratios,
                      const at::Tensor& seeds, int64_t block_size) {
  TORCH_CHECK(input_ids.dim() == 1, "diffusion_mask_tokens: input_ids must be 1-D (packed THD)");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kInt,
              "diffusion_mask_tokens: cu_seqlens must be 1-D int32");
  const int64_t n = cu_seqlens.size(0) - 1;
  TORCH_CHECK(n >= 0, "diffusion_mask_tokens: cu_seqlens must not be empty");
  TORCH_CHECK(prompt_lens.scalar_type() == at::kLong && prompt_lens.dim() == 1 &&
                  prompt_lens.size(0) == n,
              "diffusion_mask_tokens: prompt_lens must be int64 [num_samples]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 1 && seeds.size(0) == n,
              "diffusion_mask_tokens: seeds must be int64 [num_samples]");
  TORCH_CHECK(ratios.scalar_type() == at::kFloat && ratios.dim() == 2 && ratios.size(0) == n &&
                  ratios.size(1) >= 1,
              "diffusion_mask_tokens: ratios must be float32 [num_samples, num_blocks >= 1]");
  TORCH_CHECK(block_size >= 0, "diffusion_mask_tokens: block_size must be >= 0 (0 = per sample)");
  for (const at::Tensor* t : {&cu_seqlens, &prompt_lens, &ratios, &seeds})
    TORCH_CHECK(t->device() == input_ids.device(),
                "diffusion_mask_tokens: all tensors must be on one device");
}

std::tuple<at::Tensor, at::Tensor> diffusion_mask_tokens_cpu(
    const at::Tensor& input_ids_in, const at::Tensor& cu_seqlens_in,
    const at::Tensor& prompt_lens_in, const at::Tensor& ratios_in, const at::Tensor& seeds_in,
    int64_t block_size, bool response_origin, int64_t mask_id, bool complement) {
  check_noise_args(input_ids_in, cu_seqlens_in, prompt_lens_in, ratios_in, seeds_in, block_size);
  const at::Tensor ids = input_ids_in.contiguous(), cu_t = cu_seqlens_in.contiguous();
  const at::Tensor prompt_t = prompt_lens_in.contiguous(), ratio_t = ratios_in.contiguous();
  const at::Tensor seed_t = seeds_in.contiguous();
  const int64_t n = cu_t.size(0) - 1, nb = ratio_t.size(1);
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[n] == ids.size(0),
              "diffusion_mask_tokens: cu_seqlens must span input_ids");
  const int64_t* prompts = prompt_t.data_ptr<int64_t>();
  const float* ratios = ratio_t.data_ptr<float>();
  const int64_t* seeds = seed_t.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "diffusion_mask_tokens: cu_seqlens must be non-decreasing");
    MRL_CHECK(prompts[s] >= 0 && prompts[s] <= cu[s + 1] - cu[s],
              "diffusion_mask_tokens: sample ", s, " needs 0 <= prompt_len <= length");
  }
  at::Tensor out_ids = ids.clone();
  at::Tensor weights = at::zeros({ids.size(0)}, ids.options().dtype(at::kFloat));
  float* w = weights.data_ptr<float>();
  AT_DISPATCH_INTEGRAL_TYPES(ids.scalar_type(), "diffusion_mask_tokens_cpu", [&] {
    scalar_t* o = out_ids.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t sb, int64_t se) {
      for (int64_t s = sb; s < se; ++s) {
        const int64_t len = cu[s + 1] - cu[s];
        for (int64_t i = prompts[s]; i < len; ++i) {
          int64_t b = 0, bs, be;
          if (block_size > 0) mrl_block_of(i, len, prompts[s], block_size, response_origin, &b, &bs, &be);
          const float p = b < nb ? ratios[s * nb + b] : 0.0f;
          const float u = mrl_uniform24(seeds[s], i);
          const bool masked = complement ? u >= p : u < p;
          if (masked) {
            o[cu[s] + i] = static_cast<scalar_t>(mask_id);
            w[cu[s] + i] = complement ? 1.0f / (1.0f - p) : 1.0f / p;
          }
        }
      }
    });
  });
  return {out_ids, weights};
}

}  // namespace megatron_rl
