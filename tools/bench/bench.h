// turboquant-bench subcommands.
#pragma once

#include <string>
#include <vector>

#include "codec/group_quantizer.h"
#include "device_flags.h"
#include "kv/cache.h"

namespace tq::bench {

struct CodecArgs {
  std::vector<int> bits = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<int> dims = {64, 128, 256};
  std::vector<std::string> data = {"gaussian", "outliers"};
  int group_size = 64;
  ScaleFit scale_fit = ScaleFit::plain;
  RotationBlock rotation_block = RotationBlock::dim;
  Distribution codebook = Distribution::gaussian;
  size_t floats = size_t{1} << 21;
  bool json = false;
};
int run_codec(const CodecArgs& args);

// "best": the kernels dispatch to the best target this CPU has; "avx2": to AVX2 at most (the AVX-512
// targets disabled), to time the path of CPUs without AVX-512 on this one. Returns the name of the target
// the kernels then dispatch to;
// throws tq::Error when the CPU lacks the target asked for.
std::string select_simd(const std::string& which);

struct AttentionArgs {
  int n_heads = 32, n_kv = 8, dim = 128, group_size = 64, block_tokens = kDefaultBlockTokens;
  // Cold (the default): each step attends to the next of enough copies of the cache to exceed
  // kColdBytes, so that every step reads its cache from memory, as in a model whose other layers pass
  // through the CPU caches in between. Warm: every step attends to one cache, which the last-level
  // cache partly holds.
  bool cold = true;
  std::vector<int> contexts = {1024, 4096, 16384, 65536};
  std::vector<int> threads = {1, 2};
  std::vector<std::pair<int, int>> bit_pairs = {{8, 3}, {4, 4}};
  std::vector<std::string> centers = {"none"};  // TurboQuant block-mean centring per method: none, k, v, kv
  int center_tokens = 0;                        // positions per mean (0: the block size)
  bool fastest_call = false;                    // time = the fastest single step of a round, not the mean
  bool standard = true;
  std::vector<std::string> methods = {"dense_f16", "fused", "standard", "q8_0", "q4_0"};
  double min_seconds = 0.2;
  bool json = false;
  std::string simd;  // the SIMD target the kernels dispatch to (select_simd), reported with the results
};
int run_attention(const AttentionArgs& args);

struct ModelBenchArgs {
  std::string model;
  int prompt = 512, gen = 128;
  // Prompt tokens per forward pass of the pp test and of the fill to the depth (llama-bench's -ub); 0: the
  // pp prompt in one pass and the depth in passes of 512. A long prompt's activations need slices on the GPU.
  int ubatch = 0;
  std::vector<int> depths = {0};
  std::vector<std::string> kv = {"f16", "k8v3", "k4v4", "q8_0/q8_0", "q4_0/q4_0"};
  bool standard = true;
  int reps = 3;
  int threads = 2;
  std::string format = "md";
  std::vector<int> batches = {1};  // sequences decoding together
  cli::DeviceFlags device;        // --device cpu|cuda and the CUDA options (tools/common/device_flags.h)
  std::string simd;               // as AttentionArgs::simd
};
int run_model(const ModelBenchArgs& args);

// The fused block kernel's cycles per position, keys and values apart (bench_block.cc).
struct BlockArgs {
  int dim = 128, rows = 4, group_size = 64, positions = 256;
  std::vector<std::pair<int, int>> bit_pairs = {{8, 3}, {4, 4}};
  long iterations = 20000;
  bool json = false;
  std::string simd;  // as AttentionArgs::simd
};
int run_block(const BlockArgs& args);

// Which 512-bit instructions share the multiply-add pipes (x86-64 with AVX-512 VNNI/VBMI/BF16/GFNI).
struct PipesArgs {
  long iterations = 20000000;  // loop iterations per timing (each times 5 rounds, best kept)
  bool json = false;
};
int run_pipes(const PipesArgs& args);

}  // namespace tq::bench
