// TurboQuant weight folders end to end: convert -> load -> logits near the source model's (the demo model and
// the tiny random Llama fixture), decode = prompt, the skip rules, and clear errors for damaged folders.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/half.h"
#include "core/thread_pool.h"
#include "model/loader.h"
#include "model/model_test_util.h"
#include "model/tq_convert.h"
#include "model/tq_weights.h"
#include "model/writer.h"
#include "runtime/calibrate.h"
#include "runtime/generate.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

namespace fs = std::filesystem;
using testing_util::CpuModel;
using testing_util::expect_error;
using testing_util::ScratchDir;

const std::string kDemo = std::string(TQ_SOURCE_DIR) + "/models/demo";
const std::string kTinyLlama = std::string(TQ_SOURCE_DIR) + "/tests/fixtures/golden/llama";

std::string convert(const std::string& in, const std::string& out, int bits, int group, bool extras = false) {
  TqConvertOptions o;
  o.bits = bits;
  o.group_size = group;
  o.quantize_extras = extras;
  ThreadPool pool(2);
  convert_to_turboquant(in, out, o, pool);
  return out;
}

// Logits of every position of `ids`, [tokens][vocab], fed in chunks of `chunk`.
std::vector<float> logits_of(const std::string& path, const std::vector<int32_t>& ids, size_t chunk) {
  CpuModel cpu(path, 2);
  auto engine = testing_util::dense_engine(*cpu.model, "f32");
  return testing_util::feed_all(*engine, engine->add_sequence(), ids, chunk);
}

struct Compare {
  double rel_error = 0;  // ||a - b|| / ||b|| over all logits
  double top1 = 0;       // positions whose argmax agrees
};
Compare compare(const std::vector<float>& a, const std::vector<float>& b, size_t vocab) {
  Compare c;
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
  c.rel_error = std::sqrt(e / r);
  c.top1 = static_cast<double>(agree) / static_cast<double>(a.size() / vocab);
  return c;
}

// A dense F32 copy of a converted folder: every tensor as the loader reads it (TQ ones dequantized and rotated
// back). The TQ model must give this model's logits up to float rounding: what is left is the format's error.
std::string dequantized_copy(const std::string& tq_folder, const std::string& out) {
  fs::create_directories(out);
  ModelFiles files = open_model(tq_folder);
  SafetensorsWriter w;
  for (const TensorView& t : files.tensors().all()) {
    const std::string& n = t.name;
    if (n.ends_with(".tq_codes") || n.ends_with(".tq_scales")) continue;
    w.add(n, DType::f32, t.shape, read_tensor_f32(t));
  }
  write_bytes_to_file(out + "/model.safetensors", w.bytes());
  nlohmann::json c = nlohmann::json::parse(std::ifstream(tq_folder + "/config.json"));
  c.erase("quantization");
  std::ofstream(out + "/config.json") << c.dump(2);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"})
    if (fs::exists(tq_folder + "/" + f)) fs::copy_file(tq_folder + "/" + f, out + "/" + f);
  return out;
}

// The bounds below were measured with a margin of about 1.5x (printed by the tests): the logits' relative
// L2 error of TQ4 g64 is ~0.1 x the weights' (~0.096), as the error of each product partly averages out.
TEST(TqModel, DemoModelConvertedLogitsStayNearTheOriginal) {
  ScratchDir dir("tq_demo");
  const size_t vocab = static_cast<size_t>(open_model(kDemo).config.vocab_size);
  const std::vector<int32_t> ids = testing_util::random_tokens(24, 7, static_cast<int>(vocab));
  const std::vector<float> base = logits_of(kDemo, ids, ids.size());
  const double bound[5] = {0, 0, 0.4, 0.2, 0.1};  // measured 0.25, 0.13, 0.068
  for (int bits : {4, 3, 2}) {
    const std::string out = convert(kDemo, dir.file("tq" + std::to_string(bits)), bits, 64);
    const std::vector<float> got = logits_of(out, ids, ids.size());
    const Compare c = compare(got, base, vocab);
    std::cout << "demo TQ" << bits << " g64: logits rel error " << c.rel_error << ", top-1 agreement " << c.top1 << "\n";
    EXPECT_LT(c.rel_error, bound[bits]) << "TQ" << bits;
    if (bits == 4) {
      EXPECT_GE(c.top1, 0.75);
      // Decode (one token a step) gives the prompt's logits: the products are the same bits.
      const std::vector<float> stepped = logits_of(out, ids, 1);
      EXPECT_LT(compare(stepped, got, vocab).rel_error, 1e-5);
    }
  }
}

// models/demo-tq4 (what scripts/demo runs) is exactly the conversion its documentation names
// (turboquant-convert models/demo --bits 4 --group-size 64 --codebook lloyd_absmax --norm-correction), so the
// quality table of docs/BENCHMARKS.md measured this file, and it stays near the F16 model's logits.
TEST(TqModel, ShippedDemoTq4IsItsDocumentedConversion) {
  const std::string shipped = std::string(TQ_SOURCE_DIR) + "/models/demo-tq4";
  ScratchDir dir("tq_demo_shipped");
  TqConvertOptions o;
  o.bits = 4;
  o.group_size = 64;
  o.codebook = ops::TqCodebook::lloyd_absmax;
  o.scale_fit = ops::TqScaleFit::norm_correction;
  ThreadPool pool(2);
  const std::string out = dir.file("tq4");
  convert_to_turboquant(kDemo, out, o, pool);
  auto bytes = [](const std::string& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_TRUE(bytes(out + "/model.safetensors") == bytes(shipped + "/model.safetensors"))
      << "models/demo-tq4 is not the documented conversion of models/demo: re-make it";
  EXPECT_EQ(nlohmann::json::parse(bytes(out + "/config.json")), nlohmann::json::parse(bytes(shipped + "/config.json")));
  const size_t vocab = static_cast<size_t>(open_model(kDemo).config.vocab_size);
  const std::vector<int32_t> ids = testing_util::random_tokens(24, 7, static_cast<int>(vocab));
  const Compare c = compare(logits_of(shipped, ids, ids.size()), logits_of(kDemo, ids, ids.size()), vocab);
  std::cout << "models/demo-tq4: logits rel error " << c.rel_error << ", top-1 agreement " << c.top1 << "\n";
  EXPECT_LT(c.rel_error, 0.1);
  EXPECT_GE(c.top1, 0.75);
}

TEST(TqModel, TinyRandomLlamaConvertsAllItsMatricesAndStaysNear) {
  ScratchDir dir("tq_tiny");
  // Group 32: intermediate_size 160 = 5 groups, and a rotation block of 160 = 20 * 8 (the Paley H20 path).
  const std::string out = convert(kTinyLlama, dir.file("tq4"), 4, 32, /*extras=*/true);
  ModelFiles files = open_model(out);
  EXPECT_EQ(files.weights.layers[0].w_down->dtype, DType::tq4);
  EXPECT_EQ(files.weights.layers[0].w_down->tq.rotation_block, 160);
  EXPECT_EQ(files.weights.embed->dtype, DType::tq4);     // --quantize-extras
  EXPECT_EQ(files.weights.lm_head->dtype, DType::tq4);
  EXPECT_EQ(files.weights.final_norm->dtype, DType::f32);  // norms never
  // q/k/v share a rotation (one rotated input), gate/up another, o and down their own.
  const LayerWeights& L = files.weights.layers[0];
  EXPECT_EQ(L.wq->tq.seed, L.wk->tq.seed);
  EXPECT_EQ(L.wq->tq.seed, L.wv->tq.seed);
  EXPECT_EQ(L.w_gate->tq.seed, L.w_up->tq.seed);
  EXPECT_NE(L.wq->tq.seed, L.wo->tq.seed);
  EXPECT_NE(L.w_gate->tq.seed, L.wq->tq.seed);
  // The weights come back within the codebook's error.
  ModelFiles src = open_model(kTinyLlama);
  const std::vector<float> a = read_tensor_f32(*L.w_down), b = read_tensor_f32(*src.weights.layers[0].w_down);
  double e = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    e += (a[i] - b[i]) * (a[i] - b[i]);
    r += b[i] * b[i];
  }
  EXPECT_LT(std::sqrt(e / r), 0.11);
  const int vocab = static_cast<int>(src.config.vocab_size);
  const std::vector<int32_t> ids = testing_util::random_tokens(12, 3, vocab);
  const Compare c = compare(logits_of(out, ids, ids.size()), logits_of(kTinyLlama, ids, ids.size()), static_cast<size_t>(vocab));
  std::cout << "tiny llama TQ4 g32 (extras): logits rel error " << c.rel_error << ", top-1 " << c.top1 << "\n";
  // A random-weight model has no structure that averages errors out: 0.35 measured with every matrix,
  // the embedding and the head quantized (0.1 each).
  EXPECT_LT(c.rel_error, 0.5);
  // Against the same weights dequantized into a dense model: only float rounding and the rotations remain.
  const std::string dense = dequantized_copy(out, dir.file("dequantized"));
  const Compare d = compare(logits_of(out, ids, ids.size()), logits_of(dense, ids, ids.size()), static_cast<size_t>(vocab));
  std::cout << "tiny llama TQ4 vs its dequantized dense copy: logits rel error " << d.rel_error << "\n";
  EXPECT_LT(d.rel_error, 1e-5);
  EXPECT_EQ(d.top1, 1.0);
}

// ---- the converter's fits: the mse scale and GPTQ (ops/tq_fit.h), written, loaded and run

// A calibration text of our own (the demo model was trained on English prose), long enough for a few windows.
std::string write_calibration_text(const std::string& path) {
  const char* sentences[] = {
      "The morning was cold, and the lane that ran past the church was still white with frost when she set out. ",
      "Her brother had promised to walk with her as far as the mill, but he had not come down to breakfast. ",
      "She did not mind; the road was familiar, and she liked to think without being asked what she was thinking. ",
      "At the bridge she stopped to watch the water, which was high after the rain and carried leaves and branches. ",
      "A cart came slowly up the hill behind her, and the driver lifted his hat and said it would snow before night. ",
      "She thanked him, though she did not believe it, and went on towards the house where her aunt was waiting. ",
  };
  std::ofstream out(path);
  for (int round = 0; round < 12; ++round)
    for (int i = 0; i < 6; ++i) out << sentences[(i + round) % 6];
  return path;
}

TEST(TqModel, MseScaleFitAndGptqConversionsLoadRunAndLowerTheirErrors) {
  ScratchDir dir("tq_fits");
  ThreadPool pool(2);
  auto run = [&](const std::string& name, ops::TqScaleFit fit, const TqCalibration* cal) {
    TqConvertOptions o;
    o.bits = 3;
    o.group_size = 64;
    o.scale_fit = fit;
    o.calibration = cal;
    const std::string out = dir.file(name);
    return std::pair{out, convert_to_turboquant(kDemo, out, o, pool)};
  };
  const auto [plain, plain_report] = run("plain", ops::TqScaleFit::plain, nullptr);
  const auto [mse, mse_report] = run("mse", ops::TqScaleFit::mse, nullptr);
  // The mse fit never has more weight error than the plain scale (each group keeps the better of the two).
  ASSERT_EQ(plain_report.tensors.size(), mse_report.tensors.size());
  for (size_t i = 0; i < plain_report.tensors.size(); ++i) {
    if (!plain_report.tensors[i].quantized) continue;
    EXPECT_LE(mse_report.tensors[i].rel_error, plain_report.tensors[i].rel_error * (1 + 1e-6)) << plain_report.tensors[i].name;
    EXPECT_FALSE(mse_report.tensors[i].gptq);
  }
  EXPECT_EQ(read_tq_quantization(mse)->scale_fit, "mse");
  EXPECT_EQ(read_tq_quantization(plain)->scale_fit, "plain");
  EXPECT_FALSE(nlohmann::json::parse(std::ifstream(plain + "/config.json"))["quantization"].contains("scale_fit"));

  // GPTQ, calibrated on a text of our own.
  CalibrationOptions co;
  co.tokens = 1024;
  co.ctx = 256;
  const TqCalibration cal = calibrate_linear_inputs(kDemo, write_calibration_text(dir.file("calibration.txt")), co);
  EXPECT_EQ(cal.tokens, 1024);
  EXPECT_EQ(cal.hessians.count("model.layers.0.self_attn.qkv_proj"), 1u);
  EXPECT_EQ(cal.hessians.count("model.layers.7.mlp.down_proj"), 1u);
  EXPECT_EQ(cal.cols.at("model.layers.7.mlp.down_proj"), 768);
  const auto [gptq, gptq_report] = run("gptq", ops::TqScaleFit::plain, &cal);
  for (const TqTensorReport& t : gptq_report.tensors) EXPECT_EQ(t.gptq, t.quantized) << t.name;
  const nlohmann::json q = nlohmann::json::parse(std::ifstream(gptq + "/config.json"))["quantization"];
  EXPECT_EQ(q["calibration"]["method"], "gptq");
  EXPECT_EQ(q["calibration"]["tokens"], 1024);

  // Every folder loads and runs. GPTQ minimises the layers' output error on the calibration inputs, so on
  // those tokens its logits are nearer the source model's than plain rounding's.
  CpuModel src(kDemo, 1);
  const auto tok = load_model_tokenizer(src.model->files());
  EncodeOptions eo;
  eo.add_special_tokens = false;
  std::ifstream in(dir.file("calibration.txt"));
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  std::vector<int32_t> ids = tok->encode(text, eo);
  ids.resize(128);
  const size_t vocab = static_cast<size_t>(src.model->vocab_size());
  const std::vector<float> base = logits_of(kDemo, ids, ids.size());
  const Compare cp = compare(logits_of(plain, ids, ids.size()), base, vocab);
  const Compare cm = compare(logits_of(mse, ids, ids.size()), base, vocab);
  const Compare cg = compare(logits_of(gptq, ids, ids.size()), base, vocab);
  std::cout << "demo TQ3 g64 on calibration tokens: logits rel error plain " << cp.rel_error << ", mse " << cm.rel_error << ", GPTQ "
            << cg.rel_error << "; top-1 " << cp.top1 << " / " << cm.top1 << " / " << cg.top1 << "\n";
  EXPECT_LT(cm.rel_error, 0.2);
  EXPECT_LT(cg.rel_error, 0.8 * cp.rel_error);

  // A model whose H matrices do not fit the memory budget is refused before it runs, with the numbers.
  CalibrationOptions tight = co;
  tight.memory_budget_bytes = 1 << 20;
  expect_error([&] { calibrate_linear_inputs(kDemo, dir.file("calibration.txt"), tight); },
               {"GPTQ calibration of", "input matrices H", "more than the 1048576 bytes of the memory budget"});

  // A calibration with nothing in it, or without a layer's input, is refused by name.
  TqCalibration empty;
  expect_error([&] { run("none", ops::TqScaleFit::plain, &empty); }, {"calibration of no tokens"});
  TqCalibration partial = cal;
  partial.hessians.erase("model.layers.3.mlp.down_proj");
  expect_error([&] { run("partial", ops::TqScaleFit::plain, &partial); }, {"no inputs of 'model.layers.3.mlp.down_proj'"});
}

// ---- damaged folders

nlohmann::json read_json(const std::string& p) { return nlohmann::json::parse(std::ifstream(p)); }
void write_json(const std::string& p, const nlohmann::json& j) { std::ofstream(p) << j.dump(2); }

// Byte offset in model.safetensors of tensor `name`'s data.
uint64_t data_offset(const std::string& file, const std::string& name) {
  std::ifstream f(file, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string h(n, ' ');
  f.read(h.data(), static_cast<std::streamsize>(n));
  return 8 + n + nlohmann::json::parse(h)[name]["data_offsets"][0].get<uint64_t>();
}

TEST(TqModel, DamagedFoldersGiveClearErrors) {
  ScratchDir dir("tq_bad");
  const std::string good = convert(kDemo, dir.file("good"), 4, 64);
  const std::string q = "model.layers.0.self_attn.q_proj";
  auto variant = [&](const std::string& tag) {
    const std::string p = dir.file(tag);
    fs::copy(good, p);
    return p;
  };
  {  // config says 3 bits, the codes are 4-bit
    const std::string p = variant("bits");
    nlohmann::json c = read_json(p + "/config.json");
    c["quantization"]["tensors"][q]["bits"] = 3;
    write_json(p + "/config.json", c);
    expect_error([&] { open_model(p); }, {q + ".tq_codes", "expected [256, 96]", "3 bits"});
  }
  {  // group size 32 in the config: the scales have the shape of 64
    const std::string p = variant("group");
    nlohmann::json c = read_json(p + "/config.json");
    c["quantization"]["tensors"][q]["group_size"] = 32;
    write_json(p + "/config.json", c);
    expect_error([&] { open_model(p); }, {q + ".tq_scales", "has shape [256, 4]", "expected [256, 8]"});
  }
  {  // a NaN scale in the packed data
    const std::string p = variant("nan");
    const uint64_t at = data_offset(p + "/model.safetensors", q + ".tq_scales");
    std::fstream f(p + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at + 2 * 5));
    const uint16_t nan = 0x7e00;
    f.write(reinterpret_cast<const char*>(&nan), 2);
    f.close();
    expect_error([&] { open_model(p); }, {q + ".tq_scales", "row 1, group 1", "finite"});
  }
  {  // a plane the config does not list
    const std::string p = variant("orphan");
    nlohmann::json c = read_json(p + "/config.json");
    c["quantization"]["tensors"].erase(q);
    write_json(p + "/config.json", c);
    expect_error([&] { open_model(p); }, {q + ".tq_codes", "does not list"});
  }
  {  // planes but no quantization block
    const std::string p = variant("nomode");
    nlohmann::json c = read_json(p + "/config.json");
    c.erase("quantization");
    write_json(p + "/config.json", c);
    expect_error([&] { open_model(p); }, {"TurboQuant plane", "no quantization block"});
  }
  {  // level tables of another codebook
    const std::string p = variant("levels");
    nlohmann::json c = read_json(p + "/config.json");
    c["quantization"]["levels"]["b4_g64"][3] = 0.5;
    write_json(p + "/config.json", c);
    expect_error([&] { open_model(p); }, {"quantization.levels.b4_g64[3]", "lloyd_max"});
  }
  {  // bits outside 2..4
    const std::string p = variant("bits5");
    nlohmann::json c = read_json(p + "/config.json");
    c["quantization"]["tensors"][q]["bits"] = 5;
    write_json(p + "/config.json", c);
    expect_error([&] { open_model(p); }, {"bits is 5", "2, 3 or 4"});
  }
  // The converter never overwrites, and leaves nothing when it refuses.
  expect_error([&] { convert(kDemo, good, 4, 64); }, {"exists", "never overwrites"});
  expect_error([&] { convert(kDemo, dir.file("odd"), 4, 48); }, {"group size must be 32, 64 or 128"});
  EXPECT_FALSE(fs::exists(dir.file("odd")));
}

}  // namespace
}  // namespace tq
