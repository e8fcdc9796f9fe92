// turboquant-convert: a Hugging Face folder in, a TurboQuant weight folder out (docs/FORMATS.md
// "TurboQuant weights"). Parses and reports; the conversion is model/tq_convert.h.
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/tq_convert.h"
#include "progress.h"
#include "runtime/calibrate.h"

int main(int argc, char** argv) {
  CLI::App app{"turboquant-convert: quantize a Hugging Face model's linear layers to TurboQuant weights (TQ2/TQ3/TQ4)"};
  std::string input, output, codebook = "lloyd_max", scale_fit, calibrate;
  tq::TqConvertOptions o;
  tq::CalibrationOptions co;
  bool norm_correction = false;
  int threads = 2;
  app.add_option("input", input, "Hugging Face model folder (safetensors F32/F16/BF16)")->required();
  app.add_option("output", output, "new folder to write (refused when it exists)")->required();
  app.add_option("-b,--bits", o.bits, "bits per weight code")->check(CLI::IsMember({2, 3, 4}))->capture_default_str();
  app.add_option("-g,--group-size", o.group_size, "weights per FP16 scale along the input")
      ->check(CLI::IsMember({32, 64, 128}))
      ->capture_default_str();
  app.add_option("--attn-bits", o.attn_bits, "bits of q/k/v/o_proj (default: --bits)")->check(CLI::IsMember({2, 3, 4}));
  app.add_option("--mlp-bits", o.mlp_bits, "bits of gate/up/down_proj (default: --bits)")->check(CLI::IsMember({2, 3, 4}));
  app.add_option("--rotation-seed", o.rotation_seed, "base seed of the per-matrix Hadamard sign vectors")->capture_default_str();
  app.add_option("--codebook", codebook, "levels: lloyd_max (RMS scale) or lloyd_absmax (absmax scale)")
      ->check(CLI::IsMember({"lloyd_max", "lloyd_absmax"}))
      ->capture_default_str();
  app.add_flag("--norm-correction", norm_correction,
               "rescale each group so its reconstruction keeps the rotated weights' L2 norm (= --scale-fit norm_correction)");
  app.add_option("--scale-fit", scale_fit,
                 "each group's scale: plain (RMS or absmax), norm_correction, or mse (least squared error; default plain)")
      ->check(CLI::IsMember({"plain", "norm_correction", "mse"}));
  app.add_option("--calibrate", calibrate,
                 "GPTQ: run the source model on the CPU over this text and code each layer matrix with error feedback "
                 "under its inputs' H = sum x x^T (use a text other than the one you evaluate on)")
      ->check(CLI::ExistingFile);
  app.add_option("--calib-tokens", co.tokens, "calibration tokens (the text's first, in windows of --calib-ctx)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--calib-ctx", co.ctx, "tokens per calibration window")->check(CLI::Range(2, 1 << 20))->capture_default_str();
  app.add_option("--gptq-damp", o.gptq_damp, "GPTQ damping: this fraction of H's mean diagonal added to it")
      ->check(CLI::Range(1e-6, 0.999))
      ->capture_default_str();
  app.add_flag("--quantize-extras", o.quantize_extras, "quantize the embeddings and the output head too");
  app.add_option("-t,--threads", threads, "threads")->check(CLI::Range(1, 1024))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  o.codebook = codebook == "lloyd_max" ? tq::ops::TqCodebook::lloyd_max : tq::ops::TqCodebook::lloyd_absmax;
  try {
    if (norm_correction && !scale_fit.empty() && scale_fit != "norm_correction")
      throw tq::Error("--norm-correction and --scale-fit " + scale_fit + " are two different scale fits: give one");
    for (const char* flag : {"--calib-tokens", "--calib-ctx", "--gptq-damp"})
      if (calibrate.empty() && app.count(flag) > 0)
        throw tq::Error(std::string(flag) + " is a GPTQ setting: it needs --calibrate FILE");
    o.scale_fit = norm_correction ? tq::ops::TqScaleFit::norm_correction
                                  : tq::ops::parse_tq_scale_fit(scale_fit.empty() ? "plain" : scale_fit);
    tq::ThreadPool pool(threads);
    tq::TqCalibration calibration;
    if (!calibrate.empty()) {
      co.threads = threads;
      std::fprintf(stderr, "calibrating on %s (%lld tokens, windows of %d)...\n", calibrate.c_str(),
                   static_cast<long long>(co.tokens), co.ctx);
      calibration = tq::calibrate_linear_inputs(input, calibrate, co);
      std::fprintf(stderr, "calibration: %lld tokens, %zu matrix inputs, %.1f s\n", static_cast<long long>(calibration.tokens),
                   calibration.hessians.size(), calibration.seconds);
      o.calibration = &calibration;
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<tq::cli::Progress> bar;
    const tq::TqConvertReport r = tq::convert_to_turboquant(input, output, o, pool, [&](size_t done, size_t total, const std::string& name) {
      if (!bar) bar = std::make_unique<tq::cli::Progress>(static_cast<int>(total));
      bar->step(name);
    });
    if (bar) bar->done();
    const double convert_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Per layer: each matrix's relative reconstruction error ||W - W_hat||_F / ||W||_F.
    std::printf("%-48s %5s %6s %10s\n", "tensor", "type", "group", "rel_error");
    std::map<int64_t, std::pair<double, int>> per_layer;
    int skipped = 0;
    for (const tq::TqTensorReport& t : r.tensors) {
      if (!t.quantized) {
        ++skipped;
        continue;
      }
      std::printf("%-48s   TQ%d %6d %10.5f%s\n", t.name.c_str(), t.bits, t.group_size, t.rel_error, t.gptq ? "  (GPTQ)" : "");
      auto& [sum, n] = per_layer[t.layer];
      sum += t.rel_error;
      ++n;
    }
    for (const auto& [layer, v] : per_layer) {
      if (layer >= 0) std::printf("layer %3lld: mean rel_error %.5f over %d matrices\n", static_cast<long long>(layer), v.first / v.second, v.second);
    }
    std::printf("skipped %d tensors (kept as they are):", skipped);
    for (const tq::TqTensorReport& t : r.tensors)
      if (!t.quantized) std::printf("\n  %s: %s", t.name.c_str(), t.skip_reason.c_str());
    std::printf("\n%s: %.1f MiB -> %.1f MiB\n", output.c_str(), r.bytes_in / 1048576.0, r.bytes_out / 1048576.0);
    std::printf("scale fit %s; quantization %.1f s", tq::ops::scale_fit_name(o.scale_fit), convert_s);
    if (o.calibration) std::printf(", GPTQ calibration %.1f s (%lld tokens of %s)", calibration.seconds,
                                   static_cast<long long>(calibration.tokens), calibration.text.c_str());
    std::printf("\n");
  } catch (const tq::Error& e) {
    std::fprintf(stderr, "turboquant-convert: %s\n", e.what());
    return 1;
  }
  return 0;
}
