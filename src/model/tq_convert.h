// Hugging Face folder -> TurboQuant weight folder (docs/FORMATS.md "TurboQuant weights"), what
// turboquant-convert runs. Streams tensor by tensor (rows in blocks) from the memory-mapped input into a
// preallocated output file, so memory stays at a block of rows whatever the model's size.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "ops/tq_fit.h"
#include "ops/tq_format.h"

namespace tq {

// Calibration statistics for GPTQ (runtime/calibrate.h makes them): per matrix input, H = sum x x^T over the
// calibration tokens, in the source model's (unrotated) basis. The converter rotates H into each matrix's
// rotated basis (R H R^T, the same as accumulating the rotated inputs) before the fit.
struct TqCalibration {
  std::map<std::string, std::vector<double>> hessians;  // rotation key (tq_rotation_key) -> [cols][cols]
  std::map<std::string, int64_t> cols;                  // rotation key -> cols
  int64_t tokens = 0;                                   // calibration tokens that went through the model
  std::string text;                                     // where they came from (a file name), for the config
  double seconds = 0;                                   // the calibration pass's wall time
};

struct TqConvertOptions {
  int bits = 4;             // default for every quantized matrix
  int group_size = 64;      // 32, 64 or 128
  int attn_bits = 0;        // q/k/v/o_proj (0: bits)
  int mlp_bits = 0;         // gate/up/down_proj (0: bits)
  ops::TqCodebook codebook = ops::TqCodebook::lloyd_max;
  ops::TqScaleFit scale_fit = ops::TqScaleFit::plain;  // how each group's scale is chosen (ops/tq_fit.h)
  uint64_t rotation_seed = 42;
  bool quantize_extras = false;  // embeddings and the output head too
  // With calibration statistics: every layer matrix (q/k/v/o, gate/up/down) is coded by GPTQ under its
  // input's H (ops/tq_fit.h: damping gptq_damp of the mean diagonal, lazy blocks of 128 columns); a layer
  // matrix whose input has no H is refused. The embedding and the head (with --quantize-extras) are
  // rounded with the scale fit. Not owned.
  const TqCalibration* calibration = nullptr;
  double gptq_damp = 0.01;
};

struct TqTensorReport {
  std::string name;         // the source tensor (P.weight)
  int64_t layer = -1;       // model.layers.N, -1 outside the layers
  bool quantized = false;
  int bits = 0, group_size = 0;
  std::string skip_reason;  // when not quantized
  double rel_error = 0;     // ||W - W_hat||_F / ||W||_F (quantized only)
  bool gptq = false;        // coded by GPTQ under the calibration's H
  uint64_t bytes_in = 0, bytes_out = 0;
};

struct TqConvertReport {
  std::vector<TqTensorReport> tensors;
  uint64_t bytes_in = 0, bytes_out = 0;
};

// Converts the HF folder `input` (safetensors F32/F16/BF16, a Llama-family config) into the new folder
// `output` (refused when it exists): model.safetensors, config.json with the "quantization" block, and every
// other file of the input folder (tokenizer, generation config) copied. `progress(done, total, name)` is
// called after each tensor. Writes into `output`.partial and renames it at the end, so a failed run leaves
// no folder that looks complete.
TqConvertReport convert_to_turboquant(const std::string& input, const std::string& output, const TqConvertOptions& options,
                                      ThreadPool& pool,
                                      const std::function<void(size_t, size_t, const std::string&)>& progress = {});

}  // namespace tq
