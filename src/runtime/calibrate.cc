#include "runtime/calibrate.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "device/cpu_device.h"
#include "model/tq_weights.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "runtime/memory_plan.h"
#include "runtime/perplexity.h"

namespace tq {

TqCalibration calibrate_linear_inputs(const std::string& model_path, const std::string& text_path, const CalibrationOptions& options) {
  TQ_CHECK(options.tokens >= 1, "calibration needs at least one token, got ", options.tokens);
  TQ_CHECK(options.ctx >= 2 && options.chunk >= 1, "calibration windows of ", options.ctx, " tokens in chunks of ", options.chunk);
  const auto start = std::chrono::steady_clock::now();
  CpuDevice dev(options.threads);
  const std::unique_ptr<Model> model = Model::open(model_path, dev);
  TQ_CHECK(options.ctx <= model->config().max_position_embeddings, "calibration windows of ", options.ctx,
           " tokens exceed the model's context of ", model->config().max_position_embeddings);
  std::ifstream in(text_path, std::ios::binary);
  TQ_CHECK(in.good(), "calibration text '", text_path, "' cannot be read");
  std::ostringstream text;
  text << in.rdbuf();
  EncodeOptions eo;
  eo.add_special_tokens = false;
  const std::vector<int32_t> tokens = load_model_tokenizer(model->files())->encode(text.str(), eo);
  TQ_CHECK(tokens.size() >= 2, "calibration text '", text_path, "' has ", tokens.size(), " tokens");
  const size_t used = std::min(tokens.size(), static_cast<size_t>(options.tokens));

  // The matrix a product reads, by the data of its first part: the tensor of the source folder it views.
  std::map<const void*, std::string> key_of;  // tensor data -> rotation key
  std::map<std::string, int64_t> cols_of;     // rotation key -> the columns of its matrices' input
  for (const TensorView& t : model->files().tensors().all()) {
    if (t.shape.size() != 2) continue;
    key_of[t.data] = tq_rotation_key(t.name);
    cols_of[key_of[t.data]] = t.shape[1];
  }
  // Every H [cols][cols] (double) stays until the conversion has used it: refuse up front, with the numbers,
  // a model whose matrices cannot all be held in the memory this machine has free (an 8B model needs ~65 GB).
  int64_t hessian_bytes = 0;
  for (const auto& [key, cols] : cols_of) hessian_bytes += cols * cols * static_cast<int64_t>(sizeof(double));
  TQ_CHECK(options.memory_budget_bytes >= 0, "a negative memory budget for the calibration");
  const bool measured = options.memory_budget_bytes == 0;
  const int64_t available = measured ? available_memory_bytes() : options.memory_budget_bytes;
  TQ_CHECK(hessian_bytes <= available, "GPTQ calibration of '", model_path, "' keeps ", cols_of.size(),
           " input matrices H = sum x x^T in double, ", hessian_bytes, " bytes (", hessian_bytes >> 20, " MiB), more than the ",
           available, " bytes ", measured ? "this machine has available (MemAvailable)" : "of the memory budget",
           ": convert without --calibrate, or on a machine with more memory");

  TqCalibration cal;
  std::vector<float> xt, prod;  // [cols][rows] the input transposed; [cols][cols] its Gram matrix
  dev.set_matmul_observer([&](std::span<const ops::WeightView> parts, const Tensor& x) {
    const auto it = key_of.find(parts[0].data);
    TQ_CHECK(it != key_of.end(), "calibration: a product over a matrix that is no tensor of '", model_path, "'");
    const size_t rows = static_cast<size_t>(x.rows), cols = static_cast<size_t>(x.cols);
    std::vector<double>& h = cal.hessians[it->second];
    if (h.empty()) {
      h.assign(cols * cols, 0.0);
      cal.cols[it->second] = static_cast<int64_t>(cols);
    }
    TQ_CHECK(h.size() == cols * cols, "calibration: inputs of ", cols, " columns to '", it->second, "', earlier of ",
             cal.cols[it->second]);
    // H += X^T X as a product of the input's transpose with itself: Xt [cols][rows] as a weight matrix and as
    // the activation, y [cols][cols] = Xt . Xt^T (float sums over one chunk's rows, added up in double).
    xt.resize(cols * rows);
    prod.resize(cols * cols);
    for (size_t r = 0; r < rows; ++r) {
      const float* xr = x.row(static_cast<int64_t>(r));
      for (size_t c = 0; c < cols; ++c) xt[c * rows + r] = xr[c];
    }
    ops::matmul(ops::WeightView::dense(ops::DType::F32, xt.data(), static_cast<int64_t>(cols), static_cast<int64_t>(rows)), xt.data(),
                cols, prod.data(), dev.pool());
    for (size_t i = 0; i < cols * cols; ++i) h[i] += prod[i];
  });

  EngineOptions opts;
  opts.kv = parse_kv_spec("f16");
  opts.ctx_size = options.ctx;
  Engine engine(*model, opts);
  for (size_t w0 = 0; w0 < used; w0 += static_cast<size_t>(options.ctx)) {
    const size_t n = std::min(used - w0, static_cast<size_t>(options.ctx));
    const std::span<const int32_t> window(tokens.data() + w0, n);
    const int seq = engine.add_sequence();
    for (size_t done = 0; done < n;) {
      const size_t m = std::min(static_cast<size_t>(options.chunk), n - done);
      const BatchEntry e{seq, window.subspan(done, m), static_cast<int>(done), Logits::last};
      engine.forward({&e, 1});
      done += m;
    }
    engine.remove_sequence(seq);
  }
  dev.set_matmul_observer({});
  cal.tokens = static_cast<int64_t>(used);
  cal.text = std::filesystem::path(text_path).filename().string();
  cal.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return cal;
}

}  // namespace tq
