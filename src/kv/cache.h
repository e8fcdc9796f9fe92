// Per-layer caches.
//
//   KVCache     keys and values of an attention layer, for any number of sequences. Two tiers:
//               the sink tier holds positions [0, min_tokens) of each sequence in `sink_type` (FP16 by
//               default); the main tier holds the rest in fixed-size blocks of `block_tokens` positions
//               from a pool shared by all sequences, in the main format (dense FP16/BF16/FP32,
//               TurboQuant, or the q8_0/q4_0 baselines). With `window` > 0 it is a rotating cache for
//               sliding-window layers: blocks that fall entirely out of the window are given back.
//   StateCache  convolution and recurrent state of a linear-attention layer.
//
// Block layout (bytes): for each KV head h: [K region: block_tokens x k_record][V records:
// block_tokens x v_record][K means: runs x dim binary16, when K is centred][V means: likewise], with
// runs = block_tokens / center_tokens (block-mean centring, KVCacheOptions::center_k). The K region is in column (dimension-major) layout when the K format has
// one (dense and TurboQuant; see VectorFormat::encode_column), else block_tokens records. Memory
// formulas: docs/FORMATS.md ("KV cache").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kv/block_pool.h"
#include "kv/vector_format.h"

namespace tq {

// Positions per main-tier block when the options do not say: the CPU block kernel attends to up to
// 256 positions of a block per call, and a call's fixed cost (the softmax update, loading and storing
// the accumulators, the drain between its phases) spread over 128 positions instead of 64 made the
// K8/V3 decode step about 10% faster at 16K, over 256 another 4-5%; 512 gained nothing more
// (docs/BENCHMARKS.md).
constexpr int kDefaultBlockTokens = 256;
// Bounds far above any model's, so that a size from a file or a flag that is absurd is an error that
// names it, not an allocation of what it names.
constexpr int kMaxKVHeads = 1 << 16, kMaxHeadDim = 1 << 16, kMaxBlockTokens = 1 << 16, kMaxSinkTokens = 1 << 20;

// A run of consecutive positions stored in one format, as attention reads it.
struct Segment {
  int first_pos = 0;
  int n_tokens = 0;
  const VectorFormat* k_format = nullptr;
  const VectorFormat* v_format = nullptr;
  const uint8_t* k = nullptr;  // record of head 0, first token
  const uint8_t* v = nullptr;
  size_t head_stride = 0;      // bytes from head h to head h + 1 (same for K and V)
  size_t k_stride = 0;         // bytes from one token's K record to the next (record layout)
  size_t v_stride = 0;
  bool k_columns = false;      // K is a column region of `block_tokens` tokens (first_pos at column 0)
  int block_tokens = 0;
  // Block-mean centring: a record holds y - mean, y the stored-domain (rotated) vector and mean the
  // binary16 mean of the run of center_tokens positions it belongs to (first_pos starts a run). k_mean /
  // v_mean: head 0's means [runs][dim], head h's head_stride bytes further; nullptr when not centred.
  const uint16_t* k_mean = nullptr;
  const uint16_t* v_mean = nullptr;
  int center_tokens = 0;
  // The mean of token t's run for head h ([dim] binary16), or nullptr.
  const uint16_t* k_mean_of(int head, int t) const { return k_mean ? mean_at(k_mean, head, t) : nullptr; }
  const uint16_t* v_mean_of(int head, int t) const { return v_mean ? mean_at(v_mean, head, t) : nullptr; }
  const uint8_t* k_region(int head) const { return k + head * head_stride; }
  const uint8_t* k_record(int head, int t) const { return k + head * head_stride + static_cast<size_t>(t) * k_stride; }
  const uint8_t* v_record(int head, int t) const { return v + head * head_stride + static_cast<size_t>(t) * v_stride; }
  // Token t's key (either layout) as floats: original domain / stored domain.
  // Means included.
  void decode_k(int head, int t, float* x) const;
  void decode_k_stored(int head, int t, float* y) const;
  void decode_v(int head, int t, float* x) const;

 private:
  const uint16_t* mean_at(const uint16_t* head0, int head, int t) const {
    const auto* base = reinterpret_cast<const uint8_t*>(head0) + static_cast<size_t>(head) * head_stride;
    return reinterpret_cast<const uint16_t*>(base) + static_cast<size_t>(t / center_tokens) * k_format->dim();
  }
};

struct MemoryUsage {
  int64_t sink_tokens = 0;       // positions held in the sink tier (all sequences)
  int64_t main_tokens = 0;       // positions held in the main tier (a position forked sequences share counts for each)
  int64_t sink_bytes = 0;        // = sink_tokens * sink bytes per token
  int64_t main_bytes = 0;        // = main_tokens * main bytes per token
  int64_t allocated_bytes = 0;   // what the process holds for this cache (whole blocks, sink buffers)
  int64_t fp16_bytes = 0;        // what an FP16 cache of the same positions would take
  int64_t blocks_in_use = 0;     // main-tier blocks held by sequences, each shared block once
  int64_t blocks_shared = 0;     // of those, blocks that more than one (forked) sequence holds
  int64_t block_bytes = 0;       // bytes of one block (all KV heads)
  int64_t snapshot_bytes = 0;    // state snapshots the engine keeps (Engine::snapshot; each shared one once), not in bytes_in_use()
  int64_t bytes_in_use() const { return sink_bytes + main_bytes; }
  MemoryUsage& operator+=(const MemoryUsage& o);
};

enum class LayerKind { full_attention, sliding_attention, linear_attention };

// How many blocks appending would take, against what the pool can still hand out.
struct SequenceGrowth {
  int seq = 0;
  int n = 0;  // positions to append
};
struct BlockDemand {
  int64_t needed = 0;                // new blocks (and copies of shared blocks about to be written)
  int64_t available = INT64_MAX;     // blocks the pool can still hand out (INT64_MAX: unbounded)
  int64_t capacity = 0;              // the pool's bound in blocks (0: unbounded)
  int64_t block_bytes = 0;
};

// One layer's cache for any number of sequences. Every layer of a model holds the same sequence ids;
// the runtime (runtime/engine.h) keeps them in step.
class LayerCache {
 public:
  virtual ~LayerCache() = default;
  virtual std::string describe() const = 0;
  virtual MemoryUsage memory() const = 0;
  virtual int add_sequence() = 0;
  virtual void add_sequence_with_id(int seq) = 0;
  virtual void remove_sequence(int seq) = 0;
  virtual bool has_sequence(int seq) const = 0;
  virtual std::vector<int> sequences() const = 0;  // the ids held, in increasing order
  virtual int length(int seq) const = 0;  // positions appended so far
  // A new sequence `child` that holds what `parent` holds. KV caches share the parent's blocks, the one
  // still filling included: a block is copied when either sequence first writes into it while the other
  // still holds it (copy-on-write), so a fork costs no block until the sequences diverge. With copy, the
  // child gets copies of every block at once (what a benchmark of independent sequences wants).
  virtual void fork_sequence(int parent, int child, bool copy = false) = 0;
  // Forgets positions [length, length(seq)): the next append goes to position `length`. Throws when the
  // positions the next query needs are gone (a rotating cache's window, a recurrent state).
  virtual void truncate(int seq, int length) = 0;
  // Why truncate(seq, length) would throw, or "" when it would not (nothing is changed).
  virtual std::string truncate_problem(int seq, int length) const = 0;
  // What appending these positions would take from the block pool (nothing is changed).
  virtual BlockDemand demand(const std::vector<SequenceGrowth>& growth) const = 0;
};

// The checksum that ends every cache file (64-bit FNV-1a over the bytes before it).
uint64_t fnv1a(const uint8_t* p, size_t n);

struct KVCacheOptions {
  VectorFormatSpec k;             // main tier formats
  VectorFormatSpec v;
  int min_tokens = 0;             // sink tier size (per sequence)
  KVType sink_type = KVType::f16;
  int window = 0;                 // > 0: rotating cache keeping at least the last `window` positions
  int block_tokens = kDefaultBlockTokens;
  int64_t max_blocks = 0;         // main-tier blocks the cache may hold at once (0: no bound)
  // Block-mean centring of the main tier (docs/FORMATS.md): each run of center_tokens positions of a
  // block is quantized around its own binary16 mean (stored domain, per head), stored beside the block;
  // the run that is still filling is held in FP16 (the tail) until it is complete. Attention adds the
  // mean back exactly: q.mean per run to the scores, (the run's weight sum) x mean to the values.
  bool center_k = false, center_v = false;
  int center_tokens = 0;          // positions per mean: a power of two, 16..block_tokens; 0: block_tokens
  // The fused attention's int8-query scorer (attn/attention.h, Int8QueryPlan): the main tier's key scores
  // from the query rounded to int8 per group. An option of attention, not of the stored format (files do
  // not record it).
  bool query_int8 = false;
  bool centred() const { return center_k || center_v; }
  int center_run() const { return center_tokens > 0 ? center_tokens : block_tokens; }
};

// The bytes of one layer's KV cache, from its shape and options alone. KVCache sizes its records, blocks
// and pool from this, and the memory plan (runtime/memory_plan.h) predicts a run's caches with it, so the
// plan and a real run agree by construction.
struct KVLayerSize {
  int n_kv_heads = 0, head_dim = 0;
  int min_tokens = 0;                // sink tier positions per sequence
  int window = 0;                    // > 0: rotating
  int block_tokens = 0;
  int64_t main_bytes_per_token = 0;  // all KV heads, K and V records of the main tier
  int64_t sink_bytes_per_token = 0;  // all KV heads, K and V records of the sink tier
  int64_t sink_reserved_bytes = 0;   // one sequence's sink buffers, reserved at its first position: [K, V][heads][min_tokens][record]
  int64_t block_bytes = 0;           // one main-tier block of all heads, as the pool stores it (rounded up to 64 bytes),
                                     // the centring means inside it
  // Block-mean centring (KVCacheOptions::center_k): 0 when not centred.
  int center_tokens = 0;             // positions per mean (KVCacheOptions::center_run)
  int64_t mean_bytes_per_run = 0;    // all KV heads, K and/or V binary16 means of one run
  int64_t tail_reserved_bytes = 0;   // one sequence's FP16 filling run, reserved at its first main-tier position:
                                     // [K, V][heads][center_tokens][f16 record]
  int first_chunk_blocks = 0;        // the pool's first chunk (about 1024 positions), then chunks of later_chunk_blocks
  int later_chunk_blocks = 0;
  // Bytes the pool holds once `blocks` blocks were in use at once at most (whole chunks).
  int64_t pool_bytes(int64_t blocks) const;
  // Main-tier bytes of `tokens` positions from the start of the main tier's grid: the records and, centred,
  // the means of every run they reach into (the filling run's too: its block holds them).
  int64_t main_bytes(int64_t tokens) const {
    return tokens * main_bytes_per_token + (center_tokens > 0 ? (tokens + center_tokens - 1) / center_tokens * mean_bytes_per_run : 0);
  }
  // What one position takes in the pool, the means spread over their runs (rounded up): what a KV pool in
  // bytes divides by.
  int64_t pool_bytes_per_token() const {
    return main_bytes_per_token + (center_tokens > 0 ? (mean_bytes_per_run + center_tokens - 1) / center_tokens : 0);
  }
};
KVLayerSize kv_layer_size(int n_kv_heads, int head_dim, const KVCacheOptions& options);
// A rotating cache's blocks at the start of an append at `next_pos`: how many of the sequence's `blocks`
// oldest blocks (the first starting at first_block_pos) fall entirely out of the window and go back.
// One block always stays.
int rotating_blocks_to_drop(int64_t first_block_pos, int64_t blocks, int64_t next_pos, int window, int block_tokens);

class KVCache final : public LayerCache {
 public:
  KVCache(int n_kv_heads, int head_dim, const KVCacheOptions& options);

  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  const KVCacheOptions& options() const { return options_; }
  const VectorFormat& k_format() const { return *k_format_; }
  const VectorFormat& v_format() const { return *v_format_; }
  const VectorFormat& sink_format() const { return *sink_format_; }
  std::string describe() const override;

  int add_sequence() override;
  void add_sequence_with_id(int seq) override;
  // A sequence whose positions before `first` are gone (length `first`, none of them held): what a
  // rotating cache converted after it dropped positions continues from. No sink tier (min_tokens 0)
  // unless first is 0, since the sink tier's positions are among those gone.
  void add_sequence_from(int seq, int first);
  void remove_sequence(int seq) override;
  bool has_sequence(int seq) const override { return seqs_.count(seq) != 0; }
  std::vector<int> sequences() const override;
  int length(int seq) const override;  // positions appended so far
  int first_kept(int seq) const;       // oldest main-tier position still held (> 0 only for rotating caches; the
                                       // sink tier below options().min_tokens is always held, and a sequence
                                       // longer than the sink tier whose window dropped nothing reads min_tokens)
  void fork_sequence(int parent, int child, bool copy = false) override;
  void truncate(int seq, int length) override;
  std::string truncate_problem(int seq, int length) const override;
  BlockDemand demand(const std::vector<SequenceGrowth>& growth) const override;

  // Appends n positions. k, v: [n][n_kv_heads][head_dim] floats, original domain, position i's row at
  // k + i * k_stride (0: rows side by side), likewise v.
  void append(int seq, const float* k, const float* v, int n, size_t k_stride = 0, size_t v_stride = 0);

  // The stored positions of a sequence, oldest first: sink tier, then main-tier blocks.
  void segments(int seq, std::vector<Segment>& out) const;

  // Position pos decoded to floats in the original domain: k, v [n_kv_heads][head_dim].
  void read(int seq, int pos, float* k, float* v) const;

  MemoryUsage memory() const override;
  size_t main_bytes_per_token() const { return static_cast<size_t>(size_.main_bytes_per_token); }
  size_t sink_bytes_per_token() const { return static_cast<size_t>(size_.sink_bytes_per_token); }
  const KVLayerSize& size() const { return size_; }
  // Bytes of the means of one run of center_tokens positions (all KV heads, K and V), 0 without centring.
  size_t mean_bytes_per_run() const { return static_cast<size_t>(size_.mean_bytes_per_run); }
  // Bits per cached K and V value of the main tier, the means counted.
  double main_bits_per_value() const;

  bool is_plain_dense_growing() const;
  bool fused() const { return fused_; }
  void set_fused(bool on) { fused_ = on; }

  // Versioned file with a checksum; load() rebuilds the cache from the file alone. to_bytes / from_bytes
  // are the same bytes in memory (a layer of a prompt cache file, kv/cache_file.h); `name` is what the
  // errors call them ("cache file 'x.tqkv'").
  void save(const std::string& path) const;
  static std::unique_ptr<KVCache> load(const std::string& path);
  std::vector<uint8_t> to_bytes() const;
  static std::unique_ptr<KVCache> from_bytes(std::span<const uint8_t> bytes, const std::string& name);

 private:
  struct Sequence {
    int length = 0;
    int first_block_pos = 0;               // position of the first token of block_table[0]
    std::vector<uint8_t> sink_k, sink_v;   // [n_kv_heads][min_tokens][sink record]
    std::vector<int> block_table;          // main-tier blocks, oldest first
    // Centring: the run that is still filling, FP16 until it is complete. K [n_kv_heads][dim][C] (column
    // layout), V [n_kv_heads][C][dim], C = center_tokens; tail_pos its first position, -1 when none.
    std::vector<uint8_t> tail_k, tail_v;
    int tail_pos = -1;
  };
  Sequence& seq_ref(int seq);
  const Sequence& seq_ref(int seq) const;
  // The block that holds pos, to write into: allocates blocks up to pos, and copies a block that another
  // sequence also holds first (copy-on-write).
  uint8_t* main_block(Sequence& s, int pos);
  uint8_t* main_v_record(Sequence& s, int pos, int head);
  bool k_columns() const { return k_columns_; }
  void drop_out_of_window(Sequence& s, int next_pos);
  // Centring: one head's position at block offset t into the block (a run already encoded: its mean),
  // and the tail's run encoded around its new means once it is complete.
  void put_centred(uint8_t* block, int h, int t, const float* k, const float* v);
  void finish_tail(Sequence& s);
  size_t mean_offset() const { return static_cast<size_t>(options_.block_tokens) * (k_format_->record_bytes() + v_format_->record_bytes()); }

  int n_kv_heads_, head_dim_;
  KVCacheOptions options_;
  std::unique_ptr<VectorFormat> k_format_, v_format_, sink_format_, tail_format_;  // tail: FP16
  size_t block_head_bytes_;  // K and V records of one head in one block
  bool k_columns_;
  KVLayerSize size_;  // the byte arithmetic the memory plan shares
  BlockPool pool_;
  std::map<int, Sequence> seqs_;
  int next_id_ = 0;
  bool fused_ = false;
};

// Linear-attention layer state (e.g. gated delta rule): per sequence, a causal-convolution state
// [conv_channels][conv_kernel - 1] and a recurrent state [state_heads][state_dk][state_dv], float32.
struct StateShape {
  int conv_channels = 0, conv_kernel = 0;
  int state_heads = 0, state_dk = 0, state_dv = 0;
  int64_t conv_floats() const { return static_cast<int64_t>(conv_channels) * (conv_kernel > 1 ? conv_kernel - 1 : 0); }
  int64_t recurrent_floats() const { return static_cast<int64_t>(state_heads) * state_dk * state_dv; }
  // One sequence's state (float32), what StateCache holds and the memory plan counts.
  int64_t bytes_per_sequence() const { return (conv_floats() + recurrent_floats()) * static_cast<int64_t>(sizeof(float)); }
};

// A saved copy of one sequence's state (RecurrentStateCache::snapshot), to go back to: a recurrent state
// cannot be truncated, so prefix reuse and rollback restore the state saved at the position they return to.
// Held in host memory whatever the device (a snapshot is taken rarely: at a prefix boundary, before a draft).
class StateSnapshot {
 public:
  StateSnapshot() = default;
  StateSnapshot(const StateShape& shape, std::vector<float> conv, std::vector<float> recurrent, int length);
  int length() const { return length_; }  // positions the state held when saved
  const StateShape& shape() const { return shape_; }
  const std::vector<float>& conv() const { return conv_; }            // [conv_channels][conv_kernel - 1]
  const std::vector<float>& recurrent() const { return recurrent_; }  // [state_heads][state_dk][state_dv]
  int64_t bytes() const { return static_cast<int64_t>((conv_.size() + recurrent_.size()) * sizeof(float)); }

 private:
  StateShape shape_;
  std::vector<float> conv_, recurrent_;
  int length_ = 0;
};

// The cache of a linear-attention layer on any device: per sequence a fixed-size state and the positions
// it has taken in. It cannot be truncated back (only restored from a snapshot).
class RecurrentStateCache : public LayerCache {
 public:
  const StateShape& shape() const { return shape_; }
  // Records that n more positions went into the state (the layer that updates it calls this).
  virtual void advance(int seq, int n) = 0;
  virtual void reset(int seq) = 0;  // zeroes the state (a new prompt)
  // A copy of the sequence's state and length now; restore() puts it back into any sequence of a cache of
  // the same shape (its length becomes the snapshot's), so the sequence continues exactly from there.
  virtual StateSnapshot snapshot(int seq) const = 0;
  virtual void restore(int seq, const StateSnapshot& snapshot) = 0;
  // Only to the current length: the state holds no earlier positions to go back to (restore a snapshot).
  std::string truncate_problem(int seq, int length) const override;
  void truncate(int seq, int length) override;
  BlockDemand demand(const std::vector<SequenceGrowth>& growth) const override { return {}; }

 protected:
  explicit RecurrentStateCache(const StateShape& shape);
  // Throws unless the snapshot is of a state of this cache's shape (naming both).
  void check_snapshot_shape(const StateSnapshot& snapshot) const;
  StateShape shape_;
};

// The state in host memory (the CPU device's).
class StateCache final : public RecurrentStateCache {
 public:
  explicit StateCache(const StateShape& shape);
  std::string describe() const override;
  MemoryUsage memory() const override;
  int add_sequence() override;
  void add_sequence_with_id(int seq) override;
  void remove_sequence(int seq) override;
  bool has_sequence(int seq) const override { return states_.count(seq) != 0; }
  std::vector<int> sequences() const override;
  int length(int seq) const override;
  void advance(int seq, int n) override;
  // A copy of the parent's state: a recurrent state cannot be shared.
  void fork_sequence(int parent, int child, bool copy = false) override;
  float* conv_state(int seq);       // [conv_channels][conv_kernel - 1]
  float* recurrent_state(int seq);  // [state_heads][state_dk][state_dv]
  void reset(int seq) override;
  StateSnapshot snapshot(int seq) const override;
  void restore(int seq, const StateSnapshot& snapshot) override;

 private:
  struct State {
    std::vector<float> conv, recurrent;
    int length = 0;
  };
  State& state(int seq);
  const State& state(int seq) const;
  std::map<int, State> states_;
  int next_id_ = 0;
};

// What make_prompt_cache needs to know about one layer.
struct LayerSpec {
  LayerKind kind = LayerKind::full_attention;
  int n_kv_heads = 0, head_dim = 0;
  int window = 0;       // sliding_attention
  StateShape state;     // linear_attention
};

using PromptCache = std::vector<std::unique_ptr<LayerCache>>;

// The right cache per layer: growing dense caches for full attention, rotating dense caches for
// sliding-window layers, state caches for linear attention.
PromptCache make_prompt_cache(const std::vector<LayerSpec>& layers, KVType dense_type = KVType::f16,
                              int block_tokens = kDefaultBlockTokens);

struct TurboQuantCacheOptions {
  int k_bits = 8, v_bits = 3;
  int group_size = 64;
  int min_tokens_before_quant = 0;
  uint64_t k_seed = 0x4b4b4b4b;  // documented defaults (docs/FORMATS.md)
  uint64_t v_seed = 0x56565656;
  ScaleFit scale_fit = ScaleFit::norm_correction;
  Grid k_grid_8bit = Grid::uniform;
  bool compress_rotating = false;  // also convert sliding-window caches (long windows)
  int block_tokens = kDefaultBlockTokens;
  bool center_k = false, center_v = false;  // block-mean centring (KVCacheOptions)
  int center_tokens = 0;
  QuantizerOptions k_quantizer() const;
  QuantizerOptions v_quantizer() const;
};
KVCacheOptions turboquant_cache_options(const TurboQuantCacheOptions& o, int window = 0);

// Replaces every plain growing dense cache (and rotating ones when compress_rotating) by a
// TurboQuant cache holding the same positions (quantizing what is already there); leaves the
// others as they are. Returns how many caches were converted.
int convert_cache_to_turboquant(PromptCache& caches, const TurboQuantCacheOptions& options);

// Marks every KV cache for the fused attention path. Returns how many caches were marked.
int enable_fused_attend(PromptCache& caches);

}  // namespace tq
