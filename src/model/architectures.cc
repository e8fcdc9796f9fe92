// The architecture table: which file builds which checkpoint.
#include "core/error.h"
#include "model/architecture.h"
#include "model/gpt_oss.h"
#include "model/llama.h"
#include "model/qwen3_5.h"

namespace tq {

std::unique_ptr<Architecture> build_architecture(const ModelFiles& files, Device& device) {
  switch (files.config.arch) {
    case ModelArch::llama:
    case ModelArch::mistral:
    case ModelArch::qwen2:
    case ModelArch::qwen3: return std::make_unique<Llama>(files, device);
    case ModelArch::gpt_oss: return std::make_unique<GptOss>(files, device);
    case ModelArch::qwen3_5: return std::make_unique<Qwen35>(files, device);
  }
  fail(files.path, ": no architecture file builds '", files.config.architecture_class, "'");
}

}  // namespace tq
