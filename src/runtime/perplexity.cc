#include "runtime/perplexity.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "core/parse.h"

namespace tq {
namespace {

// log-softmax of a row, in double: out[v] = x[v] - max - log(sum exp(x - max)).
void log_softmax(const float* x, int n, std::vector<double>& out) {
  out.resize(n);
  const double mx = *std::max_element(x, x + n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int i = 0; i < n; ++i) out[i] = x[i] - lse;
}

// Logits of every position of one window: [n][vocab], from a new sequence of `engine` (removed after).
void window_logits(Engine& engine, std::span<const int32_t> window, int chunk, std::vector<float>& logits) {
  const int n = static_cast<int>(window.size());
  const size_t V = static_cast<size_t>(engine.model().vocab_size());
  logits.resize(static_cast<size_t>(n) * V);
  const int seq = engine.add_sequence();
  for (int done = 0; done < n;) {
    const int m = std::min(chunk, n - done);
    const BatchEntry e{seq, window.subspan(static_cast<size_t>(done), static_cast<size_t>(m)), done, Logits::all};
    engine.forward({&e, 1});
    engine.read_logits(logits.data() + static_cast<size_t>(done) * V);
    done += m;
  }
  engine.remove_sequence(seq);
}

double bits_per_value(const KVSettings& kv, int head_dim) { return kv.bits_per_value(head_dim); }

}  // namespace

KVSettings parse_kv_spec(const std::string& spec) {
  KVSettings kv;
  std::stringstream ss(spec);
  std::string part;
  bool first = true;
  while (std::getline(ss, part, '+')) {
    if (first) {
      first = false;
      const size_t v_at = part.find('v');
      if (part == "f16" || part == "bf16" || part == "f32") {
        kv.k_type = kv.v_type = part;
      } else if (part.size() > 1 && part[0] == 'k' && v_at != std::string::npos && part.find('/') == std::string::npos) {
        kv.k_bits = parse_integer(std::string_view(part).substr(1, v_at - 1), "the K bits of '" + spec + "'");
        kv.v_bits = parse_integer(std::string_view(part).substr(v_at + 1), "the V bits of '" + spec + "'");
      } else if (const auto slash = part.find('/'); slash != std::string::npos) {
        kv.k_type = part.substr(0, slash);
        kv.v_type = part.substr(slash + 1);
      } else {
        fail("cannot read the KV configuration '", spec, "' (examples: k8v3, k8v3+mt128, q8_0/q4_0_rot, f16)");
      }
      continue;
    }
    const auto eq = part.find('=');
    const std::string key = part.substr(0, eq), value = eq == std::string::npos ? "" : part.substr(eq + 1);
    if (key.rfind("mt", 0) == 0 && eq == std::string::npos) {
      kv.min_tokens = parse_integer(std::string_view(key).substr(2), "the mt (min_tokens_before_quant) of '" + spec + "'");
    } else if (key == "mt") {
      kv.min_tokens = parse_integer(value, "the mt (min_tokens_before_quant) of '" + spec + "'");
    } else if (key == "g") {
      kv.group_size = parse_integer(value, "the g (group size) of '" + spec + "'");
    } else if (key == "fit") {
      kv.fit = value;
    } else if (key == "rot") {
      kv.rotation = value;
    } else if (key == "cb") {
      kv.codebook = value;
    } else if (key == "grid") {
      kv.grid = value;
    } else if (key == "fused") {
      kv.fused = true;
    } else if (key == "int8q") {  // the int8-query scorer, of the fused attention (implies fused)
      kv.query_int8 = true;
      kv.fused = true;
    } else if (key == "swa") {
      kv.swa_compress = true;
    } else if (key == "center") {
      kv.center = value;
    } else if (key == "cblock") {
      kv.center_tokens = parse_integer(value, "the cblock (centring run) of '" + spec + "'");
    } else if (key == "bt") {
      kv.block_tokens = parse_integer(value, "the bt (block size) of '" + spec + "'");
    } else {
      fail("unknown option '", part, "' in the KV configuration '", spec, "' (mt=N, g=N, fit=..., rot=..., cb=..., bt=N, center=none|k|v|kv, cblock=N, fused, int8q, swa)");
    }
  }
  kv.resolve();
  return kv;
}

std::vector<QualityReport> measure_quality(Model& model, std::span<const int32_t> tokens,
                                           const std::vector<std::pair<std::string, KVSettings>>& configs,
                                           const PerplexityOptions& options, const std::function<void(int, int)>& progress) {
  // One engine per configuration (and the FP16 baseline), built on first use; every window is a new sequence.
  std::map<std::string, std::unique_ptr<Engine>> engines;
  Model& base_model = options.base_model != nullptr ? *options.base_model : model;
  TQ_CHECK(base_model.vocab_size() == model.vocab_size(), "the base model's vocabulary (", base_model.vocab_size(),
           ") differs from the model's (", model.vocab_size(), ")");
  auto run = [&](std::span<const int32_t> window, const KVSettings& kv, int chunk, std::vector<float>& out,
                 bool base = false) {
    std::unique_ptr<Engine>& engine =
        engines[(base ? "base/" : "") + kv.describe() + "/bt" + std::to_string(kv.block_tokens)];
    if (!engine) {
      EngineOptions eo;
      eo.kv = kv;
      eo.ctx_size = static_cast<int64_t>(window.size());
      engine = std::make_unique<Engine>(base ? base_model : model, eo);
    }
    window_logits(*engine, window, chunk, out);
  };
  TQ_CHECK(options.ctx >= 2, "--ctx must be at least 2");
  TQ_CHECK(options.ctx <= model.config().max_position_embeddings, "--ctx ", options.ctx, " exceeds the model's context of ",
           model.config().max_position_embeddings);
  TQ_CHECK(options.chunk >= 1, "the chunk size must be positive");
  const int available = static_cast<int>(tokens.size()) / options.ctx;
  TQ_CHECK(available >= 1, "the text has ", tokens.size(), " tokens, fewer than one window of ", options.ctx);
  const int windows = options.chunks > 0 ? std::min(options.chunks, available) : available;
  TQ_CHECK(options.chunks <= available, "--chunks ", options.chunks, " asks for more windows than the text has (", available, ")");
  const int V = static_cast<int>(model.vocab_size());

  std::vector<QualityReport> reports(configs.size());
  std::vector<double> nll(configs.size(), 0.0), nll_base_sum(1, 0.0);
  std::vector<std::vector<double>> klds(configs.size());
  std::vector<int64_t> same(configs.size(), 0);
  int64_t scored = 0;
  KVSettings base_kv;
  base_kv.resolve();
  std::vector<float> base_logits, logits;
  std::vector<double> lp_base, lp;

  for (int w = 0; w < windows; ++w) {
    const auto window = tokens.subspan(static_cast<size_t>(w) * options.ctx, options.ctx);
    if (options.kl_divergence) {
      run(window, base_kv, options.chunk, base_logits, true);
      for (int i = 0; i + 1 < options.ctx; ++i) {
        log_softmax(base_logits.data() + static_cast<size_t>(i) * V, V, lp_base);
        nll_base_sum[0] -= lp_base[window[i + 1]];
      }
    }
    for (size_t c = 0; c < configs.size(); ++c) {
      run(window, configs[c].second, options.chunk, logits);
      for (int i = 0; i + 1 < options.ctx; ++i) {
        const float* row = logits.data() + static_cast<size_t>(i) * V;
        log_softmax(row, V, lp);
        nll[c] -= lp[window[i + 1]];
        if (options.kl_divergence) {
          const float* brow = base_logits.data() + static_cast<size_t>(i) * V;
          log_softmax(brow, V, lp_base);
          double kl = 0;
          for (int v = 0; v < V; ++v) kl += std::exp(lp_base[v]) * (lp_base[v] - lp[v]);
          klds[c].push_back(std::max(kl, 0.0));
          same[c] += std::max_element(row, row + V) - row == std::max_element(brow, brow + V) - brow;
        }
      }
    }
    scored += options.ctx - 1;
    if (progress) progress(w + 1, windows);
  }
  for (size_t c = 0; c < configs.size(); ++c) {
    QualityReport& r = reports[c];
    r.name = configs[c].first;
    r.kv = configs[c].second;
    r.windows = windows;
    r.scored = scored;
    r.ppl = std::exp(nll[c] / static_cast<double>(scored));
    r.bits_per_value = bits_per_value(r.kv, static_cast<int>(model.config().head_dim));
    if (options.kl_divergence) {
      r.ppl_base = std::exp(nll_base_sum[0] / static_cast<double>(scored));
      auto& k = klds[c];
      double sum = 0;
      for (double x : k) sum += x;
      r.kld_mean = sum / static_cast<double>(k.size());
      std::sort(k.begin(), k.end());
      r.kld_p99 = k[std::min(k.size() - 1, static_cast<size_t>(0.99 * static_cast<double>(k.size())))];
      r.kld_max = k.back();
      r.top1_same = static_cast<double>(same[c]) / static_cast<double>(k.size());
    }
  }
  return reports;
}

}  // namespace tq
