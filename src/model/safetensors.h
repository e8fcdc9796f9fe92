// Safetensors (Hugging Face): an 8-byte little-endian header length N, N bytes of JSON
//   { "__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ... }
// then the data buffer; offsets are relative to the buffer's start (byte 8 + N of the file).
// Everything is validated when the file is opened; tensors point into the mapping (no copy).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "model/mapped_file.h"
#include "model/tensor.h"

namespace tq {

// How a file's tensors are read. header_only (the memory plan, turboquant-plan): every tensor of a dtype
// the format defines is listed, those this reader cannot compute with (U32 codes of the reference system's
// TurboQuant folders, I8, ...) as flat U8 views of their bytes ([nbytes]) after their byte count is checked
// against their dtype and shape; nothing but the header is read either way.
enum class SafetensorsRead { weights, header_only };

class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path, SafetensorsRead mode = SafetensorsRead::weights);
  // Parses bytes already in memory or mapped (the file's path() names it in messages).
  static SafetensorsFile parse(MappedFile file, SafetensorsRead mode = SafetensorsRead::weights);

  const std::string& path() const { return file_.path(); }
  // In data order (ascending data_offsets).
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // "__metadata__" entries whose values are strings (others are ignored).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  MappedFile file_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The weights of a Hugging Face model: one model.safetensors, or model.safetensors.index.json and
// the shards it lists. Opening checks that every listed shard exists, every tensor of the index is
// in the shard it names, every tensor of a shard is in the index, and no tensor is in two shards.
//
// Aliases: safetensors stores a shared (tied) tensor once and records each dropped name in
// __metadata__ as  "<dropped name>": "<kept name>"  (TinyStories-656K keeps lm_head.weight and
// records model.embed_tokens.weight this way). A metadata entry whose key is not a tensor and whose
// value names a tensor of the same file becomes an alias in tensors().
class SafetensorsModel {
 public:
  // `path`: a folder (model.safetensors is preferred over an index when both exist, as transformers
  // does), a .safetensors file, or a .safetensors.index.json file.
  static SafetensorsModel open(const std::string& path, SafetensorsRead mode = SafetensorsRead::weights);

  const TensorSet& tensors() const { return tensors_; }
  // For the loader, which adds views over the files' tensors (TurboQuant weights: model/tq_weights.h).
  TensorSet& tensors() { return tensors_; }
  const std::vector<SafetensorsFile>& files() const { return files_; }
  // The index file, or empty for a single file.
  const std::string& index_path() const { return index_path_; }

 private:
  static SafetensorsModel from_files(std::string source, std::vector<SafetensorsFile> files);

  std::vector<SafetensorsFile> files_;
  TensorSet tensors_;
  std::string index_path_;
};

// True for the safetensors dtype names that exist in the format, supported here or not
// (F32, F16, BF16 are supported; I8, U8, F8_E4M3, F64, ... are recognised and rejected).
bool is_known_safetensors_dtype(const std::string& name);
// Bits per element of a dtype the format defines (BOOL 8, F4 4, F6_* 6, C64 64, ...); 0 for an unknown name.
int safetensors_dtype_bits(const std::string& name);

}  // namespace tq
