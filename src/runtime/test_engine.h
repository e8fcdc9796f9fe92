// Helpers for the tests that run models through the engine on the CPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "device/cpu_device.h"
#include "runtime/engine.h"

namespace tq::testing_util {

// A model on a CPU device of its own.
struct CpuModel {
  CpuModel(const std::string& path, int threads) : device(threads), model(Model::open(path, device)) {}
  CpuDevice device;
  std::unique_ptr<Model> model;
};


// An engine with dense caches of `type` ("f32", "f16", "bf16") for up to `sequences` sequences.
inline std::unique_ptr<Engine> dense_engine(Model& model, const std::string& type, int sequences = 1) {
  EngineOptions o;
  o.kv.k_type = o.kv.v_type = type;
  o.kv.resolve();
  o.max_sequences = sequences;
  return std::make_unique<Engine>(model, o);
}

// Runs tokens through sequence `seq` (at its end) in chunks; returns the logits of every position fed,
// [tokens][vocab].
inline std::vector<float> feed_all(Engine& engine, int seq, const std::vector<int32_t>& tokens, size_t chunk) {
  const size_t V = static_cast<size_t>(engine.model().vocab_size());
  std::vector<float> logits(tokens.size() * V);
  for (size_t done = 0; done < tokens.size();) {
    const size_t n = std::min(chunk, tokens.size() - done);
    const BatchEntry e{seq, std::span<const int32_t>(tokens.data() + done, n), -1, Logits::all};
    engine.forward({&e, 1});
    engine.read_logits(logits.data() + done * V);
    done += n;
  }
  return logits;
}

// n token ids drawn uniformly from [0, vocab), reproducible from seed.
inline std::vector<int32_t> random_tokens(size_t n, uint64_t seed, int vocab) {
  SplitMix64 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab));
  return t;
}

// Logits against a reference, position by position ([positions][vocab] each): the largest |got - want| over
// the largest |want| of a position, at the worst position.
inline double worst_position_error(const std::vector<float>& got, const std::vector<double>& want, size_t vocab) {
  double worst = 0;
  for (size_t p = 0; p < want.size() / vocab; ++p) {
    double err = 0, scale = 0;
    for (size_t j = 0; j < vocab; ++j) {
      err = std::max(err, std::fabs(got[p * vocab + j] - want[p * vocab + j]));
      scale = std::max(scale, std::fabs(want[p * vocab + j]));
    }
    worst = std::max(worst, err / scale);
  }
  return worst;
}

// Greedy decoding of a new sequence: the prompt in one forward pass, then one token at a time.
inline std::vector<int32_t> greedy(Engine& engine, const std::vector<int32_t>& prompt, int steps) {
  const int seq = engine.add_sequence();
  BatchEntry e{seq, prompt, -1, Logits::last};
  engine.forward({&e, 1});
  std::vector<int32_t> out;
  for (int s = 0; s < steps; ++s) {
    const int32_t next = engine.argmax()[0];
    out.push_back(next);
    e.tokens = std::span<const int32_t>(&out.back(), 1);
    engine.forward({&e, 1});
  }
  return out;
}

}  // namespace tq::testing_util
