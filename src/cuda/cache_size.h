// The device bytes of one layer's KV cache on the CUDA backend, from its shape, options and capacity alone:
// what DeviceKVCache allocates (device_cache.cc builds its tiles and pools from this) and what the memory
// plan (runtime/memory_plan.h, turboquant-plan --device cuda) counts. Host code only, no CUDA runtime: the
// plan uses it in builds without the CUDA backend.
//
//   main pool   n_pages x page_bytes, page_bytes = n_kv x (page_tokens / 16) x main tile bytes, allocated
//               up front: row_pages = max(1, ceil(max_tokens / page_tokens)) pages (every position a
//               sequence may reach), or, for a rotating cache (options.window > 0), at most max_sequences x
//               rotating_pages_per_sequence(window, page_tokens, rotating_append_tokens)
//   sink pool   max_sequences x n_kv x ceil(min_tokens / 16) x sink tile bytes (none without a sink tier)
//   page table  max_sequences x row_pages int32 (rows indexed by logical page)
//   centring (options.center_k / center_v, C = options.center_run()):
//     mean pools  n_pages x n_kv x (page_tokens / C) x D binary16, one per centred tensor
//     tail pool   max_sequences x 2 x n_kv x (C / 16) FP16 tiles: each sequence's run that is still
//                 filling, in one of two halves (an append reads the run it completes from one half while
//                 it writes the next filling run into the other)
#pragma once

#include <cstdint>

#include "core/error.h"
#include "cuda/layout.h"
#include "kv/cache.h"

namespace tq::cuda {

// Pages of `page_tokens` positions a rotating cache's sequence holds at most right after appending
// `append` positions (append >= 1): the pages covering [pos - window + 1, pos + append) for the first
// appended position pos, plus the one page the drop rule always keeps. Right after appending [pos, pos +
// append), a sequence holds the pages that meet [pos - window + 1, pos + append) and the page of pos - 1
// (the drop rule keeps one page even when it left the window: window 1): the pages meeting a run of
// max(window, 2) - 1 + append positions, at most ceil((run - 1) / page_tokens) + 1 of them.
inline int64_t rotating_pages_per_sequence(int window, int page_tokens, int append) {
  TQ_CHECK(window >= 1 && page_tokens >= 1 && append >= 1, "internal error: rotating_pages_per_sequence(", window, ", ", page_tokens, ", ",
           append, ")");
  const int64_t run = static_cast<int64_t>(window < 2 ? 2 : window) - 1 + append;
  return (run - 1 + page_tokens - 1) / page_tokens + 1;
}

// What DeviceCacheCapacity::rotating_append_tokens is unless set: the prompt chunk a rotating cache's pool
// holds beside each sequence's window.
inline constexpr int kDefaultRotatingAppendTokens = 1024;

// Whether the default --kv-center centres on the CUDA device (CudaDevice::kv_centring answers this, and the
// plan takes the same default from it): yes, as on the CPU (K below 8 bits centred per run), so that both
// devices compute the same cache. Its cost on the fused attention is measured in docs/BENCHMARKS.md
// ("Block-mean centring on the H200").
inline constexpr bool kDeviceKVCentring = true;

struct DeviceKVLayerSize {
  TileFormat main_tile, sink_tile;
  int page_tokens = 0, tiles_per_page = 0, sink_tiles = 0;
  int64_t n_pages = 0;    // pages in the pool
  int64_t row_pages = 0;  // page-table entries per sequence (the pages a sequence may reach)
  int64_t page_bytes = 0;
  int64_t main_pool_bytes = 0, sink_pool_bytes = 0, page_table_bytes = 0;
  int64_t main_bytes_per_token = 0;  // all KV heads, K and V (a tile of 16 positions / 16)
  // Block-mean centring (0 when not centred).
  TileFormat tail_tile;
  int center_tokens = 0, runs_per_page = 0, tail_tiles = 0;
  int64_t mean_pool_bytes = 0;  // each centred tensor's pool
  int64_t mean_pools = 0;       // centred tensors (0, 1 or 2)
  int64_t tail_pool_bytes = 0;
  int64_t device_bytes() const { return main_pool_bytes + sink_pool_bytes + page_table_bytes + mean_pools * mean_pool_bytes + tail_pool_bytes; }
};

// The code kind the device stores a side (K or V) of a tier in; throws for a type the backend does not store.
inline CodeKind device_code_kind(const VectorFormatSpec& spec, const char* what) {
  if (spec.type == KVType::turboquant) {
    const int bits = spec.quantizer.bits;
    TQ_CHECK(bits >= 2 && bits <= 8, "the CUDA backend stores TurboQuant ", what, " with 2 to 8 bits, got ", bits);
    if (bits <= 4) return static_cast<CodeKind>(bits);
    return spec.quantizer.grid == Grid::uniform ? CodeKind::byte_uniform : CodeKind::byte_lut;
  }
  TQ_CHECK(spec.type == KVType::f16 || spec.type == KVType::bf16, "the CUDA backend stores ", what, " as FP16, BF16 or TurboQuant, not ",
           to_string(spec.type));
  return spec.type == KVType::bf16 ? CodeKind::dense_bf16 : CodeKind::dense_f16;
}

inline DeviceKVLayerSize device_kv_layer_size(int n_kv_heads, int head_dim, const KVCacheOptions& options, int max_sequences,
                                              int64_t max_tokens, int rotating_append_tokens = kDefaultRotatingAppendTokens) {
  TQ_CHECK(n_kv_heads >= 1, "device KV cache needs at least one KV head, got ", n_kv_heads);
  TQ_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256, "the CUDA backend supports head_dim 64, 128 or 256, got ", head_dim);
  TQ_CHECK(options.block_tokens >= 16 && options.block_tokens % 16 == 0, "the CUDA backend needs block_tokens a multiple of 16, got ",
           options.block_tokens);
  TQ_CHECK(options.min_tokens >= 0, "min_tokens_before_quant must not be negative, got ", options.min_tokens);
  TQ_CHECK(max_sequences >= 1, "device KV cache needs room for at least one sequence");
  TQ_CHECK(max_tokens >= 0, "device KV cache capacity must not be negative");
  const bool k_tq = options.k.type == KVType::turboquant, v_tq = options.v.type == KVType::turboquant;
  TQ_CHECK(k_tq == v_tq, "the CUDA backend needs K and V both TurboQuant or both dense, got ", to_string(options.k.type), "/",
           to_string(options.v.type));
  const CodeKind k = device_code_kind(options.k, "keys"), v = device_code_kind(options.v, "values");
  int group = head_dim;
  if (k_tq) {
    TQ_CHECK(options.k.quantizer.group_size == options.v.quantizer.group_size, "the CUDA backend needs the same group size for K and V, got ",
             options.k.quantizer.group_size, " and ", options.v.quantizer.group_size);
    group = options.k.quantizer.group_size;
    TQ_CHECK(group == 32 || group == 64 || group == 128, "the CUDA backend supports group sizes 32, 64, 128, got ", group);
  } else {
    TQ_CHECK(k == v, "the CUDA backend needs K and V of the same dense type");
  }
  const CodeKind sink = device_code_kind(VectorFormatSpec{options.sink_type, {}, false, 0}, "the sink tier");
  DeviceKVLayerSize z;
  z.main_tile = tile_format(head_dim, section_format(k, head_dim, group), section_format(v, head_dim, group));
  z.sink_tile = tile_format(head_dim, section_format(sink, head_dim, head_dim), section_format(sink, head_dim, head_dim));
  z.page_tokens = options.block_tokens;
  z.tiles_per_page = z.page_tokens / kTileTokens;
  z.sink_tiles = (options.min_tokens + kTileTokens - 1) / kTileTokens;
  z.row_pages = std::max<int64_t>(1, (max_tokens + z.page_tokens - 1) / z.page_tokens);
  z.n_pages = z.row_pages;
  if (options.window > 0)
    z.n_pages = std::min<int64_t>(z.n_pages, static_cast<int64_t>(max_sequences) *
                                                 rotating_pages_per_sequence(options.window, z.page_tokens, rotating_append_tokens));
  z.page_bytes = static_cast<int64_t>(n_kv_heads) * z.tiles_per_page * z.main_tile.bytes;
  z.main_pool_bytes = z.page_bytes * z.n_pages;
  z.sink_pool_bytes = z.sink_tiles > 0 ? static_cast<int64_t>(max_sequences) * n_kv_heads * z.sink_tiles * z.sink_tile.bytes : 0;
  z.page_table_bytes = static_cast<int64_t>(max_sequences) * z.row_pages * static_cast<int64_t>(sizeof(int32_t));
  z.main_bytes_per_token = static_cast<int64_t>(n_kv_heads) * z.main_tile.bytes / kTileTokens;
  if (options.centred()) {
    const int C = options.center_run();
    TQ_CHECK(k_tq, "block-mean centring needs quantized K and V on the CUDA backend (got ", to_string(options.k.type), "/",
             to_string(options.v.type), ")");
    TQ_CHECK(C >= kTileTokens && C <= z.page_tokens && (C & (C - 1)) == 0 && z.page_tokens % C == 0,
             "block-mean centring runs of ", C, " positions: the CUDA backend needs a power of two from 16 to the page of ", z.page_tokens,
             " positions that divides it");
    const SectionFormat f16 = section_format(CodeKind::dense_f16, head_dim, head_dim);
    z.tail_tile = tile_format(head_dim, f16, f16);
    z.center_tokens = C;
    z.runs_per_page = z.page_tokens / C;
    z.tail_tiles = C / kTileTokens;
    z.mean_pools = (options.center_k ? 1 : 0) + (options.center_v ? 1 : 0);
    z.mean_pool_bytes = z.n_pages * n_kv_heads * z.runs_per_page * static_cast<int64_t>(head_dim) * 2;
    z.tail_pool_bytes = static_cast<int64_t>(max_sequences) * 2 * n_kv_heads * z.tail_tiles * z.tail_tile.bytes;
  }
  return z;
}

}  // namespace tq::cuda
