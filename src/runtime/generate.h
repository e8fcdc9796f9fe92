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

// What the generation loop asks of a model, wherever it runs: feed(tokens, n, pos) runs tokens [0, n)
// at positions pos .. pos + n - 1 (the prompt in chunks, then one token at a time); next(history) picks
// the following id from the last fed token's outputs (history: prompt and generated ids so far).
struct TokenSteps {
  std::function<void(const int32_t* tokens, int n, int pos)> feed;
  std::function<int32_t(const std::vector<int32_t>& history)> next;
};

// The generation loop itself (generate() runs it on the CPU model; turboquant-generate --device cuda on
// the GPU one): prefill in options.prefill_chunk pieces, then next / eos / stop strings / context checks
// and one feed per generated token, with the same stop reasons. eos: the ids that end the sequence.
GenerateResult generate_steps(const TokenSteps& model, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                              const std::vector<int32_t>& eos, int ctx, const GenerateOptions& options,
                              const std::function<void(std::string_view)>& on_text);

// The end-of-sequence ids of a model (config, generation config and tokenizer together).
std::vector<int32_t> eos_ids(const ModelFiles& files, const Tokenizer& tokenizer);

}  // namespace tq
