// DeviceKVCache: host-side bookkeeping (sequences, pages, formats) of the device KV cache.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "codec/rotation.h"
#include "core/error.h"
#include "core/half.h"
#include "cuda/check.h"
#include "cuda/cache_size.h"
#include "cuda/center_plan.h"
#include "cuda/device_cache_impl.h"
#include "cuda/encode_rule.h"
#include "cuda/kernels.h"

namespace tq::cuda {

// ------------------------------------------------------------------ device queries

bool device_available(std::string* reason) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    if (reason) *reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(e);
    cudaGetLastError();  // clear the sticky error so later calls report their own
    return false;
  }
  if (count == 0) {
    if (reason) *reason = "no CUDA device";
    return false;
  }
  return true;
}

bool device_memory(int64_t* free_bytes, int64_t* total_bytes, std::string* reason) {
  if (!device_available(reason)) return false;
  size_t free = 0, total = 0;
  const cudaError_t e = cudaMemGetInfo(&free, &total);
  if (e != cudaSuccess) {
    if (reason) *reason = std::string("cudaMemGetInfo failed: ") + cudaGetErrorString(e);
    cudaGetLastError();
    return false;
  }
  *free_bytes = static_cast<int64_t>(free);
  *total_bytes = static_cast<int64_t>(total);
  return true;
}

DeviceProperties device_properties() {
  int dev = 0;
  TQ_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  TQ_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  DeviceProperties d;
  d.name = p.name;
  d.sm_count = p.multiProcessorCount;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.global_bytes = static_cast<int64_t>(p.totalGlobalMem);
  d.l2_bytes = p.l2CacheSize;
  d.memory_bus_bits = p.memoryBusWidth;
  int clock = 0;
  if (cudaDeviceGetAttribute(&clock, cudaDevAttrMemoryClockRate, dev) == cudaSuccess) d.memory_clock_khz = clock;
  cudaGetLastError();
  return d;
}

// ------------------------------------------------------------------ DeviceBuffer

DeviceBuffer::DeviceBuffer(size_t bytes) { reserve(bytes); }
DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}
void DeviceBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_ && ptr_) return;
  if (ptr_) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  if (bytes == 0) return;
  const cudaError_t e = cudaMalloc(&ptr_, bytes);
  if (e != cudaSuccess) {
    ptr_ = nullptr;
    cudaGetLastError();
    fail("cannot allocate ", bytes, " bytes on the CUDA device: ", cudaGetErrorString(e));
  }
  bytes_ = bytes;
}
void DeviceBuffer::upload(const void* host, size_t bytes, void* stream, size_t offset) {
  if (bytes == 0) return;
  TQ_CHECK(offset + bytes <= bytes_, "internal error: device upload of ", bytes, " bytes at ", offset, " overflows a buffer of ",
           bytes_);
  TQ_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice,
                                static_cast<cudaStream_t>(stream)));
}

PinnedStaging::~PinnedStaging() {
  if (done_) cudaEventDestroy(static_cast<cudaEvent_t>(done_));
  if (host_) cudaFreeHost(host_);
}
uint8_t* PinnedStaging::begin(size_t bytes) {
  if (pending_) {
    TQ_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(done_)));
    pending_ = false;
  }
  if (bytes > bytes_) {
    if (host_) TQ_CUDA_CHECK(cudaFreeHost(host_));
    host_ = nullptr;
    bytes_ = 0;
    const size_t want = std::max<size_t>(2 * bytes, 64 << 10);  // room to grow: plans grow with the context
    void* h = nullptr;
    TQ_CUDA_CHECK(cudaMallocHost(&h, want));
    host_ = static_cast<uint8_t*>(h);
    bytes_ = want;
  }
  return host_;
}
void PinnedStaging::upload(DeviceBuffer& dst, size_t bytes, void* stream, size_t dst_offset) {
  if (bytes == 0) return;
  TQ_CHECK(bytes <= bytes_, "internal error: staged upload of ", bytes, " bytes from ", bytes_, " staged");
  dst.upload(host_, bytes, stream, dst_offset);
  mark_pending(stream);
}

void PinnedStaging::upload_pieces(DeviceBuffer& dst, const std::vector<Piece>& pieces, void* stream) {
  if (pieces.empty()) return;
  for (const Piece& p : pieces) {
    TQ_CHECK(p.src_offset + p.bytes <= bytes_, "internal error: staged piece past the ", bytes_, " staged bytes");
    dst.upload(host_ + p.src_offset, p.bytes, stream, p.dst_offset);
  }
  mark_pending(stream);
}

void PinnedStaging::mark_pending(void* stream) {
  if (!done_) {
    cudaEvent_t e;
    TQ_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    done_ = e;
  }
  TQ_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(done_), static_cast<cudaStream_t>(stream)));
  pending_ = true;
}

void UploadBatch::begin() {
  if (wanted_ > capacity_) {
    capacity_ = std::max<size_t>(2 * wanted_, 64 << 10);
    device_.reserve(capacity_);  // frees the old area: cudaFree waits for the work that reads it
  }
  host_ = stage_.begin(capacity_);
  used_ = wanted_ = 0;
}
UploadBatch::Region UploadBatch::take(size_t bytes) {
  const size_t at = wanted_;
  wanted_ += (bytes + 15) / 16 * 16;
  if (host_ == nullptr || wanted_ > capacity_) return {};
  used_ = wanted_;
  return {host_ + at, device_.as<uint8_t>() + at};
}
void UploadBatch::upload(void* stream) {
  if (used_ > 0) stage_.upload(device_, used_, stream);
  host_ = nullptr;  // regions are taken between begin() and upload()
}

// ------------------------------------------------------------------ formats

void set_encode_rule(EncodeParams& e, const GroupQuantizer::Plan& plan) {
  switch (plan.grid) {
    case Grid::lloyd_max: e.grid = EncodeGrid::lloyd_max; break;
    case Grid::uniform: e.grid = EncodeGrid::uniform; break;
    case Grid::lloyd_absmax: e.grid = EncodeGrid::lloyd_absmax; break;
    default:
      fail("the CUDA backend does not implement the quantizer grid ", static_cast<int>(plan.grid),
           " (it implements lloyd_max, uniform and lloyd_absmax)");
  }
  e.group_size = plan.group_size;
  TQ_CHECK(plan.level_count >= 1 && plan.level_count <= 256, "the CUDA append kernel takes at most 256 levels (8-bit codes), got ",
           plan.level_count);
  e.level_count = plan.level_count;
  e.scale_kind_l2 = plan.scale_kind == ScaleKind::l2;
  e.scale_fit = plan.scale_fit == ScaleFit::plain ? 0 : plan.scale_fit == ScaleFit::norm_correction ? 1 : 2;
  e.uniform_max = plan.uniform_max;
}

namespace {

void setup_dense_side(SideFormat& f, KVType type, const char* what) {
  TQ_CHECK(type == KVType::f16 || type == KVType::bf16, "the CUDA backend stores ", what,
           " as FP16, BF16 or TurboQuant, not ", to_string(type));
  f.kind = type == KVType::bf16 ? CodeKind::dense_bf16 : CodeKind::dense_f16;
  f.bits = 16;
}

void setup_turboquant_side(SideFormat& f, const VectorFormat& vf, int dim, const char* what) {
  const GroupQuantizer* q = vf.quantizer();
  const auto& plan = q->plan();
  TQ_CHECK(q->bits() >= 2 && q->bits() <= 8, "the CUDA backend stores TurboQuant ", what, " with 2 to 8 bits, got ", q->bits());
  const Rotation* rot = q->rotation();
  TQ_CHECK(rot && rot->block() == dim && rot->plan().m == 1, "the CUDA backend needs TurboQuant ", what,
           " rotated over the whole head (rotation block = head_dim, a power of two)");
  EncodeParams rule;
  set_encode_rule(rule, plan);  // refuses grids the append kernel does not implement, before any allocation
  f.bits = q->bits();
  f.group_size = q->group_size();
  f.quantizer = q;
  if (f.bits <= 4) {
    f.kind = static_cast<CodeKind>(f.bits);
  } else {
    f.kind = plan.grid == Grid::uniform ? CodeKind::byte_uniform : CodeKind::byte_lut;
  }
  std::vector<float> levels(plan.levels, plan.levels + plan.level_count);
  std::vector<float> thresholds(plan.thresholds, plan.thresholds + plan.level_count - 1);
  f.levels.reserve(levels.size() * sizeof(float));
  f.levels.upload(levels.data(), levels.size() * sizeof(float));
  f.thresholds.reserve(std::max<size_t>(1, thresholds.size()) * sizeof(float));
  f.thresholds.upload(thresholds.data(), thresholds.size() * sizeof(float));
  f.signs.reserve(static_cast<size_t>(dim) * sizeof(float));
  f.signs.upload(rot->signs(), static_cast<size_t>(dim) * sizeof(float));
  // Level tables as binary16: byte planes for the register decoders, a plain table for bytes.
  std::vector<uint16_t> table(256, 0);
  for (int c = 0; c < plan.level_count && c < 256; ++c) table[c] = f32_to_f16_bits(plan.levels[c]);
  for (int c = 0; c < 16; ++c) {
    f.lut.lo[c / 4] |= static_cast<uint32_t>(table[c] & 0xffu) << (8 * (c % 4));
    f.lut.hi[c / 4] |= static_cast<uint32_t>(table[c] >> 8) << (8 * (c % 4));
  }
  if (plan.grid == Grid::uniform) {
    const uint32_t h = f32_to_f16_bits(1024.0f + plan.uniform_max);
    f.bias = h | (h << 16);
  }
  f.table16.reserve(256 * sizeof(uint16_t));
  f.table16.upload(table.data(), 256 * sizeof(uint16_t));
  TQ_CUDA_CHECK(cudaDeviceSynchronize());  // the host vectors above go out of scope
}

}  // namespace

// ------------------------------------------------------------------ DeviceKVCache

DeviceKVCache::DeviceKVCache(int n_kv_heads, int head_dim, const KVCacheOptions& options, const DeviceCacheCapacity& capacity)
    : impl_(std::make_unique<Impl>()) {
  Impl& c = *impl_;
  TQ_CHECK(n_kv_heads >= 1, "device KV cache needs at least one KV head, got ", n_kv_heads);
  TQ_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256, "the CUDA backend supports head_dim 64, 128 or 256, got ", head_dim);
  TQ_CHECK(options.block_tokens >= 16 && options.block_tokens % 16 == 0, "the CUDA backend needs block_tokens a multiple of 16, got ",
           options.block_tokens);
  TQ_CHECK(options.min_tokens >= 0, "min_tokens_before_quant must not be negative, got ", options.min_tokens);
  TQ_CHECK(!options.query_int8, "the CUDA backend has no int8-query scorer (--kv-query-int8 is a CPU scorer)");
  TQ_CHECK(options.window >= 0, "sliding window must not be negative, got ", options.window);
  TQ_CHECK(options.window == 0 || capacity.rotating_append_tokens >= 1,
           "a rotating device cache needs room for appends of at least one position, got ", capacity.rotating_append_tokens);
  TQ_CHECK(capacity.max_sequences >= 1, "device KV cache needs room for at least one sequence");
  TQ_CHECK(capacity.max_tokens >= 0, "device KV cache capacity must not be negative");
  std::string why;
  TQ_CHECK(device_available(&why), "no usable CUDA device: ", why);
  c.n_kv = n_kv_heads;
  c.dim = head_dim;
  c.options = options;
  c.capacity = capacity;
  c.k_format = std::make_unique<VectorFormat>(head_dim, options.k);
  c.v_format = std::make_unique<VectorFormat>(head_dim, options.v);

  const bool k_tq = options.k.type == KVType::turboquant, v_tq = options.v.type == KVType::turboquant;
  TQ_CHECK(k_tq == v_tq, "the CUDA backend needs K and V both TurboQuant or both dense, got ", to_string(options.k.type), "/",
           to_string(options.v.type));
  if (k_tq) {
    setup_turboquant_side(c.main_k, *c.k_format, head_dim, "keys");
    setup_turboquant_side(c.main_v, *c.v_format, head_dim, "values");
    TQ_CHECK(c.main_k.group_size == c.main_v.group_size, "the CUDA backend needs the same group size for K and V, got ",
             c.main_k.group_size, " and ", c.main_v.group_size);
    c.group_size = c.main_k.group_size;
    TQ_CHECK(c.group_size == 32 || c.group_size == 64 || c.group_size == 128, "the CUDA backend supports group sizes 32, 64, 128, got ",
             c.group_size);
    c.main_kind = MainKind::tq;
  } else {
    setup_dense_side(c.main_k, options.k.type, "keys");
    setup_dense_side(c.main_v, options.v.type, "values");
    TQ_CHECK(c.main_k.kind == c.main_v.kind, "the CUDA backend needs K and V of the same dense type");
    c.group_size = head_dim;
    c.main_kind = c.main_k.kind == CodeKind::dense_bf16 ? MainKind::dense_bf16 : MainKind::dense_f16;
  }
  setup_dense_side(c.sink_k, options.sink_type, "the sink tier");
  setup_dense_side(c.sink_v, options.sink_type, "the sink tier");

  // Tiles, pages and pools from the arithmetic the memory plan shares (cuda/cache_size.h); the kinds it
  // derives from the options must be the ones the sides were set up with.
  const DeviceKVLayerSize size =
      device_kv_layer_size(n_kv_heads, head_dim, options, capacity.max_sequences, capacity.max_tokens, capacity.rotating_append_tokens);
  // Page-table entries are indexed by int (the kernels' slot * row + page).
  TQ_CHECK(size.row_pages * capacity.max_sequences <= INT32_MAX, "a device cache of ", capacity.max_sequences, " sequences of ",
           capacity.max_tokens, " positions needs a page table of more than 2^31 entries");
  TQ_CHECK(size.main_tile.k.kind == c.main_k.kind && size.main_tile.v.kind == c.main_v.kind && size.sink_tile.k.kind == c.sink_k.kind &&
               size.main_tile.k.groups == (is_dense(c.main_k.kind) ? 0 : head_dim / c.group_size),
           "internal error: the device cache's size arithmetic disagrees with its formats");
  c.main_tile = size.main_tile;
  c.sink_tile = size.sink_tile;
  c.page_tokens = size.page_tokens;
  c.tiles_per_page = size.tiles_per_page;
  c.sink_tiles = size.sink_tiles;
  c.n_pages = static_cast<int>(size.n_pages);  // a rotating cache's: what the windows of all its sequences hold at once
  c.row_pages = static_cast<int>(size.row_pages);
  c.page_bytes = static_cast<size_t>(size.page_bytes);

  c.main_pool.reserve(static_cast<size_t>(size.main_pool_bytes));
  TQ_CUDA_CHECK(cudaMemset(c.main_pool.get(), 0, c.main_pool.bytes()));
  if (c.sink_tiles > 0) {
    c.sink_pool.reserve(static_cast<size_t>(size.sink_pool_bytes));
    TQ_CUDA_CHECK(cudaMemset(c.sink_pool.get(), 0, c.sink_pool.bytes()));
  }
  c.host_page_table.assign(static_cast<size_t>(capacity.max_sequences) * c.row_pages, -1);
  c.page_owners.assign(static_cast<size_t>(c.n_pages), 0);
  c.page_table.reserve(c.host_page_table.size() * sizeof(int32_t));
  // -1 (every byte 0xff) where a row holds no page: a kernel that read such an entry would fault, not
  // read another sequence's page.
  TQ_CUDA_CHECK(cudaMemset(c.page_table.get(), 0xff, c.page_table.bytes()));
  if (size.center_tokens > 0) {
    // Block-mean centring: the run means of every page and each slot's FP16 filling runs (cuda/cache_size.h).
    c.center_tokens = size.center_tokens;
    c.runs_per_page = size.runs_per_page;
    c.tail_tiles = size.tail_tiles;
    c.tail_tile = size.tail_tile;
    setup_dense_side(c.tail_k, KVType::f16, "the filling centring run");
    setup_dense_side(c.tail_v, KVType::f16, "the filling centring run");
    // The means start at zero: the standard path expands whole pages, the slots of a run still filling too
    // (masked, but a non-finite value there would turn a zero weight into NaN).
    for (DeviceBuffer* pool : {&c.k_means, &c.v_means}) {
      if (pool == &c.k_means ? !options.center_k : !options.center_v) continue;
      pool->reserve(static_cast<size_t>(size.mean_pool_bytes));
      TQ_CUDA_CHECK(cudaMemset(pool->get(), 0, pool->bytes()));
    }
    c.tail_pool.reserve(static_cast<size_t>(size.tail_pool_bytes));
    // Zeroed so that no slot of a tail tile a query may see past the length holds a non-finite value.
    TQ_CUDA_CHECK(cudaMemset(c.tail_pool.get(), 0, c.tail_pool.bytes()));
  }
  for (int p = c.n_pages - 1; p >= 0; --p) c.free_pages.push_back(p);
  for (int s = capacity.max_sequences - 1; s >= 0; --s) c.free_slots.push_back(s);
}

DeviceKVCache::~DeviceKVCache() = default;

int DeviceKVCache::n_kv_heads() const { return impl_->n_kv; }
int DeviceKVCache::head_dim() const { return impl_->dim; }
const KVCacheOptions& DeviceKVCache::options() const { return impl_->options; }

std::string DeviceKVCache::describe() const {
  std::ostringstream os;
  os << "cuda ";
  if (impl_->options.window > 0) os << "rotating(window " << impl_->options.window << ") ";
  os << impl_->k_format->describe() << "/" << impl_->v_format->describe();
  if (impl_->options.min_tokens > 0) os << " + " << impl_->options.min_tokens << " sink tokens in " << to_string(impl_->options.sink_type);
  if (impl_->centred())
    os << ", " << (impl_->options.center_k && impl_->options.center_v ? "K and V" : impl_->options.center_k ? "K" : "V")
       << " centred per " << impl_->center_tokens << " positions";
  return os.str();
}

const DeviceKVCache::Impl::Sequence& DeviceKVCache::Impl::seq(int id) const {
  auto it = seqs.find(id);
  TQ_CHECK(it != seqs.end(), "no sequence ", id, " in this device cache");
  return it->second;
}
DeviceKVCache::Impl::Sequence& DeviceKVCache::Impl::seq(int id) {
  auto it = seqs.find(id);
  TQ_CHECK(it != seqs.end(), "no sequence ", id, " in this device cache");
  return it->second;
}

int DeviceKVCache::add_sequence() {
  Impl& c = *impl_;
  while (c.seqs.count(c.next_id)) ++c.next_id;
  add_sequence_with_id(c.next_id);
  return c.next_id++;
}

void DeviceKVCache::add_sequence_with_id(int id) {
  Impl& c = *impl_;
  TQ_CHECK(id >= 0, "sequence ids are non-negative, got ", id);
  TQ_CHECK(!c.seqs.count(id), "sequence ", id, " already exists in this device cache");
  TQ_CHECK(!c.free_slots.empty(), "the device cache holds at most ", c.capacity.max_sequences, " sequences");
  Impl::Sequence s;
  s.slot = c.free_slots.back();
  c.free_slots.pop_back();
  c.seqs.emplace(id, s);
}

std::vector<int> DeviceKVCache::sequences() const {
  std::vector<int> ids;
  for (const auto& [id, s] : impl_->seqs) ids.push_back(id);
  return ids;
}

int DeviceKVCache::Impl::take_page() {
  TQ_CHECK(!free_pages.empty(), "the device cache is full (", n_pages, " pages of ", page_tokens, " positions)");
  const int page = free_pages.back();
  free_pages.pop_back();
  page_owners[static_cast<size_t>(page)] = 1;
  return page;
}

void DeviceKVCache::Impl::release_page(int page, void* stream) {
  int& owners = page_owners[static_cast<size_t>(page)];
  TQ_CHECK(owners > 0, "internal error: releasing device page ", page, ", which is free");
  if (--owners > 0) return;
  // Pages go back zeroed: code bits are OR-ed in, and unused token slots must decode to 0. On the stream
  // the cache's kernels run on, so that the zeroing is ordered after what reads the page and before what
  // is appended to it next.
  TQ_CUDA_CHECK(cudaMemsetAsync(main_pool.as<uint8_t>() + static_cast<size_t>(page) * page_bytes, 0, page_bytes,
                                static_cast<cudaStream_t>(stream)));
  free_pages.push_back(page);
}

void DeviceKVCache::Impl::copy_page(int dst, int src, void* stream) {
  TQ_CUDA_CHECK(cudaMemcpyAsync(main_pool.as<uint8_t>() + static_cast<size_t>(dst) * page_bytes,
                                main_pool.as<uint8_t>() + static_cast<size_t>(src) * page_bytes, page_bytes, cudaMemcpyDeviceToDevice,
                                static_cast<cudaStream_t>(stream)));
  // A centred page's run means go with its codes.
  for (DeviceBuffer* pool : {&k_means, &v_means}) {
    if (pool->get() == nullptr) continue;
    const size_t bytes = mean_page_bytes();
    TQ_CUDA_CHECK(cudaMemcpyAsync(pool->as<uint8_t>() + static_cast<size_t>(dst) * bytes, pool->as<uint8_t>() + static_cast<size_t>(src) * bytes,
                                  bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  }
}

void DeviceKVCache::remove_sequence(int id, void* stream) {
  Impl& c = *impl_;
  const Impl::Sequence s = c.seq(id);
  std::vector<int> changes;
  for (int i = s.first_page; i < s.end_page(); ++i) {
    c.release_page(c.host_page_table[c.row_entry(s, i)], stream);
    c.host_page_table[c.row_entry(s, i)] = -1;
    changes.push_back(static_cast<int>(c.row_entry(s, i)));
  }
  c.upload_page_table(changes, stream);
  if (c.sink_tiles > 0) {
    const size_t slot_bytes = static_cast<size_t>(c.n_kv) * c.sink_tiles * c.sink_tile.bytes;
    TQ_CUDA_CHECK(cudaMemsetAsync(c.sink_pool.as<uint8_t>() + s.slot * slot_bytes, 0, slot_bytes, static_cast<cudaStream_t>(stream)));
  }
  c.free_slots.push_back(s.slot);
  c.seqs.erase(id);
}

void DeviceKVCache::fork_sequence(int parent, int child, bool copy, void* stream) {
  Impl& c = *impl_;
  const Impl::Sequence p = c.seq(parent);
  TQ_CHECK(!copy || p.pages <= static_cast<int>(c.free_pages.size()), "cannot copy sequence ", parent, ": its ", p.pages,
           " pages are more than the ", c.free_pages.size(), " the device cache has free");
  add_sequence_with_id(child);
  Impl::Sequence& s = c.seqs.at(child);
  s.length = p.length;
  s.first_page = p.first_page;  // a rotating cache's child holds the same window
  s.pages = p.pages;
  s.tail_pos = p.tail_pos;      // centring: the filling run is copied (below); each completes it on its own
  s.tail_half = p.tail_half;
  std::vector<int> changes;
  for (int i = p.first_page; i < p.end_page(); ++i) {
    int page = c.host_page_table[c.row_entry(p, i)];
    if (copy) {
      const int own = c.take_page();
      c.copy_page(own, page, stream);
      page = own;
    } else {
      ++c.page_owners[static_cast<size_t>(page)];
    }
    c.host_page_table[c.row_entry(s, i)] = page;
    changes.push_back(static_cast<int>(c.row_entry(s, i)));
  }
  c.upload_page_table(changes, stream);
  if (c.sink_tiles > 0) {  // the sink tier is per sequence slot: copied
    const size_t slot_bytes = static_cast<size_t>(c.n_kv) * c.sink_tiles * c.sink_tile.bytes;
    TQ_CUDA_CHECK(cudaMemcpyAsync(c.sink_pool.as<uint8_t>() + s.slot * slot_bytes, c.sink_pool.as<uint8_t>() + p.slot * slot_bytes,
                                  slot_bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  }
  if (c.centred()) {  // both halves of the slot's filling-run tiles
    const size_t slot_bytes = 2 * c.tail_page_bytes();
    TQ_CUDA_CHECK(cudaMemcpyAsync(c.tail_pool.as<uint8_t>() + s.slot * slot_bytes, c.tail_pool.as<uint8_t>() + p.slot * slot_bytes, slot_bytes,
                                  cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  }
}

std::string DeviceKVCache::truncate_problem(int seq, int length) const {
  // KVCache::truncate_problem's rules and words: the next query, at position `length`, sees the positions
  // [length - window + 1, length) (all of them without a window), and those must still be held.
  const Impl& c = *impl_;
  const Impl::Sequence& s = c.seq(seq);
  std::ostringstream os;
  if (length < 0 || length > s.length) {
    os << "cannot truncate sequence " << seq << " to " << length << " positions: it holds " << s.length;
    return os.str();
  }
  const int M = c.options.min_tokens, window = c.options.window;
  const int oldest_needed = window > 0 ? std::max(0, length - window + 1) : 0;
  const int first_block = c.first_block_pos(s);
  const int held_from = first_block > M ? first_block : 0;
  if (oldest_needed < held_from && length > M && length < s.length) {
    os << "cannot truncate sequence " << seq << " to " << length << " positions: positions before " << held_from
       << " are no longer held" << (window > 0 ? " (they left the sliding window)" : "") << ", and the next position needs them from "
       << oldest_needed;
  }
  return os.str();
}

void DeviceKVCache::truncate(int seq, int length, void* stream) {
  Impl& c = *impl_;
  const std::string problem = truncate_problem(seq, length);
  TQ_CHECK(problem.empty(), problem);
  Impl::Sequence& s = c.seq(seq);
  if (length == s.length) return;
  const int M = c.options.min_tokens;
  // Logical pages [0, end) hold positions below `length`; the held ones past them go back (a rotating
  // cache holds [first_page, end_page()), and truncate_problem let through only lengths whose next query
  // finds its window held).
  const int end = length <= M ? 0 : (length - M + c.page_tokens - 1) / c.page_tokens;
  std::vector<int> changes;
  for (int i = std::max(s.first_page, end); i < s.end_page(); ++i) {
    c.release_page(c.host_page_table[c.row_entry(s, i)], stream);
    c.host_page_table[c.row_entry(s, i)] = -1;
    changes.push_back(static_cast<int>(c.row_entry(s, i)));
  }
  s.pages = std::max(0, std::min(end, s.end_page()) - s.first_page);
  // Back inside the sink tier with every page gone: the main tier's pages start again at min_tokens
  // (KVCache::truncate resets first_block_pos the same way).
  if (s.pages == 0 && length <= M) s.first_page = 0;
  // The positions left in the last kept page (and in the sink tier) are cleared; a page a fork still
  // holds is copied first, so that the fork keeps them.
  const int clear_end = std::min(s.length, length <= M ? M : M + end * c.page_tokens);
  if (s.pages > 0 && length > M && (length - M) % c.page_tokens != 0) {
    int& page = c.host_page_table[c.row_entry(s, end - 1)];
    if (c.page_owners[static_cast<size_t>(page)] > 1) {
      const int own = c.take_page();
      c.copy_page(own, page, stream);
      --c.page_owners[static_cast<size_t>(page)];
      page = own;
      changes.push_back(static_cast<int>(c.row_entry(s, end - 1)));
    }
  }
  c.upload_page_table(changes, stream);
  std::vector<AppendToken> cleared;
  for (int pos = length; pos < clear_end; ++pos) cleared.push_back(c.destination(s, pos));
  if (!cleared.empty()) {
    const size_t bytes = cleared.size() * sizeof(AppendToken);
    c.staging_tokens.reserve(bytes);
    std::memcpy(c.tokens_stage.begin(bytes), cleared.data(), bytes);
    c.tokens_stage.upload(c.staging_tokens, bytes, stream);
    AppendParams p;
    clear_bytes(p);
    p.main_base = c.main_pool.as<uint8_t>();
    p.sink_base = c.sink_pool.as<uint8_t>();
    p.tokens = c.staging_tokens.as<AppendToken>();
    p.n_tokens = static_cast<int>(cleared.size());
    p.n_kv = c.n_kv;
    p.main_k = c.encode_params(c.main_k, true, c.main_tile);
    p.main_v = c.encode_params(c.main_v, false, c.main_tile);
    p.sink_k = c.encode_params(c.sink_k, true, c.sink_tile);
    p.sink_v = c.encode_params(c.sink_v, false, c.sink_tile);
    TQ_CHECK(kernels::launch_clear(c.dim, p, stream), "internal error: no clear kernel for head_dim ", c.dim);
    TQ_CUDA_CHECK(cudaGetLastError());
  }
  // Centring (KVCache::truncate): the filling run's positions all gone, none is filling; a run already
  // encoded that `length` falls inside keeps its means, and the positions appended into it again are
  // encoded around them.
  CenterState st{s.tail_pos, s.tail_half};
  truncate_centring(st, length);
  s.tail_pos = st.tail_pos;
  s.length = length;
}

BlockDemand DeviceKVCache::demand(const std::vector<SequenceGrowth>& growth) const {
  const Impl& c = *impl_;
  BlockDemand d;
  d.available = static_cast<int64_t>(c.free_pages.size());
  d.capacity = c.n_pages;
  d.block_bytes = static_cast<int64_t>(c.page_bytes);
  const int M = c.options.min_tokens, T = c.page_tokens;
  for (const SequenceGrowth& g : growth) {
    TQ_CHECK(g.n >= 0, "cannot append a negative number of positions");
    const Impl::Sequence& s = c.seq(g.seq);
    // A rotating cache first gives back the pages out of the window (Impl::drop_out_of_window): those no
    // fork shares are free again for this append.
    Impl::Sequence kept = s;
    if (c.options.window > 0) {
      const int oldest_needed = s.length - c.options.window + 1;
      while (kept.pages > 1 && c.first_block_pos(kept) + T <= oldest_needed) {
        d.available += c.page_owners[static_cast<size_t>(c.host_page_table[c.row_entry(kept, kept.first_page)])] == 1;
        ++kept.first_page;
        --kept.pages;
      }
    }
    const int from = std::max(s.length, M), to = s.length + g.n;
    if (to <= from) continue;
    const int first_page = (from - M) / T, last_page = (to - 1 - M) / T;
    for (int i = first_page; i <= last_page; ++i) {
      const bool held = i >= kept.first_page && i < kept.end_page();
      d.needed += !held || c.page_owners[static_cast<size_t>(c.host_page_table[c.row_entry(kept, i)])] > 1;
    }
  }
  return d;
}

bool DeviceKVCache::has_sequence(int seq) const { return impl_->seqs.count(seq) != 0; }
int DeviceKVCache::length(int seq) const { return impl_->seq(seq).length; }
int DeviceKVCache::first_kept(int seq) const { return impl_->first_kept(impl_->seq(seq)); }
int DeviceKVCache::window() const { return impl_->options.window; }


void DeviceKVCache::Impl::drop_out_of_window(Sequence& s, int next_pos, std::vector<int>& changes, void* stream) {
  if (options.window <= 0) return;
  // Queries from next_pos on look back at most window - 1 positions (KVCache::drop_out_of_window).
  const int oldest_needed = next_pos - options.window + 1;
  while (s.pages > 1 && first_block_pos(s) + page_tokens <= oldest_needed) {
    const size_t e = row_entry(s, s.first_page);
    release_page(host_page_table[e], stream);
    host_page_table[e] = -1;
    changes.push_back(static_cast<int>(e));
    ++s.first_page;
    --s.pages;
  }
}

AppendToken DeviceKVCache::Impl::destination(const Sequence& s, int pos) const {
  const int M = options.min_tokens;
  AppendToken t{};
  if (pos < M) {
    const int tile = pos / kTileTokens;
    t.tier = 1;
    t.tok = static_cast<int16_t>(pos % kTileTokens);
    t.tile0 = (static_cast<int64_t>(s.slot) * n_kv * sink_tiles + tile) * sink_tile.bytes;
    t.head_stride = sink_tiles * sink_tile.bytes;
  } else {
    const int mi = pos - M, page_i = mi / page_tokens;
    const int page = host_page_table[row_entry(s, page_i)];
    t.tier = 0;
    t.tok = static_cast<int16_t>(mi % kTileTokens);
    t.tile0 = (static_cast<int64_t>(page) * n_kv * tiles_per_page + (mi % page_tokens) / kTileTokens) * main_tile.bytes;
    t.head_stride = tiles_per_page * main_tile.bytes;
  }
  return t;
}

void DeviceKVCache::Impl::place(Sequence& s, int n, std::vector<AppendToken>& out, std::vector<int>& changes, void* stream) {
  const int M = options.min_tokens;
  for (int i = 0; i < n; ++i) {
    const int pos = s.length + i;
    if (pos >= M) {
      const int page_i = (pos - M) / page_tokens;
      TQ_CHECK(page_i < row_pages, "a sequence would reach position ", pos, ", past the ",
               static_cast<int64_t>(row_pages) * page_tokens + M, " positions this device cache was made for (its max_tokens)");
      while (s.end_page() <= page_i) {
        host_page_table[row_entry(s, s.end_page())] = take_page();
        changes.push_back(static_cast<int>(row_entry(s, s.end_page())));
        ++s.pages;
      }
      int& page = host_page_table[row_entry(s, page_i)];
      if (page_owners[static_cast<size_t>(page)] > 1) {
        // A fork still reads this page: this sequence writes into a copy of its own.
        const int own = take_page();
        copy_page(own, page, stream);
        --page_owners[static_cast<size_t>(page)];
        page = own;
        changes.push_back(static_cast<int>(row_entry(s, page_i)));
      }
    }
    out.push_back(destination(s, pos));
  }
  s.length += n;
}

void DeviceKVCache::Impl::upload_page_table(std::vector<int>& changes, void* stream) {
  if (changes.empty()) return;
  // Runs of consecutive entries, each one copy out of one staging area.
  std::sort(changes.begin(), changes.end());
  changes.erase(std::unique(changes.begin(), changes.end()), changes.end());
  uint8_t* host = page_table_stage.begin(changes.size() * sizeof(int32_t));
  std::vector<PinnedStaging::Piece> pieces;
  size_t at = 0;
  for (size_t i = 0; i < changes.size();) {
    size_t j = i + 1;
    while (j < changes.size() && changes[j] == changes[j - 1] + 1) ++j;
    const size_t bytes = (j - i) * sizeof(int32_t);
    std::memcpy(host + at, host_page_table.data() + changes[i], bytes);
    pieces.push_back({at, static_cast<size_t>(changes[i]) * sizeof(int32_t), bytes});
    at += bytes;
    i = j;
  }
  page_table_stage.upload_pieces(page_table, pieces, stream);
  changes.clear();
}

EncodeParams DeviceKVCache::Impl::encode_params(const SideFormat& side, bool key, const TileFormat& tile) const {
  EncodeParams e;
  clear_bytes(e);  // padding too (AppendParams are compared byte for byte)
  e.inv_sqrt_dim = 1.0f;
  e.kind = side.kind;
  e.is_key = key;
  const SectionFormat& sec = key ? tile.k : tile.v;
  e.words = sec.words;
  e.codes = key ? 0 : tile.v_codes;
  e.scales = key ? tile.k_scales : tile.v_scales;
  if (side.quantizer) {
    const auto& plan = side.quantizer->plan();
    set_encode_rule(e, plan);
    e.levels = side.levels.as<float>();
    e.thresholds = side.thresholds.as<float>();
    e.signs = side.signs.as<float>();
    e.inv_sqrt_dim = side.quantizer->rotation()->plan().inv_sqrt_block;
  }
  return e;
}

TierParams DeviceKVCache::Impl::main_params() const {
  TierParams t;
  clear_bytes(t);  // padding too (kernel parameters are compared byte for byte)
  t.base = main_pool.as<uint8_t>();
  t.page_table = page_table.as<int32_t>();
  t.page_stride = row_pages;  // rows indexed by logical page
  t.tiles_per_page = tiles_per_page;
  t.tile_bytes = main_tile.bytes;
  t.first_pos = options.min_tokens;
  t.k_kind = main_k.kind;
  t.v_kind = main_v.kind;
  t.k_words = main_tile.k.words;
  t.v_words = main_tile.v.words;
  t.k_scales = main_tile.k_scales;
  t.v_codes = main_tile.v_codes;
  t.v_scales = main_tile.v_scales;
  t.k_lut = main_k.lut;
  t.v_lut = main_v.lut;
  t.k_bias = main_k.bias;
  t.v_bias = main_v.bias;
  t.k_table = main_k.table16.as<uint16_t>();
  t.v_table = main_v.table16.as<uint16_t>();
  return t;
}

TierParams DeviceKVCache::Impl::sink_params() const {
  TierParams t;
  clear_bytes(t);  // padding too (kernel parameters are compared byte for byte)
  t.base = sink_pool.as<uint8_t>();
  t.page_table = nullptr;
  t.tiles_per_page = std::max(1, sink_tiles);
  t.tile_bytes = sink_tile.bytes;
  t.first_pos = 0;
  t.k_kind = sink_k.kind;
  t.v_kind = sink_v.kind;
  t.k_words = sink_tile.k.words;
  t.v_words = sink_tile.v.words;
  t.v_codes = sink_tile.v_codes;
  return t;
}

TierParams DeviceKVCache::Impl::tail_params() const {
  TierParams t;
  clear_bytes(t);  // padding too (kernel parameters are compared byte for byte)
  if (!centred()) return t;
  t.base = tail_pool.as<uint8_t>();
  t.page_table = nullptr;  // "page" 2 * slot + half (RequestParams::tail_page)
  t.tiles_per_page = tail_tiles;
  t.tile_bytes = tail_tile.bytes;
  t.first_pos = 0;         // the request's tail_pos
  t.k_kind = t.v_kind = CodeKind::dense_f16;
  t.k_words = tail_tile.k.words;
  t.v_words = tail_tile.v.words;
  t.v_codes = tail_tile.v_codes;
  return t;
}

MeanParams DeviceKVCache::Impl::mean_params() const {
  MeanParams m;
  clear_bytes(m);
  if (!centred()) return m;
  m.k = options.center_k ? k_means.as<uint16_t>() : nullptr;
  m.v = options.center_v ? v_means.as<uint16_t>() : nullptr;
  m.runs = runs_per_page;
  m.run_tiles = center_tokens / kTileTokens;
  while ((1 << m.run_tiles_log2) < m.run_tiles) ++m.run_tiles_log2;
  m.ring_bytes = ((options.center_k ? 1 : 0) + (options.center_v ? 1 : 0)) * dim * 2;
  return m;
}

int64_t DeviceKVCache::Impl::mean_row_of(const Sequence& s, int pos) const {
  const int mi = pos - options.min_tokens;
  const int page = host_page_table[row_entry(s, mi / page_tokens)];
  return (static_cast<int64_t>(page) * n_kv) * runs_per_page + (mi % page_tokens) / center_tokens;
}

// Centring: the span's positions [first, first + n) (input rows row0..), already placed (pages held,
// destinations in `tokens`), as the CPU's centred append handles them (cuda/center_plan.h): each action
// becomes a token of the append kernel with its source (an input row or a tail slot) and its run's mean
// row, each completed run a mean job.
void DeviceKVCache::Impl::center_span(Sequence& s, int first, int n, int row0, const AppendToken* tokens, std::vector<AppendToken>& out,
                                      std::vector<AppendSource>& sources, std::vector<MeanJob>& jobs) const {
  CenterState st{s.tail_pos, s.tail_half};
  std::vector<CenterAction> actions;
  std::vector<CenterJob> runs;
  plan_centred_append(options.min_tokens, center_tokens, first_block_pos(s), st, first, n, row0, actions, runs);
  auto tail_tile0 = [&](int half, int t) {
    return (static_cast<int64_t>(2 * s.slot + half) * n_kv * tail_tiles + t / kTileTokens) * static_cast<int64_t>(tail_tile.bytes);
  };
  for (const CenterAction& a : actions) {
    switch (a.kind) {
      case CenterAction::sink:
        out.push_back(tokens[a.pos - first]);
        sources.push_back({-1, a.row, 0, -1});
        break;
      case CenterAction::tail_write: {
        AppendToken t{};
        t.tier = 2;
        t.tok = static_cast<int16_t>(a.tail_t % kTileTokens);
        t.tile0 = tail_tile0(a.half, a.tail_t);
        t.head_stride = tail_tiles * tail_tile.bytes;
        out.push_back(t);
        sources.push_back({-1, a.row, 0, -1});
        break;
      }
      case CenterAction::encode:
        out.push_back(a.pos >= first ? tokens[a.pos - first] : destination(s, a.pos));
        if (a.row >= 0) {
          sources.push_back({-1, a.row, 0, mean_row_of(s, a.run_pos)});
        } else {
          sources.push_back({tail_tile0(a.half, a.tail_t), 0, a.tail_t % kTileTokens, mean_row_of(s, a.run_pos)});
        }
        break;
    }
  }
  for (const CenterJob& r : runs) {
    MeanJob j{};
    j.tail_page = 2 * s.slot + r.half;
    j.have = r.have;
    j.row0 = r.row0;
    j.mean_row = mean_row_of(s, r.run_pos);
    jobs.push_back(j);
  }
  s.tail_pos = st.tail_pos;
  s.tail_half = st.tail_half;
}

AppendParams DeviceKVCache::prepare_append(std::span<const Span> spans, const float* k, const float* v, void* stream,
                                           UploadBatch* batch, int64_t k_stride, int64_t v_stride) {
  Impl& c = *impl_;
  // Check everything before changing anything: sequences exist, counts are sane, pages suffice.
  int total = 0;
  std::vector<SequenceGrowth> growth;
  growth.reserve(spans.size());
  for (const Span& sp : spans) {
    TQ_CHECK(sp.count >= 0, "cannot append a negative number of positions");
    growth.push_back({sp.seq, sp.count});
    total += sp.count;
  }
  std::vector<int> ids(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) ids[i] = spans[i].seq;
  std::sort(ids.begin(), ids.end());
  TQ_CHECK(std::adjacent_find(ids.begin(), ids.end()) == ids.end(), "a sequence appears twice in one append");
  const BlockDemand need = demand(growth);
  if (need.needed > need.available && c.options.window > 0)
    fail("the device cache of this sliding-window layer is full: appending needs ", need.needed, " more pages of ", c.page_tokens,
         " positions, ", need.available, " are free; it holds, for each of its ", c.capacity.max_sequences, " sequences, the window of ",
         c.options.window, " positions and appends of up to ", c.capacity.rotating_append_tokens,
         " positions (append fewer positions at once: shorter prompt chunks)");
  TQ_CHECK(need.needed <= need.available, "the device cache is full: appending needs ", need.needed, " more pages of ", c.page_tokens,
           " positions, ", need.available, " are free");
  AppendParams p;
  clear_bytes(p);  // padding too: callers compare parameter blocks byte for byte
  p.n_kv = c.n_kv;
  // A rotating cache first gives back what left each sequence's window (as KVCache::append does, even
  // for nothing appended): all of them before any page is taken, since demand() counted those pages free.
  std::vector<int> changes;
  for (const Span& sp : spans) {
    Impl::Sequence& s = c.seq(sp.seq);
    c.drop_out_of_window(s, s.length, changes, stream);
  }
  if (total == 0) {
    c.upload_page_table(changes, stream);
    return p;
  }
  std::vector<AppendToken> tokens;
  tokens.reserve(total);
  std::vector<AppendSource> sources;
  std::vector<MeanJob> jobs;
  if (c.centred()) {
    std::vector<AppendToken> placed;
    int row0 = 0;
    for (const Span& sp : spans) {
      Impl::Sequence& s = c.seq(sp.seq);
      const int first = s.length;
      placed.clear();
      c.place(s, sp.count, placed, changes, stream);
      c.center_span(s, first, sp.count, row0, placed.data(), tokens, sources, jobs);
      row0 += sp.count;
    }
  } else {
    for (const Span& sp : spans) c.place(c.seq(sp.seq), sp.count, tokens, changes, stream);
  }
  c.upload_page_table(changes, stream);
  // The per-position arrays go up with the batch when it has room, else through their own staging.
  auto upload = [&](const void* data, size_t bytes, DeviceBuffer& staging, PinnedStaging& stage) -> const void* {
    if (bytes == 0) return nullptr;
    const UploadBatch::Region region = batch ? batch->take(bytes) : UploadBatch::Region{};
    if (region.host) {
      std::memcpy(region.host, data, bytes);
      return region.device;
    }
    staging.reserve(bytes);
    std::memcpy(stage.begin(bytes), data, bytes);
    stage.upload(staging, bytes, stream);
    return staging.get();
  };
  const auto* tokens_dev =
      static_cast<const AppendToken*>(upload(tokens.data(), tokens.size() * sizeof(AppendToken), c.staging_tokens, c.tokens_stage));
  if (c.centred()) {
    p.sources = static_cast<const AppendSource*>(
        upload(sources.data(), sources.size() * sizeof(AppendSource), c.staging_sources, c.sources_stage));
    p.mean_jobs = static_cast<const MeanJob*>(upload(jobs.data(), jobs.size() * sizeof(MeanJob), c.staging_jobs, c.jobs_stage));
    p.n_mean_jobs = static_cast<int32_t>(jobs.size());
    p.center_tokens = c.center_tokens;
    p.mean_head_rows = c.runs_per_page;
    p.tail_tiles = c.tail_tiles;
    p.tail_tile_bytes = c.tail_tile.bytes;
    p.tail_base = c.tail_pool.as<uint8_t>();
    p.k_means = c.options.center_k ? c.k_means.as<uint16_t>() : nullptr;
    p.v_means = c.options.center_v ? c.v_means.as<uint16_t>() : nullptr;
    p.tail_k = c.encode_params(c.tail_k, true, c.tail_tile);
    p.tail_v = c.encode_params(c.tail_v, false, c.tail_tile);
    p.k_signs = c.main_k.signs.as<float>();
    p.v_signs = c.main_v.signs.as<float>();
    p.inv_sqrt_dim = c.main_k.quantizer->rotation()->plan().inv_sqrt_block;
  }

  p.main_base = c.main_pool.as<uint8_t>();
  p.sink_base = c.sink_pool.as<uint8_t>();
  p.tokens = tokens_dev;
  p.k = k;
  p.v = v;
  p.k_stride = k_stride > 0 ? k_stride : static_cast<int64_t>(c.n_kv) * c.dim;
  p.v_stride = v_stride > 0 ? v_stride : static_cast<int64_t>(c.n_kv) * c.dim;
  p.n_tokens = static_cast<int32_t>(tokens.size());  // centring adds the re-encoded positions of completed runs
  p.main_k = c.encode_params(c.main_k, true, c.main_tile);
  p.main_v = c.encode_params(c.main_v, false, c.main_tile);
  p.sink_k = c.encode_params(c.sink_k, true, c.sink_tile);
  p.sink_v = c.encode_params(c.sink_v, false, c.sink_tile);
  if (c.centred()) {
    for (EncodeParams* e : {&p.main_k, &p.main_v}) e->round16 = true;
    p.main_k.centred = c.options.center_k;
    p.main_k.means = p.k_means;
    p.main_v.centred = c.options.center_v;
    p.main_v.means = p.v_means;
  }
  return p;
}

void DeviceKVCache::launch_append(const AppendParams& p, void* stream) const {
  if (p.n_tokens == 0) return;
  // Centring: the means of the runs this append completes first; the append encodes around them.
  if (p.n_mean_jobs > 0) {
    TQ_CHECK(kernels::launch_means(impl_->dim, p, stream), "internal error: no centring mean kernel for head_dim ", impl_->dim);
    TQ_CUDA_CHECK(cudaGetLastError());
  }
  TQ_CHECK(kernels::launch_append(impl_->dim, p, stream), "internal error: no append kernel for head_dim ", impl_->dim);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void DeviceKVCache::append_device(std::span<const Span> spans, const float* k, const float* v, void* stream) {
  launch_append(prepare_append(spans, k, v, stream), stream);
}

void DeviceKVCache::append(int seq, const float* k, const float* v, int n) {
  Impl& c = *impl_;
  TQ_CHECK(n >= 0, "cannot append a negative number of positions");
  if (n == 0) {
    c.seq(seq);
    return;
  }
  const size_t floats = static_cast<size_t>(n) * c.n_kv * c.dim;
  c.staging_kv.reserve(2 * floats * sizeof(float));
  c.staging_kv.upload(k, floats * sizeof(float));
  c.staging_kv.upload(v, floats * sizeof(float), nullptr, floats * sizeof(float));
  const Span span{seq, n};
  append_device({&span, 1}, c.staging_kv.as<float>(), c.staging_kv.as<float>() + floats, nullptr);
  TQ_CUDA_CHECK(cudaDeviceSynchronize());
}

DeviceKVCache::Stored DeviceKVCache::stored(int seq, int pos, int head, bool key) const {
  const Impl& c = *impl_;
  const Impl::Sequence& s = c.seq(seq);
  TQ_CHECK(pos >= 0 && pos < s.length, "position ", pos, " is not in sequence ", seq, " (length ", s.length, ")");
  TQ_CHECK(head >= 0 && head < c.n_kv, "KV head ", head, " out of range");
  const int M = c.options.min_tokens;
  Stored out;
  out.sink = pos < M;
  out.filling = !out.sink && s.tail_pos >= 0 && pos >= s.tail_pos;
  const TierParams tier = out.sink ? c.sink_params() : out.filling ? c.tail_params() : c.main_params();
  const TileFormat& tf = out.sink ? c.sink_tile : out.filling ? c.tail_tile : c.main_tile;
  TQ_CHECK(out.sink || pos >= c.first_block_pos(s), "position ", pos, " of sequence ", seq, " has left the sliding window");
  const int tier_pos = out.sink ? pos : out.filling ? pos - s.tail_pos : pos - M;
  int tile = tier_pos / kTileTokens;
  const int tok = tier_pos % kTileTokens;
  // The tile's device address (the host mirror of the page table stands in for the device one).
  int64_t index;
  if (out.sink) {
    index = (static_cast<int64_t>(s.slot) * c.n_kv + head) * c.sink_tiles + tile;
  } else if (out.filling) {
    index = (static_cast<int64_t>(s.tail_page()) * c.n_kv + head) * c.tail_tiles + tile;
  } else {
    const int page = c.host_page_table[c.row_entry(s, tile / c.tiles_per_page)];
    index = (static_cast<int64_t>(page) * c.n_kv + head) * c.tiles_per_page + tile % c.tiles_per_page;
  }
  std::vector<uint8_t> bytes(tf.bytes);
  TQ_CUDA_CHECK(cudaMemcpy(bytes.data(), tier.base + index * tf.bytes, tf.bytes, cudaMemcpyDeviceToHost));
  const SectionFormat& sec = key ? tf.k : tf.v;
  const int codes_at = key ? 0 : tf.v_codes, scales_at = key ? tf.k_scales : tf.v_scales;
  auto lane_words_of = [&](int lane) {
    std::vector<uint32_t> w(sec.words);
    for (int i = 0; i < sec.words; ++i) std::memcpy(&w[i], bytes.data() + codes_at + lane_word_offset(sec.words, lane, i), 4);
    return w;
  };
  for (int d = 0; d < c.dim; ++d) {
    const Slot sl = key ? k_slot(tok, d) : v_slot(tok, d);
    const std::vector<uint32_t> w = lane_words_of(sl.lane);
    if (is_dense(sec.kind)) {
      const uint16_t bits = static_cast<uint16_t>(w[sl.e / 2] >> (16 * (sl.e % 2)));
      out.values.push_back(sec.kind == CodeKind::dense_bf16 ? bf16_bits_to_f32(bits) : f16_bits_to_f32(bits));
    } else {
      out.codes.push_back(static_cast<uint8_t>(slot_code(sec.kind, w.data(), sl.e)));
    }
  }
  for (int g = 0; g < sec.groups; ++g) {
    uint16_t h;
    std::memcpy(&h, bytes.data() + scales_at + 2 * (key ? k_scale_index(tok, g) : v_scale_index(tok, g)), 2);
    out.scales.push_back(f16_bits_to_f32(h));
  }
  // A centred tensor's run mean (stored domain), for positions encoded around it.
  const DeviceBuffer& means = key ? c.k_means : c.v_means;
  if (!out.sink && !out.filling && means.get() != nullptr) {
    std::vector<uint16_t> m(static_cast<size_t>(c.dim));
    const int64_t row = c.mean_row_of(s, pos) + static_cast<int64_t>(head) * c.runs_per_page;
    TQ_CUDA_CHECK(cudaMemcpy(m.data(), means.as<uint16_t>() + row * c.dim, m.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    for (uint16_t h : m) out.mean.push_back(f16_bits_to_f32(h));
  }
  return out;
}

void DeviceKVCache::read(int seq, int pos, float* k, float* v) const {
  const Impl& c = *impl_;
  for (int h = 0; h < c.n_kv; ++h) {
    for (int key = 1; key >= 0; --key) {
      const Stored st = stored(seq, pos, h, key == 1);
      float* x = (key ? k : v) + static_cast<size_t>(h) * c.dim;
      if (!st.codes.empty()) {
        const GroupQuantizer* q = (key ? c.main_k : c.main_v).quantizer;
        const int G = q->group_size();
        for (int d = 0; d < c.dim; ++d) x[d] = q->levels()[st.codes[d]] * st.scales[d / G];
        for (size_t d = 0; d < st.mean.size(); ++d) x[d] += st.mean[d];  // centred: the run's mean, then the inverse rotation
        q->rotation()->inverse(x);
      } else {
        std::copy(st.values.begin(), st.values.end(), x);
      }
    }
  }
}

size_t DeviceKVCache::main_bytes_per_token() const {
  return static_cast<size_t>(impl_->n_kv) * impl_->main_tile.bytes / kTileTokens;
}

MemoryUsage DeviceKVCache::memory() const {
  const Impl& c = *impl_;
  MemoryUsage m;
  const int M = c.options.min_tokens;
  for (const auto& [id, s] : c.seqs) {
    m.sink_tokens += std::min(s.length, M);
    m.main_tokens += std::max(0, s.length - std::max(M, c.first_block_pos(s)));
  }
  m.sink_bytes = m.sink_tokens * static_cast<int64_t>(c.n_kv) * 2 * 2 * c.dim;
  m.main_bytes = m.main_tokens * static_cast<int64_t>(main_bytes_per_token());
  m.allocated_bytes = device_bytes();
  m.blocks_in_use = c.n_pages - static_cast<int64_t>(c.free_pages.size());
  for (int o : c.page_owners) m.blocks_shared += o > 1;
  m.block_bytes = static_cast<int64_t>(c.page_bytes);
  m.fp16_bytes = (m.sink_tokens + m.main_tokens) * 2 * 2 * static_cast<int64_t>(c.n_kv) * c.dim;
  return m;
}

int64_t DeviceKVCache::device_bytes() const {
  const Impl& c = *impl_;
  return static_cast<int64_t>(c.main_pool.bytes() + c.sink_pool.bytes() + c.page_table.bytes() + c.k_means.bytes() + c.v_means.bytes() +
                              c.tail_pool.bytes());
}

}  // namespace tq::cuda
