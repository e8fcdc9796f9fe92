#include "model/loader.h"

#include <filesystem>

#include "core/error.h"
#include "model/mlx_tq.h"
#include "model/tq_weights.h"

namespace tq {

namespace {

// The files of a model, their config and tensor tables, as open_model and open_model_headers both start:
// a folder (config.json, generation_config.json, safetensors read in `mode`) or a .gguf file.
ModelFiles open_files(const std::string& path, SafetensorsRead mode) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TQ_CHECK(fs::exists(path, ec), "model path '", path, "' does not exist");
  ModelFiles m;
  m.path = path;
  if (fs::is_directory(path, ec)) {
    m.config = load_hf_config(path);
    m.generation = load_generation_config(path);
    m.safetensors = std::make_unique<SafetensorsModel>(SafetensorsModel::open(path, mode));
    m.naming = WeightNaming::hf;
  } else {
    const std::string ext = fs::path(path).extension().string();
    TQ_CHECK(ext == ".gguf", "'", path, "' is neither a model folder nor a .gguf file");
    m.gguf = std::make_unique<GgufFile>(GgufFile::open(path));
    m.config = config_from_gguf(*m.gguf);
    m.naming = WeightNaming::gguf;
  }
  return m;
}

// TurboQuant weights (ours and the reference system's) are read for the Llama family only.
void check_tq_architecture(const ModelFiles& m, const char* what) {
  const ModelArch a = m.config.arch;
  TQ_CHECK(a == ModelArch::llama || a == ModelArch::mistral || a == ModelArch::qwen2 || a == ModelArch::qwen3, "'", m.path, "': ", what,
           " are read for the Llama family (llama, mistral, qwen2, qwen3) only, not ", architecture_name(a));
}

}  // namespace

ModelFiles open_model(const std::string& path) {
  ModelFiles m = open_files(path, SafetensorsRead::weights);
  if (m.safetensors) {
    // A turboquant-convert folder: its matrices become tq views under their usual names.
    if (const std::optional<TqQuantization> q = read_tq_quantization(path)) {
      check_tq_architecture(m, "TurboQuant weights");
      attach_tq_weights(*q, m.safetensors->tensors());
    } else if (const std::optional<MlxTqQuantization> mq = read_mlx_tq_quantization(path)) {
      // The reference system's folder: its layers become tq views too (repacked where needed).
      check_tq_architecture(m, "the reference system's TurboQuant folders");
      m.mlx_tq = attach_mlx_tq_weights(*mq, m.safetensors->tensors());
    } else {
      auto ends_with = [](const std::string& s, const std::string& t) {
        return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
      };
      for (const TensorView& t : m.safetensors->tensors().all())
        TQ_CHECK(!ends_with(t.name, ".tq_codes") && !ends_with(t.name, ".tq_scales"), "'", path, "': tensor '", t.name,
                 "' is a TurboQuant plane, but config.json has no quantization block with mode \"", kTqMode, "\"");
      for (const TensorView& t : m.safetensors->tensors().all())
        TQ_CHECK(t.dtype != DType::u32, "'", t.file, "': tensor '", t.name, "' is U32 (packed codes), but config.json has no "
                 "quantization block with mode \"", kMlxTqMode, "\" (the reference system's TurboQuant folders)");
    }
  }
  m.weights = validate_weights(m.config, m.tensors(), m.naming);
  if (m.config.num_experts > 0) m.experts = build_expert_weights(m.config, m.weights, m.naming);
  return m;
}

ModelFiles open_model_headers(const std::string& path) { return open_files(path, SafetensorsRead::header_only); }

int64_t file_tensor_bytes(const TensorSet& tensors) {
  int64_t bytes = 0;
  for (const TensorView& t : tensors.all()) {
    if (t.dtype == DType::tq2 || t.dtype == DType::tq3 || t.dtype == DType::tq4) continue;  // a view over the planes
    bytes += static_cast<int64_t>(t.nbytes);
  }
  return bytes;
}

}  // namespace tq
