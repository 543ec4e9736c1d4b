// Token streaming buffer (host helper, exposed through pybind11). Contract: streaming.h.
#include "streaming/streaming.h"

// The per-op headers, not <ATen/ATen.h> (every op: a quarter of the compile time).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

namespace megatron_rl {

TokenStreamBuffer::TokenStreamBuffer(int64_t capacity_tokens, bool pin_memory)
    : capacity_(capacity_tokens), pin_memory_(pin_memory) {
  if (capacity_tokens <= 0)
    throw std::invalid_argument("capacity_tokens must be positive, got " +
                                std::to_string(capacity_tokens));
}

bool TokenStreamBuffer::append(int64_t sample_id, const at::Tensor& tokens, bool finished,
                               double timeout_s) {
  TORCH_CHECK(tokens.device().is_cpu() && tokens.dim() == 1,
              "TokenStreamBuffer.append: tokens must be a 1-D CPU tensor");
  TORCH_CHECK(tokens.scalar_type() == at::kLong || tokens.scalar_type() == at::kInt,
              "TokenStreamBuffer.append: tokens must be int64 or int32");
  const at::Tensor t = tokens.to(at::kLong).contiguous();
  return append_raw(sample_id, t.data_ptr<int64_t>(), t.numel(), finished, timeout_s);
}

bool TokenStreamBuffer::append_list(int64_t sample_id, const std::vector<int64_t>& tokens,
                                    bool finished, double timeout_s) {
  return append_raw(sample_id, tokens.data(), static_cast<int64_t>(tokens.size()), finished,
                    timeout_s);
}

bool TokenStreamBuffer::append_raw(int64_t sample_id, const int64_t* data, int64_t n,
                                   bool finished, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto has_room = [&] { return closed_ || buffered_ == 0 || buffered_ + n <= capacity_; };
  if (!has_room()) {
    ++num_waiting_producers_;
    bool ok = true;
    if (timeout_s < 0) {
      room_cv_.wait(lock, has_room);
    } else {
      ok = room_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), has_room);
    }
    --num_waiting_producers_;
    if (!ok) return false;
  }
  if (closed_) throw std::runtime_error("TokenStreamBuffer is closed");
  Entry& e = entries_[sample_id];
  if (e.finished)
    throw std::invalid_argument("sample " + std::to_string(sample_id) +
                                " was already marked finished");
  e.tokens.insert(e.tokens.end(), data, data + n);
  buffered_ += n;
  if (finished) {
    e.finished = true;
    finished_order_.push_back(sample_id);
  } else if (n > 0 && !e.queued_partial) {
    e.queued_partial = true;
    partial_order_.push_back(sample_id);
  }
  if (num_waiting_consumers_ > 0) data_cv_.notify_all();
  return true;
}

void TokenStreamBuffer::collect_locked(int64_t max_samples, bool partial,
                                       std::vector<int64_t>& ids, std::vector<bool>& finished,
                                       std::vector<std::vector<int64_t>>& chunks) {
  const size_t limit = max_samples <= 0 ? SIZE_MAX : static_cast<size_t>(max_samples);
  int64_t freed = 0;
  while (!finished_order_.empty() && ids.size() < limit) {
    const int64_t id = finished_order_.front();
    finished_order_.pop_front();
    auto it = entries_.find(id);
    freed += static_cast<int64_t>(it->second.tokens.size());
    ids.push_back(id);
    finished.push_back(true);
    chunks.push_back(std::move(it->second.tokens));
    entries_.erase(it);
  }
  while (partial && !partial_order_.empty() && ids.size() < limit) {
    const int64_t id = partial_order_.front();
    partial_order_.pop_front();
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.finished) continue;  // taken as finished already
    Entry& e = it->second;
    e.queued_partial = false;
    if (e.tokens.empty()) continue;
    freed += static_cast<int64_t>(e.tokens.size());
    ids.push_back(id);
    finished.push_back(false);
    chunks.push_back(std::move(e.tokens));
    e.tokens = {};
  }
  buffered_ -= freed;
  if (freed > 0 && num_waiting_producers_ > 0) room_cv_.notify_all();
}

StreamBatch TokenStreamBuffer::make_batch(std::vector<int64_t> ids, std::vector<bool> finished,
                                          const std::vector<std::vector<int64_t>>& chunks) const {
  const int64_t n = static_cast<int64_t>(ids.size());
  at::Tensor offsets = at::empty({n + 1}, at::kLong);
  int64_t* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t i = 0; i < n; ++i) off[i + 1] = off[i] + static_cast<int64_t>(chunks[i].size());
  at::Tensor tokens =
      at::empty({off[n]}, at::TensorOptions().dtype(at::kLong).pinned_memory(pin_memory_));
  int64_t* dst = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (!chunks[i].empty())
      std::memcpy(dst + off[i], chunks[i].data(), chunks[i].size() * sizeof(int64_t));
  return StreamBatch{std::move(ids), std::move(finished), std::move(tokens), std::move(offsets)};
}

StreamBatch TokenStreamBuffer::take(int64_t max_samples, bool partial, double timeout_s) {
  std::vector<int64_t> ids;
  std::vector<bool> finished;
  std::vector<std::vector<int64_t>> chunks;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] {
      if (closed_ || !finished_order_.empty()) return true;
      if (!partial) return false;
      for (const int64_t id : partial_order_) {  // stale ids are dropped by collect_locked
        auto it = entries_.find(id);
        if (it != entries_.end() && !it->second.finished && !it->second.tokens.empty())
          return true;
      }
      return false;
    };
    if (!ready()) {
      ++num_waiting_consumers_;
      if (timeout_s < 0) {
        data_cv_.wait(lock, ready);
      } else {
        data_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready);
      }
      --num_waiting_consumers_;
    }
    collect_locked(max_samples, partial, ids, finished, chunks);
  }
  return make_batch(std::move(ids), std::move(finished), chunks);
}

StreamBatch TokenStreamBuffer::drain() {
  std::vector<int64_t> ids;
  std::vector<bool> finished;
  std::vector<std::vector<int64_t>> chunks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    collect_locked(0, true, ids, finished, chunks);
    // Samples whose pending tokens were all taken earlier but that never finished hold nothing.
    entries_.clear();
    partial_order_.clear();
  }
  room_cv_.notify_all();
  data_cv_.notify_all();
  return make_batch(std::move(ids), std::move(finished), chunks);
}

void TokenStreamBuffer::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  room_cv_.notify_all();
  data_cv_.notify_all();
}

bool TokenStreamBuffer::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

int64_t TokenStreamBuffer::buffered_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return buffered_;
}

}  // namespace megatron_rl
