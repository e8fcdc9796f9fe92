// Checks of the engine's batch contract, shared by the CPU tests (engine_test.cc) and the GPU tests
// (cuda/gpu_model_test.cc): the same scenarios on either device.
//
//   batch_vs_alone    sequences of different lengths run in mixed batches (prompt chunks and decode
//                     tokens together) against each run alone: the largest relative difference of a
//                     logits row.
//   random_operations add / fork / truncate / remove / forward at random, every forward's logits against
//                     a replay of each sequence's tokens alone in a fresh engine.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/rng.h"
#include "runtime/engine.h"

namespace tq::testing_util {

// max |a - b| / max |b| over a row of n values.
inline double relative_error(const float* a, const float* b, int64_t n) {
  double max_ref = 0, max_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(b[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

inline std::vector<int32_t> random_ids(int64_t vocab, int n, SplitMix64& rng) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab));
  return t;
}

inline std::unique_ptr<Engine> make_engine(Model& model, const KVSettings& kv, int sequences, int64_t ctx) {
  EngineOptions o;
  o.kv = kv;
  o.max_sequences = sequences;
  o.ctx_size = ctx;
  o.kv_pool_tokens = static_cast<int64_t>(sequences) * ctx;
  return std::make_unique<Engine>(model, o);
}

// The logits of every position of `tokens` fed to a new sequence of a fresh engine, in chunks of `chunk`
// (the first chunk of `first_chunk` when that is given: a prompt, then tokens one by one).
inline std::vector<float> alone_logits(Model& model, const KVSettings& kv, const std::vector<int32_t>& tokens, size_t chunk, int64_t ctx,
                                       size_t first_chunk = 0) {
  auto engine = make_engine(model, kv, 1, ctx);
  const int seq = engine->add_sequence();
  const size_t V = static_cast<size_t>(model.vocab_size());
  std::vector<float> logits(tokens.size() * V);
  for (size_t done = 0; done < tokens.size();) {
    const size_t n = std::min(done == 0 && first_chunk > 0 ? first_chunk : chunk, tokens.size() - done);
    const BatchEntry e{seq, std::span<const int32_t>(tokens.data() + done, n), -1, Logits::all};
    engine->forward({&e, 1});
    engine->read_logits(logits.data() + done * V);
    done += n;
  }
  return logits;
}

// `sequences` sequences of 1..40 prompt tokens and 6 more tokens each (teacher-forced, so that every run
// sees the same ids) in one engine: sequence i joins at step i % 3; each step, every sequence that has
// tokens left takes part, a prompt with a chunk of 1..7 tokens, a decoding sequence with one; every row's
// logits come back. Returns the largest relative difference between a row and the same position run alone
// (the whole prompt in one chunk, then token by token).
inline double batch_vs_alone(Model& model, const KVSettings& kv, int sequences, uint64_t seed) {
  SplitMix64 rng(seed);
  const int64_t V = model.vocab_size();
  constexpr int kDecode = 6;
  const int64_t ctx = 64;
  std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(sequences));
  std::vector<int> prompt(static_cast<size_t>(sequences));
  for (int i = 0; i < sequences; ++i) {
    prompt[i] = 1 + static_cast<int>(rng.next() % 40);
    tokens[i] = random_ids(V, prompt[i] + kDecode, rng);
  }
  auto engine = make_engine(model, kv, sequences, ctx);
  std::vector<int> seq(static_cast<size_t>(sequences), -1), fed(static_cast<size_t>(sequences), 0);
  std::vector<std::vector<float>> batched(static_cast<size_t>(sequences));
  for (int i = 0; i < sequences; ++i) batched[i].resize(tokens[i].size() * static_cast<size_t>(V));
  int mixed_steps = 0;
  for (int step = 0;; ++step) {
    std::vector<BatchEntry> batch;
    std::vector<int> who;
    bool prefill = false, decode = false;
    for (int i = 0; i < sequences; ++i) {
      if (step < i % 3 || fed[i] == static_cast<int>(tokens[i].size())) continue;
      if (seq[i] < 0) seq[i] = engine->add_sequence();
      const int left_in_prompt = prompt[i] - fed[i];
      const int n = left_in_prompt > 0 ? std::min(left_in_prompt, 1 + static_cast<int>(rng.next() % 7)) : 1;
      (left_in_prompt > 0 ? prefill : decode) = true;
      batch.push_back({seq[i], std::span<const int32_t>(tokens[i].data() + fed[i], static_cast<size_t>(n)), fed[i], Logits::all});
      who.push_back(i);
    }
    if (batch.empty()) break;
    mixed_steps += prefill && decode;
    const BatchOutput out = engine->forward(batch);
    const std::vector<float> logits = engine->logits();
    for (size_t b = 0; b < batch.size(); ++b) {
      const int i = who[b];
      std::copy_n(logits.begin() + static_cast<size_t>(out.first_row[b]) * V, batch[b].tokens.size() * V,
                  batched[i].begin() + static_cast<size_t>(fed[i]) * V);
      fed[i] += static_cast<int>(batch[b].tokens.size());
    }
  }
  if (sequences >= 3) {
    EXPECT_GT(mixed_steps, 0) << "no batch mixed prompt chunks and decode tokens";
  }
  double worst = 0;
  for (int i = 0; i < sequences; ++i) {
    const std::vector<float> alone = alone_logits(model, kv, tokens[i], 1, ctx, static_cast<size_t>(prompt[i]));
    for (size_t p = 0; p < tokens[i].size(); ++p)
      worst = std::max(worst, relative_error(batched[i].data() + p * V, alone.data() + p * V, V));
  }
  return worst;
}

// Random add / fork / truncate / remove / forward on one engine (up to 6 sequences), each forward's
// logits against the sequence's tokens replayed alone; also that a fork shares its parent's blocks.
// Returns the largest relative difference.
inline double random_operations(Model& model, const KVSettings& kv, int operations, uint64_t seed) {
  SplitMix64 rng(seed);
  const int64_t V = model.vocab_size();
  const int64_t ctx = 48;
  constexpr int kMaxSequences = 6;
  auto engine = make_engine(model, kv, kMaxSequences, ctx);
  std::map<int, std::vector<int32_t>> history;  // each live sequence's tokens
  double worst = 0;
  int forwards = 0, forks = 0, truncates = 0, removes = 0;
  for (int op = 0; op < operations; ++op) {
    const int what = static_cast<int>(rng.next() % 10);
    std::vector<int> live;
    for (const auto& [id, h] : history) live.push_back(id);
    const int pick = live.empty() ? -1 : live[rng.next() % live.size()];
    if (live.empty() || (what == 0 && live.size() < kMaxSequences)) {
      history[engine->add_sequence()] = {};
    } else if (what == 1 && live.size() < kMaxSequences && !history[pick].empty()) {
      const MemoryUsage before = engine->memory();
      const int child = engine->fork_sequence(pick);
      const MemoryUsage after = engine->memory();
      EXPECT_EQ(after.blocks_in_use, before.blocks_in_use) << "a fork took blocks of its own";
      history[child] = history[pick];
      ++forks;
    } else if (what == 2 && !history[pick].empty()) {
      const int length = static_cast<int>(rng.next() % (history[pick].size() + 1));
      engine->truncate(pick, length);
      history[pick].resize(static_cast<size_t>(length));
      ++truncates;
    } else if (what == 3 && live.size() > 1) {
      engine->remove_sequence(pick);
      history.erase(pick);
      ++removes;
    } else {
      // A forward over a random subset of the live sequences, 1..4 tokens each, where the context allows.
      std::vector<BatchEntry> batch;
      std::vector<std::vector<int32_t>> fresh;
      fresh.reserve(live.size());
      for (int id : live) {
        if (rng.next() % 3 == 0) continue;
        const int room = static_cast<int>(ctx) - static_cast<int>(history[id].size());
        if (room <= 0) continue;
        const int n = std::min(room, 1 + static_cast<int>(rng.next() % 4));
        fresh.push_back(random_ids(V, n, rng));
        batch.push_back({id, fresh.back(), static_cast<int>(history[id].size()), Logits::all});
      }
      if (batch.empty()) continue;
      const BatchOutput out = engine->forward(batch);
      const std::vector<float> logits = engine->logits();
      ++forwards;
      for (size_t b = 0; b < batch.size(); ++b) {
        std::vector<int32_t>& h = history[batch[b].seq];
        const size_t before = h.size();
        h.insert(h.end(), batch[b].tokens.begin(), batch[b].tokens.end());
        const std::vector<float> alone = alone_logits(model, kv, h, h.size(), ctx);
        for (size_t i = 0; i < batch[b].tokens.size(); ++i)
          worst = std::max(worst, relative_error(logits.data() + (static_cast<size_t>(out.first_row[b]) + i) * V,
                                                 alone.data() + (before + i) * V, V));
      }
    }
    for (const auto& [id, h] : history) EXPECT_EQ(engine->length(id), static_cast<int>(h.size())) << "sequence " << id;
  }
  EXPECT_GT(forwards, operations / 4);
  EXPECT_GT(forks, 0);
  EXPECT_GT(truncates, 0);
  EXPECT_GT(removes, 0);
  return worst;
}

}  // namespace tq::testing_util
