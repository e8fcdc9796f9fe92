// How one head's key or value vector (head_dim floats) is stored in a cache: a fixed-size record.
//
//   f32 / f16 / bf16 : head_dim elements, original domain
//   turboquant       : [codes: packed_bytes(head_dim, bits), plane layout][scales: head_dim/group binary16],
//                      rotated domain (see codec/group_quantizer.h)
//   q8_0 / q4_0      : head_dim/32 llama.cpp absmax blocks (34 or 18 bytes), original domain, or the
//                      rotated domain when `rotate` is set (llama.cpp's Hadamard-rotated KV, "q8_0_rot")
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "codec/group_quantizer.h"
#include "codec/rotation.h"

namespace tq {

enum class KVType { f32, f16, bf16, turboquant, q8_0, q4_0 };

std::string to_string(KVType t);
// Whether vectors of this type are stored as plain numbers (f32, f16, bf16), not codes.
inline bool is_dense(KVType t) { return t == KVType::f32 || t == KVType::f16 || t == KVType::bf16; }
KVType parse_kv_type(const std::string& name);  // f32 f16 bf16 turboquant q8_0 q4_0

struct VectorFormatSpec {
  KVType type = KVType::f16;
  QuantizerOptions quantizer;  // turboquant: bits, group size, grid, fit, seed...
  bool rotate = false;         // q8_0 / q4_0: Hadamard-rotate over the head dimension first
  uint64_t seed = 42;          // rotation seed for rotated absmax formats
};

// The plain facts the SIMD decoders need (no virtual calls in the hot loop).
struct RecordPlan {
  KVType type;
  int dim;
  // turboquant
  int bits = 0, group_size = 0, level_count = 0;
  bool uniform = false;      // uniform grid: level[c] = c - uniform_max
  float uniform_max = 0;
  const float* levels = nullptr;
  size_t code_bytes = 0;     // scales follow the codes
  PackLayout layout = PackLayout::planes;
};

class VectorFormat {
 public:
  VectorFormat(int dim, const VectorFormatSpec& spec);

  KVType type() const { return spec_.type; }
  int dim() const { return dim_; }
  const VectorFormatSpec& spec() const { return spec_; }
  size_t record_bytes() const { return record_bytes_; }
  bool rotated() const { return rotation_ != nullptr; }  // records hold the rotated vector
  const Rotation* rotation() const { return rotation_; }
  const GroupQuantizer* quantizer() const { return quantizer_.get(); }
  const RecordPlan& plan() const { return plan_; }
  double bits_per_value() const { return 8.0 * static_cast<double>(record_bytes_) / dim_; }
  std::string describe() const;

  // x: [dim] in the original domain -> one record.
  void encode(const float* x, uint8_t* record) const;
  // x: [dim] original domain -> y: [dim] stored domain (the forward rotation when rotated(), else a copy).
  void to_stored(const float* x, float* y) const;
  // y: [dim] in the stored domain -> one record (encode(x) == encode_stored(to_stored(x)), bit for bit).
  // Block-mean centring encodes y - mean this way (kv/cache.h).
  void encode_stored(const float* y, uint8_t* record) const;
  // record -> [dim] in the original domain (undoes the rotation).
  void decode(const uint8_t* record, float* x) const;
  // record -> [dim] in the stored domain (rotated when rotated()).
  void decode_stored(const uint8_t* record, float* y) const;

  // Column (dimension-major) regions: the records of T tokens stored so that the values of one
  // dimension for consecutive tokens are adjacent, which lets attention score 16 tokens per vector
  // without horizontal sums. Same size as T records. Layout (docs/FORMATS.md):
  //   dense: [dim][T] elements; turboquant: codes [dim][T] bytes at 8 bits, else [dim][bits][T/8]
  //   plane bytes (bit t = token t), then scales [dim/group][T] binary16. T must be a multiple of 16.
  bool supports_columns() const { return spec_.type != KVType::q8_0 && spec_.type != KVType::q4_0; }
  void encode_column(const float* x, uint8_t* region, int T, int t) const;
  void encode_column_stored(const float* y, uint8_t* region, int T, int t) const;  // y in the stored domain
  void decode_column_stored(const uint8_t* region, int T, int t, float* y) const;
  void decode_column(const uint8_t* region, int T, int t, float* x) const;

 private:
  int dim_;
  VectorFormatSpec spec_;
  size_t record_bytes_ = 0;
  std::unique_ptr<GroupQuantizer> quantizer_;
  std::unique_ptr<Rotation> own_rotation_;
  const Rotation* rotation_ = nullptr;
  RecordPlan plan_{};
};

namespace kernels {
// SIMD decode of one record into [dim] floats of the stored domain (dispatched per target).
void decode_record(const RecordPlan& plan, const uint8_t* record, float* out);
// count records `stride` bytes apart -> out [count][dim] (per-call setup amortised over the tile).
void decode_records(const RecordPlan& plan, const uint8_t* first, size_t stride, int count, float* out);
// Tokens [t0, t0 + 16) of a column region of T tokens -> out [dim][16], stored domain, scales applied.
// t0 is a multiple of 16; tokens past the filled ones decode whatever the (zeroed) region holds.
void decode_columns(const RecordPlan& plan, const uint8_t* region, int T, int t0, float* out);
}  // namespace kernels
namespace scalar {
void decode_record(const RecordPlan& plan, const uint8_t* record, float* out);
}  // namespace scalar

}  // namespace tq
