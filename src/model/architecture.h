// An architecture: one model family's layer math, stated once as calls on the device interface
// (device/device.h), for every backend. One file per family (model/llama.cc, ...); the table in
// architectures.cc maps a checkpoint's architecture to its builder.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "device/device.h"
#include "kv/cache.h"
#include "model/loader.h"

namespace tq {

class Architecture {
 public:
  virtual ~Architecture() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int64_t vocab_size() const = 0;
  // One cache per layer: what it is (full or sliding-window attention, a recurrent state) and its shape.
  virtual std::vector<LayerSpec> layer_specs() const = 0;
  // The forward pass of the device's current step (called inside Device::run_step): every row of the
  // batch through every layer, appending to and attending over `caches` (one per layer), then the logits
  // of the step's output rows (Device::set_logits). attention: one per layer, counts the paths that ran
  // (may be null).
  virtual void forward(Device& dev, std::vector<std::unique_ptr<LayerCache>>& caches, std::vector<AttentionStats>* attention) const = 0;
};

// One cache per layer of a model with this config, from the config alone (every architecture's
// layer_specs() returns this; the memory plan reads it without building the model): full attention, a
// sliding window where the config says a layer slides, a recurrent state for Gated DeltaNet layers.
std::vector<LayerSpec> layer_specs_for(const ModelConfig& config);

// The architecture of a checkpoint, its weights handed to `device` (uploaded or mapped). `files` must
// outlive the result (the CPU backend reads the mapped weights in place). Throws tq::Error for an
// architecture no file implements.
std::unique_ptr<Architecture> build_architecture(const ModelFiles& files, Device& device);

}  // namespace tq
