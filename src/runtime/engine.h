// The runtime over batches of sequences: what the generation loop, the server's scheduler and the Python
// API drive.
//
//   Model    a checkpoint on a device: its mapped files and its architecture (model/architecture.h)
//            with the weights handed to the device once.
//   Engine   one model's caches (one per layer, as the KV settings ask) for any number of sequences,
//            and the forward call over a batch of them.
//
// The contract (docs/ARCHITECTURE.md, "The runtime"):
//   - A batch is any number of entries, at most one per sequence, each a run of tokens (a prompt chunk,
//     or one decode token) at the sequence's end, in any mix. One forward call runs them all: every
//     weight is read once for all rows (one matrix product per weight), attention runs per sequence over
//     its own cache pages. Logits come back for the rows each entry asks for (none, its last, all).
//   - Sequences are added, removed, forked (the child shares the parent's blocks, copy-on-write: a
//     prefix cache) and truncated back to a position (stop strings, rejected draft tokens); on a model
//     with recurrent layers, back to a position where snapshot() kept their states.
//   - Bad use is a tq::Error that names it, and changes nothing: an unknown sequence, a batch entry that
//     does not continue its sequence, positions past the context, token ids outside the vocabulary, a
//     batch the KV pool cannot hold (how much it needs, how much is free).
#pragma once

#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "device/device.h"
#include "kv/cache_file.h"
#include "model/architecture.h"
#include "runtime/kv_settings.h"

namespace tq {

class Model {
 public:
  Model(ModelFiles files, Device& device);
  // A folder or a .gguf file (model/loader.h), built on `device`.
  static std::unique_ptr<Model> open(const std::string& path, Device& device);

  const ModelConfig& config() const { return files_->config; }
  const ModelFiles& files() const { return *files_; }
  Device& device() const { return device_; }
  const Architecture& architecture() const { return *arch_; }
  int64_t vocab_size() const { return arch_->vocab_size(); }
  std::vector<LayerSpec> layer_specs() const { return arch_->layer_specs(); }
  std::string weights_dtype() const;  // of the files' first layer matrix
  // What a prompt cache file of this model carries to be loaded only into this model (kv/cache_file.h).
  ModelFingerprint fingerprint() const;
  int64_t file_weight_bytes() const;  // the tensors' bytes in the files

  // Positions beyond the model's max_position_embeddings are refused unless the limit is raised
  // (benchmarks at depth; RoPE itself has no limit, the model's quality does).
  void set_position_limit(int64_t limit) { position_limit_ = limit; }
  int64_t position_limit() const { return position_limit_ > 0 ? position_limit_ : config().max_position_embeddings; }

 private:
  std::unique_ptr<ModelFiles> files_;  // heap-held: the architecture's weights point into it
  Device& device_;
  std::unique_ptr<Architecture> arch_;
  int64_t position_limit_ = 0;
};

// Which attention path each layer ran, counted over the engine's calls (reported by the tools).
struct LayerAttentionReport {
  std::string cache;  // the cache's description
  AttentionStats stats;
};

struct EngineOptions {
  KVSettings kv;                // resolved (KVSettings::resolve or parse_kv_spec)
  int max_sequences = 1;        // alive at once
  int64_t ctx_size = 0;         // positions one sequence may reach (0: the model's position limit)
  // The KV pool: main-tier positions every layer holds for all sequences together, or the bytes of all
  // layers' main tiers together (kv_pool_tokens wins when both are given). 0 and 0: unbounded on the
  // CPU; on CUDA (caches allocated up front), room for max_sequences sequences of ctx_size positions.
  int64_t kv_pool_tokens = 0;
  int64_t kv_pool_bytes = 0;
};

enum class Logits { none, last, all };

struct BatchEntry {
  int seq = 0;
  std::span<const int32_t> tokens;  // at least one
  int pos0 = -1;                    // the position of tokens[0]: the sequence's length (-1: that)
  Logits logits = Logits::last;
};

// Where each entry's logits are among the rows of a forward call's output.
struct BatchOutput {
  std::vector<int> first_row;  // [entries]: entry i's first output row (-1 when it asked for none)
  std::vector<int> rows;       // [entries]: how many output rows entry i has
  int total = 0;               // output rows in all
};

class Engine {
 public:
  Engine(Model& model, const EngineOptions& options);
  // An engine over caches made elsewhere (make_prompt_cache, convert_cache_to_turboquant, a loaded cache
  // file: what the Python API hands over), one per layer, on the model's device; the sequences they hold
  // are the engine's. options.kv is only reported.
  Engine(Model& model, std::vector<std::unique_ptr<LayerCache>> caches, const EngineOptions& options);

  Model& model() const { return model_; }
  const EngineOptions& options() const { return options_; }
  int64_t ctx_size() const { return ctx_; }

  // ---- sequences
  int add_sequence();
  void remove_sequence(int seq);
  // A new sequence holding what `parent` holds (its blocks shared, copy-on-write; with copy, copied at
  // once) and the parent's snapshots (shared: they never change); returns its id.
  int fork_sequence(int parent, bool copy = false);
  // A fork of `parent` truncated to `length` (a prefix reused from a snapshot on a hybrid model); refused
  // before anything is forked when the parent could not be truncated there (truncate_problem).
  int fork_sequence_at(int parent, int length);
  // Forgets positions [length, length(seq)); the next token goes to position `length`. The KV layers drop
  // their positions; a recurrent layer (a state holds no earlier positions) restores the snapshot kept at
  // exactly `length` (snapshot()), or the call is refused naming the positions that have one, with nothing
  // changed. Snapshots after `length` are dropped.
  void truncate(int seq, int length);
  // Why truncate(seq, length) would be refused, or "" when it would not (nothing is changed).
  std::string truncate_problem(int seq, int length) const;
  // Keeps a snapshot of every recurrent layer's state of the sequence at its current length, so that a
  // truncation or a fork can come back to this position (replacing one kept there already). Held in host
  // memory (memory().snapshot_bytes) until the sequence is removed or truncated below it. On a model
  // without recurrent layers it costs nothing and keeps nothing: its KV layers truncate to any position.
  void snapshot(int seq);
  // The positions of the snapshots kept for the sequence, in increasing order (none on a model without
  // recurrent layers).
  std::vector<int> snapshot_positions(int seq) const;
  bool has_sequence(int seq) const;
  int length(int seq) const;
  std::vector<int> sequences() const;

  // ---- prompt cache files (kv/cache_file.h): every layer's cache of every sequence (not the snapshots)
  void save_prompt_cache(const std::string& path, const PromptCacheMetadata& metadata = {}) const;
  // An engine over the caches of a file of this model, holding its sequences; refused on a device other
  // than the CPU (the file loads into host caches). options.kv is only reported.
  static std::unique_ptr<Engine> load_prompt_cache(Model& model, const std::string& path, const EngineOptions& options,
                                                   PromptCacheMetadata* metadata = nullptr);

  // ---- one batch
  BatchOutput forward(std::span<const BatchEntry> batch);
  // The last forward's logits, [output rows][vocab] / their greedy choices [output rows] (the largest
  // logit's index, the lowest on ties; computed where the logits are).
  void read_logits(float* host);
  std::vector<float> logits();
  std::vector<int32_t> argmax();

  // ---- reports
  MemoryUsage memory() const;                   // all layers together, and the snapshots kept
  std::vector<MemoryUsage> layer_memory() const;
  std::vector<LayerAttentionReport> attention_report() const;
  StepStats step_stats() const { return model_.device().step_stats(); }
  std::string describe() const { return options_.kv.describe(); }
  // The caches, one per layer (the Python API reads and converts them).
  std::vector<std::unique_ptr<LayerCache>>& caches() { return caches_; }

 private:
  void check_sequence(int seq, const char* what) const;
  // The layers whose cache is a recurrent state (indices into caches_, increasing).
  std::vector<size_t> recurrent_layers() const;

  // Every recurrent layer's state of one sequence at one position: states[i] is layer
  // recurrent_layers()[i]'s. Immutable once taken, so forks share it.
  struct Snapshot {
    std::vector<StateSnapshot> states;  // [recurrent layers]
    int64_t bytes() const;
  };
  using Snapshots = std::map<int, std::shared_ptr<const Snapshot>>;  // position -> the states there
  const Snapshot* snapshot_at(int seq, int length) const;           // null when none is kept there

  Model& model_;
  EngineOptions options_;
  int64_t ctx_ = 0;
  std::vector<std::unique_ptr<LayerCache>> caches_;  // one per layer
  std::vector<AttentionStats> attention_;            // one per layer
  std::vector<int> lengths_;                         // [sequence id]: positions held, -1: no such sequence
  std::map<int, Snapshots> snapshots_;               // sequence id -> its snapshots (absent: none)
  std::set<int> lost_;  // sequences whose recurrent state took in a step that then failed (no snapshot to go back to)
  int alive_ = 0;
  int last_output_rows_ = 0;
  StepLayout step_;
};

}  // namespace tq
