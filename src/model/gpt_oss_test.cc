// GPT-OSS through the engine on the CPU against a double-precision reference forward pass written here
// from the equations of model/gpt_oss.h (transformers' modeling_gpt_oss.py): a tiny random model with
// MXFP4 experts, a sliding window shorter than the prompts and sink logits far from zero, so that each
// detail changes the logits. (The golden logits of transformers itself are in golden_test.cc.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <numbers>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/gguf_export.h"
#include "model/loader.h"
#include "model/model_test_util.h"
#include "model/writer.h"
#include "runtime/perplexity.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

using json = nlohmann::json;

// The test model's shapes: head_dim 64 as the real model (and the CUDA kernels); q wider than hidden.
constexpr int kLayers = 2, kHidden = 64, kHeads = 4, kKvHeads = 2, kHeadDim = 64, kInter = 96, kExperts = 4, kTopK = 2;
constexpr int kVocab = 48, kWindow = 5;
constexpr double kTheta = 150000, kYarnFactor = 32, kBetaFast = 32, kBetaSlow = 1, kOriginalContext = 4096;
constexpr double kLimit = 7.0, kAlpha = 1.702, kEps = 1e-5;

double lut(int nibble) {
  static const double kValues[16] = {0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6};
  return kValues[nibble];
}

// The model's values, as the reference reads them; the same bytes go into the safetensors file.
struct TinyGptOss {
  using Matrix = std::vector<double>;  // [rows][cols], row-major
  struct Layer {
    Matrix attn_norm, moe_norm;           // [H]
    Matrix wq, wk, wv, wo;                // [out][in]
    Matrix bq, bk, bv, bo, sinks;         // [out], [heads]
    Matrix router, router_bias;           // [E][H], [E]
    std::vector<uint8_t> gu_codes, gu_scales;  // [E][2I][H/32][16], [E][2I][H/32]
    std::vector<uint8_t> dn_codes, dn_scales;  // [E][H][I/32][16], [E][H][I/32]
    Matrix gu_bias, dn_bias;              // [E][2I] (interleaved), [E][H]
  };
  Matrix embed, lm_head, final_norm;  // [V][H], [V][H], [H]
  std::vector<Layer> layers;

  explicit TinyGptOss(uint64_t seed) {
    SplitMix64 rng(seed);
    auto normal = [&](size_t n, double scale, double base = 0) {
      Matrix m(n);
      for (double& v : m) v = static_cast<double>(static_cast<float>(base + scale * rng.normal()));  // exact in F32
      return m;
    };
    auto bytes = [&](size_t n, int lo, int span) {
      std::vector<uint8_t> b(n);
      for (uint8_t& x : b) x = static_cast<uint8_t>(span ? lo + static_cast<int>(rng.next() % static_cast<uint64_t>(span)) : rng.next());
      return b;
    };
    embed = normal(kVocab * kHidden, 1.0);
    lm_head = normal(kVocab * kHidden, 1.0 / std::sqrt(kHidden));
    final_norm = normal(kHidden, 0.2, 1.0);
    for (int l = 0; l < kLayers; ++l) {
      Layer L;
      L.attn_norm = normal(kHidden, 0.2, 1.0);
      L.moe_norm = normal(kHidden, 0.2, 1.0);
      L.wq = normal(kHeads * kHeadDim * kHidden, 1.0 / std::sqrt(kHidden));
      L.wk = normal(kKvHeads * kHeadDim * kHidden, 1.0 / std::sqrt(kHidden));
      L.wv = normal(kKvHeads * kHeadDim * kHidden, 1.0 / std::sqrt(kHidden));
      L.wo = normal(kHidden * kHeads * kHeadDim, 1.0 / std::sqrt(kHeads * kHeadDim));
      L.bq = normal(kHeads * kHeadDim, 0.2);
      L.bk = normal(kKvHeads * kHeadDim, 0.2);
      L.bv = normal(kKvHeads * kHeadDim, 0.2);
      L.bo = normal(kHidden, 0.2);
      L.sinks = normal(kHeads, 1.0, 1.5);  // far from zero: they take a visible share of the softmax
      L.router = normal(kExperts * kHidden, 2.0 / std::sqrt(kHidden));
      L.router_bias = normal(kExperts, 0.5);
      L.gu_codes = bytes(static_cast<size_t>(kExperts) * 2 * kInter * kHidden / 2, 0, 0);
      L.gu_scales = bytes(static_cast<size_t>(kExperts) * 2 * kInter * kHidden / 32, 121, 4);  // 2^-6 .. 2^-3
      L.dn_codes = bytes(static_cast<size_t>(kExperts) * kHidden * kInter / 2, 0, 0);
      L.dn_scales = bytes(static_cast<size_t>(kExperts) * kHidden * kInter / 32, 121, 4);
      // BF16 in the file: round here so that the reference sees the stored values.
      L.gu_bias = normal(static_cast<size_t>(kExperts) * 2 * kInter, 0.5);
      L.dn_bias = normal(static_cast<size_t>(kExperts) * kHidden, 0.2);
      for (Matrix* b : {&L.gu_bias, &L.dn_bias})
        for (double& v : *b) v = bf16_bits_to_f32(f32_to_bf16_bits(static_cast<float>(v)));
      layers.push_back(std::move(L));
    }
  }

  // The expert matrices' values: element [e][r][c] of a [E][rows][cols] plane pair.
  static double mx(const std::vector<uint8_t>& codes, const std::vector<uint8_t>& scales, int rows, int cols, int e, int r, int c) {
    const size_t blk = (static_cast<size_t>(e) * rows + r) * (cols / 32) + c / 32;
    const uint8_t byte = codes[blk * 16 + (c % 32) / 2];
    return std::ldexp(lut(c % 2 ? byte >> 4 : byte & 15), static_cast<int>(scales[blk]) - 127);
  }

  void write(const std::string& dir) const {
    SafetensorsWriter w;
    auto f32 = [&](const std::string& name, std::vector<int64_t> shape, const Matrix& m) {
      w.add(name, DType::f32, std::move(shape), std::vector<float>(m.begin(), m.end()));
    };
    f32("model.embed_tokens.weight", {kVocab, kHidden}, embed);
    f32("lm_head.weight", {kVocab, kHidden}, lm_head);
    f32("model.norm.weight", {kHidden}, final_norm);
    for (int l = 0; l < kLayers; ++l) {
      const Layer& L = layers[static_cast<size_t>(l)];
      const std::string p = "model.layers." + std::to_string(l) + ".";
      f32(p + "input_layernorm.weight", {kHidden}, L.attn_norm);
      f32(p + "post_attention_layernorm.weight", {kHidden}, L.moe_norm);
      f32(p + "self_attn.q_proj.weight", {kHeads * kHeadDim, kHidden}, L.wq);
      f32(p + "self_attn.k_proj.weight", {kKvHeads * kHeadDim, kHidden}, L.wk);
      f32(p + "self_attn.v_proj.weight", {kKvHeads * kHeadDim, kHidden}, L.wv);
      f32(p + "self_attn.o_proj.weight", {kHidden, kHeads * kHeadDim}, L.wo);
      f32(p + "self_attn.q_proj.bias", {kHeads * kHeadDim}, L.bq);
      f32(p + "self_attn.k_proj.bias", {kKvHeads * kHeadDim}, L.bk);
      f32(p + "self_attn.v_proj.bias", {kKvHeads * kHeadDim}, L.bv);
      f32(p + "self_attn.o_proj.bias", {kHidden}, L.bo);
      f32(p + "self_attn.sinks", {kHeads}, L.sinks);
      f32(p + "mlp.router.weight", {kExperts, kHidden}, L.router);
      f32(p + "mlp.router.bias", {kExperts}, L.router_bias);
      const std::string x = p + "mlp.experts.";
      w.add_raw(x + "gate_up_proj_blocks", "U8", {kExperts, 2 * kInter, kHidden / 32, 16}, L.gu_codes);
      w.add_raw(x + "gate_up_proj_scales", "U8", {kExperts, 2 * kInter, kHidden / 32}, L.gu_scales);
      w.add(x + "gate_up_proj_bias", DType::bf16, {kExperts, 2 * kInter}, std::vector<float>(L.gu_bias.begin(), L.gu_bias.end()));
      w.add_raw(x + "down_proj_blocks", "U8", {kExperts, kHidden, kInter / 32, 16}, L.dn_codes);
      w.add_raw(x + "down_proj_scales", "U8", {kExperts, kHidden, kInter / 32}, L.dn_scales);
      w.add(x + "down_proj_bias", DType::bf16, {kExperts, kHidden}, std::vector<float>(L.dn_bias.begin(), L.dn_bias.end()));
    }
    write_bytes_to_file(dir + "/model.safetensors", w.bytes());
    json types = json::array();
    for (int l = 0; l < kLayers; ++l) types.push_back(l % 2 ? "full_attention" : "sliding_attention");
    const json config = {
        {"architectures", {"GptOssForCausalLM"}}, {"model_type", "gpt_oss"}, {"num_hidden_layers", kLayers},
        {"hidden_size", kHidden}, {"head_dim", kHeadDim}, {"num_attention_heads", kHeads}, {"num_key_value_heads", kKvHeads},
        {"intermediate_size", kInter}, {"num_local_experts", kExperts}, {"num_experts_per_tok", kTopK},
        {"sliding_window", kWindow}, {"layer_types", types}, {"attention_bias", true}, {"rms_norm_eps", kEps},
        {"rope_theta", kTheta},
        {"rope_scaling", {{"rope_type", "yarn"}, {"factor", kYarnFactor}, {"beta_fast", kBetaFast}, {"beta_slow", kBetaSlow},
                          {"original_max_position_embeddings", kOriginalContext}, {"truncate", false}}},
        {"max_position_embeddings", 131072}, {"swiglu_limit", kLimit}, {"vocab_size", kVocab},
        {"tie_word_embeddings", false}, {"eos_token_id", 1}, {"pad_token_id", 0},
        {"quantization_config", {{"quant_method", "mxfp4"}}}};
    const std::string text = config.dump();
    write_bytes_to_file(dir + "/config.json", std::vector<uint8_t>(text.begin(), text.end()));
  }

  // ------------------------------------------------------------------ the reference forward pass

  static std::vector<double> rms_norm(const std::vector<double>& x, const Matrix& w) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + kEps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = w[i] * x[i] * r;
    return y;
  }
  static std::vector<double> linear(const Matrix& w, const Matrix& b, const std::vector<double>& x, size_t rows) {
    std::vector<double> y(rows);
    for (size_t r = 0; r < rows; ++r) {
      double s = b.empty() ? 0.0 : b[r];
      for (size_t c = 0; c < x.size(); ++c) s += w[r * x.size() + c] * x[c];
      y[r] = s;
    }
    return y;
  }
  // YaRN (truncate false): the correction range kept as floats; cos and sin scaled by 0.1 ln(factor) + 1.
  static void rope(std::vector<double>& head, int pos) {
    const int half = kHeadDim / 2;
    auto correction_dim = [](double rotations) {
      return kHeadDim * std::log(kOriginalContext / (rotations * 2 * std::numbers::pi)) / (2 * std::log(kTheta));
    };
    const double low = std::max(0.0, correction_dim(kBetaFast)), high = std::min(kHeadDim - 1.0, correction_dim(kBetaSlow));
    const double mscale = 0.1 * std::log(kYarnFactor) + 1.0;
    std::vector<double> out(head.size());
    for (int i = 0; i < half; ++i) {
      const double freq = std::pow(kTheta, 2.0 * i / kHeadDim);
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      const double extrapolate = 1.0 - ramp;  // share of the original frequency
      const double inv = (1.0 / (kYarnFactor * freq)) * (1.0 - extrapolate) + (1.0 / freq) * extrapolate;
      const double c = std::cos(pos * inv) * mscale, s = std::sin(pos * inv) * mscale;
      out[i] = head[i] * c - head[i + half] * s;
      out[i + half] = head[i + half] * c + head[i] * s;
    }
    head = out;
  }

  // Logits [tokens][vocab] of one sequence.
  std::vector<double> forward(const std::vector<int32_t>& tokens) const {
    const size_t n = tokens.size();
    std::vector<std::vector<double>> x(n);
    for (size_t t = 0; t < n; ++t) x[t].assign(embed.begin() + tokens[t] * kHidden, embed.begin() + (tokens[t] + 1) * kHidden);
    for (int l = 0; l < kLayers; ++l) {
      const Layer& L = layers[static_cast<size_t>(l)];
      const int window = l % 2 ? 0 : kWindow;
      std::vector<std::vector<double>> q(n), k(n), v(n);
      for (size_t t = 0; t < n; ++t) {
        const std::vector<double> h = rms_norm(x[t], L.attn_norm);
        q[t] = linear(L.wq, L.bq, h, kHeads * kHeadDim);
        k[t] = linear(L.wk, L.bk, h, kKvHeads * kHeadDim);
        v[t] = linear(L.wv, L.bv, h, kKvHeads * kHeadDim);
        for (int hd = 0; hd < kHeads; ++hd) {
          std::vector<double> head(q[t].begin() + hd * kHeadDim, q[t].begin() + (hd + 1) * kHeadDim);
          rope(head, static_cast<int>(t));
          std::copy(head.begin(), head.end(), q[t].begin() + hd * kHeadDim);
        }
        for (int hd = 0; hd < kKvHeads; ++hd) {
          std::vector<double> head(k[t].begin() + hd * kHeadDim, k[t].begin() + (hd + 1) * kHeadDim);
          rope(head, static_cast<int>(t));
          std::copy(head.begin(), head.end(), k[t].begin() + hd * kHeadDim);
        }
      }
      for (size_t t = 0; t < n; ++t) {
        std::vector<double> att(kHeads * kHeadDim, 0.0);
        for (int hd = 0; hd < kHeads; ++hd) {
          const int kv = hd / (kHeads / kKvHeads);
          std::vector<double> z;
          std::vector<size_t> keys;
          for (size_t j = 0; j <= t; ++j) {
            if (window > 0 && static_cast<int>(j) <= static_cast<int>(t) - window) continue;
            double s = 0;
            for (int d = 0; d < kHeadDim; ++d) s += q[t][hd * kHeadDim + d] * k[j][kv * kHeadDim + d];
            z.push_back(s / std::sqrt(static_cast<double>(kHeadDim)));
            keys.push_back(j);
          }
          const double m = std::max(*std::max_element(z.begin(), z.end()), L.sinks[hd]);
          double denom = std::exp(L.sinks[hd] - m);  // the sink: in the denominator only
          for (double s : z) denom += std::exp(s - m);
          for (size_t i = 0; i < z.size(); ++i) {
            const double p = std::exp(z[i] - m) / denom;
            for (int d = 0; d < kHeadDim; ++d) att[hd * kHeadDim + d] += p * v[keys[i]][kv * kHeadDim + d];
          }
        }
        const std::vector<double> o = linear(L.wo, L.bo, att, kHidden);
        for (int i = 0; i < kHidden; ++i) x[t][i] += o[i];
      }
      for (size_t t = 0; t < n; ++t) {
        const std::vector<double> h = rms_norm(x[t], L.moe_norm);
        const std::vector<double> r = linear(L.router, L.router_bias, h, kExperts);
        std::vector<int> order(kExperts);
        for (int e = 0; e < kExperts; ++e) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return r[a] > r[b]; });
        std::vector<int> chosen(order.begin(), order.begin() + kTopK);
        std::sort(chosen.begin(), chosen.end());
        double mr = -INFINITY, sum = 0;
        for (int e : chosen) mr = std::max(mr, r[e]);
        for (int e : chosen) sum += std::exp(r[e] - mr);
        for (int e : chosen) {
          const double weight = std::exp(r[e] - mr) / sum;
          std::vector<double> act(kInter);
          for (int i = 0; i < kInter; ++i) {
            double g = L.gu_bias[e * 2 * kInter + 2 * i], u = L.gu_bias[e * 2 * kInter + 2 * i + 1];
            for (int c = 0; c < kHidden; ++c) {
              g += mx(L.gu_codes, L.gu_scales, 2 * kInter, kHidden, e, 2 * i, c) * h[c];
              u += mx(L.gu_codes, L.gu_scales, 2 * kInter, kHidden, e, 2 * i + 1, c) * h[c];
            }
            g = std::min(g, kLimit);
            u = std::clamp(u, -kLimit, kLimit);
            act[i] = (u + 1) * g / (1 + std::exp(-kAlpha * g));
          }
          for (int o = 0; o < kHidden; ++o) {
            double y = L.dn_bias[e * kHidden + o];
            for (int i = 0; i < kInter; ++i) y += mx(L.dn_codes, L.dn_scales, kHidden, kInter, e, o, i) * act[i];
            x[t][o] += weight * y;
          }
        }
      }
    }
    std::vector<double> logits(n * kVocab);
    for (size_t t = 0; t < n; ++t) {
      const std::vector<double> row = linear(lm_head, {}, rms_norm(x[t], final_norm), kVocab);
      std::copy(row.begin(), row.end(), logits.begin() + static_cast<std::ptrdiff_t>(t * kVocab));
    }
    return logits;
  }
};

std::vector<int32_t> random_tokens(size_t n, uint64_t seed) { return testing_util::random_tokens(n, seed, kVocab); }
double worst_relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  return testing_util::worst_position_error(got, want, kVocab);
}

class GptOssModel : public testing::Test {
 protected:
  void SetUp() override { model_.write(dir_.path()); }
  testing_util::ScratchDir dir_{"gpt_oss"};
  TinyGptOss model_{77};
};

TEST_F(GptOssModel, MatchesTheDoubleReferencePromptAndDecode) {
  const std::vector<int32_t> tokens = random_tokens(19, 3);  // past the window of 5
  const std::vector<double> want = model_.forward(tokens);
  for (int threads : {1, 2}) {
    testing_util::CpuModel cpu(dir_.path(), threads);
    EXPECT_EQ(cpu.model->config().arch, ModelArch::gpt_oss);
    for (size_t chunk : {tokens.size(), size_t{1}, size_t{4}}) {
      auto engine = testing_util::dense_engine(*cpu.model, "f32");
      const std::vector<float> got = testing_util::feed_all(*engine, engine->add_sequence(), tokens, chunk);
      EXPECT_LE(worst_relative_error(got, want), 1e-4) << "chunks of " << chunk << ", " << threads << " threads";
    }
  }
}

// Each ingredient changes the logits: a reference without sinks, without the window or without YaRN's
// factor would be far off (so the match above checks them).
TEST_F(GptOssModel, SinksAndWindowMatter) {
  const std::vector<int32_t> tokens = random_tokens(19, 3);
  const std::vector<double> want = model_.forward(tokens);
  TinyGptOss no_sinks = model_;
  for (auto& L : no_sinks.layers) std::fill(L.sinks.begin(), L.sinks.end(), -1e30);
  TinyGptOss shifted = model_;  // the sinks' effect without removing them
  for (auto& L : shifted.layers)
    for (double& s : L.sinks) s += 2.0;
  std::vector<float> base(want.begin(), want.end());
  EXPECT_GT(worst_relative_error(base, no_sinks.forward(tokens)), 1e-2);
  EXPECT_GT(worst_relative_error(base, shifted.forward(tokens)), 1e-2);
}

// The same model read from the HF folder and from the GGUF written from it gives the same logits.
TEST_F(GptOssModel, GgufWrittenFromTheFolderGivesTheSameLogits) {
  const std::string gguf = dir_.file("model.gguf");
  {
    const ModelFiles hf = open_model(dir_.path());
    write_gpt_oss_gguf(hf, gguf);
  }
  const std::vector<int32_t> tokens = random_tokens(19, 4);
  testing_util::CpuModel from_hf(dir_.path(), 2), from_gguf(gguf, 2);
  EXPECT_EQ(from_gguf.model->config().arch, ModelArch::gpt_oss);
  auto a = testing_util::dense_engine(*from_hf.model, "f32"), b = testing_util::dense_engine(*from_gguf.model, "f32");
  const std::vector<float> la = testing_util::feed_all(*a, a->add_sequence(), tokens, 5);
  const std::vector<float> lb = testing_util::feed_all(*b, b->add_sequence(), tokens, 5);
  EXPECT_EQ(la, lb);
}

// Several sequences in one batch, with compressed caches on the full layer (the sliding layer keeps its
// rotating dense cache): the batch gives each sequence what it gets alone.
TEST_F(GptOssModel, BatchOfSequencesEqualsEachAlone) {
  testing_util::CpuModel cpu(dir_.path(), 2);
  EngineOptions o;
  o.kv.k_bits = 8;
  o.kv.v_bits = 4;
  o.kv.fused = true;
  o.kv.resolve();
  o.max_sequences = 3;
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(11, 5), random_tokens(3, 6), random_tokens(17, 7)};
  std::vector<std::vector<float>> alone;
  for (const auto& p : prompts) {
    Engine e(*cpu.model, o);
    alone.push_back(testing_util::feed_all(e, e.add_sequence(), p, p.size()));
  }
  Engine batch(*cpu.model, o);
  std::vector<BatchEntry> entries;
  for (const auto& p : prompts) entries.push_back({batch.add_sequence(), p, -1, Logits::all});
  const BatchOutput out = batch.forward(entries);
  const std::vector<float> logits = batch.logits();
  for (size_t b = 0; b < prompts.size(); ++b)
    for (size_t i = 0; i < prompts[b].size() * kVocab; ++i)
      ASSERT_NEAR(logits[static_cast<size_t>(out.first_row[b]) * kVocab + i], alone[b][i], 1e-4) << "sequence " << b;
  // The per-layer report: the sliding layer's rotating cache and the full layer's compressed one.
  const std::vector<LayerAttentionReport> report = batch.attention_report();
  ASSERT_EQ(report.size(), 2u);
  EXPECT_NE(report[0].cache.find("rotating"), std::string::npos) << report[0].cache;
  EXPECT_NE(report[1].cache.find("turboquant"), std::string::npos) << report[1].cache;
  EXPECT_GT(report[1].stats.fused, 0);
}

// --kv-swa-compress: the sliding layer's rotating cache is TurboQuant too, attended fused; past the window
// (its blocks given back) the logits stay close to the reference's, and without the flag that layer is dense.
// "Close" position by position: the router's top-k is discontinuous, so where two experts' logits nearly
// tie a small KV error can switch experts and move that position's logits far (positions 32 and 49 of
// this prompt do, with 8-bit K and V on the sliding layer; the dense run is exact there).
TEST_F(GptOssModel, SlidingLayersCompressedOnRequest) {
  testing_util::CpuModel cpu(dir_.path(), 2);
  const std::vector<int32_t> tokens = random_tokens(40, 9);
  const std::vector<double> want = model_.forward(tokens);
  for (bool swa : {false, true}) {
    EngineOptions o;
    o.kv = parse_kv_spec(swa ? "k8v8+fused+swa" : "k8v8+fused");
    o.kv.block_tokens = 8;  // blocks leave the window of 5 during the prompt
    Engine e(*cpu.model, o);
    const std::vector<float> got = testing_util::feed_all(e, e.add_sequence(), tokens, 3);
    int close = 0;
    for (size_t p = 0; p < tokens.size(); ++p) {
      const std::vector<float> g(got.begin() + static_cast<std::ptrdiff_t>(p * kVocab), got.begin() + static_cast<std::ptrdiff_t>((p + 1) * kVocab));
      const std::vector<double> w(want.begin() + static_cast<std::ptrdiff_t>(p * kVocab), want.begin() + static_cast<std::ptrdiff_t>((p + 1) * kVocab));
      close += worst_relative_error(g, w) <= 0.05;
    }
    EXPECT_GE(close, swa ? 36 : 40) << "of 40 positions within 5% (" << (swa ? "sliding layer compressed" : "dense") << ")";
    const std::vector<LayerAttentionReport> report = e.attention_report();
    EXPECT_NE(report[0].cache.find("rotating"), std::string::npos) << report[0].cache;
    EXPECT_EQ(report[0].cache.find("turboquant") != std::string::npos, swa) << report[0].cache;
    EXPECT_GT(report[0].stats.fused, 0);
    EXPECT_EQ(report[0].stats.standard, 0);
  }
  EXPECT_NE(parse_kv_spec("k8v3+fused+swa").describe().find("sliding-window layers compressed"), std::string::npos);
  testing_util::expect_error([] { parse_kv_spec("f16+swa"); }, {"--kv-swa-compress needs a compressed KV cache"});
}

}  // namespace
}  // namespace tq
