// Writes safetensors and GGUF files (in memory or to disk): for tests that need valid and corrupt
// files, for fixtures, and for conversion tools. The layouts are the ones the readers expect
// (safetensors.h, gguf.h).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "model/gguf.h"

namespace tq {

void write_bytes_to_file(const std::string& path, const std::vector<uint8_t>& bytes);

class SafetensorsWriter {
 public:
  // `dtype` is the safetensors name ("F32", "BF16", ...); `data` the raw little-endian bytes.
  void add_raw(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
               std::vector<uint8_t> data);
  // values: [numel(shape)] converted to the dtype (F32, F16 or BF16, round to nearest even).
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const std::vector<float>& values);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  // The JSON header as written (tensors in insertion order, data packed in that order).
  std::string header_json() const;
  // 8-byte length + header (padded with spaces to a multiple of 8) + data.
  std::vector<uint8_t> bytes() const;
  // Assembles a file from any header text and data buffer (for corrupt-file tests).
  static std::vector<uint8_t> assemble(const std::string& header, const std::vector<uint8_t>& data);

 private:
  struct Entry {
    std::string name, dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

class GgufWriter {
 public:
  // Metadata, kept in insertion order. `payload` is the encoded value without its type tag.
  void set_raw(const std::string& key, GgufType type, std::vector<uint8_t> payload);
  void set_u8(const std::string& key, uint8_t v);
  void set_i8(const std::string& key, int8_t v);
  void set_u16(const std::string& key, uint16_t v);
  void set_i16(const std::string& key, int16_t v);
  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void set_u64(const std::string& key, uint64_t v);
  void set_i64(const std::string& key, int64_t v);
  void set_f32(const std::string& key, float v);
  void set_f64(const std::string& key, double v);
  void set_bool(const std::string& key, bool v);
  void set_string(const std::string& key, const std::string& v);
  void set_strings(const std::string& key, const std::vector<std::string>& v);
  void set_f32s(const std::string& key, const std::vector<float>& v);
  void set_i32s(const std::string& key, const std::vector<int32_t>& v);

  // Encoders for building payloads by hand (nested arrays, odd widths).
  static std::vector<uint8_t> encode_string(const std::string& s);
  // u32 element type + u64 count + the elements' encoded bytes.
  static std::vector<uint8_t> encode_array(GgufType elem_type, uint64_t count, const std::vector<uint8_t>& elems);

  // A tensor of ggml type `type_id` with `shape` outermost first (written as ne, innermost first) and
  // raw bytes. `offset` overrides the data offset (default: packed in insertion order, aligned).
  void add_tensor_raw(const std::string& name, uint32_t type_id, std::vector<int64_t> shape, std::vector<uint8_t> data,
                      std::optional<uint64_t> offset = std::nullopt);
  // values: [numel(shape)] converted to the dtype (Q8_0 quantizes per 32-value block).
  void add_tensor(const std::string& name, DType dtype, std::vector<int64_t> shape, const std::vector<float>& values);

  void set_version(uint32_t v) { version_ = v; }
  // Alignment of the data section and of every tensor. Also written as general.alignment when it
  // is not the default 32 (call before bytes()).
  void set_alignment(uint32_t a) { alignment_ = a; }

  std::vector<uint8_t> bytes() const;

 private:
  struct Kv {
    std::string key;
    GgufType type;
    std::vector<uint8_t> payload;
  };
  struct Tensor {
    std::string name;
    uint32_t type;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
    std::optional<uint64_t> offset;
  };
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
  uint32_t version_ = 3;
  uint32_t alignment_ = 32;
};

// Encodes floats as `dtype` (F32, F16, BF16, or Q8_0 with rows of whole 32-value blocks).
//   values: [n] -> bytes: tensor_bytes(dtype, {n})
std::vector<uint8_t> encode_values(DType dtype, const std::vector<float>& values);

}  // namespace tq
