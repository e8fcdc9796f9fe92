#include "model/tq_weights.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "codec/rotation.h"
#include "core/error.h"
#include "core/half.h"
#include "core/read_file.h"
#include "core/rng.h"
#include "ops/tq_weights.h"

namespace tq {

using json = nlohmann::json;

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string levels_key(int bits, int group) { return "b" + std::to_string(bits) + "_g" + std::to_string(group); }

}  // namespace

std::string tq_rotation_key(const std::string& tensor_name) {
  std::string p = ends_with(tensor_name, ".weight") ? tensor_name.substr(0, tensor_name.size() - 7) : tensor_name;
  const size_t dot = p.rfind('.');
  const std::string head = dot == std::string::npos ? "" : p.substr(0, dot + 1);
  const std::string last = dot == std::string::npos ? p : p.substr(dot + 1);
  if (last == "q_proj" || last == "k_proj" || last == "v_proj") return head + "qkv_proj";
  if (last == "gate_proj" || last == "up_proj") return head + "gate_up_proj";
  return p;
}

uint64_t tq_rotation_seed(uint64_t rotation_seed, const std::string& key) {
  return splitmix64_mix(rotation_seed ^ fnv1a64(key)) & ((uint64_t{1} << 53) - 1);
}

nlohmann::ordered_json tq_quantization_json(const TqQuantization& q) {
  nlohmann::ordered_json j;
  j["mode"] = kTqMode;
  j["format_version"] = q.format_version;
  j["bits"] = q.bits;
  j["group_size"] = q.group_size;
  j["attn_bits"] = q.attn_bits;
  j["mlp_bits"] = q.mlp_bits;
  j["codebook"] = ops::codebook_name(q.codebook);
  j["scale"] = q.codebook == ops::TqCodebook::lloyd_max ? "rms" : "absmax";
  j["norm_correction"] = q.norm_correction;
  // Only the newer fits add keys, so the folders the plain and norm-corrected settings made stay as they were.
  if (q.scale_fit == "mse") j["scale_fit"] = q.scale_fit;
  if (q.calibration_tokens > 0)
    j["calibration"] = {{"method", "gptq"}, {"text", q.calibration_text}, {"tokens", q.calibration_tokens},
                        {"damp", q.calibration_damp}, {"block", 128}};
  j["rotation"] = "blockwise_hadamard";
  j["rotation_seed"] = q.rotation_seed;
  j["seed_scheme"] = "splitmix64_mix(rotation_seed ^ fnv1a64(rotation_key)) & (2^53 - 1)";
  j["quantize_extras"] = q.quantize_extras;
  // The level tables the codes index, for readers without this codec (checked against it at load).
  std::set<std::pair<int, int>> used;
  for (const TqTensorEntry& e : q.tensors) used.insert({e.bits, e.group_size});
  nlohmann::ordered_json levels = nlohmann::ordered_json::object();
  for (const auto& [bits, group] : used) {
    const float* l = ops::tq_levels(bits, group, q.codebook);
    levels[levels_key(bits, group)] = std::vector<float>(l, l + (1 << bits));
  }
  j["levels"] = levels;
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
  for (const TqTensorEntry& e : q.tensors) {
    tensors[e.name] = {{"shape", e.shape}, {"bits", e.bits}, {"group_size", e.group_size}, {"rotation_block", e.rotation_block},
                       {"seed", e.seed}};
  }
  j["tensors"] = tensors;
  nlohmann::ordered_json skipped = nlohmann::ordered_json::object();
  for (size_t i = 0; i < q.skipped.size(); ++i) skipped[q.skipped[i]] = i < q.skip_reasons.size() ? q.skip_reasons[i] : "";
  j["skipped"] = skipped;
  return j;
}

std::optional<TqQuantization> parse_tq_quantization(const json& config, const std::string& source) {
  const auto it = config.find("quantization");
  if (it == config.end() || !it->is_object()) return std::nullopt;
  const json& j = *it;
  if (!j.contains("mode") || !j["mode"].is_string() || j["mode"].get<std::string>() != kTqMode) return std::nullopt;
  auto field = [&](const char* name) -> const json& {
    TQ_CHECK(j.contains(name), "'", source, "': quantization.", name, " is missing");
    return j[name];
  };
  auto integer = [&](const json& v, const std::string& what, int64_t lo, int64_t hi) {
    TQ_CHECK(v.is_number_integer(), "'", source, "': ", what, " is ", v.dump(), ", expected an integer");
    const int64_t x = v.get<int64_t>();
    TQ_CHECK(x >= lo && x <= hi, "'", source, "': ", what, " is ", x, ", expected ", lo, "..", hi);
    return x;
  };
  auto bits_of = [&](const json& v, const std::string& what) {
    const int b = static_cast<int>(integer(v, what, 0, 64));
    TQ_CHECK(b >= 2 && b <= 4, "'", source, "': ", what, " is ", b, "; TurboQuant weights have 2, 3 or 4 bits");
    return b;
  };
  auto group_of = [&](const json& v, const std::string& what) {
    const int g = static_cast<int>(integer(v, what, 0, 1 << 20));
    TQ_CHECK(g == 32 || g == 64 || g == 128, "'", source, "': ", what, " is ", g, "; groups are 32, 64 or 128 values");
    return g;
  };
  TqQuantization q;
  q.format_version = static_cast<int>(integer(field("format_version"), "quantization.format_version", 0, 1 << 20));
  TQ_CHECK(q.format_version == kTqFormatVersion, "'", source, "': TurboQuant weight format version ", q.format_version,
           " is not one this build reads (", kTqFormatVersion, ")");
  q.bits = bits_of(field("bits"), "quantization.bits");
  q.group_size = group_of(field("group_size"), "quantization.group_size");
  if (j.contains("attn_bits")) q.attn_bits = bits_of(j["attn_bits"], "quantization.attn_bits");
  if (j.contains("mlp_bits")) q.mlp_bits = bits_of(j["mlp_bits"], "quantization.mlp_bits");
  const json& cb = field("codebook");
  TQ_CHECK(cb.is_string() && (cb == "lloyd_max" || cb == "lloyd_absmax"), "'", source, "': quantization.codebook is ", cb.dump(),
           ", expected \"lloyd_max\" or \"lloyd_absmax\"");
  q.codebook = cb == "lloyd_max" ? ops::TqCodebook::lloyd_max : ops::TqCodebook::lloyd_absmax;
  if (j.contains("norm_correction")) {
    TQ_CHECK(j["norm_correction"].is_boolean(), "'", source, "': quantization.norm_correction must be true or false");
    q.norm_correction = j["norm_correction"].get<bool>();
  }
  if (j.contains("scale_fit")) {
    const json& f = j["scale_fit"];
    TQ_CHECK(f.is_string() && (f == "plain" || f == "norm_correction" || f == "mse"), "'", source, "': quantization.scale_fit is ",
             f.dump(), ", expected \"plain\", \"norm_correction\" or \"mse\"");
    q.scale_fit = f.get<std::string>();
  } else {
    q.scale_fit = q.norm_correction ? "norm_correction" : "plain";
  }
  const json& rot = field("rotation");
  TQ_CHECK(rot == "blockwise_hadamard", "'", source, "': quantization.rotation is ", rot.dump(), ", expected \"blockwise_hadamard\"");
  if (j.contains("rotation_seed")) {
    TQ_CHECK(j["rotation_seed"].is_number_unsigned(), "'", source, "': quantization.rotation_seed must be a non-negative integer");
    q.rotation_seed = j["rotation_seed"].get<uint64_t>();
  }
  if (j.contains("quantize_extras") && j["quantize_extras"].is_boolean()) q.quantize_extras = j["quantize_extras"].get<bool>();
  const json& tensors = field("tensors");
  TQ_CHECK(tensors.is_object(), "'", source, "': quantization.tensors must be an object of name: {shape, bits, group_size, ...}");
  for (const auto& [name, e] : tensors.items()) {
    const std::string what = "quantization.tensors[\"" + name + "\"]";
    TQ_CHECK(e.is_object(), "'", source, "': ", what, " must be an object");
    TqTensorEntry t;
    t.name = name;
    TQ_CHECK(e.contains("shape") && e["shape"].is_array() && e["shape"].size() == 2, "'", source, "': ", what,
             ".shape must be [out, in]");
    for (const json& d : e["shape"]) t.shape.push_back(integer(d, what + ".shape", 1, int64_t{1} << 40));
    TQ_CHECK(e.contains("bits"), "'", source, "': ", what, ".bits is missing");
    TQ_CHECK(e.contains("group_size"), "'", source, "': ", what, ".group_size is missing");
    TQ_CHECK(e.contains("rotation_block"), "'", source, "': ", what, ".rotation_block is missing");
    TQ_CHECK(e.contains("seed") && e["seed"].is_number_unsigned(), "'", source, "': ", what, ".seed must be a non-negative integer");
    t.bits = bits_of(e["bits"], what + ".bits");
    t.group_size = group_of(e["group_size"], what + ".group_size");
    t.rotation_block = static_cast<int>(integer(e["rotation_block"], what + ".rotation_block", 1, 1 << 30));
    t.seed = e["seed"].get<uint64_t>();
    TQ_CHECK(t.shape[1] % t.group_size == 0, "'", source, "': ", what, ": group size ", t.group_size, " does not divide in = ", t.shape[1]);
    TQ_CHECK(Rotation::is_supported_block(t.rotation_block) && t.shape[1] % t.rotation_block == 0, "'", source, "': ", what,
             ": rotation block ", t.rotation_block, " is not a Hadamard size (m * 2^k, m in {1, 12, 20, 28}) dividing in = ", t.shape[1]);
    q.tensors.push_back(std::move(t));
  }
  // The stored level tables must be this build's: codes index them.
  if (j.contains("levels") && j["levels"].is_object()) {
    for (const TqTensorEntry& t : q.tensors) {
      const std::string key = levels_key(t.bits, t.group_size);
      if (!j["levels"].contains(key)) continue;
      const json& l = j["levels"][key];
      const float* mine = ops::tq_levels(t.bits, t.group_size, q.codebook);
      TQ_CHECK(l.is_array() && l.size() == (size_t{1} << t.bits), "'", source, "': quantization.levels.", key, " must hold ",
               1 << t.bits, " values");
      for (int i = 0; i < (1 << t.bits); ++i) {
        const double v = l[static_cast<size_t>(i)].get<double>();
        TQ_CHECK(std::fabs(v - mine[i]) <= 1e-6 * std::max(1.0, std::fabs(static_cast<double>(mine[i]))), "'", source,
                 "': quantization.levels.", key, "[", i, "] is ", v, ", but this build's ", ops::codebook_name(q.codebook),
                 " table has ", mine[i]);
      }
    }
  }
  if (j.contains("skipped") && j["skipped"].is_object()) {
    for (const auto& [name, why] : j["skipped"].items()) {
      q.skipped.push_back(name);
      q.skip_reasons.push_back(why.is_string() ? why.get<std::string>() : "");
    }
  }
  return q;
}

std::optional<TqQuantization> read_tq_quantization(const std::string& folder) {
  const std::string path = (std::filesystem::path(folder) / "config.json").string();
  if (!std::filesystem::exists(path)) return std::nullopt;
  const std::string text = read_whole_file(path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("'", path, "': not valid JSON (", e.what(), ")");
  }
  return parse_tq_quantization(j, path);
}

void attach_tq_weights(const TqQuantization& q, TensorSet& tensors) {
  std::set<std::string> listed;
  for (const TqTensorEntry& e : q.tensors) {
    const int64_t out = e.shape[0], in = e.shape[1];
    const std::string codes_name = e.name + ".tq_codes", scales_name = e.name + ".tq_scales";
    listed.insert(codes_name);
    listed.insert(scales_name);
    const TensorView* codes = tensors.find(codes_name);
    const TensorView* scales = tensors.find(scales_name);
    TQ_CHECK(codes != nullptr, "'", tensors.source(), "': tensor '", codes_name, "' is missing (config.json lists '", e.name,
             "' as a TQ", e.bits, " matrix)");
    TQ_CHECK(scales != nullptr, "'", tensors.source(), "': tensor '", scales_name, "' is missing (config.json lists '", e.name,
             "' as a TQ", e.bits, " matrix)");
    const std::vector<int64_t> codes_shape{out, in * e.bits / 8}, scales_shape{out, in / e.group_size};
    TQ_CHECK(codes->dtype == DType::u8, "'", codes->file, "': tensor '", codes_name, "' is ", dtype_name(codes->dtype),
             ", expected U8 (packed codes)");
    TQ_CHECK(codes->shape == codes_shape, "'", codes->file, "': tensor '", codes_name, "' has shape ", shape_string(codes->shape),
             ", expected ", shape_string(codes_shape), " for [", out, ", ", in, "] at ", e.bits,
             " bits (config.json's bits do not match the codes, or the tensor is truncated)");
    TQ_CHECK(scales->dtype == DType::f16, "'", scales->file, "': tensor '", scales_name, "' is ", dtype_name(scales->dtype),
             ", expected F16 (group scales)");
    TQ_CHECK(scales->shape == scales_shape, "'", scales->file, "': tensor '", scales_name, "' has shape ",
             shape_string(scales->shape), ", expected ", shape_string(scales_shape), " (one scale per group of ", e.group_size,
             " of ", in, " columns)");
    // A scale is a group's RMS or absmax: finite and not negative. Anything else is a damaged file.
    const auto* sp = static_cast<const uint8_t*>(scales->data);
    for (int64_t k = 0; k < out * (in / e.group_size); ++k) {
      uint16_t b;
      std::memcpy(&b, sp + 2 * k, 2);
      const float s = f16_bits_to_f32(b);
      TQ_CHECK(std::isfinite(s) && s >= 0, "'", scales->file, "': tensor '", scales_name, "' holds the scale ", s, " at row ",
               k / (in / e.group_size), ", group ", k % (in / e.group_size), " (scales are finite and >= 0)");
    }
    TQ_CHECK(!tensors.contains(e.name + ".weight"), "'", tensors.source(), "': both '", e.name, ".weight' and its TurboQuant planes are stored");
    TensorView v;
    v.name = e.name + ".weight";
    v.dtype = e.bits == 2 ? DType::tq2 : e.bits == 3 ? DType::tq3 : DType::tq4;
    v.shape = e.shape;
    v.data = codes->data;
    v.nbytes = codes->nbytes;
    v.file = codes->file;
    v.tq_scales = scales->data;
    v.tq.group_size = e.group_size;
    v.tq.rotation_block = e.rotation_block;
    v.tq.seed = e.seed;
    v.tq.codebook = q.codebook;
    tensors.add(std::move(v));
  }
  for (const TensorView& t : tensors.all()) {
    if ((ends_with(t.name, ".tq_codes") || ends_with(t.name, ".tq_scales")) && !listed.count(t.name))
      fail("'", t.file, "': tensor '", t.name, "' is a TurboQuant plane that config.json's quantization.tensors does not list");
  }
}

}  // namespace tq
