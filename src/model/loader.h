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

// The same model read from its headers only (what turboquant-plan and the tools' up-front memory check
// read): config.json or the GGUF metadata, and the tensor tables of the safetensors files or the GGUF file,
// mapped but with no tensor data touched. `weights` and `experts` stay empty (no weight checks, no MXFP4
// repacking, no TurboQuant scale checks). A folder of the reference system's TurboQuant weights
// (config.json quantization.mode "turboquant": U32 codes) lists its tensors as flat bytes
// (SafetensorsRead::header_only), and so does any folder whose dtypes this reader cannot compute with.
ModelFiles open_model_headers(const std::string& path);

// The bytes of the tensors stored in the files: every tensor of the set but the TurboQuant views the loader
// adds over the tq planes (model/tq_weights.h), which are bytes of the files counted once, as planes.
int64_t file_tensor_bytes(const TensorSet& tensors);

}  // namespace tq
