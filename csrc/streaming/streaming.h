// Token streaming buffer: a bounded, multi-producer store of rollout tokens keyed by sample id.
//
// Producers (engine callbacks, threads) append token chunks to a sample and mark it finished;
// consumers take finished samples in completion order, or (partial=true) also the chunks of
// unfinished samples received so far, for prefix log-probs. Every token is handed out exactly
// once and in append order per sample. All blocking methods release the GIL (bindings.cpp).
//
// Output layout of take()/drain(): a StreamBatch with
//   sample_ids [n], finished [n], tokens int64 [total] (pinned when pin_memory, so that
//   .to("cuda", non_blocking=True) is a real async copy), offsets int64 [n+1] (sample i owns
//   tokens[offsets[i]:offsets[i+1]]; this is the `src_starts`/ragged layout megatron_rl::pack reads).
//
// Backpressure: append blocks while buffered + chunk > capacity (a chunk larger than the whole
// capacity is admitted into an empty buffer). A consumer that takes finished samples only must
// size capacity above the tokens of all in-flight samples, or take with partial=true.
// close(): later appends raise; blocked producers wake up and raise; take() keeps returning
// finished samples and returns an empty batch once none are left. drain() closes the buffer and
// returns everything left: finished samples first (completion order), then unfinished ones.
// Tolerance: exact (tokens are copied, never converted).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

namespace megatron_rl {

struct StreamBatch {
  std::vector<int64_t> sample_ids;
  std::vector<bool> finished;
  at::Tensor tokens;   // int64 [total]
  at::Tensor offsets;  // int64 [n + 1]
};

class TokenStreamBuffer {
 public:
  TokenStreamBuffer(int64_t capacity_tokens, bool pin_memory);

  // Appends `tokens` (1-D, int64 or int32, CPU) to sample_id; finished marks its last chunk.
  // timeout_s < 0 waits for room forever; returns false if the timeout passed first.
  bool append(int64_t sample_id, const at::Tensor& tokens, bool finished, double timeout_s);
  bool append_list(int64_t sample_id, const std::vector<int64_t>& tokens, bool finished,
                   double timeout_s);
  // Takes up to max_samples (<= 0: all available) samples, waiting up to timeout_s (< 0: forever)
  // for one. Empty batch on timeout, or when closed and nothing is left.
  StreamBatch take(int64_t max_samples, bool partial, double timeout_s);
  StreamBatch drain();
  void close();

  bool closed() const;
  int64_t buffered_tokens() const;
  int64_t capacity() const { return capacity_; }

 private:
  struct Entry {
    std::vector<int64_t> tokens;
    bool finished = false;
    bool queued_partial = false;
  };
  bool append_raw(int64_t sample_id, const int64_t* data, int64_t n, bool finished,
                  double timeout_s);
  // Moves the selected samples' tokens out under the lock; the caller builds tensors unlocked.
  void collect_locked(int64_t max_samples, bool partial, std::vector<int64_t>& ids,
                      std::vector<bool>& finished, std::vector<std::vector<int64_t>>& chunks);
  StreamBatch make_batch(std::vector<int64_t> ids, std::vector<bool> finished,
                         const std::vector<std::vector<int64_t>>& chunks) const;

  const int64_t capacity_;
  const bool pin_memory_;
  mutable std::mutex mu_;
  std::condition_variable room_cv_;  // producers wait for room
  std::condition_variable data_cv_;  // consumers wait for data
  int64_t buffered_ = 0;
  int num_waiting_producers_ = 0;
  int num_waiting_consumers_ = 0;
  bool closed_ = false;
  std::unordered_map<int64_t, Entry> entries_;
  std::deque<int64_t> finished_order_;
  std::deque<int64_t> partial_order_;  // may hold ids that have since finished (skipped on take)
};

}  // namespace megatron_rl
