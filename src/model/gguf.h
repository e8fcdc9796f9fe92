// GGUF v3 (llama.cpp / ggml), little-endian:
//   "GGUF" | u32 version = 3 | u64 tensor_count | u64 kv_count
//   kv_count x { string key | u32 value type | value }
//   tensor_count x { string name | u32 n_dims | u64 ne[n_dims] (innermost first) | u32 ggml type | u64 offset }
//   zero padding to `alignment` (general.alignment, default 32) | tensor data
// where a string is u64 length + bytes, and an array value is u32 element type + u64 count + elements.
// Tensor offsets are relative to the data section and multiples of the alignment.
//
// Tensor shapes are given outermost first (ne reversed), as for safetensors: ggml's token_embd with
// ne = [n_embd, n_vocab] becomes shape [n_vocab, n_embd].
//
// Weights are returned exactly as stored. Note for Llama GGUFs made by llama.cpp's converter from
// Hugging Face checkpoints: the rows of attn_q and attn_k are permuted within every head so that
// interleaved-pair RoPE (x[2i], x[2i+1]) computes what rotate-half RoPE (x[i], x[i + d/2]) computed
// on the original weights; llama2.c checkpoints (stories260K) were trained interleaved and need no
// permutation. Either way a Llama GGUF's attn_q/attn_k go with interleaved RoPE, which is what
// config_from_gguf() records (ModelConfig::rope_layout). Qwen2/Qwen3 GGUFs are not permuted and use
// rotate-half RoPE.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/mapped_file.h"
#include "model/tensor.h"

namespace tq {

enum class GgufType : uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};
const char* gguf_type_name(GgufType t);  // "UINT32", "STRING", ...

// ggml tensor type ids this reader knows by name (the supported ones are F32 0, F16 1, Q4_0 2, Q8_0 8,
// Q4_K 12, Q5_K 13, Q6_K 14, BF16 30, MXFP4 39; the others are refused by name: Q4_1, Q5_0, Q5_1, Q8_1,
// Q2_K, Q3_K, Q8_K, the IQ* and TQ* types, ...).
const char* ggml_type_name(uint32_t type_id);  // "Q4_K", ..., or nullptr for an unknown id
inline constexpr uint32_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ8_0 = 8, kGgmlBF16 = 30, kGgmlMxfp4 = 39;
inline constexpr uint32_t kGgmlQ4_0 = 2, kGgmlQ4_K = 12, kGgmlQ5_K = 13, kGgmlQ6_K = 14;
// The types the reader maps, as a message lists them.
inline constexpr const char* kGgufSupportedTypes = "F32, F16, BF16, Q8_0, MXFP4, Q4_0, Q4_K, Q5_K, Q6_K";

// One metadata value. Numeric arrays stay in the file (elements read on request).
struct GgufValue {
  GgufType type = GgufType::u8;
  uint64_t u = 0;     // u8/u16/u32/u64 and bool
  int64_t i = 0;      // i8/i16/i32/i64
  double f = 0;       // f32/f64
  std::string str;    // string
  // array
  GgufType elem_type = GgufType::u8;
  uint64_t count = 0;
  const uint8_t* elems = nullptr;       // numeric or bool elements, little-endian, in the mapping
  std::vector<std::string> strings;     // string elements
  std::vector<GgufValue> items;         // array elements (arrays of arrays)

  // "UINT32 5", "STRING \"llama\"", "ARRAY<STRING>[512] {\"<unk>\", \"<s>\", ...}"
  std::string describe(size_t max_items = 4) const;
};

class GgufFile {
 public:
  static GgufFile open(const std::string& path);
  static GgufFile parse(MappedFile file);

  const std::string& path() const { return file_.path(); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // file offset of the tensor data

  // Metadata, keys in file order.
  const std::vector<std::string>& keys() const { return keys_; }
  const GgufValue* find(const std::string& key) const;
  bool has(const std::string& key) const { return find(key) != nullptr; }

  // Typed access: throws tq::Error naming the file and key when the key is absent or of another
  // type. Integer getters accept any integer type whose value fits; get_f32 accepts F32 and F64.
  std::string get_string(const std::string& key) const;
  uint32_t get_u32(const std::string& key) const;
  int64_t get_i64(const std::string& key) const;
  float get_f32(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  // T = std::string, float, int32_t, int64_t or uint32_t. Numeric conversions as for the scalars.
  template <typename T>
  std::vector<T> get_array(const std::string& key) const;
  // The element count of an array without reading it.
  uint64_t array_size(const std::string& key) const;

  const TensorSet& tensors() const { return tensors_; }
  // The ggml type id of each tensor, by name.
  uint32_t ggml_type(const std::string& tensor) const { return ggml_types_.at(tensor); }

 private:
  const GgufValue& require(const std::string& key, const char* wanted) const;

  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::string> keys_;
  std::map<std::string, GgufValue> metadata_;
  TensorSet tensors_;
  std::map<std::string, uint32_t> ggml_types_;
};

template <>
std::vector<std::string> GgufFile::get_array<std::string>(const std::string& key) const;
template <>
std::vector<float> GgufFile::get_array<float>(const std::string& key) const;
template <>
std::vector<int32_t> GgufFile::get_array<int32_t>(const std::string& key) const;
template <>
std::vector<int64_t> GgufFile::get_array<int64_t>(const std::string& key) const;
template <>
std::vector<uint32_t> GgufFile::get_array<uint32_t>(const std::string& key) const;

}  // namespace tq
