#include "kv/vector_format.h"

#include <cstring>
#include <sstream>
#include <vector>

#include "codec/absmax.h"
#include "codec/packing.h"
#include "core/error.h"
#include "core/half.h"

namespace tq {

std::string to_string(KVType t) {
  switch (t) {
    case KVType::f32: return "f32";
    case KVType::f16: return "f16";
    case KVType::bf16: return "bf16";
    case KVType::turboquant: return "turboquant";
    case KVType::q8_0: return "q8_0";
    case KVType::q4_0: return "q4_0";
  }
  return "?";
}

KVType parse_kv_type(const std::string& name) {
  for (KVType t : {KVType::f32, KVType::f16, KVType::bf16, KVType::turboquant, KVType::q8_0, KVType::q4_0}) {
    if (name == to_string(t)) return t;
  }
  fail("unknown KV cache type '", name, "' (expected f32, f16, bf16, turboquant, q8_0 or q4_0)");
}

VectorFormat::VectorFormat(int dim, const VectorFormatSpec& spec) : dim_(dim), spec_(spec) {
  TQ_CHECK(dim >= 1, "head dimension must be positive, got ", dim);
  plan_.type = spec.type;
  plan_.dim = dim;
  switch (spec.type) {
    case KVType::f32: record_bytes_ = 4 * static_cast<size_t>(dim); break;
    case KVType::f16:
    case KVType::bf16: record_bytes_ = 2 * static_cast<size_t>(dim); break;
    case KVType::turboquant: {
      TQ_CHECK(dim % 8 == 0, "turboquant KV needs a head dimension that is a multiple of 8, got ", dim);
      QuantizerOptions q = spec.quantizer;
      q.layout = PackLayout::planes;
      quantizer_ = std::make_unique<GroupQuantizer>(dim, q);
      rotation_ = quantizer_->rotation();
      record_bytes_ = quantizer_->bytes_per_vector();
      const auto& p = quantizer_->plan();
      plan_.bits = p.bits;
      plan_.group_size = p.group_size;
      plan_.level_count = p.level_count;
      plan_.uniform = p.grid == Grid::uniform;
      plan_.uniform_max = p.uniform_max;
      plan_.levels = p.levels;
      plan_.code_bytes = quantizer_->code_bytes();
      plan_.layout = PackLayout::planes;
      break;
    }
    case KVType::q8_0:
    case KVType::q4_0: {
      TQ_CHECK(dim % kAbsmaxBlock == 0, to_string(spec.type), " KV needs a head dimension that is a multiple of 32, got ", dim);
      record_bytes_ = static_cast<size_t>(dim / kAbsmaxBlock) *
                      absmax_block_bytes(spec.type == KVType::q8_0 ? AbsmaxFormat::q8_0 : AbsmaxFormat::q4_0);
      if (spec.rotate) {
        own_rotation_ = std::make_unique<Rotation>(dim, 0, spec.seed);
        rotation_ = own_rotation_.get();
      }
      break;
    }
  }
  TQ_CHECK(!spec.rotate || spec.type == KVType::q8_0 || spec.type == KVType::q4_0,
           "rotation is an option of the q8_0/q4_0 KV types only (turboquant always rotates)");
}

std::string VectorFormat::describe() const {
  std::ostringstream os;
  os << to_string(spec_.type);
  if (spec_.type == KVType::turboquant) os << "(" << quantizer_->bits() << " bits, group " << quantizer_->group_size() << ")";
  if (spec_.rotate) os << "_rot";
  return os.str();
}

void VectorFormat::to_stored(const float* x, float* y) const {
  std::memcpy(y, x, sizeof(float) * static_cast<size_t>(dim_));
  if (rotation_) rotation_->forward(y);
}

void VectorFormat::encode_stored(const float* y, uint8_t* record) const {
  switch (spec_.type) {
    case KVType::turboquant:
      quantizer_->quantize_rotated(y, 1, record, reinterpret_cast<f16*>(record + quantizer_->code_bytes()));
      return;
    case KVType::q8_0:
      quantize_q8_0(y, dim_, reinterpret_cast<BlockQ8_0*>(record));
      return;
    case KVType::q4_0:
      quantize_q4_0(y, dim_, reinterpret_cast<BlockQ4_0*>(record));
      return;
    default: encode(y, record); return;  // dense: the stored domain is the original one
  }
}

void VectorFormat::encode(const float* x, uint8_t* record) const {
  switch (spec_.type) {
    case KVType::f32: std::memcpy(record, x, 4 * static_cast<size_t>(dim_)); return;
    case KVType::f16: {
      auto* h = reinterpret_cast<uint16_t*>(record);
      for (int i = 0; i < dim_; ++i) h[i] = f32_to_f16_bits(x[i]);
      return;
    }
    case KVType::bf16: {
      auto* h = reinterpret_cast<uint16_t*>(record);
      for (int i = 0; i < dim_; ++i) h[i] = f32_to_bf16_bits(x[i]);
      return;
    }
    case KVType::turboquant:
      quantizer_->quantize(x, 1, record, reinterpret_cast<f16*>(record + quantizer_->code_bytes()));
      return;
    case KVType::q8_0:
    case KVType::q4_0: {
      std::vector<float> y(x, x + dim_);
      if (rotation_) rotation_->forward(y.data());
      if (spec_.type == KVType::q8_0) {
        quantize_q8_0(y.data(), dim_, reinterpret_cast<BlockQ8_0*>(record));
      } else {
        quantize_q4_0(y.data(), dim_, reinterpret_cast<BlockQ4_0*>(record));
      }
      return;
    }
  }
}

void VectorFormat::decode_stored(const uint8_t* record, float* y) const { kernels::decode_record(plan_, record, y); }

void VectorFormat::decode(const uint8_t* record, float* x) const {
  decode_stored(record, x);
  if (rotation_) rotation_->inverse(x);
}

void VectorFormat::encode_column(const float* x, uint8_t* region, int T, int t) const {
  std::vector<float> y(static_cast<size_t>(dim_));  // [dim] stored domain
  to_stored(x, y.data());
  encode_column_stored(y.data(), region, T, t);
}

void VectorFormat::encode_column_stored(const float* y, uint8_t* region, int T, int t) const {
  TQ_CHECK(supports_columns(), to_string(spec_.type), " has no column layout");
  std::vector<uint8_t> rec(record_bytes_);
  encode_stored(y, rec.data());
  const size_t D = static_cast<size_t>(dim_);
  switch (spec_.type) {
    case KVType::f32:
      for (size_t j = 0; j < D; ++j) std::memcpy(region + (j * T + t) * 4, rec.data() + j * 4, 4);
      return;
    case KVType::f16:
    case KVType::bf16:
      for (size_t j = 0; j < D; ++j) std::memcpy(region + (j * T + t) * 2, rec.data() + j * 2, 2);
      return;
    case KVType::turboquant: {
      const int bits = plan_.bits;
      std::vector<uint8_t> codes(D);
      unpack_codes(PackLayout::planes, rec.data(), D, bits, codes.data());
      if (bits == 8) {
        for (size_t j = 0; j < D; ++j) region[j * T + t] = codes[j];
      } else {
        const size_t plane = static_cast<size_t>(T) / 8;
        for (size_t j = 0; j < D; ++j)
          for (int k = 0; k < bits; ++k) {
            uint8_t& byte = region[(j * bits + k) * plane + t / 8];
            const uint8_t bit = static_cast<uint8_t>(1u << (t % 8));
            byte = static_cast<uint8_t>(((codes[j] >> k) & 1) ? (byte | bit) : (byte & ~bit));
          }
      }
      uint8_t* scales = region + static_cast<size_t>(T) * plan_.code_bytes;
      for (int g = 0; g < dim_ / plan_.group_size; ++g)
        std::memcpy(scales + (static_cast<size_t>(g) * T + t) * 2, rec.data() + plan_.code_bytes + 2 * g, 2);
      return;
    }
    default: break;
  }
}

void VectorFormat::decode_column_stored(const uint8_t* region, int T, int t, float* y) const {
  TQ_CHECK(supports_columns(), to_string(spec_.type), " has no column layout");
  std::vector<uint8_t> rec(record_bytes_);
  const size_t D = static_cast<size_t>(dim_);
  switch (spec_.type) {
    case KVType::f32:
      for (size_t j = 0; j < D; ++j) std::memcpy(rec.data() + j * 4, region + (j * T + t) * 4, 4);
      break;
    case KVType::f16:
    case KVType::bf16:
      for (size_t j = 0; j < D; ++j) std::memcpy(rec.data() + j * 2, region + (j * T + t) * 2, 2);
      break;
    case KVType::turboquant: {
      const int bits = plan_.bits;
      std::vector<uint8_t> codes(D, 0);
      if (bits == 8) {
        for (size_t j = 0; j < D; ++j) codes[j] = region[j * T + t];
      } else {
        const size_t plane = static_cast<size_t>(T) / 8;
        for (size_t j = 0; j < D; ++j)
          for (int k = 0; k < bits; ++k)
            codes[j] = static_cast<uint8_t>(codes[j] | (((region[(j * bits + k) * plane + t / 8] >> (t % 8)) & 1) << k));
      }
      pack_codes(PackLayout::planes, codes.data(), D, bits, rec.data());
      const uint8_t* scales = region + static_cast<size_t>(T) * plan_.code_bytes;
      for (int g = 0; g < dim_ / plan_.group_size; ++g)
        std::memcpy(rec.data() + plan_.code_bytes + 2 * g, scales + (static_cast<size_t>(g) * T + t) * 2, 2);
      break;
    }
    default: break;
  }
  decode_stored(rec.data(), y);
}

void VectorFormat::decode_column(const uint8_t* region, int T, int t, float* x) const {
  decode_column_stored(region, T, t, x);
  if (rotation_) rotation_->inverse(x);
}

namespace scalar {

void decode_record(const RecordPlan& plan, const uint8_t* record, float* out) {
  const int dim = plan.dim;
  switch (plan.type) {
    case KVType::f32: std::memcpy(out, record, 4 * static_cast<size_t>(dim)); return;
    case KVType::f16: {
      const auto* h = reinterpret_cast<const uint16_t*>(record);
      for (int i = 0; i < dim; ++i) out[i] = f16_bits_to_f32(h[i]);
      return;
    }
    case KVType::bf16: {
      const auto* h = reinterpret_cast<const uint16_t*>(record);
      for (int i = 0; i < dim; ++i) out[i] = bf16_bits_to_f32(h[i]);
      return;
    }
    case KVType::turboquant: {
      std::vector<uint8_t> codes(dim);
      unpack_codes(plan.layout, record, dim, plan.bits, codes.data());
      const auto* scales = reinterpret_cast<const uint16_t*>(record + plan.code_bytes);
      for (int i = 0; i < dim; ++i) out[i] = plan.levels[codes[i]] * f16_bits_to_f32(scales[i / plan.group_size]);
      return;
    }
    case KVType::q8_0: dequantize_q8_0(reinterpret_cast<const BlockQ8_0*>(record), dim, out); return;
    case KVType::q4_0: dequantize_q4_0(reinterpret_cast<const BlockQ4_0*>(record), dim, out); return;
  }
}

}  // namespace scalar
}  // namespace tq
