// Tensors as they lie in a model file: a name, a storage type, a shape and a pointer into the
// file's bytes (no copy). Safetensors and GGUF readers both produce these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ops/dtype.h"
#include "ops/tq_format.h"

namespace tq {

// Storage types the loaders accept. Everything else is rejected by name when a file is opened.
enum class DType {
  f32,
  f16,
  bf16,
  q8_0,   // ggml Q8_0: blocks of 32 values = binary16 scale d + 32 int8 q; value = d * q
  u8,     // raw bytes (safetensors U8): the *_blocks and *_scales planes of HF MXFP4 tensors
  mxfp4,  // ggml MXFP4 (type 39): blocks of 32 values = E8M0 scale e + 16 bytes qs, where qs[j]
          // holds value j in its low nibble and value j + 16 in its high nibble (split-half);
          // value = E2M1(code) * 2^(e - 127) (ggml writes it as doubled codes * 2^(e - 128))
  tq2,    // TurboQuant weights (docs/FORMATS.md): a view the loader makes over '<name>.tq_codes' (U8) and
  tq3,    // '<name>.tq_scales' (F16) of a converted folder; shape [out, in], 32 values = 4 * bits bytes of codes,
  tq4,    // the scales in TensorView::tq_scales. Never a dtype in a file.

  // MLX TurboQuant folders (model/mlx_tq.h).
  u32,    // raw little-endian 32-bit words (safetensors U32): the packed codes of the reference system's
          // weight folders, read only by model/mlx_tq.cc, which turns them into tq2/tq3/tq4 views
  // ggml's 4-6 bit block types (GGUF types 2, 12, 13, 14), used in place; layouts in ops/kquant.h.
  q4_0,   // 32 values in 18 bytes
  q4_k,   // 256 values in 144 bytes
  q5_k,   // 256 values in 176 bytes
  q6_k,   // 256 values in 210 bytes
};
inline bool is_kquant(DType t) { return t == DType::q4_0 || t == DType::q4_k || t == DType::q5_k || t == DType::q6_k; }

const char* dtype_name(DType t);
// The ops storage type of a q4_0 / q4_k / q5_k / q6_k tensor (throws for the others).
ops::DType to_ops_kquant(DType t);           // "F32", "F16", "BF16", "Q8_0", "U8", "MXFP4"
int64_t dtype_block_elems(DType t);        // values per block: 1, or 32 for Q8_0, MXFP4, TQ and Q4_0, 256 for the k-quants
int64_t dtype_block_bytes(DType t);        // bytes per block: 4, 2, 2, 34, 1, 17 (TQ: 8, 12, 16 bytes of codes)
inline bool is_tq(DType t) { return t == DType::tq2 || t == DType::tq3 || t == DType::tq4; }
inline constexpr int64_t kQ8_0BlockElems = 32;
inline constexpr int64_t kQ8_0BlockBytes = 34;  // 2-byte f16 scale + 32 int8
static_assert(kQ8_0BlockBytes == 2 + kQ8_0BlockElems);
inline constexpr int64_t kMxfp4BlockElems = 32;
inline constexpr int64_t kMxfp4BlockBytes = 17;  // 1-byte E8M0 scale + 16 bytes of nibbles
static_assert(kMxfp4BlockBytes == 1 + kMxfp4BlockElems / 2);

// "[2048, 128]"
std::string shape_string(const std::vector<int64_t>& shape);

// Bytes taken by a tensor of `shape` stored as `dtype`; nullopt when a dimension is negative, the
// product overflows, or (block types) the last dimension is not a multiple of the block length.
std::optional<uint64_t> tensor_bytes(DType dtype, const std::vector<int64_t>& shape);

struct TensorView {
  std::string name;
  DType dtype = DType::f32;
  // Outermost dimension first (row-major, as PyTorch and NumPy write it): a linear layer's weight is
  // [out_features, in_features] and element (r, c) lies at r * in_features + c. GGUF lists its
  // dimensions innermost first (ggml's ne[]); the GGUF reader reverses them into this order.
  std::vector<int64_t> shape;
  // Points into the file's bytes; valid while the object that opened the file lives. Safetensors
  // gives no alignment guarantee beyond the byte, so read through memcpy or check the address.
  const void* data = nullptr;
  uint64_t nbytes = 0;
  std::string file;  // the file that holds the bytes, for messages
  // tq2/tq3/tq4 only: the binary16 group scales [rows][row_length / tq.group_size] and the parameters.
  const void* tq_scales = nullptr;
  ops::TqParams tq;

  int64_t numel() const;
  // The last dimension (1 for a scalar) and the product of all the others.
  int64_t row_length() const { return shape.empty() ? 1 : shape.back(); }
  int64_t rows() const;
  uint64_t row_bytes() const;
};

// Converts row `row` (0 <= row < view.rows()) to float32 (U8: each byte's value).
//   out: [view.row_length()] floats
// Slow and portable: meant for tests, loading and reference paths, not for the hot loop.
void read_row_f32(const TensorView& view, int64_t row, float* out);
// The whole tensor as float32, [numel] in row-major order.
std::vector<float> read_tensor_f32(const TensorView& view);

// The tensors of one model (one file or several shards), by name, with aliases.
class TensorSet {
 public:
  explicit TensorSet(std::string source = {}) : source_(std::move(source)) {}

  // Throws tq::Error when the name is already taken (naming both files).
  void add(TensorView view);
  // Puts `view` in the place of the stored tensor of its name (a loader's view over raw planes, e.g. MLX
  // TurboQuant codes); throws when there is none.
  void replace(TensorView view);
  // `alias` resolves to the tensor `target` (e.g. a tied embedding stored once under another name).
  void add_alias(const std::string& alias, const std::string& target);

  // nullptr when absent. Pointers stay valid until the next add().
  const TensorView* find(std::string_view name) const;
  // Throws tq::Error naming the source when absent.
  const TensorView& at(std::string_view name) const;
  bool contains(std::string_view name) const { return find(name) != nullptr; }

  const std::vector<TensorView>& all() const { return tensors_; }
  size_t size() const { return tensors_.size(); }
  const std::map<std::string, std::string>& aliases() const { return aliases_; }
  // Where the tensors came from (a file or a folder), for messages.
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::vector<TensorView> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> aliases_;
};

}  // namespace tq
