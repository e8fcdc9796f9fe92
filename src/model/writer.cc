#include "model/writer.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/half.h"
#include "ops/kquant.h"

namespace tq {

namespace {

template <typename T>
void put_le(std::vector<uint8_t>& out, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // the project targets little-endian hosts (x86-64, aarch64)
  out.insert(out.end(), b, b + sizeof(T));
}

std::vector<uint8_t> scalar_bytes(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

int64_t count_elems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

void write_bytes_to_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  TQ_CHECK(f != nullptr, "cannot create '", path, "'");
  const size_t written = bytes.empty() ? 0 : std::fwrite(bytes.data(), 1, bytes.size(), f);
  const bool closed = std::fclose(f) == 0;
  TQ_CHECK(written == bytes.size() && closed, "cannot write '", path, "'");
}

std::vector<uint8_t> encode_values(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> out;
  switch (dtype) {
    case DType::f32:
      for (float v : values) put_le(out, v);
      break;
    case DType::f16:
      for (float v : values) put_le(out, f32_to_f16_bits(v));
      break;
    case DType::bf16:
      for (float v : values) put_le(out, f32_to_bf16_bits(v));
      break;
    case DType::q8_0: {
      TQ_CHECK(values.size() % kQ8_0BlockElems == 0, "Q8_0 needs a multiple of 32 values, got ", values.size());
      for (size_t b = 0; b < values.size(); b += kQ8_0BlockElems) {
        float amax = 0;
        for (int64_t j = 0; j < kQ8_0BlockElems; ++j) amax = std::max(amax, std::fabs(values[b + j]));
        const uint16_t d_bits = f32_to_f16_bits(amax / 127.0f);
        // Quantize against the scale as stored, so that d * q reproduces the value within d/2.
        const float d = f16_bits_to_f32(d_bits);
        put_le(out, d_bits);
        for (int64_t j = 0; j < kQ8_0BlockElems; ++j) {
          const float q = d > 0 ? std::nearbyint(values[b + j] / d) : 0.0f;
          out.push_back(static_cast<uint8_t>(static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)))));
        }
      }
      break;
    }
    case DType::u8:
      for (float v : values) {
        TQ_CHECK(v >= 0 && v <= 255 && v == std::floor(v), "U8 value ", v, " is not a byte");
        out.push_back(static_cast<uint8_t>(v));
      }
      break;
    case DType::mxfp4:
      fail("MXFP4 is not encoded from floats here (it would need a quantizer); write its blocks with add_tensor_raw");
    case DType::tq2:
    case DType::tq3:
    case DType::tq4:
      fail("TurboQuant weights are written as their .tq_codes / .tq_scales planes (turboquant-convert), not from floats");
    case DType::u32:
      fail("U32 words are written raw (add_raw), not from floats");
    case DType::q4_0:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k: {
      // llama.cpp-style round-to-nearest reference quantizers (ops/kquant.h).
      const ops::DType t = to_ops_kquant(dtype);
      TQ_CHECK(values.size() % ops::block_values(t) == 0, dtype_name(dtype), " needs a multiple of ",
               ops::block_values(t), " values, got ", values.size());
      out.resize(ops::storage_bytes(t, values.size()));
      ops::kquant_quantize(t, values.data(), values.size(), out.data());
      break;
    }
  }
  return out;
}

// ---------------------------------------------------------------- safetensors

void SafetensorsWriter::add_raw(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                                std::vector<uint8_t> data) {
  entries_.push_back({name, dtype, std::move(shape), std::move(data)});
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const std::vector<float>& values) {
  TQ_CHECK(dtype != DType::q8_0 && dtype != DType::mxfp4 && !is_kquant(dtype), "safetensors has no ", dtype_name(dtype));
  TQ_CHECK(count_elems(shape) == static_cast<int64_t>(values.size()), "tensor '", name, "': ", values.size(),
           " values for shape ", shape_string(shape));
  add_raw(name, dtype_name(dtype), std::move(shape), encode_values(dtype, values));
}

std::string SafetensorsWriter::header_json() const {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const Entry& e : entries_) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.data.size()}}};
    offset += e.data.size();
  }
  return h.dump();
}

std::vector<uint8_t> SafetensorsWriter::assemble(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out;
  put_le(out, static_cast<uint64_t>(header.size()));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<uint8_t> SafetensorsWriter::bytes() const {
  std::string header = header_json();
  while ((8 + header.size()) % 8 != 0) header.push_back(' ');  // as the safetensors library pads
  std::vector<uint8_t> data;
  for (const Entry& e : entries_) data.insert(data.end(), e.data.begin(), e.data.end());
  return assemble(header, data);
}

// ---------------------------------------------------------------- GGUF

std::vector<uint8_t> GgufWriter::encode_string(const std::string& s) {
  std::vector<uint8_t> out;
  put_le(out, static_cast<uint64_t>(s.size()));
  out.insert(out.end(), s.begin(), s.end());
  return out;
}

std::vector<uint8_t> GgufWriter::encode_array(GgufType elem_type, uint64_t count, const std::vector<uint8_t>& elems) {
  std::vector<uint8_t> out;
  put_le(out, static_cast<uint32_t>(elem_type));
  put_le(out, count);
  out.insert(out.end(), elems.begin(), elems.end());
  return out;
}

void GgufWriter::set_raw(const std::string& key, GgufType type, std::vector<uint8_t> payload) {
  kvs_.push_back({key, type, std::move(payload)});
}
void GgufWriter::set_u8(const std::string& k, uint8_t v) { set_raw(k, GgufType::u8, scalar_bytes(&v, 1)); }
void GgufWriter::set_i8(const std::string& k, int8_t v) { set_raw(k, GgufType::i8, scalar_bytes(&v, 1)); }
void GgufWriter::set_u16(const std::string& k, uint16_t v) { set_raw(k, GgufType::u16, scalar_bytes(&v, 2)); }
void GgufWriter::set_i16(const std::string& k, int16_t v) { set_raw(k, GgufType::i16, scalar_bytes(&v, 2)); }
void GgufWriter::set_u32(const std::string& k, uint32_t v) { set_raw(k, GgufType::u32, scalar_bytes(&v, 4)); }
void GgufWriter::set_i32(const std::string& k, int32_t v) { set_raw(k, GgufType::i32, scalar_bytes(&v, 4)); }
void GgufWriter::set_u64(const std::string& k, uint64_t v) { set_raw(k, GgufType::u64, scalar_bytes(&v, 8)); }
void GgufWriter::set_i64(const std::string& k, int64_t v) { set_raw(k, GgufType::i64, scalar_bytes(&v, 8)); }
void GgufWriter::set_f32(const std::string& k, float v) { set_raw(k, GgufType::f32, scalar_bytes(&v, 4)); }
void GgufWriter::set_f64(const std::string& k, double v) { set_raw(k, GgufType::f64, scalar_bytes(&v, 8)); }
void GgufWriter::set_bool(const std::string& k, bool v) {
  const uint8_t b = v ? 1 : 0;
  set_raw(k, GgufType::boolean, scalar_bytes(&b, 1));
}
void GgufWriter::set_string(const std::string& k, const std::string& v) {
  set_raw(k, GgufType::string, encode_string(v));
}
void GgufWriter::set_strings(const std::string& k, const std::vector<std::string>& v) {
  std::vector<uint8_t> elems;
  for (const std::string& s : v) {
    const std::vector<uint8_t> e = encode_string(s);
    elems.insert(elems.end(), e.begin(), e.end());
  }
  set_raw(k, GgufType::array, encode_array(GgufType::string, v.size(), elems));
}
void GgufWriter::set_f32s(const std::string& k, const std::vector<float>& v) {
  std::vector<uint8_t> elems;
  for (float x : v) put_le(elems, x);
  set_raw(k, GgufType::array, encode_array(GgufType::f32, v.size(), elems));
}
void GgufWriter::set_i32s(const std::string& k, const std::vector<int32_t>& v) {
  std::vector<uint8_t> elems;
  for (int32_t x : v) put_le(elems, x);
  set_raw(k, GgufType::array, encode_array(GgufType::i32, v.size(), elems));
}

void GgufWriter::add_tensor_raw(const std::string& name, uint32_t type_id, std::vector<int64_t> shape,
                                std::vector<uint8_t> data, std::optional<uint64_t> offset) {
  tensors_.push_back({name, type_id, std::move(shape), std::move(data), offset});
}

void GgufWriter::add_tensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const std::vector<float>& values) {
  TQ_CHECK(count_elems(shape) == static_cast<int64_t>(values.size()), "tensor '", name, "': ", values.size(),
           " values for shape ", shape_string(shape));
  const uint32_t id = dtype == DType::f32    ? kGgmlF32
                      : dtype == DType::f16  ? kGgmlF16
                      : dtype == DType::bf16 ? kGgmlBF16
                      : dtype == DType::q8_0 ? kGgmlQ8_0
                      : dtype == DType::q4_0 ? kGgmlQ4_0
                      : dtype == DType::q4_k ? kGgmlQ4_K
                      : dtype == DType::q5_k ? kGgmlQ5_K
                      : dtype == DType::q6_k ? kGgmlQ6_K
                                             : kGgmlMxfp4;
  TQ_CHECK(dtype != DType::u8, "GGUF has no U8 tensors");
  add_tensor_raw(name, id, std::move(shape), encode_values(dtype, values));
}

std::vector<uint8_t> GgufWriter::bytes() const {
  std::vector<Kv> kvs = kvs_;
  bool has_alignment_key = false;
  for (const Kv& kv : kvs) has_alignment_key = has_alignment_key || kv.key == "general.alignment";
  if (alignment_ != 32 && !has_alignment_key) {
    kvs.push_back({"general.alignment", GgufType::u32, scalar_bytes(&alignment_, 4)});
  }
  auto align = [&](uint64_t x) { return (x + alignment_ - 1) / alignment_ * alignment_; };

  std::vector<uint8_t> out = {'G', 'G', 'U', 'F'};
  put_le(out, version_);
  put_le(out, static_cast<uint64_t>(tensors_.size()));
  put_le(out, static_cast<uint64_t>(kvs.size()));
  for (const Kv& kv : kvs) {
    const std::vector<uint8_t> key = encode_string(kv.key);
    out.insert(out.end(), key.begin(), key.end());
    put_le(out, static_cast<uint32_t>(kv.type));
    out.insert(out.end(), kv.payload.begin(), kv.payload.end());
  }
  std::vector<uint64_t> offsets;
  uint64_t next = 0;
  for (const Tensor& t : tensors_) {
    offsets.push_back(t.offset.value_or(next));
    next = align(std::max(next, offsets.back() + t.data.size()));
  }
  for (size_t k = 0; k < tensors_.size(); ++k) {
    const Tensor& t = tensors_[k];
    const std::vector<uint8_t> name = encode_string(t.name);
    out.insert(out.end(), name.begin(), name.end());
    put_le(out, static_cast<uint32_t>(t.shape.size()));
    for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) put_le(out, static_cast<uint64_t>(*d));
    put_le(out, t.type);
    put_le(out, offsets[k]);
  }
  out.resize(align(out.size()), 0);
  const size_t data_start = out.size();
  for (size_t k = 0; k < tensors_.size(); ++k) {
    const Tensor& t = tensors_[k];
    const size_t at = data_start + offsets[k];
    if (t.data.empty()) continue;  // a tensor given no bytes (corrupt-file tests) may point anywhere
    if (out.size() < at + t.data.size()) out.resize(at + t.data.size(), 0);
    std::memcpy(out.data() + at, t.data.data(), t.data.size());
  }
  return out;
}

}  // namespace tq
