// The calibration pass of GPTQ weight conversion (turboquant-convert --calibrate): the source model runs on the
// CPU over a calibration text, and for every linear layer's input the sum H = sum x x^T of its rows is kept
// (model/tq_convert.h TqCalibration; the converter rotates it into each matrix's basis).
#pragma once

#include <cstdint>
#include <string>

#include "model/tq_convert.h"

namespace tq {

struct CalibrationOptions {
  int64_t tokens = 8192;  // calibration tokens: the text's first windows of ctx (the last one cut short)
  int ctx = 1024;         // tokens per window, each from an empty cache (as the perplexity protocol)
  int chunk = 256;        // tokens per forward pass
  int threads = 2;
  int64_t memory_budget_bytes = 0;  // what the H matrices may take (0: MemAvailable, /proc/meminfo)
};

// Runs the model folder `model_path` (FP16 KV cache) over the text file `text_path`, encoded without BOS,
// observing every matrix product's input (CpuDevice::set_matmul_observer). The result holds one H per rotation
// key (q/k/v share one input, gate/up another): [cols][cols] in double, and the pass's wall time. A text that
// cannot be read or has under two tokens is refused, naming the file; so is, before anything runs, a model
// whose H matrices (one [cols][cols] of doubles per rotation key) would take more than the memory budget.
TqCalibration calibrate_linear_inputs(const std::string& model_path, const std::string& text_path, const CalibrationOptions& options);

}  // namespace tq
