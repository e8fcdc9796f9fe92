#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/gguf.h"
#include "model/mapped_file.h"

namespace tq {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

struct ArchInfo {
  const char* hf_class;
  const char* model_type;
  ModelArch arch;
  int64_t default_max_positions;  // the transformers config class's default
  // Multimodal wrappers (Qwen3_5*ForConditionalGeneration): the text model's fields sit under
  // "text_config", whose model_type is this; nullptr for flat configs.
  const char* text_model_type = nullptr;
  bool experts = false;  // the class's feed-forward blocks are mixtures of experts (Qwen3.5-MoE)
};
constexpr ArchInfo kArchs[] = {
    {"LlamaForCausalLM", "llama", ModelArch::llama, 2048},
    {"MistralForCausalLM", "mistral", ModelArch::mistral, 4096 * 32},
    {"Qwen2ForCausalLM", "qwen2", ModelArch::qwen2, 32768},
    {"Qwen3ForCausalLM", "qwen3", ModelArch::qwen3, 32768},
    {"GptOssForCausalLM", "gpt_oss", ModelArch::gpt_oss, 131072},
    // The checkpoints as published (text and vision), and the text-only folders transformers writes
    // (Qwen3_5ForCausalLM.save_pretrained). Qwen3.6 uses the same classes.
    {"Qwen3_5ForConditionalGeneration", "qwen3_5", ModelArch::qwen3_5, 32768, "qwen3_5_text"},
    {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", ModelArch::qwen3_5, 32768, "qwen3_5_moe_text", true},
    {"Qwen3_5ForCausalLM", "qwen3_5_text", ModelArch::qwen3_5, 32768},
    {"Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", ModelArch::qwen3_5, 32768, nullptr, true},
    // Qwen3-Next: the same layers stored differently (ModelConfig::qwen3_next); its feed-forward blocks are
    // mixtures of experts unless num_experts is 0 (parse_qwen3_5 decides).
    {"Qwen3NextForCausalLM", "qwen3_next", ModelArch::qwen3_5, 32768, nullptr, true},
};

bool is_qwen3_next(const ArchInfo& a) { return std::string_view(a.model_type) == "qwen3_next"; }

// Typed reads from one JSON object; every message names the file and the key. A key whose value is
// null counts as absent (HF writes "rope_scaling": null, "sliding_window": null).
class Fields {
 public:
  Fields(const json& j, const std::string& source) : j_(j), source_(source) {}

  const json* get(const char* key) const {
    auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }

  std::optional<int64_t> opt_int(const char* key) const {
    const json* v = get(key);
    if (v == nullptr) return std::nullopt;
    return as_int(*v, key);
  }
  int64_t positive_int(const char* key) const {
    const std::optional<int64_t> v = opt_int(key);
    TQ_CHECK(v.has_value(), "'", source_, "': \"", key, "\" is missing");
    TQ_CHECK(*v > 0, "'", source_, "': \"", key, "\" is ", *v, ", expected a positive integer");
    return *v;
  }
  std::optional<double> opt_number(const char* key) const {
    const json* v = get(key);
    if (v == nullptr) return std::nullopt;
    TQ_CHECK(v->is_number(), "'", source_, "': \"", key, "\" is ", v->dump(), ", expected a number");
    return v->get<double>();
  }
  std::optional<bool> opt_bool(const char* key) const {
    const json* v = get(key);
    if (v == nullptr) return std::nullopt;
    TQ_CHECK(v->is_boolean(), "'", source_, "': \"", key, "\" is ", v->dump(), ", expected true or false");
    return v->get<bool>();
  }
  std::optional<std::string> opt_string(const char* key) const {
    const json* v = get(key);
    if (v == nullptr) return std::nullopt;
    TQ_CHECK(v->is_string(), "'", source_, "': \"", key, "\" is ", v->dump(), ", expected a string");
    return v->get<std::string>();
  }
  // An id or a list of ids ("eos_token_id": 2 or [128001, 128009]).
  std::vector<int64_t> int_or_list(const char* key) const {
    const json* v = get(key);
    std::vector<int64_t> out;
    if (v == nullptr) return out;
    if (v->is_array()) {
      for (const json& e : *v) out.push_back(as_int(e, key));
    } else {
      out.push_back(as_int(*v, key));
    }
    return out;
  }

  int64_t as_int(const json& v, const char* key) const {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned()) {
        TQ_CHECK(v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "'", source_,
                 "': \"", key, "\" = ", v.dump(), " is out of range");
      }
      return v.get<int64_t>();
    }
    // Some writers emit integral values as floats (8192.0); anything else is a mistake.
    if (v.is_number_float()) {
      const double d = v.get<double>();
      TQ_CHECK(std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15, "'", source_, "': \"", key, "\" is ",
               v.dump(), ", expected an integer");
      return static_cast<int64_t>(d);
    }
    fail("'", source_, "': \"", key, "\" is ", v.dump(), ", expected an integer");
  }

 private:
  const json& j_;
  const std::string& source_;
};

json parse_json_object(std::string_view text, const std::string& source) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail("'", source, "' is not valid JSON: ", e.what());
  }
  TQ_CHECK(j.is_object(), "'", source, "' is not a JSON object");
  return j;
}

std::string read_text(const std::string& path) {
  MappedFile f = MappedFile::open(path);
  return std::string(reinterpret_cast<const char*>(f.data()), f.size());
}

void parse_rope(const json& root, const std::string& source, ModelConfig& c) {
  Fields top(root, source);
  // transformers 5 writes {"rope_parameters": {"rope_theta": .., "rope_type": .., ...}}; older versions
  // a top-level rope_theta and an optional "rope_scaling": {"rope_type" or "type": .., ...}.
  const json* params = top.get("rope_parameters");
  const char* params_key = "rope_parameters";
  if (params == nullptr) {
    params = top.get("rope_scaling");
    params_key = "rope_scaling";
  }
  if (const std::optional<double> theta = top.opt_number("rope_theta")) c.rope_theta = *theta;
  if (params == nullptr) return;
  TQ_CHECK(params->is_object(), "'", source, "': \"", params_key, "\" is ", params->dump(), ", expected an object");
  for (auto it = params->begin(); it != params->end(); ++it) {
    TQ_CHECK(!it.value().is_object(), "'", source, "': \"", params_key, "\" has per-layer-type entries (\"", it.key(),
             "\"), which are not supported");
  }
  Fields p(*params, source);
  if (const std::optional<double> theta = p.opt_number("rope_theta")) c.rope_theta = *theta;
  // Qwen3.5 rotates a part of each head (parse_qwen3_5 reads the factor); the others rotate all of it.
  if (const std::optional<double> partial = p.opt_number("partial_rotary_factor"); partial && c.arch != ModelArch::qwen3_5) {
    TQ_CHECK(*partial == 1.0, "'", source, "': partial_rotary_factor ", *partial, " is not supported");
  }
  std::optional<std::string> type = p.opt_string("rope_type");
  if (!type) type = p.opt_string("type");
  if (!type || *type == "default") return;
  if (*type == "llama3") {
    c.rope_scaling.type = RopeScalingType::llama3;
    const std::optional<double> factor = p.opt_number("factor");
    const std::optional<double> low = p.opt_number("low_freq_factor");
    const std::optional<double> high = p.opt_number("high_freq_factor");
    const std::optional<int64_t> original = p.opt_int("original_max_position_embeddings");
    TQ_CHECK(factor && low && high && original, "'", source, "': llama3 rope scaling needs factor, low_freq_factor, ",
             "high_freq_factor and original_max_position_embeddings; it has ", params->dump());
    TQ_CHECK(*factor > 0 && *low > 0 && *high > *low && *original > 0, "'", source,
             "': llama3 rope scaling values are inconsistent: ", params->dump(),
             " (need factor > 0, high_freq_factor > low_freq_factor > 0, original_max_position_embeddings > 0)");
    c.rope_scaling.factor = *factor;
    c.rope_scaling.low_freq_factor = *low;
    c.rope_scaling.high_freq_factor = *high;
    c.rope_scaling.original_max_position_embeddings = *original;
    return;
  }
  if (*type == "yarn" && c.arch == ModelArch::gpt_oss) {
    c.rope_scaling.type = RopeScalingType::yarn;
    for (const char* unsupported : {"mscale", "mscale_all_dim"}) {
      TQ_CHECK(p.get(unsupported) == nullptr, "'", source, "': yarn rope scaling with \"", unsupported,
               "\" is not supported (", params->dump(), ")");
    }
    const std::optional<double> factor = p.opt_number("factor");
    TQ_CHECK(factor.has_value(), "'", source, "': yarn rope scaling needs \"factor\"; it has ", params->dump());
    TQ_CHECK(std::isfinite(*factor) && *factor >= 1.0, "'", source, "': yarn rope scaling factor ", *factor,
             " must be at least 1");
    c.rope_scaling.factor = *factor;
    c.rope_scaling.beta_fast = p.opt_number("beta_fast").value_or(32.0);
    c.rope_scaling.beta_slow = p.opt_number("beta_slow").value_or(1.0);
    TQ_CHECK(std::isfinite(c.rope_scaling.beta_fast) && std::isfinite(c.rope_scaling.beta_slow) &&
                 c.rope_scaling.beta_slow > 0 && c.rope_scaling.beta_fast > c.rope_scaling.beta_slow,
             "'", source, "': yarn beta_fast ", c.rope_scaling.beta_fast, " and beta_slow ", c.rope_scaling.beta_slow,
             " must satisfy beta_fast > beta_slow > 0");
    // transformers: original_max_position_embeddings, else the model's max_position_embeddings.
    c.rope_scaling.original_max_position_embeddings =
        p.opt_int("original_max_position_embeddings").value_or(c.max_position_embeddings);
    TQ_CHECK(c.rope_scaling.original_max_position_embeddings > 0, "'", source,
             "': yarn original_max_position_embeddings ", c.rope_scaling.original_max_position_embeddings,
             " must be positive");
    c.rope_scaling.truncate = p.opt_bool("truncate").value_or(true);
    c.rope_scaling.attention_factor = p.opt_number("attention_factor").value_or(0.1 * std::log(*factor) + 1.0);
    TQ_CHECK(std::isfinite(c.rope_scaling.attention_factor) && c.rope_scaling.attention_factor > 0, "'", source,
             "': yarn attention_factor ", c.rope_scaling.attention_factor, " must be positive");
    return;
  }
  fail("'", source, "': rope type '", *type, "' is not supported (supported: default, llama3",
       c.arch == ModelArch::gpt_oss ? ", yarn" : "", ")");
}

// layer_types: one "sliding_attention" or "full_attention" per layer, into c.sliding_layers.
void parse_layer_types(const json& types, const std::string& source, ModelConfig& c) {
  TQ_CHECK(types.is_array(), "'", source, "': \"layer_types\" is ", types.dump(), ", expected a list");
  TQ_CHECK(static_cast<int64_t>(types.size()) == c.num_hidden_layers, "'", source, "': layer_types lists ",
           types.size(), " layers but num_hidden_layers is ", c.num_hidden_layers);
  c.sliding_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
  for (size_t i = 0; i < types.size(); ++i) {
    const json& t = types[i];
    TQ_CHECK(t == "full_attention" || t == "sliding_attention", "'", source, "': layer_types[", i, "] is ",
             t.dump(), " (expected full_attention or sliding_attention)");
    c.sliding_layers[i] = t == "sliding_attention";
  }
}

// GptOssConfig's fields beyond the shared ones (transformers configuration_gpt_oss.py).
void parse_gpt_oss(const json& root, const std::string& source, ModelConfig& c) {
  Fields f(root, source);
  const std::optional<int64_t> experts = f.opt_int("num_local_experts");
  TQ_CHECK(experts.has_value(), "'", source, "': \"num_local_experts\" is missing");
  TQ_CHECK(*experts > 0, "'", source, "': \"num_local_experts\" is ", *experts, ", expected a positive integer");
  c.num_experts = *experts;
  // transformers names it num_experts_per_tok; OpenAI's own configs add experts_per_token.
  const std::optional<int64_t> per_tok = f.opt_int("num_experts_per_tok");
  const std::optional<int64_t> per_token = f.opt_int("experts_per_token");
  TQ_CHECK(per_tok || per_token, "'", source, "': \"num_experts_per_tok\" is missing");
  TQ_CHECK(!per_tok || !per_token || *per_tok == *per_token, "'", source, "': num_experts_per_tok ", *per_tok,
           " and experts_per_token ", *per_token, " disagree");
  c.num_experts_per_tok = per_tok ? *per_tok : *per_token;
  TQ_CHECK(c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_experts, "'", source,
           "': num_experts_per_tok ", c.num_experts_per_tok, " must be between 1 and num_local_experts ",
           c.num_experts);

  const std::optional<int64_t> window = f.opt_int("sliding_window");
  TQ_CHECK(window.has_value(), "'", source, "': \"sliding_window\" is missing (GPT-OSS's even layers need it)");
  TQ_CHECK(*window > 0, "'", source, "': sliding_window ", *window, " must be positive");
  c.sliding_window = window;
  if (const json* types = f.get("layer_types")) {
    parse_layer_types(*types, source, c);
  } else {
    // GptOssConfig's default: layer i slides when (i + 1) % 2 != 0, i.e. the even layers.
    c.sliding_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.sliding_layers[static_cast<size_t>(i)] = (i + 1) % 2 != 0;
  }

  c.swiglu_limit = f.opt_number("swiglu_limit").value_or(7.0);
  TQ_CHECK(std::isfinite(c.swiglu_limit) && c.swiglu_limit > 0, "'", source, "': swiglu_limit ", c.swiglu_limit,
           " must be positive");
  c.attention_sinks = true;  // GptOssAttention always has self_attn.sinks

  if (const json* q = f.get("quantization_config")) {
    TQ_CHECK(q->is_object(), "'", source, "': \"quantization_config\" is ", q->dump(), ", expected an object");
    const std::optional<std::string> method = Fields(*q, source).opt_string("quant_method");
    TQ_CHECK(method.has_value(), "'", source, "': quantization_config has no \"quant_method\"");
    TQ_CHECK(*method == "mxfp4", "'", source, "': quantization_config quant_method '", *method,
             "' is not supported (supported: mxfp4)");
    c.experts_mxfp4 = true;
  }
}

// Qwen3-Next's feed-forward blocks (transformers Qwen3NextDecoderLayer): layer l is a Qwen3NextSparseMoeBlock
// (router, experts, and the shared expert with its sigmoid gate, exactly Qwen3.5-MoE's block) when l is not in
// mlp_only_layers, num_experts > 0 and (l + 1) % decoder_sparse_step == 0, else a Qwen3NextMLP of
// intermediate_size. Every layer sparse, or none (a dense model), is what the model file runs; a mix is refused.
// Qwen3NextTopKRouter renormalizes the top-k softmax weights only when norm_topk_prob (default true); the
// device's MoE always does, so false is refused.
void parse_qwen3_next_ffn(const Fields& f, const std::string& source, ModelConfig& c) {
  const int64_t experts = f.opt_int("num_experts").value_or(512);
  TQ_CHECK(experts >= 0, "'", source, "': num_experts ", experts, " is negative");
  const int64_t step = f.opt_int("decoder_sparse_step").value_or(1);
  TQ_CHECK(step > 0, "'", source, "': decoder_sparse_step ", step, " must be positive");
  std::vector<bool> dense(static_cast<size_t>(c.num_hidden_layers), false);
  std::string dense_list = "[]";
  if (const json* only = f.get("mlp_only_layers")) {
    TQ_CHECK(only->is_array(), "'", source, "': \"mlp_only_layers\" is ", only->dump(), ", expected a list of layer indices");
    for (const json& v : *only) {
      const int64_t l = f.as_int(v, "mlp_only_layers");
      TQ_CHECK(l >= 0 && l < c.num_hidden_layers, "'", source, "': mlp_only_layers ", only->dump(), " has layer ", l,
               ", outside 0..", c.num_hidden_layers - 1);
      dense[static_cast<size_t>(l)] = true;
    }
    dense_list = only->dump();
  }
  int64_t sparse = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) sparse += !dense[static_cast<size_t>(l)] && experts > 0 && (l + 1) % step == 0;
  auto width = [&](const char* key, int64_t fallback) {
    const int64_t v = f.opt_int(key).value_or(fallback);
    TQ_CHECK(v > 0, "'", source, "': \"", key, "\" is ", v, ", expected a positive integer");
    return v;
  };
  if (sparse == 0) {  // every layer a Qwen3NextMLP
    c.num_experts = 0;
    c.intermediate_size = width("intermediate_size", 5632);
    return;
  }
  TQ_CHECK(sparse == c.num_hidden_layers, "'", source, "': ", c.num_hidden_layers - sparse, " of ", c.num_hidden_layers,
           " layers are dense MLPs (decoder_sparse_step ", step, ", mlp_only_layers ", dense_list,
           "), which is not supported yet: every layer must be a mixture of experts, or none");
  c.num_experts = experts;
  c.intermediate_size = width("moe_intermediate_size", 512);
  c.num_experts_per_tok = width("num_experts_per_tok", 10);
  TQ_CHECK(c.num_experts_per_tok <= c.num_experts, "'", source, "': num_experts_per_tok ", c.num_experts_per_tok,
           " must be between 1 and num_experts ", c.num_experts);
  c.shared_expert_intermediate_size = width("shared_expert_intermediate_size", 512);
  TQ_CHECK(f.opt_bool("norm_topk_prob").value_or(true), "'", source,
           "': norm_topk_prob false is not supported (the top-k routing weights are always renormalized here)");
}

// Qwen3.5 text fields beyond the shared ones (transformers configuration_qwen3_5.py and
// configuration_qwen3_5_moe.py; defaults are those classes' defaults). `root` is the text config
// (text_config of the ConditionalGeneration classes), `top` the whole file (the same object for flat
// configs), `experts` whether the class is the MoE one. `next`: Qwen3NextConfig
// (configuration_qwen3_next.py), whose fields and defaults are the same for everything read here but the
// feed-forward blocks (see the end), and whose weights are stored as ModelConfig::qwen3_next says.
void parse_qwen3_5(const json& root, const json& top, const std::string& source, bool experts, bool next, ModelConfig& c) {
  Fields f(root, source);
  c.qwen3_next = next;

  // Layer kinds: an explicit list, else transformers' rule from full_attention_interval (default 4):
  // layer i is linear unless (i + 1) is a multiple of the interval.
  c.linear_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
  if (const json* types = f.get("layer_types")) {
    TQ_CHECK(types->is_array(), "'", source, "': \"layer_types\" is ", types->dump(), ", expected a list");
    TQ_CHECK(static_cast<int64_t>(types->size()) == c.num_hidden_layers, "'", source, "': layer_types lists ",
             types->size(), " layers but num_hidden_layers is ", c.num_hidden_layers);
    for (size_t i = 0; i < types->size(); ++i) {
      const json& t = (*types)[i];
      TQ_CHECK(t == "linear_attention" || t == "full_attention", "'", source, "': layer_types[", i, "] is ", t.dump(),
               " (expected linear_attention or full_attention)");
      c.linear_layers[i] = t == "linear_attention";
    }
  } else {
    const int64_t interval = f.opt_int("full_attention_interval").value_or(4);
    TQ_CHECK(interval > 0, "'", source, "': full_attention_interval ", interval, " must be positive");
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.linear_layers[static_cast<size_t>(i)] = (i + 1) % interval != 0;
  }

  // Qwen3_5Attention's q_proj always emits the gate (the configs say attn_output_gate true); a config
  // that turns it off describes a model that code does not build.
  const bool gate = f.opt_bool("attn_output_gate").value_or(true);
  TQ_CHECK(gate, "'", source, "': attn_output_gate false is not supported (Qwen3.5's attention always gates its ",
           "output: q_proj is [heads * head_dim * 2, hidden])");
  c.attn_output_gate = true;
  TQ_CHECK(!f.opt_bool("attention_bias").value_or(false), "'", source,
           "': attention_bias true is not supported for Qwen3.5 (no published checkpoint has attention biases)");

  // Partial RoPE: rope_parameters.partial_rotary_factor (transformers 5), or a top-level one (older
  // configs), default 0.25: rotary dimension 64 of head_dim 256.
  const json* params = f.get("rope_parameters");
  if (params == nullptr) params = f.get("rope_scaling");
  std::optional<double> partial = f.opt_number("partial_rotary_factor");
  if (params != nullptr && params->is_object()) {
    if (const std::optional<double> p = Fields(*params, source).opt_number("partial_rotary_factor")) partial = p;
  }
  const double factor = partial.value_or(0.25);
  const double rotary = factor * static_cast<double>(c.head_dim);
  TQ_CHECK(factor > 0 && factor <= 1 && rotary == std::floor(rotary) && static_cast<int64_t>(rotary) % 2 == 0, "'",
           source, "': partial_rotary_factor ", factor, " with head_dim ", c.head_dim,
           " does not give an even number of rotary dimensions");
  c.rope_dim = static_cast<int64_t>(rotary);
  // mRoPE (mrope_section, mrope_interleaved): for text the three position streams (time, height, width)
  // all equal the token's position, so whichever frequencies a section gives each stream, every rotary
  // pair i turns by position * theta^(-2i / rope_dim): plain rotate-half RoPE over the rope_dim
  // dimensions. Checked here for consistency and not stored; images and video would need them.
  if (params != nullptr && params->is_object()) {
    if (const json* sections = Fields(*params, source).get("mrope_section")) {
      TQ_CHECK(sections->is_array(), "'", source, "': \"mrope_section\" is ", sections->dump(), ", expected a list");
      int64_t sum = 0;
      for (const json& v : *sections) {
        const int64_t n = Fields(*params, source).as_int(v, "mrope_section");
        TQ_CHECK(n >= 0, "'", source, "': mrope_section ", sections->dump(), " has a negative entry");
        sum += n;
      }
      TQ_CHECK(sum <= c.rope_dim / 2, "'", source, "': mrope_section ", sections->dump(), " covers ", sum,
               " frequency pairs but the rotary dimensions (", c.rope_dim, ") have ", c.rope_dim / 2);
    }
    Fields(*params, source).opt_bool("mrope_interleaved");  // type-checked; no effect on text
  }

  // Gated DeltaNet.
  auto dim = [&](const char* key, int64_t fallback) {
    const int64_t v = f.opt_int(key).value_or(fallback);
    TQ_CHECK(v > 0, "'", source, "': \"", key, "\" is ", v, ", expected a positive integer");
    return v;
  };
  c.linear_num_key_heads = dim("linear_num_key_heads", 16);
  c.linear_num_value_heads = dim("linear_num_value_heads", 32);
  c.linear_key_head_dim = dim("linear_key_head_dim", 128);
  c.linear_value_head_dim = dim("linear_value_head_dim", 128);
  c.linear_conv_kernel_dim = dim("linear_conv_kernel_dim", 4);
  TQ_CHECK(c.linear_num_value_heads % c.linear_num_key_heads == 0, "'", source, "': linear_num_value_heads ",
           c.linear_num_value_heads, " is not a multiple of linear_num_key_heads ", c.linear_num_key_heads);
  c.norm_zero_centred = true;  // Qwen3_5RMSNorm: (1 + w), initialized to zeros

  // Transformers drops mtp.* on load; counted so that the tensors can be reported as ignored.
  c.mtp_num_hidden_layers = f.opt_int("mtp_num_hidden_layers").value_or(0);
  TQ_CHECK(c.mtp_num_hidden_layers >= 0, "'", source, "': mtp_num_hidden_layers ", c.mtp_num_hidden_layers,
           " is negative");

  // Tied embeddings: either level may say it; both must agree when both do.
  if (&top != &root) {
    const std::optional<bool> outer = Fields(top, c.source).opt_bool("tie_word_embeddings");
    const std::optional<bool> inner = f.opt_bool("tie_word_embeddings");
    TQ_CHECK(!outer || !inner || *outer == *inner, "'", c.source, "': tie_word_embeddings is ",
             outer.value_or(false) ? "true" : "false", " but text_config.tie_word_embeddings is ",
             inner.value_or(false) ? "true" : "false");
    c.tie_word_embeddings = outer.value_or(inner.value_or(false));
  }

  if (next) {
    parse_qwen3_next_ffn(f, source, c);
    return;
  }
  if (!experts) {
    TQ_CHECK(f.get("num_experts") == nullptr || f.opt_int("num_experts") == 0, "'", source,
             "': num_experts is set but the architecture is the dense Qwen3.5 (use the Moe class)");
    return;
  }
  c.num_experts = dim("num_experts", 256);
  c.num_experts_per_tok = dim("num_experts_per_tok", 8);
  TQ_CHECK(c.num_experts_per_tok <= c.num_experts, "'", source, "': num_experts_per_tok ", c.num_experts_per_tok,
           " must be between 1 and num_experts ", c.num_experts);
  c.shared_expert_intermediate_size = dim("shared_expert_intermediate_size", 512);
  // Qwen3_5MoeTopKRouter always renormalizes the top-k weights and every layer is sparse; fields from
  // other Qwen MoE configs that would say otherwise are refused rather than ignored.
  TQ_CHECK(f.opt_bool("norm_topk_prob").value_or(true), "'", source,
           "': norm_topk_prob false is not supported (Qwen3.5-MoE always renormalizes the top-k weights)");
  const int64_t step = f.opt_int("decoder_sparse_step").value_or(1);
  TQ_CHECK(step == 1, "'", source, "': decoder_sparse_step ", step,
           " is not supported (every Qwen3.5-MoE layer is a mixture of experts)");
  if (const json* dense = f.get("mlp_only_layers")) {
    TQ_CHECK(dense->is_array() && dense->empty(), "'", source, "': mlp_only_layers ", dense->dump(),
             " is not supported (every Qwen3.5-MoE layer is a mixture of experts)");
  }
}

// Checks shared by both sources once the fields are filled.
// Before anything is sized by it: a count no model has (2^31 from a corrupt file) would otherwise be
// allocated per layer before the weights could disagree with it.
constexpr int64_t kMaxLayers = 1 << 16;
void check_layer_count(int64_t layers, const std::string& what) {
  TQ_CHECK(layers <= kMaxLayers, what, " is ", layers, ", more than the ", kMaxLayers, " layers any model has");
}

// Widths no model has: the device code keeps head and rotary dims, head counts and token ids in int, so a
// larger value from a corrupt file would wrap (head_dim 2^32 + 64 ran as 64: found by fuzz/fuzz_model_config).
// The widest real models are far below these (hidden 16384-ish, intermediate 53248, vocab 262144).
constexpr int64_t kMaxWidth = int64_t{1} << 24;
constexpr int64_t kMaxVocab = std::numeric_limits<int32_t>::max();
void check_widths(const ModelConfig& c) {
  const std::pair<const char*, int64_t> widths[] = {
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"RoPE dimension count", c.rope_dim},
      {"num_experts", c.num_experts},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"shared_expert_intermediate_size", c.shared_expert_intermediate_size},
      {"linear_num_key_heads", c.linear_num_key_heads},
      {"linear_num_value_heads", c.linear_num_value_heads},
      {"linear_key_head_dim", c.linear_key_head_dim},
      {"linear_value_head_dim", c.linear_value_head_dim},
      {"linear_conv_kernel_dim", c.linear_conv_kernel_dim},
  };
  for (const auto& [name, v] : widths)
    TQ_CHECK(v <= kMaxWidth, "'", c.source, "': ", name, " ", v, " is more than the ", kMaxWidth, " any model has");
  TQ_CHECK(c.vocab_size <= kMaxVocab, "'", c.source, "': vocab_size ", c.vocab_size, " does not fit the 32-bit token ids (at most ",
           kMaxVocab, ")");
}

void check_dimensions(ModelConfig& c) {
  const std::string& s = c.source;
  check_widths(c);
  TQ_CHECK(c.num_key_value_heads > 0, "'", s, "': num_key_value_heads is ", c.num_key_value_heads);
  TQ_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, "'", s, "': num_attention_heads ",
           c.num_attention_heads, " is not a multiple of num_key_value_heads ", c.num_key_value_heads);
  TQ_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, "'", s, "': head_dim ", c.head_dim, " must be positive and even");
  if (c.rope_dim == 0) c.rope_dim = c.head_dim;
  TQ_CHECK(c.rope_dim > 0 && c.rope_dim % 2 == 0 && c.rope_dim <= c.head_dim, "'", s, "': RoPE dimension count ",
           c.rope_dim, " must be even and at most head_dim ", c.head_dim);
  TQ_CHECK(c.rms_norm_eps > 0 && std::isfinite(c.rms_norm_eps), "'", s, "': rms_norm_eps ", c.rms_norm_eps,
           " must be positive");
  TQ_CHECK(c.rope_theta > 0 && std::isfinite(c.rope_theta), "'", s, "': rope_theta ", c.rope_theta,
           " must be positive");
  TQ_CHECK(c.max_position_embeddings > 0, "'", s, "': max_position_embeddings ", c.max_position_embeddings,
           " must be positive");
  for (int64_t id : c.eos_token_ids) {
    TQ_CHECK(id >= 0 && id < c.vocab_size, "'", s, "': eos token id ", id, " is outside the vocabulary (",
             c.vocab_size, ")");
  }
  if (c.bos_token_id) {
    TQ_CHECK(*c.bos_token_id >= 0 && *c.bos_token_id < c.vocab_size, "'", s, "': bos token id ", *c.bos_token_id,
             " is outside the vocabulary (", c.vocab_size, ")");
  }
}

// The qwen35 / qwen35moe / qwen3next keys beyond the shared ones (llama.cpp's Qwen3.5 and Qwen3-Next
// converters, llama_model_qwen35{,moe}::load_arch_hparams and llama_model_qwen3next::load_arch_hparams, which
// read the same keys), and what its converter changed in the tensors. qwen3next always has experts (its
// loader refuses zero).
void qwen3_5_from_gguf(const GgufFile& g, const std::string& p, bool experts, ModelConfig& c) {
  auto positive = [&](const std::string& key) {
    const int64_t v = g.get_i64(key);
    TQ_CHECK(v > 0, "'", g.path(), "': metadata '", key, "' is ", v, ", expected a positive integer");
    return v;
  };
  c.linear_conv_kernel_dim = positive(p + "ssm.conv_kernel");
  c.linear_key_head_dim = positive(p + "ssm.state_size");
  c.linear_num_key_heads = positive(p + "ssm.group_count");
  c.linear_num_value_heads = positive(p + "ssm.time_step_rank");
  const int64_t inner = positive(p + "ssm.inner_size");  // Hv * dv
  TQ_CHECK(inner % c.linear_num_value_heads == 0, "'", g.path(), "': metadata '", p, "ssm.inner_size' ", inner,
           " is not a multiple of '", p, "ssm.time_step_rank' ", c.linear_num_value_heads);
  c.linear_value_head_dim = inner / c.linear_num_value_heads;
  TQ_CHECK(c.linear_num_value_heads % c.linear_num_key_heads == 0, "'", g.path(), "': metadata '", p,
           "ssm.time_step_rank' ", c.linear_num_value_heads, " is not a multiple of '", p, "ssm.group_count' ",
           c.linear_num_key_heads);

  // Recurrent (linear) layers: an explicit per-layer array over every block (MTP blocks included, which
  // are attention), else llama.cpp's rule from full_attention_interval (default 4).
  c.linear_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
  const std::string recurrent_key = p + "attention.recurrent_layers";
  if (const GgufValue* v = g.find(recurrent_key); v != nullptr && v->type == GgufType::array) {
    const std::vector<int32_t> flags = g.get_array<int32_t>(recurrent_key);
    const int64_t blocks = c.num_hidden_layers + c.mtp_num_hidden_layers;
    TQ_CHECK(static_cast<int64_t>(flags.size()) == blocks, "'", g.path(), "': metadata '", recurrent_key, "' lists ",
             flags.size(), " layers but block_count is ", blocks);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) c.linear_layers[static_cast<size_t>(l)] = flags[l] != 0;
  } else {
    TQ_CHECK(v == nullptr, "'", g.path(), "': metadata '", recurrent_key, "' is ", v->describe(),
             ", expected an array of per-layer flags");
    const int64_t interval = g.has(p + "full_attention_interval") ? positive(p + "full_attention_interval") : 4;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) c.linear_layers[static_cast<size_t>(l)] = (l + 1) % interval != 0;
  }

  // mRoPE sections: for text the three position streams coincide and the sections change nothing (see
  // parse_qwen3_5); checked for consistency only.
  const std::string sections_key = p + "rope.dimension_sections";
  if (g.has(sections_key)) {
    int64_t sum = 0;
    for (int32_t n : g.get_array<int32_t>(sections_key)) {
      TQ_CHECK(n >= 0, "'", g.path(), "': metadata '", sections_key, "' has a negative entry ", n);
      sum += n;
    }
    const int64_t rope_dim = c.rope_dim > 0 ? c.rope_dim : c.head_dim;
    TQ_CHECK(sum <= rope_dim / 2, "'", g.path(), "': metadata '", sections_key, "' covers ", sum,
             " frequency pairs but the rotary dimensions (", rope_dim, ") have ", rope_dim / 2);
  }

  // llama.cpp's converter (conversion/qwen.py): +1 baked into every *norm.weight but the DeltaNet's
  // linear_attn.norm, A_log stored as -exp(A_log), and the value heads reordered grouped -> tiled. The
  // tiling is _LinearAttentionVReorderBase's, which the Qwen3.5 classes derive from; Qwen3NextModel itself
  // does not reorder (its graph, src/models/qwen3next.cpp, repeats the key heads interleaved, the grouped
  // order), so a qwen3next file keeps HF's grouped value heads.
  c.norm_zero_centred = false;
  c.linear_a_negexp = true;
  c.linear_v_tiled = !c.qwen3_next;

  if (!experts) return;
  c.num_experts = positive(p + "expert_count");
  c.num_experts_per_tok = positive(p + "expert_used_count");
  TQ_CHECK(c.num_experts_per_tok <= c.num_experts, "'", g.path(), "': metadata '", p, "expert_used_count' is ",
           c.num_experts_per_tok, ", more than the ", c.num_experts, " experts of '", p, "expert_count'");
  c.shared_expert_intermediate_size = positive(p + "expert_shared_feed_forward_length");
}

}  // namespace

const char* architecture_name(ModelArch a) {
  switch (a) {
    case ModelArch::llama: return "llama";
    case ModelArch::mistral: return "mistral";
    case ModelArch::qwen2: return "qwen2";
    case ModelArch::qwen3: return "qwen3";
    case ModelArch::gpt_oss: return "gpt_oss";
    case ModelArch::qwen3_5: return "qwen3_5";
  }
  return "?";
}

const char* rope_layout_name(RopeLayout l) {
  return l == RopeLayout::rotate_half ? "rotate-half" : "interleaved";
}

ops::RopeConfig rope_config(const ModelConfig& c) {
  ops::RopeConfig rc;
  rc.head_dim = static_cast<int>(c.head_dim);
  rc.rotary_dim = static_cast<int>(c.rope_dim > 0 ? c.rope_dim : c.head_dim);
  rc.theta = c.rope_theta;
  rc.layout = c.rope_layout == RopeLayout::interleaved ? ops::RopeLayout::interleaved : ops::RopeLayout::rotate_half;
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScalingType::llama3) {
    rc.llama3 = true;
    rc.llama3_scaling.factor = s.factor;
    rc.llama3_scaling.low_freq_factor = s.low_freq_factor;
    rc.llama3_scaling.high_freq_factor = s.high_freq_factor;
    rc.llama3_scaling.original_max_position_embeddings = s.original_max_position_embeddings;
  } else if (s.type == RopeScalingType::yarn) {
    rc.yarn = true;
    rc.yarn_scaling.factor = s.factor;
    rc.yarn_scaling.beta_fast = s.beta_fast;
    rc.yarn_scaling.beta_slow = s.beta_slow;
    rc.yarn_scaling.original_max_position_embeddings = s.original_max_position_embeddings;
    rc.yarn_scaling.truncate = s.truncate;
    rc.yarn_scaling.attention_factor = s.attention_factor;  // the parsers filled in the default
  }
  return rc;
}

std::string supported_architectures() {
  std::string s;
  for (const ArchInfo& a : kArchs) s += (s.empty() ? "" : ", ") + std::string(a.hf_class);
  return s;
}

std::string ModelConfig::summary() const {
  std::ostringstream os;
  os << architecture_name(arch) << ": " << num_hidden_layers << " layers, hidden " << hidden_size << ", ffn "
     << intermediate_size << ", heads " << num_attention_heads << "/" << num_key_value_heads << " x " << head_dim
     << ", vocab " << vocab_size << ", rope " << rope_layout_name(rope_layout) << " theta " << rope_theta
     << (rope_scaling.type == RopeScalingType::llama3 ? " (llama3 scaling)" : "")
     << (rope_scaling.type == RopeScalingType::yarn ? " (yarn scaling)" : "")
     << (num_experts > 0 ? ", " + std::to_string(num_experts) + " experts top-" + std::to_string(num_experts_per_tok) +
                               (experts_mxfp4 ? " (MXFP4)" : "")
                         : std::string())
     << (sliding_window ? ", sliding window " + std::to_string(*sliding_window) : std::string())
     << (attention_sinks ? ", attention sinks" : "")
     << (!linear_layers.empty()
             ? ", " + std::to_string(std::count(linear_layers.begin(), linear_layers.end(), true)) +
                   " Gated DeltaNet layers (" + std::to_string(linear_num_key_heads) + "/" +
                   std::to_string(linear_num_value_heads) + " heads x " + std::to_string(linear_key_head_dim) + "/" +
                   std::to_string(linear_value_head_dim) + ")"
             : std::string())
     << (shared_expert_intermediate_size > 0 ? ", shared expert " + std::to_string(shared_expert_intermediate_size)
                                             : std::string())
     << (tie_word_embeddings ? ", tied embeddings" : "") << (qkv_bias ? ", qkv bias" : "")
     << (qk_norm ? ", qk norm" : "");
  return os.str();
}

ModelConfig parse_hf_config(std::string_view json_text, const std::string& source) {
  const json top = parse_json_object(json_text, source);
  Fields f_top(top, source);
  ModelConfig c;
  c.source = source;

  // Which architecture: "architectures" names the class; "model_type" must agree with it.
  const ArchInfo* info = nullptr;
  const std::optional<std::string> model_type = f_top.opt_string("model_type");
  if (const json* archs = f_top.get("architectures")) {
    TQ_CHECK(archs->is_array() && !archs->empty(), "'", source, "': \"architectures\" is ", archs->dump(),
             ", expected a list of class names");
    for (const json& a : *archs) {
      TQ_CHECK(a.is_string(), "'", source, "': \"architectures\" has a non-string entry ", a.dump());
      for (const ArchInfo& k : kArchs) {
        if (info == nullptr && a.get<std::string>() == k.hf_class) info = &k;
      }
    }
    TQ_CHECK(info != nullptr, "'", source, "': unsupported architecture ", archs->dump(), " (supported: ",
             supported_architectures(), ")");
    TQ_CHECK(!model_type || *model_type == info->model_type, "'", source, "': model_type '", *model_type,
             "' does not match architecture ", info->hf_class, " (expected '", info->model_type, "')");
  } else {
    TQ_CHECK(model_type.has_value(), "'", source, "' has neither \"architectures\" nor \"model_type\"");
    for (const ArchInfo& k : kArchs) {
      if (*model_type == k.model_type) info = &k;
    }
    TQ_CHECK(info != nullptr, "'", source, "': unsupported model_type '", *model_type, "' (supported: ",
             supported_architectures(), ")");
  }
  c.arch = info->arch;
  c.architecture_class = info->hf_class;

  // The text model's fields: the file itself, or its text_config for the multimodal wrappers (whose
  // messages then name "text_config").
  const json* text = &top;
  std::string text_source = source;
  if (info->text_model_type != nullptr) {
    text = f_top.get("text_config");
    TQ_CHECK(text != nullptr, "'", source, "': \"text_config\" is missing (", info->hf_class,
             " keeps the text model's fields there)");
    TQ_CHECK(text->is_object(), "'", source, "': \"text_config\" is ", text->dump(), ", expected an object");
    text_source = source + " text_config";
    const std::optional<std::string> text_type = Fields(*text, text_source).opt_string("model_type");
    TQ_CHECK(!text_type || *text_type == info->text_model_type, "'", source, "': text_config model_type '",
             text_type.value_or(""), "' does not match architecture ", info->hf_class, " (expected '",
             info->text_model_type, "')");
    c.hf_prefix = "model.language_model.";
  }
  const json& root = *text;
  Fields f(root, text_source);

  c.hidden_size = f.positive_int("hidden_size");
  // Qwen3.5-MoE has no dense MLP: its experts' width is moe_intermediate_size (default 512). Qwen3-Next
  // has both fields; which one applies follows from its sparse layers (parse_qwen3_5).
  if (is_qwen3_next(*info)) {
    // set by parse_qwen3_5
  } else if (info->experts) {
    c.intermediate_size = f.opt_int("moe_intermediate_size").value_or(512);
    TQ_CHECK(c.intermediate_size > 0, "'", text_source, "': \"moe_intermediate_size\" is ", c.intermediate_size,
             ", expected a positive integer");
  } else {
    c.intermediate_size = f.positive_int("intermediate_size");
  }
  c.num_hidden_layers = f.positive_int("num_hidden_layers");
  check_layer_count(c.num_hidden_layers, "'" + source + "': num_hidden_layers");
  c.num_attention_heads = f.positive_int("num_attention_heads");
  c.vocab_size = f.positive_int("vocab_size");
  c.num_key_value_heads = f.opt_int("num_key_value_heads").value_or(c.num_attention_heads);
  if (const std::optional<int64_t> hd = f.opt_int("head_dim")) {
    c.head_dim = *hd;
  } else if (c.arch == ModelArch::gpt_oss) {
    c.head_dim = 64;  // GptOssConfig's default (hidden 2880 is not heads x head_dim)
  } else if (c.arch == ModelArch::qwen3_5) {
    c.head_dim = 256;  // Qwen3_5TextConfig's default
  } else {
    TQ_CHECK(c.hidden_size % c.num_attention_heads == 0, "'", source, "': hidden_size ", c.hidden_size,
             " is not a multiple of num_attention_heads ", c.num_attention_heads, " and head_dim is not given");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings = f.opt_int("max_position_embeddings").value_or(info->default_max_positions);
  c.rms_norm_eps = f.opt_number("rms_norm_eps").value_or(c.arch == ModelArch::gpt_oss ? 1e-5 : 1e-6);
  c.tie_word_embeddings = f.opt_bool("tie_word_embeddings").value_or(false);
  c.hidden_act = f.opt_string("hidden_act").value_or("silu");
  TQ_CHECK(c.hidden_act == "silu", "'", source, "': hidden_act '", c.hidden_act,
           "' is not supported (the MLP is SwiGLU with silu)");
  c.dtype = f.opt_string("torch_dtype").value_or(f.opt_string("dtype").value_or(""));
  if (c.dtype.empty() && &root != &top) c.dtype = f_top.opt_string("torch_dtype").value_or(f_top.opt_string("dtype").value_or(""));

  parse_rope(root, text_source, c);
  c.rope_layout = RopeLayout::rotate_half;  // every HF checkpoint of these classes

  const bool attention_bias = f.opt_bool("attention_bias").value_or(false);
  switch (c.arch) {
    case ModelArch::llama:
      c.qkv_bias = c.o_bias = attention_bias;
      c.mlp_bias = f.opt_bool("mlp_bias").value_or(false);
      break;
    case ModelArch::mistral:
      break;  // MistralAttention has no biases
    case ModelArch::qwen2:
      c.qkv_bias = true;  // Qwen2Attention: q/k/v with bias, o without
      break;
    case ModelArch::qwen3:
      c.qkv_bias = c.o_bias = attention_bias;
      c.qk_norm = true;
      break;
    case ModelArch::gpt_oss:
      // GptOssAttention: q, k, v and o all take bias=attention_bias (default true).
      c.qkv_bias = c.o_bias = f.opt_bool("attention_bias").value_or(true);
      parse_gpt_oss(root, source, c);
      break;
    case ModelArch::qwen3_5:
      parse_qwen3_5(root, top, text_source, info->experts, is_qwen3_next(*info), c);
      break;
  }

  // Sliding windows: Mistral applies sliding_window (when not null) to every layer; Qwen only when
  // use_sliding_window is true, to the layers that layer_types (or max_window_layers) says.
  const std::optional<int64_t> window = f.opt_int("sliding_window");
  if (c.arch == ModelArch::mistral && window) {
    c.sliding_window = window;
    c.sliding_layers.assign(c.num_hidden_layers, true);
  } else if ((c.arch == ModelArch::qwen2 || c.arch == ModelArch::qwen3) &&
             f.opt_bool("use_sliding_window").value_or(false)) {
    TQ_CHECK(window && *window > 0, "'", source, "': use_sliding_window is true but sliding_window is not a positive size");
    c.sliding_window = window;
    c.sliding_layers.assign(c.num_hidden_layers, false);
    if (const json* types = f.get("layer_types")) {
      TQ_CHECK(types->is_array() && static_cast<int64_t>(types->size()) == c.num_hidden_layers, "'", source,
               "': layer_types must list one entry per layer (", c.num_hidden_layers, ")");
      for (size_t i = 0; i < types->size(); ++i) {
        const json& t = (*types)[i];
        TQ_CHECK(t == "full_attention" || t == "sliding_attention", "'", source, "': layer_types[", i, "] is ",
                 t.dump(), " (expected full_attention or sliding_attention)");
        c.sliding_layers[i] = t == "sliding_attention";
      }
    } else {
      const int64_t first = f.opt_int("max_window_layers").value_or(c.num_hidden_layers);
      for (int64_t i = first; i < c.num_hidden_layers; ++i) c.sliding_layers[i] = true;
    }
  }
  if (c.sliding_window) {
    TQ_CHECK(*c.sliding_window > 0, "'", source, "': sliding_window ", *c.sliding_window, " must be positive");
  }

  if (const std::optional<int64_t> bos = f.opt_int("bos_token_id")) c.bos_token_id = bos;
  c.eos_token_ids = f.int_or_list("eos_token_id");
  c.pad_token_id = f.opt_int("pad_token_id");
  // The wrappers may keep the special ids at the top level only.
  if (&root != &top) {
    if (!c.bos_token_id) c.bos_token_id = f_top.opt_int("bos_token_id");
    if (c.eos_token_ids.empty()) c.eos_token_ids = f_top.int_or_list("eos_token_id");
    if (!c.pad_token_id) c.pad_token_id = f_top.opt_int("pad_token_id");
  }

  check_dimensions(c);
  return c;
}

ModelConfig load_hf_config(const std::string& path) {
  std::error_code ec;
  const std::string file = fs::is_directory(path, ec) ? (fs::path(path) / "config.json").string() : path;
  return parse_hf_config(read_text(file), file);
}

ModelConfig config_from_gguf(const GgufFile& g) {
  ModelConfig c;
  c.source = g.path();
  TQ_CHECK(g.has("general.architecture"), "'", g.path(), "': metadata general.architecture is missing");
  const std::string arch = g.get_string("general.architecture");
  if (arch == "llama") {
    c.arch = ModelArch::llama;
    c.rope_layout = RopeLayout::interleaved;  // see gguf.h: llama.cpp permutes Q/K for interleaved pairs
  } else if (arch == "qwen2") {
    c.arch = ModelArch::qwen2;
    c.rope_layout = RopeLayout::rotate_half;
    c.qkv_bias = true;
  } else if (arch == "qwen3") {
    c.arch = ModelArch::qwen3;
    c.rope_layout = RopeLayout::rotate_half;
    c.qk_norm = true;
  } else if (arch == "gpt-oss") {
    // llama.cpp's converter keeps the HF row order (NeoX RoPE, no permutation).
    c.arch = ModelArch::gpt_oss;
    c.rope_layout = RopeLayout::rotate_half;
    c.qkv_bias = c.o_bias = true;
    c.attention_sinks = true;
  } else if (arch == "qwen35" || arch == "qwen35moe") {
    // llama.cpp's converter keeps the HF row order of q/k (NeoX RoPE) and the per-head [q | gate] rows.
    c.arch = ModelArch::qwen3_5;
    c.rope_layout = RopeLayout::rotate_half;
    c.attn_output_gate = true;
  } else if (arch == "qwen3next") {
    // llama.cpp: LLAMA_ROPE_TYPE_NEOX, the HF q/k row order, the per-head [q | gate] rows of attn_q.
    c.arch = ModelArch::qwen3_5;
    c.rope_layout = RopeLayout::rotate_half;
    c.attn_output_gate = true;
    c.qwen3_next = true;
  } else {
    fail("'", g.path(), "': unsupported GGUF architecture '", arch,
         "' (supported: llama, qwen2, qwen3, gpt-oss, qwen35, qwen35moe, qwen3next)");
  }
  c.architecture_class = "gguf:" + arch;
  const std::string p = arch + ".";

  auto positive = [&](const std::string& key) {
    const int64_t v = g.get_i64(key);
    TQ_CHECK(v > 0, "'", g.path(), "': metadata '", key, "' is ", v, ", expected a positive integer");
    return v;
  };
  c.hidden_size = positive(p + "embedding_length");
  // GPT-OSS's experts have their own width key (llama.cpp: n_ff_exp); feed_forward_length is the same.
  // GPT-OSS's and Qwen3.5-MoE's experts have their own width key (llama.cpp: n_ff_exp).
  const bool expert_width = c.arch == ModelArch::gpt_oss || arch == "qwen35moe" || arch == "qwen3next";
  c.intermediate_size = expert_width ? positive(p + "expert_feed_forward_length") : positive(p + "feed_forward_length");
  c.num_hidden_layers = positive(p + "block_count");
  check_layer_count(c.num_hidden_layers, "'" + g.path() + "': metadata '" + p + "block_count'");
  if (c.arch == ModelArch::qwen3_5 && g.has(p + "nextn_predict_layers")) {
    // The converter appends the MTP blocks after the trunk and counts them in block_count.
    c.mtp_num_hidden_layers = g.get_i64(p + "nextn_predict_layers");
    TQ_CHECK(c.mtp_num_hidden_layers >= 0 && c.mtp_num_hidden_layers < c.num_hidden_layers, "'", g.path(),
             "': metadata '", p, "nextn_predict_layers' is ", c.mtp_num_hidden_layers, ", expected 0 to block_count ",
             c.num_hidden_layers, " - 1");
    c.num_hidden_layers -= c.mtp_num_hidden_layers;
  }
  c.num_attention_heads = positive(p + "attention.head_count");
  c.num_key_value_heads = g.has(p + "attention.head_count_kv") ? positive(p + "attention.head_count_kv")
                                                               : c.num_attention_heads;
  if (g.has(p + "attention.key_length")) {
    c.head_dim = positive(p + "attention.key_length");
    if (g.has(p + "attention.value_length")) {
      TQ_CHECK(g.get_i64(p + "attention.value_length") == c.head_dim, "'", g.path(),
               "': attention.value_length differs from attention.key_length, which is not supported");
    }
  } else {
    TQ_CHECK(c.hidden_size % c.num_attention_heads == 0, "'", g.path(), "': embedding_length ", c.hidden_size,
             " is not a multiple of head_count ", c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings = positive(p + "context_length");
  c.rms_norm_eps = g.get_f32(p + "attention.layer_norm_rms_epsilon");
  if (g.has(p + "rope.freq_base")) c.rope_theta = g.get_f32(p + "rope.freq_base");
  if (g.has(p + "rope.dimension_count")) c.rope_dim = positive(p + "rope.dimension_count");
  if (g.has(p + "rope.scaling.type")) {
    const std::string type = g.get_string(p + "rope.scaling.type");
    if (type == "yarn" && c.arch == ModelArch::gpt_oss) {
      RopeScaling& y = c.rope_scaling;
      y.type = RopeScalingType::yarn;
      y.factor = g.get_f32(p + "rope.scaling.factor");
      TQ_CHECK(std::isfinite(y.factor) && y.factor >= 1.0, "'", g.path(), "': metadata '", p,
               "rope.scaling.factor' is ", y.factor, ", expected at least 1");
      y.original_max_position_embeddings = positive(p + "rope.scaling.original_context_length");
      // llama.cpp's defaults when the file does not say (its cparams yarn_beta_fast / _slow).
      if (g.has(p + "rope.scaling.yarn_beta_fast")) y.beta_fast = g.get_f32(p + "rope.scaling.yarn_beta_fast");
      if (g.has(p + "rope.scaling.yarn_beta_slow")) y.beta_slow = g.get_f32(p + "rope.scaling.yarn_beta_slow");
      TQ_CHECK(std::isfinite(y.beta_fast) && std::isfinite(y.beta_slow) && y.beta_slow > 0 && y.beta_fast > y.beta_slow,
               "'", g.path(), "': yarn beta_fast ", y.beta_fast, " and beta_slow ", y.beta_slow,
               " must satisfy beta_fast > beta_slow > 0");
      // GGUF has no "truncate" key; every GPT-OSS checkpoint says truncate false (llama.cpp itself
      // rounds the range, which transformers and OpenAI's reference do not).
      y.truncate = false;
      y.attention_factor = 0.1 * std::log(y.factor) + 1.0;
    } else {
      TQ_CHECK(type == "none", "'", g.path(), "': rope scaling type '", type, "' is not supported (supported: none",
               c.arch == ModelArch::gpt_oss ? ", yarn" : "", ")");
    }
  }
  if (g.has(p + "rope.scale_linear")) {
    TQ_CHECK(g.get_f32(p + "rope.scale_linear") == 1.0f, "'", g.path(), "': linear rope scaling is not supported");
  }
  c.rope_freq_factors = g.tensors().contains("rope_freqs.weight");

  const TensorView* embd = g.tensors().find("token_embd.weight");
  if (g.has(p + "vocab_size")) {
    c.vocab_size = positive(p + "vocab_size");
  } else if (g.has("tokenizer.ggml.tokens")) {
    c.vocab_size = static_cast<int64_t>(g.array_size("tokenizer.ggml.tokens"));
  } else {
    TQ_CHECK(embd != nullptr && embd->shape.size() == 2, "'", g.path(),
             "': cannot tell the vocabulary size (no vocab_size, tokenizer.ggml.tokens or token_embd.weight)");
    c.vocab_size = embd->shape[0];
  }
  TQ_CHECK(c.vocab_size > 0, "'", g.path(), "': empty vocabulary");
  c.tie_word_embeddings = !g.tensors().contains("output.weight");
  if (c.arch == ModelArch::llama) {
    // llama.cpp's llama graph adds biases when the tensors exist.
    c.qkv_bias = g.tensors().contains("blk.0.attn_q.bias");
    c.o_bias = g.tensors().contains("blk.0.attn_output.bias");
  }
  if (c.arch == ModelArch::qwen3) c.o_bias = g.tensors().contains("blk.0.attn_output.bias");
  if (c.arch == ModelArch::gpt_oss) {
    c.num_experts = positive(p + "expert_count");
    c.num_experts_per_tok = positive(p + "expert_used_count");
    TQ_CHECK(c.num_experts_per_tok <= c.num_experts, "'", g.path(), "': metadata '", p, "expert_used_count' is ",
             c.num_experts_per_tok, ", more than the ", c.num_experts, " experts of '", p, "expert_count'");
    c.sliding_window = positive(p + "attention.sliding_window");
    // llama.cpp: layer l slides when l % pattern < pattern - 1 (pattern 2: the even layers), or a
    // per-layer array of flags.
    const std::string pattern_key = p + "attention.sliding_window_pattern";
    c.sliding_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
    const GgufValue* pattern = g.find(pattern_key);
    if (pattern != nullptr && pattern->type == GgufType::array) {
      const std::vector<int32_t> flags = g.get_array<int32_t>(pattern_key);
      TQ_CHECK(static_cast<int64_t>(flags.size()) == c.num_hidden_layers, "'", g.path(), "': metadata '", pattern_key,
               "' lists ", flags.size(), " layers but block_count is ", c.num_hidden_layers);
      for (size_t l = 0; l < flags.size(); ++l) c.sliding_layers[l] = flags[l] != 0;
    } else {
      const int64_t period = pattern != nullptr ? positive(pattern_key) : 2;
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        c.sliding_layers[static_cast<size_t>(l)] = l % period < period - 1;
      }
    }
    // GPT-OSS's clamp is 7.0 in every released config and llama.cpp hard-codes it; GGUF has no key.
    c.swiglu_limit = 7.0;
    const TensorView* gate = g.tensors().find("blk.0.ffn_gate_exps.weight");
    c.experts_mxfp4 = gate != nullptr && gate->dtype == DType::mxfp4;
  }

  if (c.arch == ModelArch::qwen3_5) qwen3_5_from_gguf(g, p, arch == "qwen35moe" || arch == "qwen3next", c);

  auto token_id = [&](const char* key) -> std::optional<int64_t> {
    if (!g.has(key)) return std::nullopt;
    const int64_t id = g.get_i64(key);
    // llama.cpp writes 0xffffffff (-1 as uint32) for "no such token".
    if (id < 0 || id == 0xffffffffll) return std::nullopt;
    return id;
  };
  c.bos_token_id = token_id("tokenizer.ggml.bos_token_id");
  if (const std::optional<int64_t> eos = token_id("tokenizer.ggml.eos_token_id")) c.eos_token_ids.push_back(*eos);
  c.pad_token_id = token_id("tokenizer.ggml.padding_token_id");

  check_dimensions(c);
  return c;
}

GenerationConfig parse_generation_config(std::string_view json_text, const std::string& source) {
  const json root = parse_json_object(json_text, source);
  Fields f(root, source);
  GenerationConfig g;
  g.source = source;
  g.temperature = f.opt_number("temperature");
  g.top_k = f.opt_int("top_k");
  g.top_p = f.opt_number("top_p");
  g.min_p = f.opt_number("min_p");
  g.repetition_penalty = f.opt_number("repetition_penalty");
  g.do_sample = f.opt_bool("do_sample");
  g.max_new_tokens = f.opt_int("max_new_tokens");
  g.max_length = f.opt_int("max_length");
  g.bos_token_id = f.opt_int("bos_token_id");
  g.pad_token_id = f.opt_int("pad_token_id");
  g.eos_token_ids = f.int_or_list("eos_token_id");
  if (g.temperature) TQ_CHECK(*g.temperature >= 0, "'", source, "': temperature ", *g.temperature, " is negative");
  if (g.top_k) TQ_CHECK(*g.top_k >= 0, "'", source, "': top_k ", *g.top_k, " is negative");
  if (g.top_p) TQ_CHECK(*g.top_p >= 0 && *g.top_p <= 1, "'", source, "': top_p ", *g.top_p, " is outside [0, 1]");
  if (g.min_p) TQ_CHECK(*g.min_p >= 0 && *g.min_p <= 1, "'", source, "': min_p ", *g.min_p, " is outside [0, 1]");
  if (g.repetition_penalty) {
    TQ_CHECK(*g.repetition_penalty > 0, "'", source, "': repetition_penalty ", *g.repetition_penalty,
             " must be positive");
  }
  return g;
}

GenerationConfig load_generation_config(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path file = fs::path(path) / "generation_config.json";
    if (!fs::exists(file, ec)) {
      GenerationConfig empty;
      empty.source = file.string();
      return empty;
    }
    return parse_generation_config(read_text(file.string()), file.string());
  }
  return parse_generation_config(read_text(path), path);
}

}  // namespace tq
