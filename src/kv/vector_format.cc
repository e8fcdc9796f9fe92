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
