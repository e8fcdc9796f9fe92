#include "runtime/kv_settings.h"

#include <sstream>

#include "core/error.h"

namespace tq {
namespace {

bool valid_type(const std::string& t) {
  for (const char* ok : {"f16", "bf16", "f32", "turboquant", "q8_0", "q4_0", "q8_0_rot", "q4_0_rot"})
    if (t == ok) return true;
  return false;
}

VectorFormatSpec spec_for(const std::string& type, int bits, const KVSettings& s, uint64_t seed) {
  VectorFormatSpec v;
  if (type == "turboquant") {
    v.type = KVType::turboquant;
    v.quantizer = QuantizerOptions::defaults(bits);
    v.quantizer.group_size = s.group_size;
    v.quantizer.scale_fit = parse_scale_fit(s.fit);
    v.quantizer.rotation_block = parse_rotation_block(s.rotation);
    v.quantizer.codebook = parse_distribution(s.codebook);
    if (!s.grid.empty()) v.quantizer.grid = parse_grid(s.grid);
    v.quantizer.seed = seed;
  } else if (type == "q8_0_rot" || type == "q4_0_rot") {
    v.type = type == "q8_0_rot" ? KVType::q8_0 : KVType::q4_0;
    v.rotate = true;
    v.seed = seed;
  } else {
    v.type = parse_kv_type(type);
  }
  return v;
}

}  // namespace

void KVSettings::resolve() {
  TQ_CHECK(!(bits && (k_bits || v_bits)), "--kv-bits cannot be combined with --kv-k-bits/--kv-v-bits");
  TQ_CHECK((k_bits == 0) == (v_bits == 0), "--kv-k-bits and --kv-v-bits must be given together");
  if (bits) k_bits = v_bits = bits;
  for (int b : {k_bits, v_bits}) TQ_CHECK(b == 0 || (b >= 2 && b <= 8), "KV bits must be in 2..8, got ", b);
  TQ_CHECK(group_size == 32 || group_size == 64 || group_size == 128, "--kv-group-size must be 32, 64 or 128, got ", group_size);
  TQ_CHECK(min_tokens >= 0, "--kv-min-tokens must not be negative");
  TQ_CHECK(block_tokens == 0 || (block_tokens >= 16 && block_tokens % 16 == 0),
           "KV block size must be a positive multiple of 16, got ", block_tokens);
  for (std::string* t : {&k_type, &v_type}) {
    if (t->empty()) *t = k_bits ? "turboquant" : "f16";
    TQ_CHECK(valid_type(*t), "unknown KV cache type '", *t,
             "' (expected f16, bf16, f32, turboquant, q8_0, q4_0, q8_0_rot or q4_0_rot)");
  }
  if (k_type == "turboquant" || v_type == "turboquant") {
    TQ_CHECK(k_bits, "a turboquant KV type needs --kv-bits or --kv-k-bits/--kv-v-bits");
  }
  parse_scale_fit(fit);
  parse_rotation_block(rotation);
  parse_distribution(codebook);
  if (!grid.empty()) parse_grid(grid);
  TQ_CHECK(!fused || compressed(), "--kv-fused needs a compressed KV cache (--kv-bits, --kv-k-bits/--kv-v-bits or a quantized --kv-k-type)");
  TQ_CHECK(center.empty() || center == "none" || center == "k" || center == "v" || center == "kv",
           "--kv-center must be none, k, v or kv, got '", center, "'");
  TQ_CHECK(center_tokens == 0 || (center_tokens >= 16 && (center_tokens & (center_tokens - 1)) == 0),
           "--kv-center-block must be a power of two of at least 16 (or 0: the block size), got ", center_tokens);
  const std::string c = resolved_center();
  TQ_CHECK(c.find('k') == std::string::npos || (k_type != "f16" && k_type != "bf16" && k_type != "f32"),
           "--kv-center ", c, " centres K, which needs a quantized K type (got ", k_type, ")");
  TQ_CHECK(c.find('v') == std::string::npos || (v_type != "f16" && v_type != "bf16" && v_type != "f32"),
           "--kv-center ", c, " centres V, which needs a quantized V type (got ", v_type, ")");
  TQ_CHECK(!query_int8 || fused, "--kv-query-int8 is a scorer of the fused attention: it needs --kv-fused");
  TQ_CHECK(!query_int8 || (k_type == "turboquant" && (k_bits <= 4 || (k_bits == 8 && (grid.empty() || grid == "uniform")))),
           "--kv-query-int8 scores TurboQuant keys of 2-4 bits or 8 bits on the uniform grid, got K ", k_type,
           k_type == "turboquant" ? " at " + std::to_string(k_bits) + " bits" + (grid.empty() ? "" : " (grid " + grid + ")") : "");
  TQ_CHECK(!swa_compress || compressed(), "--kv-swa-compress needs a compressed KV cache (--kv-bits, --kv-k-bits/--kv-v-bits or a quantized --kv-k-type)");
}

std::string KVSettings::resolved_k_type() const { return k_type.empty() ? "f16" : k_type; }
std::string KVSettings::resolved_v_type() const { return v_type.empty() ? "f16" : v_type; }

bool KVSettings::compressed() const {
  auto dense = [](const std::string& t) { return t.empty() || t == "f16" || t == "bf16" || t == "f32"; };
  return !dense(k_type) || !dense(v_type);
}

static int type_bits(const std::string& t, int tq_bits) {
  if (t == "turboquant") return tq_bits;
  if (t == "q8_0" || t == "q8_0_rot") return 8;
  if (t == "q4_0" || t == "q4_0_rot") return 4;
  if (t == "f32") return 32;
  return 16;
}
std::string KVSettings::resolved_center(bool default_centring) const {
  if (!center.empty()) return center;
  if (!default_centring) return "none";
  // Measured (docs/BENCHMARKS.md, "Block-mean centring"): centring K per block of 256 lowers the KLD of
  // K4/V4 by about 27%, K3/V4 35%, K4/V3 16% for 1-3% of attention time; 8-bit K gains nothing, and
  // centring V gains 3-7% for 3-6% of time, so neither is a default. The q8_0/q4_0 baselines stay as
  // llama.cpp stores them.
  return resolved_k_type() == "turboquant" && k_bits < 8 ? "k" : "none";
}

double KVSettings::bits_per_value(int head_dim, int default_block_tokens) const {
  const KVCacheOptions o = cache_options(default_block_tokens);
  const VectorFormat k(head_dim, o.k), v(head_dim, o.v);
  const double mean_bits = 16.0 * (o.center_k + o.center_v) / (o.centred() ? o.center_run() : 1);
  return (8.0 * static_cast<double>(k.record_bytes() + v.record_bytes()) / head_dim + mean_bits) / 2.0;
}

int KVSettings::effective_k_bits() const { return type_bits(resolved_k_type(), k_bits); }
int KVSettings::effective_v_bits() const { return type_bits(resolved_v_type(), v_bits); }

std::string KVSettings::describe() const {
  std::ostringstream os;
  const std::string k = resolved_k_type(), v = resolved_v_type();
  auto one = [&](const std::string& t, int b) { return t == "turboquant" ? "turboquant" + std::to_string(b) : t; };
  os << "K " << one(k, k_bits) << ", V " << one(v, v_bits);
  if (k == "turboquant" || v == "turboquant") {
    os << ", group " << group_size << ", fit " << fit << ", rotation " << rotation;
    if (!grid.empty()) os << ", grid " << grid;
    if (codebook != "gaussian") os << ", codebook " << codebook;
  }
  if (min_tokens) os << ", first " << min_tokens << " positions FP16";
  if (compressed()) os << (fused ? (query_int8 ? ", fused attention, int8-query scorer" : ", fused attention, exact scorer")
                                 : ", standard attention (expand, then attend)");
  if (swa_compress) os << ", sliding-window layers compressed";
  if (const std::string c = resolved_center(); c != "none") {
    os << ", " << (c == "kv" ? "K and V" : c == "k" ? "K" : "V") << " centred per ";
    if (center_tokens) os << center_tokens << " positions"; else os << "block";
  }
  return os.str();
}

KVCacheOptions KVSettings::cache_options(int default_block_tokens, bool default_centring) const {
  KVCacheOptions o;
  o.k = spec_for(resolved_k_type(), k_bits, *this, 0x4b4b4b4b);
  o.v = spec_for(resolved_v_type(), v_bits, *this, 0x56565656);
  o.min_tokens = compressed() ? min_tokens : 0;
  o.block_tokens = block_tokens > 0 ? block_tokens : default_block_tokens;
  const std::string c = resolved_center(default_centring);
  o.center_k = c.find('k') != std::string::npos;
  o.center_v = c.find('v') != std::string::npos;
  o.center_tokens = center_tokens;
  o.query_int8 = query_int8;
  return o;
}

KVCacheOptions KVSettings::sliding_cache_options(int window, int default_block_tokens, bool default_centring) const {
  const KVCacheOptions full = cache_options(default_block_tokens, default_centring);
  KVCacheOptions o;
  if (!compressed() || swa_compress) {
    o.k = full.k;
    o.v = full.v;
  }
  if (swa_compress) {
    o.center_k = full.center_k;
    o.center_v = full.center_v;
    o.center_tokens = full.center_tokens;
    o.query_int8 = full.query_int8;  // the dense rotating caches (no --kv-swa-compress) are scored exactly
  }
  o.window = window;
  o.block_tokens = full.block_tokens;
  return o;
}

PromptCache build_prompt_cache(const std::vector<LayerSpec>& specs, const KVSettings& kv) {
  PromptCache caches;
  const KVCacheOptions full = kv.cache_options();
  for (const LayerSpec& l : specs) {
    KVCacheOptions o = full;
    if (l.kind == LayerKind::sliding_attention) o = kv.sliding_cache_options(l.window);
    auto cache = std::make_unique<KVCache>(l.n_kv_heads, l.head_dim, o);
    cache->set_fused(kv.fused);  // a dense rotating cache attends on the fused path whatever the flag
    caches.push_back(std::move(cache));
  }
  return caches;
}

}  // namespace tq
