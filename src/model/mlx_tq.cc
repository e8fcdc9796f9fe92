#include "model/mlx_tq.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include "codec/rotation.h"
#include "core/error.h"
#include "core/half.h"
#include "core/read_file.h"
#include "ops/tq_weights.h"

namespace tq {

using json = nlohmann::json;

// 2- and 4-bit layers use the file's words in place as our byte rows: that holds on a little-endian host.
static_assert(std::endian::native == std::endian::little, "MLX TurboQuant words are read in place as little-endian bytes");

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

uint32_t word_at(const TensorView& t, int64_t i) {
  uint32_t w;
  std::memcpy(&w, static_cast<const uint8_t*>(t.data) + 4 * i, 4);
  return w;
}
uint16_t half_at(const void* p, int64_t i) {
  uint16_t h;
  std::memcpy(&h, static_cast<const uint8_t*>(p) + 2 * i, 2);
  return h;
}

// The bits the config gives a layer (the reference system's bits_for_path for dense layers): attention
// projections attn_bits, MLP ones mlp_bits (shared and routed experts excepted), else the base bits.
int config_bits(const MlxTqQuantization& q, const std::string& name) {
  if (q.attn_bits && (has(name, ".self_attn.") || has(name, ".attention.") || has(name, ".linear_attn."))) return q.attn_bits;
  if (q.mlp_bits && (has(name, ".mlp.") || has(name, ".feed_forward.")) && !has(name, "shared_expert") && !has(name, "routed_expert_"))
    return q.mlp_bits;
  return q.bits;
}

int64_t per_word(int bits) { return 32 / bits; }
int64_t words_for(int64_t in, int bits) { return (in + per_word(bits) - 1) / per_word(bits); }

}  // namespace

std::optional<MlxTqQuantization> parse_mlx_tq_quantization(const json& config, const std::string& source) {
  const auto it = config.find("quantization");
  if (it == config.end() || !it->is_object()) return std::nullopt;
  const json& j = *it;
  if (!j.contains("mode") || !j["mode"].is_string() || j["mode"].get<std::string>() != kMlxTqMode) return std::nullopt;
  auto bits_field = [&](const char* name, bool required) {
    if (!j.contains(name) || j[name].is_null()) {
      TQ_CHECK(!required, "'", source, "': quantization.", name, " is missing");
      return 0;
    }
    TQ_CHECK(j[name].is_number_integer(), "'", source, "': quantization.", name, " is ", j[name].dump(), ", expected 2, 3 or 4");
    const int b = j[name].get<int>();
    TQ_CHECK(b >= 1 && b <= 8, "'", source, "': quantization.", name, " is ", b, ", expected 2, 3 or 4");
    return b;
  };
  MlxTqQuantization q;
  q.bits = bits_field("bits", true);
  q.attn_bits = bits_field("attn_bits", false);
  q.mlp_bits = bits_field("mlp_bits", false);
  auto present = [&](const char* name) {
    return j.contains(name) && !j[name].is_null() && !(j[name].is_boolean() && !j[name].get<bool>()) &&
           !(j[name].is_array() && j[name].empty()) && !(j[name].is_object() && j[name].empty());
  };
  q.tiered_experts = present("ternary_experts") || present("expert_down_bits") || present("protected_expert_layers") ||
                     present("expert_layer_tiers");
  if (j.contains("rotation") && j["rotation"].is_string()) q.rotation = j["rotation"].get<std::string>();
  TQ_CHECK(!(j.contains("use_qjl") && j["use_qjl"].is_boolean() && j["use_qjl"].get<bool>()), "'", source,
           "': quantization.use_qjl is true: the QJL residual correction of the reference system is not read by this build");
  TQ_CHECK(!present("affine_extras"), "'", source,
           "': quantization.affine_extras is set: MLX affine-quantized embeddings and extras (--quantize-extras) are not "
           "read by this build");
  return q;
}

std::optional<MlxTqQuantization> read_mlx_tq_quantization(const std::string& folder) {
  const std::string path = (std::filesystem::path(folder) / "config.json").string();
  if (!std::filesystem::exists(path)) return std::nullopt;
  json j;
  try {
    j = json::parse(read_whole_file(path));
  } catch (const json::exception& e) {
    fail("'", path, "': not valid JSON (", e.what(), ")");
  }
  return parse_mlx_tq_quantization(j, path);
}

std::shared_ptr<MlxTqStorage> attach_mlx_tq_weights(const MlxTqQuantization& q, TensorSet& tensors) {
  auto storage = std::make_shared<MlxTqStorage>();
  std::vector<std::string> layers;
  for (const TensorView& t : tensors.all())
    if (ends_with(t.name, ".codebook")) layers.push_back(t.name.substr(0, t.name.size() - 9));
  std::set<std::string> done;
  for (const std::string& P : layers) {
    const TensorView& cb = tensors.at(P + ".codebook");
    const std::string where = "'" + cb.file + "': ";
    // Codebook -> bits.
    TQ_CHECK(cb.dtype == DType::f16 && cb.shape.size() == 1, where, "tensor '", P, ".codebook' is ", dtype_name(cb.dtype), " ",
             shape_string(cb.shape), ", expected F16 [2^bits]");
    const int64_t levels = cb.shape[0];
    TQ_CHECK(levels != 3, where, "tensor '", P, ".codebook' has 3 entries: '", P,
             "' is a ternary layer (base-3 codes, 20 per word), which this build does not read (2, 3 and 4 bits only)");
    TQ_CHECK(levels == 4 || levels == 8 || levels == 16, where, "tensor '", P, ".codebook' has ", levels,
             " entries; TurboQuant layers have 2^bits with bits 2, 3 or 4");
    const int bits = levels == 4 ? 2 : levels == 8 ? 3 : 4;
    for (const char* extra : {".qjl_packed", ".qjl_norms", ".qjl_signs"})
      TQ_CHECK(!tensors.contains(P + extra), where, "tensor '", P, extra,
               "': the QJL residual correction of the reference system is not read by this build");
    // Packed codes.
    const TensorView* wt = tensors.find(P + ".weight");
    TQ_CHECK(wt != nullptr, where, "tensor '", P, ".weight' (the packed codes) is missing beside '", P, ".codebook'");
    TQ_CHECK(wt->dtype == DType::u32, "'", wt->file, "': tensor '", P, ".weight' is ", dtype_name(wt->dtype),
             ", expected U32 packed codes (it has a codebook)");
    TQ_CHECK(wt->shape.size() != 3, "'", wt->file, "': tensor '", P, ".weight' is ", shape_string(wt->shape),
             ": an MoE switch layer (experts stacked, one sign vector shared by them), which this build does not read "
             "from the reference system's folders yet");
    TQ_CHECK(wt->shape.size() == 2, "'", wt->file, "': tensor '", P, ".weight' has shape ", shape_string(wt->shape),
             ", expected [out, packed words]");
    const int64_t out = wt->shape[0], words = wt->shape[1];
    // Signs -> in.
    const TensorView* sg = tensors.find(P + ".signs");
    TQ_CHECK(sg != nullptr, where, "tensor '", P, ".signs' is missing: the reference system's layers carry their rotation "
             "signs (drawn by MLX's generator, which cannot be reproduced), and '", P, "' cannot be read without them");
    TQ_CHECK(sg->dtype == DType::f16 && sg->shape.size() == 1, "'", sg->file, "': tensor '", P, ".signs' is ",
             dtype_name(sg->dtype), " ", shape_string(sg->shape), ", expected F16 [in]");
    const int64_t in = sg->shape[0];
    // Scales -> group size.
    const TensorView* sc = tensors.find(P + ".scales");
    TQ_CHECK(sc != nullptr, where, "tensor '", P, ".scales' is missing");
    TQ_CHECK(sc->dtype == DType::f16, "'", sc->file, "': tensor '", P, ".scales' is ", dtype_name(sc->dtype), ", expected F16");
    TQ_CHECK(sc->shape.size() == 2 && sc->shape[0] == out && sc->shape[1] > 0 && in % sc->shape[1] == 0, "'", sc->file,
             "': tensor '", P, ".scales' has shape ", shape_string(sc->shape), ", expected [", out,
             ", in / group] with the group dividing in = ", in, " (the length of '", P, ".signs')");
    const int group = static_cast<int>(in / sc->shape[1]);
    TQ_CHECK(group == 32 || group == 64 || group == 128, "'", sc->file, "': tensor '", P, ".scales' gives groups of ", group,
             " (", in, " columns / ", sc->shape[1], " scales); this build's TurboQuant kernels take groups of 32, 64 or 128");
    // Bits: the codebook, the packed width and the config must agree.
    if (words != words_for(in, bits)) {
      std::string hint;
      for (int b = 2; b <= 4; ++b)
        if (b != bits && words == words_for(in, b)) hint = " (the width of " + std::to_string(b) + "-bit codes: the codebook and the codes disagree)";
      fail("'", wt->file, "': tensor '", P, ".weight' has ", words, " words per row, but ", in, " codes of ", bits,
           " bits (the codebook's ", levels, " entries) take ", words_for(in, bits), hint);
    }
    if (!q.tiered_experts) {
      const int want = config_bits(q, P);
      TQ_CHECK(want == bits, where, "'", P, "' has ", bits, "-bit codes (", levels, " codebook entries), but config.json's "
               "quantization gives it ", want, " bits");
    }
    // Padding: bits above the last whole code of a word, and codes past `in` in a row's last word, are zero
    // as the reference system packs them; anything else is a damaged tensor.
    const int64_t e = per_word(bits);
    const uint32_t used = bits * e == 32 ? 0xffffffffu : (uint32_t{1} << (bits * e)) - 1;
    const int64_t tail = in - (words - 1) * e;  // codes in a row's last word
    const uint32_t last_used = tail * bits >= 32 ? 0xffffffffu : (uint32_t{1} << (tail * bits)) - 1;
    for (int64_t r = 0; r < out; ++r)
      for (int64_t k = 0; k < words; ++k) {
        const uint32_t w = word_at(*wt, r * words + k);
        const uint32_t mask = k == words - 1 ? (used & last_used) : used;
        TQ_CHECK((w & ~mask) == 0, "'", wt->file, "': tensor '", P, ".weight' row ", r, " word ", k, " = ", w, " has bits set in its padding (a corrupt packed tensor, or codes of other bits)");
      }
    // Scales: an RMS is finite and not negative.
    for (int64_t k = 0; k < out * sc->shape[1]; ++k) {
      const float s = f16_bits_to_f32(half_at(sc->data, k));
      TQ_CHECK(std::isfinite(s) && s >= 0, "'", sc->file, "': tensor '", P, ".scales' holds ", s, " at row ", k / sc->shape[1],
               ", group ", k % sc->shape[1], " (scales are finite and >= 0)");
    }
    // Levels and signs as floats.
    std::vector<float> f(static_cast<size_t>(levels + in));  // [levels | signs]
    for (int64_t i = 0; i < levels; ++i) {
      f[i] = f16_bits_to_f32(half_at(cb.data, i));
      TQ_CHECK(std::isfinite(f[i]), where, "tensor '", P, ".codebook' entry ", i, " is ", f[i]);
    }
    bool rotated = false;
    for (int64_t i = 0; i < in; ++i) {
      const float s = f16_bits_to_f32(half_at(sg->data, i));
      TQ_CHECK(s == 1.0f || s == -1.0f, "'", sg->file, "': tensor '", P, ".signs' entry ", i, " is ", s, ", not +1 or -1");
      f[levels + i] = s;
      rotated = rotated || s < 0;
    }
    // Codes in our layout.
    TensorView v;
    v.name = P + ".weight";
    v.dtype = bits == 2 ? DType::tq2 : bits == 3 ? DType::tq3 : DType::tq4;
    v.shape = {out, in};
    v.file = wt->file;
    v.tq_scales = sc->data;
    if (bits == 3) {
      std::vector<uint8_t> planes(static_cast<size_t>(out * in * 3 / 8));  // [out][in * 3 / 8]
      std::vector<uint8_t> idx(static_cast<size_t>(in));                  // [in] one row's codes
      for (int64_t r = 0; r < out; ++r) {
        for (int64_t i = 0; i < in; ++i) idx[i] = static_cast<uint8_t>(word_at(*wt, r * words + i / e) >> (3 * (i % e)) & 7);
        ops::tq_pack_row(3, idx.data(), static_cast<size_t>(in), planes.data() + r * (in * 3 / 8));
      }
      v.data = planes.data();
      v.nbytes = planes.size();
      storage->codes.push_back(std::move(planes));
    } else {
      // 16 (8) codes of 2 (4) bits per little-endian word, least significant first, no padding (the group
      // size divides in): byte k holds codes 4k..4k+3 (2k, 2k+1) from its low bits up, our TQ2 (TQ4) row.
      v.data = wt->data;
      v.nbytes = wt->nbytes;
    }
    storage->floats.push_back(std::move(f));
    const std::vector<float>& fl = storage->floats.back();
    v.tq.group_size = group;
    v.tq.levels = fl.data();
    v.tq.signs = fl.data() + levels;
    v.tq.sloane_hadamard = rotated;
    // Not rotated (rotation "none": every sign +1): a block of 1 is the identity.
    v.tq.rotation_block = rotated ? Rotation::largest_supported_block(static_cast<int>(in)) : 1;
    v.tq.seed = 0;
    storage->layers.push_back({P, out, in, bits, group, v.tq.rotation_block});
    tensors.replace(std::move(v));
    done.insert(P);
  }
  for (const TensorView& t : tensors.all()) {
    if (t.dtype == DType::u32)
      fail("'", t.file, "': tensor '", t.name, "' is U32 but has no '.codebook' beside it",
           ends_with(t.name, ".weight") && tensors.contains(t.name.substr(0, t.name.size() - 7) + ".biases")
               ? " (an MLX affine-quantized tensor: --quantize-extras output, which this build does not read)"
               : " (not a TurboQuant layer)");
    for (const char* plane : {".scales", ".signs", ".biases"}) {
      if (!ends_with(t.name, plane)) continue;
      const std::string P = t.name.substr(0, t.name.size() - std::strlen(plane));
      if (!done.count(P))
        fail("'", t.file, "': tensor '", t.name, "' has no '", P, ".codebook' beside it",
             std::string(plane) == ".signs" ? "" : " (an MLX affine-quantized tensor, which this build does not read)");
    }
  }
  return storage;
}

namespace ref {

std::vector<double> mlx_tq_weight_row(const uint32_t* words, int64_t words_per_row, int64_t in, int bits, const uint16_t* scales,
                                      int group_size, const uint16_t* codebook, const uint16_t* signs, int64_t r) {
  const int64_t e = 32 / bits;
  std::vector<double> wr(static_cast<size_t>(in));  // [in] the rotated-domain row
  bool rotated = false;
  for (int64_t i = 0; i < in; ++i) {
    const uint32_t code = words[r * words_per_row + i / e] >> (bits * (i % e)) & ((1u << bits) - 1);
    wr[i] = static_cast<double>(f16_bits_to_f32(codebook[code])) *
            f16_bits_to_f32(scales[r * (in / group_size) + i / group_size]);
    rotated = rotated || f16_bits_to_f32(signs[i]) < 0;
  }
  if (!rotated) return wr;
  // n = m * p, the largest such block dividing in; R = (1/sqrt(n)) (H_m (x) H_p) diag(s) per block, so
  // w = diag(s) (H_m (x) H_p)^T w_rot / sqrt(n): entry (j p + a, k p + b) of the Kronecker product is
  // H_m[j][k] * (-1)^popcount(a & b) (natural-order Sylvester).
  const int n = Rotation::largest_supported_block(static_cast<int>(in));
  int odd = n;
  while (odd % 2 == 0) odd /= 2;
  const int m = odd == 1 ? 1 : odd * 4;  // 3 -> 12, 5 -> 20, 7 -> 28
  const int p = n / m;
  const std::vector<int8_t>& hm = Rotation::small_hadamard(m, HadamardFamily::sloane);
  std::vector<double> w(static_cast<size_t>(in));
  for (int64_t base = 0; base < in; base += n) {
    for (int col = 0; col < n; ++col) {  // w[col] = s[col] / sqrt(n) * sum_row H[row][col] w_rot[row]
      const int k = col / p, b = col % p;
      double acc = 0;
      for (int row = 0; row < n; ++row) {
        const int j = row / p, a = row % p;
        const int h = hm[static_cast<size_t>(j * m + k)] * ((__builtin_popcount(static_cast<unsigned>(a & b)) & 1) ? -1 : 1);
        acc += h * wr[base + row];
      }
      w[base + col] = acc / std::sqrt(static_cast<double>(n)) * f16_bits_to_f32(signs[base + col]);
    }
  }
  return w;
}

}  // namespace ref
}  // namespace tq
