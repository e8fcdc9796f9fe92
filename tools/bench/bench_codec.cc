// turboquant-bench codec: distortion of the group quantizer against Lloyd-Max theory, beside
// llama.cpp's q8_0/q4_0, and quantize/dequantize throughput (scalar reference vs best SIMD target).
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <tuple>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "codec/absmax.h"
#include "codec/codebook.h"
#include "codec/group_quantizer.h"
#include "codec/kernels.h"
#include "core/rng.h"
#include "table.h"
#include "timing.h"

namespace tq::bench {
namespace {

// Test vectors: [count][dim]. "gaussian": i.i.d. N(0, 1). "outliers": the same, with a fixed set of
// dim/32 channels (the same in every vector, as real keys have) scaled by 10.
std::vector<float> make_data(const std::string& kind, int dim, size_t count, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> x(static_cast<size_t>(dim) * count);
  for (auto& v : x) v = static_cast<float>(rng.normal());
  if (kind == "outliers") {
    for (size_t i = 0; i < count; ++i)
      for (int c = 0; c < dim / 32; ++c) x[i * dim + (c * 37 + 5) % dim] *= 10.0f;
  }
  return x;
}

// Mean over vectors of ||x - x_hat||^2 / ||x||^2.
double relative_mse(const std::vector<float>& x, const std::vector<float>& back, int dim) {
  const size_t count = x.size() / dim;
  double sum = 0;
  for (size_t v = 0; v < count; ++v) {
    double err = 0, ref = 0;
    for (int j = 0; j < dim; ++j) {
      const double d = static_cast<double>(back[v * dim + j]) - x[v * dim + j];
      err += d * d;
      ref += static_cast<double>(x[v * dim + j]) * x[v * dim + j];
    }
    sum += err / ref;
  }
  return sum / static_cast<double>(count);
}

struct Row {
  std::string bits, grid, data, target;
  int dim;
  double mse, theory, theory_gaussian, bits_per_value;
  double quant_gbps, dequant_gbps, quant_gbps_scalar, dequant_gbps_scalar;
};

// MSE of a codebook on the unit-variance sphere marginal in `dim` dimensions (memoised: the
// moment tables take a moment to build).
double sphere_mse(const Codebook& cb, int dim) {
  static std::map<std::tuple<int, int, int>, double> memo;
  const auto key = std::make_tuple(cb.bits, static_cast<int>(cb.distribution), dim);
  auto it = memo.find(key);
  if (it == memo.end()) it = memo.emplace(key, codebook_mse(cb, Distribution::sphere, dim)).first;
  return it->second;
}

}  // namespace

int run_codec(const CodecArgs& args) {
  std::vector<Row> rows;
  const std::string target = kernels::chosen_target_name();
  for (const std::string& data : args.data) {
    for (int dim : args.dims) {
      const size_t count = args.floats / static_cast<size_t>(dim);
      const auto x = make_data(data, dim, count, 1000 + dim);
      const double input_gb = 4.0 * static_cast<double>(x.size()) / 1e9;
      std::vector<float> back(x.size());

      for (int bits : args.bits) {
        std::vector<Grid> grids = {bits == 8 ? Grid::uniform : Grid::lloyd_max};
        if (bits == 8) grids.push_back(Grid::lloyd_max);
        for (Grid grid : grids) {
          QuantizerOptions o;
          o.bits = bits;
          o.group_size = std::min(args.group_size, dim);
          o.grid = grid;
          o.scale_fit = args.scale_fit;
          o.rotation_block = args.rotation_block;
          o.codebook = args.codebook;
          const GroupQuantizer q(dim, o);
          std::vector<uint8_t> codes(q.code_bytes() * count);
          std::vector<f16> scales(static_cast<size_t>(q.groups()) * count);
          Row r;
          r.bits = std::to_string(bits);
          r.grid = grid == Grid::uniform ? "uniform" : "lloyd_max";
          r.data = data;
          r.dim = dim;
          r.target = target;
          q.quantize(x.data(), count, codes.data(), scales.data());
          q.dequantize(codes.data(), scales.data(), count, back.data());
          r.mse = relative_mse(x, back, dim);
          // The exact expectation: with a rotation, a Gaussian vector's coordinates divided by their
          // group RMS are distributed as one coordinate of a uniform unit vector in group_size
          // dimensions (scaled to unit variance), so the codebook's MSE on that density is the theory.
          const Codebook& cb = lloyd_max_codebook(bits, args.codebook, o.group_size);
          r.theory_gaussian = lloyd_max_codebook(bits).mse;
          r.theory = grid == Grid::lloyd_max && o.scale_fit == ScaleFit::plain && o.rotation_block != RotationBlock::none
                         ? sphere_mse(cb, o.group_size)
                         : r.theory_gaussian;
          r.bits_per_value = q.bits_per_value();
          r.quant_gbps = input_gb / seconds_per_call([&] { q.quantize(x.data(), count, codes.data(), scales.data()); });
          r.dequant_gbps = input_gb / seconds_per_call([&] { q.dequantize(codes.data(), scales.data(), count, back.data()); });
          r.quant_gbps_scalar =
              input_gb / seconds_per_call([&] { q.quantize_reference(x.data(), count, codes.data(), scales.data()); });
          r.dequant_gbps_scalar =
              input_gb / seconds_per_call([&] { q.dequantize_reference(codes.data(), scales.data(), count, back.data()); });
          rows.push_back(r);
        }
      }

      // Baselines on the same vectors: absmax blocks of 32, no rotation.
      {
        std::vector<BlockQ8_0> q8(x.size() / 32);
        Row r{"q8_0", "absmax", data, "scalar", dim, 0, lloyd_max_codebook(8).mse, lloyd_max_codebook(8).mse, 8.5, 0, 0, 0, 0};
        quantize_q8_0(x.data(), x.size(), q8.data());
        dequantize_q8_0(q8.data(), x.size(), back.data());
        r.mse = relative_mse(x, back, dim);
        r.quant_gbps = r.quant_gbps_scalar = input_gb / seconds_per_call([&] { quantize_q8_0(x.data(), x.size(), q8.data()); });
        r.dequant_gbps = r.dequant_gbps_scalar =
            input_gb / seconds_per_call([&] { dequantize_q8_0(q8.data(), x.size(), back.data()); });
        rows.push_back(r);
      }
      {
        std::vector<BlockQ4_0> q4(x.size() / 32);
        Row r{"q4_0", "absmax", data, "scalar", dim, 0, lloyd_max_codebook(4).mse, lloyd_max_codebook(4).mse, 4.5, 0, 0, 0, 0};
        quantize_q4_0(x.data(), x.size(), q4.data());
        dequantize_q4_0(q4.data(), x.size(), back.data());
        r.mse = relative_mse(x, back, dim);
        r.quant_gbps = r.quant_gbps_scalar = input_gb / seconds_per_call([&] { quantize_q4_0(x.data(), x.size(), q4.data()); });
        r.dequant_gbps = r.dequant_gbps_scalar =
            input_gb / seconds_per_call([&] { dequantize_q4_0(q4.data(), x.size(), back.data()); });
        rows.push_back(r);
      }
    }
  }

  if (args.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : rows) {
      out.push_back({{"bits", r.bits == "q8_0" || r.bits == "q4_0" ? nlohmann::json(r.bits) : nlohmann::json(std::stoi(r.bits))},
                     {"grid", r.grid},
                     {"dim", r.dim},
                     {"data", r.data},
                     {"mse", r.mse},
                     {"theory", r.theory},
                     {"theory_gaussian", r.theory_gaussian},
                     {"ratio", r.mse / r.theory},
                     {"bits_per_value", r.bits_per_value},
                     {"quant_gbps", r.quant_gbps},
                     {"dequant_gbps", r.dequant_gbps},
                     {"quant_gbps_scalar", r.quant_gbps_scalar},
                     {"dequant_gbps_scalar", r.dequant_gbps_scalar},
                     {"target", r.target}});
    }
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  std::printf("TurboQuant codec: group %d, fit %s, rotation %s, codebook %s; %zu floats per (data, dim); "
              "theory = the codebook's exact MSE on rotated Gaussian data normalised per group (the unit-variance sphere "
              "marginal in group dimensions); N(0,1) = Lloyd-Max MSE for a Gaussian (the reference for the uniform "
              "grid and for q8_0/q4_0 at 8/4 bits)\n\n",
              args.group_size, args.scale_fit == ScaleFit::plain ? "plain" : args.scale_fit == ScaleFit::norm_correction ? "norm_correction" : "least_squares",
              args.rotation_block == RotationBlock::dim ? "dim" : args.rotation_block == RotationBlock::group ? "group" : "none",
              to_string(args.codebook).c_str(), args.floats);
  MarkdownTable t({"data", "D", "bits", "grid", "bits/value", "rel. MSE", "theory", "ratio", "N(0,1) LM", "ratio", "quant GB/s (scalar)",
                   "quant GB/s (" + target + ")", "dequant GB/s (scalar)", "dequant GB/s (" + target + ")"});
  for (const auto& r : rows) {
    const bool baseline = r.target == "scalar";
    t.add({r.data, std::to_string(r.dim), r.bits, r.grid, fixed(r.bits_per_value, 3), fmt(r.mse, 4), fmt(r.theory, 4),
           fixed(r.mse / r.theory, 3), fmt(r.theory_gaussian, 4), fixed(r.mse / r.theory_gaussian, 3),
           fixed(r.quant_gbps_scalar, 2), baseline ? "-" : fixed(r.quant_gbps, 2),
           fixed(r.dequant_gbps_scalar, 2), baseline ? "-" : fixed(r.dequant_gbps, 2)});
  }
  std::cout << t.str();
  return 0;
}

}  // namespace tq::bench
