#include "model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace tq {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The safetensors library refuses headers above 100 MB; so do we (a corrupt length must not make
// us parse gigabytes of tensor data as JSON).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// U8 holds the planes of MXFP4 expert weights (*_blocks, *_scales); the weight checks say where it
// may appear.
// U32 holds the packed codes of the reference system's TurboQuant folders (model/mlx_tq.h).
constexpr const char* kSupportedDtypes = "F32, F16, BF16, U8, U32";

std::optional<DType> supported_dtype(const std::string& name) {
  if (name == "F32") return DType::f32;
  if (name == "F16") return DType::f16;
  if (name == "BF16") return DType::bf16;
  if (name == "U8") return DType::u8;
  if (name == "U32") return DType::u32;
  return std::nullopt;
}

// A JSON integer that fits in int64 and is >= 0.
bool read_count(const json& v, int64_t& out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    out = v.get<int64_t>();
    return out >= 0;
  }
  return false;
}

// Parses JSON and rejects a key repeated in the top-level object (nlohmann would keep the last one
// silently, and a tensor named twice is a corrupt file).
json parse_json_unique_top_keys(const char* begin, const char* end, const std::string& what) {
  std::set<std::string> seen;
  std::string duplicate;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(begin, end, cb);
  } catch (const json::exception& e) {
    fail(what, " is not valid JSON: ", e.what());
  }
  TQ_CHECK(duplicate.empty(), what, " names '", duplicate, "' twice");
  return j;
}

json read_json_file(const std::string& path) {
  MappedFile f = MappedFile::open(path);
  const char* p = reinterpret_cast<const char*>(f.data());
  return parse_json_unique_top_keys(p, p + f.size(), "'" + path + "'");
}

}  // namespace

int safetensors_dtype_bits(const std::string& name) {
  static const std::pair<const char*, int> kAll[] = {
      {"BOOL", 8}, {"U8", 8},       {"I8", 8},       {"I16", 16},      {"U16", 16},     {"F16", 16},    {"BF16", 16},
      {"I32", 32}, {"U32", 32},     {"F32", 32},     {"F64", 64},      {"I64", 64},     {"U64", 64},    {"F8_E5M2", 8},
      {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F4", 4},     {"F6_E2M3", 6},   {"F6_E3M2", 6},  {"C64", 64}};
  for (const auto& [k, bits] : kAll) {
    if (name == k) return bits;
  }
  return 0;
}

bool is_known_safetensors_dtype(const std::string& name) { return safetensors_dtype_bits(name) > 0; }

SafetensorsFile SafetensorsFile::open(const std::string& path, SafetensorsRead mode) { return parse(MappedFile::open(path), mode); }

SafetensorsFile SafetensorsFile::parse(MappedFile file, SafetensorsRead mode) {
  const std::string& path = file.path();
  const uint64_t size = file.size();
  TQ_CHECK(size >= 8, "'", path, "' is not a safetensors file: ", size,
           " bytes, too short for the 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file.data()[i];  // little-endian
  TQ_CHECK(header_len > 0, "'", path, "': safetensors header length is 0");
  TQ_CHECK(header_len <= size - 8, "'", path, "': safetensors header length ", header_len,
           " runs past the end of the file (", size, " bytes; is it truncated or not a safetensors file?)");
  TQ_CHECK(header_len <= kMaxHeaderBytes, "'", path, "': safetensors header length ", header_len,
           " is above the 100 MB limit");

  const char* header = reinterpret_cast<const char*>(file.data() + 8);
  TQ_CHECK(header[0] == '{', "'", path, "': safetensors header does not start with '{' (not a safetensors file?)");
  const json root = parse_json_unique_top_keys(header, header + header_len, "'" + path + "': safetensors header");
  TQ_CHECK(root.is_object(), "'", path, "': safetensors header is not a JSON object");

  const uint8_t* buffer = file.data() + 8 + header_len;
  const uint64_t buffer_size = size - 8 - header_len;

  SafetensorsFile out;
  struct Span {
    uint64_t begin, end;
    size_t tensor;
  };
  std::vector<Span> spans;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      TQ_CHECK(entry.is_object() || entry.is_null(), "'", path, "': __metadata__ is not a JSON object");
      if (entry.is_object()) {
        for (auto m = entry.begin(); m != entry.end(); ++m) {
          if (m.value().is_string()) out.metadata_[m.key()] = m.value().get<std::string>();
        }
      }
      continue;
    }
    const std::string where = "'" + path + "': tensor '" + name + "'";
    TQ_CHECK(!name.empty(), "'", path, "': a tensor has an empty name");
    TQ_CHECK(entry.is_object(), where, ": entry is not a JSON object");

    auto dtype_it = entry.find("dtype");
    TQ_CHECK(dtype_it != entry.end() && dtype_it->is_string(), where, ": missing or non-string \"dtype\"");
    const std::string dtype_str = dtype_it->get<std::string>();
    std::optional<DType> dtype = supported_dtype(dtype_str);
    const bool opaque = !dtype && mode == SafetensorsRead::header_only && is_known_safetensors_dtype(dtype_str);
    if (!dtype && !opaque) {
      if (is_known_safetensors_dtype(dtype_str)) {
        fail(where, ": dtype ", dtype_str, " is not supported (supported: ", kSupportedDtypes, ")");
      }
      fail(where, ": unknown dtype '", dtype_str, "' (supported: ", kSupportedDtypes, ")");
    }

    auto shape_it = entry.find("shape");
    TQ_CHECK(shape_it != entry.end() && shape_it->is_array(), where, ": missing or non-array \"shape\"");
    std::vector<int64_t> shape;
    for (const json& d : *shape_it) {
      int64_t v;
      TQ_CHECK(read_count(d, v), where, ": shape ", shape_it->dump(), " has an entry that is not a non-negative integer");
      shape.push_back(v);
    }

    auto off_it = entry.find("data_offsets");
    TQ_CHECK(off_it != entry.end() && off_it->is_array() && off_it->size() == 2, where,
             ": missing \"data_offsets\" or not a pair [begin, end]");
    int64_t begin, end;
    TQ_CHECK(read_count((*off_it)[0], begin) && read_count((*off_it)[1], end), where, ": data_offsets ",
             off_it->dump(), " are not non-negative integers");
    TQ_CHECK(begin <= end, where, ": data_offsets ", off_it->dump(), " end before they begin");
    TQ_CHECK(static_cast<uint64_t>(end) <= buffer_size, where, ": data_offsets ", off_it->dump(),
             " run past the end of the data (", buffer_size, " bytes after the header; file truncated?)");

    std::optional<uint64_t> expected;
    if (opaque) {
      // Bits per element times elements, in whole bytes (sub-byte dtypes pack their elements).
      using u128 = unsigned __int128;
      const u128 limit = static_cast<u128>(std::numeric_limits<uint64_t>::max()) * 8;
      u128 bits = static_cast<u128>(safetensors_dtype_bits(dtype_str));
      bool fits = true;
      for (int64_t d : shape) {
        fits = fits && (d == 0 || bits <= limit / static_cast<u128>(d));
        if (fits) bits *= static_cast<u128>(d);
      }
      if (fits) expected = static_cast<uint64_t>((bits + 7) / 8);
    } else {
      expected = tensor_bytes(*dtype, shape);
    }
    TQ_CHECK(expected.has_value(), where, ": shape ", shape_string(shape), " is too large");
    TQ_CHECK(*expected == static_cast<uint64_t>(end - begin), where, ": shape ", shape_string(shape), " of ",
             dtype_str, " needs ", *expected, " bytes but data_offsets ", off_it->dump(), " hold ", end - begin);
    if (opaque) {
      dtype = DType::u8;  // the bytes as they are: nothing computes with them
      shape = {end - begin};
    }

    TensorView view;
    view.name = name;
    view.dtype = *dtype;
    view.shape = std::move(shape);
    view.data = buffer + begin;
    view.nbytes = static_cast<uint64_t>(end - begin);
    view.file = path;
    spans.push_back({static_cast<uint64_t>(begin), static_cast<uint64_t>(end), out.tensors_.size()});
    out.tensors_.push_back(std::move(view));
  }

  // Non-empty tensors must not share bytes.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Span* previous = nullptr;
  for (const Span& s : spans) {
    if (s.begin == s.end) continue;
    if (previous != nullptr) {
      TQ_CHECK(s.begin >= previous->end, "'", path, "': tensors '", out.tensors_[previous->tensor].name, "' [",
               previous->begin, ", ", previous->end, ") and '", out.tensors_[s.tensor].name, "' [", s.begin, ", ",
               s.end, ") overlap");
    }
    previous = &s;
  }
  std::vector<TensorView> ordered;
  ordered.reserve(spans.size());
  for (const Span& s : spans) ordered.push_back(std::move(out.tensors_[s.tensor]));
  out.tensors_ = std::move(ordered);
  out.file_ = std::move(file);  // the mapping's address does not change, so the views stay valid
  return out;
}

SafetensorsModel SafetensorsModel::from_files(std::string source, std::vector<SafetensorsFile> files) {
  SafetensorsModel m;
  m.tensors_ = TensorSet(std::move(source));
  m.files_ = std::move(files);
  for (const SafetensorsFile& f : m.files_) {
    for (const TensorView& t : f.tensors()) m.tensors_.add(t);
  }
  for (const SafetensorsFile& f : m.files_) {
    std::set<std::string> own;
    for (const TensorView& t : f.tensors()) own.insert(t.name);
    for (const auto& [key, value] : f.metadata()) {
      if (own.count(value) && !m.tensors_.contains(key)) m.tensors_.add_alias(key, value);
    }
  }
  return m;
}

SafetensorsModel SafetensorsModel::open(const std::string& path, SafetensorsRead mode) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  TQ_CHECK(fs::exists(st), "model path '", path, "' does not exist");

  std::string single, index;
  if (fs::is_directory(st)) {
    const fs::path dir(path);
    if (fs::exists(dir / "model.safetensors")) {
      single = (dir / "model.safetensors").string();
    } else if (fs::exists(dir / "model.safetensors.index.json")) {
      index = (dir / "model.safetensors.index.json").string();
    } else {
      fail("model folder '", path, "' has neither model.safetensors nor model.safetensors.index.json");
    }
  } else if (path.size() >= 11 && path.compare(path.size() - 11, 11, ".index.json") == 0) {
    index = path;
  } else {
    single = path;
  }

  if (!single.empty()) {
    std::vector<SafetensorsFile> files;
    files.push_back(SafetensorsFile::open(single, mode));
    return from_files(single, std::move(files));
  }

  const json root = read_json_file(index);
  TQ_CHECK(root.is_object(), "'", index, "' is not a JSON object");
  auto wm = root.find("weight_map");
  TQ_CHECK(wm != root.end() && wm->is_object(), "'", index, "' has no \"weight_map\" object");
  TQ_CHECK(!wm->empty(), "'", index, "': weight_map is empty");

  // tensor name -> shard file name, and the shards in the order they are first named.
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> shard_names;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    TQ_CHECK(it.value().is_string(), "'", index, "': weight_map entry '", it.key(), "' is not a file name");
    const std::string shard = it.value().get<std::string>();
    const fs::path rel(shard);
    bool escapes = shard.empty() || rel.is_absolute();
    for (const auto& part : rel) escapes = escapes || part == "..";
    TQ_CHECK(!escapes, "'", index, "': shard name '", shard, "' for tensor '", it.key(),
             "' is not a file inside the model folder");
    weight_map[it.key()] = shard;
    if (std::find(shard_names.begin(), shard_names.end(), shard) == shard_names.end()) shard_names.push_back(shard);
  }
  std::sort(shard_names.begin(), shard_names.end());

  const fs::path dir = fs::path(index).parent_path();
  std::vector<SafetensorsFile> files;
  for (const std::string& shard : shard_names) {
    const std::string shard_path = (dir / shard).string();
    try {
      files.push_back(SafetensorsFile::open(shard_path, mode));
    } catch (const Error& e) {
      fail("'", index, "' lists shard '", shard, "', which cannot be read: ", e.what());
    }
  }

  // Where each tensor actually is, to name both shards of a duplicate before anything else.
  std::map<std::string, std::string> found_in;
  for (size_t i = 0; i < files.size(); ++i) {
    for (const TensorView& t : files[i].tensors()) {
      auto [it, inserted] = found_in.emplace(t.name, shard_names[i]);
      TQ_CHECK(inserted, "'", index, "': tensor '", t.name, "' is in two shards, '", it->second, "' and '",
               shard_names[i], "'");
    }
  }
  for (const auto& [name, shard] : found_in) {
    auto listed = weight_map.find(name);
    TQ_CHECK(listed != weight_map.end(), "'", index, "': tensor '", name, "' of shard '", shard,
             "' is not in the index's weight_map");
    TQ_CHECK(listed->second == shard, "'", index, "': the index puts tensor '", name, "' in '", listed->second,
             "' but it is in '", shard, "'");
  }
  for (const auto& [name, shard] : weight_map) {
    TQ_CHECK(found_in.count(name) != 0, "'", index, "': tensor '", name, "' is listed in shard '", shard,
             "' but that shard has no such tensor");
  }

  SafetensorsModel m = from_files(dir.string(), std::move(files));
  m.index_path_ = index;
  return m;
}

}  // namespace tq
