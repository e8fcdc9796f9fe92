// GGUF files with ggml k-quant weights end to end: the demo model exported by write_llama_gguf with Q4_K / Q6_K
// / Q4_0 matrices (a mixed file: Q6_K embedding, F32 norms), loaded as stored, against the same model in F32
// over the same dequantized weights (what is left is the products' int8 activation rounding) and against the
// source BF16 model (the format's error); plus clear errors for truncated files and rows that are not whole
// blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_export.h"
#include "model/loader.h"
#include "model/mapped_file.h"
#include "model/model_test_util.h"
#include "model/writer.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

using testing_util::CpuModel;
using testing_util::expect_error;
using testing_util::ScratchDir;

const std::string kDemo = std::string(TQ_SOURCE_DIR) + "/models/demo";

std::vector<float> logits_of(const std::string& path, const std::vector<int32_t>& ids, size_t chunk) {
  CpuModel cpu(path, 2);
  auto engine = testing_util::dense_engine(*cpu.model, "f32");
  return testing_util::feed_all(*engine, engine->add_sequence(), ids, chunk);
}

// ||a - b|| / ||b|| over all logits, and the share of positions whose argmax agrees.
std::pair<double, double> compare(const std::vector<float>& a, const std::vector<float>& b, size_t vocab) {
  double e = 0, r = 0;
  size_t agree = 0;
  for (size_t p = 0; p < a.size() / vocab; ++p) {
    size_t ia = 0, ib = 0;
    for (size_t v = 0; v < vocab; ++v) {
      const double d = a[p * vocab + v] - b[p * vocab + v];
      e += d * d;
      r += static_cast<double>(b[p * vocab + v]) * b[p * vocab + v];
      if (a[p * vocab + v] > a[p * vocab + ia]) ia = v;
      if (b[p * vocab + v] > b[p * vocab + ib]) ib = v;
    }
    agree += ia == ib;
  }
  return {std::sqrt(e / r), static_cast<double>(agree) / static_cast<double>(a.size() / vocab)};
}

GgufFile parse_gguf(std::vector<uint8_t> b, const std::string& name) {
  return GgufFile::parse(MappedFile::from_bytes(name, std::move(b)));
}

std::vector<int32_t> prompt_ids() {
  std::vector<int32_t> ids;
  for (int i = 0; i < 24; ++i) ids.push_back((i * 611 + 17) % 4096);
  return ids;
}

TEST(GgufKquant, ExportedDemoModelRunsAsStoredWithinTheProductsBound) {
  ScratchDir dir("kquant");
  const ModelFiles hf = open_model(kDemo);
  const std::vector<int32_t> ids = prompt_ids();
  const auto source = logits_of(kDemo, ids, 8);
  const size_t vocab = static_cast<size_t>(hf.config.vocab_size);

  // The export itself (F32 everywhere, Q/K permuted for interleaved RoPE) reproduces the source model.
  LlamaGgufOptions f32;
  f32.matrices = f32.embedding = DType::f32;
  write_llama_gguf(hf, dir.file("f32.gguf"), f32);
  const auto [f32_err, f32_top1] = compare(logits_of(dir.file("f32.gguf"), ids, 8), source, vocab);
  EXPECT_LT(f32_err, 1e-4) << "the F32 export should be the source model up to float rounding";

  // Products' bound: the quantized file against the F32 file over the same dequantized weights. The int8
  // activation rounding (ops/kquant.h) is at most 1/254 of each block's largest activation per value;
  // through 8 layers it measured 0.7-1.1% of the logits' norm (bound 2%). Format bound: against the BF16
  // source model Q6_K measured 1.9%, Q4_K 5.3%, Q4_0 8.2%.
  const struct {
    DType matrices, embedding;
    double product_bound, format_bound;
  } cases[] = {{DType::q4_k, DType::q6_k, 0.02, 0.12},
               {DType::q6_k, DType::q6_k, 0.02, 0.05},
               {DType::q4_0, DType::q4_0, 0.02, 0.2}};
  for (const auto& c : cases) {
    const std::string name = std::string(dtype_name(c.matrices)) + "-" + dtype_name(c.embedding);
    LlamaGgufOptions o;
    o.matrices = c.matrices;
    o.embedding = c.embedding;
    write_llama_gguf(hf, dir.file(name + ".gguf"), o);
    o.dequantized = true;
    write_llama_gguf(hf, dir.file(name + "-dq.gguf"), o);
    {
      // Loaded as stored: the matrices keep their ggml type.
      const ModelFiles g = open_model(dir.file(name + ".gguf"));
      EXPECT_EQ(g.weights.layers[0].w_up->dtype, c.matrices) << name;
      EXPECT_EQ(g.weights.embed->dtype, c.embedding) << name;
      EXPECT_EQ(g.weights.final_norm->dtype, DType::f32) << name;
    }
    const auto quant = logits_of(dir.file(name + ".gguf"), ids, 8);
    const auto [prod_err, prod_top1] = compare(quant, logits_of(dir.file(name + "-dq.gguf"), ids, 8), vocab);
    const auto [fmt_err, fmt_top1] = compare(quant, source, vocab);
    EXPECT_LT(prod_err, c.product_bound) << name;
    EXPECT_GE(prod_top1, 0.9) << name;
    EXPECT_LT(fmt_err, c.format_bound) << name;
    EXPECT_GT(fmt_err, prod_err) << name << ": the format's error should exceed the products' rounding";
    std::printf("%s: logits vs dequantized F32 %.4f (top-1 %.2f), vs BF16 source %.4f (top-1 %.2f)\n", name.c_str(),
                prod_err, prod_top1, fmt_err, fmt_top1);
    // Decode (one token a step) gives the prompt's bits: every (row, token) product is independent.
    if (c.matrices != DType::q4_k) continue;
    const auto decode = logits_of(dir.file(name + ".gguf"), ids, 1);
    EXPECT_EQ(std::memcmp(decode.data(), quant.data(), quant.size() * sizeof(float)), 0) << name;
  }
}

TEST(GgufKquant, DamagedFilesGiveClearErrors) {
  ScratchDir dir("kquant_bad");
  {
    // A Q4_K tensor whose rows are not whole 256-value super-blocks.
    GgufWriter w;
    w.add_tensor_raw("blk.0.ffn_up.weight", kGgmlQ4_K, {2, 320}, std::vector<uint8_t>(2 * 180));
    expect_error([&] { parse_gguf(w.bytes(), "bad.gguf"); }, {"bad.gguf", "ffn_up", "Q4_K", "256-value blocks"});
  }
  {
    // A Q6_K tensor that runs past the end of the file (truncated).
    GgufWriter w;
    std::vector<uint8_t> bytes(2 * ops::kQ6_KBlockBytes);
    w.add_tensor_raw("t", kGgmlQ6_K, {2, 256}, bytes);
    std::vector<uint8_t> file = w.bytes();
    file.resize(file.size() - 100);
    expect_error([&] { parse_gguf(file, "cut.gguf"); }, {"cut.gguf", "'t'", "runs past the end"});
  }
  {
    // Unsupported ggml types are named, with the supported list.
    for (uint32_t id : {3u, 6u, 7u, 10u, 11u}) {  // Q4_1, Q5_0, Q5_1, Q2_K, Q3_K
      GgufWriter w;
      w.add_tensor_raw("x", id, {256}, std::vector<uint8_t>(256));
      expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"'x'", ggml_type_name(id), "not supported", "Q6_K"});
    }
  }
}

}  // namespace
}  // namespace tq
