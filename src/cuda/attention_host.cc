// DeviceAttention: plans an attention call over a DeviceKVCache (work items, output groups, partial-state
// slots), uploads the plan once and enqueues the kernels on run().
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_cache_impl.h"
#include "cuda/kernels.h"

namespace tq::cuda {

namespace kernels {
bool launch_attention_d64(int group_size, MainKind kind, const AttentionKernelParams& p, int n_items, bool overlap, void* stream);
bool launch_attention_d128(int group_size, MainKind kind, const AttentionKernelParams& p, int n_items, bool overlap, void* stream);
bool launch_attention_d256(int group_size, MainKind kind, const AttentionKernelParams& p, int n_items, bool overlap, void* stream);
int attention_blocks_per_sm_d64(int group_size, MainKind kind, int tile_bytes);
int attention_blocks_per_sm_d128(int group_size, MainKind kind, int tile_bytes);
int attention_blocks_per_sm_d256(int group_size, MainKind kind, int tile_bytes);

bool launch_attention(int dim, int group_size, MainKind kind, const AttentionKernelParams& p, int n_items, bool overlap, void* stream) {
  if (n_items == 0) return true;
  switch (dim) {
    case 64: return launch_attention_d64(group_size, kind, p, n_items, overlap, stream);
    case 128: return launch_attention_d128(group_size, kind, p, n_items, overlap, stream);
    case 256: return launch_attention_d256(group_size, kind, p, n_items, overlap, stream);
    default: return false;
  }
}

int attention_blocks_per_sm(int dim, int group_size, MainKind kind, int tile_bytes) {
  switch (dim) {
    case 64: return attention_blocks_per_sm_d64(group_size, kind, tile_bytes);
    case 128: return attention_blocks_per_sm_d128(group_size, kind, tile_bytes);
    case 256: return attention_blocks_per_sm_d256(group_size, kind, tile_bytes);
    default: return 0;
  }
}
}  // namespace kernels

struct DeviceAttention::Impl {
  AttentionPath path = AttentionPath::fused;
  int dim = 0, group_size = 0;
  MainKind kind = MainKind::tq;
  AttentionKernelParams params;
  ExpandParams expand;
  bool run_expand = false;
  WorkPlan plan;
  int64_t bytes = 0;
  std::string cache_description;
  const DeviceKVCache* described_cache = nullptr;
  DeviceBuffer plan_blob, partials, counters, scratch;  // plan_blob: item records, groups, sinks, expand tiles, item count
  PinnedStaging stage;
  int grid = 0;  // thread blocks launched (replayable: the item count rounded up to a power of two, at most the capacity)
  // Replayable plans keep their arrays at fixed places with room for this many entries (grown, never shrunk).
  bool replayable = false;
  int items_cap = 0, groups_cap = 0;
  bool overlap_append = false;  // launch as a programmatic dependent of the stream's previous kernel
  int min_tiles = 0;            // the planner's fewest tiles per item (0: its default)
  PlanMemo* memo = nullptr;     // plans shared with other layers' attention (none: planned here)
};

DeviceAttention::DeviceAttention() : impl_(std::make_unique<Impl>()) {}
DeviceAttention::~DeviceAttention() = default;

void DeviceAttention::set_replayable(bool on) { impl_->replayable = on; }
void DeviceAttention::set_overlap_append(bool on) { impl_->overlap_append = on; }
void DeviceAttention::set_plan_memo(PlanMemo* memo) { impl_->memo = memo; }
void DeviceAttention::set_min_tiles(int tiles) {
  TQ_CHECK(tiles >= 0, "the fewest tiles per attention work item must not be negative, got ", tiles);
  impl_->min_tiles = tiles;
}

std::string DeviceAttention::launch_signature() const {
  const Impl& a = *impl_;
  std::string sig;
  auto add = [&](const void* p, size_t n) { sig.append(static_cast<const char*>(p), n); };
  const int32_t shape[6] = {a.dim, a.group_size, static_cast<int32_t>(a.kind), a.grid, a.run_expand ? 1 : 0, a.overlap_append ? 1 : 0};
  add(shape, sizeof shape);
  add(&a.params, sizeof a.params);
  if (a.run_expand) add(&a.expand, sizeof a.expand);
  return sig;
}

void DeviceAttention::plan(const DeviceKVCache& cache, std::span<const DeviceAttentionRequest> requests, const AttentionParams& params,
                           AttentionPath path, void* stream, UploadBatch* batch) {
  Impl& a = *impl_;
  const DeviceKVCache::Impl& c = cache.impl();
  TQ_CHECK(path != AttentionPath::reference, "the CUDA backend runs the fused and standard attention paths (reference is CPU only)");
  TQ_CHECK(params.n_heads >= 1 && params.n_heads % c.n_kv == 0, "attention needs a number of query heads that is a multiple of the ",
           c.n_kv, " KV heads, got ", params.n_heads);
  TQ_CHECK(params.window >= 0, "sliding window must not be negative");
  a.path = path;
  a.dim = c.dim;
  a.group_size = c.group_size;
  if (a.described_cache != &cache) {  // once per cache: formatting it costs the decode step's host time
    a.cache_description = cache.describe();
    a.described_cache = &cache;
  }
  const bool expand = path == AttentionPath::standard && c.main_kind == MainKind::tq;
  a.run_expand = expand;
  a.kind = expand ? MainKind::dense_bf16 : c.main_kind;
  const int group = params.n_heads / c.n_kv;
  const float scale = params.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(c.dim)) : params.scale;

  // Requests.
  std::vector<RequestParams> rq;
  std::vector<PlanRequest> pr;
  std::set<int> seqs;
  rq.reserve(requests.size());
  pr.reserve(requests.size());
  for (const auto& r : requests) {
    const auto& s = c.seq(r.seq);
    TQ_CHECK(r.q && r.out, "device attention request needs device pointers for queries and output");
    // Every position a query may see must still be held (a rotating cache gave back what left its
    // window): attn/attention.cc's check and words.
    const int oldest_needed = params.window > 0 ? std::max(0, r.pos0 - params.window + 1) : 0;
    TQ_CHECK(c.first_kept(s) <= std::max(oldest_needed, c.options.min_tokens), "sequence ", r.seq, " no longer holds position ",
             oldest_needed, " that the queries need");
    RequestParams p;
    p.q = r.q;
    p.out = r.out;
    p.n_q = r.n_q;
    p.pos0 = r.pos0;
    p.slot = s.slot;
    p.length = s.length;
    p.n_sink = std::min(s.length, c.options.min_tokens);
    const int64_t row = static_cast<int64_t>(params.n_heads) * c.dim;
    TQ_CHECK(r.q_stride == 0 || r.q_stride >= row, "query rows of ", row, " floats cannot be ", r.q_stride, " floats apart");
    p.q_stride = static_cast<int32_t>(r.q_stride > 0 ? r.q_stride : row);
    p.tail_pos = s.tail_pos;  // centring: the run still filling, read from its FP16 tiles
    p.tail_page = s.tail_pos >= 0 ? s.tail_page() : 0;
    rq.push_back(p);
    pr.push_back({s.length, r.n_q, r.pos0, s.tail_pos});
    if (expand) seqs.insert(r.seq);  // the standard path expands each sequence's tiles once
  }

  // Main tier as the kernel reads it: the cache's tiles, or the BF16 tiles the expand kernel writes.
  TierParams main = c.main_params();
  std::vector<int32_t> expand_tiles;  // the standard path's tiles to expand
  if (expand) {
    const SectionFormat dense = section_format(CodeKind::dense_bf16, c.dim, c.dim);
    const TileFormat tf = tile_format(c.dim, dense, dense);
    a.expand = ExpandParams{};
    a.expand.src = main;
    a.expand.dst_tile_bytes = tf.bytes;
    a.expand.n_kv = c.n_kv;
    a.expand.k_signs = c.main_k.signs.as<float>();
    a.expand.v_signs = c.main_v.signs.as<float>();
    a.expand.inv_sqrt_dim = c.main_k.quantizer->rotation()->plan().inv_sqrt_block;
    a.expand.means = c.mean_params();  // centred: the run means go into the BF16 tiles
    a.scratch.reserve(static_cast<size_t>(c.n_pages) * c.n_kv * c.tiles_per_page * tf.bytes);
    a.expand.dst_base = a.scratch.as<uint8_t>();
    std::vector<int32_t> tiles;
    for (int id : seqs) {
      const auto& s = c.seq(id);
      const int main_len = std::max(0, s.length - c.options.min_tokens);
      // The held tiles: a rotating cache's start at its oldest held page.
      for (int t = s.first_page * c.tiles_per_page; t < (main_len + kTileTokens - 1) / kTileTokens; ++t) {
        const int page = c.host_page_table[c.row_entry(s, t / c.tiles_per_page)];
        tiles.push_back(page * c.tiles_per_page + t % c.tiles_per_page);
      }
    }
    expand_tiles = std::move(tiles);
    a.expand.n_tiles = static_cast<int>(expand_tiles.size());
    main.base = a.scratch.as<uint8_t>();
    main.tile_bytes = tf.bytes;
    main.k_kind = main.v_kind = CodeKind::dense_bf16;
    main.k_words = main.v_words = dense.words;
    main.k_scales = 0;
    main.v_codes = tf.v_codes;
    main.v_scales = tf.v_scales;
  }

  // The kernel moves tile records with bulk copies: 16-byte multiples at 16-byte aligned addresses.
  TQ_CHECK(main.tile_bytes % 16 == 0, "internal error: tile records of ", main.tile_bytes, " bytes are not a multiple of 16");

  // Work split: enough items to fill every multiprocessor once.
  PlanShape shape;
  shape.n_heads = params.n_heads;
  shape.n_kv = c.n_kv;
  shape.min_tokens = c.options.min_tokens;
  shape.window = params.window;
  // The fused kernel's ring stages carry each tile's run means beside it (centred caches).
  const int stage_bytes = main.tile_bytes + (expand ? 0 : c.mean_params().ring_bytes);
  const int per_sm = kernels::attention_blocks_per_sm(c.dim, c.group_size, a.kind, stage_bytes);
  TQ_CHECK(per_sm > 0, "no CUDA attention kernel fits head_dim ", c.dim, ", group ", c.group_size, " (tiles of ", main.tile_bytes,
           " bytes) on this device");
  static const int sm_count = device_properties().sm_count;  // one device per process
  // Split long contexts into three items per multiprocessor (K8/V3 at head_dim 128: four blocks fit one,
  // so all of them are resident at once). Measured on the H200 (K8/V3, 1 x 128K, with the row-parallel
  // final merge): 2 items per SM 64.4 us, 3 per SM 62.0 us, 4 per SM 64.8 us; 32K: 25.8 / 26.5 / 28.5 us.
  // More items balance the multiprocessors' unequal bandwidth shares better; more parts cost merge time.
#ifndef TQ_ATTN_ITEMS_PER_SM
#define TQ_ATTN_ITEMS_PER_SM 3  // a build-time knob for experiments
#endif
  constexpr int kItemsPerSm = TQ_ATTN_ITEMS_PER_SM;
  shape.target_blocks = sm_count * std::min(per_sm, kItemsPerSm);
  // Shortest item: its fixed costs (prologue, publishing a part, a share of the merge) against its tiles.
  // Measured on the H200 (tq-llama-hd128 decode at 32K, device time per step, K8/V3): 16 tiles 383.5 us,
  // 8 tiles 387.5 us, 4 tiles 392.8 us. set_min_tiles overrides it (experiments: --attn-min-tiles).
  if (a.min_tiles > 0) shape.min_tiles_per_item = a.min_tiles;
  a.plan = a.memo ? a.memo->plan(shape, pr) : plan_attention(shape, pr);

  // The plan's arrays go up in one copy through page-locked memory (no wait for the stream: the decode
  // step plans every layer while the previous layers' kernels run). A replayable plan places them for
  // its capacities, so that their addresses (kernel parameters) do not move from one call to the next;
  // the first call sizes them for a grid that fills the GPU (plus a partial item per output group and
  // tier, the most the split's rounding adds).
  const int n_items = static_cast<int>(a.plan.items.size()), n_groups = static_cast<int>(a.plan.groups.size());
  int cap_items = n_items, cap_groups = n_groups;
  if (a.replayable) {
    a.items_cap = std::max({a.items_cap, n_items, shape.target_blocks + 2 * n_groups});
    a.groups_cap = std::max(a.groups_cap, n_groups);
    cap_items = a.items_cap, cap_groups = a.groups_cap;
  }
  size_t blob_bytes = 0;
  auto place = [&](size_t bytes) {
    const size_t at = blob_bytes;
    blob_bytes += (bytes + 15) / 16 * 16;
    return at;
  };
  const size_t at_items = place(cap_items * sizeof(ItemRecord));
  const size_t at_groups = place(cap_groups * sizeof(OutputGroup));
  const size_t at_sinks = place(params.sinks ? params.n_heads * sizeof(float) : 0);
  const size_t at_count = place(sizeof(int32_t));
  const size_t at_tiles = place(expand_tiles.size() * sizeof(int32_t));
  const UploadBatch::Region region = batch ? batch->take(blob_bytes) : UploadBatch::Region{};
  uint8_t* host = region.host ? region.host : a.stage.begin(std::max<size_t>(16, blob_bytes));
  ItemRecord* records = reinterpret_cast<ItemRecord*>(host + at_items);
  for (int i = 0; i < n_items; ++i) {
    const WorkItem& w = a.plan.items[i];
    ItemRecord& r = records[i];
    clear_bytes(r);
    r.item = w;
    r.request = rq[w.request];
    r.pages[0] = r.pages[1] = -1;
    if (w.tier == 0) {
      // The standard path's BF16 tiles sit at the same page and tile indices as the codes they expand.
      const int first_page = w.tile_begin / c.tiles_per_page;
      const int32_t* row = c.host_page_table.data() + static_cast<size_t>(r.request.slot) * c.row_pages;  // by logical page
      for (int k = 0; k < 2 && first_page + k < c.row_pages; ++k) r.pages[k] = row[first_page + k];
    }
  }
  std::memcpy(host + at_groups, a.plan.groups.data(), a.plan.groups.size() * sizeof(OutputGroup));
  if (params.sinks) std::memcpy(host + at_sinks, params.sinks, params.n_heads * sizeof(float));
  std::memcpy(host + at_count, &n_items, sizeof(int32_t));
  std::memcpy(host + at_tiles, expand_tiles.data(), expand_tiles.size() * sizeof(int32_t));
  uint8_t* blob = region.device;
  if (blob == nullptr) {
    // Sizes with room to grow: the plan grows with the context, and a reallocation synchronises the device.
    if (a.plan_blob.bytes() < blob_bytes) a.plan_blob.reserve(std::max<size_t>(size_t{64} << 10, 2 * blob_bytes));
    a.stage.upload(a.plan_blob, blob_bytes, stream);
    blob = a.plan_blob.as<uint8_t>();
  }
  if (expand) a.expand.tiles = reinterpret_cast<const int32_t*>(blob + at_tiles);
  const size_t part_bytes = (2 * kRowsPerItem + kRowsPerItem * static_cast<size_t>(c.dim)) * sizeof(float);
  if (a.partials.bytes() < std::max<size_t>(1, a.plan.n_parts) * part_bytes)
    a.partials.reserve(std::max<size_t>({static_cast<size_t>(a.plan.n_parts), static_cast<size_t>(cap_items),
                                         shape.target_blocks + a.plan.groups.size()}) * part_bytes);
  if (a.counters.bytes() < std::max<size_t>(1, cap_groups) * sizeof(uint32_t)) {
    a.counters.reserve(std::max<size_t>(1, cap_groups) * sizeof(uint32_t));
    // Zero once: the kernel leaves its counters at zero for the next launch.
    TQ_CUDA_CHECK(cudaMemsetAsync(a.counters.get(), 0, a.counters.bytes(), static_cast<cudaStream_t>(stream)));
  }

  AttentionKernelParams& k = a.params;
  clear_bytes(k);  // padding too: launch_signature() compares the bytes
  k.main = main;
  k.sink = c.sink_params();
  k.tail = c.tail_params();
  // The fused kernel adds the run means itself; the standard path's BF16 tiles hold them already.
  if (!expand) k.means = c.mean_params();
  k.items = reinterpret_cast<const ItemRecord*>(blob + at_items);
  k.groups = reinterpret_cast<const OutputGroup*>(blob + at_groups);
  k.partials = a.partials.as<float>();
  k.counters = a.counters.as<uint32_t>();
  k.sinks = params.sinks ? reinterpret_cast<const float*>(blob + at_sinks) : nullptr;
  k.n_items = a.replayable ? reinterpret_cast<const int32_t*>(blob + at_count) : nullptr;
  if (a.replayable) {
    // The grid is the item count rounded up to a power of two (at most the capacity): a recorded launch
    // stays valid while the context grows within a bucket (a few recordings over a long generation), and
    // short contexts do not launch the whole capacity. (The surplus blocks return at once: on the H200,
    // 2 KV heads at 4K, ncu timed the call the same in a grid of 400 and of 32, 16.0-16.3 vs 16.2-16.5 us.)
    int bucket = 16;
    while (bucket < n_items) bucket *= 2;
    a.grid = std::min(cap_items, bucket);
  } else {
    a.grid = n_items;
  }
  k.k_signs = c.main_kind == MainKind::tq ? c.main_k.signs.as<float>() : nullptr;
  k.v_signs = c.main_kind == MainKind::tq ? c.main_v.signs.as<float>() : nullptr;
  k.n_heads = params.n_heads;
  k.n_kv = c.n_kv;
  k.group = group;
  k.window = params.window;
  k.q_scale = scale * 1.4426950408889634f;
  k.inv_sqrt_dim = c.main_kind == MainKind::tq ? c.main_k.quantizer->rotation()->plan().inv_sqrt_block : 1.0f;

  // Bytes the call reads from the cache (and, on the standard path, writes and reads again).
  int64_t bytes = 0;
  for (const WorkItem& w : a.plan.items)
    bytes += static_cast<int64_t>(w.tile_end - w.tile_begin) * (w.tier == 0 ? main.tile_bytes : w.tier == 1 ? c.sink_tile.bytes : c.tail_tile.bytes);
  if (expand) bytes += static_cast<int64_t>(a.expand.n_tiles) * c.n_kv * (c.main_tile.bytes + main.tile_bytes);  // read, written
  a.bytes = bytes;
}

void DeviceAttention::run(void* stream) {
  Impl& a = *impl_;
  if (a.run_expand) {
    TQ_CHECK(kernels::launch_expand(a.dim, a.group_size, a.expand, stream), "internal error: no expand kernel for head_dim ", a.dim,
             ", group ", a.group_size);
    TQ_CUDA_CHECK(cudaGetLastError());
  }
  // The standard path's expand kernel runs between the append and this one: nothing to overlap.
  const bool overlap = a.overlap_append && !a.run_expand;
  TQ_CHECK(kernels::launch_attention(a.dim, a.group_size, a.kind, a.params, a.grid, overlap, stream),
           "internal error: no attention kernel for head_dim ", a.dim, ", group ", a.group_size);
  TQ_CUDA_CHECK(cudaGetLastError());
}

int DeviceAttention::items() const { return static_cast<int>(impl_->plan.items.size()); }
int DeviceAttention::parts() const { return impl_->plan.n_parts; }
int DeviceAttention::tiles_per_item() const { return impl_->plan.tiles_per_item; }
int64_t DeviceAttention::bytes_read() const { return impl_->bytes; }
std::string DeviceAttention::describe() const {
  std::ostringstream os;
  os << to_string(impl_->path) << " over " << impl_->cache_description << ": " << impl_->plan.items.size() << " blocks, "
     << impl_->plan.groups.size() << " output groups, " << impl_->plan.tiles_per_item << " tiles per block";
  return os.str();
}

void attend(const DeviceKVCache& cache, std::span<const AttentionRequest> requests, const AttentionParams& params, AttentionPath path,
            AttentionStats* stats) {
  const int dim = cache.head_dim();
  std::vector<size_t> offsets;
  size_t floats = 0;
  for (const auto& r : requests) {
    TQ_CHECK(r.q && r.out && r.n_q >= 1, "attention request needs queries and an output");
    offsets.push_back(floats);
    floats += static_cast<size_t>(r.n_q) * params.n_heads * dim;
  }
  DeviceBuffer q(std::max<size_t>(1, floats) * sizeof(float)), out(std::max<size_t>(1, floats) * sizeof(float));
  std::vector<DeviceAttentionRequest> dreq;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    const size_t n = static_cast<size_t>(r.n_q) * params.n_heads * dim;
    q.upload(r.q, n * sizeof(float), nullptr, offsets[i] * sizeof(float));
    dreq.push_back({r.seq, q.as<float>() + offsets[i], r.n_q, r.pos0, out.as<float>() + offsets[i]});
  }
  DeviceAttention a;
  a.plan(cache, dreq, params, path, nullptr);
  a.run(nullptr);
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    const size_t n = static_cast<size_t>(r.n_q) * params.n_heads * dim;
    TQ_CUDA_CHECK(cudaMemcpy(r.out, out.as<float>() + offsets[i], n * sizeof(float), cudaMemcpyDeviceToHost));
  }
  if (stats) {
    if (path == AttentionPath::standard) {
      ++stats->standard;
    } else {
      ++stats->fused;
    }
  }
}

}  // namespace tq::cuda
