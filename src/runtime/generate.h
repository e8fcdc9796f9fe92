// Text generation: prefill the prompt (in chunks), then sample token after token, streaming text.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/llama.h"
#include "runtime/sampler.h"
#include "text/tokenizer.h"

namespace tq {

// The tokenizer that belongs to a model: tokenizer.json (or vocab.json + merges.txt) in an HF folder,
// or the vocabulary embedded in a GGUF file.
std::unique_ptr<Tokenizer> load_model_tokenizer(const ModelFiles& files);

struct GenerateOptions {
  int max_tokens = 200;
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings (not included in the output)
  bool stop_at_eos = true;        // the model's EOS ids (config, generation config, tokenizer)
  int prefill_chunk = 512;        // prompt tokens per forward pass
  int ctx_size = 0;               // 0: the model's max_position_embeddings
};

struct GenerateResult {
  std::vector<int32_t> tokens;     // generated ids
  std::string text;                // generated text (without a matched stop string)
  std::string stop_reason;         // "eos", "stop string", "max tokens", "context full"
  int prompt_tokens = 0;
  double prompt_seconds = 0, decode_seconds = 0;
  std::vector<LayerAttentionReport> layers;  // attention path per layer, over the whole run
};

// Runs one sequence (id 0 in every cache, which must hold no sequence yet). on_text receives text as
// it becomes final (complete UTF-8, never a possible start of a stop string).
GenerateResult generate(const LlamaModel& model, const Tokenizer& tokenizer, PromptCache& caches,
                        std::span<const int32_t> prompt, const GenerateOptions& options, ThreadPool& pool,
                        const std::function<void(std::string_view)>& on_text);

// The end-of-sequence ids of a model (config, generation config and tokenizer together).
std::vector<int32_t> eos_ids(const ModelFiles& files, const Tokenizer& tokenizer);

}  // namespace tq
