// turboquant-bench: benchmarks that compare methods side by side in one process.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <map>

#include "bench.h"
#include "core/error.h"

int main(int argc, char** argv) {
  using namespace tq::bench;
  CLI::App app{"turboquant-bench: side-by-side benchmarks (Markdown tables, or JSON with --json)"};
  app.require_subcommand(1);

  CodecArgs codec;
  std::string fit = "plain", rotation = "dim", codebook = "gaussian";
  auto* c = app.add_subcommand("codec", "group quantizer distortion vs Lloyd-Max theory, q8_0/q4_0 baselines, throughput");
  c->add_option("--bits", codec.bits, "bit widths (1..8)")->delimiter(',')->check(CLI::Range(1, 8));
  c->add_option("--dims", codec.dims, "vector lengths")->delimiter(',')->check(CLI::PositiveNumber);
  c->add_option("--data", codec.data, "gaussian and/or outliers")->delimiter(',')->check(CLI::IsMember({"gaussian", "outliers"}));
  c->add_option("--group-size", codec.group_size, "values per scale")->check(CLI::PositiveNumber);
  c->add_option("--fit", fit, "scale fit")->check(CLI::IsMember({"plain", "norm_correction", "least_squares"}));
  c->add_option("--rotation-block", rotation, "rotation block: dim or group")->check(CLI::IsMember({"dim", "group", "none"}));
  c->add_option("--codebook", codebook, "gaussian or sphere (exact marginal in the group's dimension)")
      ->check(CLI::IsMember({"gaussian", "sphere"}));
  c->add_option("--floats", codec.floats, "floats per (data, dim) test set")->check(CLI::Range(4096, 1 << 26));
  c->add_flag("--json", codec.json, "print a JSON array instead of a Markdown table");

  CLI11_PARSE(app, argc, argv);
  try {
    if (c->parsed()) {
      codec.scale_fit = tq::parse_scale_fit(fit);
      codec.rotation_block = tq::parse_rotation_block(rotation);
      codec.codebook = tq::parse_distribution(codebook);
      return run_codec(codec);
    }
  } catch (const tq::Error& e) {
    std::fprintf(stderr, "turboquant-bench: %s\n", e.what());
    return 2;
  }
  return 0;
}
