// MappedFile, tensor conversions, and the safetensors / GGUF readers on files built here:
// round trips, every kind of corruption, and random mutations that must never crash.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "model/gguf.h"
#include "model/mapped_file.h"
#include "model/model_test_util.h"
#include "model/safetensors.h"
#include "model/tensor.h"
#include "model/writer.h"

namespace tq {
namespace {

using testing_util::error_message;
using testing_util::expect_error;
using testing_util::ScratchDir;
using Bytes = std::vector<uint8_t>;

std::vector<float> ramp(size_t n, float scale = 0.25f, float offset = -1.0f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = offset + scale * static_cast<float>(i);
  return v;
}

std::vector<float> gaussian(size_t n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

void put_u64(Bytes& b, size_t at, uint64_t v) {
  for (int k = 0; k < 8; ++k) b[at + k] = static_cast<uint8_t>(v >> (8 * k));
}
void put_u32(Bytes& b, size_t at, uint32_t v) {
  for (int k = 0; k < 4; ++k) b[at + k] = static_cast<uint8_t>(v >> (8 * k));
}

// ---------------------------------------------------------------- MappedFile

TEST(MappedFile, MapsAFileAndKeepsItsAddressWhenMoved) {
  ScratchDir dir("map");
  const Bytes content = {1, 2, 3, 4, 5};
  write_bytes_to_file(dir.file("a.bin"), content);
  MappedFile f = MappedFile::open(dir.file("a.bin"));
  ASSERT_EQ(f.size(), 5u);
  EXPECT_TRUE(f.is_mapped());
  EXPECT_EQ(std::memcmp(f.data(), content.data(), 5), 0);
  const uint8_t* where = f.data();
  MappedFile g = std::move(f);
  EXPECT_EQ(g.data(), where);
  EXPECT_EQ(g.path(), dir.file("a.bin"));
  EXPECT_EQ(f.data(), nullptr);
}

TEST(MappedFile, FromBytesKeepsItsAddressWhenMoved) {
  MappedFile f = MappedFile::from_bytes("mem", {9, 8, 7});
  const uint8_t* where = f.data();
  MappedFile g = std::move(f);
  EXPECT_EQ(g.data(), where);
  EXPECT_EQ(g.data()[2], 7);
  static const uint8_t kStatic[] = {4, 5};
  MappedFile b = MappedFile::borrow("static", kStatic, 2);
  EXPECT_EQ(b.data(), kStatic);
}

TEST(MappedFile, ClearErrors) {
  ScratchDir dir("maperr");
  expect_error([&] { MappedFile::open(dir.file("missing.bin")); }, {"missing.bin", "no such file"});
  expect_error([&] { MappedFile::open(dir.path()); }, {dir.path(), "directory"});
  write_bytes_to_file(dir.file("empty.bin"), {});
  expect_error([&] { MappedFile::open(dir.file("empty.bin")); }, {"empty.bin", "empty"});
  expect_error([&] { MappedFile::from_bytes("nothing", {}); }, {"nothing", "empty"});
}

TEST(MappedFile, PermissionDenied) {
  ScratchDir dir("mapperm");
  write_bytes_to_file(dir.file("secret.bin"), {1});
  ::chmod(dir.file("secret.bin").c_str(), 0);
  if (::access(dir.file("secret.bin").c_str(), R_OK) == 0) {
    GTEST_SKIP() << "running with privileges that ignore file permissions; permission case not testable";
  }
  expect_error([&] { MappedFile::open(dir.file("secret.bin")); }, {"secret.bin", "permission denied"});
}

// ---------------------------------------------------------------- tensors

TEST(Tensor, ReadRowConvertsEveryDtype) {
  // F16 and BF16 values that are exact in both formats, and Q8_0 from its definition d * q.
  const std::vector<float> exact = {1.0f, -2.5f, 0.125f, 3.0f, -0.0f, 96.0f, 7.0f, -1.75f};
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    const Bytes bytes = encode_values(dt, exact);
    TensorView v{"t", dt, {2, 4}, bytes.data(), bytes.size(), "mem"};
    std::vector<float> row(4);
    read_row_f32(v, 1, row.data());
    for (int i = 0; i < 4; ++i) EXPECT_EQ(row[i], exact[4 + i]) << dtype_name(dt);
    EXPECT_EQ(read_tensor_f32(v), exact) << dtype_name(dt);
  }
  Bytes q(2 * kQ8_0BlockBytes);  // [2, 32]: two rows of one block each
  for (int r = 0; r < 2; ++r) {
    const uint16_t d = f32_to_f16_bits(r == 0 ? 0.5f : -0.03125f);
    std::memcpy(q.data() + r * kQ8_0BlockBytes, &d, 2);
    for (int j = 0; j < 32; ++j) q[r * kQ8_0BlockBytes + 2 + j] = static_cast<uint8_t>(static_cast<int8_t>(j * 8 - 127));
  }
  TensorView v{"q", DType::q8_0, {2, 32}, q.data(), q.size(), "mem"};
  std::vector<float> row(32);
  read_row_f32(v, 1, row.data());
  for (int j = 0; j < 32; ++j) EXPECT_EQ(row[j], -0.03125f * static_cast<float>(j * 8 - 127));
  expect_error([&] { read_row_f32(v, 2, row.data()); }, {"mem", "row 2", "out of range"});
}

TEST(Tensor, Q8_0EncodingIsWithinHalfAStep) {
  const std::vector<float> x = gaussian(4 * 64, 3);
  const Bytes bytes = encode_values(DType::q8_0, x);
  ASSERT_EQ(bytes.size(), x.size() / 32 * 34);
  TensorView v{"q", DType::q8_0, {4, 64}, bytes.data(), bytes.size(), "mem"};
  const std::vector<float> y = read_tensor_f32(v);
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    const float step = round_to_f16(amax / 127);
    for (int j = 0; j < 32; ++j) EXPECT_LE(std::fabs(y[b + j] - x[b + j]), 0.5f * step * 1.0001f);
  }
}

TEST(Tensor, BytesChecksShapes) {
  EXPECT_EQ(tensor_bytes(DType::f32, {3, 5}), 60u);
  EXPECT_EQ(tensor_bytes(DType::bf16, {}), 2u);
  EXPECT_EQ(tensor_bytes(DType::f16, {0, 7}), 0u);
  EXPECT_EQ(tensor_bytes(DType::q8_0, {2, 64}), 4u * 34);
  EXPECT_FALSE(tensor_bytes(DType::q8_0, {2, 48}).has_value());
  EXPECT_FALSE(tensor_bytes(DType::f32, {-1, 2}).has_value());
  EXPECT_FALSE(tensor_bytes(DType::f32, {int64_t{1} << 40, int64_t{1} << 30}).has_value());
}

TEST(TensorSet, DuplicatesAndAliases) {
  TensorSet set("model");
  set.add({"a", DType::f32, {1}, nullptr, 4, "f1"});
  expect_error([&] { set.add({"a", DType::f32, {1}, nullptr, 4, "f2"}); }, {"model", "'a'", "f1", "f2"});
  set.add_alias("b", "a");
  EXPECT_EQ(set.find("b"), set.find("a"));
  expect_error([&] { set.add_alias("c", "zzz"); }, {"'zzz'"});
  expect_error([&] { set.at("nope"); }, {"model", "'nope'"});
}

// ---------------------------------------------------------------- safetensors

Bytes small_safetensors() {
  SafetensorsWriter w;
  w.add("w.f32", DType::f32, {2, 3}, ramp(6));
  w.add("w.f16", DType::f16, {4}, ramp(4, 0.5f));
  w.add("w.bf16", DType::bf16, {2, 2}, ramp(4, -2.0f, 3.0f));
  w.add("empty", DType::f32, {0, 4}, {});
  w.set_metadata("format", "pt");
  return w.bytes();
}

SafetensorsFile parse_st(Bytes b, const std::string& name = "test.safetensors") {
  return SafetensorsFile::parse(MappedFile::from_bytes(name, std::move(b)));
}

TEST(Safetensors, RoundTrip) {
  ScratchDir dir("st");
  write_bytes_to_file(dir.file("model.safetensors"), small_safetensors());
  const SafetensorsFile f = SafetensorsFile::open(dir.file("model.safetensors"));
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView& t : f.tensors()) by_name[t.name] = &t;
  const TensorView& a = *by_name.at("w.f32");
  EXPECT_EQ(a.dtype, DType::f32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.file, dir.file("model.safetensors"));
  EXPECT_EQ(read_tensor_f32(a), ramp(6));
  EXPECT_EQ(read_tensor_f32(*by_name.at("w.f16")), ramp(4, 0.5f));
  EXPECT_EQ(read_tensor_f32(*by_name.at("w.bf16")), ramp(4, -2.0f, 3.0f));
  EXPECT_EQ(by_name.at("empty")->numel(), 0);
  // The data is the mapping itself, not a copy.
  const uint8_t* p = static_cast<const uint8_t*>(a.data);
  EXPECT_GT(p, static_cast<const uint8_t*>(nullptr));
  float first;
  std::memcpy(&first, p, 4);
  EXPECT_EQ(first, -1.0f);
}

TEST(Safetensors, EveryTruncationIsAnError) {
  const Bytes full = small_safetensors();
  for (size_t len = 1; len < full.size(); ++len) {
    const std::string msg = error_message([&] { parse_st(Bytes(full.begin(), full.begin() + len), "cut.safetensors"); });
    EXPECT_NE(msg.find("cut.safetensors"), std::string::npos) << "length " << len << ": " << msg;
  }
  ScratchDir dir("sttrunc");
  write_bytes_to_file(dir.file("t.safetensors"), Bytes(full.begin(), full.end() - 3));
  expect_error([&] { SafetensorsFile::open(dir.file("t.safetensors")); },
               {"t.safetensors", "run past the end of the data"});
}

const char* kOneTensorHeader = R"({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})";

TEST(Safetensors, HeaderLengthProblems) {
  Bytes b = SafetensorsWriter::assemble(kOneTensorHeader, Bytes(16));
  EXPECT_NO_THROW(parse_st(b));
  Bytes huge = b;
  put_u64(huge, 0, b.size());  // header longer than the file
  expect_error([&] { parse_st(huge, "h.safetensors"); }, {"h.safetensors", "header length", "past the end"});
  put_u64(huge, 0, ~uint64_t{0});
  expect_error([&] { parse_st(huge, "h.safetensors"); }, {"h.safetensors", "header length"});
  put_u64(huge, 0, 0);
  expect_error([&] { parse_st(huge, "h.safetensors"); }, {"h.safetensors", "header length is 0"});
  expect_error([&] { parse_st({1, 2, 3}, "tiny.safetensors"); }, {"tiny.safetensors", "too short"});
}

TEST(Safetensors, HeaderContentProblems) {
  struct Case {
    std::string header;
    size_t data_bytes;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {R"({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]})", 16, {"not valid JSON"}},
      {R"([1, 2])", 0, {"does not start with '{'"}},
      {R"({"x": 3})", 0, {"'x'", "not a JSON object"}},
      {R"({"x": {"shape": [1], "data_offsets": [0, 4]}})", 4, {"'x'", "dtype"}},
      {R"({"x": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}})", 4, {"'x'", "unknown dtype 'Q4'"}},
      {R"({"x": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}})", 4, {"'x'", "dtype I8 is not supported"}},
      {R"({"x": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}})", 4, {"F8_E4M3 is not supported"}},
      {R"({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4, {"'x'", "shape"}},
      {R"({"x": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4, {"'x'", "shape"}},
      {R"({"x": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})", 4, {"'x'", "shape"}},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4, {"'x'", "data_offsets"}},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", 4, {"'x'", "end before they begin"}},
      {R"({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 100]}})", 16, {"'x'", "past the end"}},
      {R"({"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}})", 16, {"'x'", "needs 24 bytes", "hold 16"}},
      {R"({"x": {"dtype": "F32", "shape": [4000000000, 4000000000, 4000000000], "data_offsets": [0, 16]}})", 16,
       {"'x'", "too large"}},
      {R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
       24, {"'a'", "'b'", "overlap"}},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
       8, {"names 'a' twice"}},
      {R"({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4, {"empty name"}},
      {R"({"__metadata__": [1], "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4, {"__metadata__"}},
      {"{\"x\xff\": 1}", 0, {"not valid JSON"}},
  };
  for (const Case& c : cases) {
    const std::string msg = error_message([&] { parse_st(SafetensorsWriter::assemble(c.header, Bytes(c.data_bytes)), "bad.safetensors"); });
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << c.header << " -> " << msg;
    for (const std::string& n : c.needles) EXPECT_NE(msg.find(n), std::string::npos) << c.header << " -> " << msg;
  }
}

TEST(Safetensors, MetadataAliasResolvesTiedTensor) {
  ScratchDir dir("alias");
  SafetensorsWriter w;
  w.add("lm_head.weight", DType::f32, {3, 2}, ramp(6));
  w.set_metadata("format", "pt");
  w.set_metadata("model.embed_tokens.weight", "lm_head.weight");
  write_bytes_to_file(dir.file("model.safetensors"), w.bytes());
  const SafetensorsModel m = SafetensorsModel::open(dir.path());
  EXPECT_EQ(m.tensors().size(), 1u);
  const TensorView* e = m.tensors().find("model.embed_tokens.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e, m.tensors().find("lm_head.weight"));
  EXPECT_EQ(m.tensors().find("format"), nullptr);  // "pt" is no tensor: not an alias
}

// Writes a two-shard model into dir; `edit` may change the index before it is written.
void write_sharded(const ScratchDir& dir, const std::function<void(nlohmann::json&)>& edit = {}) {
  SafetensorsWriter a, b;
  a.add("t.a", DType::bf16, {2, 2}, ramp(4));
  a.add("t.b", DType::f32, {3}, ramp(3));
  b.add("t.c", DType::f16, {5}, ramp(5));
  write_bytes_to_file(dir.file("model-00001-of-00002.safetensors"), a.bytes());
  write_bytes_to_file(dir.file("model-00002-of-00002.safetensors"), b.bytes());
  nlohmann::json index = {{"metadata", {{"total_size", 8 + 12 + 10}}},
                          {"weight_map",
                           {{"t.a", "model-00001-of-00002.safetensors"},
                            {"t.b", "model-00001-of-00002.safetensors"},
                            {"t.c", "model-00002-of-00002.safetensors"}}}};
  if (edit) edit(index);
  const std::string text = index.dump(2);
  write_bytes_to_file(dir.file("model.safetensors.index.json"), Bytes(text.begin(), text.end()));
}

TEST(Safetensors, ShardedModelLoads) {
  ScratchDir dir("shards");
  write_sharded(dir);
  const SafetensorsModel m = SafetensorsModel::open(dir.path());
  EXPECT_EQ(m.files().size(), 2u);
  EXPECT_EQ(m.tensors().size(), 3u);
  EXPECT_EQ(m.tensors().at("t.c").file, dir.file("model-00002-of-00002.safetensors"));
  EXPECT_EQ(read_tensor_f32(m.tensors().at("t.c")), ramp(5));
  EXPECT_EQ(read_tensor_f32(m.tensors().at("t.a")), ramp(4));
  // The index file itself may be given, too.
  EXPECT_EQ(SafetensorsModel::open(dir.file("model.safetensors.index.json")).tensors().size(), 3u);
}

TEST(Safetensors, ShardedModelProblems) {
  {
    ScratchDir dir("shard_missing");
    write_sharded(dir, [](nlohmann::json& j) { j["weight_map"]["t.d"] = "model-00003-of-00003.safetensors"; });
    expect_error([&] { SafetensorsModel::open(dir.path()); },
                 {"model.safetensors.index.json", "model-00003-of-00003.safetensors", "no such file"});
  }
  {
    ScratchDir dir("shard_wrong");
    write_sharded(dir, [](nlohmann::json& j) { j["weight_map"]["t.c"] = "model-00001-of-00002.safetensors"; });
    expect_error([&] { SafetensorsModel::open(dir.path()); }, {"'t.c'", "model-00001-of-00002.safetensors"});
  }
  {
    ScratchDir dir("shard_absent_tensor");
    write_sharded(dir, [](nlohmann::json& j) { j["weight_map"]["t.zz"] = "model-00002-of-00002.safetensors"; });
    expect_error([&] { SafetensorsModel::open(dir.path()); }, {"'t.zz'", "no such tensor"});
  }
  {
    ScratchDir dir("shard_unlisted");
    write_sharded(dir, [](nlohmann::json& j) { j["weight_map"].erase("t.b"); });
    expect_error([&] { SafetensorsModel::open(dir.path()); }, {"'t.b'", "not in the index"});
  }
  {
    ScratchDir dir("shard_dup");
    write_sharded(dir);
    SafetensorsWriter b;
    b.add("t.c", DType::f16, {5}, ramp(5));
    b.add("t.a", DType::f16, {1}, ramp(1));
    write_bytes_to_file(dir.file("model-00002-of-00002.safetensors"), b.bytes());
    expect_error([&] { SafetensorsModel::open(dir.path()); }, {"'t.a'", "two shards"});
  }
  {
    ScratchDir dir("shard_escape");
    write_sharded(dir, [](nlohmann::json& j) { j["weight_map"]["t.c"] = "../elsewhere.safetensors"; });
    expect_error([&] { SafetensorsModel::open(dir.path()); }, {"../elsewhere.safetensors", "not a file inside"});
  }
  {
    ScratchDir dir("shard_badjson");
    write_bytes_to_file(dir.file("model.safetensors.index.json"), {'{', '"'});
    expect_error([&] { SafetensorsModel::open(dir.path()); }, {"model.safetensors.index.json", "not valid JSON"});
    write_bytes_to_file(dir.file("model.safetensors.index.json"), {'{', '}'});
    expect_error([&] { SafetensorsModel::open(dir.path()); }, {"model.safetensors.index.json", "weight_map"});
  }
  {
    ScratchDir dir("shard_none");
    expect_error([&] { SafetensorsModel::open(dir.path()); }, {dir.path(), "neither model.safetensors"});
    expect_error([&] { SafetensorsModel::open(dir.file("nothing_here")); }, {"nothing_here", "does not exist"});
  }
  {
    ScratchDir dir("shard_corrupt");
    write_sharded(dir);
    write_bytes_to_file(dir.file("model-00002-of-00002.safetensors"), {1, 2, 3, 4, 5, 6, 7, 8, 9});
    expect_error([&] { SafetensorsModel::open(dir.path()); },
                 {"model-00002-of-00002.safetensors", "header length"});
  }
}

// ---------------------------------------------------------------- GGUF

// A file with a value of every metadata type and a tensor of every supported type.
GgufWriter full_gguf_writer() {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_u8("t.u8", 200);
  w.set_i8("t.i8", -100);
  w.set_u16("t.u16", 60000);
  w.set_i16("t.i16", -30000);
  w.set_u32("t.u32", 4000000000u);
  w.set_i32("t.i32", -2000000000);
  w.set_u64("t.u64", 18000000000000000000ull);
  w.set_i64("t.i64", -9000000000000000000ll);
  w.set_f32("t.f32", 1.5f);
  w.set_f64("t.f64", 2.25);
  w.set_bool("t.bool", true);
  w.set_string("t.str", "héllo");
  w.set_strings("t.strs", {"a", "", "▁the"});
  w.set_f32s("t.f32s", {0.5f, -1.0f});
  w.set_i32s("t.i32s", {-1, 7, 2147483647});
  {
    std::vector<uint8_t> elems = {3, 0, 0, 1};  // two little-endian u16: 3 and 256
    w.set_raw("t.u16s", GgufType::array, GgufWriter::encode_array(GgufType::u16, 2, elems));
  }
  {
    // array of two arrays: [u8 {1, 2}], [string {"x"}]
    std::vector<uint8_t> inner1 = GgufWriter::encode_array(GgufType::u8, 2, {1, 2});
    std::vector<uint8_t> inner2 = GgufWriter::encode_array(GgufType::string, 1, GgufWriter::encode_string("x"));
    std::vector<uint8_t> elems;
    elems.insert(elems.end(), inner1.begin(), inner1.end());
    elems.insert(elems.end(), inner2.begin(), inner2.end());
    w.set_raw("t.nested", GgufType::array, GgufWriter::encode_array(GgufType::array, 2, elems));
  }
  w.set_raw("t.bools", GgufType::array, GgufWriter::encode_array(GgufType::boolean, 3, {1, 0, 1}));
  w.add_tensor("a.f32", DType::f32, {3, 5}, ramp(15));
  w.add_tensor("b.f16", DType::f16, {7}, ramp(7, 0.5f));
  w.add_tensor("c.bf16", DType::bf16, {2, 1, 2}, ramp(4, 2.0f));
  w.add_tensor("d.q8", DType::q8_0, {2, 64}, gaussian(128, 5));
  return w;
}

GgufFile parse_gguf(Bytes b, const std::string& name = "test.gguf") {
  return GgufFile::parse(MappedFile::from_bytes(name, std::move(b)));
}

TEST(Gguf, RoundTripMetadataOfEveryType) {
  ScratchDir dir("gguf");
  write_bytes_to_file(dir.file("m.gguf"), full_gguf_writer().bytes());
  const GgufFile g = GgufFile::open(dir.file("m.gguf"));
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.alignment(), 32u);
  EXPECT_EQ(g.keys().size(), 19u);
  EXPECT_EQ(g.keys().front(), "general.architecture");
  EXPECT_EQ(g.get_string("general.architecture"), "llama");
  EXPECT_EQ(g.get_u32("t.u8"), 200u);
  EXPECT_EQ(g.get_i64("t.i8"), -100);
  EXPECT_EQ(g.get_u32("t.u16"), 60000u);
  EXPECT_EQ(g.get_i64("t.i16"), -30000);
  EXPECT_EQ(g.get_u32("t.u32"), 4000000000u);
  EXPECT_EQ(g.get_i64("t.i32"), -2000000000);
  EXPECT_EQ(g.find("t.u64")->u, 18000000000000000000ull);
  EXPECT_EQ(g.get_i64("t.i64"), -9000000000000000000ll);
  EXPECT_EQ(g.get_f32("t.f32"), 1.5f);
  EXPECT_EQ(g.get_f32("t.f64"), 2.25f);
  EXPECT_TRUE(g.get_bool("t.bool"));
  EXPECT_EQ(g.get_string("t.str"), "héllo");
  EXPECT_EQ(g.get_array<std::string>("t.strs"), (std::vector<std::string>{"a", "", "▁the"}));
  EXPECT_EQ(g.get_array<float>("t.f32s"), (std::vector<float>{0.5f, -1.0f}));
  EXPECT_EQ(g.get_array<int32_t>("t.i32s"), (std::vector<int32_t>{-1, 7, 2147483647}));
  EXPECT_EQ(g.get_array<int64_t>("t.u16s"), (std::vector<int64_t>{3, 256}));
  EXPECT_EQ(g.array_size("t.strs"), 3u);
  const GgufValue* nested = g.find("t.nested");
  ASSERT_NE(nested, nullptr);
  ASSERT_EQ(nested->items.size(), 2u);
  EXPECT_EQ(nested->items[1].strings, (std::vector<std::string>{"x"}));
  EXPECT_EQ(g.find("t.bools")->describe(), "ARRAY<BOOL>[3] {true, false, true}");
  EXPECT_EQ(g.find("t.strs")->describe(2), "ARRAY<STRING>[3] {\"a\", \"\", ...}");
  EXPECT_EQ(g.find("t.u32")->describe(), "UINT32 4000000000");

  ASSERT_EQ(g.tensors().size(), 4u);
  const TensorView& a = g.tensors().at("a.f32");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 5}));  // written as ne = [5, 3]
  EXPECT_EQ(read_tensor_f32(a), ramp(15));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data) % 32, 0u);
  EXPECT_EQ(read_tensor_f32(g.tensors().at("b.f16")), ramp(7, 0.5f));
  EXPECT_EQ(g.tensors().at("c.bf16").shape, (std::vector<int64_t>{2, 1, 2}));
  EXPECT_EQ(read_tensor_f32(g.tensors().at("c.bf16")), ramp(4, 2.0f));
  const TensorView& q = g.tensors().at("d.q8");
  EXPECT_EQ(q.dtype, DType::q8_0);
  EXPECT_EQ(q.nbytes, 4u * 34);
  EXPECT_EQ(g.ggml_type("d.q8"), kGgmlQ8_0);
  const std::vector<float> x = gaussian(128, 5), y = read_tensor_f32(q);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 0.02f);
}

TEST(Gguf, TypedAccessorsRejectOtherTypes) {
  const GgufFile g = parse_gguf(full_gguf_writer().bytes(), "acc.gguf");
  expect_error([&] { g.get_string("t.u32"); }, {"acc.gguf", "'t.u32'", "UINT32", "expected STRING"});
  expect_error([&] { g.get_u32("t.str"); }, {"'t.str'", "STRING", "expected an integer"});
  expect_error([&] { g.get_u32("t.i8"); }, {"'t.i8'", "-100", "does not fit in uint32"});
  expect_error([&] { g.get_i64("t.u64"); }, {"'t.u64'", "does not fit in int64"});
  expect_error([&] { g.get_f32("t.i32"); }, {"'t.i32'", "expected FLOAT32"});
  expect_error([&] { g.get_bool("t.u8"); }, {"'t.u8'", "expected BOOL"});
  expect_error([&] { g.get_array<float>("t.strs"); }, {"'t.strs'", "ARRAY<STRING>", "floats"});
  expect_error([&] { g.get_array<std::string>("t.f32s"); }, {"'t.f32s'", "ARRAY<FLOAT32>"});
  expect_error([&] { g.get_array<int32_t>("t.str"); }, {"'t.str'", "integers"});
  expect_error([&] { g.get_array<uint32_t>("t.i32s"); }, {"'t.i32s'", "-1", "does not fit"});
  expect_error([&] { g.get_u32("no.such.key"); }, {"acc.gguf", "'no.such.key'", "missing"});
  expect_error([&] { g.tensors().at("zz"); }, {"acc.gguf", "'zz'"});
}

TEST(Gguf, AlignmentKeyIsHonoured) {
  GgufWriter w;
  w.set_alignment(64);
  w.add_tensor("a", DType::f32, {3}, ramp(3));
  w.add_tensor("b", DType::f32, {5}, ramp(5));
  const GgufFile g = parse_gguf(w.bytes());
  EXPECT_EQ(g.alignment(), 64u);
  EXPECT_EQ(g.data_offset() % 64, 0u);
  EXPECT_EQ(read_tensor_f32(g.tensors().at("b")), ramp(5));
  GgufWriter bad;
  bad.set_u32("general.alignment", 48);
  expect_error([&] { parse_gguf(bad.bytes(), "al.gguf"); }, {"al.gguf", "general.alignment 48", "power of two"});
  GgufWriter badtype;
  badtype.set_string("general.alignment", "32");
  expect_error([&] { parse_gguf(badtype.bytes(), "al.gguf"); }, {"al.gguf", "general.alignment", "expected UINT32"});
  GgufWriter zero;
  zero.set_u32("general.alignment", 0);
  expect_error([&] { parse_gguf(zero.bytes(), "al.gguf"); }, {"power of two"});
}

TEST(Gguf, HeaderProblems) {
  const Bytes good = full_gguf_writer().bytes();
  Bytes b = good;
  std::memcpy(b.data(), "GGJT", 4);
  expect_error([&] { parse_gguf(b, "m.gguf"); }, {"m.gguf", "not a GGUF file", "'GGJT'", "expected 'GGUF'"});
  for (uint32_t v : {1u, 2u}) {
    b = good;
    put_u32(b, 4, v);
    expect_error([&] { parse_gguf(b, "v.gguf"); }, {"v.gguf", "GGUF version " + std::to_string(v), "only version 3"});
  }
  b = good;
  put_u32(b, 4, 4);
  expect_error([&] { parse_gguf(b, "v.gguf"); }, {"v.gguf", "unknown GGUF version 4"});
  b = good;
  put_u32(b, 4, 0x03000000u);
  expect_error([&] { parse_gguf(b, "v.gguf"); }, {"v.gguf", "big-endian"});
  b = good;
  put_u64(b, 16, uint64_t{1} << 60);  // metadata count
  expect_error([&] { parse_gguf(b, "c.gguf"); }, {"c.gguf", "metadata count", "cannot fit"});
  b = good;
  put_u64(b, 8, uint64_t{1} << 59);  // tensor count
  expect_error([&] { parse_gguf(b, "c.gguf"); }, {"c.gguf", "tensor count", "cannot fit"});
  b = good;
  put_u64(b, 24, uint64_t{1} << 40);  // length of the first key
  expect_error([&] { parse_gguf(b, "k.gguf"); }, {"k.gguf", "metadata key #0"});
  expect_error([&] { parse_gguf({'G', 'G'}, "short.gguf"); }, {"short.gguf", "not a GGUF file"});
}

TEST(Gguf, MetadataProblems) {
  {
    GgufWriter w;
    w.set_raw("bad.type", static_cast<GgufType>(13), {0});
    expect_error([&] { parse_gguf(w.bytes(), "m.gguf"); }, {"m.gguf", "'bad.type'", "unknown value type 13"});
  }
  {
    GgufWriter w;
    w.set_raw("bad.bool", GgufType::boolean, {2});
    expect_error([&] { parse_gguf(w.bytes(), "m.gguf"); }, {"m.gguf", "'bad.bool'", "bool"});
  }
  {
    GgufWriter w;
    w.set_u32("twice", 1);
    w.set_u32("twice", 2);
    expect_error([&] { parse_gguf(w.bytes(), "m.gguf"); }, {"m.gguf", "'twice'", "appears twice"});
  }
  {
    GgufWriter w;  // an array that claims far more elements than the file holds
    w.set_raw("big.array", GgufType::array, GgufWriter::encode_array(GgufType::u32, uint64_t{1} << 61, {}));
    expect_error([&] { parse_gguf(w.bytes(), "m.gguf"); }, {"m.gguf", "'big.array'", "elements"});
  }
  {
    GgufWriter w;
    w.set_raw("big.strings", GgufType::array, GgufWriter::encode_array(GgufType::string, uint64_t{1} << 40, {}));
    expect_error([&] { parse_gguf(w.bytes(), "m.gguf"); }, {"m.gguf", "'big.strings'", "elements"});
  }
  {
    // Arrays nested 20 deep.
    std::vector<uint8_t> v = GgufWriter::encode_array(GgufType::u8, 0, {});
    for (int k = 0; k < 20; ++k) v = GgufWriter::encode_array(GgufType::array, 1, v);
    GgufWriter w;
    w.set_raw("deep", GgufType::array, v);
    expect_error([&] { parse_gguf(w.bytes(), "m.gguf"); }, {"m.gguf", "'deep'", "nests arrays"});
  }
}

TEST(Gguf, TensorProblems) {
  {
    GgufWriter w;
    w.add_tensor_raw("k", 3, {256}, Bytes(160));
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'k'", "Q4_1", "not supported", "Q4_K, Q5_K, Q6_K"});
  }
  {
    GgufWriter w;
    w.add_tensor_raw("u", 99, {4}, Bytes(16));
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'u'", "unknown ggml type id 99"});
  }
  {
    GgufWriter w;
    w.add_tensor_raw("q", kGgmlQ8_0, {2, 48}, Bytes(2 * 34 + 34));
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'q'", "32-value blocks"});
  }
  {
    GgufWriter w;
    w.add_tensor("a", DType::f32, {8}, ramp(8));
    w.add_tensor_raw("b", kGgmlF32, {8}, encode_values(DType::f32, ramp(8)), /*offset=*/16);
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'b'", "not a multiple of the alignment"});
  }
  {
    GgufWriter w;
    w.add_tensor("a", DType::f32, {16}, ramp(16));
    w.add_tensor_raw("b", kGgmlF32, {8}, encode_values(DType::f32, ramp(8)), /*offset=*/32);
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'a'", "'b'", "overlap"});
  }
  {
    GgufWriter w;
    w.add_tensor("a", DType::f32, {8}, ramp(8));
    w.add_tensor_raw("b", kGgmlF32, {8}, {}, /*offset=*/uint64_t{1} << 40);
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'b'", "runs past the end"});
  }
  {
    GgufWriter w;
    w.add_tensor("a", DType::f32, {8}, ramp(8));
    w.add_tensor("a", DType::f32, {8}, ramp(8));
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'a'", "twice"});
  }
  {
    GgufWriter w;
    w.add_tensor_raw("five", kGgmlF32, {1, 1, 1, 1, 1}, Bytes(4));
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'five'", "5 dimensions"});
  }
  {
    GgufWriter w;
    w.add_tensor_raw("huge", kGgmlF32, {int64_t{1} << 31, int64_t{1} << 31, int64_t{1} << 31}, Bytes(4));
    expect_error([&] { parse_gguf(w.bytes(), "t.gguf"); }, {"t.gguf", "'huge'", "too large"});
  }
  {
    GgufWriter w;
    w.add_tensor("a", DType::f32, {64}, ramp(64));
    Bytes b = w.bytes();
    b.resize(b.size() - 1);
    expect_error([&] { parse_gguf(b, "t.gguf"); }, {"t.gguf", "'a'", "runs past the end", "truncated"});
  }
}

TEST(Gguf, EveryTruncationIsAnError) {
  GgufWriter w = full_gguf_writer();
  const Bytes full = w.bytes();
  for (size_t len = 1; len < full.size(); ++len) {
    const std::string msg = error_message([&] { parse_gguf(Bytes(full.begin(), full.begin() + len), "cut.gguf"); });
    EXPECT_NE(msg.find("cut.gguf"), std::string::npos) << "length " << len << ": " << msg;
  }
}

// Random byte changes must end in a clean load or a tq::Error, never a crash or another exception.
// Under the asan preset this also shows that no read leaves the buffer.
template <typename Parse>
void fuzz(const Bytes& good, uint64_t seed, int rounds, Parse parse) {
  SplitMix64 rng(seed);
  int loaded = 0, rejected = 0;
  for (int r = 0; r < rounds; ++r) {
    Bytes b = good;
    const int edits = 1 + static_cast<int>(rng.next() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng.next() % b.size();
      switch (rng.next() % 3) {
        case 0: b[at] = static_cast<uint8_t>(rng.next()); break;
        case 1: b[at] ^= static_cast<uint8_t>(1u << (rng.next() % 8)); break;
        default: b[at] = static_cast<uint8_t>(b[at] + 1); break;
      }
    }
    if (rng.next() % 4 == 0) b.resize(1 + rng.next() % b.size());
    try {
      parse(std::move(b));
      ++loaded;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "round " << r << ": non-tq exception " << e.what();
    }
  }
  // Both outcomes must occur, or the mutations are not reaching the parser's checks.
  EXPECT_GT(rejected, rounds / 10);
  EXPECT_GT(loaded, rounds / 100);
  std::cout << "random mutations: " << loaded << " loaded, " << rejected << " rejected\n";
}

TEST(Gguf, RandomCorruptionNeverCrashes) {
  fuzz(full_gguf_writer().bytes(), 11, 4000, [](Bytes b) {
    const GgufFile g = parse_gguf(std::move(b), "fuzz.gguf");
    for (const TensorView& t : g.tensors().all()) (void)read_tensor_f32(t);  // touch every byte claimed
    for (const std::string& k : g.keys()) (void)g.find(k)->describe(1000);
  });
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
  fuzz(small_safetensors(), 12, 4000, [](Bytes b) {
    const SafetensorsFile f = parse_st(std::move(b), "fuzz.safetensors");
    for (const TensorView& t : f.tensors()) (void)read_tensor_f32(t);
  });
}

}  // namespace
}  // namespace tq
