// GpuLlamaModel: weights upload, device buffers and the forward pass (host side; kernels in
// gpu_model_kernels.cu, GEMMs through cuBLAS, attention through DeviceAttention).
#include "cuda/gpu_model.h"

#include <cublas_v2.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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
  const uint16_t* row(int64_t r) const { return data.as<uint16_t>() + r * cols; }
};

// The matrices stacked by rows into one ([sum of rows][cols]): q/k/v and gate/up share their input, so a
// decode step multiplies by the stack once; longer inputs use its row blocks one by one.
DeviceMatrix upload_bf16_stacked(std::initializer_list<std::pair<const TensorView*, const char*>> parts) {
  DeviceMatrix m;
  for (const auto& [t, what] : parts) {
    TQ_CHECK(t != nullptr, "GPU model: the weight ", what, " is missing");
    const int64_t cols = t->row_length();
    TQ_CHECK(m.cols == 0 || m.cols == cols, "GPU model: ", what, " has rows of ", cols, " values, the matrices it is stacked with ",
             m.cols);
    m.cols = cols;
    m.rows += t->shape.size() == 1 ? 1 : t->rows();
  }
  std::vector<uint16_t> bits(static_cast<size_t>(m.rows * m.cols));  // [rows][cols]
  std::vector<float> row(static_cast<size_t>(m.cols));                // [cols]
  int64_t at = 0;
  for (const auto& [t, what] : parts) {
    const int64_t rows = t->shape.size() == 1 ? 1 : t->rows();
    for (int64_t r = 0; r < rows; ++r, ++at) {
      read_row_f32(*t, r, row.data());
      for (int64_t c = 0; c < m.cols; ++c) bits[static_cast<size_t>(at * m.cols + c)] = f32_to_bf16_bits(row[static_cast<size_t>(c)]);
    }
  }
  m.data.reserve(bits.size() * sizeof(uint16_t));
  m.data.upload(bits.data(), bits.size() * sizeof(uint16_t));
  return m;
}

DeviceMatrix upload_bf16(const TensorView* t, const char* what) { return upload_bf16_stacked({{t, what}}); }

// Float vector (norm weight or bias) on the device; empty when the tensor is absent.
DeviceBuffer upload_f32(const TensorView* t) {
  DeviceBuffer b;
  if (!t) return b;
  const std::vector<float> v = read_tensor_f32(*t);
  b.reserve(v.size() * sizeof(float));
  b.upload(v.data(), v.size() * sizeof(float));
  return b;
}

bool graphs_allowed_by_environment() {
  const char* e = std::getenv("TQ_CUDA_GRAPH");
  return !(e && std::string(e) == "0");
}

#ifdef TQ_ATTN_TIMELINE
}  // namespace
namespace kernels {
void read_attention_timeline_d128(unsigned long long* host);
void clear_attention_timeline_d128();
void read_append_timeline(unsigned long long* host);
void clear_append_timeline();
void read_append_phases(unsigned long long* host);
}  // namespace kernels
namespace {

// Diagnostics build: TQ_TIMELINE=<position> prints, for the decode step at that position, when the last
// layer's append kernel ran and the phases of its attention kernel (us after the append started).
void print_step_timeline(int grid) {
  constexpr int kBlocks = 4096, kMarks = 16;
  std::vector<unsigned long long> t(kBlocks * kMarks);
  unsigned long long ap[2];
  kernels::read_attention_timeline_d128(t.data());
  kernels::read_append_timeline(ap);
  const unsigned long long t0 = ap[0];
  std::fprintf(stderr, "  step timeline (last layer), us after its append started: append ends %.2f\n", (ap[1] - t0) * 1e-3);
  unsigned long long ph[4][8];
  kernels::read_append_phases(&ph[0][0]);
  for (int w = 0; w < 4; ++w) {
    std::fprintf(stderr, "    append warp %d phases:", w);
    for (int i = 1; i < 6; ++i) std::fprintf(stderr, " %.2f", (static_cast<double>(ph[w][i]) - static_cast<double>(ph[w][0])) * 1e-3);
    std::fprintf(stderr, " us after its start %.2f\n", (static_cast<double>(ph[w][0]) - static_cast<double>(t0)) * 1e-3);
  }
  for (int m = 0; m < kMarks; ++m) {
    std::vector<double> v;
    for (int b = 0; b < std::min(grid, kBlocks); ++b)
      if (t[b * kMarks + m] != 0) v.push_back((static_cast<double>(t[b * kMarks + m]) - static_cast<double>(t0)) * 1e-3);
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::fprintf(stderr, "    mark %2d: %7.2f / %7.2f / %7.2f  (%zu blocks)\n", m, v.front(), v[v.size() / 2], v.back(), v.size());
  }
}
#endif

}  // namespace

struct GpuLlamaModel::Impl {
  struct Layer {
    DeviceMatrix wqkv;     // BF16 [heads * head_dim + 2 * kv_heads * head_dim][hidden]: q, k, v rows stacked
    DeviceMatrix wo, w_down;
    DeviceMatrix w_gate_up;  // BF16 [2 * intermediate][hidden]: gate rows, then up rows
    DeviceBuffer attn_norm, ffn_norm, q_norm, k_norm;  // F32 [hidden] / [head_dim]; q/k norms empty but for Qwen3
    DeviceBuffer bq, bk, bv, bo, b_gate, b_up, b_down; // F32 [rows]; empty when absent
    int window = 0;
    bool fused_path = true;
    std::unique_ptr<DeviceKVCache> cache;
    std::unique_ptr<DeviceAttention> attention = std::make_unique<DeviceAttention>();         // prompts, eager steps
    std::unique_ptr<DeviceAttention> step_attention = std::make_unique<DeviceAttention>();    // replayed decode steps
    AppendParams append{};  // the decode step's append launch, prepared before the replay
  };

  ModelConfig config;
  int hidden = 0, inter = 0, n_heads = 0, n_kv = 0, head_dim = 0, rotary_dim = 0, vocab = 0;
  int q_dim = 0, kv_dim = 0;  // heads * head_dim, kv_heads * head_dim
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
  DeviceBuffer x;              // F32 [n][hidden]: the residual stream
  DeviceBuffer qkv;            // F32 q [n][heads * head_dim], then k [n][kv_dim], then v [n][kv_dim]
  DeviceBuffer att;            // F32 [n][heads * head_dim]
  DeviceBuffer gate_up;        // F32 gate [n][intermediate], then up [n][intermediate]
  DeviceBuffer gemm_in;        // BF16 [n][max(hidden, heads * head_dim, intermediate)]: the next GEMM's input
  DeviceBuffer logits;         // F32 [n][vocab]
  DeviceBuffer argmax_out;     // int32 [1]
  int64_t last_logits_row = 0; // row of `logits` that holds the last token's logits

  cudaStream_t stream = nullptr;  // everything the model enqueues (graphs cannot be recorded on the legacy stream)
  cublasHandle_t cublas = nullptr;
  DeviceBuffer cublas_workspace;  // given to cuBLAS so that a recorded GEMM allocates nothing

  // The decode step's graph: the step's token and position, and what the recorded launches were.
  DeviceBuffer step;          // int32 [2]: token, position (when the step's batch has no room for them)
  PinnedStaging step_stage;
  UploadBatch step_upload;    // a decode step's inputs, append destinations and attention plans: one copy
  cudaGraphExec_t step_graph = nullptr;
  cudaEvent_t step_begin = nullptr, step_end = nullptr;  // around each replay
  std::string step_signature;  // the launches' parameter bytes the graph was recorded with
  bool graph_on = graphs_allowed_by_environment();
  DecodeGraphStats graph_stats;

  ~Impl() {
    if (step_graph) cudaGraphExecDestroy(step_graph);
    if (step_begin) cudaEventDestroy(step_begin);
    if (step_end) cudaEventDestroy(step_end);
    if (cublas) cublasDestroy(cublas);
    if (stream) cudaStreamDestroy(stream);
  }

  float* q(int n) const { return qkv.as<float>(); }
  float* k(int n) const { return qkv.as<float>() + static_cast<int64_t>(n) * q_dim; }
  float* v(int n) const { return qkv.as<float>() + static_cast<int64_t>(n) * (q_dim + kv_dim); }
  float* gate(int n) const { return gate_up.as<float>(); }
  float* up(int n) const { return gate_up.as<float>() + static_cast<int64_t>(n) * inter; }
  uint16_t* bf16_in() const { return gemm_in.as<uint16_t>(); }

  void reserve(int n) {
    if (n <= capacity) return;
    const size_t f = sizeof(float), nn = static_cast<size_t>(n);
    tokens.reserve(nn * sizeof(int32_t));
    x.reserve(nn * hidden * f);
    qkv.reserve(nn * (q_dim + 2 * kv_dim) * f);
    att.reserve(nn * q_dim * f);
    gate_up.reserve(nn * 2 * inter * f);
    gemm_in.reserve(nn * std::max({hidden, q_dim, inter}) * sizeof(uint16_t));
    logits.reserve(nn * vocab * f);
    capacity = n;
    step_signature.clear();  // the recorded graph points at the old buffers
  }

  // out[n][rows] = in[n][cols] . W[row0 .. row0 + rows)^T + beta * out, in = BF16 gemm_in: cuBLAS in
  // column-major terms computes out^T (rows x n) = W (stored as the column-major cols x rows matrix,
  // transposed) . in^T. beta = 1 adds the product to out (the residual).
  void gemm(const DeviceMatrix& w, int64_t row0, int64_t rows, int n, float* out, float beta) {
    const float alpha = 1.0f;
    TQ_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), n, static_cast<int>(w.cols), &alpha,
                                 w.row(row0), CUDA_R_16BF, static_cast<int>(w.cols), gemm_in.get(), CUDA_R_16BF,
                                 static_cast<int>(w.cols), &beta, out, CUDA_R_32F, static_cast<int>(rows), CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
  }
  void add_bias(float* y, const DeviceBuffer& bias, int n, int cols) {
    if (bias.get()) model_kernels::add_bias(y, bias.as<float>(), n, cols, stream);
  }

  // The forward pass of n tokens at positions pos0.. (pos_dev: the position on the device instead, for a
  // recorded step). prepared: the layers' append launches and attention plans (step_attention) were
  // made before (a replayed decode step); otherwise each layer makes them as it goes (attention).
  void enqueue_forward(const int32_t* tokens_dev, int n, int pos0, const int32_t* pos_dev, bool prepared, bool all_logits);
  void prepare_layer(Layer& L, DeviceAttention& attention, int n, int pos0, UploadBatch* batch = nullptr);
  void decode_step(int32_t token, int pos0);
};

void GpuLlamaModel::Impl::prepare_layer(Layer& L, DeviceAttention& attention, int n, int pos0, UploadBatch* batch) {
  const DeviceKVCache::Span span{seq, n};
  L.append = L.cache->prepare_append({&span, 1}, k(n), v(n), stream, batch);
  AttentionParams p;
  p.n_heads = n_heads;
  p.window = L.window;
  const DeviceAttentionRequest r{seq, q(n), n, pos0, att.as<float>()};
  attention.plan(*L.cache, {&r, 1}, p, L.fused_path ? AttentionPath::fused : AttentionPath::standard, stream, batch);
}

void GpuLlamaModel::Impl::enqueue_forward(const int32_t* tokens_dev, int n, int pos0, const int32_t* pos_dev, bool prepared,
                                          bool all_logits) {
  const int64_t nn = n;
  model_kernels::embed(embed.data.as<uint16_t>(), tokens_dev, n, hidden, x.as<float>(), stream);
  for (Layer& L : layers) {
    // Attention block: x += Wo . attention(rope(Wq h), rope(Wk h), Wv h), h = rms_norm(x).
    model_kernels::rms_norm_rows_bf16(x.as<float>(), L.attn_norm.as<float>(), eps, nn, hidden, bf16_in(), stream);
    if (n == 1) {
      gemm(L.wqkv, 0, q_dim + 2 * kv_dim, n, q(n), 0.0f);  // q, k, v side by side
    } else {
      gemm(L.wqkv, 0, q_dim, n, q(n), 0.0f);
      gemm(L.wqkv, q_dim, kv_dim, n, k(n), 0.0f);
      gemm(L.wqkv, q_dim + kv_dim, kv_dim, n, v(n), 0.0f);
    }
    add_bias(q(n), L.bq, n, q_dim);
    add_bias(k(n), L.bk, n, kv_dim);
    add_bias(v(n), L.bv, n, kv_dim);
    if (L.q_norm.get()) {
      model_kernels::rms_norm_rows(q(n), L.q_norm.as<float>(), eps, nn * n_heads, head_dim, q(n), stream);
      model_kernels::rms_norm_rows(k(n), L.k_norm.as<float>(), eps, nn * n_kv, head_dim, k(n), stream);
    }
    model_kernels::rope(q(n), n_heads, k(n), n_kv, n, head_dim, rotary_dim, interleaved, inv_freq.as<float>(), pos0, pos_dev, stream);
    DeviceAttention& attention = prepared ? *L.step_attention : *L.attention;
    if (!prepared) prepare_layer(L, attention, n, pos0);
    L.cache->launch_append(L.append, stream);
    attention.run(stream);
    model_kernels::to_bf16(att.as<float>(), nn * q_dim, bf16_in(), stream);
    gemm(L.wo, 0, hidden, n, x.as<float>(), 1.0f);
    add_bias(x.as<float>(), L.bo, n, hidden);

    // Feed-forward block: x += W_down . (silu(W_gate h) * W_up h), h = rms_norm(x).
    model_kernels::rms_norm_rows_bf16(x.as<float>(), L.ffn_norm.as<float>(), eps, nn, hidden, bf16_in(), stream);
    if (n == 1) {
      gemm(L.w_gate_up, 0, 2 * inter, n, gate(n), 0.0f);
    } else {
      gemm(L.w_gate_up, 0, inter, n, gate(n), 0.0f);
      gemm(L.w_gate_up, inter, inter, n, up(n), 0.0f);
    }
    add_bias(gate(n), L.b_gate, n, inter);
    add_bias(up(n), L.b_up, n, inter);
    model_kernels::swiglu_bf16(gate(n), up(n), nn * inter, bf16_in(), stream);
    gemm(L.w_down, 0, hidden, n, x.as<float>(), 1.0f);
    add_bias(x.as<float>(), L.b_down, n, hidden);
  }

  const int first = all_logits ? 0 : n - 1;
  const int rows = n - first;
  const float* last_x = x.as<float>() + static_cast<int64_t>(first) * hidden;
  model_kernels::rms_norm_rows_bf16(last_x, final_norm.as<float>(), eps, rows, hidden, bf16_in(), stream);
  gemm(*lm_head, 0, vocab, rows, logits.as<float>(), 0.0f);
  last_logits_row = rows - 1;
}

void GpuLlamaModel::Impl::decode_step(int32_t token, int pos0) {
  const auto host_begin = std::chrono::steady_clock::now();
  // What changes from step to step goes up first, in one copy: the token and position, then every
  // layer's append destinations and attention plan.
  step_upload.begin();
  const int32_t step_host[2] = {token, pos0};
  const UploadBatch::Region region = step_upload.take(sizeof step_host);
  const int32_t* step_dev;
  if (region.host) {
    std::memcpy(region.host, step_host, sizeof step_host);
    step_dev = reinterpret_cast<const int32_t*>(region.device);
  } else {
    std::memcpy(step_stage.begin(sizeof step_host), step_host, sizeof step_host);
    step_stage.upload(step, sizeof step_host, stream);
    step_dev = step.as<int32_t>();
  }
  std::string signature(reinterpret_cast<const char*>(&step_dev), sizeof step_dev);
  for (Layer& L : layers) {
    prepare_layer(L, *L.step_attention, 1, pos0, &step_upload);
    signature.append(reinterpret_cast<const char*>(&L.append), sizeof L.append);
    signature += L.step_attention->launch_signature();
  }
  step_upload.upload(stream);
  if (!step_graph || signature != step_signature) {
    // (Re)record: the first step, or a launch whose parameters moved (a buffer grew).
    cudaGraph_t graph = nullptr;
    TQ_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue_forward(step_dev, 1, pos0, step_dev + 1, /*prepared=*/true, /*all_logits=*/false);
    } catch (...) {
      (void)cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    TQ_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    if (step_graph) TQ_CUDA_CHECK(cudaGraphExecDestroy(step_graph));
    step_graph = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&step_graph, graph, 0);
    cudaGraphDestroy(graph);
    TQ_CUDA_CHECK(made);
    step_signature = std::move(signature);
    ++graph_stats.captures;
  }
#ifdef TQ_ATTN_TIMELINE
  const char* at = std::getenv("TQ_TIMELINE");
  const bool timeline = at && std::atoi(at) == pos0;
  if (timeline) {
    TQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    kernels::clear_attention_timeline_d128();
    kernels::clear_append_timeline();
  }
#endif
  TQ_CUDA_CHECK(cudaEventRecord(step_begin, stream));
  TQ_CUDA_CHECK(cudaGraphLaunch(step_graph, stream));
#ifdef TQ_ATTN_TIMELINE
  if (timeline) {
    TQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    print_step_timeline(4096);
  }
#endif
  TQ_CUDA_CHECK(cudaEventRecord(step_end, stream));
  graph_stats.host_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - host_begin).count();
  ++graph_stats.replays;
  last_logits_row = 0;
}

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
  m.q_dim = m.n_heads * m.head_dim;
  m.kv_dim = m.n_kv * m.head_dim;
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

  TQ_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  TQ_CUBLAS_CHECK(cublasCreate(&m.cublas));
  TQ_CUBLAS_CHECK(cublasSetStream(m.cublas, m.stream));
  // A workspace of its own (cuBLAS suggests 32 MiB on Hopper): a GEMM recorded into a graph must not
  // allocate.
  m.cublas_workspace.reserve(size_t{32} << 20);
  TQ_CUBLAS_CHECK(cublasSetWorkspace(m.cublas, m.cublas_workspace.get(), m.cublas_workspace.bytes()));
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
  // The device kernels were tuned with 64-position pages (the CPU default, kDefaultBlockTokens, is the
  // CPU block kernel's).
  constexpr int kDevicePageTokens = 64;
  const KVCacheOptions full = kv.cache_options(kDevicePageTokens);
  const bool dense = !kv.compressed();
  DeviceCacheCapacity capacity;
  capacity.max_sequences = 1;
  capacity.max_tokens = max_tokens;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    Impl::Layer L;
    L.wqkv = upload_bf16_stacked({{lw.wq, "q_proj"}, {lw.wk, "k_proj"}, {lw.wv, "v_proj"}});
    TQ_CHECK(L.wqkv.rows == m.q_dim + 2 * m.kv_dim && L.wqkv.cols == m.hidden, "GPU model: layer ", l,
             " has q/k/v projections of ", L.wqkv.rows, " x ", L.wqkv.cols, " values together, the configuration says ",
             m.q_dim + 2 * m.kv_dim, " x ", m.hidden);
    L.wo = upload_bf16(lw.wo, "o_proj");
    L.w_gate_up = upload_bf16_stacked({{lw.w_gate, "gate_proj"}, {lw.w_up, "up_proj"}});
    TQ_CHECK(L.w_gate_up.rows == 2 * static_cast<int64_t>(m.inter), "GPU model: layer ", l, " has gate/up projections of ",
             L.w_gate_up.rows, " rows together, the configuration says 2 x ", m.inter);
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
      o.block_tokens = full.block_tokens;
    }
    L.fused_path = kv.fused || dense || L.window > 0;
    try {
      L.cache = std::make_unique<DeviceKVCache>(m.n_kv, m.head_dim, o, capacity);
    } catch (const Error& e) {
      fail("GPU model: the KV cache ", kv.describe(), " cannot live on the device: ", e.what());
    }
    m.seq = L.cache->add_sequence();  // the same id in every layer (each cache starts empty)
    L.step_attention->set_replayable(true);
    // Attention follows its layer's append on the stream and starts while the append still runs (it
    // waits for it before the newest tiles). TQ_ATTN_OVERLAP=0 launches them one after the other.
    static const bool overlap = [] {
      const char* v = std::getenv("TQ_ATTN_OVERLAP");
      return v == nullptr || std::string(v) != "0";
    }();
    L.attention->set_overlap_append(overlap);
    L.step_attention->set_overlap_append(overlap);
    if (!L.fused_path && m.graph_stats.eager_reason.empty())
      m.graph_stats.eager_reason = "the standard attention path (its expand launch changes with the context length)";
    m.layers.push_back(std::move(L));
  }
  for (const Impl::Layer& L : m.layers) {
    for (const DeviceMatrix* d : {&L.wqkv, &L.wo, &L.w_gate_up, &L.w_down})
      m.weight_bytes += static_cast<int64_t>(d->data.bytes());
  }
  m.weight_bytes += static_cast<int64_t>(m.embed.data.bytes() + m.lm_head_own.data.bytes());
  m.argmax_out.reserve(sizeof(int32_t));
  // Room for a decode step's uploads: per layer an attention plan (a work item of 32 bytes per block of a
  // grid that fills the GPU, a few hundred on an H200) and the append positions; it grows if needed.
  m.step_upload.reserve(m.layers.size() * (size_t{32} << 10) + (size_t{64} << 10));
  m.step.reserve(2 * sizeof(int32_t));
  TQ_CUDA_CHECK(cudaEventCreate(&m.step_begin));
  TQ_CUDA_CHECK(cudaEventCreate(&m.step_end));
  if (!m.graph_on) m.graph_stats.eager_reason = "TQ_CUDA_GRAPH=0";
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
  const bool replay = n == 1 && m.graph_on && m.graph_stats.eager_reason.empty();
  if (replay) {
    m.decode_step(tokens[0], pos0);
  } else {
    if (n == 1) ++m.graph_stats.eager_steps;
    m.tokens.upload(tokens, static_cast<size_t>(n) * sizeof(int32_t), m.stream);
    m.enqueue_forward(m.tokens.as<int32_t>(), n, pos0, nullptr, /*prepared=*/false, all_logits);
  }
  if (logits_host) {
    const size_t rows = static_cast<size_t>(m.last_logits_row) + 1;
    TQ_CUDA_CHECK(cudaMemcpyAsync(logits_host, m.logits.get(), rows * m.vocab * sizeof(float), cudaMemcpyDeviceToHost, m.stream));
  }
  TQ_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  if (replay) {
    float ms = 0;
    TQ_CUDA_CHECK(cudaEventElapsedTime(&ms, m.step_begin, m.step_end));
    m.graph_stats.device_seconds += ms * 1e-3;
  }
}

GpuLlamaModel::DecodeGraphStats GpuLlamaModel::decode_graph_stats() const { return impl_->graph_stats; }

void GpuLlamaModel::set_decode_graph(bool on) {
  Impl& m = *impl_;
  m.graph_on = on;
  if (!on) {
    m.graph_stats.eager_reason = "decode graphs switched off";
  } else if (m.graph_stats.eager_reason == "decode graphs switched off" || m.graph_stats.eager_reason == "TQ_CUDA_GRAPH=0") {
    m.graph_stats.eager_reason.clear();
    for (const Impl::Layer& L : m.layers)
      if (!L.fused_path) m.graph_stats.eager_reason = "the standard attention path (its expand launch changes with the context length)";
  }
}

int32_t GpuLlamaModel::argmax() const {
  const Impl& m = *impl_;
  TQ_CHECK(m.capacity > 0, "GPU argmax before any forward");
  model_kernels::argmax(m.logits.as<float>() + m.last_logits_row * m.vocab, m.vocab, m.argmax_out.as<int32_t>(), m.stream);
  int32_t id = 0;
  TQ_CUDA_CHECK(cudaMemcpyAsync(&id, m.argmax_out.get(), sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream));
  TQ_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  return id;
}

}  // namespace tq::cuda
