// turboquant-bench: benchmarks that compare methods side by side in one process.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <map>

#include <hwy/targets.h>

#include "attn/kernels.h"
#include "bench.h"
#include "core/error.h"
#include "core/parse.h"

namespace tq::bench {
std::string select_simd(const std::string& which) {
  int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  if (which == "avx2") {
    int64_t avx512 = HWY_AVX3 | HWY_AVX3_DL;
#ifdef HWY_AVX3_ZEN4
    avx512 |= HWY_AVX3_ZEN4;
#endif
#ifdef HWY_AVX3_SPR
    avx512 |= HWY_AVX3_SPR;
#endif
    targets &= ~avx512;
    TQ_CHECK((targets & HWY_AVX2) != 0, "--simd avx2: this CPU has no AVX2");
    // Not DisableTargets: Highway's SupportedTargets() detects the CPU again on every call and resets the
    // dispatch to everything it found, so a later call would undo it; a fixed target set stays.
    hwy::SetSupportedTargetsForTest(targets);
  }
  // What the kernels dispatch to, asked of them: the target set above, or the best one.
  return tq::attn_kernels::kernel_target();
}
}  // namespace tq::bench

int main(int argc, char** argv) {
  using namespace tq::bench;
  CLI::App app{"turboquant-bench: side-by-side benchmarks (Markdown tables, or JSON with --json)"};
  app.require_subcommand(1);

  CodecArgs codec;
  std::string fit = "plain", rotation = "dim", codebook = "gaussian";
  auto* c = app.add_subcommand("codec", "group quantizer distortion vs Lloyd-Max theory, q8_0/q4_0 baselines, throughput");
  c->add_option("--bits", codec.bits, "bit widths (1..8)")->delimiter(',')->check(CLI::Range(1, 8));
  c->add_option("--dims", codec.dims, "vector lengths")->delimiter(',')->check(CLI::Range(1, 1 << 20));
  c->add_option("--data", codec.data, "gaussian and/or outliers")->delimiter(',')->check(CLI::IsMember({"gaussian", "outliers"}));
  c->add_option("--group-size", codec.group_size, "values per scale")->check(CLI::Range(1, 1 << 20));
  c->add_option("--fit", fit, "scale fit")->check(CLI::IsMember({"plain", "norm_correction", "least_squares"}));
  c->add_option("--rotation-block", rotation, "rotation block: dim or group")->check(CLI::IsMember({"dim", "group", "none"}));
  c->add_option("--codebook", codebook, "gaussian or sphere (exact marginal in the group's dimension)")
      ->check(CLI::IsMember({"gaussian", "sphere"}));
  c->add_option("--floats", codec.floats, "floats per (data, dim) test set")->check(CLI::Range(4096, 1 << 26));
  c->add_flag("--json", codec.json, "print a JSON array instead of a Markdown table");

  AttentionArgs attn;
  std::vector<std::string> kv_pairs = {"8,3", "4,4"};
  bool no_standard = false;
  auto* at = app.add_subcommand("attention", "one layer's decode step: dense FP16, standard and fused TurboQuant, q8_0/q4_0");
  at->add_option("--context", attn.contexts, "context lengths")->delimiter(',')->check(CLI::Range(1, 1 << 22));
  at->add_option("--threads", attn.threads, "thread counts (1 or 2)")->delimiter(',')->check(CLI::Range(1, 2));
  at->add_option("--heads", attn.n_heads, "query heads")->check(CLI::Range(1, 1024));
  at->add_option("--kv-heads", attn.n_kv, "KV heads")->check(CLI::Range(1, 1024));
  at->add_option("--head-dim", attn.dim, "head dimension")->check(CLI::Range(1, 16384));
  at->add_option("--group-size", attn.group_size, "TurboQuant group size (32, 64, 128)");
  at->add_option("--block-tokens", attn.block_tokens, "positions per cache block (a multiple of 16)")->check(CLI::Range(1, 4096));
  at->add_option("--kv", kv_pairs, "TurboQuant K,V bit pairs, e.g. --kv 8,3 --kv 4,4")->expected(1, 16);
  bool warm = false;
  at->add_flag("--warm", warm,
               "every step attends to the same cache (which the last-level cache then partly holds); by default "
               "steps cycle through copies of the cache larger than 256 MiB in all, so that each reads its cache "
               "from memory as a model's decode step does");
  at->add_flag("--no-standard", no_standard, "skip the (slow) standard path");
  at->add_option("--center", attn.centers, "TurboQuant block-mean centring, one method each: none, k, v, kv (e.g. none,k)")
      ->delimiter(',')
      ->check(CLI::IsMember({"none", "k", "v", "kv"}));
  at->add_option("--center-block", attn.center_tokens, "positions per centring mean (0: the block size)");
  at->add_flag("--fastest-call", attn.fastest_call,
               "time each method by its fastest single step (a shared machine: the steps no other process preempted)");
  at->add_option("--methods", attn.methods, "subset of dense_f16,fused,fused_int8 (the int8-query scorer),standard,q8_0,q4_0")
      ->delimiter(',')
      ->check(CLI::IsMember({"dense_f16", "fused", "fused_int8", "standard", "q8_0", "q4_0"}));
  at->add_option("--min-seconds", attn.min_seconds, "time per measurement round")->check(CLI::Range(0.0, 60.0));
  at->add_flag("--json", attn.json, "print a JSON array instead of a Markdown table");
  std::string simd = "best";
  const auto simd_help = "SIMD target of the kernels: best (what this CPU has) or avx2 (AVX-512 off, the path of CPUs without it)";
  at->add_option("--simd", simd, simd_help)->check(CLI::IsMember({"best", "avx2"}));

  ModelBenchArgs mb;
  bool mb_no_standard = false;
  auto* mo = app.add_subcommand("model", "llama-bench style: prompt processing and generation at depth, per KV configuration");
  mo->add_option("-m,--model", mb.model, "model folder or .gguf")->required();
  mo->add_option("-p,--prompt", mb.prompt, "prompt tokens per pp test (0: none)")->check(CLI::Range(0, 1 << 22));
  mo->add_option("--ubatch", mb.ubatch,
                 "prompt tokens per forward pass, for the pp test and the fill to the depth (0: pp in one pass, the depth in passes of 512)")
      ->check(CLI::Range(0, 1 << 22));
  mo->add_option("-n,--gen", mb.gen, "generated tokens per tg test (0: none)")->check(CLI::Range(0, 1 << 22));
  mo->add_option("-d,--depth", mb.depths, "context depths")->delimiter(',')->check(CLI::Range(0, 1 << 22));
  mo->add_option("--kv", mb.kv, "KV configurations: f16, k8v3, k4v4, q8_0/q4_0, k8v3+mt128, ...")->delimiter(',');
  mo->add_flag("--no-standard", mb_no_standard, "skip the standard (expand, then attend) path");
  mo->add_option("-r,--repetitions", mb.reps, "repetitions")->check(CLI::Range(1, 1000));
  mo->add_option("-t,--threads", mb.threads, "threads")->check(CLI::Range(1, 256));
  mo->add_option("-o,--output", mb.format, "md, csv or json")->check(CLI::IsMember({"md", "csv", "json"}));
  mo->add_option("-b,--batch", mb.batches, "sequences decoding together (each at the depth), e.g. 1,4,16,64")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  tq::cli::add_device_flags(*mo, mb.device);
  mo->add_option("--simd", simd, simd_help)->check(CLI::IsMember({"best", "avx2"}));

  PipesArgs pipes;
  auto* pi = app.add_subcommand("pipes", "which 512-bit instructions share the multiply-add pipes (why integer dot products do or do not help)");
  pi->add_option("--iterations", pipes.iterations, "loop iterations per timing")->check(CLI::Range(1000L, 1000000000L));
  pi->add_flag("--json", pipes.json, "print JSON instead of a Markdown table");

  BlockArgs blk;
  std::vector<std::string> blk_pairs = {"8,3", "4,4"};
  auto* bl = app.add_subcommand("block", "cycles per position of the fused block kernel, key scoring and value accumulation apart");
  bl->add_option("--kv", blk_pairs, "TurboQuant K,V bit pairs (keys 1-4 or 8, values 1-4), e.g. --kv 8,3 --kv 4,4")->expected(1, 16);
  bl->add_option("--head-dim", blk.dim, "head dimension (a multiple of 16)")->check(CLI::Range(16, 1024));
  bl->add_option("--rows", blk.rows, "query rows of the KV head (1..4)")->check(CLI::Range(1, 4));
  bl->add_option("--group-size", blk.group_size, "TurboQuant group size (32, 64, 128)");
  bl->add_option("--positions", blk.positions, "positions of the block (a multiple of 16, at most 256)");
  bl->add_option("--iterations", blk.iterations, "calls per timing round")->check(CLI::Range(10L, 100000000L));
  bl->add_flag("--json", blk.json, "print JSON instead of a Markdown table");
  bl->add_option("--simd", simd, simd_help)->check(CLI::IsMember({"best", "avx2"}));

  CLI11_PARSE(app, argc, argv);
  try {
    if (c->parsed()) {
      codec.scale_fit = tq::parse_scale_fit(fit);
      codec.rotation_block = tq::parse_rotation_block(rotation);
      codec.codebook = tq::parse_distribution(codebook);
      return run_codec(codec);
    }
    if (at->parsed()) {
      TQ_CHECK(attn.n_heads % attn.n_kv == 0, "--heads must be a multiple of --kv-heads");
      // As the runtime's KV settings (bt=N): other sizes keep K token-major, which no model run uses.
      TQ_CHECK(attn.block_tokens % 16 == 0, "--block-tokens must be a multiple of 16, got ", attn.block_tokens);
      attn.bit_pairs.clear();
      for (const auto& s : kv_pairs) {
        const auto comma = s.find(',');
        TQ_CHECK(comma != std::string::npos, "--kv takes K,V bit pairs like 8,3; got '", s, "'");
        attn.bit_pairs.emplace_back(tq::parse_integer(std::string_view(s).substr(0, comma), "the K bits of --kv " + s),
                                    tq::parse_integer(std::string_view(s).substr(comma + 1), "the V bits of --kv " + s));
      }
      attn.standard = !no_standard;
      attn.cold = !warm;
      attn.simd = select_simd(simd);
      return run_attention(attn);
    }
    if (pi->parsed()) return run_pipes(pipes);
    if (bl->parsed()) {
      TQ_CHECK(blk.dim % 16 == 0, "--head-dim must be a multiple of 16, got ", blk.dim);
      TQ_CHECK(blk.dim % blk.group_size == 0, "--group-size must divide --head-dim");
      blk.bit_pairs.clear();
      for (const auto& s : blk_pairs) {
        const auto comma = s.find(',');
        TQ_CHECK(comma != std::string::npos, "--kv takes K,V bit pairs like 8,3; got '", s, "'");
        blk.bit_pairs.emplace_back(tq::parse_integer(std::string_view(s).substr(0, comma), "the K bits of --kv " + s),
                                   tq::parse_integer(std::string_view(s).substr(comma + 1), "the V bits of --kv " + s));
      }
      blk.simd = select_simd(simd);
      return run_block(blk);
    }
    if (mo->parsed()) {
      mb.standard = !mb_no_standard;
      mb.simd = select_simd(simd);
      return run_model(mb);
    }
  } catch (const tq::Error& e) {
    std::fprintf(stderr, "turboquant-bench: %s\n", e.what());
    return 2;
  }
  return 0;
}
