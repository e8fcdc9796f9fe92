// The reference system's TurboQuant folders (model/mlx_tq.h): the repacked views through our TQ kernels against
// the scalar reference that dequantizes the MLX layout directly (H_12 / H_20 / H_28 blocks, blockwise, unrotated,
// every bit width), the fixture folders of tools/fixtures/make_mlx_tq_fixture.py against the logits of their
// dequantized weights (NumPy, float64), and clear errors for damaged folders.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <vector>

#include "codec/rotation.h"
#include "core/half.h"
#include "core/thread_pool.h"
#include "model/device_weights.h"
#include "model/loader.h"
#include "model/mlx_tq.h"
#include "model/model_test_util.h"
#include "model/safetensors.h"
#include "model/writer.h"
#include "ops/tq_weights.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

namespace fs = std::filesystem;
using testing_util::CpuModel;
using testing_util::expect_error;
using testing_util::ScratchDir;

const std::string kFixtures = std::string(TQ_SOURCE_DIR) + "/tests/fixtures/mlx-tq";

// ------------------------------------------------------------------ one matrix, in memory

// A matrix in the MLX layout with random codes, scales, signs and a Lloyd-Max-like codebook.
struct MlxMatrix {
  int64_t out, in;
  int bits, group;
  std::vector<uint32_t> words;     // [out][ceil(in / (32 / bits))]
  std::vector<uint16_t> scales;    // [out][in / group] binary16
  std::vector<uint16_t> codebook;  // [2^bits] binary16
  std::vector<uint16_t> signs;     // [in] binary16 +-1
  int64_t words_per_row() const { return (in + 32 / bits - 1) / (32 / bits); }
};

MlxMatrix random_matrix(int64_t out, int64_t in, int bits, int group, bool rotated, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  MlxMatrix m{out, in, bits, group, {}, {}, {}, {}};
  const int64_t e = 32 / bits;
  m.words.assign(static_cast<size_t>(out * m.words_per_row()), 0);
  for (int64_t r = 0; r < out; ++r)
    for (int64_t i = 0; i < in; ++i)
      m.words[r * m.words_per_row() + i / e] |= (rng() & ((1u << bits) - 1)) << (bits * (i % e));
  for (int64_t k = 0; k < out * (in / group); ++k) m.scales.push_back(f32_to_f16_bits(0.01f + 0.05f * u(rng)));
  const int levels = 1 << bits;
  for (int i = 0; i < levels; ++i) m.codebook.push_back(f32_to_f16_bits(2.4f * (i - (levels - 1) / 2.0f) / levels + 0.01f * u(rng)));
  for (int64_t i = 0; i < in; ++i) m.signs.push_back(f32_to_f16_bits(rotated && u(rng) < 0.5f ? -1.0f : 1.0f));
  return m;
}

// The tensors of `m` under the layer name "blk.proj" (views into m's buffers).
TensorSet tensor_set(const MlxMatrix& m) {
  TensorSet s("memory");
  auto add = [&](const std::string& name, DType t, std::vector<int64_t> shape, const void* data, uint64_t bytes) {
    TensorView v;
    v.name = name;
    v.dtype = t;
    v.shape = std::move(shape);
    v.data = data;
    v.nbytes = bytes;
    v.file = "memory";
    s.add(std::move(v));
  };
  add("blk.proj.weight", DType::u32, {m.out, m.words_per_row()}, m.words.data(), m.words.size() * 4);
  add("blk.proj.scales", DType::f16, {m.out, m.in / m.group}, m.scales.data(), m.scales.size() * 2);
  add("blk.proj.codebook", DType::f16, {static_cast<int64_t>(m.codebook.size())}, m.codebook.data(), m.codebook.size() * 2);
  add("blk.proj.signs", DType::f16, {m.in}, m.signs.data(), m.signs.size() * 2);
  return s;
}

struct Shape {
  int64_t out, in;
  int bits, group;
  bool rotated;
  int block;  // the Hadamard block the layer must get
};

// Every product path of a repacked layer equals the scalar reference within 1e-6 * ||w_r|| ||x|| (float
// rounding of the activation's rotation and of the sums; |y_r| <= ||w_r|| ||x|| bounds every term's scale;
// measured at most 3.4e-8). Our Paley matrices in place of Sloane's give errors of order 1.
TEST(MlxTq, RepackedLayersMatchTheScalarReferenceOfTheMlxLayout) {
  const Shape shapes[] = {
      {24, 384, 3, 128, true, 384},  // H_12 (x) H_32 (TinyStories-656K's down_proj)
      {20, 160, 4, 32, true, 160},   // H_20 (x) H_8 (the fixtures' down_proj)
      {12, 448, 2, 64, true, 448},   // H_28 (x) H_16
      {16, 576, 3, 64, true, 192},   // 3 blocks of H_12 (x) H_16
      {9, 320, 4, 64, true, 320},    // GPT-OSS's block of 320 = 20 * 16, one block here
      {33, 256, 2, 128, true, 256},  // a power of two; 33 rows (a partial row tile)
      {8, 96, 3, 32, false, 1},      // rotation "none": every sign +1
      {7, 64, 3, 32, true, 64},      // 3-bit rows of 7 words, the last one 4 codes
  };
  ThreadPool pool(2);
  uint32_t seed = 1;
  for (const Shape& sh : shapes) {
    SCOPED_TRACE("[" + std::to_string(sh.out) + ", " + std::to_string(sh.in) + "] " + std::to_string(sh.bits) + " bits g" +
                 std::to_string(sh.group));
    const MlxMatrix m = random_matrix(sh.out, sh.in, sh.bits, sh.group, sh.rotated, seed++);
    TensorSet set = tensor_set(m);
    MlxTqQuantization q;
    q.bits = sh.bits;
    const std::shared_ptr<MlxTqStorage> storage = attach_mlx_tq_weights(q, set);
    ASSERT_EQ(storage->layers.size(), 1u);
    EXPECT_EQ(storage->layers[0].rotation_block, sh.block);
    const TensorView& t = set.at("blk.proj.weight");
    EXPECT_EQ(t.shape, (std::vector<int64_t>{sh.out, sh.in}));
    const ops::WeightView w = weight_view(&t);
    // The reference rows (original domain) and an activation.
    std::vector<std::vector<double>> rows;
    for (int64_t r = 0; r < sh.out; ++r)
      rows.push_back(ref::mlx_tq_weight_row(m.words.data(), m.words_per_row(), sh.in, sh.bits, m.scales.data(), sh.group,
                                            m.codebook.data(), m.signs.data(), r));
    std::mt19937 rng(seed++);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const size_t n = 3;
    std::vector<float> x(n * static_cast<size_t>(sh.in));  // [n][in]
    for (float& v : x) v = nd(rng);
    // The SIMD path, as the CPU device runs it.
    ops::TqInput input(sh.in, t.tq);
    ASSERT_TRUE(input.serves(w));
    std::vector<float> xp(n * input.stride());  // [n][stride]
    input.prepare(x.data(), n, static_cast<size_t>(sh.in), xp.data());
    std::vector<float> y(n * static_cast<size_t>(sh.out)), y_ref(y.size());  // [n][out]
    const ops::LinearPart part{w, y.data(), 0, nullptr};
    ops::tq_matmul_parts(std::span<const ops::LinearPart>(&part, 1), ops::TqPrepared{xp.data(), n, input.stride(), ops::tq_kernel_lanes()},
                         pool);
    ops::ref::tq_matmul(w, x.data(), n, y_ref.data(), nullptr);
    double worst = 0;
    for (size_t s = 0; s < n; ++s) {
      double xn = 0;
      for (int64_t j = 0; j < sh.in; ++j) xn += static_cast<double>(x[s * sh.in + j]) * x[s * sh.in + j];
      for (int64_t r = 0; r < sh.out; ++r) {
        double want = 0, wn = 0;
        for (int64_t j = 0; j < sh.in; ++j) {
          want += rows[r][j] * x[s * sh.in + j];
          wn += rows[r][j] * rows[r][j];
        }
        const double bound = 1e-6 * std::sqrt(wn * xn);
        const double e_simd = std::fabs(y[s * sh.out + r] - want), e_ref = std::fabs(y_ref[s * sh.out + r] - want);
        EXPECT_LE(e_simd, bound) << "row " << r << " token " << s;
        EXPECT_LE(e_ref, bound) << "row " << r << " token " << s;
        worst = std::max(worst, e_simd / std::sqrt(wn * xn));
      }
    }
    std::cout << "[" << sh.out << ", " << sh.in << "] " << sh.bits << " bits g" << sh.group << " block " << sh.block
              << ": largest |y - y_ref| / (||w|| ||x||) = " << worst << "\n";
    // The embedding-lookup path (weight_row: dequantized and rotated back) gives the reference rows.
    std::vector<float> row(static_cast<size_t>(sh.in));
    for (int64_t r = 0; r < sh.out; r += 5) {
      ops::weight_row(w, r, row.data());
      for (int64_t j = 0; j < sh.in; ++j) ASSERT_NEAR(row[j], rows[r][j], 1e-5) << "row " << r << " col " << j;
    }
  }
}

// Our Paley matrices and Sloane's are different Hadamard matrices: a rotation must use the family it was made with.
TEST(MlxTq, SloaneAndPaleyFamiliesDiffer) {
  for (int m : {12, 20, 28}) {
    const auto& s = Rotation::small_hadamard(m, HadamardFamily::sloane);
    const auto& p = Rotation::small_hadamard(m, HadamardFamily::paley);
    ASSERT_EQ(s.size(), static_cast<size_t>(m * m));
    EXPECT_NE(s, p) << m;
    EXPECT_EQ(s[0], 1);
    EXPECT_EQ(s[1], -1);  // Sloane's first row starts "+-"
  }
}

// ------------------------------------------------------------------ fixture folders

struct Golden {
  std::vector<int32_t> ids;
  std::vector<float> logits;  // [ids][vocab]
};
Golden read_golden(const std::string& folder) {
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(folder + "/logits.json"));
  Golden g;
  const auto& p = j["prompts"][0];
  for (const auto& i : p["ids"]) g.ids.push_back(i.get<int32_t>());
  for (const auto& row : p["logits"])
    for (const auto& v : row) g.logits.push_back(v.get<float>());
  return g;
}

// The largest max_v |a - b| / max_v |b| over the positions (runtime/batch_check.h's metric).
double max_relative_error(const std::vector<float>& a, const std::vector<float>& b, size_t vocab) {
  double worst = 0;
  for (size_t p = 0; p < b.size() / vocab; ++p) {
    double e = 0, r = 0;
    for (size_t v = 0; v < vocab; ++v) {
      e = std::max(e, std::fabs(static_cast<double>(a[p * vocab + v]) - b[p * vocab + v]));
      r = std::max(r, std::fabs(static_cast<double>(b[p * vocab + v])));
    }
    worst = std::max(worst, e / r);
  }
  return worst;
}

// Our float32 engine against the float64 forward over the dequantized weights: what is left is float rounding,
// measured 5e-7 to 7e-7; the bound is 1e-5 (our Paley H_20 in place of Sloane's gives 1.3; any wrong bit of
// layout, sign, order or level is far above the bound).
TEST(MlxTq, FixtureFoldersGiveTheLogitsOfTheirDequantizedWeights) {
  struct Expect {
    std::map<std::string, int> bits;  // layer -> bits
    size_t layers;
    int down_block;  // layer 0's down_proj rotation block; 0: kept in F16 (in = 160 is not a multiple of 64)
  };
  const std::map<std::string, Expect> expect = {
      {"llama-b4-g32", {{{"model.layers.0.self_attn.q_proj", 4}, {"model.layers.1.mlp.down_proj", 4}}, 14, 160}},  // H_20 (x) H_8
      {"llama-b3-g32-i96", {{{"model.layers.0.self_attn.q_proj", 3}, {"model.layers.1.mlp.up_proj", 3}}, 14, 96}},  // H_12 (x) H_8
      {"qwen2-b2-g64-attn3", {{{"model.layers.0.self_attn.k_proj", 3}, {"model.layers.1.mlp.up_proj", 2}}, 12, 0}},
  };
  for (const auto& [name, want] : expect) {
    SCOPED_TRACE(name);
    const std::string folder = kFixtures + "/" + name;
    const Golden g = read_golden(folder);
    CpuModel cpu(folder, 2);
    const ModelFiles& files = cpu.model->files();
    ASSERT_TRUE(files.mlx_tq != nullptr);
    std::map<std::string, MlxTqLayer> layers;
    for (const MlxTqLayer& l : files.mlx_tq->layers) layers[l.name] = l;
    for (const auto& [layer, b] : want.bits) {
      ASSERT_TRUE(layers.count(layer)) << layer;
      EXPECT_EQ(layers[layer].bits, b) << layer;
    }
    EXPECT_EQ(layers.size(), want.layers);
    if (want.down_block == 0)
      EXPECT_EQ(files.tensors().at("model.layers.0.mlp.down_proj.weight").dtype, DType::f16);
    else
      EXPECT_EQ(layers["model.layers.0.mlp.down_proj"].rotation_block, want.down_block);
    const size_t vocab = static_cast<size_t>(cpu.model->vocab_size());
    auto engine = testing_util::dense_engine(*cpu.model, "f32");
    const std::vector<float> prompt = testing_util::feed_all(*engine, engine->add_sequence(), g.ids, g.ids.size());
    const double e = max_relative_error(prompt, g.logits, vocab);
    std::cout << name << ": logits vs the dequantized weights' (float64): max relative error " << e << "\n";
    EXPECT_LT(e, 1e-5);
    // Decode, one token a step, gives the same logits.
    auto stepped_engine = testing_util::dense_engine(*cpu.model, "f32");
    const std::vector<float> stepped = testing_util::feed_all(*stepped_engine, stepped_engine->add_sequence(), g.ids, 1);
    EXPECT_LT(max_relative_error(stepped, g.logits, vocab), 1e-5);
  }
}

// ------------------------------------------------------------------ damaged folders

// A copy of fixture `name` whose tensors went through `edit` (name -> dtype, shape, bytes) and whose
// config.json went through `edit_config`.
struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
std::string damaged(const ScratchDir& dir, const std::string& name, const std::string& tag,
                    const std::function<void(std::map<std::string, RawTensor>&)>& edit,
                    const std::function<void(nlohmann::json&)>& edit_config = {}) {
  const std::string src = kFixtures + "/" + name, out = dir.file(tag);
  fs::create_directories(out);
  std::map<std::string, RawTensor> t;
  std::vector<std::string> order;
  {
    const SafetensorsModel st = SafetensorsModel::open(src);
    for (const TensorView& v : st.tensors().all()) {
      const auto* p = static_cast<const uint8_t*>(v.data);
      t[v.name] = RawTensor{dtype_name(v.dtype), v.shape, std::vector<uint8_t>(p, p + v.nbytes)};
      order.push_back(v.name);
    }
  }
  edit(t);
  SafetensorsWriter w;
  for (const std::string& n : order)
    if (t.count(n)) w.add_raw(n, t[n].dtype, t[n].shape, t[n].bytes);
  for (const auto& [n, r] : t)
    if (std::find(order.begin(), order.end(), n) == order.end()) w.add_raw(n, r.dtype, r.shape, r.bytes);
  write_bytes_to_file(out + "/model.safetensors", w.bytes());
  nlohmann::json c = nlohmann::json::parse(std::ifstream(src + "/config.json"));
  if (edit_config) edit_config(c);
  std::ofstream(out + "/config.json") << c.dump(2);
  return out;
}

std::vector<uint8_t> halves(std::initializer_list<float> v) {
  std::vector<uint8_t> b;
  for (float f : v) {
    const uint16_t h = f32_to_f16_bits(f);
    b.push_back(static_cast<uint8_t>(h & 0xff));
    b.push_back(static_cast<uint8_t>(h >> 8));
  }
  return b;
}

TEST(MlxTq, DamagedFoldersGiveClearErrors) {
  ScratchDir dir("mlx_tq_damaged");
  const std::string B3 = "llama-b3-g32-i96", q = "model.layers.0.self_attn.q_proj";
  // q_proj at 3 bits: [64, 64] -> 7 words a row, the last with 4 codes (bits 12..31 zero).
  auto set_word = [](RawTensor& r, size_t word, uint32_t value) { std::memcpy(r.bytes.data() + 4 * word, &value, 4); };
  expect_error([&] { open_model(damaged(dir, B3, "pad", [&](auto& t) { set_word(t[q + ".weight"], 6, 1u << 20); })); },
               {q + ".weight", "row 0 word 6", "padding"});
  expect_error([&] { open_model(damaged(dir, B3, "pad30", [&](auto& t) { set_word(t[q + ".weight"], 7 + 2, 1u << 31); })); },
               {q + ".weight", "row 1 word 2", "padding"});
  expect_error([&] {
    open_model(damaged(dir, B3, "short", [&](auto& t) {
      RawTensor& r = t[q + ".weight"];
      r.shape = {64, 6};
      r.bytes.resize(64 * 6 * 4);
    }));
  }, {q + ".weight", "6 words per row", "take 7"});
  expect_error([&] {
    open_model(damaged(dir, B3, "scales", [&](auto& t) {
      RawTensor& r = t[q + ".scales"];
      r.shape = {32, 4};
    }));
  }, {q + ".scales", "has shape [32, 4]", "expected [64, in / group]"});
  expect_error([&] {
    open_model(damaged(dir, B3, "group16", [&](auto& t) {
      RawTensor& r = t[q + ".scales"];
      r.shape = {64, 4};
      r.bytes.resize(64 * 4 * 2, 0);
    }));
  }, {q + ".scales", "groups of 16", "32, 64 or 128"});
  expect_error([&] {
    open_model(damaged(dir, B3, "nan_scale", [&](auto& t) {
      const std::vector<uint8_t> nan = halves({std::nanf("")});
      std::copy(nan.begin(), nan.end(), t[q + ".scales"].bytes.begin() + 4);  // row 1, group 0 (2 groups a row)
    }));
  }, {q + ".scales", "row 1, group 0", "finite"});
  // A 16-entry codebook on 3-bit codes: the packed width is 3 bits', the codebook 4 bits'.
  expect_error([&] {
    open_model(damaged(dir, B3, "bits", [&](auto& t) {
      RawTensor& r = t[q + ".codebook"];
      r.shape = {16};
      r.bytes.resize(32, 0);
    }));
  }, {q + ".weight", "7 words per row", "4 bits", "the width of 3-bit codes"});
  expect_error([&] { open_model(damaged(dir, B3, "config_bits", [](auto&) {}, [](nlohmann::json& c) { c["quantization"]["bits"] = 4; })); },
               {"3-bit codes", "gives it 4 bits"});
  expect_error([&] {
    open_model(damaged(dir, B3, "ternary", [&](auto& t) {
      RawTensor& r = t[q + ".codebook"];
      r.shape = {3};
      r.bytes = halves({-1.224f, 0.0f, 1.224f});
    }));
  }, {q + ".codebook", "3 entries", "ternary"});
  expect_error([&] { open_model(damaged(dir, B3, "no_signs", [&](auto& t) { t.erase(q + ".signs"); })); },
               {q + ".signs' is missing", "cannot be reproduced"});
  expect_error([&] {
    open_model(damaged(dir, B3, "bad_sign", [&](auto& t) {
      const std::vector<uint8_t> h = halves({0.5f});
      std::copy(h.begin(), h.end(), t[q + ".signs"].bytes.begin() + 2 * 5);
    }));
  }, {q + ".signs' entry 5", "not +1 or -1"});
  expect_error([&] {
    open_model(damaged(dir, B3, "moe", [&](auto& t) {
      t[q + ".weight"].shape = {1, 64, 7};
    }));
  }, {q + ".weight", "MoE switch layer"});
  expect_error([&] { open_model(damaged(dir, B3, "qjl", [&](auto& t) { t[q + ".qjl_norms"] = RawTensor{"F16", {64}, std::vector<uint8_t>(128, 0)}; })); },
               {q + ".qjl_norms", "QJL"});
  expect_error([&] {
    open_model(damaged(dir, B3, "affine", [&](auto& t) {
      t["model.embed_tokens.biases"] = RawTensor{"F16", {320, 1}, std::vector<uint8_t>(640, 0)};
    }));
  }, {"model.embed_tokens.biases", "affine"});
  expect_error([&] { open_model(damaged(dir, B3, "no_block", [](auto&) {}, [](nlohmann::json& c) { c.erase("quantization"); })); },
               {".weight' is U32", "\"turboquant\""});
  expect_error([&] { open_model(damaged(dir, B3, "qjl_config", [](auto&) {}, [](nlohmann::json& c) { c["quantization"]["use_qjl"] = true; })); },
               {"use_qjl", "QJL"});
}

}  // namespace
}  // namespace tq
