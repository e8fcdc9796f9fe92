#include "kv/cache.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "core/error.h"
#include "core/half.h"
#include "kv/json_field.h"

namespace tq {

// ------------------------------------------------------------------ KVCache

namespace {
// The options' own checks, before the formats and the pool are built from them (the pool's and the
// formats' messages would not name the option at fault).
const KVCacheOptions& checked(int n_kv_heads, int head_dim, const KVCacheOptions& options) {
  TQ_CHECK(n_kv_heads >= 1 && n_kv_heads <= kMaxKVHeads, "KV cache needs 1..", kMaxKVHeads, " KV heads, got ", n_kv_heads);
  TQ_CHECK(head_dim <= kMaxHeadDim, "KV cache head dimension must be at most ", kMaxHeadDim, ", got ", head_dim);
  TQ_CHECK(options.block_tokens >= 1 && options.block_tokens <= kMaxBlockTokens, "block size must be 1..", kMaxBlockTokens,
           " tokens, got ", options.block_tokens);
  // The sink tier reserves min_tokens positions per KV head at its first token.
  TQ_CHECK(options.min_tokens >= 0 && options.min_tokens <= kMaxSinkTokens, "min_tokens_before_quant must be 0..", kMaxSinkTokens,
           ", got ", options.min_tokens);
  TQ_CHECK(options.window >= 0, "sliding window must not be negative, got ", options.window);
  TQ_CHECK(options.max_blocks >= 0, "a KV cache's block bound must not be negative, got ", options.max_blocks);
  TQ_CHECK(is_dense(options.sink_type), "the sink tier must be a dense type (f16, bf16 or f32), got ",
           to_string(options.sink_type));
  if (options.centred()) {
    const int C = options.center_run(), T = options.block_tokens;
    TQ_CHECK(C >= 16 && (C & (C - 1)) == 0 && C <= T && T % C == 0, "block-mean centring needs runs of a power of two of at least 16 "
             "positions that divide the block of ", T, ", got ", C);
    TQ_CHECK(!options.center_k || !is_dense(options.k.type), "block-mean centring of K needs a quantized K type (got ",
             to_string(options.k.type), ": a dense cache has nothing to gain)");
    TQ_CHECK(!options.center_v || !is_dense(options.v.type), "block-mean centring of V needs a quantized V type (got ",
             to_string(options.v.type), ": a dense cache has nothing to gain)");
  }
  return options;
}
}  // namespace

int64_t KVLayerSize::pool_bytes(int64_t blocks) const {
  return BlockPool::blocks_allocated_for(blocks, first_chunk_blocks, later_chunk_blocks) * block_bytes;
}

KVLayerSize kv_layer_size(int n_kv_heads, int head_dim, const KVCacheOptions& options) {
  checked(n_kv_heads, head_dim, options);
  const VectorFormat k(head_dim, options.k), v(head_dim, options.v);
  const VectorFormat sink(head_dim, VectorFormatSpec{options.sink_type, {}, false, 0});
  KVLayerSize z;
  z.n_kv_heads = n_kv_heads;
  z.head_dim = head_dim;
  z.min_tokens = options.min_tokens;
  z.window = options.window;
  z.block_tokens = options.block_tokens;
  z.main_bytes_per_token = static_cast<int64_t>(n_kv_heads) * static_cast<int64_t>(k.record_bytes() + v.record_bytes());
  z.sink_bytes_per_token = static_cast<int64_t>(n_kv_heads) * 2 * static_cast<int64_t>(sink.record_bytes());
  z.sink_reserved_bytes = z.sink_bytes_per_token * options.min_tokens;
  if (options.centred()) {
    z.center_tokens = options.center_run();
    z.mean_bytes_per_run = static_cast<int64_t>(n_kv_heads) * (options.center_k + options.center_v) * 2 * static_cast<int64_t>(head_dim);
    const VectorFormat tail(head_dim, VectorFormatSpec{KVType::f16, {}, false, 0});
    z.tail_reserved_bytes = int64_t{2} * n_kv_heads * z.center_tokens * static_cast<int64_t>(tail.record_bytes());
  }
  // A block: for each head, block_tokens K records (or a column region of the same size), then as many V
  // records, then (centred) the K and/or V means of its block_tokens / center_tokens runs.
  const size_t block =
      static_cast<size_t>(n_kv_heads) * (static_cast<size_t>(options.block_tokens) * (k.record_bytes() + v.record_bytes()) +
                                         static_cast<size_t>(z.center_tokens > 0 ? options.block_tokens / z.center_tokens : 0) *
                                             static_cast<size_t>(z.mean_bytes_per_run / n_kv_heads));
  z.block_bytes = static_cast<int64_t>(BlockPool::rounded_block_bytes(block));
  // A first chunk of about 1024 positions whatever the block size (4 blocks at the default 256), so that the
  // memory a short sequence reserves does not grow with the block size; later chunks fill huge pages (BlockPool).
  z.first_chunk_blocks = std::max(1, 1024 / std::max(1, options.block_tokens));
  z.later_chunk_blocks = BlockPool::later_chunk_blocks(static_cast<size_t>(z.block_bytes), z.first_chunk_blocks);
  return z;
}

int rotating_blocks_to_drop(int64_t first_block_pos, int64_t blocks, int64_t next_pos, int window, int block_tokens) {
  if (window <= 0) return 0;
  // Queries from next_pos on look back at most window - 1 positions.
  const int64_t oldest_needed = next_pos - window + 1;
  int drop = 0;
  while (blocks - drop > 1 && first_block_pos + static_cast<int64_t>(drop + 1) * block_tokens <= oldest_needed) ++drop;
  return drop;
}

KVCache::KVCache(int n_kv_heads, int head_dim, const KVCacheOptions& options)
    : n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      options_(checked(n_kv_heads, head_dim, options)),
      k_format_(std::make_unique<VectorFormat>(head_dim, options.k)),
      v_format_(std::make_unique<VectorFormat>(head_dim, options.v)),
      sink_format_(std::make_unique<VectorFormat>(head_dim, VectorFormatSpec{options.sink_type, {}, false, 0})),
      tail_format_(std::make_unique<VectorFormat>(head_dim, VectorFormatSpec{KVType::f16, {}, false, 0})),
      block_head_bytes_(static_cast<size_t>(options.block_tokens) * (k_format_->record_bytes() + v_format_->record_bytes()) +
                        static_cast<size_t>(options.centred() ? options.block_tokens / options.center_run() : 0) *
                            (options.center_k + options.center_v) * 2 * static_cast<size_t>(head_dim)),
      k_columns_(k_format_->supports_columns() && options.block_tokens % 16 == 0),
      size_(kv_layer_size(n_kv_heads, head_dim, options)),
      pool_(block_head_bytes_ * static_cast<size_t>(n_kv_heads), size_.first_chunk_blocks, options.max_blocks) {
}

std::string KVCache::describe() const {
  std::ostringstream os;
  if (options_.window > 0) os << "rotating(window " << options_.window << ") ";
  os << k_format_->describe() << "/" << v_format_->describe();
  if (options_.min_tokens > 0) os << " + " << options_.min_tokens << " sink tokens in " << to_string(options_.sink_type);
  if (options_.centred())
    os << ", " << (options_.center_k && options_.center_v ? "K and V" : options_.center_k ? "K" : "V") << " centred per "
       << options_.center_run() << " positions";
  return os.str();
}

double KVCache::main_bits_per_value() const {
  const double per_token = static_cast<double>(main_bytes_per_token()) +
                           (options_.centred() ? static_cast<double>(mean_bytes_per_run()) / options_.center_run() : 0.0);
  return 8.0 * per_token / (2.0 * n_kv_heads_ * head_dim_);
}

int KVCache::add_sequence() {
  while (seqs_.count(next_id_)) ++next_id_;
  add_sequence_with_id(next_id_);
  return next_id_++;
}

void KVCache::add_sequence_with_id(int seq) {
  TQ_CHECK(seq >= 0, "sequence ids are non-negative, got ", seq);
  TQ_CHECK(!seqs_.count(seq), "sequence ", seq, " already exists in this cache");
  Sequence s;
  s.first_block_pos = options_.min_tokens;
  seqs_.emplace(seq, std::move(s));
}

void KVCache::add_sequence_from(int seq, int first) {
  TQ_CHECK(first >= 0, "a sequence cannot start at the negative position ", first);
  TQ_CHECK(first == 0 || options_.min_tokens == 0, "a sequence that starts at position ", first,
           " cannot have a sink tier (its first positions are gone); use min_tokens 0");
  add_sequence_with_id(seq);
  if (first == 0) return;
  Sequence& s = seqs_.at(seq);
  s.length = first;
  s.first_block_pos = first;  // the block grid of this sequence starts at its first held position
}

void KVCache::remove_sequence(int seq) {
  Sequence& s = seq_ref(seq);
  for (int b : s.block_table) pool_.release(b);
  seqs_.erase(seq);
}

void KVCache::fork_sequence(int parent, int child, bool copy) {
  const Sequence& p = seq_ref(parent);
  TQ_CHECK(child >= 0, "sequence ids are non-negative, got ", child);
  TQ_CHECK(!seqs_.count(child), "cannot fork sequence ", parent, " into ", child, ": sequence ", child, " already exists in this cache");
  TQ_CHECK(!copy || static_cast<int64_t>(p.block_table.size()) <= pool_.blocks_available(), "cannot copy sequence ", parent, ": its ",
           p.block_table.size(), " blocks are more than the ", pool_.blocks_available(), " the KV pool has free");
  Sequence c = p;  // the sink tier is per sequence (small): copied
  for (int& b : c.block_table) {
    if (!copy) {
      pool_.retain(b);
      continue;
    }
    const int own = pool_.allocate();
    std::memcpy(pool_.data(own), pool_.data(b), pool_.block_bytes());
    b = own;
  }
  seqs_.emplace(child, std::move(c));
}

std::string KVCache::truncate_problem(int seq, int length) const {
  const Sequence& s = seq_ref(seq);
  std::ostringstream os;
  if (length < 0 || length > s.length) {
    os << "cannot truncate sequence " << seq << " to " << length << " positions: it holds " << s.length;
    return os.str();
  }
  // The next query, at position `length`, sees the positions [length - window + 1, length) (all of them
  // without a window); those must still be held. Positions before first_block_pos that are not in the sink
  // tier are gone (a rotating cache dropped them, or the sequence was converted after it had).
  const int M = options_.min_tokens;
  const int oldest_needed = options_.window > 0 ? std::max(0, length - options_.window + 1) : 0;
  const int held_from = s.first_block_pos > M ? s.first_block_pos : 0;
  if (oldest_needed < held_from && length > M && length < s.length) {
    os << "cannot truncate sequence " << seq << " to " << length << " positions: positions before " << held_from
       << " are no longer held" << (options_.window > 0 ? " (they left the sliding window)" : "")
       << ", and the next position needs them from " << oldest_needed;
  }
  return os.str();
}

void KVCache::truncate(int seq, int length) {
  const std::string problem = truncate_problem(seq, length);
  TQ_CHECK(problem.empty(), problem);
  Sequence& s = seq_ref(seq);
  if (length == s.length) return;
  const int M = options_.min_tokens;
  const int T = options_.block_tokens;
  // Blocks that hold no position below `length` go back to the pool.
  while (!s.block_table.empty()) {
    const int first = s.first_block_pos + static_cast<int>(s.block_table.size() - 1) * T;
    if (first < length) break;
    pool_.release(s.block_table.back());
    s.block_table.pop_back();
  }
  // Back inside the sink tier with every block gone: the main tier's grid starts again at min_tokens.
  if (s.block_table.empty() && length <= M) s.first_block_pos = M;
  // The filling run's positions are all gone: none is filling. A run already encoded that `length` falls
  // inside keeps its means; the positions appended into it again are encoded around them.
  if (s.tail_pos >= 0 && length <= s.tail_pos) s.tail_pos = -1;
  s.length = length;
}

BlockDemand KVCache::demand(const std::vector<SequenceGrowth>& growth) const {
  BlockDemand d;
  d.available = pool_.blocks_available();
  d.capacity = pool_.max_blocks();
  d.block_bytes = static_cast<int64_t>(pool_.block_bytes());
  const int M = options_.min_tokens, T = options_.block_tokens;
  for (const SequenceGrowth& g : growth) {
    TQ_CHECK(g.n >= 0, "cannot append a negative number of positions");
    const Sequence& s = seq_ref(g.seq);
    const int from = s.length, to = from + g.n;
    if (to <= M || g.n == 0) continue;
    // Blocks on the sequence's grid that the new positions fall in: new ones are allocated, held ones
    // that a fork shares are copied before the first write.
    const int main_from = std::max(from, std::max(M, s.first_block_pos));
    const int b_first = (main_from - s.first_block_pos) / T, b_last = (to - 1 - s.first_block_pos) / T;
    for (int b = b_first; b <= b_last; ++b) {
      const bool held = static_cast<size_t>(b) < s.block_table.size();
      d.needed += !held || pool_.owners(s.block_table[static_cast<size_t>(b)]) > 1;
    }
  }
  return d;
}

std::vector<int> KVCache::sequences() const {
  std::vector<int> ids;
  for (const auto& [id, s] : seqs_) ids.push_back(id);
  return ids;
}

KVCache::Sequence& KVCache::seq_ref(int seq) {
  auto it = seqs_.find(seq);
  TQ_CHECK(it != seqs_.end(), "no sequence ", seq, " in this cache");
  return it->second;
}
const KVCache::Sequence& KVCache::seq_ref(int seq) const {
  auto it = seqs_.find(seq);
  TQ_CHECK(it != seqs_.end(), "no sequence ", seq, " in this cache");
  return it->second;
}

int KVCache::length(int seq) const { return seq_ref(seq).length; }
int KVCache::first_kept(int seq) const {
  const Sequence& s = seq_ref(seq);
  return s.length <= options_.min_tokens ? 0 : std::min(s.first_block_pos, s.length);
}

void KVCache::drop_out_of_window(Sequence& s, int next_pos) {
  const int drop = rotating_blocks_to_drop(s.first_block_pos, static_cast<int64_t>(s.block_table.size()), next_pos, options_.window,
                                           options_.block_tokens);
  for (int i = 0; i < drop; ++i) pool_.release(s.block_table[static_cast<size_t>(i)]);
  s.block_table.erase(s.block_table.begin(), s.block_table.begin() + drop);
  s.first_block_pos += drop * options_.block_tokens;
}

uint8_t* KVCache::main_block(Sequence& s, int pos) {
  const size_t b = static_cast<size_t>((pos - s.first_block_pos) / options_.block_tokens);
  while (s.block_table.size() <= b) {
    const int id = pool_.allocate();
    // Zeroed so that column tiles read defined values past the last filled token.
    std::memset(pool_.data(id), 0, pool_.block_bytes());
    s.block_table.push_back(id);
  }
  int& id = s.block_table[b];
  if (pool_.owners(id) > 1) {
    // Another sequence (a fork) still reads this block: this one writes into a copy of its own.
    const int copy = pool_.allocate();
    std::memcpy(pool_.data(copy), pool_.data(id), pool_.block_bytes());
    pool_.release(id);
    id = copy;
  }
  return pool_.data(id);
}

uint8_t* KVCache::main_v_record(Sequence& s, int pos, int head) {
  const int T = options_.block_tokens;
  const int t = (pos - s.first_block_pos) % T;
  return main_block(s, pos) + static_cast<size_t>(head) * block_head_bytes_ + static_cast<size_t>(T) * k_format_->record_bytes() +
         static_cast<size_t>(t) * v_format_->record_bytes();
}

namespace {
void add_mean(const uint16_t* mean, int dim, float* y) {
  if (mean)
    for (int j = 0; j < dim; ++j) y[j] += f16_bits_to_f32(mean[j]);
}
}  // namespace

void Segment::decode_k_stored(int head, int t, float* y) const {
  if (k_columns) {
    k_format->decode_column_stored(k_region(head), block_tokens, t, y);
  } else {
    k_format->decode_stored(k_record(head, t), y);
  }
  add_mean(k_mean_of(head, t), k_format->dim(), y);
}

void Segment::decode_k(int head, int t, float* x) const {
  decode_k_stored(head, t, x);
  if (k_format->rotated()) k_format->rotation()->inverse(x);
}

void Segment::decode_v(int head, int t, float* x) const {
  v_format->decode_stored(v_record(head, t), x);
  add_mean(v_mean_of(head, t), v_format->dim(), x);
  if (v_format->rotated()) v_format->rotation()->inverse(x);
}

void KVCache::append(int seq, const float* k, const float* v, int n, size_t k_stride, size_t v_stride) {
  const size_t row = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_);
  if (k_stride == 0) k_stride = row;
  if (v_stride == 0) v_stride = row;
  TQ_CHECK(k_stride >= row && v_stride >= row, "appended rows of ", row, " floats cannot be ", k_stride, " (keys) or ", v_stride,
           " (values) floats apart");
  TQ_CHECK(n >= 0, "cannot append a negative number of positions");
  TQ_CHECK(n == 0 || (k != nullptr && v != nullptr), "append needs keys and values (got a null pointer)");
  Sequence& s = seq_ref(seq);
  drop_out_of_window(s, s.length);
  const int M = options_.min_tokens;
  const size_t sink_rec = sink_format_->record_bytes();
  for (int i = 0; i < n; ++i) {
    const int pos = s.length;
    for (int h = 0; h < n_kv_heads_; ++h) {
      const float* kh = k + static_cast<size_t>(i) * k_stride + static_cast<size_t>(h) * head_dim_;
      const float* vh = v + static_cast<size_t>(i) * v_stride + static_cast<size_t>(h) * head_dim_;
      if (pos < M) {
        if (s.sink_k.empty()) {
          s.sink_k.resize(static_cast<size_t>(n_kv_heads_) * M * sink_rec);
          s.sink_v.resize(s.sink_k.size());
        }
        const size_t off = (static_cast<size_t>(h) * M + pos) * sink_rec;
        sink_format_->encode(kh, s.sink_k.data() + off);
        sink_format_->encode(vh, s.sink_v.data() + off);
      } else if (options_.centred()) {
        const int C = options_.center_run();
        const int rel = pos - s.first_block_pos;
        uint8_t* block = main_block(s, pos);  // held (and made this sequence's own) while its run fills too
        if (h == 0 && s.tail_pos < 0 && rel % C == 0) {
          s.tail_pos = pos;  // a new run: FP16 until it is complete
          if (s.tail_k.empty()) {
            s.tail_k.resize(static_cast<size_t>(n_kv_heads_) * C * tail_format_->record_bytes());
            s.tail_v.resize(s.tail_k.size());
          }
        }
        if (s.tail_pos >= 0) {
          const size_t head_off = static_cast<size_t>(h) * C * tail_format_->record_bytes();
          tail_format_->encode_column(kh, s.tail_k.data() + head_off, C, pos - s.tail_pos);
          tail_format_->encode(vh, s.tail_v.data() + head_off + static_cast<size_t>(pos - s.tail_pos) * tail_format_->record_bytes());
        } else {
          // A run completed before a truncation: encoded around its means, from binary16 like every
          // centred position (so that appending again what was truncated gives the codes it had).
          std::vector<float> k16(kh, kh + head_dim_), v16(vh, vh + head_dim_);  // [head_dim] each
          for (int j = 0; j < head_dim_; ++j) {
            k16[j] = round_to_f16(k16[j]);
            v16[j] = round_to_f16(v16[j]);
          }
          put_centred(block, h, rel % options_.block_tokens, k16.data(), v16.data());
        }
      } else {
        const int T = options_.block_tokens;
        const int t = (pos - s.first_block_pos) % T;
        uint8_t* k_region = main_block(s, pos) + static_cast<size_t>(h) * block_head_bytes_;
        if (k_columns_) {
          k_format_->encode_column(kh, k_region, T, t);
        } else {
          k_format_->encode(kh, k_region + static_cast<size_t>(t) * k_format_->record_bytes());
        }
        v_format_->encode(vh, main_v_record(s, pos, h));
      }
    }
    ++s.length;
    if (s.tail_pos >= 0 && s.length - s.tail_pos == options_.center_run()) finish_tail(s);
  }
}

void KVCache::put_centred(uint8_t* block, int h, int t, const float* k, const float* v) {
  const int T = options_.block_tokens, C = options_.center_run(), D = head_dim_;
  uint8_t* head = block + static_cast<size_t>(h) * block_head_bytes_;
  const auto* means = reinterpret_cast<const uint16_t*>(head + mean_offset());  // [K runs][D] then [V runs][D]
  const int runs = T / C;
  std::vector<float> y(static_cast<size_t>(D));  // [D] stored domain
  k_format_->to_stored(k, y.data());
  if (options_.center_k)
    for (int j = 0; j < D; ++j) y[j] -= f16_bits_to_f32(means[static_cast<size_t>(t / C) * D + j]);
  if (k_columns_) {
    k_format_->encode_column_stored(y.data(), head, T, t);
  } else {
    k_format_->encode_stored(y.data(), head + static_cast<size_t>(t) * k_format_->record_bytes());
  }
  v_format_->to_stored(v, y.data());
  if (options_.center_v) {
    const uint16_t* vm = means + (options_.center_k ? static_cast<size_t>(runs) * D : 0) + static_cast<size_t>(t / C) * D;
    for (int j = 0; j < D; ++j) y[j] -= f16_bits_to_f32(vm[j]);
  }
  v_format_->encode_stored(y.data(), head + static_cast<size_t>(T) * k_format_->record_bytes() + static_cast<size_t>(t) * v_format_->record_bytes());
}

void KVCache::finish_tail(Sequence& s) {
  const int T = options_.block_tokens, C = options_.center_run(), D = head_dim_;
  const int rel = s.tail_pos - s.first_block_pos;
  uint8_t* block = main_block(s, s.tail_pos);
  const int run = (rel % T) / C, runs = T / C;
  const size_t rec = tail_format_->record_bytes();
  std::vector<float> k(static_cast<size_t>(C) * D), v(k.size());  // [C][D] original domain (from FP16)
  std::vector<double> sum(static_cast<size_t>(D));                 // [D]
  for (int h = 0; h < n_kv_heads_; ++h) {
    const size_t head_off = static_cast<size_t>(h) * C * rec;
    auto* means = reinterpret_cast<uint16_t*>(block + static_cast<size_t>(h) * block_head_bytes_ + mean_offset());
    // The means go into the block first: put_centred encodes each position around them.
    for (int tensor = 0; tensor < 2; ++tensor) {
      const bool centre = tensor == 0 ? options_.center_k : options_.center_v;
      const VectorFormat& f = tensor == 0 ? *k_format_ : *v_format_;
      float* x = tensor == 0 ? k.data() : v.data();
      for (int t = 0; t < C; ++t) {
        if (tensor == 0) {
          tail_format_->decode_column(s.tail_k.data() + head_off, C, t, x + static_cast<size_t>(t) * D);
        } else {
          tail_format_->decode(s.tail_v.data() + head_off + static_cast<size_t>(t) * rec, x + static_cast<size_t>(t) * D);
        }
      }
      if (!centre) continue;
      // The mean of the stored-domain vectors: the rotation is linear, so it is the rotated mean.
      std::fill(sum.begin(), sum.end(), 0.0);
      std::vector<float> y(static_cast<size_t>(D));
      for (int t = 0; t < C; ++t) {
        f.to_stored(x + static_cast<size_t>(t) * D, y.data());
        for (int j = 0; j < D; ++j) sum[j] += y[j];
      }
      uint16_t* m = means + (tensor == 1 && options_.center_k ? static_cast<size_t>(runs) * D : 0) + static_cast<size_t>(run) * D;
      for (int j = 0; j < D; ++j) m[j] = f32_to_f16_bits(static_cast<float>(sum[j] / C));
    }
    for (int t = 0; t < C; ++t) put_centred(block, h, rel % T + t, k.data() + static_cast<size_t>(t) * D, v.data() + static_cast<size_t>(t) * D);
  }
  s.tail_pos = -1;
}

void KVCache::segments(int seq, std::vector<Segment>& out) const {
  out.clear();
  const Sequence& s = seq_ref(seq);
  const int M = options_.min_tokens;
  const size_t sink_rec = sink_format_->record_bytes();
  if (s.length > 0 && M > 0) {
    Segment g;
    g.first_pos = 0;
    g.n_tokens = std::min(s.length, M);
    g.k_format = g.v_format = sink_format_.get();
    g.k = s.sink_k.data();
    g.v = s.sink_v.data();
    g.head_stride = static_cast<size_t>(M) * sink_rec;
    g.k_stride = g.v_stride = sink_rec;
    out.push_back(g);
  }
  const int T = options_.block_tokens;
  for (size_t b = 0; b < s.block_table.size(); ++b) {
    const int first = s.first_block_pos + static_cast<int>(b) * T;
    if (first >= s.length) break;
    // With centring the run that is still filling comes from the FP16 tail, after the block's encoded part.
    const bool tail_here = s.tail_pos >= first && s.tail_pos < first + T;
    const int encoded_end = tail_here ? s.tail_pos : std::min(first + T, s.length);
    if (encoded_end > first) {
      Segment g;
      g.first_pos = first;
      g.n_tokens = encoded_end - first;
      g.k_format = k_format_.get();
      g.v_format = v_format_.get();
      g.k = pool_.data(s.block_table[b]);
      g.v = g.k + static_cast<size_t>(T) * k_format_->record_bytes();
      g.head_stride = block_head_bytes_;
      g.k_stride = k_format_->record_bytes();
      g.v_stride = v_format_->record_bytes();
      g.k_columns = k_columns_;
      g.block_tokens = T;
      if (options_.centred()) {
        g.center_tokens = options_.center_run();
        const auto* means = reinterpret_cast<const uint16_t*>(g.k + mean_offset());
        if (options_.center_k) g.k_mean = means;
        if (options_.center_v) g.v_mean = means + (options_.center_k ? static_cast<size_t>(T / g.center_tokens) * head_dim_ : 0);
      }
      out.push_back(g);
    }
    if (tail_here) {
      const int C = options_.center_run();
      const size_t rec = tail_format_->record_bytes();
      Segment g;
      g.first_pos = s.tail_pos;
      g.n_tokens = s.length - s.tail_pos;
      g.k_format = g.v_format = tail_format_.get();
      g.k = s.tail_k.data();
      g.v = s.tail_v.data();
      g.head_stride = static_cast<size_t>(C) * rec;
      g.k_stride = g.v_stride = rec;
      g.k_columns = true;
      g.block_tokens = C;
      out.push_back(g);
    }
  }
}

void KVCache::read(int seq, int pos, float* k, float* v) const {
  const Sequence& s = seq_ref(seq);
  TQ_CHECK(pos >= 0 && pos < s.length, "position ", pos, " is not in sequence ", seq, " (length ", s.length, ")");
  const int M = options_.min_tokens;
  if (pos < M) {
    const size_t rec = sink_format_->record_bytes();
    for (int h = 0; h < n_kv_heads_; ++h) {
      const size_t off = (static_cast<size_t>(h) * M + pos) * rec;
      sink_format_->decode(s.sink_k.data() + off, k + static_cast<size_t>(h) * head_dim_);
      sink_format_->decode(s.sink_v.data() + off, v + static_cast<size_t>(h) * head_dim_);
    }
    return;
  }
  TQ_CHECK(pos >= s.first_block_pos, "position ", pos, " of sequence ", seq, " has left the sliding window");
  std::vector<Segment> segs;
  segments(seq, segs);
  for (const Segment& g : segs) {
    if (pos < g.first_pos || pos >= g.first_pos + g.n_tokens) continue;  // (the sink tier holds no pos >= M)
    for (int h = 0; h < n_kv_heads_; ++h) {
      g.decode_k(h, pos - g.first_pos, k + static_cast<size_t>(h) * head_dim_);
      g.decode_v(h, pos - g.first_pos, v + static_cast<size_t>(h) * head_dim_);
    }
  }
}

MemoryUsage& MemoryUsage::operator+=(const MemoryUsage& o) {
  sink_tokens += o.sink_tokens;
  main_tokens += o.main_tokens;
  sink_bytes += o.sink_bytes;
  main_bytes += o.main_bytes;
  allocated_bytes += o.allocated_bytes;
  fp16_bytes += o.fp16_bytes;
  blocks_in_use += o.blocks_in_use;
  blocks_shared += o.blocks_shared;
  block_bytes = std::max(block_bytes, o.block_bytes);
  snapshot_bytes += o.snapshot_bytes;
  return *this;
}

MemoryUsage KVCache::memory() const {
  MemoryUsage m;
  m.blocks_in_use = static_cast<int64_t>(pool_.blocks_in_use());
  m.blocks_shared = static_cast<int64_t>(pool_.blocks_shared());
  m.block_bytes = static_cast<int64_t>(pool_.block_bytes());
  const int M = options_.min_tokens;
  for (const auto& [id, s] : seqs_) {
    m.sink_tokens += std::min(s.length, M);
    m.main_tokens += std::max(0, s.length - std::max(M, s.first_block_pos));
    m.allocated_bytes += static_cast<int64_t>(s.sink_k.size() + s.sink_v.size() + s.tail_k.size() + s.tail_v.size());
  }
  m.sink_bytes = m.sink_tokens * size_.sink_bytes_per_token;
  // Per sequence: its main-tier positions from the start of its grid (the means of every run they reach).
  for (const auto& [id, s] : seqs_) m.main_bytes += size_.main_bytes(std::max(0, s.length - std::max(M, s.first_block_pos)));
  m.allocated_bytes += static_cast<int64_t>(pool_.bytes_allocated());
  m.fp16_bytes = (m.sink_tokens + m.main_tokens) * 2 * 2 * static_cast<int64_t>(n_kv_heads_) * head_dim_;
  return m;
}

bool KVCache::is_plain_dense_growing() const {
  return is_dense(options_.k.type) && is_dense(options_.v.type) && options_.window == 0 && options_.min_tokens == 0;
}

// ------------------------------------------------------------------ save / load

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

namespace {

constexpr char kMagic[8] = {'T', 'Q', 'K', 'V', 'C', 'A', 'C', 'H'};
// Version 2 added block-mean centring (the header's center_* fields, the means inside each block, and per
// sequence its filling run, tail_pos and the FP16 tail after its blocks); version 1 files still load.
constexpr uint32_t kVersion = 2;
constexpr uint32_t kOldestVersion = 1;

nlohmann::json spec_json(const VectorFormatSpec& s) {
  const auto& q = s.quantizer;
  return {{"type", to_string(s.type)},
          {"rotate", s.rotate},
          {"seed", s.seed},
          {"bits", q.bits},
          {"group_size", q.group_size},
          {"grid", q.grid == Grid::uniform ? "uniform" : q.grid == Grid::lloyd_absmax ? "lloyd_absmax" : "lloyd_max"},
          {"scale_kind", q.scale_kind == ScaleKind::rms ? "rms" : "l2"},
          {"scale_fit", q.scale_fit == ScaleFit::plain ? "plain" : q.scale_fit == ScaleFit::norm_correction ? "norm_correction" : "least_squares"},
          {"rotation_block", q.rotation_block == RotationBlock::dim ? "dim" : q.rotation_block == RotationBlock::group ? "group" : "none"},
          {"codebook", to_string(q.codebook)},
          {"quantizer_seed", q.seed}};
}

VectorFormatSpec spec_from_json(const nlohmann::json& j) {
  VectorFormatSpec s;
  s.type = parse_kv_type(j.at("type").get<std::string>());
  s.rotate = j.at("rotate").get<bool>();
  s.seed = integer_field<uint64_t>(j, "seed");
  auto& q = s.quantizer;
  q.bits = integer_field<int>(j, "bits");
  q.group_size = integer_field<int>(j, "group_size");
  q.grid = parse_grid(j.at("grid").get<std::string>());
  q.scale_kind = j.at("scale_kind").get<std::string>() == "l2" ? ScaleKind::l2 : ScaleKind::rms;
  q.scale_fit = parse_scale_fit(j.at("scale_fit").get<std::string>());
  q.rotation_block = parse_rotation_block(j.at("rotation_block").get<std::string>());
  q.codebook = parse_distribution(j.at("codebook").get<std::string>());
  q.seed = integer_field<uint64_t>(j, "quantizer_seed");
  return s;
}

}  // namespace

// File: magic[8] "TQKVCACH", u32 version, u32 header length L, L bytes of JSON (options and sequence
// lengths), then per sequence in header order: sink K and V [n_kv_heads][min(length, min_tokens)][record],
// then each held main-tier block in order, whole (the block layout of cache.h, means included), then
// (version 2, a sequence whose tail_pos >= 0) the FP16 tail K and V, whole: [n_kv_heads][C][record] each; last, the u64
// FNV-1a hash of every byte before it. All integers little-endian.
std::vector<uint8_t> KVCache::to_bytes() const {
  nlohmann::json header = {{"n_kv_heads", n_kv_heads_},
                           {"head_dim", head_dim_},
                           {"k", spec_json(options_.k)},
                           {"v", spec_json(options_.v)},
                           {"min_tokens", options_.min_tokens},
                           {"sink_type", to_string(options_.sink_type)},
                           {"window", options_.window},
                           {"block_tokens", options_.block_tokens},
                           {"center_k", options_.center_k},
                           {"center_v", options_.center_v},
                           {"center_tokens", options_.center_tokens},
                           {"fused", fused_}};
  nlohmann::json seqs = nlohmann::json::array();
  for (const auto& [id, s] : seqs_)
    seqs.push_back({{"id", id}, {"length", s.length}, {"first_main", std::max(s.first_block_pos, options_.min_tokens)}, {"tail_pos", s.tail_pos}});
  header["sequences"] = seqs;
  const std::string text = header.dump();

  std::vector<uint8_t> bytes = framed_header(kMagic, kVersion, text);
  auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  };
  const int M = options_.min_tokens;
  const size_t sink_rec = sink_format_->record_bytes();
  for (const auto& [id, s] : seqs_) {
    const int n_sink = std::min(s.length, M);
    for (const auto* buf : {&s.sink_k, &s.sink_v})
      for (int h = 0; h < n_kv_heads_; ++h) put(buf->data() + static_cast<size_t>(h) * M * sink_rec, n_sink * sink_rec);
    const int T = options_.block_tokens;
    for (size_t b = 0; b < s.block_table.size() && s.first_block_pos + static_cast<int>(b) * T < s.length; ++b) {
      put(pool_.data(s.block_table[b]), block_head_bytes_ * static_cast<size_t>(n_kv_heads_));
    }
    if (s.tail_pos >= 0) {
      put(s.tail_k.data(), s.tail_k.size());
      put(s.tail_v.data(), s.tail_v.size());
    }
  }
  const uint64_t hash = fnv1a(bytes.data(), bytes.size());
  put(&hash, 8);
  return bytes;
}

void KVCache::save(const std::string& path) const {
  const std::vector<uint8_t> bytes = to_bytes();
  std::ofstream f(path, std::ios::binary);
  TQ_CHECK(f.good(), "cannot open '", path, "' for writing");
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  TQ_CHECK(f.good(), "writing the cache file '", path, "' failed");
}

std::unique_ptr<KVCache> KVCache::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TQ_CHECK(f.good(), "cannot open the cache file '", path, "'");
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return from_bytes(bytes, "cache file '" + path + "'");
}

std::unique_ptr<KVCache> KVCache::from_bytes(std::span<const uint8_t> bytes, const std::string& name) {
  uint32_t version = 0;
  const std::string header_text = framed_header_text(bytes, kMagic, kVersion, name, "KV cache", kOldestVersion, &version);
  const size_t len = header_text.size();
  nlohmann::json header;
  std::unique_ptr<KVCache> cache;
  try {
    header = nlohmann::json::parse(header_text);
    KVCacheOptions o;
    o.k = spec_from_json(header.at("k"));
    o.v = spec_from_json(header.at("v"));
    o.min_tokens = integer_field<int>(header, "min_tokens");
    o.sink_type = parse_kv_type(header.at("sink_type").get<std::string>());
    o.window = integer_field<int>(header, "window");
    o.block_tokens = integer_field<int>(header, "block_tokens");
    if (version >= 2) {
      o.center_k = header.at("center_k").get<bool>();
      o.center_v = header.at("center_v").get<bool>();
      o.center_tokens = integer_field<int>(header, "center_tokens");
    }
    cache = std::make_unique<KVCache>(integer_field<int>(header, "n_kv_heads"), integer_field<int>(header, "head_dim"), o);
    cache->fused_ = header.at("fused").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    fail(name, " has a malformed header: ", e.what());
  } catch (const Error& e) {
    fail(name, " has a malformed header: ", e.what());
  }
  size_t off = 16 + len;
  const size_t end = bytes.size() - 8;
  auto take = [&](size_t n) {
    TQ_CHECK(off + n <= end, name, " is truncated (payload shorter than its header says)");
    const uint8_t* p = bytes.data() + off;
    off += n;
    return p;
  };
  const int M = cache->options_.min_tokens;
  const int H = cache->n_kv_heads_;
  const size_t sink_rec = cache->sink_format_->record_bytes();
  struct SavedSequence {
    int id, length, first_main, tail_pos;
  };
  std::vector<SavedSequence> saved;
  try {
    for (const auto& js : header.at("sequences"))
      saved.push_back({integer_field<int>(js, "id"), integer_field<int>(js, "length"), integer_field<int>(js, "first_main"),
                       version >= 2 ? integer_field<int>(js, "tail_pos") : -1});
  } catch (const nlohmann::json::exception& e) {
    fail(name, " has a malformed sequence list: ", e.what());
  } catch (const Error& e) {
    fail(name, " has a malformed sequence list: ", e.what());
  }
  const int T = cache->options_.block_tokens;
  const size_t block_bytes = cache->block_head_bytes_ * static_cast<size_t>(H);
  const int C = cache->options_.center_run();
  const size_t tail_bytes = cache->options_.centred() ? static_cast<size_t>(H) * C * cache->tail_format_->record_bytes() : 0;
  for (const auto& [id, length, first_main, tail_pos] : saved) {
    TQ_CHECK(length >= 0 && first_main >= M && first_main <= std::max(length, M), name,
             " has an inconsistent sequence ", id);
    // The filling run: none, or one that starts on the run grid and holds 1..C-1 of the last positions.
    TQ_CHECK(tail_pos == -1 || (cache->options_.centred() && tail_pos >= first_main && (tail_pos - first_main) % C == 0 &&
                                tail_pos < length && length - tail_pos < C),
             name, " has an inconsistent filling run (tail_pos ", tail_pos, ") in sequence ", id);
    const int n_sink = std::min(length, M);
    // The sequence's bytes must be in the payload before anything is allocated for them: a header that
    // lies about the sizes would otherwise allocate whatever it names. In 128 bits: no product overflows.
    using u128 = unsigned __int128;
    const u128 main_blocks = length > first_main ? (static_cast<u128>(length - first_main) + T - 1) / T : 0;
    const u128 need = static_cast<u128>(2) * H * n_sink * sink_rec + main_blocks * block_bytes + (tail_pos >= 0 ? 2 * tail_bytes : 0);
    cache->add_sequence_with_id(id);  // first: a repeated id is named as such
    TQ_CHECK(need <= end - off, name, " is truncated (payload shorter than its header says)");
    Sequence& s = cache->seqs_.at(id);
    // What is still allocated beyond the payload: the sink tier's whole capacity (M positions per head) and
    // the pool's first chunk (about 1024 positions); a header can name more than the machine has.
    try {
      if (n_sink > 0) {
        s.sink_k.resize(static_cast<size_t>(H) * M * sink_rec);
        s.sink_v.resize(s.sink_k.size());
      }
      for (auto* buf : {&s.sink_k, &s.sink_v})
        for (int h = 0; h < H; ++h) {
          if (n_sink) std::memcpy(buf->data() + static_cast<size_t>(h) * M * sink_rec, take(n_sink * sink_rec), n_sink * sink_rec);
        }
      // Main tier: blocks start at first_main (M plus whole blocks, or the first position a converted
      // rotating cache held).
      s.first_block_pos = first_main;
      for (int64_t pos = s.first_block_pos; pos < length; pos += T)
        std::memcpy(cache->main_block(s, static_cast<int>(pos)), take(block_bytes), block_bytes);
      if (tail_pos >= 0) {
        s.tail_k.resize(tail_bytes);
        s.tail_v.resize(tail_bytes);
        std::memcpy(s.tail_k.data(), take(tail_bytes), tail_bytes);
        std::memcpy(s.tail_v.data(), take(tail_bytes), tail_bytes);
        s.tail_pos = tail_pos;
      }
    } catch (const std::bad_alloc&) {
      fail(name, ": sequence ", id, " needs more memory than can be allocated (", H, " KV heads, ", M,
           " sink positions, blocks of ", block_bytes, " bytes)");
    }
    s.length = length;
  }
  TQ_CHECK(off == end, name, " has ", end - off, " unexpected trailing bytes");
  return cache;
}

// ------------------------------------------------------------------ StateCache

StateSnapshot::StateSnapshot(const StateShape& shape, std::vector<float> conv, std::vector<float> recurrent, int length)
    : shape_(shape), conv_(std::move(conv)), recurrent_(std::move(recurrent)), length_(length) {
  TQ_CHECK(conv_.size() == static_cast<size_t>(shape.conv_channels) * std::max(0, shape.conv_kernel - 1) &&
               recurrent_.size() == static_cast<size_t>(shape.state_heads) * shape.state_dk * shape.state_dv && length >= 0,
           "a state snapshot's arrays do not match its shape");
}

RecurrentStateCache::RecurrentStateCache(const StateShape& shape) : shape_(shape) {
  TQ_CHECK(shape.conv_channels >= 0 && shape.conv_kernel >= 0 && shape.state_heads >= 0 && shape.state_dk >= 0 &&
               shape.state_dv >= 0,
           "state cache dimensions must not be negative");
}

std::string RecurrentStateCache::truncate_problem(int seq, int length) const {
  const int held = this->length(seq);
  if (length == held) return "";
  std::ostringstream os;
  os << "cannot truncate sequence " << seq << " from " << held << " to " << length
     << " positions: a recurrent state holds no earlier positions to go back to";
  return os.str();
}

void RecurrentStateCache::truncate(int seq, int length) {
  const std::string problem = truncate_problem(seq, length);
  TQ_CHECK(problem.empty(), problem);
}

void RecurrentStateCache::check_snapshot_shape(const StateSnapshot& snap) const {
  const StateShape& a = snap.shape();
  const StateShape& b = shape_;
  TQ_CHECK(a.conv_channels == b.conv_channels && a.conv_kernel == b.conv_kernel && a.state_heads == b.state_heads &&
               a.state_dk == b.state_dk && a.state_dv == b.state_dv,
           "cannot restore a snapshot of a state of conv ", a.conv_channels, "x", a.conv_kernel, ", recurrent ", a.state_heads, "x",
           a.state_dk, "x", a.state_dv, " into a state cache of conv ", b.conv_channels, "x", b.conv_kernel, ", recurrent ",
           b.state_heads, "x", b.state_dk, "x", b.state_dv);
}

StateCache::StateCache(const StateShape& shape) : RecurrentStateCache(shape) {}

std::string StateCache::describe() const {
  std::ostringstream os;
  os << "state(conv " << shape_.conv_channels << "x" << std::max(0, shape_.conv_kernel - 1) << ", recurrent "
     << shape_.state_heads << "x" << shape_.state_dk << "x" << shape_.state_dv << ")";
  return os.str();
}

MemoryUsage StateCache::memory() const {
  MemoryUsage m;
  for (const auto& [id, s] : states_) m.main_bytes += static_cast<int64_t>((s.conv.size() + s.recurrent.size()) * sizeof(float));
  m.allocated_bytes = m.main_bytes;
  m.fp16_bytes = m.main_bytes;
  return m;
}

int StateCache::add_sequence() {
  while (states_.count(next_id_)) ++next_id_;
  State s;
  s.conv.assign(static_cast<size_t>(shape_.conv_floats()), 0.0f);
  s.recurrent.assign(static_cast<size_t>(shape_.recurrent_floats()), 0.0f);
  states_.emplace(next_id_, std::move(s));
  return next_id_++;
}

void StateCache::add_sequence_with_id(int seq) {
  TQ_CHECK(seq >= 0, "sequence ids are non-negative, got ", seq);
  TQ_CHECK(!states_.count(seq), "sequence ", seq, " already exists in this state cache");
  State s;
  s.conv.assign(static_cast<size_t>(shape_.conv_floats()), 0.0f);
  s.recurrent.assign(static_cast<size_t>(shape_.recurrent_floats()), 0.0f);
  states_.emplace(seq, std::move(s));
}

void StateCache::remove_sequence(int seq) {
  TQ_CHECK(states_.erase(seq) == 1, "no sequence ", seq, " in this state cache");
}

std::vector<int> StateCache::sequences() const {
  std::vector<int> ids;
  for (const auto& [id, s] : states_) ids.push_back(id);
  return ids;
}

int StateCache::length(int seq) const {
  auto it = states_.find(seq);
  TQ_CHECK(it != states_.end(), "no sequence ", seq, " in this state cache");
  return it->second.length;
}

void StateCache::advance(int seq, int n) {
  TQ_CHECK(n >= 0, "a state cannot go back by ", -n, " positions");
  state(seq).length += n;
}

void StateCache::fork_sequence(int parent, int child, bool copy) {
  TQ_CHECK(child >= 0, "sequence ids are non-negative, got ", child);
  TQ_CHECK(!states_.count(child), "cannot fork sequence ", parent, " into ", child, ": sequence ", child, " already exists in this state cache");
  State child_state = state(parent);
  states_.emplace(child, std::move(child_state));
}

StateCache::State& StateCache::state(int seq) {
  auto it = states_.find(seq);
  TQ_CHECK(it != states_.end(), "no sequence ", seq, " in this state cache");
  return it->second;
}
const StateCache::State& StateCache::state(int seq) const {
  auto it = states_.find(seq);
  TQ_CHECK(it != states_.end(), "no sequence ", seq, " in this state cache");
  return it->second;
}
float* StateCache::conv_state(int seq) { return state(seq).conv.data(); }
float* StateCache::recurrent_state(int seq) { return state(seq).recurrent.data(); }
void StateCache::reset(int seq) {
  State& s = state(seq);
  std::fill(s.conv.begin(), s.conv.end(), 0.0f);
  std::fill(s.recurrent.begin(), s.recurrent.end(), 0.0f);
  s.length = 0;
}

StateSnapshot StateCache::snapshot(int seq) const {
  const State& s = state(seq);
  return StateSnapshot(shape_, s.conv, s.recurrent, s.length);
}

void StateCache::restore(int seq, const StateSnapshot& snap) {
  check_snapshot_shape(snap);
  State& s = state(seq);
  s.conv = snap.conv();
  s.recurrent = snap.recurrent();
  s.length = snap.length();
}

// ------------------------------------------------------------------ prompt caches

PromptCache make_prompt_cache(const std::vector<LayerSpec>& layers, KVType dense_type, int block_tokens) {
  TQ_CHECK(is_dense(dense_type), "make_prompt_cache builds dense caches; convert them afterwards (got ", to_string(dense_type), ")");
  PromptCache caches;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSpec& l = layers[i];
    if (l.kind == LayerKind::linear_attention) {
      caches.push_back(std::make_unique<StateCache>(l.state));
      continue;
    }
    KVCacheOptions o;
    o.k.type = o.v.type = dense_type;
    o.block_tokens = block_tokens;
    if (l.kind == LayerKind::sliding_attention) {
      TQ_CHECK(l.window > 0, "layer ", i, " is a sliding-window layer without a window size");
      o.window = l.window;
    }
    caches.push_back(std::make_unique<KVCache>(l.n_kv_heads, l.head_dim, o));
  }
  return caches;
}

QuantizerOptions TurboQuantCacheOptions::k_quantizer() const {
  QuantizerOptions q = QuantizerOptions::defaults(k_bits);
  q.group_size = group_size;
  q.scale_fit = scale_fit;
  q.seed = k_seed;
  if (k_bits == 8) q.grid = k_grid_8bit;
  return q;
}

QuantizerOptions TurboQuantCacheOptions::v_quantizer() const {
  QuantizerOptions q = QuantizerOptions::defaults(v_bits);
  q.group_size = group_size;
  q.scale_fit = scale_fit;
  q.seed = v_seed;
  return q;
}

KVCacheOptions turboquant_cache_options(const TurboQuantCacheOptions& o, int window) {
  TQ_CHECK(o.k_bits >= 2 && o.k_bits <= 8, "K bits must be in 2..8, got ", o.k_bits);
  TQ_CHECK(o.v_bits >= 2 && o.v_bits <= 8, "V bits must be in 2..8, got ", o.v_bits);
  TQ_CHECK(o.group_size == 32 || o.group_size == 64 || o.group_size == 128, "KV group size must be 32, 64 or 128, got ", o.group_size);
  TQ_CHECK(o.min_tokens_before_quant >= 0, "min_tokens_before_quant must not be negative");
  KVCacheOptions c;
  c.k.type = c.v.type = KVType::turboquant;
  c.k.quantizer = o.k_quantizer();
  c.v.quantizer = o.v_quantizer();
  c.min_tokens = o.min_tokens_before_quant;
  c.window = window;
  c.block_tokens = o.block_tokens;
  c.center_k = o.center_k;
  c.center_v = o.center_v;
  c.center_tokens = o.center_tokens;
  return c;
}

int convert_cache_to_turboquant(PromptCache& caches, const TurboQuantCacheOptions& options) {
  int converted = 0;
  for (auto& layer : caches) {
    auto* kv = dynamic_cast<KVCache*>(layer.get());
    if (!kv) continue;
    const bool rotating_dense = kv->options().window > 0 && is_dense(kv->options().k.type) &&
                                is_dense(kv->options().v.type) && kv->options().min_tokens == 0;
    if (!kv->is_plain_dense_growing() && !(options.compress_rotating && rotating_dense)) continue;
    // A rotating cache that already dropped positions continues from its oldest held one, without a
    // sink tier: the sink tier's positions are among those gone (and outside the window).
    bool dropped = false;
    for (int seq : kv->sequences()) dropped = dropped || kv->first_kept(seq) > 0;
    TurboQuantCacheOptions layer_options = options;
    if (dropped) layer_options.min_tokens_before_quant = 0;
    auto tq = std::make_unique<KVCache>(kv->n_kv_heads(), kv->head_dim(), turboquant_cache_options(layer_options, kv->options().window));
    const int H = kv->n_kv_heads(), D = kv->head_dim();
    std::vector<Segment> segs;
    std::vector<float> k, v;  // [segment positions][H][D], original domain
    for (int seq : kv->sequences()) {
      tq->add_sequence_from(seq, kv->first_kept(seq));
      // One append per stored segment (a block), decoded straight from its records: read() would
      // look the segments up again for every position.
      kv->segments(seq, segs);
      for (const Segment& g : segs) {
        k.resize(static_cast<size_t>(g.n_tokens) * H * D);
        v.resize(k.size());
        for (int t = 0; t < g.n_tokens; ++t)
          for (int h = 0; h < H; ++h) {
            const size_t at = (static_cast<size_t>(t) * H + h) * D;
            g.decode_k(h, t, k.data() + at);
            g.decode_v(h, t, v.data() + at);
          }
        tq->append(seq, k.data(), v.data(), g.n_tokens);
      }
    }
    tq->set_fused(kv->fused());
    layer = std::move(tq);
    ++converted;
  }
  return converted;
}

int enable_fused_attend(PromptCache& caches) {
  int marked = 0;
  for (auto& layer : caches) {
    if (auto* kv = dynamic_cast<KVCache*>(layer.get())) {
      kv->set_fused(true);
      ++marked;
    }
  }
  return marked;
}

}  // namespace tq
