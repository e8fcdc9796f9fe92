// Reading a model from its headers only (open_model_headers, SafetensorsRead::header_only): the tensor
// tables of dtypes the reader cannot compute with (the reference system's TurboQuant folders: U32 codes)
// are listed as flat bytes after their byte counts are checked; the weights reader still refuses them.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/loader.h"
#include "model/model_test_util.h"
#include "model/safetensors.h"

namespace tq {
namespace {

// A safetensors file of the given header JSON and `data_bytes` bytes of data.
std::vector<uint8_t> safetensors_bytes(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> b(8 + header.size() + data_bytes, 0);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) b[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(b.data() + 8, header.data(), header.size());
  return b;
}

const std::string kHeader =
    R"({"model.layers.0.self_attn.q_proj.weight":{"dtype":"U32","shape":[64,8],"data_offsets":[0,2048]},)"
    R"("model.layers.0.self_attn.q_proj.scales":{"dtype":"F16","shape":[64,1],"data_offsets":[2048,2176]},)"
    R"("model.norm.weight":{"dtype":"F32","shape":[64],"data_offsets":[2176,2432]}})";

// U32 (the reference system's packed codes) is a dtype of its own since the MLX tq loader (model/mlx_tq.h):
// both modes list it as stored; the byte count must agree with it either way.
TEST(ModelHeaders, ListsDtypesItCannotComputeWithAsBytes) {
  const SafetensorsFile f = SafetensorsFile::parse(MappedFile::from_bytes("ref.safetensors", safetensors_bytes(kHeader, 2432)),
                                                   SafetensorsRead::header_only);
  ASSERT_EQ(f.tensors().size(), 3u);
  const TensorView& codes = f.tensors()[0];
  EXPECT_EQ(codes.name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(codes.dtype, DType::u32);
  EXPECT_EQ(codes.shape, (std::vector<int64_t>{64, 8}));
  EXPECT_EQ(codes.nbytes, 2048u);
  EXPECT_EQ(f.tensors()[1].dtype, DType::f16);  // supported dtypes keep theirs
  const SafetensorsFile full = SafetensorsFile::parse(MappedFile::from_bytes("ref.safetensors", safetensors_bytes(kHeader, 2432)));
  EXPECT_EQ(full.tensors()[0].dtype, DType::u32);
  // A byte count that disagrees with the dtype and shape is refused in either mode.
  std::string bad = kHeader;
  bad.replace(bad.find("[64,8]"), 6, "[64,9]");
  testing_util::expect_error(
      [&] { SafetensorsFile::parse(MappedFile::from_bytes("bad.safetensors", safetensors_bytes(bad, 2432)), SafetensorsRead::header_only); },
      {"shape [64, 9] of U32 needs 2304 bytes", "hold 2048"});
  // An unknown dtype stays an error.
  std::string unknown = kHeader;
  unknown.replace(unknown.find("\"U32\""), 5, "\"Q9\"");
  testing_util::expect_error(
      [&] { SafetensorsFile::parse(MappedFile::from_bytes("q9.safetensors", safetensors_bytes(unknown, 2432)), SafetensorsRead::header_only); },
      {"unknown dtype 'Q9'"});
}

// A folder laid out as the reference system writes its TurboQuant weights (config.json quantization.mode
// "turboquant", U32 codes): open_model_headers reads its config and sizes, open_model refuses its dtypes.
TEST(ModelHeaders, ReadsAReferenceTurboQuantFolder) {
  const std::string golden = std::string(TQ_SOURCE_DIR) + "/tests/fixtures/golden/llama/config.json";
  if (!std::filesystem::exists(golden)) GTEST_SKIP() << golden << " is absent";
  testing_util::ScratchDir dir("ref_tq");
  std::ifstream in(golden);
  std::string config((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  config.insert(config.find('{') + 1, R"("quantization": {"mode": "turboquant", "bits": 4, "group_size": 64},)");
  std::ofstream(dir.file("config.json")) << config;
  const std::vector<uint8_t> bytes = safetensors_bytes(kHeader, 2432);
  std::ofstream(dir.file("model.safetensors"), std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                                       static_cast<std::streamsize>(bytes.size()));
  const ModelFiles m = open_model_headers(dir.path());
  EXPECT_EQ(m.config.num_hidden_layers, 2);
  EXPECT_EQ(file_tensor_bytes(m.tensors()), 2432);
  EXPECT_TRUE(m.weights.layers.empty());  // no weight checks
  // A loading run reads it as an MLX tq folder: these codes lack the codebook and signs such a layer has.
  testing_util::expect_error([&] { open_model(dir.path()); }, {"q_proj.weight", "is U32 but has no '.codebook' beside it"});
}

}  // namespace
}  // namespace tq
