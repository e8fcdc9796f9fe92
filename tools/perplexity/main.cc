// turboquant-perplexity: perplexity of a text with a (compressed) KV cache, and with --kl-divergence
// the KL divergence of its next-token distributions from the FP16 cache's, like
// llama-perplexity --kl-divergence.
//
//   turboquant-perplexity --model DIR --file text.txt --ctx 1024 --chunks 32 --kv-k-bits 8 --kv-v-bits 3 --kl-divergence
//   ... --compare k8v4 --compare q8_0_rot/q4_0_rot      (more configurations, one baseline pass)
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "device_flags.h"
#include "kv_flags.h"
#include "runtime/generate.h"
#include "runtime/perplexity.h"

int main(int argc, char** argv) {
  using namespace tq;
  CLI::App app{"turboquant-perplexity: perplexity and KL divergence of compressed KV caches"};
  std::string model_path, file;
  PerplexityOptions po;
  int threads = 2;
  bool json = false, add_bos = false;
  std::vector<std::string> compare;
  KVSettings kv;
  app.add_option("--model", model_path, "model folder or .gguf")->required();
  app.add_option("--file", file, "text file")->required()->check(CLI::ExistingFile);
  app.add_option("--ctx", po.ctx, "tokens per window")->check(CLI::Range(2, 1 << 20));
  app.add_option("--chunks", po.chunks, "windows to score (0: all)")->check(CLI::Range(0, 1 << 30));
  app.add_option("--batch", po.chunk, "tokens per forward pass inside a window")->check(CLI::Range(1, 1 << 20));
  app.add_flag("--kl-divergence", po.kl_divergence, "also run the FP16 cache and report KL divergence");
  app.add_flag("--add-bos", add_bos, "encode the text with the tokenizer's BOS (default: without)");
  app.add_option("--compare", compare, "more KV configurations, e.g. k8v4, k8v3+mt128, q8_0/q4_0_rot")->take_all();
  app.add_option("--threads", threads, "threads")->check(CLI::Range(1, 256));
  std::string base_model_path;
  app.add_option("--base-model", base_model_path,
                 "with --kl-divergence: the baseline is this model (FP16 cache), e.g. the BF16 source of a quantized model");
  cli::DeviceFlags device_flags;
  cli::add_device_flags(app, device_flags);
  app.add_flag("--json", json, "print JSON (an object, or an array with --compare)");
  cli::add_kv_flags(app, kv);
  CLI11_PARSE(app, argc, argv);
  try {
    kv.resolve();
    const std::unique_ptr<Device> device = cli::make_device(device_flags, threads, "turboquant-perplexity");
    const auto model = Model::open(model_path, *device);
    std::unique_ptr<Model> base_model;
    if (!base_model_path.empty()) {
      TQ_CHECK(po.kl_divergence, "--base-model needs --kl-divergence");
      base_model = Model::open(base_model_path, *device);
      po.base_model = base_model.get();
    }
    const auto tok = load_model_tokenizer(model->files());
    std::ifstream in(file, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    EncodeOptions eo;
    eo.add_special_tokens = add_bos;
    const auto tokens = tok->encode(text.str(), eo);
    std::vector<std::pair<std::string, KVSettings>> configs = {{kv.describe(), kv}};
    for (const auto& c : compare) configs.emplace_back(c, parse_kv_spec(c));
    const bool tty = isatty(fileno(stderr));
    std::fprintf(stderr, "%s: %zu tokens, %s windows of %d, prompt chunks of %d tokens; every position at or after "
                 "--kv-min-tokens is read back from the compressed tier (also inside its own chunk)\n",
                 file.c_str(), tokens.size(), po.chunks ? std::to_string(po.chunks).c_str() : "all", po.ctx, po.chunk);
    const auto reports = measure_quality(*model, tokens, configs, po, [&](int done, int total) {
      if (tty) std::fprintf(stderr, "\r[%-30s] window %d/%d", std::string(30 * done / total, '#').c_str(), done, total);
    });
    if (tty) std::fprintf(stderr, "\n");
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : reports) {
      nlohmann::json j = {{"name", r.name}, {"kv", r.kv.describe()}, {"ppl", r.ppl}, {"bits_per_value", r.bits_per_value},
                          {"k_bits", r.kv.effective_k_bits()}, {"v_bits", r.kv.effective_v_bits()},
                          {"k_type", r.kv.resolved_k_type()}, {"v_type", r.kv.resolved_v_type()},
                          {"min_tokens", r.kv.min_tokens}, {"chunks", r.windows}, {"ctx", po.ctx}, {"scored", r.scored},
                          {"mode", "prompt chunks of " + std::to_string(po.chunk) + ", all positions read from the cache"}};
      if (po.kl_divergence) {
        j["ppl_base"] = r.ppl_base;
        j["delta_ppl"] = r.ppl - r.ppl_base;
        j["kld_mean"] = r.kld_mean;
        j["kld_p99"] = r.kld_p99;
        j["kld_max"] = r.kld_max;
        j["top1_same"] = r.top1_same;
      }
      out.push_back(j);
    }
    if (json) {
      std::cout << (compare.empty() ? out[0] : out).dump(1) << "\n";
      return 0;
    }
    for (const auto& j : out) {
      std::printf("%s (%.3f bits/value): perplexity %.4f", j["kv"].get<std::string>().c_str(), j["bits_per_value"].get<double>(),
                  j["ppl"].get<double>());
      if (po.kl_divergence) {
        std::printf(", FP16 %.4f (delta %+.4f), KLD mean %.6f p99 %.6f max %.6f, top-1 same %.2f%%", j["ppl_base"].get<double>(),
                    j["delta_ppl"].get<double>(), j["kld_mean"].get<double>(), j["kld_p99"].get<double>(),
                    j["kld_max"].get<double>(), 100 * j["top1_same"].get<double>());
      }
      std::printf("\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "turboquant-perplexity: error: %s\n", e.what());
    return 1;
  }
}
