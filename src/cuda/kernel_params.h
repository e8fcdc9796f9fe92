// Parameter blocks of the CUDA kernels, passed by value at launch. Plain structs: the host code that
// fills them is ordinary C++ (no CUDA headers).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/layout.h"
#include "cuda/plan.h"

namespace tq::cuda {

// Clears every byte of a parameter block, padding included: blocks are compared byte for byte (a launch
// recorded in a CUDA graph is replayed while its parameters are unchanged), so that no stale padding
// makes equal parameters look different.
template <typename T>
void clear_bytes(T& block) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::memset(static_cast<void*>(&block), 0, sizeof block);
}

// What the main tier holds, as the attention kernel is specialised: TurboQuant codes, or FP16/BF16.
enum class MainKind : int32_t { tq = 0, dense_f16 = 1, dense_bf16 = 2 };

// How the kernels find and read one storage tier (main or sink).
struct TierParams {
  const uint8_t* base = nullptr;        // tile records
  const int32_t* page_table = nullptr;  // [sequence slot][page_stride] page ids; nullptr: the sink tier,
                                        // where a sequence slot's tiles are one "page" of its own
  int32_t page_stride = 0;
  int32_t tiles_per_page = 0;
  int32_t tile_bytes = 0;
  int32_t first_pos = 0;                // position of the tier's tile 0 (main: min_tokens; sink: 0)
  CodeKind k_kind = CodeKind::dense_f16, v_kind = CodeKind::dense_f16;
  int32_t k_words = 0, v_words = 0;     // lane words of the code sections
  int32_t k_scales = 0, v_codes = 0, v_scales = 0;  // section offsets in a tile record
  Lut16 k_lut{}, v_lut{};               // nibble kinds: byte planes of the binary16 level tables
  uint32_t k_bias = 0, v_bias = 0;      // byte_uniform: binary16 pair of 1024 + top
  const uint16_t* k_table = nullptr;    // byte_lut: 256 binary16 levels
  const uint16_t* v_table = nullptr;
};

// Byte address of a tile (host and device).
TQ_HD const uint8_t* tile_address(const TierParams& t, int slot, int head, int n_kv, int tile) {
  const int page_i = tile / t.tiles_per_page, in_page = tile - page_i * t.tiles_per_page;
  const int page = t.page_table ? t.page_table[slot * t.page_stride + page_i] : slot;
  return t.base + ((static_cast<int64_t>(page) * n_kv + head) * t.tiles_per_page + in_page) * static_cast<int64_t>(t.tile_bytes);
}

struct RequestParams {
  const float* q = nullptr;  // [n_q][n_heads][D], device; query i's row at q + i * q_stride
  float* out = nullptr;      // [n_q][n_heads][D], device, rows side by side
  int32_t n_q = 1, pos0 = 0;
  int32_t slot = 0;          // sequence slot in the cache
  int32_t length = 0;        // positions held
  int32_t n_sink = 0;        // positions in the sink tier: min(length, min_tokens)
  int32_t q_stride = 0;      // floats from one query's row to the next (n_heads * D when side by side)
  // Block-mean centring: the first position of the run that is still filling (held in FP16 in the tail
  // tier, "page" tail_page of it), or -1 when none; the main tier's positions end there.
  int32_t tail_pos = -1;
  int32_t tail_page = 0;
};

// What a block of the attention kernel reads first, in one round trip: its work item, the item's request
// and the ids of the first two main-tier pages its tiles lie in. With these the block starts copying
// tiles at once (a work item -> request -> page table chain of loads took three round trips, about 2 us
// of the H200's prologue before the first tile was on its way).
struct alignas(16) ItemRecord {
  WorkItem item;
  RequestParams request;
  int32_t pages[2];  // main tier: ids of pages tile_begin / tiles_per_page and the next one (-1: none)
};
static_assert(sizeof(ItemRecord) == 96);

// Block-mean centring of the main tier (kv/cache.h, KVCacheOptions::center_k): per page, KV head and run
// of center_tokens positions, the binary16 mean of the run's stored-domain (rotated) vectors. Pool layout
// [page][n_kv][runs][D] binary16 for K and for V; nullptr for a tensor that is not centred.
struct MeanParams {
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  int32_t runs = 0;        // runs per page (page_tokens / center_tokens); 0: not centred
  int32_t run_tiles = 0;   // 16-token tiles per run
  int32_t run_tiles_log2 = 0;  // run_tiles = 2^run_tiles_log2 (runs are powers of two)
  int32_t ring_bytes = 0;  // bytes of a tile's run means in the attention kernel's tile ring (D x 2 per centred tensor)
};

// Byte-free index of the mean row of (page, head, run) in a mean pool, in units of D values.
TQ_HD int64_t mean_row(const MeanParams& m, int page, int head, int n_kv, int run) {
  return (static_cast<int64_t>(page) * n_kv + head) * m.runs + run;
}

struct AttentionKernelParams {
  TierParams main, sink;
  TierParams tail;                  // centring: the FP16 tiles of each sequence's filling run (tier 2)
  MeanParams means;                 // centring: the main tier's run means (fused path; zero runs otherwise)
  const ItemRecord* items = nullptr;
  const OutputGroup* groups = nullptr;
  float* partials = nullptr;        // [parts][16 + 8 * D]: row maxima, row sums, rows x D accumulators
  uint32_t* counters = nullptr;     // [groups], zero between launches
  const float* sinks = nullptr;     // [n_heads] learned sink logits, or nullptr
  const float* k_signs = nullptr;   // [D] rotation signs of the main tier's K (nullptr: not rotated)
  const float* v_signs = nullptr;   // [D] ... of V
  const int32_t* n_items = nullptr; // device count of the items; blocks past it return (nullptr: the grid is the count)
  int32_t n_heads = 0, n_kv = 0, group = 1, window = 0;
  float q_scale = 1;                // softmax scale times log2(e): scores are in base 2
  float inv_sqrt_dim = 1;           // the rotation's 1/sqrt(D)
};

// Quantize-and-append: one entry per appended position.
struct AppendToken {
  int64_t tile0;   // byte offset (from the tier's base) of head 0's tile holding this position
  int32_t head_stride;  // bytes from one head's tile to the next's
  int16_t tier;    // 0 main, 1 sink
  int16_t tok;     // token index inside the tile
};
static_assert(sizeof(AppendToken) == 16);

// The level grids the append kernel implements (codec/group_quantizer.h, Grid): how the statistic scale
// is taken and how a value finds its code.
enum class EncodeGrid : int32_t {
  lloyd_max = 0,     // scale = group RMS (or L2 norm); code = thresholds below x / scale
  uniform = 1,       // scale = absmax / top; code = nearest integer level
  lloyd_absmax = 2,  // scale = absmax; code = thresholds below x / scale
};

// How one tier's vectors are written (K or V half of a tile).
struct EncodeParams {
  CodeKind kind = CodeKind::dense_f16;
  int32_t words = 0;          // lane words of the code section
  int32_t codes = 0;          // section offsets in the tile record
  int32_t scales = 0;
  int32_t group_size = 0;
  int32_t level_count = 0;
  EncodeGrid grid = EncodeGrid::lloyd_max;
  int32_t scale_kind_l2 = 0;  // 1: the statistic is the L2 norm, 0: the RMS
  int32_t scale_fit = 0;      // 0 plain, 1 norm correction, 2 least squares (codec/group_quantizer.h)
  float uniform_max = 0;
  const float* levels = nullptr;      // [level_count], device
  const float* thresholds = nullptr;  // [level_count - 1], device
  const float* signs = nullptr;       // [D] rotation signs, device (nullptr: dense, not rotated)
  float inv_sqrt_dim = 1;
  bool is_key = true;                 // element placement: K slots or V slots
  // Block-mean centring (main tier of a centred cache): the input is rounded to binary16 first (the CPU
  // encodes centred positions from its FP16 filling run), and, when `centred`, the run's binary16 mean
  // (AppendSource::mean_row of `means`) is subtracted after the rotation.
  bool round16 = false;
  bool centred = false;
  const uint16_t* means = nullptr;    // [page][n_kv][runs][D] binary16
};

// Centred caches: where each appended (or re-encoded) position's vector comes from and which mean it is
// encoded around. One per AppendToken.
struct AppendSource {
  int64_t tail_tile0;  // byte offset in the tail pool of head 0's tile holding the source, or -1: input row `row`
  int32_t row;         // input row (index into k / v) when tail_tile0 < 0
  int32_t tail_tok;    // token inside the tail tile
  int64_t mean_row;    // mean_row() of the position's run (main tier), or -1
};
static_assert(sizeof(AppendSource) == 24);

// Centred caches: one run that completes in this append, its means taken before its positions are
// encoded. Run position t < have is in the tail pool (tile t / 16 of tail "page" tail_page), the others
// are input rows row0 + t - have.
struct MeanJob {
  int32_t tail_page;
  int32_t have;
  int32_t row0;
  int32_t pad;
  int64_t mean_row;    // where the run's means go
};
static_assert(sizeof(MeanJob) == 24);

struct AppendParams {
  uint8_t* main_base = nullptr;
  uint8_t* sink_base = nullptr;
  uint8_t* tail_base = nullptr;      // centring: FP16 tiles of the filling runs (tier 2 tokens)
  const AppendToken* tokens = nullptr;
  const AppendSource* sources = nullptr;  // centring: [n_tokens]; nullptr: token i is input row i
  const MeanJob* mean_jobs = nullptr;     // centring: runs completing in this append
  int32_t n_mean_jobs = 0;
  int32_t center_tokens = 0;              // positions per run (0: not centred)
  int32_t tail_tiles = 0;                 // tiles per tail page (center_tokens / 16)
  int32_t tail_tile_bytes = 0;
  uint16_t* k_means = nullptr;            // mean pools written by the mean kernel (nullptr: tensor not centred)
  uint16_t* v_means = nullptr;
  int32_t mean_head_rows = 0;             // mean rows from one KV head's to the next's (runs per page)
  const float* k = nullptr;  // [tokens][n_kv][D], token t's row at k + t * k_stride
  const float* v = nullptr;  // likewise, v_stride
  int32_t n_tokens = 0, n_kv = 0;
  int64_t k_stride = 0, v_stride = 0;  // floats between tokens' rows
  EncodeParams main_k, main_v, sink_k, sink_v;
  EncodeParams tail_k, tail_v;  // centring: FP16 tiles
  const float* k_signs = nullptr;  // centring: rotation signs and 1/sqrt(D) for the mean kernel
  const float* v_signs = nullptr;
  float inv_sqrt_dim = 1;
};

// Standard path: expand main-tier TurboQuant tiles to BF16 tiles in the original domain.
struct ExpandParams {
  TierParams src;                    // the cache's main tier
  uint8_t* dst_base = nullptr;       // BF16 tiles, the same page ids and tile order as src
  int32_t dst_tile_bytes = 0;
  const int32_t* tiles = nullptr;    // [n_tiles] (page id * tiles_per_page + tile in page)
  int32_t n_tiles = 0, n_kv = 0;
  const float* k_signs = nullptr;    // [D]
  const float* v_signs = nullptr;
  float inv_sqrt_dim = 1;
  MeanParams means;                  // centring: added to the decoded levels before the inverse rotation
};

}  // namespace tq::cuda
