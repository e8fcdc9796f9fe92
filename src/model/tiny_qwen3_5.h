// A tiny random Qwen3.5 hybrid (Gated DeltaNet and gated attention layers) for the tests: its weights, its
// files (safetensors and config.json, written into a folder the engine opens) and a reference forward pass
// written from the equations of model/qwen3_5.h (the attention layer, the norms and the MLP in double
// precision, the Gated DeltaNet by ops::ref). Used by model/qwen3_5_model_test.cc (against the reference)
// and by the runtime's tests of snapshots and prompt-cache files (a hybrid model to run).
#pragma once

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/writer.h"
#include "ops/reference.h"

namespace tq::testing_util::tiny_qwen3_5 {

// Layers [linear, linear, linear, full]; 4 query heads and 2 KV heads of 32 (8 rotated dims); the DeltaNet
// with 2 key heads and 4 value heads of 16 (each key head shared by 2 value heads).
constexpr int kLayers = 4, kHidden = 64, kHeads = 4, kKv = 2, kHd = 32, kRot = 8, kInter = 96, kVocab = 48;
constexpr int kHk = 2, kHv = 4, kDk = 16, kDv = 16, kConvK = 4;
constexpr int kKeyW = kHk * kDk, kValW = kHv * kDv, kConvW = 2 * kKeyW + kValW;
constexpr double kTheta = 10000000.0, kEps = 1e-6;
// The MoE variant: 4 experts of 32 top-2 and a shared expert of 48.
constexpr int kExperts = 4, kTopK = 2, kExpertI = 32, kSharedI = 48;

inline bool is_linear(int l) { return (l + 1) % 4 != 0; }

struct TinyQwen35 {
  using Matrix = std::vector<float>;  // values exact in F32 (the file's dtype)
  struct Layer {
    Matrix attn_norm, ffn_norm;               // [H] zero-centred (applied as 1 + w)
    Matrix wq, wk, wv, wo, q_norm, k_norm;    // full attention: wq [heads * 2 hd][H] (query, gate per head)
    Matrix w_qkv, w_z, w_b, w_a, conv, a_log, dt_bias, out_norm, w_out;  // DeltaNet
    Matrix w_gate, w_up, w_down;        // dense MLP, or the shared expert's (MoE)
    Matrix router, experts_gate_up, experts_down, shared_gate_w;  // MoE: [E][H], [E][2I][H], [E][H][I], [1][H]
  };
  Matrix embed, lm_head, final_norm;
  std::vector<Layer> layers;
  bool moe = false;

  explicit TinyQwen35(uint64_t seed, bool with_experts = false) : moe(with_experts) {
    SplitMix64 rng(seed);
    auto normal = [&](size_t n, double scale, double base = 0) {
      Matrix m(n);
      for (float& v : m) v = static_cast<float>(base + scale * rng.normal());
      return m;
    };
    const double s = 1.0 / std::sqrt(kHidden);
    embed = normal(kVocab * kHidden, 1.0);
    lm_head = normal(kVocab * kHidden, s);
    final_norm = normal(kHidden, 0.2);
    for (int l = 0; l < kLayers; ++l) {
      Layer L;
      L.attn_norm = normal(kHidden, 0.2);
      L.ffn_norm = normal(kHidden, 0.2);
      if (is_linear(l)) {
        L.w_qkv = normal(kConvW * kHidden, s);
        L.w_z = normal(kValW * kHidden, s);
        L.w_b = normal(kHv * kHidden, s);
        L.w_a = normal(kHv * kHidden, s);
        L.conv = normal(kConvW * kConvK, 0.5);
        L.a_log = Matrix(kHv);
        for (float& v : L.a_log) v = static_cast<float>(std::log(0.5 + 7.5 * (rng.next() % 1000) / 1000.0));
        L.dt_bias = normal(kHv, 0.5);
        L.out_norm = normal(kDv, 0.2, 1.0);
        L.w_out = normal(kHidden * kValW, 1.0 / std::sqrt(kValW));
      } else {
        L.wq = normal(kHeads * 2 * kHd * kHidden, s);
        L.wk = normal(kKv * kHd * kHidden, s);
        L.wv = normal(kKv * kHd * kHidden, s);
        L.wo = normal(kHidden * kHeads * kHd, 1.0 / std::sqrt(kHeads * kHd));
        L.q_norm = normal(kHd, 0.2);
        L.k_norm = normal(kHd, 0.2);
      }
      const int inter = moe ? kSharedI : kInter;
      L.w_gate = normal(inter * kHidden, s);
      L.w_up = normal(inter * kHidden, s);
      L.w_down = normal(kHidden * inter, 1.0 / std::sqrt(inter));
      if (moe) {
        L.router = normal(kExperts * kHidden, 2.0 * s);
        L.experts_gate_up = normal(static_cast<size_t>(kExperts) * 2 * kExpertI * kHidden, s);
        L.experts_down = normal(static_cast<size_t>(kExperts) * kHidden * kExpertI, 1.0 / std::sqrt(kExpertI));
        L.shared_gate_w = normal(kHidden, s);
      }
      layers.push_back(std::move(L));
    }
  }

  void write(const std::string& dir) const {
    using json = nlohmann::json;
    SafetensorsWriter w;
    auto add = [&](const std::string& name, std::vector<int64_t> shape, const Matrix& m) { w.add(name, DType::f32, std::move(shape), m); };
    add("model.embed_tokens.weight", {kVocab, kHidden}, embed);
    add("lm_head.weight", {kVocab, kHidden}, lm_head);
    add("model.norm.weight", {kHidden}, final_norm);
    for (int l = 0; l < kLayers; ++l) {
      const Layer& L = layers[static_cast<size_t>(l)];
      const std::string p = "model.layers." + std::to_string(l) + ".";
      add(p + "input_layernorm.weight", {kHidden}, L.attn_norm);
      add(p + "post_attention_layernorm.weight", {kHidden}, L.ffn_norm);
      if (is_linear(l)) {
        const std::string a = p + "linear_attn.";
        add(a + "in_proj_qkv.weight", {kConvW, kHidden}, L.w_qkv);
        add(a + "in_proj_z.weight", {kValW, kHidden}, L.w_z);
        add(a + "in_proj_b.weight", {kHv, kHidden}, L.w_b);
        add(a + "in_proj_a.weight", {kHv, kHidden}, L.w_a);
        add(a + "conv1d.weight", {kConvW, 1, kConvK}, L.conv);
        add(a + "A_log", {kHv}, L.a_log);
        add(a + "dt_bias", {kHv}, L.dt_bias);
        add(a + "norm.weight", {kDv}, L.out_norm);
        add(a + "out_proj.weight", {kHidden, kValW}, L.w_out);
      } else {
        const std::string a = p + "self_attn.";
        add(a + "q_proj.weight", {kHeads * 2 * kHd, kHidden}, L.wq);
        add(a + "k_proj.weight", {kKv * kHd, kHidden}, L.wk);
        add(a + "v_proj.weight", {kKv * kHd, kHidden}, L.wv);
        add(a + "o_proj.weight", {kHidden, kHeads * kHd}, L.wo);
        add(a + "q_norm.weight", {kHd}, L.q_norm);
        add(a + "k_norm.weight", {kHd}, L.k_norm);
      }
      if (moe) {
        add(p + "mlp.gate.weight", {kExperts, kHidden}, L.router);
        add(p + "mlp.experts.gate_up_proj", {kExperts, 2 * kExpertI, kHidden}, L.experts_gate_up);
        add(p + "mlp.experts.down_proj", {kExperts, kHidden, kExpertI}, L.experts_down);
        add(p + "mlp.shared_expert.gate_proj.weight", {kSharedI, kHidden}, L.w_gate);
        add(p + "mlp.shared_expert.up_proj.weight", {kSharedI, kHidden}, L.w_up);
        add(p + "mlp.shared_expert.down_proj.weight", {kHidden, kSharedI}, L.w_down);
        add(p + "mlp.shared_expert_gate.weight", {1, kHidden}, L.shared_gate_w);
      } else {
        add(p + "mlp.gate_proj.weight", {kInter, kHidden}, L.w_gate);
        add(p + "mlp.up_proj.weight", {kInter, kHidden}, L.w_up);
        add(p + "mlp.down_proj.weight", {kHidden, kInter}, L.w_down);
      }
    }
    write_bytes_to_file(dir + "/model.safetensors", w.bytes());
    json types = json::array();
    for (int l = 0; l < kLayers; ++l) types.push_back(is_linear(l) ? "linear_attention" : "full_attention");
    json config = {{"architectures", {moe ? "Qwen3_5MoeForCausalLM" : "Qwen3_5ForCausalLM"}},
                         {"model_type", moe ? "qwen3_5_moe_text" : "qwen3_5_text"}, {"num_hidden_layers", kLayers},
                         {"hidden_size", kHidden}, {"intermediate_size", kInter}, {"num_attention_heads", kHeads},
                         {"num_key_value_heads", kKv}, {"head_dim", kHd}, {"layer_types", types}, {"attn_output_gate", true},
                         {"linear_num_key_heads", kHk}, {"linear_num_value_heads", kHv}, {"linear_key_head_dim", kDk},
                         {"linear_value_head_dim", kDv}, {"linear_conv_kernel_dim", kConvK}, {"rms_norm_eps", kEps},
                         {"vocab_size", kVocab}, {"tie_word_embeddings", false}, {"eos_token_id", 2},
                         {"max_position_embeddings", 4096},
                         {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", kTheta}, {"partial_rotary_factor", 0.25}}}};
    if (moe) {
      config.erase("intermediate_size");
      config["num_experts"] = kExperts;
      config["num_experts_per_tok"] = kTopK;
      config["moe_intermediate_size"] = kExpertI;
      config["shared_expert_intermediate_size"] = kSharedI;
    }
    const std::string text = config.dump();
    write_bytes_to_file(dir + "/config.json", std::vector<uint8_t>(text.begin(), text.end()));
  }

  // ------------------------------------------------------------------ the reference forward pass

  using Vec = std::vector<double>;
  static Vec rms_norm(const Vec& x, const Matrix& w, bool zero_centred) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + kEps);
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = (zero_centred ? 1.0 + w[i % w.size()] : w[i % w.size()]) * x[i] * r;
    return y;
  }
  static Vec linear(const Matrix& w, const Vec& x, size_t rows) {
    Vec y(rows, 0.0);
    for (size_t r = 0; r < rows; ++r)
      for (size_t c = 0; c < x.size(); ++c) y[r] += static_cast<double>(w[r * x.size() + c]) * x[c];
    return y;
  }
  // Rotate-half RoPE on the first kRot dims of a head.
  static void rope(double* head, int pos) {
    const int half = kRot / 2;
    for (int i = 0; i < half; ++i) {
      const double inv = 1.0 / std::pow(kTheta, 2.0 * i / kRot);
      const double c = std::cos(pos * inv), s = std::sin(pos * inv);
      const double x1 = head[i], x2 = head[i + half];
      head[i] = x1 * c - x2 * s;
      head[i + half] = x2 * c + x1 * s;
    }
  }

  std::vector<double> forward(const std::vector<int32_t>& tokens) const {
    const size_t n = tokens.size();
    std::vector<Vec> x(n);
    for (size_t t = 0; t < n; ++t) x[t].assign(embed.begin() + tokens[t] * kHidden, embed.begin() + (tokens[t] + 1) * kHidden);
    for (int l = 0; l < kLayers; ++l) {
      const Layer& L = layers[static_cast<size_t>(l)];
      std::vector<Vec> h(n);
      for (size_t t = 0; t < n; ++t) h[t] = rms_norm(x[t], L.attn_norm, true);
      if (is_linear(l)) {
        // Projections, then the DeltaNet pieces through ops::ref (float in and out, double inside).
        std::vector<float> qkv(n * kConvW), z(n * kValW), b(n * kHv), a(n * kHv), mixed(n * kConvW), o(n * kValW), y(n * kValW);
        for (size_t t = 0; t < n; ++t) {
          const Vec p = linear(L.w_qkv, h[t], kConvW), pz = linear(L.w_z, h[t], kValW), pb = linear(L.w_b, h[t], kHv),
                    pa = linear(L.w_a, h[t], kHv);
          for (int i = 0; i < kConvW; ++i) qkv[t * kConvW + i] = static_cast<float>(p[i]);
          for (int i = 0; i < kValW; ++i) z[t * kValW + i] = static_cast<float>(pz[i]);
          for (int i = 0; i < kHv; ++i) {
            b[t * kHv + i] = static_cast<float>(pb[i]);
            a[t * kHv + i] = static_cast<float>(pa[i]);
          }
        }
        std::vector<float> conv_state(kConvW * (kConvK - 1), 0.0f), state(kHv * kDk * kDv, 0.0f);
        ops::ref::causal_conv1d_silu(qkv.data(), n, kConvW, kConvK, L.conv.data(), conv_state.data(), mixed.data());
        ops::ref::gated_delta_rule(mixed.data(), a.data(), b.data(), L.a_log.data(), L.dt_bias.data(), n, kHk, kHv, kDk, kDv,
                                   state.data(), o.data());
        for (size_t t = 0; t < n; ++t)
          for (int hv = 0; hv < kHv; ++hv) {
            const size_t at = t * kValW + static_cast<size_t>(hv) * kDv;
            ops::ref::gated_rms_norm(o.data() + at, z.data() + at, L.out_norm.data(), static_cast<float>(kEps), kDv, y.data() + at);
          }
        for (size_t t = 0; t < n; ++t) {
          const Vec yt(y.begin() + static_cast<std::ptrdiff_t>(t * kValW), y.begin() + static_cast<std::ptrdiff_t>((t + 1) * kValW));
          const Vec out = linear(L.w_out, yt, kHidden);
          for (int i = 0; i < kHidden; ++i) x[t][i] += out[i];
        }
      } else {
        std::vector<Vec> q(n), gate(n), k(n), v(n);
        for (size_t t = 0; t < n; ++t) {
          const Vec qg = linear(L.wq, h[t], kHeads * 2 * kHd);
          q[t].resize(kHeads * kHd);
          gate[t].resize(kHeads * kHd);
          for (int hd = 0; hd < kHeads; ++hd)
            for (int d = 0; d < kHd; ++d) {
              q[t][hd * kHd + d] = qg[hd * 2 * kHd + d];
              gate[t][hd * kHd + d] = qg[hd * 2 * kHd + kHd + d];
            }
          k[t] = linear(L.wk, h[t], kKv * kHd);
          v[t] = linear(L.wv, h[t], kKv * kHd);
          for (int hd = 0; hd < kHeads; ++hd) {
            const Vec head(q[t].begin() + hd * kHd, q[t].begin() + (hd + 1) * kHd);
            Vec normed = rms_norm(head, L.q_norm, true);
            rope(normed.data(), static_cast<int>(t));
            std::copy(normed.begin(), normed.end(), q[t].begin() + hd * kHd);
          }
          for (int hd = 0; hd < kKv; ++hd) {
            const Vec head(k[t].begin() + hd * kHd, k[t].begin() + (hd + 1) * kHd);
            Vec normed = rms_norm(head, L.k_norm, true);
            rope(normed.data(), static_cast<int>(t));
            std::copy(normed.begin(), normed.end(), k[t].begin() + hd * kHd);
          }
        }
        for (size_t t = 0; t < n; ++t) {
          Vec att(kHeads * kHd, 0.0);
          for (int hd = 0; hd < kHeads; ++hd) {
            const int kv = hd / (kHeads / kKv);
            std::vector<double> s(t + 1);
            for (size_t j = 0; j <= t; ++j) {
              double dot = 0;
              for (int d = 0; d < kHd; ++d) dot += q[t][hd * kHd + d] * k[j][kv * kHd + d];
              s[j] = dot / std::sqrt(static_cast<double>(kHd));
            }
            const double m = *std::max_element(s.begin(), s.end());
            double sum = 0;
            for (double& e : s) sum += (e = std::exp(e - m));
            for (size_t j = 0; j <= t; ++j)
              for (int d = 0; d < kHd; ++d) att[hd * kHd + d] += s[j] / sum * v[j][kv * kHd + d];
          }
          for (int i = 0; i < kHeads * kHd; ++i) att[i] *= 1.0 / (1.0 + std::exp(-gate[t][i]));
          const Vec out = linear(L.wo, att, kHidden);
          for (int i = 0; i < kHidden; ++i) x[t][i] += out[i];
        }
      }
      const int inter = moe ? kSharedI : kInter;
      for (size_t t = 0; t < n; ++t) {
        const Vec hm = rms_norm(x[t], L.ffn_norm, true);
        const Vec g = linear(L.w_gate, hm, inter), u = linear(L.w_up, hm, inter);
        Vec act(inter);
        for (int i = 0; i < inter; ++i) act[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
        Vec out = linear(L.w_down, act, kHidden);
        if (moe) {
          // The shared expert's gate, then softmax over all experts, the top-k renormalised.
          const double sg = 1.0 / (1.0 + std::exp(-linear(L.shared_gate_w, hm, 1)[0]));
          for (double& o : out) o *= sg;
          const Vec r = linear(L.router, hm, kExperts);
          std::vector<int> order(kExperts);
          for (int e = 0; e < kExperts; ++e) order[e] = e;
          std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return r[a] > r[b]; });
          const double mr = r[order[0]];
          double all = 0, chosen = 0;
          for (int e = 0; e < kExperts; ++e) all += std::exp(r[e] - mr);
          for (int k = 0; k < kTopK; ++k) chosen += std::exp(r[order[k]] - mr) / all;
          for (int k = 0; k < kTopK; ++k) {
            const int e = order[k];
            const double weight = std::exp(r[e] - mr) / all / chosen;
            Vec ea(kExpertI);
            for (int i = 0; i < kExpertI; ++i) {
              double ge = 0, ue = 0;
              for (int c = 0; c < kHidden; ++c) {
                ge += L.experts_gate_up[(static_cast<size_t>(e) * 2 * kExpertI + i) * kHidden + c] * hm[c];
                ue += L.experts_gate_up[(static_cast<size_t>(e) * 2 * kExpertI + kExpertI + i) * kHidden + c] * hm[c];
              }
              ea[i] = ge / (1.0 + std::exp(-ge)) * ue;
            }
            for (int o = 0; o < kHidden; ++o) {
              double y = 0;
              for (int i = 0; i < kExpertI; ++i) y += L.experts_down[(static_cast<size_t>(e) * kHidden + o) * kExpertI + i] * ea[i];
              out[o] += weight * y;
            }
          }
        }
        for (int i = 0; i < kHidden; ++i) x[t][i] += out[i];
      }
    }
    std::vector<double> logits(n * kVocab);
    for (size_t t = 0; t < n; ++t) {
      const Vec row = linear(lm_head, rms_norm(x[t], final_norm, true), kVocab);
      std::copy(row.begin(), row.end(), logits.begin() + static_cast<std::ptrdiff_t>(t * kVocab));
    }
    return logits;
  }
};

}  // namespace tq::testing_util::tiny_qwen3_5
