// Opens a model the way a user names it: a Hugging Face folder (config.json, generation_config.json,
// model.safetensors or an index with shards) or a .gguf file; parses the config and validates the
// weights against it.
#pragma once

#include <memory>
#include <string>

#include "model/config.h"
#include "model/experts.h"
#include "model/gguf.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace tq {

struct MlxTqStorage;

struct ModelFiles {
  std::string path;
  ModelConfig config;
  GenerationConfig generation;  // empty for GGUF and for folders without generation_config.json
  WeightNaming naming = WeightNaming::hf;
  // Exactly one of these owns the mapped files; heap-held so that `weights` stays valid when the
  // ModelFiles object moves.
  std::unique_ptr<SafetensorsModel> safetensors;
  std::unique_ptr<GgufFile> gguf;
  ModelWeights weights;
  // Mixture-of-experts layers (config.num_experts > 0): per-expert views over `weights`.
  ExpertWeights experts;
  // The reference system's TurboQuant folders (model/mlx_tq.h): buffers the tq views point into.
  std::shared_ptr<MlxTqStorage> mlx_tq;

  const TensorSet& tensors() const { return gguf ? gguf->tensors() : safetensors->tensors(); }
};

// `path`: a folder, or a file ending in .gguf. Throws tq::Error naming the file and the problem.
ModelFiles open_model(const std::string& path);

}  // namespace tq
