// GpuLlamaModel: weights upload, device buffers and the forward pass (host side; kernels in
// gpu_model_kernels.cu, GEMMs through cuBLAS, attention through DeviceAttention).
#include "cuda/gpu_model.h"

#include <cublas_v2.h>

#include <algorithm>

#include "core/error.h"
#include "core/half.h"
#include "cuda/check.h"
#include "cuda/cuda_backend.h"
#include "cuda/device_cache_impl.h"
#include "cuda/gpu_model_kernels.h"

namespace tq::cuda {
namespace {

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    default: return "cuBLAS error";
  }
}

#define TQ_CUBLAS_CHECK(expr)                                                                                      \
  do {                                                                                                             \
    const cublasStatus_t tq_cublas_status_ = (expr);                                                               \
    if (tq_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                                                \
      ::tq::fail("cuBLAS error in ", #expr, " (", __FILE__, ":", __LINE__, "): ", cublas_status_name(tq_cublas_status_)); \
  } while (0)

// A weight matrix [rows][cols] on the device as BF16.
struct DeviceMatrix {
  DeviceBuffer data;  // BF16 bits [rows][cols]
  int64_t rows = 0, cols = 0;
};

DeviceMatrix upload_bf16(const TensorView* t, const char* what) {
  TQ_CHECK(t != nullptr, "GPU model: the weight ", what, " is missing");
  DeviceMatrix m;
  m.rows = t->shape.size() == 1 ? 1 : t->rows();
  m.cols = t->row_length();
  std::vector<uint16_t> bits(static_cast<size_t>(m.rows * m.cols));  // [rows][cols]
  std::vector<float> row(static_cast<size_t>(m.cols));                // [cols]
  for (int64_t r = 0; r < m.rows; ++r) {
    read_row_f32(*t, r, row.data());
    for (int64_t c = 0; c < m.cols; ++c) bits[static_cast<size_t>(r * m.cols + c)] = f32_to_bf16_bits(row[static_cast<size_t>(c)]);
  }
  m.data.reserve(bits.size() * sizeof(uint16_t));
  m.data.upload(bits.data(), bits.size() * sizeof(uint16_t));
  return m;
}

// Float vector (norm weight or bias) on the device; empty when the tensor is absent.
DeviceBuffer upload_f32(const TensorView* t) {
  DeviceBuffer b;
  if (!t) return b;
  const std::vector<float> v = read_tensor_f32(*t);
  b.reserve(v.size() * sizeof(float));
  b.upload(v.data(), v.size() * sizeof(float));
  return b;
}

}  // namespace

struct GpuLlamaModel::Impl {
  struct Layer {
    DeviceMatrix wq, wk, wv, wo, w_gate, w_up, w_down;
    DeviceBuffer attn_norm, ffn_norm, q_norm, k_norm;  // F32 [hidden] / [head_dim]; q/k norms empty but for Qwen3
    DeviceBuffer bq, bk, bv, bo, b_gate, b_up, b_down; // F32 [rows]; empty when absent
    int window = 0;
    bool fused_path = true;
    std::unique_ptr<DeviceKVCache> cache;
    std::unique_ptr<DeviceAttention> attention = std::make_unique<DeviceAttention>();
  };

  ModelConfig config;
  int hidden = 0, inter = 0, n_heads = 0, n_kv = 0, head_dim = 0, rotary_dim = 0, vocab = 0;
  float eps = 0;
  bool interleaved = false;
  int64_t max_tokens = 0, position_limit = 0;
  std::vector<Layer> layers;
  DeviceMatrix embed, lm_head_own;  // lm_head_own is empty when the embedding is tied
  const DeviceMatrix* lm_head = nullptr;
  DeviceBuffer final_norm;  // F32 [hidden]
  DeviceBuffer inv_freq;    // F32 [rotary_dim / 2]
  int seq = 0;
  int64_t weight_bytes = 0;

  // Activations, sized for the largest n seen so far.
  int capacity = 0;
  DeviceBuffer tokens;         // int32 [n]
  DeviceBuffer x, h, proj;     // F32 [n][hidden]
  DeviceBuffer q, att;         // F32 [n][heads * head_dim]
  DeviceBuffer k, v;           // F32 [n][kv_heads * head_dim]
  DeviceBuffer gate, up;       // F32 [n][intermediate]
  DeviceBuffer gemm_in;        // BF16 [n][max(hidden, heads * head_dim, intermediate)]
  DeviceBuffer logits;         // F32 [n][vocab]
  DeviceBuffer argmax_out;     // int32 [1]
  int64_t last_logits_row = 0; // row of `logits` that holds the last token's logits

  cublasHandle_t cublas = nullptr;

  ~Impl() {
    if (cublas) cublasDestroy(cublas);
  }

  void reserve(int n) {
    if (n <= capacity) return;
    const size_t f = sizeof(float), nn = static_cast<size_t>(n);
    tokens.reserve(nn * sizeof(int32_t));
    x.reserve(nn * hidden * f);
    h.reserve(nn * hidden * f);
    proj.reserve(nn * hidden * f);
    q.reserve(nn * n_heads * head_dim * f);
    att.reserve(nn * n_heads * head_dim * f);
    k.reserve(nn * n_kv * head_dim * f);
    v.reserve(nn * n_kv * head_dim * f);
    gate.reserve(nn * inter * f);
    up.reserve(nn * inter * f);
    gemm_in.reserve(nn * std::max({hidden, n_heads * head_dim, inter}) * sizeof(uint16_t));
    logits.reserve(nn * vocab * f);
    capacity = n;
  }

  // out[n][w.rows] = in[n][w.cols] . W^T (+ bias): cuBLAS in column-major terms computes
  // out^T (rows x n) = W (rows x cols, stored as the column-major cols x rows matrix, transposed) . in^T.
  void linear(const DeviceMatrix& w, const float* in, int n, float* out, const DeviceBuffer& bias) {
    model_kernels::to_bf16(in, static_cast<int64_t>(n) * w.cols, gemm_in.as<uint16_t>(), nullptr);
    const float alpha = 1.0f, beta = 0.0f;
    TQ_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), n, static_cast<int>(w.cols), &alpha,
                                 w.data.get(), CUDA_R_16BF, static_cast<int>(w.cols), gemm_in.get(), CUDA_R_16BF,
                                 static_cast<int>(w.cols), &beta, out, CUDA_R_32F, static_cast<int>(w.rows), CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
    if (bias.get()) model_kernels::add_bias(out, bias.as<float>(), n, static_cast<int>(w.rows), nullptr);
  }
};

GpuLlamaModel::GpuLlamaModel(const LlamaModel& cpu_model, const KVSettings& kv, int64_t max_tokens)
    : impl_(std::make_unique<Impl>()) {
  std::string reason;
  TQ_CHECK(device_available(&reason), "GPU model: no usable CUDA device (", reason, ")");
  Impl& m = *impl_;
  const ModelConfig& c = cpu_model.config();
  m.config = c;
  m.hidden = static_cast<int>(c.hidden_size);
  m.inter = static_cast<int>(c.intermediate_size);
  m.n_heads = static_cast<int>(c.num_attention_heads);
  m.n_kv = static_cast<int>(c.num_key_value_heads);
  m.head_dim = static_cast<int>(c.head_dim);
  m.vocab = static_cast<int>(c.vocab_size);
  m.eps = static_cast<float>(c.rms_norm_eps);
  m.max_tokens = max_tokens;
  m.position_limit = cpu_model.position_limit() > 0 ? cpu_model.position_limit() : c.max_position_embeddings;
  TQ_CHECK(max_tokens >= 1, "GPU model: max_tokens must be positive, got ", max_tokens);
  TQ_CHECK(c.hidden_act == "silu", "GPU model: hidden_act ", c.hidden_act, " is not supported (silu only)");

  const ops::RopeTable& rope = cpu_model.rope();
  m.rotary_dim = rope.rotary_dim();
  m.interleaved = rope.layout() == ops::RopeLayout::interleaved;
  m.inv_freq.reserve(rope.inv_freq().size() * sizeof(float));
  m.inv_freq.upload(rope.inv_freq().data(), rope.inv_freq().size() * sizeof(float));

  TQ_CUBLAS_CHECK(cublasCreate(&m.cublas));
  // FP32 accumulation of BF16 products; no reduced-precision reductions.
  TQ_CUBLAS_CHECK(cublasSetMathMode(m.cublas, CUBLAS_DEFAULT_MATH));

  const ModelWeights& w = cpu_model.files().weights;
  m.embed = upload_bf16(w.embed, "embed_tokens");
  if (w.lm_head == w.embed) {
    m.lm_head = &m.embed;
  } else {
    m.lm_head_own = upload_bf16(w.lm_head, "lm_head");
    m.lm_head = &m.lm_head_own;
  }
  m.final_norm = upload_f32(w.final_norm);
  const KVCacheOptions full = kv.cache_options();
  const bool dense = !kv.compressed();
  DeviceCacheCapacity capacity;
  capacity.max_sequences = 1;
  capacity.max_tokens = max_tokens;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    Impl::Layer L;
    L.wq = upload_bf16(lw.wq, "q_proj");
    L.wk = upload_bf16(lw.wk, "k_proj");
    L.wv = upload_bf16(lw.wv, "v_proj");
    L.wo = upload_bf16(lw.wo, "o_proj");
    L.w_gate = upload_bf16(lw.w_gate, "gate_proj");
    L.w_up = upload_bf16(lw.w_up, "up_proj");
    L.w_down = upload_bf16(lw.w_down, "down_proj");
    L.attn_norm = upload_f32(lw.attn_norm);
    L.ffn_norm = upload_f32(lw.ffn_norm);
    L.q_norm = upload_f32(lw.q_norm);
    L.k_norm = upload_f32(lw.k_norm);
    L.bq = upload_f32(lw.bq);
    L.bk = upload_f32(lw.bk);
    L.bv = upload_f32(lw.bv);
    L.bo = upload_f32(lw.bo);
    L.b_gate = upload_f32(lw.b_gate);
    L.b_up = upload_f32(lw.b_up);
    L.b_down = upload_f32(lw.b_down);
    KVCacheOptions o = full;
    if (c.uses_sliding_window(l) && c.sliding_window) {
      // As build_prompt_cache: sliding-window layers keep dense FP16 caches. The device cache keeps every
      // position; the window is applied by the attention.
      L.window = static_cast<int>(*c.sliding_window);
      o = KVCacheOptions{};
      o.block_tokens = kv.block_tokens;
    }
    L.fused_path = kv.fused || dense || L.window > 0;
    try {
      L.cache = std::make_unique<DeviceKVCache>(m.n_kv, m.head_dim, o, capacity);
    } catch (const Error& e) {
      fail("GPU model: the KV cache ", kv.describe(), " cannot live on the device: ", e.what());
    }
    m.seq = L.cache->add_sequence();  // the same id in every layer (each cache starts empty)
    m.layers.push_back(std::move(L));
  }
  for (const Impl::Layer& L : m.layers) {
    for (const DeviceMatrix* d : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down})
      m.weight_bytes += static_cast<int64_t>(d->data.bytes());
  }
  m.weight_bytes += static_cast<int64_t>(m.embed.data.bytes() + m.lm_head_own.data.bytes());
  m.argmax_out.reserve(sizeof(int32_t));
  TQ_CUDA_CHECK(cudaDeviceSynchronize());
}

GpuLlamaModel::~GpuLlamaModel() = default;

void GpuLlamaModel::reset() {
  // Every layer drops the old sequence and starts a new one; the caches hand out the same new id.
  const int old_seq = impl_->seq;
  int new_seq = -1;
  for (Impl::Layer& L : impl_->layers) {
    L.cache->remove_sequence(old_seq);
    const int id = L.cache->add_sequence();
    TQ_CHECK(new_seq < 0 || id == new_seq, "GPU model: layer caches disagree on the new sequence id");
    new_seq = id;
  }
  impl_->seq = new_seq;
}

int GpuLlamaModel::length() const { return impl_->layers.empty() ? 0 : impl_->layers[0].cache->length(impl_->seq); }

int64_t GpuLlamaModel::vocab_size() const { return impl_->vocab; }

std::string GpuLlamaModel::describe() const {
  return impl_->layers.empty() ? std::string("no layers") : impl_->layers.back().cache->describe();
}

int64_t GpuLlamaModel::weight_bytes() const { return impl_->weight_bytes; }

int64_t GpuLlamaModel::cache_device_bytes() const {
  int64_t b = 0;
  for (const Impl::Layer& L : impl_->layers) b += L.cache->device_bytes();
  return b;
}

MemoryUsage GpuLlamaModel::cache_memory() const {
  MemoryUsage total;
  for (const Impl::Layer& L : impl_->layers) {
    const MemoryUsage u = L.cache->memory();
    total.sink_tokens += u.sink_tokens;
    total.main_tokens += u.main_tokens;
    total.sink_bytes += u.sink_bytes;
    total.main_bytes += u.main_bytes;
    total.allocated_bytes += u.allocated_bytes;
    total.fp16_bytes += u.fp16_bytes;
  }
  return total;
}

void GpuLlamaModel::forward(const int32_t* tokens, int n, int pos0, float* logits_host, bool all_logits) {
  Impl& m = *impl_;
  TQ_CHECK(n >= 1, "GPU forward needs at least one token");
  TQ_CHECK(pos0 == length(), "GPU forward at position ", pos0, " but the caches hold ", length(), " positions");
  TQ_CHECK(pos0 + n <= m.max_tokens, "GPU forward: positions up to ", pos0 + n, " exceed the device caches' ", m.max_tokens);
  TQ_CHECK(m.position_limit <= 0 || pos0 + n <= m.position_limit, "positions up to ", pos0 + n, " exceed the model's context of ",
           m.position_limit, " tokens");
  for (int i = 0; i < n; ++i)
    TQ_CHECK(tokens[i] >= 0 && tokens[i] < m.vocab, "token id ", tokens[i], " is outside the vocabulary (", m.vocab, ")");
  m.reserve(n);
  const int64_t nn = n;

  m.tokens.upload(tokens, nn * sizeof(int32_t));
  model_kernels::embed(m.embed.data.as<uint16_t>(), m.tokens.as<int32_t>(), n, m.hidden, m.x.as<float>(), nullptr);

  for (Impl::Layer& L : m.layers) {
    model_kernels::rms_norm_rows(m.x.as<float>(), L.attn_norm.as<float>(), m.eps, nn, m.hidden, m.h.as<float>(), nullptr);
    m.linear(L.wq, m.h.as<float>(), n, m.q.as<float>(), L.bq);
    m.linear(L.wk, m.h.as<float>(), n, m.k.as<float>(), L.bk);
    m.linear(L.wv, m.h.as<float>(), n, m.v.as<float>(), L.bv);
    if (L.q_norm.get()) {
      model_kernels::rms_norm_rows(m.q.as<float>(), L.q_norm.as<float>(), m.eps, nn * m.n_heads, m.head_dim, m.q.as<float>(), nullptr);
      model_kernels::rms_norm_rows(m.k.as<float>(), L.k_norm.as<float>(), m.eps, nn * m.n_kv, m.head_dim, m.k.as<float>(), nullptr);
    }
    model_kernels::rope(m.q.as<float>(), n, m.n_heads, m.head_dim, m.rotary_dim, m.interleaved, m.inv_freq.as<float>(), pos0, nullptr);
    model_kernels::rope(m.k.as<float>(), n, m.n_kv, m.head_dim, m.rotary_dim, m.interleaved, m.inv_freq.as<float>(), pos0, nullptr);
    const DeviceKVCache::Span span{m.seq, n};
    L.cache->append_device({&span, 1}, m.k.as<float>(), m.v.as<float>(), nullptr);
    AttentionParams p;
    p.n_heads = m.n_heads;
    p.window = L.window;
    const DeviceAttentionRequest r{m.seq, m.q.as<float>(), n, pos0, m.att.as<float>()};
    L.attention->plan(*L.cache, {&r, 1}, p, L.fused_path ? AttentionPath::fused : AttentionPath::standard, nullptr);
    L.attention->run(nullptr);
    m.linear(L.wo, m.att.as<float>(), n, m.proj.as<float>(), L.bo);
    model_kernels::add_inplace(m.x.as<float>(), m.proj.as<float>(), nn * m.hidden, nullptr);

    model_kernels::rms_norm_rows(m.x.as<float>(), L.ffn_norm.as<float>(), m.eps, nn, m.hidden, m.h.as<float>(), nullptr);
    m.linear(L.w_gate, m.h.as<float>(), n, m.gate.as<float>(), L.b_gate);
    m.linear(L.w_up, m.h.as<float>(), n, m.up.as<float>(), L.b_up);
    model_kernels::swiglu(m.gate.as<float>(), m.up.as<float>(), nn * m.inter, nullptr);
    m.linear(L.w_down, m.gate.as<float>(), n, m.proj.as<float>(), L.b_down);
    model_kernels::add_inplace(m.x.as<float>(), m.proj.as<float>(), nn * m.hidden, nullptr);
  }

  const int first = all_logits ? 0 : n - 1;
  const int rows = n - first;
  const float* last_x = m.x.as<float>() + static_cast<int64_t>(first) * m.hidden;
  model_kernels::rms_norm_rows(last_x, m.final_norm.as<float>(), m.eps, rows, m.hidden, m.h.as<float>(), nullptr);
  m.linear(*m.lm_head, m.h.as<float>(), rows, m.logits.as<float>(), DeviceBuffer());
  m.last_logits_row = rows - 1;
  if (logits_host) {
    TQ_CUDA_CHECK(cudaMemcpy(logits_host, m.logits.get(), static_cast<size_t>(rows) * m.vocab * sizeof(float), cudaMemcpyDeviceToHost));
  }
  TQ_CUDA_CHECK(cudaDeviceSynchronize());
}

int32_t GpuLlamaModel::argmax() const {
  const Impl& m = *impl_;
  TQ_CHECK(m.capacity > 0, "GPU argmax before any forward");
  model_kernels::argmax(m.logits.as<float>() + m.last_logits_row * m.vocab, m.vocab, m.argmax_out.as<int32_t>(), nullptr);
  int32_t id = 0;
  TQ_CUDA_CHECK(cudaMemcpy(&id, m.argmax_out.get(), sizeof(int32_t), cudaMemcpyDeviceToHost));
  return id;
}

}  // namespace tq::cuda
