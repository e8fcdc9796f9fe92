#include "runtime/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "cuda/cache_size.h"
#include "model/architecture.h"

namespace tq {

std::vector<KVCacheOptions> engine_cache_options(const std::vector<LayerSpec>& specs, const KVSettings& kv, int default_block_tokens,
                                                 bool default_centring) {
  const KVCacheOptions full = kv.cache_options(default_block_tokens, default_centring);
  std::vector<KVCacheOptions> options;
  options.reserve(specs.size());
  for (const LayerSpec& l : specs) {
    if (l.kind == LayerKind::linear_attention) {
      // A recurrent layer's state has a fixed size per sequence: nothing per position in the pool.
      options.emplace_back();
    } else if (l.kind == LayerKind::sliding_attention) {
      options.push_back(kv.sliding_cache_options(l.window, default_block_tokens, default_centring));
    } else {
      options.push_back(full);
    }
  }
  return options;
}

int64_t kv_bytes_per_position(const std::vector<LayerSpec>& specs, const std::vector<KVCacheOptions>& options) {
  TQ_CHECK(specs.size() == options.size(), "internal error: ", specs.size(), " layers but ", options.size(), " cache options");
  int64_t bytes = 0;
  for (size_t l = 0; l < specs.size(); ++l) {
    if (specs[l].kind == LayerKind::linear_attention) continue;
    bytes += kv_layer_size(specs[l].n_kv_heads, specs[l].head_dim, options[l]).pool_bytes_per_token();
  }
  return bytes;
}

int64_t pool_blocks(int64_t tokens, int max_sequences, int block_tokens) {
  const int64_t T = block_tokens;
  return (tokens + (static_cast<int64_t>(max_sequences) - 1) * (T - 1) + T - 1) / T;
}

namespace {

// One attention layer's cache replayed over the appends: the block table of each sequence as KVCache keeps
// it (the first block's position, the blocks held), the pool's blocks in use at their peak.
MemoryUsage replay_kv_layer(const KVLayerSize& z, int sequences, const std::vector<int64_t>& appends) {
  struct Seq {
    int64_t length = 0, first_block_pos = 0, blocks = 0;
  };
  std::vector<Seq> seqs(static_cast<size_t>(sequences));
  for (Seq& s : seqs) s.first_block_pos = z.min_tokens;  // KVCache::add_sequence_with_id
  const int64_t M = z.min_tokens, T = z.block_tokens;
  int64_t in_use = 0, peak = 0;
  for (int64_t n : appends) {
    for (Seq& s : seqs) {
      // KVCache::append: blocks out of the window go back first, then positions are written one by one.
      const int drop = rotating_blocks_to_drop(s.first_block_pos, s.blocks, s.length, z.window, z.block_tokens);
      s.blocks -= drop;
      s.first_block_pos += drop * T;
      in_use -= drop;
      const int64_t end = s.length + n;
      if (end > M) {
        const int64_t need = (end - 1 - s.first_block_pos) / T + 1;  // main_block: block (pos - first_block_pos) / T
        if (need > s.blocks) {
          in_use += need - s.blocks;
          s.blocks = need;
        }
      }
      s.length = end;
      peak = std::max(peak, in_use);
    }
  }
  // KVCache::memory
  MemoryUsage m;
  m.blocks_in_use = in_use;
  m.block_bytes = z.block_bytes;
  for (const Seq& s : seqs) {
    m.sink_tokens += std::min(s.length, M);
    m.main_tokens += std::max<int64_t>(0, s.length - std::max(M, s.first_block_pos));
    if (s.length > 0 && M > 0) m.allocated_bytes += z.sink_reserved_bytes;  // reserved at the first position
    // Centred: the FP16 filling run, reserved at the first main-tier position (the grid starts a run there).
    if (s.length > M) m.allocated_bytes += z.tail_reserved_bytes;
    m.main_bytes += z.main_bytes(std::max<int64_t>(0, s.length - std::max(M, s.first_block_pos)));
  }
  m.sink_bytes = m.sink_tokens * z.sink_bytes_per_token;
  m.allocated_bytes += z.pool_bytes(peak);
  m.fp16_bytes = (m.sink_tokens + m.main_tokens) * 2 * 2 * static_cast<int64_t>(z.n_kv_heads) * z.head_dim;
  return m;
}

}  // namespace

std::vector<MemoryUsage> predict_layer_memory(const std::vector<LayerSpec>& specs, const std::vector<KVCacheOptions>& options,
                                              int sequences, const std::vector<int64_t>& appends) {
  TQ_CHECK(specs.size() == options.size(), "internal error: ", specs.size(), " layers but ", options.size(), " cache options");
  TQ_CHECK(sequences >= 0, "a memory plan needs a non-negative number of sequences, got ", sequences);
  std::vector<MemoryUsage> out;
  out.reserve(specs.size());
  for (size_t l = 0; l < specs.size(); ++l) {
    if (specs[l].kind == LayerKind::linear_attention) {
      // StateCache::memory: every sequence's state, from its first position on and before it.
      MemoryUsage m;
      m.main_bytes = static_cast<int64_t>(sequences) * specs[l].state.bytes_per_sequence();
      m.allocated_bytes = m.main_bytes;
      m.fp16_bytes = m.main_bytes;
      out.push_back(m);
      continue;
    }
    out.push_back(replay_kv_layer(kv_layer_size(specs[l].n_kv_heads, specs[l].head_dim, options[l]), sequences, appends));
  }
  return out;
}

namespace {

// The float32 scratch of one step of `rows` rows, from the layer widths: the residual stream, the normed
// input, q (with Qwen3.5's gate rows), k, v, the attention output, gate, up and their product, for the
// widest layer kind; the DeltaNet's stacked input product (q | k | v | z | b | a) and its output. An
// estimate of the CPU arena (CpuDevice::Arena grows to the largest step; the architecture files take their
// tensors in a model-specific order), not an exact count: it is reported as an estimate.
int64_t activation_estimate(const ModelConfig& c, int64_t rows) {
  const int64_t inter = std::max(c.intermediate_size, c.shared_expert_intermediate_size) *
                        std::max<int64_t>(1, c.num_experts > 0 ? std::min<int64_t>(c.num_experts_per_tok, rows) : 1);
  const int64_t attention = 2 * c.q_dim() * (c.attn_output_gate ? 2 : 1) + 2 * c.kv_dim();
  const int64_t linear = c.linear_layers.empty() ? 0 : 2 * c.linear_conv_dim() + 2 * c.linear_value_dim() + 2 * c.linear_num_value_heads;
  const int64_t per_row = 3 * c.hidden_size + std::max(attention, linear) + 3 * inter;
  return rows * per_row * static_cast<int64_t>(sizeof(float));
}

}  // namespace

namespace {

// The CUDA backend: every cache allocated up front (Engine on a device that preallocates, CudaDevice::kv_cache,
// DeviceKVCache, CudaStateCache), the weights as its BF16 copies (an estimate), its fixed reservations.
MemoryPlan plan_cuda(const PlanRequest& r, MemoryPlan p) {
  p.cuda = true;
  constexpr int kCudaPageTokens = 64;  // CudaDevice::default_block_tokens
  const int max_sequences = r.max_sequences > 0 ? r.max_sequences : r.parallel;
  const int64_t pool_tokens = r.kv_pool_tokens > 0 ? r.kv_pool_tokens : static_cast<int64_t>(max_sequences) * p.context;
  std::vector<KVCacheOptions> options = engine_cache_options(r.layers, r.kv, kCudaPageTokens, cuda::kDeviceKVCentring);
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const LayerSpec& s = r.layers[l];
    MemoryUsage m;
    LayerKindPlan& k = s.kind == LayerKind::full_attention ? p.full : s.kind == LayerKind::sliding_attention ? p.sliding : p.recurrent;
    ++k.layers;
    if (s.kind == LayerKind::linear_attention) {
      // CudaStateCache: a slot per sequence the engine may hold, from the start.
      m.main_bytes = static_cast<int64_t>(r.parallel) * s.state.bytes_per_sequence();
      m.allocated_bytes = static_cast<int64_t>(max_sequences) * s.state.bytes_per_sequence();
      m.fp16_bytes = m.main_bytes;
      k.state_bytes_per_sequence += s.state.bytes_per_sequence();
    } else {
      KVCacheOptions o = options[l];
      o.max_blocks = 0;  // CudaDevice::kv_cache: the pool is bounded by its capacity (a sliding layer's by its window)
      const int64_t blocks = pool_blocks(pool_tokens, max_sequences, o.block_tokens);
      const cuda::DeviceKVLayerSize z = cuda::device_kv_layer_size(s.n_kv_heads, s.head_dim, o, max_sequences, blocks * o.block_tokens);
      const int64_t M = o.min_tokens;
      // A sliding layer holds at most its pages right after the last prompt chunk (an upper bound on the
      // positions its rotating cache keeps); a full layer every position past the sink tier.
      int64_t main = std::max<int64_t>(0, p.context - M);
      if (o.window > 0)
        main = std::min(main, cuda::rotating_pages_per_sequence(o.window, o.block_tokens, std::max(1, r.prefill_chunk)) * o.block_tokens);
      m.sink_tokens = r.parallel * std::min(p.context, M);
      m.main_tokens = r.parallel * main;
      m.sink_bytes = m.sink_tokens * s.n_kv_heads * 2 * 2 * s.head_dim;  // DeviceKVCache::memory
      m.main_bytes = m.main_tokens * z.main_bytes_per_token;
      m.allocated_bytes = z.device_bytes();
      m.blocks_in_use = r.parallel * ((main + o.block_tokens - 1) / o.block_tokens);
      m.block_bytes = z.page_bytes;
      m.fp16_bytes = (m.sink_tokens + m.main_tokens) * 2 * 2 * static_cast<int64_t>(s.n_kv_heads) * s.head_dim;
      k.main_bytes_per_token += z.main_bytes_per_token;
      k.sink_bytes_per_token += static_cast<int64_t>(s.n_kv_heads) * 2 * 2 * s.head_dim;
      k.tokens_held = std::max(k.tokens_held, main);
    }
    k.usage += m;
    p.kv += m;
    p.layers.push_back(m);
  }
  p.logits_bytes = static_cast<int64_t>(r.parallel) * r.config.vocab_size * static_cast<int64_t>(sizeof(float));
  p.activation_bytes = activation_estimate(r.config, std::max<int64_t>(std::min<int64_t>(r.prefill_chunk, p.context), r.parallel));
  p.backend_bytes = (int64_t{32} << 20) + (int64_t{4} << 20);  // CudaDevice: cuBLAS workspace, upload staging
  return p;
}

}  // namespace

int64_t cuda_weight_bytes_estimate(const TensorSet& tensors) {
  auto ends_with = [](const std::string& s, const char* t) {
    const std::string e(t);
    return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
  };
  int64_t bytes = 0;
  for (const TensorView& t : tensors.all()) {
    // CudaDevice::linear refuses TurboQuant weights (no rotated-activation kernels on the GPU yet): so does the plan.
    TQ_CHECK(!ends_with(t.name, ".tq_codes") && !ends_with(t.name, ".tq_scales") && t.dtype != DType::tq2 && t.dtype != DType::tq3 &&
                 t.dtype != DType::tq4,
             tensors.source(), ": tensor '", t.name, "' is a TurboQuant weight plane, which the CUDA backend does not run yet");
    if (t.dtype == DType::u8 || t.dtype == DType::mxfp4) {
      bytes += static_cast<int64_t>(t.nbytes);  // MXFP4 expert planes, kept as they are
    } else if (t.shape.size() >= 2) {
      bytes += t.numel() * 2;  // BF16 rows
    } else {
      bytes += t.numel() * static_cast<int64_t>(sizeof(float));
    }
  }
  return bytes;
}

MemoryPlan plan_memory(const PlanRequest& r) {
  TQ_CHECK(r.parallel >= 1, "a memory plan needs at least one sequence, got ", r.parallel);
  TQ_CHECK(r.context >= 0, "the context size must not be negative, got ", r.context);
  TQ_CHECK(r.prefill_chunk >= 1, "the prefill chunk must be at least one position, got ", r.prefill_chunk);
  MemoryPlan p;
  p.context = r.context > 0 ? r.context : r.config.max_position_embeddings;
  TQ_CHECK(p.context >= 1, r.config.source, ": the model has no context length (max_position_embeddings); give a context size");
  // What Engine refuses (at the model's position limit; benchmarks raise it, a plan does not).
  TQ_CHECK(r.config.max_position_embeddings <= 0 || p.context <= r.config.max_position_embeddings, "a context of ", p.context,
           " positions is longer than the model's ", r.config.max_position_embeddings);
  p.parallel = r.parallel;
  p.weight_bytes = r.weight_bytes;
  if (r.cuda) return plan_cuda(r, p);
  const std::vector<KVCacheOptions> options = engine_cache_options(r.layers, r.kv, r.default_block_tokens,
                                                                   /*default_centring=*/true);  // CpuDevice::kv_centring
  // The prompt in chunks: the most a rotating cache holds at once (its window and a chunk).
  std::vector<int64_t> appends;
  for (int64_t done = 0; done < p.context; done += r.prefill_chunk) appends.push_back(std::min<int64_t>(r.prefill_chunk, p.context - done));
  p.layers = predict_layer_memory(r.layers, options, r.parallel, appends);
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const LayerSpec& s = r.layers[l];
    LayerKindPlan& k = s.kind == LayerKind::full_attention ? p.full : s.kind == LayerKind::sliding_attention ? p.sliding : p.recurrent;
    ++k.layers;
    k.usage += p.layers[l];
    if (s.kind == LayerKind::linear_attention) {
      k.state_bytes_per_sequence += s.state.bytes_per_sequence();
    } else {
      const KVLayerSize z = kv_layer_size(s.n_kv_heads, s.head_dim, options[l]);
      k.main_bytes_per_token += z.pool_bytes_per_token();  // the centring means counted
      k.sink_bytes_per_token += z.sink_bytes_per_token;
      k.tokens_held = std::max(k.tokens_held, p.layers[l].main_tokens / r.parallel);
    }
    p.kv += p.layers[l];
  }
  // One row of logits per sequence (generation), float32 on the CPU.
  p.logits_bytes = static_cast<int64_t>(r.parallel) * r.config.vocab_size * static_cast<int64_t>(sizeof(float));
  // A step's rows: a prompt chunk (the server's batch of --batch-tokens rows in all), or one decode row per
  // sequence when there are more sequences than that.
  p.activation_bytes = activation_estimate(r.config, std::max<int64_t>(std::min<int64_t>(r.prefill_chunk, p.context), r.parallel));
  return p;
}

int64_t largest_context(const PlanRequest& request, int64_t budget_bytes) {
  const int64_t limit = request.config.max_position_embeddings > 0 ? request.config.max_position_embeddings : int64_t{1} << 24;
  PlanRequest r = request;
  auto fits = [&](int64_t ctx) {
    r.context = ctx;
    return plan_memory(r).total_bytes() <= budget_bytes;
  };
  if (!fits(1)) return 0;
  if (fits(limit)) return limit;
  int64_t lo = 1, hi = limit;  // fits(lo), !fits(hi); memory grows with the context
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  TQ_CHECK(in, "cannot read /proc/meminfo to find the available memory; give a memory budget");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;  // kB
  }
  fail("/proc/meminfo has no MemAvailable line; give a memory budget");
}

std::string format_bytes(int64_t bytes) {
  char buf[48];
  const double b = static_cast<double>(bytes);
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  } else if (b < 1048576.0) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024);
  } else if (b < 1073741824.0) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / 1048576);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / 1073741824);
  }
  return buf;
}

std::string memory_refusal(const PlanRequest& request, const MemoryPlan& plan, int64_t budget_bytes, const std::string& budget_source) {
  if (plan.total_bytes() <= budget_bytes) return "";
  std::ostringstream os;
  os << "this run needs " << format_bytes(plan.total_bytes()) << " (" << plan.total_bytes() << " bytes: weights "
     << format_bytes(plan.weight_bytes) << ", KV cache " << format_bytes(plan.kv.allocated_bytes) << " for " << plan.parallel
     << (plan.parallel == 1 ? " sequence" : " sequences") << " of " << plan.context << " positions (" << request.kv.describe()
     << "), workspace about " << format_bytes(plan.workspace_bytes()) << "), more than the " << format_bytes(budget_bytes) << " ("
     << budget_bytes << " bytes) of " << budget_source << "; ";
  const int64_t fits = largest_context(request, budget_bytes);
  if (fits > 0)
    os << "the largest context that fits is " << fits << " positions (--ctx-size), or compress the KV cache (turboquant-plan compares the formats)";
  else
    os << "not even one position fits: the weights alone take " << format_bytes(plan.weight_bytes);
  return os.str();
}

void refuse_unless_fits(const ModelFiles& files, const KVSettings& kv, const FitCheck& check) {
  PlanRequest r;
  r.layers = layer_specs_for(files.config);
  r.config = files.config;
  r.cuda = check.cuda;
  r.weight_bytes = check.cuda ? cuda_weight_bytes_estimate(files.tensors()) : file_tensor_bytes(files.tensors());
  if (check.cuda) r.default_block_tokens = 64;
  r.kv = kv;
  r.context = check.positions;
  r.parallel = check.parallel;
  r.max_sequences = check.max_sequences;
  r.kv_pool_tokens = check.kv_pool_tokens;
  r.prefill_chunk = check.prefill_chunk;
  const MemoryPlan plan = plan_memory(r);
  TQ_CHECK(!check.cuda || check.budget_bytes > 0, "internal error: the GPU memory check needs the GPU's memory");
  const int64_t budget = check.budget_bytes > 0 ? check.budget_bytes : available_memory_bytes();
  const std::string source = !check.budget_source.empty() ? check.budget_source
                             : check.budget_bytes > 0    ? "the memory budget (--memory-budget-mb)"
                                                         : "available memory (MemAvailable, /proc/meminfo)";
  const std::string refusal = memory_refusal(r, plan, budget, source);
  TQ_CHECK(refusal.empty(), refusal);
}

}  // namespace tq
