#include "model/config.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <sstream>

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
};
constexpr ArchInfo kArchs[] = {
    {"LlamaForCausalLM", "llama", ModelArch::llama, 2048},
    {"MistralForCausalLM", "mistral", ModelArch::mistral, 4096 * 32},
    {"Qwen2ForCausalLM", "qwen2", ModelArch::qwen2, 32768},
    {"Qwen3ForCausalLM", "qwen3", ModelArch::qwen3, 32768},
};

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
  if (const std::optional<double> partial = p.opt_number("partial_rotary_factor")) {
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
  fail("'", source, "': rope type '", *type, "' is not supported (supported: default, llama3)");
}

// Checks shared by both sources once the fields are filled.
// Before anything is sized by it: a count no model has (2^31 from a corrupt file) would otherwise be
// allocated per layer before the weights could disagree with it.
constexpr int64_t kMaxLayers = 1 << 16;
void check_layer_count(int64_t layers, const std::string& what) {
  TQ_CHECK(layers <= kMaxLayers, what, " is ", layers, ", more than the ", kMaxLayers, " layers any model has");
}

void check_dimensions(ModelConfig& c) {
  const std::string& s = c.source;
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

}  // namespace

const char* architecture_name(ModelArch a) {
  switch (a) {
    case ModelArch::llama: return "llama";
    case ModelArch::mistral: return "mistral";
    case ModelArch::qwen2: return "qwen2";
    case ModelArch::qwen3: return "qwen3";
  }
  return "?";
}

const char* rope_layout_name(RopeLayout l) {
  return l == RopeLayout::rotate_half ? "rotate-half" : "interleaved";
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
     << (tie_word_embeddings ? ", tied embeddings" : "") << (qkv_bias ? ", qkv bias" : "")
     << (qk_norm ? ", qk norm" : "");
  return os.str();
}

ModelConfig parse_hf_config(std::string_view json_text, const std::string& source) {
  const json root = parse_json_object(json_text, source);
  Fields f(root, source);
  ModelConfig c;
  c.source = source;

  // Which architecture: "architectures" names the class; "model_type" must agree with it.
  const ArchInfo* info = nullptr;
  const std::optional<std::string> model_type = f.opt_string("model_type");
  if (const json* archs = f.get("architectures")) {
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

  c.hidden_size = f.positive_int("hidden_size");
  c.intermediate_size = f.positive_int("intermediate_size");
  c.num_hidden_layers = f.positive_int("num_hidden_layers");
  check_layer_count(c.num_hidden_layers, "'" + source + "': num_hidden_layers");
  c.num_attention_heads = f.positive_int("num_attention_heads");
  c.vocab_size = f.positive_int("vocab_size");
  c.num_key_value_heads = f.opt_int("num_key_value_heads").value_or(c.num_attention_heads);
  if (const std::optional<int64_t> hd = f.opt_int("head_dim")) {
    c.head_dim = *hd;
  } else {
    TQ_CHECK(c.hidden_size % c.num_attention_heads == 0, "'", source, "': hidden_size ", c.hidden_size,
             " is not a multiple of num_attention_heads ", c.num_attention_heads, " and head_dim is not given");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings = f.opt_int("max_position_embeddings").value_or(info->default_max_positions);
  c.rms_norm_eps = f.opt_number("rms_norm_eps").value_or(1e-6);
  c.tie_word_embeddings = f.opt_bool("tie_word_embeddings").value_or(false);
  c.hidden_act = f.opt_string("hidden_act").value_or("silu");
  TQ_CHECK(c.hidden_act == "silu", "'", source, "': hidden_act '", c.hidden_act,
           "' is not supported (the MLP is SwiGLU with silu)");
  c.dtype = f.opt_string("torch_dtype").value_or(f.opt_string("dtype").value_or(""));

  parse_rope(root, source, c);
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
  } else {
    fail("'", g.path(), "': unsupported GGUF architecture '", arch, "' (supported: llama, qwen2, qwen3)");
  }
  c.architecture_class = "gguf:" + arch;
  const std::string p = arch + ".";

  auto positive = [&](const std::string& key) {
    const int64_t v = g.get_i64(key);
    TQ_CHECK(v > 0, "'", g.path(), "': metadata '", key, "' is ", v, ", expected a positive integer");
    return v;
  };
  c.hidden_size = positive(p + "embedding_length");
  c.intermediate_size = positive(p + "feed_forward_length");
  c.num_hidden_layers = positive(p + "block_count");
  check_layer_count(c.num_hidden_layers, "'" + g.path() + "': metadata '" + p + "block_count'");
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
    TQ_CHECK(type == "none", "'", g.path(), "': rope scaling type '", type, "' is not supported (supported: none)");
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
