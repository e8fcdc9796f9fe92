#include "model/gguf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace tq {

namespace {

constexpr uint32_t kMaxDims = 4;          // GGML_MAX_DIMS
constexpr int kMaxArrayNesting = 8;       // arrays of arrays deeper than this are not metadata
constexpr uint64_t kMaxKeyBytes = 65535;  // the spec's limit on key length

size_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::u8: case GgufType::i8: case GgufType::boolean: return 1;
    case GgufType::u16: case GgufType::i16: return 2;
    case GgufType::u32: case GgufType::i32: case GgufType::f32: return 4;
    case GgufType::u64: case GgufType::i64: case GgufType::f64: return 8;
    default: return 0;  // string, array: variable
  }
}

bool is_unsigned(GgufType t) {
  return t == GgufType::u8 || t == GgufType::u16 || t == GgufType::u32 || t == GgufType::u64;
}
bool is_signed(GgufType t) {
  return t == GgufType::i8 || t == GgufType::i16 || t == GgufType::i32 || t == GgufType::i64;
}
bool is_float(GgufType t) { return t == GgufType::f32 || t == GgufType::f64; }

uint64_t load_le(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t k = n; k-- > 0;) v = (v << 8) | p[k];
  return v;
}

// Decodes a numeric or bool scalar of type t at p into the value's u / i / f field.
void decode_scalar(GgufType t, const uint8_t* p, GgufValue& v) {
  const uint64_t bits = load_le(p, scalar_size(t));
  switch (t) {
    case GgufType::u8: case GgufType::u16: case GgufType::u32: case GgufType::u64: case GgufType::boolean:
      v.u = bits;
      break;
    case GgufType::i8: v.i = static_cast<int8_t>(bits); break;
    case GgufType::i16: v.i = static_cast<int16_t>(bits); break;
    case GgufType::i32: v.i = static_cast<int32_t>(bits); break;
    case GgufType::i64: v.i = static_cast<int64_t>(bits); break;
    case GgufType::f32: {
      float x;
      const uint32_t b32 = static_cast<uint32_t>(bits);
      std::memcpy(&x, &b32, 4);
      v.f = x;
      break;
    }
    case GgufType::f64: {
      double x;
      std::memcpy(&x, &bits, 8);
      v.f = x;
      break;
    }
    default: break;
  }
}

// Bounds-checked little-endian reads over the file; every failure names the file and the item.
class Reader {
 public:
  Reader(const MappedFile& f) : path_(f.path()), data_(f.data()), size_(f.size()) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }

  void need(uint64_t n, const std::string& what) const {
    TQ_CHECK(n <= remaining(), "'", path_, "': file ends inside ", what, " (needs ", n, " bytes at offset ", pos_,
             ", file is ", size_, " bytes; truncated?)");
  }
  const uint8_t* take(uint64_t n, const std::string& what) {
    need(n, what);
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  uint32_t u32(const std::string& what) { return static_cast<uint32_t>(load_le(take(4, what), 4)); }
  uint64_t u64(const std::string& what) { return load_le(take(8, what), 8); }
  std::string string(const std::string& what, uint64_t max_len = std::numeric_limits<uint64_t>::max()) {
    const uint64_t len = u64("the length of " + what);
    TQ_CHECK(len <= max_len, "'", path_, "': ", what, " is ", len, " bytes long (limit ", max_len, ")");
    TQ_CHECK(len <= remaining(), "'", path_, "': ", what, " claims ", len, " bytes at offset ", pos_,
             " but the file has only ", remaining(), " left (truncated or corrupt)");
    const uint8_t* p = take(len, what);
    return std::string(reinterpret_cast<const char*>(p), len);
  }

  GgufType value_type(const std::string& what) {
    const uint32_t t = u32("the type of " + what);
    TQ_CHECK(t <= static_cast<uint32_t>(GgufType::f64), "'", path_, "': ", what, " has unknown value type ", t);
    return static_cast<GgufType>(t);
  }

  GgufValue value(GgufType type, const std::string& what, int depth) {
    GgufValue v;
    v.type = type;
    if (type == GgufType::string) {
      v.str = string(what);
    } else if (type == GgufType::array) {
      TQ_CHECK(depth < kMaxArrayNesting, "'", path_, "': ", what, " nests arrays more than ", kMaxArrayNesting,
               " deep");
      v.elem_type = value_type("the elements of " + what);
      v.count = u64("the element count of " + what);
      // Each element takes at least min_size bytes, which bounds the count before anything is reserved.
      const uint64_t min_size = v.elem_type == GgufType::string  ? 8
                                : v.elem_type == GgufType::array ? 12
                                                                 : scalar_size(v.elem_type);
      TQ_CHECK(v.count <= remaining() / min_size, "'", path_, "': ", what, " claims ", v.count, " elements of type ",
               gguf_type_name(v.elem_type), " at offset ", pos_, " but only ", remaining(),
               " bytes are left (truncated or corrupt)");
      if (v.elem_type == GgufType::string) {
        v.strings.reserve(v.count);
        for (uint64_t k = 0; k < v.count; ++k) v.strings.push_back(string("element " + std::to_string(k) + " of " + what));
      } else if (v.elem_type == GgufType::array) {
        for (uint64_t k = 0; k < v.count; ++k) {
          // Elements carry no type tag of their own: each is an array payload (type, count, elements).
          v.items.push_back(value(GgufType::array, "element " + std::to_string(k) + " of " + what, depth + 1));
        }
      } else {
        v.elems = take(v.count * min_size, what);
        if (v.elem_type == GgufType::boolean) {
          for (uint64_t k = 0; k < v.count; ++k) {
            TQ_CHECK(v.elems[k] <= 1, "'", path_, "': element ", k, " of ", what, " is a bool with byte value ",
                     int(v.elems[k]));
          }
        }
      }
    } else {
      decode_scalar(type, take(scalar_size(type), what), v);
      TQ_CHECK(type != GgufType::boolean || v.u <= 1, "'", path_, "': ", what, " is a bool with byte value ", v.u);
    }
    return v;
  }

 private:
  const std::string& path_;
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

std::string printable_magic(const uint8_t* p) {
  std::ostringstream os;
  os << '\'';
  for (int k = 0; k < 4; ++k) os << (p[k] >= 0x20 && p[k] < 0x7f ? static_cast<char>(p[k]) : '?');
  os << "' (bytes";
  static const char* hex = "0123456789abcdef";
  for (int k = 0; k < 4; ++k) os << ' ' << hex[p[k] >> 4] << hex[p[k] & 15];
  os << ')';
  return os.str();
}

// Reads one numeric element of an array as the wanted kind.
template <typename T>
T numeric_element(const GgufValue& v, uint64_t k, const std::string& path, const std::string& key) {
  GgufValue e;
  const size_t sz = scalar_size(v.elem_type);
  decode_scalar(v.elem_type, v.elems + k * sz, e);
  if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(e.f);
  } else {
    const bool fits = is_unsigned(v.elem_type)
                          ? e.u <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                          : (e.i >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                             (e.i < 0 || static_cast<uint64_t>(e.i) <= static_cast<uint64_t>(std::numeric_limits<T>::max())));
    if (!fits) {
      fail("'", path, "': element ", k, " of '", key, "' (",
           is_unsigned(v.elem_type) ? std::to_string(e.u) : std::to_string(e.i), ") does not fit the requested type");
    }
    return is_unsigned(v.elem_type) ? static_cast<T>(e.u) : static_cast<T>(e.i);
  }
}

}  // namespace

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::u8: return "UINT8";
    case GgufType::i8: return "INT8";
    case GgufType::u16: return "UINT16";
    case GgufType::i16: return "INT16";
    case GgufType::u32: return "UINT32";
    case GgufType::i32: return "INT32";
    case GgufType::f32: return "FLOAT32";
    case GgufType::boolean: return "BOOL";
    case GgufType::string: return "STRING";
    case GgufType::array: return "ARRAY";
    case GgufType::u64: return "UINT64";
    case GgufType::i64: return "INT64";
    case GgufType::f64: return "FLOAT64";
  }
  return "?";
}

const char* ggml_type_name(uint32_t id) {
  // Ids from ggml.h; gaps are ids that were removed from the format.
  static const char* const kNames[] = {
      "F32",     "F16",    "Q4_0",    "Q4_1",  "Q4_2",     "Q4_3",     "Q5_0",     "Q5_1",       "Q8_0",
      "Q8_1",    "Q2_K",   "Q3_K",    "Q4_K",  "Q5_K",     "Q6_K",     "Q8_K",     "IQ2_XXS",    "IQ2_XS",
      "IQ3_XXS", "IQ1_S",  "IQ4_NL",  "IQ3_S", "IQ2_S",    "IQ4_XS",   "I8",       "I16",        "I32",
      "I64",     "F64",    "IQ1_M",   "BF16",  "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8", "TQ1_0",      "TQ2_0",
      "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4"};
  return id < sizeof(kNames) / sizeof(kNames[0]) ? kNames[id] : nullptr;
}

std::string GgufValue::describe(size_t max_items) const {
  std::ostringstream os;
  auto scalar = [&](const GgufValue& v) {
    if (is_unsigned(v.type)) os << v.u;
    else if (is_signed(v.type)) os << v.i;
    else if (is_float(v.type)) os << v.f;
    else if (v.type == GgufType::boolean) os << (v.u ? "true" : "false");
    else if (v.type == GgufType::string) os << '"' << v.str << '"';
  };
  if (type != GgufType::array) {
    os << gguf_type_name(type) << ' ';
    scalar(*this);
    return os.str();
  }
  os << "ARRAY<" << gguf_type_name(elem_type) << ">[" << count << "] {";
  const uint64_t shown = std::min<uint64_t>(count, max_items);
  for (uint64_t k = 0; k < shown; ++k) {
    if (k) os << ", ";
    if (elem_type == GgufType::string) {
      os << '"' << strings[k] << '"';
    } else if (elem_type == GgufType::array) {
      os << items[k].describe(max_items);
    } else {
      GgufValue e;
      e.type = elem_type;
      decode_scalar(elem_type, elems + k * scalar_size(elem_type), e);
      scalar(e);
    }
  }
  if (count > shown) os << ", ...";
  os << '}';
  return os.str();
}

GgufFile GgufFile::open(const std::string& path) { return parse(MappedFile::open(path)); }

GgufFile GgufFile::parse(MappedFile file) {
  const std::string path = file.path();
  GgufFile g;
  Reader r(file);

  TQ_CHECK(file.size() >= 4, "'", path, "' is not a GGUF file: only ", file.size(), " bytes");
  const uint8_t* magic = file.data();
  TQ_CHECK(std::memcmp(magic, "GGUF", 4) == 0, "'", path, "' is not a GGUF file: magic is ", printable_magic(magic),
           ", expected 'GGUF'");
  r.take(4, "the magic");
  g.version_ = r.u32("the GGUF version");
  if (g.version_ != 3) {
    if (g.version_ == 1 || g.version_ == 2) {
      fail("'", path, "': GGUF version ", g.version_,
           " is not supported (only version 3); convert the model again with a current llama.cpp");
    }
    if ((g.version_ & 0xffffu) == 0 && (g.version_ >> 16) != 0) {
      fail("'", path, "': big-endian GGUF files are not supported (version field reads ", g.version_, ")");
    }
    fail("'", path, "': unknown GGUF version ", g.version_, " (only version 3 is supported)");
  }
  const uint64_t n_tensors = r.u64("the tensor count");
  const uint64_t n_kv = r.u64("the metadata count");
  // A key/value takes at least 12 bytes and a tensor info at least 24.
  TQ_CHECK(n_kv <= r.remaining() / 12, "'", path, "': metadata count ", n_kv, " cannot fit in the file (",
           file.size(), " bytes)");
  TQ_CHECK(n_tensors <= r.remaining() / 24, "'", path, "': tensor count ", n_tensors, " cannot fit in the file (",
           file.size(), " bytes)");

  for (uint64_t k = 0; k < n_kv; ++k) {
    const std::string key = r.string("metadata key #" + std::to_string(k), kMaxKeyBytes);
    TQ_CHECK(!key.empty(), "'", path, "': metadata key #", k, " is empty");
    const std::string what = "metadata value '" + key + "'";
    const GgufType type = r.value_type(what);
    GgufValue v = r.value(type, what, 0);
    TQ_CHECK(g.metadata_.count(key) == 0, "'", path, "': metadata key '", key, "' appears twice");
    g.keys_.push_back(key);
    g.metadata_.emplace(key, std::move(v));
  }

  if (const GgufValue* a = g.find("general.alignment")) {
    TQ_CHECK(a->type == GgufType::u32, "'", path, "': general.alignment is ", gguf_type_name(a->type),
             ", expected UINT32");
    TQ_CHECK(a->u > 0 && (a->u & (a->u - 1)) == 0, "'", path, "': general.alignment ", a->u,
             " is not a power of two");
    g.alignment_ = a->u;
  }

  struct Info {
    std::string name;
    std::vector<int64_t> shape;  // outermost first
    uint32_t type;
    uint64_t offset;
  };
  std::vector<Info> infos;
  infos.reserve(n_tensors);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    Info info;
    info.name = r.string("the name of tensor #" + std::to_string(k));
    const std::string what = "tensor '" + info.name + "'";
    TQ_CHECK(!info.name.empty(), "'", path, "': tensor #", k, " has an empty name");
    const uint32_t n_dims = r.u32("the dimension count of " + what);
    TQ_CHECK(n_dims <= kMaxDims, "'", path, "': ", what, " has ", n_dims, " dimensions (at most ", kMaxDims, ")");
    std::vector<int64_t> ne(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t e = r.u64("the dimensions of " + what);
      TQ_CHECK(e <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "'", path, "': ", what,
               " has dimension ", d, " = ", e, ", out of range");
      ne[d] = static_cast<int64_t>(e);
    }
    info.shape.assign(ne.rbegin(), ne.rend());
    info.type = r.u32("the type of " + what);
    info.offset = r.u64("the data offset of " + what);
    infos.push_back(std::move(info));
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t end_of_infos = r.pos();
  const uint64_t data_offset = (end_of_infos + g.alignment_ - 1) / g.alignment_ * g.alignment_;
  g.data_offset_ = data_offset;
  TQ_CHECK(infos.empty() || data_offset <= file.size(), "'", path, "': the tensor data would start at offset ",
           data_offset, ", past the end of the file (", file.size(), " bytes; truncated?)");
  const uint64_t data_size = data_offset <= file.size() ? file.size() - data_offset : 0;

  g.tensors_ = TensorSet(path);
  struct Span {
    uint64_t begin, end;
    size_t info;
  };
  std::vector<Span> spans;
  for (size_t k = 0; k < infos.size(); ++k) {
    const Info& info = infos[k];
    const std::string what = "'" + path + "': tensor '" + info.name + "'";
    DType dtype;
    switch (info.type) {
      case kGgmlF32: dtype = DType::f32; break;
      case kGgmlF16: dtype = DType::f16; break;
      case kGgmlBF16: dtype = DType::bf16; break;
      case kGgmlQ8_0: dtype = DType::q8_0; break;
      case kGgmlMxfp4: dtype = DType::mxfp4; break;
      case kGgmlQ4_0: dtype = DType::q4_0; break;
      case kGgmlQ4_K: dtype = DType::q4_k; break;
      case kGgmlQ5_K: dtype = DType::q5_k; break;
      case kGgmlQ6_K: dtype = DType::q6_k; break;
      default: {
        const char* name = ggml_type_name(info.type);
        if (name != nullptr) {
          fail(what, " has ggml type ", name, ", which is not supported (supported: ", kGgufSupportedTypes, ")");
        }
        fail(what, " has unknown ggml type id ", info.type, " (supported: ", kGgufSupportedTypes, ")");
      }
    }
    const std::optional<uint64_t> nbytes = tensor_bytes(dtype, info.shape);
    if (!nbytes) {
      TQ_CHECK(dtype_block_elems(dtype) == 1 || info.shape.empty() || info.shape.back() % dtype_block_elems(dtype) == 0,
               what, ": ", dtype_name(dtype), " rows of ", info.shape.back(),
               " values are not a whole number of ", dtype_block_elems(dtype), "-value blocks");
      fail(what, ": shape ", shape_string(info.shape), " is too large");
    }
    TQ_CHECK(info.offset % g.alignment_ == 0, what, ": data offset ", info.offset,
             " is not a multiple of the alignment ", g.alignment_);
    TQ_CHECK(info.offset <= data_size && *nbytes <= data_size - info.offset, what, ": data [", info.offset, ", +",
             *nbytes, ") runs past the end of the file (", data_size, " bytes of tensor data; truncated?)");
    TensorView view;
    view.name = info.name;
    view.dtype = dtype;
    view.shape = info.shape;
    view.data = file.data() + data_offset + info.offset;
    view.nbytes = *nbytes;
    view.file = path;
    g.ggml_types_[info.name] = info.type;
    g.tensors_.add(std::move(view));
    spans.push_back({info.offset, info.offset + *nbytes, k});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  const Span* previous = nullptr;
  for (const Span& s : spans) {
    if (s.begin == s.end) continue;
    if (previous != nullptr) {
      TQ_CHECK(s.begin >= previous->end, "'", path, "': tensors '", infos[previous->info].name, "' and '",
               infos[s.info].name, "' overlap in the data section");
    }
    previous = &s;
  }
  g.file_ = std::move(file);  // mapping address unchanged: the views stay valid
  return g;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufValue& GgufFile::require(const std::string& key, const char* wanted) const {
  const GgufValue* v = find(key);
  TQ_CHECK(v != nullptr, "'", path(), "': metadata key '", key, "' is missing (expected ", wanted, ")");
  return *v;
}

std::string GgufFile::get_string(const std::string& key) const {
  const GgufValue& v = require(key, "a string");
  TQ_CHECK(v.type == GgufType::string, "'", path(), "': metadata '", key, "' is ", gguf_type_name(v.type),
           ", expected STRING");
  return v.str;
}

int64_t GgufFile::get_i64(const std::string& key) const {
  const GgufValue& v = require(key, "an integer");
  if (is_signed(v.type)) return v.i;
  TQ_CHECK(is_unsigned(v.type), "'", path(), "': metadata '", key, "' is ", gguf_type_name(v.type),
           ", expected an integer");
  TQ_CHECK(v.u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "'", path(), "': metadata '", key,
           "' = ", v.u, " does not fit in int64");
  return static_cast<int64_t>(v.u);
}

uint32_t GgufFile::get_u32(const std::string& key) const {
  const GgufValue& v = require(key, "an integer");
  TQ_CHECK(is_signed(v.type) || is_unsigned(v.type), "'", path(), "': metadata '", key, "' is ",
           gguf_type_name(v.type), ", expected an integer");
  const bool fits = is_unsigned(v.type) ? v.u <= 0xffffffffu : (v.i >= 0 && v.i <= 0xffffffffll);
  TQ_CHECK(fits, "'", path(), "': metadata '", key, "' = ", is_unsigned(v.type) ? std::to_string(v.u) : std::to_string(v.i),
           " does not fit in uint32");
  return is_unsigned(v.type) ? static_cast<uint32_t>(v.u) : static_cast<uint32_t>(v.i);
}

float GgufFile::get_f32(const std::string& key) const {
  const GgufValue& v = require(key, "a float");
  TQ_CHECK(is_float(v.type), "'", path(), "': metadata '", key, "' is ", gguf_type_name(v.type),
           ", expected FLOAT32");
  return static_cast<float>(v.f);
}

bool GgufFile::get_bool(const std::string& key) const {
  const GgufValue& v = require(key, "a bool");
  TQ_CHECK(v.type == GgufType::boolean, "'", path(), "': metadata '", key, "' is ", gguf_type_name(v.type),
           ", expected BOOL");
  return v.u != 0;
}

uint64_t GgufFile::array_size(const std::string& key) const {
  const GgufValue& v = require(key, "an array");
  TQ_CHECK(v.type == GgufType::array, "'", path(), "': metadata '", key, "' is ", gguf_type_name(v.type),
           ", expected ARRAY");
  return v.count;
}

template <>
std::vector<std::string> GgufFile::get_array<std::string>(const std::string& key) const {
  const GgufValue& v = require(key, "an array of strings");
  TQ_CHECK(v.type == GgufType::array && v.elem_type == GgufType::string, "'", path(), "': metadata '", key, "' is ",
           v.type == GgufType::array ? "ARRAY<" + std::string(gguf_type_name(v.elem_type)) + ">"
                                     : std::string(gguf_type_name(v.type)),
           ", expected ARRAY<STRING>");
  return v.strings;
}

namespace {
template <typename T>
std::vector<T> numeric_array(const GgufValue* vp, const std::string& path, const std::string& key, bool want_float) {
  TQ_CHECK(vp != nullptr, "'", path, "': metadata key '", key, "' is missing (expected an array)");
  const GgufValue& v = *vp;
  const bool ok = v.type == GgufType::array &&
                  (want_float ? is_float(v.elem_type) : (is_signed(v.elem_type) || is_unsigned(v.elem_type)));
  TQ_CHECK(ok, "'", path, "': metadata '", key, "' is ",
           v.type == GgufType::array ? "ARRAY<" + std::string(gguf_type_name(v.elem_type)) + ">"
                                     : std::string(gguf_type_name(v.type)),
           want_float ? ", expected an array of floats" : ", expected an array of integers");
  std::vector<T> out(v.count);
  for (uint64_t k = 0; k < v.count; ++k) out[k] = numeric_element<T>(v, k, path, key);
  return out;
}
}  // namespace

template <>
std::vector<float> GgufFile::get_array<float>(const std::string& key) const {
  return numeric_array<float>(find(key), path(), key, true);
}
template <>
std::vector<int32_t> GgufFile::get_array<int32_t>(const std::string& key) const {
  return numeric_array<int32_t>(find(key), path(), key, false);
}
template <>
std::vector<int64_t> GgufFile::get_array<int64_t>(const std::string& key) const {
  return numeric_array<int64_t>(find(key), path(), key, false);
}
template <>
std::vector<uint32_t> GgufFile::get_array<uint32_t>(const std::string& key) const {
  return numeric_array<uint32_t>(find(key), path(), key, false);
}

}  // namespace tq
