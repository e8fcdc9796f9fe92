// Text generation: prefill the prompt (in chunks), then sample token after token, streaming text.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/engine.h"
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
  // Stream special tokens as their text ("<|channel|>"), for output whose markers carry meaning (gpt-oss's
  // harmony channels, parsed by chat/harmony.h); otherwise they are left out of the text.
  bool special_tokens_as_text = false;
};

struct GenerateResult {
  std::vector<int32_t> tokens;     // generated ids
  std::string text;                // generated text (without a matched stop string)
  std::string stop_reason;         // "eos", "stop string", "max tokens", "context full"
  int prompt_tokens = 0;
  double prompt_seconds = 0, decode_seconds = 0;
  std::vector<LayerAttentionReport> layers;  // attention path per layer, over the engine's calls so far
  int seq = -1;                    // the engine's sequence that holds the prompt and the generated tokens
};

// Runs one new sequence of the engine (left in it: its memory can be read, it can be continued or
// removed). on_text receives text as it becomes final (complete UTF-8, never a possible start of a stop
// string). Greedy decoding without a repetition penalty takes the argmax where the logits are (on the
// GPU, no logits are copied back); anything else samples the logits on the host.
GenerateResult generate(Engine& engine, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                        const GenerateOptions& options, const std::function<void(std::string_view)>& on_text);

// What the generation loop asks of a model, wherever it runs: feed(tokens, n, pos) runs tokens [0, n)
// at positions pos .. pos + n - 1 (the prompt in chunks, then one token at a time); next(history) picks
// the following id from the last fed token's outputs (history: prompt and generated ids so far).
struct TokenSteps {
  std::function<void(const int32_t* tokens, int n, int pos)> feed;
  std::function<int32_t(const std::vector<int32_t>& history)> next;
};

// The generation loop itself (generate() runs it on an engine): prefill in options.prefill_chunk pieces, then next / eos / stop strings / context checks
// and one feed per generated token, with the same stop reasons. eos: the ids that end the sequence.
GenerateResult generate_steps(const TokenSteps& model, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                              const std::vector<int32_t>& eos, int ctx, const GenerateOptions& options,
                              const std::function<void(std::string_view)>& on_text);

// The chat template of a model: chat_template.jinja or tokenizer_config.json in an HF folder, or the
// GGUF key tokenizer.chat_template. Empty when the model has none.
std::string find_chat_template(const ModelFiles& files);

// The end-of-sequence ids of a model (config, generation config and tokenizer together). For a harmony
// tokenizer (gpt-oss) they always include <|return|> and <|call|>, and never <|end|>, which only ends
// one message (the reasoning before the answer).
std::vector<int32_t> eos_ids(const ModelFiles& files, const Tokenizer& tokenizer);

// A tokenizer with gpt-oss's harmony markers as special tokens (<|start|>, <|channel|>, <|message|>,
// <|end|>, <|return|>, <|call|>): its model writes harmony channels.
bool is_harmony_tokenizer(const Tokenizer& tokenizer);

}  // namespace tq
