// GPU tests of block-mean centring in the device KV cache (kv/cache.h, KVCacheOptions::center_k): the
// means, codes and FP16 filling run against the CPU's centred cache, and the fused and standard attention
// against the CPU reference over the same centred cache. Every test skips without a CUDA device.
//
// Tolerances are the uncentred GPU tests' (cuda_test.cc): 2e-3 of a row's norm for the fused path (FP16
// operands) and 2e-2 for the standard path (BF16 tiles). Centring adds, per tile, q . mu and mu x the
// tile's weights as MMAs on FP16 operands (mu is binary16 already; q and P are the FP16 values the codes'
// MMAs use), so its error is of the same kind and size as the rest of the tile's. The drifting-offset
// case is the exception: its scores carry q . mu of a large offset (|mu| about 4 per channel), and an FP16
// query of relative error 2^-11 moves such a score by up to ~5e-3 (base 2), so rows there are held to
// 5e-3 (fused) and, through BF16 tiles whose rounding is 8 times coarser, 4e-2 (standard).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/test_util.h"
#include "core/thread_pool.h"
#include "cuda/cuda_backend.h"

namespace tq::cuda {
namespace {

class CudaCenter : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!device_available(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): the GPU tests need one";
  }
};

using testing_util::gaussian;
using testing_util::max_row_error;

constexpr double kFp16Tolerance = 2e-3, kBf16Tolerance = 2e-2;
constexpr double kOffsetFp16Tolerance = 5e-3, kOffsetBf16Tolerance = 4e-2;

struct CenterCase {
  int k_bits = 4, v_bits = 4;
  bool center_k = true, center_v = false;
  int block = 64;        // page / block positions
  int center = 0;        // positions per mean (0: the block)
  int n_heads = 8, n_kv = 2, dim = 128, group = 64;
  int min_tokens = 0;
  int window = 0;
  bool sinks = false;    // learned sink logits
  std::vector<int> lengths = {300};
  int n_q = 1;
  float offset = 0.0f;   // amplitude of a per-channel offset that drifts along the sequence (0: none)
};

std::string name(const CenterCase& c) {
  std::ostringstream s;  // a stream, not operator+ chains (GCC 12's false -Wrestrict)
  s << "K" << c.k_bits << "V" << c.v_bits << " centre " << (c.center_k && c.center_v ? "KV" : c.center_k ? "K" : "V") << " run "
    << (c.center ? c.center : c.block) << " block " << c.block << " heads " << c.n_heads << "/" << c.n_kv << " dim " << c.dim << " len";
  for (int l : c.lengths) s << " " << l;
  s << " sink " << c.min_tokens << " window " << c.window << (c.sinks ? " learned-sinks" : "") << " n_q " << c.n_q;
  if (c.offset > 0) s << " drifting offset " << c.offset;
  return s.str();
}

KVCacheOptions options(const CenterCase& c) {
  TurboQuantCacheOptions o;
  o.k_bits = c.k_bits;
  o.v_bits = c.v_bits;
  o.group_size = c.group;
  o.min_tokens_before_quant = c.min_tokens;
  o.block_tokens = c.block;
  KVCacheOptions opt = turboquant_cache_options(o, 0);
  opt.center_k = c.center_k;
  opt.center_v = c.center_v;
  opt.center_tokens = c.center;
  return opt;
}

// Keys and values [n][n_kv][dim]: Gaussian, plus (offset > 0) a per-channel offset that drifts along the
// positions, amp * (a_c + b_c sin(pos / 97 + phi_c)): what makes centring worth it, and uncentred
// quantization visibly worse.
std::vector<float> vectors(int n, const CenterCase& c, SplitMix64& rng, float sigma) {
  std::vector<float> x = gaussian(static_cast<size_t>(n) * c.n_kv * c.dim, rng, sigma);
  if (c.offset > 0) {
    const size_t channels = static_cast<size_t>(c.n_kv) * c.dim;
    const auto a = gaussian(channels, rng), b = gaussian(channels, rng), phi = gaussian(channels, rng, 3.0f);
    for (int pos = 0; pos < n; ++pos)
      for (size_t ch = 0; ch < channels; ++ch)
        x[pos * channels + ch] += c.offset * (a[ch] + b[ch] * std::sin(static_cast<float>(pos) / 97.0f + phi[ch]));
  }
  return x;
}

// The GPU appends in uneven chunks, so that runs complete in the middle of an append, partly from the
// FP16 tail and partly from the appended rows, and the next filling run starts in the same append.
const int kChunks[] = {1, 37, 5, 64, 200, 3, 129, 16};

void append_in_chunks(DeviceKVCache& gpu, int seq, const float* k, const float* v, int n, int n_kv, int dim, int chunk0 = 0) {
  const size_t row = static_cast<size_t>(n_kv) * dim;
  for (int done = 0, i = chunk0; done < n; ++i) {
    const int m = std::min(n - done, kChunks[i % (sizeof kChunks / sizeof kChunks[0])]);
    gpu.append(seq, k + done * row, v + done * row, m);
    done += m;
  }
}

// CPU: the segment of a sequence holding pos, and pos's index inside it.
const Segment* segment_of(const std::vector<Segment>& segs, int pos, int* t) {
  for (const Segment& g : segs)
    if (pos >= g.first_pos && pos < g.first_pos + g.n_tokens) {
      *t = pos - g.first_pos;
      return &g;
    }
  return nullptr;
}

// What the device stores for each position against the CPU's centred cache: the sink tier and the filling
// run exactly (binary16 of the input), each run's means bit for bit (the same binary16 values rotated in
// the same order and summed in double in position order), and the stored-domain reconstruction (levels x
// scales + mean) equal to the CPU's group by group but for the rare code on a decision boundary (as
// cuda_test's codes; one such code changes its group's values, and with norm correction its scale).
struct StorageCounts {
  int64_t vectors = 0, mean_mismatch = 0, exact_mismatch = 0, filling = 0, means_checked = 0;
  int64_t groups = 0, group_mismatch = 0;
};

void compare_storage(const KVCache& cpu, int cpu_seq, const DeviceKVCache& gpu, int gpu_seq, const std::vector<float>& k,
                     const std::vector<float>& v, int n_kv, int dim, StorageCounts& n) {
  std::vector<Segment> segs;
  cpu.segments(cpu_seq, segs);
  const KVCacheOptions& o = cpu.options();
  std::vector<float> ck(static_cast<size_t>(n_kv) * dim), cv(ck.size()), yg(dim), yc(dim);
  for (int pos = gpu.first_kept(gpu_seq) > o.min_tokens ? gpu.first_kept(gpu_seq) : 0; pos < gpu.length(gpu_seq); ++pos) {
    int t = 0;
    const Segment* g = segment_of(segs, pos, &t);
    ASSERT_NE(g, nullptr) << "position " << pos << " is in no CPU segment";
    for (int h = 0; h < n_kv; ++h)
      for (int key = 1; key >= 0; --key) {
        const char* what = key ? "K" : "V";
        const DeviceKVCache::Stored st = gpu.stored(gpu_seq, pos, h, key == 1);
        const float* x = (key ? k.data() : v.data()) + (static_cast<size_t>(pos) * n_kv + h) * dim;
        ++n.vectors;
        const bool cpu_dense = (key ? g->k_format : g->v_format)->quantizer() == nullptr;
        if (st.sink || st.filling) {
          // Held in FP16 on both sides: the binary16 values of the input.
          EXPECT_TRUE(cpu_dense) << what << " position " << pos << ": the GPU holds it in FP16 (" << (st.sink ? "sink" : "filling run")
                                 << "), the CPU encoded it";
          n.filling += st.filling;
          for (int d = 0; d < dim; ++d) n.exact_mismatch += st.values[d] != round_to_f16(x[d]);
          continue;
        }
        EXPECT_FALSE(cpu_dense) << what << " position " << pos << ": the GPU encoded it, the CPU holds it in FP16 (its run fills)";
        if (cpu_dense) continue;
        const uint16_t* cpu_mean = key ? g->k_mean_of(h, t) : g->v_mean_of(h, t);
        EXPECT_EQ(cpu_mean != nullptr, !st.mean.empty()) << what << " position " << pos << ": centred on one side only";
        if (cpu_mean && !st.mean.empty()) {
          ++n.means_checked;
          bool differs = false;
          for (int d = 0; d < dim; ++d) differs |= st.mean[d] != f16_bits_to_f32(cpu_mean[d]);
          n.mean_mismatch += differs;
        }
        // The GPU's stored domain from its codes, scales and mean; the CPU's as its decoded vector rotated
        // forward again (float rounding of the two rotations only: ~1e-6 of the vector's largest value,
        // where a different code moves a value by a level step times the scale, ~1e-2 of it or more).
        const GroupQuantizer* q = (key ? g->k_format : g->v_format)->quantizer();
        const int G = q->group_size();
        for (int d = 0; d < dim; ++d) yg[d] = q->levels()[st.codes[d]] * st.scales[d / G] + (st.mean.empty() ? 0.0f : st.mean[d]);
        cpu.read(cpu_seq, pos, ck.data(), cv.data());
        std::copy_n((key ? ck.data() : cv.data()) + static_cast<size_t>(h) * dim, dim, yc.data());
        q->rotation()->forward(yc.data());
        double largest = 0;
        for (int d = 0; d < dim; ++d) largest = std::max(largest, static_cast<double>(std::fabs(yc[d])));
        for (int grp = 0; grp < dim / G; ++grp) {
          bool differs = false;
          for (int d = grp * G; d < (grp + 1) * G; ++d) differs |= std::fabs(yg[d] - yc[d]) > 1e-4 * largest + 1e-6;
          ++n.groups;
          n.group_mismatch += differs;
        }
      }
  }
}

void check_storage_case(const CenterCase& c) {
  SCOPED_TRACE(name(c));
  SplitMix64 rng(static_cast<uint64_t>(c.k_bits * 131 + c.v_bits * 17 + c.dim + c.block + c.center * 3 + c.center_k * 5 + c.center_v * 11));
  const KVCacheOptions opt = options(c);
  KVCache cpu(c.n_kv, c.dim, opt);
  DeviceCacheCapacity cap;
  cap.max_sequences = 1;
  cap.max_tokens = c.lengths[0] + c.block;
  DeviceKVCache gpu(c.n_kv, c.dim, opt, cap);
  const int a = cpu.add_sequence(), b = gpu.add_sequence();
  const int n = c.lengths[0];
  const auto k = vectors(n, c, rng, 1.5f), v = vectors(n, c, rng, 1.0f);
  cpu.append(a, k.data(), v.data(), n);
  append_in_chunks(gpu, b, k.data(), v.data(), n, c.n_kv, c.dim);
  StorageCounts cnt;
  compare_storage(cpu, a, gpu, b, k, v, c.n_kv, c.dim, cnt);
  std::printf("  %-80s %lld vectors (%lld filling), %lld means: %lld differ; %lld groups: %lld differ; %lld FP16 values differ\n",
              name(c).c_str(), static_cast<long long>(cnt.vectors), static_cast<long long>(cnt.filling),
              static_cast<long long>(cnt.means_checked), static_cast<long long>(cnt.mean_mismatch), static_cast<long long>(cnt.groups),
              static_cast<long long>(cnt.group_mismatch), static_cast<long long>(cnt.exact_mismatch));
  EXPECT_EQ(cnt.mean_mismatch, 0) << "run means differ from the CPU's (they are taken from the same binary16 values in the same order)";
  EXPECT_EQ(cnt.exact_mismatch, 0) << "sink or filling-run values are not the binary16 of the input";
  EXPECT_LE(cnt.group_mismatch, std::max<int64_t>(1, cnt.groups / 200))
      << "more than 0.5% of the encoded groups reconstruct differently from the CPU's (a code on a decision boundary is rare)";
  EXPECT_GT(cnt.means_checked, 0) << "this case is meant to complete runs";
}

// Attention over a centred GPU cache (fused and standard) against the CPU reference over the CPU's centred
// cache of the same vectors.
void check_attention_case(const CenterCase& c, ThreadPool& pool) {
  SCOPED_TRACE(name(c));
  SplitMix64 rng(static_cast<uint64_t>(c.k_bits * 7 + c.v_bits * 3 + c.dim + c.n_heads + c.lengths[0] + c.min_tokens + c.block + c.window));
  const KVCacheOptions opt = options(c);
  KVCache cpu(c.n_kv, c.dim, opt);
  DeviceCacheCapacity cap;
  cap.max_sequences = static_cast<int>(c.lengths.size());
  for (int len : c.lengths) cap.max_tokens += len + c.block;
  DeviceKVCache gpu(c.n_kv, c.dim, opt, cap);
  std::vector<int> cpu_seqs, gpu_seqs;
  for (size_t i = 0; i < c.lengths.size(); ++i) {
    const int len = c.lengths[i];
    cpu_seqs.push_back(cpu.add_sequence());
    gpu_seqs.push_back(gpu.add_sequence());
    const auto k = vectors(len, c, rng, 1.5f), v = vectors(len, c, rng, 1.0f);
    cpu.append(cpu_seqs.back(), k.data(), v.data(), len);
    append_in_chunks(gpu, gpu_seqs.back(), k.data(), v.data(), len, c.n_kv, c.dim, static_cast<int>(i));
  }
  const auto sinks = gaussian(c.n_heads, rng, 2.0f);
  AttentionParams p;
  p.n_heads = c.n_heads;
  p.window = c.window;
  p.sinks = c.sinks ? sinks.data() : nullptr;
  const size_t per_seq = static_cast<size_t>(c.n_q) * c.n_heads * c.dim;
  const auto q = gaussian(per_seq * c.lengths.size(), rng);
  std::vector<float> reference(q.size(), 0.0f), fused(q.size(), 0.0f), standard(q.size(), 0.0f);
  std::vector<AttentionRequest> cpu_reqs, gpu_reqs;
  for (size_t i = 0; i < c.lengths.size(); ++i) {
    const int n_q = std::min(c.n_q, c.lengths[i]);
    cpu_reqs.push_back({cpu_seqs[i], q.data() + i * per_seq, n_q, c.lengths[i] - n_q, reference.data() + i * per_seq});
    gpu_reqs.push_back({gpu_seqs[i], q.data() + i * per_seq, n_q, c.lengths[i] - n_q, nullptr});
  }
  attend(cpu, cpu_reqs, p, AttentionPath::reference, pool);
  auto run = [&](AttentionPath path, std::vector<float>& out) {
    for (size_t i = 0; i < gpu_reqs.size(); ++i) gpu_reqs[i].out = out.data() + i * per_seq;
    attend(gpu, gpu_reqs, p, path);
  };
  run(AttentionPath::fused, fused);
  run(AttentionPath::standard, standard);
  const double e_fused = max_row_error(fused, reference, c.dim), e_standard = max_row_error(standard, reference, c.dim);
  std::printf("  %-100s fused %.2e  standard %.2e\n", name(c).c_str(), e_fused, e_standard);
  EXPECT_LE(e_fused, c.offset > 0 ? kOffsetFp16Tolerance : kFp16Tolerance) << "fused GPU attention over the centred cache vs the CPU reference";
  EXPECT_LE(e_standard, c.offset > 0 ? kOffsetBf16Tolerance : kBf16Tolerance)
      << "standard GPU attention (BF16 tiles with the means) vs the CPU reference";
}

const int kBits[][2] = {{8, 3}, {8, 4}, {4, 4}, {4, 3}, {3, 4}, {3, 3}, {2, 2}, {5, 6}};

// ------------------------------------------------------------------ storage

TEST_F(CudaCenter, MeansCodesAndFillingRunMatchTheCpu) {
  for (const auto& b : kBits)
    for (int which = 0; which < 3; ++which) {
      CenterCase c;
      c.k_bits = b[0];
      c.v_bits = b[1];
      c.center_k = which != 1;
      c.center_v = which != 0;
      c.min_tokens = 20;
      c.lengths = {333};  // 20 sink positions, 4 complete runs of 64, a filling run of 57
      check_storage_case(c);
    }
  for (int dim : {64, 256}) {
    CenterCase c;
    c.dim = dim;
    c.center_v = true;
    check_storage_case(c);
  }
  // Block sizes 64 / 128 / 256 with runs of 16 .. the block.
  const int runs[][2] = {{64, 16}, {64, 32}, {128, 0}, {128, 64}, {256, 0}, {256, 64}, {256, 128}};
  for (const auto& r : runs) {
    CenterCase c;
    c.block = r[0];
    c.center = r[1];
    c.center_v = true;
    c.min_tokens = 16;
    c.lengths = {900};
    check_storage_case(c);
  }
  CenterCase drift;
  drift.offset = 4.0f;
  drift.center_v = true;
  drift.lengths = {700};
  check_storage_case(drift);
}

// ------------------------------------------------------------------ attention

TEST_F(CudaCenter, FusedAndStandardAgreeWithTheCpuReference) {
  ThreadPool pool(4);
  for (const auto& b : kBits)
    for (int which = 0; which < 3; ++which)
      for (int len : {1, 70, 130, 1000, 4100}) {
        CenterCase c;
        c.k_bits = b[0];
        c.v_bits = b[1];
        c.center_k = which != 1;
        c.center_v = which != 0;
        c.n_heads = 32;
        c.n_kv = 8;
        c.lengths = {len};
        check_attention_case(c, pool);
      }
}

TEST_F(CudaCenter, ShapesBlocksAndRuns) {
  ThreadPool pool(4);
  struct Shape {
    int n_heads, n_kv, dim;
  };
  for (const Shape& sh : {Shape{8, 8, 128}, Shape{16, 2, 256}, Shape{8, 2, 64}})
    for (int block : {64, 128, 256})
      for (int center : {0, 16, 64}) {
        if (center > block) continue;
        CenterCase c;
        c.n_heads = sh.n_heads;
        c.n_kv = sh.n_kv;
        c.dim = sh.dim;
        c.block = block;
        c.center = center;
        c.center_v = true;
        c.lengths = {1500, 77, 256 + 5};  // several sequences of different lengths in one launch
        check_attention_case(c, pool);
      }
}

TEST_F(CudaCenter, SinksWindowsAndQueryBlocks) {
  ThreadPool pool(4);
  for (int min_tokens : {0, 16, 64})
    for (int window : {0, 100, 300})
      for (bool sinks : {false, true})
        for (int n_q : {1, 16}) {
          CenterCase c;
          c.k_bits = 8;
          c.v_bits = 3;
          c.center_v = true;
          c.n_heads = 32;
          c.n_kv = 8;
          c.min_tokens = min_tokens;
          c.window = window;
          c.sinks = sinks;
          c.n_q = n_q;
          c.lengths = {1111, 70};
          check_attention_case(c, pool);
        }
}

TEST_F(CudaCenter, ManyPartsMergeIntoTheOutput) {
  ThreadPool pool(4);
  CenterCase c;
  c.n_heads = 4;
  c.n_kv = 2;
  c.min_tokens = 64;
  c.sinks = true;
  c.center_v = true;
  c.lengths = {20000 + 17};
  check_attention_case(c, pool);
}

// A large per-channel offset that drifts: centring is exact for attention, so the centred GPU cache must
// agree with the CPU's centred cache as tightly as ever, and both must be visibly closer to attention over
// the unquantized vectors than the uncentred cache is.
TEST_F(CudaCenter, DriftingOffset) {
  ThreadPool pool(4);
  for (const auto& b : {std::array<int, 2>{4, 4}, std::array<int, 2>{3, 4}, std::array<int, 2>{8, 3}}) {
    CenterCase c;
    c.k_bits = b[0];
    c.v_bits = b[1];
    c.center_v = true;
    c.n_heads = 16;
    c.n_kv = 4;
    c.offset = 4.0f;
    c.lengths = {2000};
    check_attention_case(c, pool);
    // Exact attention over the vectors themselves (an FP32 cache) against the centred and the uncentred GPU caches.
    SCOPED_TRACE(name(c));
    SplitMix64 rng(99 + b[0] * 10 + b[1]);
    const int n = c.lengths[0];
    const auto k = vectors(n, c, rng, 1.5f), v = vectors(n, c, rng, 1.0f);
    KVCacheOptions exact;
    exact.k.type = exact.v.type = KVType::f32;
    KVCache truth(c.n_kv, c.dim, exact);
    const int ts = truth.add_sequence();
    truth.append(ts, k.data(), v.data(), n);
    const auto q = gaussian(static_cast<size_t>(c.n_heads) * c.dim, rng);
    AttentionParams p;
    p.n_heads = c.n_heads;
    std::vector<float> want(q.size()), centred(q.size()), plain(q.size());
    AttentionRequest r{ts, q.data(), 1, n - 1, want.data()};
    attend(truth, {&r, 1}, p, AttentionPath::reference, pool);
    for (int centre = 1; centre >= 0; --centre) {
      CenterCase cc = c;
      cc.center_k = cc.center_v = centre == 1;
      KVCacheOptions o = options(cc);
      DeviceKVCache gpu(c.n_kv, c.dim, o, {1, n + 64});
      const int s = gpu.add_sequence();
      gpu.append(s, k.data(), v.data(), n);
      AttentionRequest g{s, q.data(), 1, n - 1, centre ? centred.data() : plain.data()};
      attend(gpu, {&g, 1}, p, AttentionPath::fused);
    }
    const double e_centred = max_row_error(centred, want, c.dim), e_plain = max_row_error(plain, want, c.dim);
    std::printf("  K%dV%d drifting offset: error against exact attention, centred %.3e, uncentred %.3e\n", b[0], b[1], e_centred, e_plain);
    EXPECT_LT(e_centred, 0.8 * e_plain) << "centring should beat the uncentred cache clearly on a drifting offset";
  }
}

// ------------------------------------------------------------------ truncate, fork, rotating caches

// The CPU's rules (kv/cache.h): truncation inside the filling run or at a run's start is as if the
// positions had never been appended; inside a completed run the run keeps its means and the positions
// appended again are encoded around them; a fork copies the filling run and completes it on its own.
TEST_F(CudaCenter, TruncateAndForkAsTheCpu) {
  ThreadPool pool(4);
  CenterCase c;
  c.center_v = true;
  c.min_tokens = 16;
  const KVCacheOptions opt = options(c);
  KVCache cpu(c.n_kv, c.dim, opt);
  DeviceKVCache gpu(c.n_kv, c.dim, opt, {4, 4096});
  SplitMix64 rng(4242);
  const int n = 600;
  const auto k = vectors(n, c, rng, 1.5f), v = vectors(n, c, rng, 1.0f);
  const size_t row = static_cast<size_t>(c.n_kv) * c.dim;
  const int a = cpu.add_sequence(), b = gpu.add_sequence();
  // Each step: truncate both to `to`, append the vectors from there up to `upto` (the same ones or, with
  // `fresh`, new ones), compare storage and attention.
  std::vector<float> ka = k, va = v;  // what each position holds now
  auto compare = [&](const char* what, int cs, int gs) {
    SCOPED_TRACE(what);
    StorageCounts cnt;
    compare_storage(cpu, cs, gpu, gs, ka, va, c.n_kv, c.dim, cnt);
    EXPECT_EQ(cnt.mean_mismatch, 0);
    EXPECT_EQ(cnt.exact_mismatch, 0);
    EXPECT_LE(cnt.group_mismatch, std::max<int64_t>(1, cnt.groups / 200));
    const auto q = gaussian(static_cast<size_t>(c.n_heads) * c.dim, rng);
    AttentionParams p;
    p.n_heads = c.n_heads;
    std::vector<float> want(q.size()), got(q.size()), got_std(q.size());
    const int len = cpu.length(cs);
    ASSERT_EQ(gpu.length(gs), len);
    AttentionRequest rc{cs, q.data(), 1, len - 1, want.data()}, rg{gs, q.data(), 1, len - 1, got.data()};
    attend(cpu, {&rc, 1}, p, AttentionPath::reference, pool);
    attend(gpu, {&rg, 1}, p, AttentionPath::fused);
    rg.out = got_std.data();
    attend(gpu, {&rg, 1}, p, AttentionPath::standard);
    EXPECT_LE(max_row_error(got, want, c.dim), kFp16Tolerance) << "fused, length " << len;
    EXPECT_LE(max_row_error(got_std, want, c.dim), kBf16Tolerance) << "standard, length " << len;
  };
  auto append_both = [&](int cs, int gs, int upto, bool fresh) {
    const int from = cpu.length(cs);
    if (fresh) {
      const auto nk = vectors(upto - from, c, rng, 1.5f), nv = vectors(upto - from, c, rng, 1.0f);
      std::copy(nk.begin(), nk.end(), ka.begin() + from * row);
      std::copy(nv.begin(), nv.end(), va.begin() + from * row);
    }
    cpu.append(cs, ka.data() + from * row, va.data() + from * row, upto - from);
    append_in_chunks(gpu, gs, ka.data() + from * row, va.data() + from * row, upto - from, c.n_kv, c.dim, from);
  };
  append_both(a, b, 300, false);  // runs [16, 80) .. [208, 272) complete, [272, 300) filling
  compare("300 positions", a, b);
  struct Step {
    int to, upto;
    bool fresh;
    const char* what;
  };
  const Step steps[] = {{290, 330, true, "inside the filling run, then new positions"},
                        {272, 300, false, "at the filling run's start"},
                        {240, 290, true, "inside a completed run (its means kept), then past it"},
                        {208, 208, false, "at a completed run's start"},
                        {10, 150, true, "back into the sink tier"},
                        {150, 400, true, "on again"}};
  for (const Step& s : steps) {
    cpu.truncate(a, s.to);
    gpu.truncate(b, s.to);
    append_both(a, b, s.upto, s.fresh);
    compare(s.what, a, b);
  }
  // Forks: the child copies the filling run ([400, 464) holds 20 positions at 420).
  append_both(a, b, 420, true);
  for (bool copy : {false, true}) {
    const int child_c = cpu.add_sequence(), child_g = gpu.add_sequence();
    cpu.remove_sequence(child_c);
    gpu.remove_sequence(child_g);
    cpu.fork_sequence(a, child_c, copy);
    gpu.fork_sequence(b, child_g, copy);
    // The child completes the run with other vectors than the parent's.
    const std::vector<float> keep_k = ka, keep_v = va;
    append_both(child_c, child_g, 470, true);
    compare(copy ? "copied fork, completed on its own" : "shared fork, completed on its own", child_c, child_g);
    ka = keep_k;
    va = keep_v;
    compare("the parent after its fork", a, b);
    cpu.remove_sequence(child_c);
    gpu.remove_sequence(child_g);
  }
}

TEST_F(CudaCenter, RotatingCacheMatchesTheCpu) {
  ThreadPool pool(4);
  for (int block : {64, 128}) {
    CenterCase c;
    c.k_bits = 8;
    c.v_bits = 3;
    c.center_v = true;
    c.block = block;
    c.n_heads = 16;
    c.n_kv = 4;
    c.window = 128;
    c.sinks = true;
    SCOPED_TRACE(name(c));
    KVCacheOptions opt = options(c);
    opt.window = c.window;
    KVCache cpu(c.n_kv, c.dim, opt);
    DeviceCacheCapacity cap;
    cap.max_sequences = 1;
    cap.max_tokens = 4096;
    cap.rotating_append_tokens = 256;
    DeviceKVCache gpu(c.n_kv, c.dim, opt, cap);
    const int a = cpu.add_sequence(), b = gpu.add_sequence();
    SplitMix64 rng(77 + block);
    const auto sinks = gaussian(c.n_heads, rng, 2.0f);
    AttentionParams p;
    p.n_heads = c.n_heads;
    p.window = c.window;
    p.sinks = sinks.data();
    int len = 0;
    double worst = 0, worst_std = 0;
    for (int step = 0; step < 40; ++step) {
      const int m = kChunks[step % 8] % 200 + 1;
      const auto k = vectors(m, c, rng, 1.5f), v = vectors(m, c, rng, 1.0f);
      cpu.append(a, k.data(), v.data(), m);
      gpu.append(b, k.data(), v.data(), m);
      len += m;
      ASSERT_EQ(gpu.first_kept(b), cpu.first_kept(a)) << "length " << len;
      const auto q = gaussian(static_cast<size_t>(c.n_heads) * c.dim, rng);
      std::vector<float> want(q.size()), got(q.size()), got_std(q.size());
      AttentionRequest rc{a, q.data(), 1, len - 1, want.data()}, rg{b, q.data(), 1, len - 1, got.data()};
      attend(cpu, {&rc, 1}, p, AttentionPath::reference, pool);
      attend(gpu, {&rg, 1}, p, AttentionPath::fused);
      rg.out = got_std.data();
      attend(gpu, {&rg, 1}, p, AttentionPath::standard);
      worst = std::max(worst, max_row_error(got, want, c.dim));
      worst_std = std::max(worst_std, max_row_error(got_std, want, c.dim));
    }
    std::printf("  %-90s 40 appends to %d: fused %.2e standard %.2e\n", name(c).c_str(), len, worst, worst_std);
    EXPECT_LE(worst, kFp16Tolerance);
    EXPECT_LE(worst_std, kBf16Tolerance);
  }
}

// Decode steps as the CUDA device runs them: the append and the attention recorded in a graph and
// replayed while their parameters are unchanged, the attention overlapping the append (it waits for it
// from the run holding the query's position: a step that completes a run re-encodes all of it). Every
// step against the CPU reference; the runs complete every 64 steps.
TEST_F(CudaCenter, GraphReplayedDecodeStepsWithOverlap) {
  ThreadPool pool(4);
  CenterCase c;
  c.center_v = true;
  c.min_tokens = 16;
  c.n_heads = 16;
  c.n_kv = 4;
  const KVCacheOptions opt = options(c);
  KVCache cpu(c.n_kv, c.dim, opt);
  DeviceKVCache gpu(c.n_kv, c.dim, opt, {2, 4096});
  SplitMix64 rng(2026);
  const int cs[2] = {cpu.add_sequence(), cpu.add_sequence()};
  const int gs[2] = {gpu.add_sequence(), gpu.add_sequence()};
  for (int i = 0; i < 2; ++i) {
    const int n = i == 0 ? 100 : 37;
    const auto k = vectors(n, c, rng, 1.5f), v = vectors(n, c, rng, 1.0f);
    cpu.append(cs[i], k.data(), v.data(), n);
    gpu.append(gs[i], k.data(), v.data(), n);
  }
  const size_t row = static_cast<size_t>(c.n_kv) * c.dim, per = static_cast<size_t>(c.n_heads) * c.dim;
  float *dkv = nullptr, *dq = nullptr, *dout = nullptr;
  ASSERT_EQ(cudaMalloc(&dkv, 4 * row * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dq, 2 * per * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, 2 * per * sizeof(float)), cudaSuccess);
  AttentionParams p;
  p.n_heads = c.n_heads;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  DeviceAttention attn;
  attn.set_replayable(true);
  attn.set_overlap_append(true);
  cudaGraphExec_t exec = nullptr;
  std::string signature;
  int recordings = 0, completions = 0;
  double worst = 0;
  for (int step = 0; step < 200; ++step) {
    const auto k = vectors(2, c, rng, 1.5f), v = vectors(2, c, rng, 1.0f);  // one position per sequence
    std::vector<float> kv(4 * row);
    std::copy(k.begin(), k.end(), kv.begin());
    std::copy(v.begin(), v.end(), kv.begin() + 2 * row);
    ASSERT_EQ(cudaMemcpy(dkv, kv.data(), kv.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    for (int i = 0; i < 2; ++i) cpu.append(cs[i], k.data() + i * row, v.data() + i * row, 1);
    const DeviceKVCache::Span spans[2] = {{gs[0], 1}, {gs[1], 1}};
    const AppendParams ap = gpu.prepare_append(spans, dkv, dkv + 2 * row, stream);
    completions += ap.n_mean_jobs > 0;
    const auto q = gaussian(2 * per, rng);
    ASSERT_EQ(cudaMemcpy(dq, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    const DeviceAttentionRequest reqs[2] = {{gs[0], dq, 1, gpu.length(gs[0]) - 1, dout}, {gs[1], dq + per, 1, gpu.length(gs[1]) - 1, dout + per}};
    attn.plan(gpu, reqs, p, AttentionPath::fused, stream);
    std::string sig(reinterpret_cast<const char*>(&ap), sizeof ap);
    sig += attn.launch_signature();
    if (!exec || sig != signature) {
      if (exec) cudaGraphExecDestroy(exec);
      cudaGraph_t graph;
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      gpu.launch_append(ap, stream);
      attn.run(stream);
      ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      cudaGraphDestroy(graph);
      signature = sig;
      ++recordings;
    }
    ASSERT_EQ(cudaMemsetAsync(dout, 0xff, 2 * per * sizeof(float), stream), cudaSuccess);  // NaN poison
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> got(2 * per), want(2 * per);
    ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    const AttentionRequest rc[2] = {{cs[0], q.data(), 1, cpu.length(cs[0]) - 1, want.data()},
                                    {cs[1], q.data() + per, 1, cpu.length(cs[1]) - 1, want.data() + per}};
    attend(cpu, rc, p, AttentionPath::reference, pool);
    const double e = max_row_error(got, want, c.dim);
    worst = std::max(worst, e);
    ASSERT_LE(e, kFp16Tolerance) << "step " << step << " (lengths " << cpu.length(cs[0]) << ", " << cpu.length(cs[1]) << ")";
  }
  std::printf("  200 decode steps of 2 sequences: %d runs completed, %d recordings, worst row error %.2e\n", completions, recordings, worst);
  EXPECT_GE(completions, 5);
  EXPECT_LT(recordings, 200) << "steps that complete no run should replay the recorded graph";
  if (exec) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  cudaFree(dkv);
  cudaFree(dq);
  cudaFree(dout);
}

std::string message(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST_F(CudaCenter, RefusesWhatThePagesCannotHold) {
  CenterCase c;
  KVCacheOptions short_runs = options(c);
  short_runs.center_tokens = 8;  // below a tile
  EXPECT_NE(message([&] { DeviceKVCache g(2, 128, short_runs, {1, 64}); }).find("centring runs of 8"), std::string::npos);
  KVCacheOptions long_runs = options(c);
  long_runs.center_tokens = 128;  // more than the page of 64
  EXPECT_NE(message([&] { DeviceKVCache g(2, 128, long_runs, {1, 64}); }).find("centring runs of 128"), std::string::npos);
  KVCacheOptions dense;
  dense.k.type = dense.v.type = KVType::f16;
  dense.center_v = true;
  EXPECT_NE(message([&] { DeviceKVCache g(2, 128, dense, {1, 64}); }).find("centring needs quantized"), std::string::npos);
  // A centred cache's pools are counted in what it holds on the device.
  DeviceKVCache plain(2, 128, options(CenterCase{.center_k = false}), {1, 640});
  DeviceKVCache centred(2, 128, options(c), {1, 640});
  EXPECT_GT(centred.device_bytes(), plain.device_bytes());
  EXPECT_NE(centred.describe().find("centred per 64"), std::string::npos) << centred.describe();
}

}  // namespace
}  // namespace tq::cuda
