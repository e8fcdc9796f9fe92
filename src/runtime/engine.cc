#include "runtime/engine.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "core/error.h"
#include "runtime/memory_plan.h"

namespace tq {

// ------------------------------------------------------------------ Model

Model::Model(ModelFiles files, Device& device)
    : files_(std::make_unique<ModelFiles>(std::move(files))), device_(device), arch_(build_architecture(*files_, device)) {}

std::unique_ptr<Model> Model::open(const std::string& path, Device& device) { return std::make_unique<Model>(open_model(path), device); }

std::string Model::weights_dtype() const {
  const ModelWeights& w = files_->weights;
  const TensorView* t = w.layers.empty() ? w.embed : w.layers[0].wq;
  return t ? dtype_name(t->dtype) : "none";
}

ModelFingerprint Model::fingerprint() const { return model_fingerprint(architecture_name(config().arch), layer_specs()); }

int64_t Model::file_weight_bytes() const { return file_tensor_bytes(files_->tensors()); }

// ------------------------------------------------------------------ Engine

namespace {

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / 1048576.0);
  return buf;
}

}  // namespace

Engine::Engine(Model& model, const EngineOptions& options) : model_(model), options_(options) {
  Device& dev = model.device();
  TQ_CHECK(options.max_sequences >= 1, "an engine needs room for at least one sequence, got ", options.max_sequences);
  TQ_CHECK(options.ctx_size >= 0, "the context size must not be negative, got ", options.ctx_size);
  TQ_CHECK(options.kv_pool_bytes >= 0, "the KV pool size must not be negative, got ", options.kv_pool_bytes);
  ctx_ = options.ctx_size > 0 ? options.ctx_size : model.position_limit();
  TQ_CHECK(ctx_ >= 1, "the model has no context length (max_position_embeddings); give a context size");
  TQ_CHECK(ctx_ <= model.position_limit(), "a context of ", ctx_, " positions is longer than the model's ", model.position_limit());

  const std::vector<LayerSpec> specs = model.layer_specs();
  // The memory plan computes a run's caches from the same options and sizes (runtime/memory_plan.h); the
  // default --kv-center centres only where the device's caches implement it.
  std::vector<KVCacheOptions> layer_options = engine_cache_options(specs, options.kv, dev.default_block_tokens(), dev.kv_centring());
  const int64_t bytes_per_position = kv_bytes_per_position(specs, layer_options);  // main tiers of all layers, the means counted
  // The pool: the same number of positions in every layer.
  CacheCapacity capacity;
  capacity.max_sequences = options.max_sequences;
  TQ_CHECK(options.kv_pool_tokens >= 0, "the KV pool size must not be negative, got ", options.kv_pool_tokens);
  if (options.kv_pool_tokens > 0) {
    capacity.max_tokens = options.kv_pool_tokens;
  } else if (options.kv_pool_bytes > 0) {
    capacity.max_tokens = std::max<int64_t>(1, options.kv_pool_bytes / std::max<int64_t>(1, bytes_per_position));
  } else if (dev.preallocates_caches()) {
    capacity.max_tokens = static_cast<int64_t>(options.max_sequences) * ctx_;
  }
  for (size_t l = 0; l < specs.size(); ++l) {
    if (specs[l].kind == LayerKind::linear_attention) {
      caches_.push_back(dev.state_cache(specs[l].state, capacity));
      continue;
    }
    KVCacheOptions& o = layer_options[l];
    CacheCapacity layer_capacity = capacity;
    if (capacity.max_tokens > 0) {
      // Whole blocks: the positions asked for wherever the sequences end (each may leave a block partly
      // filled), so that the pool holds them in any split among its sequences.
      o.max_blocks = pool_blocks(capacity.max_tokens, options.max_sequences, o.block_tokens);
      layer_capacity.max_tokens = o.max_blocks * o.block_tokens;
    }
    // A dense rotating cache attends on the fused path whatever the flag; a compressed one (--kv-swa-compress)
    // follows it like the full layers.
    const bool fused = options.kv.fused;
    caches_.push_back(dev.kv_cache(specs[l].n_kv_heads, specs[l].head_dim, o, fused, layer_capacity));
  }
  attention_.resize(caches_.size());
}

Engine::Engine(Model& model, std::vector<std::unique_ptr<LayerCache>> caches, const EngineOptions& options)
    : model_(model), options_(options), caches_(std::move(caches)) {
  TQ_CHECK(options.max_sequences >= 1, "an engine needs room for at least one sequence, got ", options.max_sequences);
  ctx_ = options.ctx_size > 0 ? options.ctx_size : model.position_limit();
  const size_t layers = model.layer_specs().size();
  TQ_CHECK(caches_.size() == layers, "the model has ", layers, " layers, the caches given ", caches_.size());
  const std::vector<int> ids = caches_.empty() ? std::vector<int>{} : caches_[0]->sequences();
  for (size_t l = 0; l < caches_.size(); ++l) {
    TQ_CHECK(caches_[l]->sequences() == ids, "the caches given hold different sequences in layer 0 and layer ", l);
    for (int id : ids)
      TQ_CHECK(caches_[l]->length(id) == caches_[0]->length(id), "sequence ", id, " holds ", caches_[0]->length(id), " positions in layer 0 and ",
               caches_[l]->length(id), " in layer ", l);
  }
  for (int id : ids) {
    if (static_cast<size_t>(id) >= lengths_.size()) lengths_.resize(static_cast<size_t>(id) + 1, -1);
    lengths_[static_cast<size_t>(id)] = caches_[0]->length(id);
  }
  alive_ = static_cast<int>(ids.size());
  TQ_CHECK(alive_ <= options.max_sequences, "the caches given hold ", alive_, " sequences, more than the ", options.max_sequences, " allowed");
  attention_.resize(caches_.size());
}

void Engine::check_sequence(int seq, const char* what) const {
  TQ_CHECK(has_sequence(seq), what, ": sequence ", seq, " does not exist (never added, or removed)");
}

bool Engine::has_sequence(int seq) const { return seq >= 0 && static_cast<size_t>(seq) < lengths_.size() && lengths_[seq] >= 0; }

int Engine::length(int seq) const {
  check_sequence(seq, "length");
  return lengths_[static_cast<size_t>(seq)];
}

std::vector<int> Engine::sequences() const {
  std::vector<int> ids;
  for (size_t i = 0; i < lengths_.size(); ++i)
    if (lengths_[i] >= 0) ids.push_back(static_cast<int>(i));
  return ids;
}

int Engine::add_sequence() {
  TQ_CHECK(alive_ < options_.max_sequences, "the engine holds at most ", options_.max_sequences,
           " sequences at once; remove one first");
  int id = 0;
  while (has_sequence(id)) ++id;
  for (auto& c : caches_) c->add_sequence_with_id(id);
  if (static_cast<size_t>(id) >= lengths_.size()) lengths_.resize(static_cast<size_t>(id) + 1, -1);
  lengths_[static_cast<size_t>(id)] = 0;
  ++alive_;
  return id;
}

void Engine::remove_sequence(int seq) {
  check_sequence(seq, "remove");
  for (auto& c : caches_) c->remove_sequence(seq);
  lengths_[static_cast<size_t>(seq)] = -1;
  snapshots_.erase(seq);
  lost_.erase(seq);
  --alive_;
}

int Engine::fork_sequence(int parent, bool copy) {
  check_sequence(parent, "fork");
  TQ_CHECK(alive_ < options_.max_sequences, "cannot fork sequence ", parent, ": the engine holds at most ", options_.max_sequences,
           " sequences at once");
  int id = 0;
  while (has_sequence(id)) ++id;
  size_t done = 0;
  try {
    for (; done < caches_.size(); ++done) caches_[done]->fork_sequence(parent, id, copy);
  } catch (...) {
    for (size_t l = 0; l < done; ++l) caches_[l]->remove_sequence(id);
    throw;
  }
  if (static_cast<size_t>(id) >= lengths_.size()) lengths_.resize(static_cast<size_t>(id) + 1, -1);
  lengths_[static_cast<size_t>(id)] = lengths_[static_cast<size_t>(parent)];
  if (auto it = snapshots_.find(parent); it != snapshots_.end()) snapshots_[id] = it->second;  // shared pointers: no copy
  if (lost_.count(parent)) lost_.insert(id);  // the same lost state (fork_sequence_at may restore a snapshot)
  ++alive_;
  return id;
}

int Engine::fork_sequence_at(int parent, int length) {
  check_sequence(parent, "fork");
  // The child would hold what the parent holds, so what stops the parent's truncation stops the child's.
  const std::string problem = truncate_problem(parent, length);
  TQ_CHECK(problem.empty(), "cannot fork sequence ", parent, " at ", length, " positions: ", problem);
  const int child = fork_sequence(parent);
  truncate(child, length);
  return child;
}

std::vector<size_t> Engine::recurrent_layers() const {
  std::vector<size_t> layers;
  for (size_t l = 0; l < caches_.size(); ++l)
    if (dynamic_cast<const RecurrentStateCache*>(caches_[l].get())) layers.push_back(l);
  return layers;
}

int64_t Engine::Snapshot::bytes() const {
  int64_t b = 0;
  for (const StateSnapshot& s : states) b += s.bytes();
  return b;
}

void Engine::snapshot(int seq) {
  check_sequence(seq, "snapshot");
  const std::vector<size_t> layers = recurrent_layers();
  if (layers.empty()) return;  // every layer truncates to any position: nothing to keep
  auto snap = std::make_shared<Snapshot>();
  for (size_t l : layers) snap->states.push_back(static_cast<const RecurrentStateCache&>(*caches_[l]).snapshot(seq));
  snapshots_[seq][lengths_[static_cast<size_t>(seq)]] = std::move(snap);
}

std::vector<int> Engine::snapshot_positions(int seq) const {
  check_sequence(seq, "snapshot positions");
  std::vector<int> positions;
  if (auto it = snapshots_.find(seq); it != snapshots_.end())
    for (const auto& [pos, snap] : it->second) positions.push_back(pos);
  return positions;
}

std::string Engine::truncate_problem(int seq, int length) const {
  check_sequence(seq, "truncate");
  const int held = lengths_[static_cast<size_t>(seq)];
  std::ostringstream os;
  if (length < 0 || length > held) {
    os << "cannot truncate sequence " << seq << " to " << length << " positions: it holds " << held;
    return os.str();
  }
  const std::vector<size_t> recurrent = recurrent_layers();
  if (length < held && !recurrent.empty() && !snapshot_at(seq, length)) {
    const std::vector<int> kept = snapshot_positions(seq);
    os << "cannot truncate sequence " << seq << " from " << held << " to " << length << " positions: its " << recurrent.size()
       << " recurrent layers hold no earlier positions and go back only to a snapshot, and none was kept at " << length;
    if (kept.empty()) os << " (it has no snapshots)";
    for (size_t i = 0; i < kept.size(); ++i) os << (i ? ", " : " (it has snapshots at ") << kept[i] << (i + 1 == kept.size() ? ")" : "");
    return os.str();
  }
  // The KV layers (a rotating cache's window); the recurrent ones are restored, not truncated.
  for (size_t l = 0; l < caches_.size(); ++l) {
    if (std::find(recurrent.begin(), recurrent.end(), l) != recurrent.end()) continue;
    std::string problem = caches_[l]->truncate_problem(seq, length);
    if (!problem.empty()) return problem;
  }
  return "";
}

const Engine::Snapshot* Engine::snapshot_at(int seq, int length) const {
  const auto it = snapshots_.find(seq);
  if (it == snapshots_.end()) return nullptr;
  const auto at = it->second.find(length);
  return at == it->second.end() ? nullptr : at->second.get();
}

void Engine::truncate(int seq, int length) {
  // Every layer first says whether it can (a rotating cache's window, a recurrent state's snapshot); then
  // all go back together.
  const std::string problem = truncate_problem(seq, length);
  TQ_CHECK(problem.empty(), problem);
  const int held = lengths_[static_cast<size_t>(seq)];
  const std::vector<size_t> recurrent = recurrent_layers();
  const Snapshot* snap = length < held ? snapshot_at(seq, length) : nullptr;
  for (size_t l = 0, r = 0; l < caches_.size(); ++l) {
    if (r < recurrent.size() && recurrent[r] == l) {
      if (snap) static_cast<RecurrentStateCache&>(*caches_[l]).restore(seq, snap->states[r]);
      ++r;
      continue;
    }
    caches_[l]->truncate(seq, length);
  }
  lengths_[static_cast<size_t>(seq)] = length;
  if (snap) lost_.erase(seq);  // its states are the snapshot's again
  if (auto it = snapshots_.find(seq); it != snapshots_.end()) {
    // Positions past the new length will be written again, by other tokens perhaps.
    it->second.erase(it->second.upper_bound(length), it->second.end());
    if (it->second.empty()) snapshots_.erase(it);
  }
}

void Engine::save_prompt_cache(const std::string& path, const PromptCacheMetadata& metadata) const {
  tq::save_prompt_cache(path, caches_, model_.fingerprint(), metadata);
}

std::unique_ptr<Engine> Engine::load_prompt_cache(Model& model, const std::string& path, const EngineOptions& options,
                                                  PromptCacheMetadata* metadata) {
  TQ_CHECK(!model.device().is_cuda(), "cannot load the prompt cache file '", path, "' on ", model.device().name(),
           ": its caches load into host memory, for the CPU");
  LoadedPromptCache loaded = tq::load_prompt_cache(path, model.fingerprint());
  if (metadata) *metadata = std::move(loaded.metadata);
  return std::make_unique<Engine>(model, std::move(loaded.caches), options);
}

BatchOutput Engine::forward(std::span<const BatchEntry> batch) {
  TQ_CHECK(!batch.empty(), "a batch needs at least one entry");
  const int64_t vocab = model_.vocab_size();
  // Everything is checked before anything changes.
  std::set<int> seen;
  std::vector<SequenceGrowth> growth;
  for (const BatchEntry& e : batch) {
    check_sequence(e.seq, "forward");
    TQ_CHECK(!lost_.count(e.seq), "sequence ", e.seq, "'s recurrent state was lost when an earlier step failed on the way ",
             "(no snapshot was kept at its length): truncate it to a snapshot, or remove it and start again");
    TQ_CHECK(seen.insert(e.seq).second, "sequence ", e.seq, " appears twice in one batch");
    TQ_CHECK(!e.tokens.empty(), "the batch entry of sequence ", e.seq, " has no tokens");
    const int held = lengths_[static_cast<size_t>(e.seq)];
    TQ_CHECK(e.pos0 < 0 || e.pos0 == held, "sequence ", e.seq, " holds ", held, " positions: a batch entry at position ", e.pos0,
             e.pos0 > held ? " would leave a gap" : " would overwrite it (truncate first)");
    TQ_CHECK(held + static_cast<int64_t>(e.tokens.size()) <= ctx_, "sequence ", e.seq, " would reach ", held + e.tokens.size(),
             " positions, more than the context of ", ctx_);
    for (int32_t t : e.tokens) TQ_CHECK(t >= 0 && t < vocab, "token id ", t, " is outside the vocabulary (", vocab, ")");
    growth.push_back({e.seq, static_cast<int>(e.tokens.size())});
  }
  for (size_t l = 0; l < caches_.size(); ++l) {
    const BlockDemand d = caches_[l]->demand(growth);
    if (d.needed <= d.available) continue;
    fail("the batch needs ", d.needed, " more KV blocks in layer ", l, " (", mib(static_cast<double>(d.needed * d.block_bytes)),
         "), but the KV pool has ", d.available, " free (", mib(static_cast<double>(d.available * d.block_bytes)), ") of ", d.capacity,
         " (", mib(static_cast<double>(d.capacity * d.block_bytes)), "); finish or remove sequences, or give a larger pool");
  }

  step_ = StepLayout{};
  BatchOutput out;
  for (const BatchEntry& e : batch) {
    const int row0 = step_.rows();
    step_.add(e.seq, e.tokens, lengths_[static_cast<size_t>(e.seq)]);
    const int n = static_cast<int>(e.tokens.size());
    const int first = e.logits == Logits::all ? 0 : n - 1;
    const int count = e.logits == Logits::none ? 0 : n - first;
    out.first_row.push_back(count ? out.total : -1);
    out.rows.push_back(count);
    for (int i = 0; i < count; ++i) step_.output_rows.push_back(row0 + first + i);
    out.total += count;
  }
  Device& dev = model_.device();
  try {
    dev.run_step(step_, [&] { model_.architecture().forward(dev, caches_, &attention_); });
  } catch (...) {
    // A step that failed on the way leaves every KV layer as it was before the batch. A recurrent state
    // that already took the batch in cannot go back unless a snapshot was kept at the old length; without
    // one the sequence is marked lost (every later use of it is refused, naming the cause) rather than left
    // to continue from a wrong state. The original error propagates.
    const std::vector<size_t> recurrent = recurrent_layers();
    for (const BatchEntry& e : batch) {
      const int before = lengths_[static_cast<size_t>(e.seq)];
      const Snapshot* snap = snapshot_at(e.seq, before);
      for (size_t l = 0, r = 0; l < caches_.size(); ++l) {
        LayerCache& c = *caches_[l];
        const bool is_state = r < recurrent.size() && recurrent[r] == l;
        if (c.has_sequence(e.seq) && c.length(e.seq) > before) {
          if (!is_state) {
            c.truncate(e.seq, before);
          } else if (snap) {
            static_cast<RecurrentStateCache&>(c).restore(e.seq, snap->states[r]);
          } else {
            lost_.insert(e.seq);
          }
        }
        if (is_state) ++r;
      }
    }
    throw;
  }
  for (const BatchEntry& e : batch) lengths_[static_cast<size_t>(e.seq)] += static_cast<int>(e.tokens.size());
  last_output_rows_ = out.total;
  return out;
}

void Engine::read_logits(float* host) {
  TQ_CHECK(last_output_rows_ > 0, "the last batch asked for no logits");
  model_.device().read_logits(host);
}

std::vector<float> Engine::logits() {
  std::vector<float> v(static_cast<size_t>(last_output_rows_) * static_cast<size_t>(model_.vocab_size()));
  read_logits(v.data());
  return v;
}

std::vector<int32_t> Engine::argmax() {
  TQ_CHECK(last_output_rows_ > 0, "the last batch asked for no logits");
  std::vector<int32_t> ids(static_cast<size_t>(last_output_rows_));
  model_.device().argmax_logits(ids.data());
  return ids;
}

MemoryUsage Engine::memory() const {
  MemoryUsage total;
  for (const auto& c : caches_) total += c->memory();
  // A snapshot that forks share is held once.
  std::set<const Snapshot*> counted;
  for (const auto& [seq, snaps] : snapshots_)
    for (const auto& [pos, snap] : snaps)
      if (counted.insert(snap.get()).second) total.snapshot_bytes += snap->bytes();
  return total;
}

std::vector<MemoryUsage> Engine::layer_memory() const {
  std::vector<MemoryUsage> m;
  for (const auto& c : caches_) m.push_back(c->memory());
  return m;
}

std::vector<LayerAttentionReport> Engine::attention_report() const {
  std::vector<LayerAttentionReport> r(caches_.size());
  for (size_t l = 0; l < caches_.size(); ++l) r[l] = {caches_[l]->describe(), attention_[l]};
  return r;
}

}  // namespace tq
