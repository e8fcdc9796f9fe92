// Prompt cache files: every layer's cache of a model for the sequences it holds (KV caches of any format,
// recurrent states), saved with the fingerprint of the model that computed them, so that a file loads only
// into a model of the same shape (a cache of another model would run, and be wrong). The format is in
// docs/FORMATS.md ("Prompt cache file").
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kv/cache.h"

namespace tq {

// What a prompt cache must agree on with the model it goes into: the architecture, and per layer its kind
// and shapes. A file's fingerprint also names each KV cache's format (its describe()); a model's leaves
// the formats empty (a cache of any format runs on the model).
struct LayerFingerprint {
  LayerKind kind = LayerKind::full_attention;
  int n_kv_heads = 0, head_dim = 0;  // attention layers
  int window = 0;                    // sliding_attention
  StateShape state;                  // linear_attention
  std::string format;                // the KV cache's describe(); "" for a state, or where any format goes
};

struct ModelFingerprint {
  std::string architecture;  // architecture_name(): "llama", "qwen3_5", ...
  std::vector<LayerFingerprint> layers;
};

// A model's fingerprint, from its architecture name and layers (Model::layer_specs()).
ModelFingerprint model_fingerprint(const std::string& architecture, const std::vector<LayerSpec>& layers);
// The fingerprint of caches, their formats included (a KV cache with a window is a sliding-window layer's).
// Throws for a cache a file cannot hold (neither a KVCache nor a recurrent state), naming its layer.
ModelFingerprint cache_fingerprint(const std::string& architecture, const PromptCache& caches);
// The first way `held` (what `holder` holds: "the file", "the prompt cache") differs from `model`, in words
// ("layer 3: the file holds a state cache of conv 96x3, recurrent 4x32x32; this model's layer 3 is full
// attention with 2 KV heads of 64"), or "" when they agree. Formats are compared where both name one.
std::string first_difference(const ModelFingerprint& held, const ModelFingerprint& model, const std::string& holder = "the file");

using PromptCacheMetadata = std::map<std::string, std::string>;

// Writes every layer's cache for every sequence it holds, the fingerprint and the metadata (whatever the
// caller wants back: the tokens' text, the model's path). The KV caches must be CPU ones (KVCache); the
// states go through RecurrentStateCache::snapshot, on any device. Throws, writing nothing, when the caches
// are not the model's (naming the first difference), a cache is of a kind the file cannot hold, or the
// layers hold different sequences.
void save_prompt_cache(const std::string& path, const PromptCache& caches, const ModelFingerprint& model,
                       const PromptCacheMetadata& metadata = {});

struct LoadedPromptCache {
  PromptCache caches;            // one per layer, in host memory (KVCache, StateCache), with the saved sequences
  PromptCacheMetadata metadata;
  ModelFingerprint fingerprint;  // the file's, the formats included
};

// Reads a file save_prompt_cache wrote. A file of another model is refused naming the first difference
// from `model`; a file that is not one, corrupt, truncated or of another version, naming that.
LoadedPromptCache load_prompt_cache(const std::string& path, const ModelFingerprint& model);

}  // namespace tq
