#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "hwy/tests/hwy_gtest.h"
#include "core/aligned.h"
#include "kv/block_pool.h"
#include "kv/cache.h"

namespace tq {
namespace {

std::vector<float> gaussian(size_t n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

std::string temp_path(const std::string& name) { return testing::TempDir() + "/" + name; }

// f() throws an Error whose message mentions `needle`.
void expect_error_mentioning(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}
void expect_load_error(const std::string& path, const std::string& needle) {
  expect_error_mentioning([&] { KVCache::load(path); }, needle);
}


VectorFormatSpec tq_spec(int bits, int group = 64) {
  VectorFormatSpec s;
  s.type = KVType::turboquant;
  s.quantizer = QuantizerOptions::defaults(bits);
  s.quantizer.group_size = group;
  return s;
}

std::vector<VectorFormatSpec> all_specs() {
  std::vector<VectorFormatSpec> specs;
  for (KVType t : {KVType::f32, KVType::f16, KVType::bf16, KVType::q8_0, KVType::q4_0}) {
    VectorFormatSpec s;
    s.type = t;
    specs.push_back(s);
    if (t == KVType::q8_0 || t == KVType::q4_0) {
      s.rotate = true;
      specs.push_back(s);
    }
  }
  for (int b = 2; b <= 8; ++b)
    for (int g : {32, 64, 128}) specs.push_back(tq_spec(b, g));
  auto lm8 = tq_spec(8);
  lm8.quantizer.grid = Grid::lloyd_max;
  specs.push_back(lm8);
  return specs;
}

class RecordTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(RecordTargets);

TEST_P(RecordTargets, SimdDecodeMatchesScalarForEveryFormat) {
  for (int dim : {64, 128, 256}) {
    for (const auto& spec : all_specs()) {
      if (spec.type == KVType::turboquant && dim % spec.quantizer.group_size != 0) continue;
      const VectorFormat f(dim, spec);
      const int count = 5;
      const auto x = gaussian(static_cast<size_t>(dim) * count, dim + 7);
      std::vector<uint8_t> recs(f.record_bytes() * count);
      for (int i = 0; i < count; ++i) f.encode(x.data() + i * dim, recs.data() + i * f.record_bytes());
      std::vector<float> simd(static_cast<size_t>(dim) * count), ref(simd.size());
      kernels::decode_records(f.plan(), recs.data(), f.record_bytes(), count, simd.data());
      for (int i = 0; i < count; ++i) scalar::decode_record(f.plan(), recs.data() + i * f.record_bytes(), ref.data() + i * dim);
      for (size_t i = 0; i < simd.size(); ++i) ASSERT_EQ(simd[i], ref[i]) << f.describe() << " dim " << dim << " i " << i;
      // And the round trip is close to the input.
      std::vector<float> back(dim);
      f.decode(recs.data(), back.data());
      double err = 0, norm = 0;
      for (int j = 0; j < dim; ++j) {
        err += (back[j] - x[j]) * (back[j] - x[j]);
        norm += x[j] * x[j];
      }
      EXPECT_LT(err / norm, 0.2) << f.describe();
    }
  }
}

TEST_P(RecordTargets, ColumnRegionsDecodeLikeRecords) {
  const int T = 64;
  for (int dim : {64, 128}) {
    for (const auto& spec : all_specs()) {
      if (spec.type == KVType::turboquant && dim % spec.quantizer.group_size != 0) continue;
      const VectorFormat f(dim, spec);
      if (!f.supports_columns()) continue;
      const auto x = gaussian(static_cast<size_t>(dim) * T, dim + 3);
      std::vector<uint8_t> region(f.record_bytes() * T, 0), rec(f.record_bytes());
      for (int t = 0; t < T; ++t) f.encode_column(x.data() + t * dim, region.data(), T, t);
      AlignedVector<float> cols(static_cast<size_t>(dim) * 16);
      std::vector<float> one(dim), expect(dim);
      for (int t0 = 0; t0 < T; t0 += 16) {
        kernels::decode_columns(f.plan(), region.data(), T, t0, cols.data());
        for (int t = t0; t < t0 + 16; ++t) {
          f.encode(x.data() + t * dim, rec.data());
          f.decode_stored(rec.data(), expect.data());
          f.decode_column_stored(region.data(), T, t, one.data());
          for (int j = 0; j < dim; ++j) {
            ASSERT_EQ(one[j], expect[j]) << f.describe();
            ASSERT_EQ(cols[j * 16 + (t - t0)], expect[j]) << f.describe() << " t " << t << " j " << j;
          }
        }
      }
    }
  }
}

TEST(VectorFormat, RecordSizesMatchTheFormula) {
  EXPECT_EQ(VectorFormat(128, tq_spec(8)).record_bytes(), 128u + 4u);  // K8: codes + 2 scales
  EXPECT_EQ(VectorFormat(128, tq_spec(3)).record_bytes(), 48u + 4u);   // V3
  EXPECT_EQ(VectorFormat(128, tq_spec(4, 128)).record_bytes(), 64u + 2u);
  VectorFormatSpec q8;
  q8.type = KVType::q8_0;
  EXPECT_EQ(VectorFormat(128, q8).record_bytes(), 4u * 34u);
  q8.type = KVType::q4_0;
  EXPECT_EQ(VectorFormat(128, q8).record_bytes(), 4u * 18u);
  VectorFormatSpec f16;
  EXPECT_EQ(VectorFormat(128, f16).record_bytes(), 256u);
}

KVCacheOptions tq_options(int k_bits, int v_bits, int min_tokens, int window = 0, int block = 16) {
  TurboQuantCacheOptions o;
  o.k_bits = k_bits;
  o.v_bits = v_bits;
  o.min_tokens_before_quant = min_tokens;
  o.block_tokens = block;
  return turboquant_cache_options(o, window);
}

// A small K8/V3 cache (sequence 0, 10 positions) saved to `path`; returns the file's bytes.
std::vector<uint8_t> save_small_cache(const std::string& path, uint64_t seed) {
  KVCache cache(1, 64, tq_options(8, 3, 0));
  const int s = cache.add_sequence();
  const auto x = gaussian(10 * 64, seed);
  cache.append(s, x.data(), x.data(), 10);
  cache.save(path);
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

TEST(KVCache, AppendAndReadAcrossTiersBlocksAndSequences) {
  const int H = 2, D = 64;
  KVCache cache(H, D, tq_options(8, 4, 5));
  const VectorFormat& kf = cache.k_format();
  const VectorFormat& vf = cache.v_format();
  const int a = cache.add_sequence(), b = cache.add_sequence();
  EXPECT_NE(a, b);
  const auto ka = gaussian(40 * H * D, 1), va = gaussian(40 * H * D, 2);
  const auto kb = gaussian(9 * H * D, 3), vb = gaussian(9 * H * D, 4);
  cache.append(a, ka.data(), va.data(), 17);          // crosses the sink tier and a block
  cache.append(b, kb.data(), vb.data(), 9);
  cache.append(a, ka.data() + 17 * H * D, va.data() + 17 * H * D, 23);
  EXPECT_EQ(cache.length(a), 40);
  EXPECT_EQ(cache.length(b), 9);
  std::vector<float> k(H * D), v(H * D), expect_k(D), expect_v(D);
  for (int pos = 0; pos < 40; ++pos) {
    cache.read(a, pos, k.data(), v.data());
    for (int h = 0; h < H; ++h) {
      const float* xk = ka.data() + (pos * H + h) * D;
      const float* xv = va.data() + (pos * H + h) * D;
      if (pos < 5) {  // sink tier: FP16 values
        for (int j = 0; j < D; ++j) {
          EXPECT_EQ(k[h * D + j], round_to_f16(xk[j]));
          EXPECT_EQ(v[h * D + j], round_to_f16(xv[j]));
        }
      } else {  // main tier: exactly what the format encodes
        std::vector<uint8_t> rk(kf.record_bytes()), rv(vf.record_bytes());
        kf.encode(xk, rk.data());
        vf.encode(xv, rv.data());
        kf.decode(rk.data(), expect_k.data());
        vf.decode(rv.data(), expect_v.data());
        for (int j = 0; j < D; ++j) {
          EXPECT_EQ(k[h * D + j], expect_k[j]);
          EXPECT_EQ(v[h * D + j], expect_v[j]);
        }
      }
    }
  }
  std::vector<Segment> segs;
  cache.segments(a, segs);
  ASSERT_EQ(segs.size(), 1u + 3u);  // sink + ceil(35 / 16) blocks
  EXPECT_EQ(segs[0].n_tokens, 5);
  EXPECT_EQ(segs[1].first_pos, 5);
  EXPECT_EQ(segs[3].first_pos, 37);
  EXPECT_EQ(segs[3].n_tokens, 3);
  cache.remove_sequence(b);
  EXPECT_FALSE(cache.has_sequence(b));
  EXPECT_THROW(cache.length(b), Error);
  EXPECT_THROW(cache.read(a, 40, k.data(), v.data()), Error);
}

TEST(KVCache, MemoryAccountingEqualsTheFormula) {
  const int H = 8, D = 128;
  KVCache cache(H, D, tq_options(8, 3, 128, 0, 64));
  const int seq = cache.add_sequence();
  const auto k = gaussian(1000 * H * D, 5);
  cache.append(seq, k.data(), k.data(), 1000);
  const MemoryUsage m = cache.memory();
  // docs/FORMATS.md: main tier H * ((D + 2 D/64) + (3D/8 + 2 D/64)) = 8 * (132 + 52) = 1472 B per position;
  // sink tier H * 2 * 2D = 4096 B per position.
  EXPECT_EQ(cache.main_bytes_per_token(), 1472u);
  EXPECT_EQ(cache.sink_bytes_per_token(), 4096u);
  EXPECT_EQ(m.sink_tokens, 128);
  EXPECT_EQ(m.main_tokens, 872);
  EXPECT_EQ(m.sink_bytes, 128 * 4096);
  EXPECT_EQ(m.main_bytes, 872 * 1472);
  EXPECT_EQ(m.fp16_bytes, 1000 * 4096);
  EXPECT_GE(m.allocated_bytes, m.bytes_in_use());
  EXPECT_LT(m.allocated_bytes, m.bytes_in_use() + 16 * 64 * 1472 + 64 * 16);  // at most one chunk of spare blocks
}

TEST(BlockPool, LaterChunksFillHugePagesAndBlocksNeverOverlap) {
  // docs/FORMATS.md: K8/V3, H = 8, D = 128, g = 64, T = 256 blocks of 376,832 B: 5 per 2 MiB page.
  EXPECT_EQ(BlockPool::later_chunk_blocks(376832, 4), 5);
  EXPECT_EQ(BlockPool::later_chunk_blocks(size_t{1} << 20, 4), 4);  // FP16 blocks: the first chunk is 4 MiB already
  EXPECT_EQ(BlockPool::later_chunk_blocks(1500 * 1024, 1), 4);      // 4 blocks in 3 pages: 0.14 MiB left over
  for (size_t block_bytes : {size_t{64}, size_t{4160}, size_t{376832}, size_t{700000}, size_t{3} << 20}) {
    const size_t lb = BlockPool::later_chunk_blocks(block_bytes, 1);
    const size_t chunk = lb * block_bytes;
    if (block_bytes + 64 < (size_t{2} << 20)) {
      const size_t pages = (chunk + 64 + (size_t{2} << 20) - 1) / (size_t{2} << 20);
      EXPECT_LE(pages * (size_t{2} << 20) - chunk, pages * (size_t{2} << 20) / 8) << block_bytes;
    }
  }
  BlockPool pool(376832, 4);
  std::vector<int> ids;
  for (int i = 0; i < 16; ++i) ids.push_back(pool.allocate());  // chunks of 4, 5, 5, 5 blocks
  EXPECT_EQ(pool.blocks_allocated(), 19u);
  EXPECT_EQ(pool.bytes_allocated(), 19u * 376832);
  for (int id : ids) std::memset(pool.data(id), id + 1, pool.block_bytes());
  for (int id : ids) {
    const uint8_t* b = pool.data(id);
    EXPECT_EQ(b[0], id + 1);
    EXPECT_EQ(b[pool.block_bytes() - 1], id + 1) << "block " << id << " overlaps another";
  }
  // A later chunk starts on a 2 MiB boundary (the huge-page alignment).
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool.data(4)) % (uintptr_t{2} << 20), 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool.data(9)) % (uintptr_t{2} << 20), 0u);
  pool.release(ids[3]);
  EXPECT_EQ(pool.allocate(), ids[3]);
}

TEST(KVCache, LongSequencesAllocateHugePageChunks) {
  KVCacheOptions o;
  o.k = tq_spec(8);
  o.v = tq_spec(3);
  o.block_tokens = 256;
  KVCache cache(8, 128, o);
  const int seq = cache.add_sequence();
  const auto k = gaussian(3000 * 8 * 128, 9);
  cache.append(seq, k.data(), k.data(), 3000);
  // 12 blocks in use: chunks of 4, 5 and 5 blocks (docs/FORMATS.md).
  EXPECT_EQ(cache.memory().main_bytes, 3000 * 8 * (132 + 52));
  EXPECT_EQ(cache.memory().allocated_bytes, 14 * 376832);
}

TEST(KVCache, RotatingCacheGivesBackBlocksOutsideTheWindow) {
  const int H = 1, D = 64, W = 40;
  KVCacheOptions o;
  o.window = W;
  o.block_tokens = 16;
  KVCache cache(H, D, o);
  const int seq = cache.add_sequence();
  const auto x = gaussian(500 * D, 9);
  for (int pos = 0; pos < 500; ++pos) cache.append(seq, x.data() + pos * D, x.data() + pos * D, 1);
  EXPECT_EQ(cache.length(seq), 500);
  EXPECT_LE(500 - cache.first_kept(seq), W + 16);
  EXPECT_GE(500 - cache.first_kept(seq), W - 1);
  EXPECT_LE(cache.memory().main_tokens, W + 16);
  std::vector<float> k(D), v(D);
  cache.read(seq, 499 - W + 1, k.data(), v.data());
  for (int j = 0; j < D; ++j) EXPECT_EQ(k[j], round_to_f16(x[(499 - W + 1) * D + j]));
  EXPECT_THROW(cache.read(seq, 10, k.data(), v.data()), Error);
}

TEST(KVCache, SaveLoadRoundTripIsExact) {
  const int H = 2, D = 64;
  for (int window : {0, 24}) {
    KVCache cache(H, D, tq_options(4, 3, 3, window));
    const int a = cache.add_sequence(), b = cache.add_sequence();
    const auto x = gaussian(60 * H * D, 11);
    cache.append(a, x.data(), x.data() + 1, 50);
    cache.append(b, x.data() + 7, x.data() + 3, 2);
    cache.set_fused(true);
    const std::string path = temp_path("cache_roundtrip.tqkv");
    cache.save(path);
    const auto loaded = KVCache::load(path);
    EXPECT_TRUE(loaded->fused());
    EXPECT_EQ(loaded->describe(), cache.describe());
    for (int seq : {a, b}) {
      ASSERT_EQ(loaded->length(seq), cache.length(seq));
      EXPECT_EQ(loaded->first_kept(seq), cache.first_kept(seq));
      std::vector<float> k1(H * D), v1(H * D), k2(H * D), v2(H * D);
      for (int pos = cache.first_kept(seq); pos < cache.length(seq); ++pos) {
        if (pos < 3 && pos >= cache.length(seq)) continue;
        cache.read(seq, pos, k1.data(), v1.data());
        loaded->read(seq, pos, k2.data(), v2.data());
        EXPECT_EQ(k1, k2);
        EXPECT_EQ(v1, v2);
      }
    }
    EXPECT_EQ(loaded->memory().bytes_in_use(), cache.memory().bytes_in_use());
  }
}

TEST(KVCache, CorruptFilesGiveClearErrors) {
  const std::string path = temp_path("cache_corrupt.tqkv");
  const std::vector<uint8_t> bytes = save_small_cache(path, 12);
  auto flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x40;
  write_file(path, flipped);
  expect_load_error(path, "checksum");
  write_file(path, std::vector<uint8_t>(bytes.begin(), bytes.begin() + 100));
  expect_load_error(path, "checksum");
  write_file(path, std::vector<uint8_t>(bytes.begin(), bytes.begin() + 10));
  expect_load_error(path, "truncated");
  auto magic = bytes;
  magic[0] = 'X';
  write_file(path, magic);
  expect_load_error(path, "bad magic");
  expect_load_error(path, "bad magic");  // a failed load leaves the file and the next load alone
  auto newer = bytes;
  newer[8] ^= 0x02;  // the u32 version after the magic
  write_file(path, newer);
  expect_load_error(path, "this build reads version");
  std::remove(path.c_str());
  expect_load_error(path, "cannot open");
}

// Files whose checksum is right but whose header lies (written by another tool, or edited): the
// header's own checks must catch them.
TEST(KVCache, ConsistentChecksumWithABadHeaderGivesClearErrors) {
  const std::string path = temp_path("cache_bad_header.tqkv");
  const std::vector<uint8_t> bytes = save_small_cache(path, 13);
  const int s = 0;
  uint32_t len;
  std::memcpy(&len, bytes.data() + 12, 4);
  const nlohmann::json header = nlohmann::json::parse(bytes.begin() + 16, bytes.begin() + 16 + len);
  const std::vector<uint8_t> payload(bytes.begin() + 16 + len, bytes.end() - 8);
  // The file with `h` as its header and a correct FNV-1a checksum over everything before it.
  auto write_with_header = [&](const nlohmann::json& h) {
    const std::string text = h.dump();
    std::vector<uint8_t> out(bytes.begin(), bytes.begin() + 12);
    const uint32_t n = static_cast<uint32_t>(text.size());
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&n), reinterpret_cast<const uint8_t*>(&n) + 4);
    out.insert(out.end(), text.begin(), text.end());
    out.insert(out.end(), payload.begin(), payload.end());
    uint64_t hash = 0xcbf29ce484222325ull;
    for (uint8_t b : out) hash = (hash ^ b) * 0x100000001b3ull;
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&hash), reinterpret_cast<const uint8_t*>(&hash) + 8);
    write_file(path, out);
  };
  auto expect_error = [&](const std::string& needle) { expect_load_error(path, needle); };
  write_with_header(header);
  EXPECT_EQ(KVCache::load(path)->length(s), 10);  // the rewriting itself is faithful

  auto h = header;
  h["sequences"][0].erase("length");
  write_with_header(h);
  expect_error("malformed sequence list");
  h = header;
  h["sequences"].push_back(h["sequences"][0]);
  write_with_header(h);
  expect_error("already exists");
  h = header;
  h.erase("block_tokens");
  write_with_header(h);
  expect_error("malformed header");
  // One field replaced (a JSON pointer and its value) and the error it must give. Sizes no cache has are
  // refused before anything is allocated for them (2^31 - 1 KV heads threw std::bad_alloc), and numbers
  // are whole and in range (4294967296 was read as 0, 1e300 as whatever the conversion gave).
  struct Edit {
    const char* pointer;
    nlohmann::json value;
    const char* needle;
  };
  const std::vector<Edit> edits = {
      {"/sequences/0/length", 1000, "payload shorter than its header says"},
      {"/sequences/0/length", 0, "unexpected trailing bytes"},  // no positions: none of the block is read
      {"/sequences/0/length", -1, "inconsistent sequence"},
      {"/sequences/0/length", 2.5, "'length' must be an integer"},
      {"/head_dim", -64, "head"},
      {"/head_dim", 1000000, "head dimension must be at most 65536"},
      {"/n_kv_heads", 2147483647, "KV cache needs 1..65536 KV heads, got 2147483647"},
      {"/min_tokens", (1 << 20) + 1, "min_tokens_before_quant must be 0..1048576"},
      {"/window", 4294967296LL, "'window' must be an integer from -2147483648 to 2147483647, got 4294967296"},
      {"/k/seed", 1e300, "'seed' must be an integer from 0 to 18446744073709551615"},
  };
  for (const Edit& e : edits) {
    SCOPED_TRACE(std::string(e.pointer) + " = " + e.value.dump());
    h = header;
    h[nlohmann::json::json_pointer(e.pointer)] = e.value;
    write_with_header(h);
    expect_error(e.needle);
  }
  std::remove(path.c_str());
}

TEST(PromptCache, MakeConvertAndEnableFused) {
  std::vector<LayerSpec> layers(4);
  for (auto& l : layers) {
    l.n_kv_heads = 2;
    l.head_dim = 64;
  }
  layers[1].kind = LayerKind::sliding_attention;
  layers[1].window = 32;
  layers[2].kind = LayerKind::linear_attention;
  layers[2].state = StateShape{8, 4, 2, 16, 16};
  PromptCache caches = make_prompt_cache(layers);
  ASSERT_EQ(caches.size(), 4u);
  auto* full = dynamic_cast<KVCache*>(caches[0].get());
  ASSERT_NE(full, nullptr);
  const int seq = full->add_sequence();
  const auto x = gaussian(20 * 2 * 64, 13);
  full->append(seq, x.data(), x.data(), 20);  // prefill in FP16, convert after
  auto* state = dynamic_cast<StateCache*>(caches[2].get());
  ASSERT_NE(state, nullptr);
  const int sseq = state->add_sequence();
  state->recurrent_state(sseq)[5] = 1.0f;
  EXPECT_EQ(state->memory().main_bytes, static_cast<int64_t>((8 * 3 + 2 * 16 * 16) * 4));

  TurboQuantCacheOptions o;
  o.min_tokens_before_quant = 4;
  EXPECT_EQ(convert_cache_to_turboquant(caches, o), 2);  // layers 0 and 3; not the rotating or state ones
  auto* converted = dynamic_cast<KVCache*>(caches[0].get());
  ASSERT_NE(converted, nullptr);
  EXPECT_EQ(converted->k_format().type(), KVType::turboquant);
  EXPECT_EQ(converted->length(seq), 20);
  EXPECT_EQ(converted->memory().sink_tokens, 4);
  EXPECT_EQ(dynamic_cast<KVCache*>(caches[1].get())->k_format().type(), KVType::f16);
  EXPECT_EQ(dynamic_cast<StateCache*>(caches[2].get())->recurrent_state(sseq)[5], 1.0f);
  // The converted cache holds the quantized image of the FP16 values.
  std::vector<float> k(2 * 64), v(2 * 64), rk(64), back(64);
  converted->read(seq, 10, k.data(), v.data());
  std::vector<float> src(64);
  for (int j = 0; j < 64; ++j) src[j] = round_to_f16(x[(10 * 2 + 1) * 64 + j]);
  std::vector<uint8_t> rec(converted->k_format().record_bytes());
  converted->k_format().encode(src.data(), rec.data());
  converted->k_format().decode(rec.data(), back.data());
  for (int j = 0; j < 64; ++j) EXPECT_EQ(k[64 + j], back[j]);
  EXPECT_EQ(enable_fused_attend(caches), 3);
  EXPECT_TRUE(converted->fused());
  o.compress_rotating = true;
  EXPECT_EQ(convert_cache_to_turboquant(caches, o), 1);  // now the rotating one
}

// A long prompt prefilled in FP16 has already left a sliding window's oldest blocks behind; with
// compress_rotating the rotating cache still converts, from its oldest held position on, and goes on
// rotating, saving and loading like one that was compressed from the start.
TEST(PromptCache, ConvertsARotatingCacheThatDroppedPositions) {
  const int H = 2, D = 64, W = 40;
  PromptCache caches = make_prompt_cache({LayerSpec{LayerKind::sliding_attention, H, D, W, StateShape{}}}, KVType::f16, 16);
  auto* dense = dynamic_cast<KVCache*>(caches[0].get());
  ASSERT_NE(dense, nullptr);
  const int seq = dense->add_sequence();
  const auto k = gaussian(300 * H * D, 31), v = gaussian(300 * H * D, 32);
  dense->append(seq, k.data(), v.data(), 200);
  dense->append(seq, k.data() + 200 * H * D, v.data() + 200 * H * D, 50);  // drops what position 200 cannot see
  const int first = dense->first_kept(seq);
  ASSERT_GT(first, 0);

  TurboQuantCacheOptions o;
  o.compress_rotating = true;
  o.min_tokens_before_quant = 4;  // no sink tier for this layer: positions 0..3 are gone
  o.block_tokens = 64;            // a block grid other than the dense cache's
  ASSERT_EQ(convert_cache_to_turboquant(caches, o), 1);
  auto* tq = dynamic_cast<KVCache*>(caches[0].get());
  ASSERT_NE(tq, nullptr);
  EXPECT_EQ(tq->k_format().type(), KVType::turboquant);
  EXPECT_EQ(tq->options().min_tokens, 0);
  EXPECT_EQ(tq->length(seq), 250);
  EXPECT_EQ(tq->first_kept(seq), first);
  EXPECT_EQ(tq->memory().main_tokens, 250 - first);
  EXPECT_EQ(tq->memory().main_bytes, static_cast<int64_t>((250 - first) * tq->main_bytes_per_token()));
  std::vector<float> dk(H * D), dv(H * D), got_k(H * D), got_v(H * D), rec_k(D);
  std::vector<uint8_t> rec(tq->k_format().record_bytes());
  for (int pos = first; pos < 250; pos += 37) {  // the quantized image of what the FP16 cache held
    tq->read(seq, pos, got_k.data(), got_v.data());
    std::vector<float> src(D);
    for (int j = 0; j < D; ++j) src[j] = round_to_f16(k[(static_cast<size_t>(pos) * H + 1) * D + j]);
    tq->k_format().encode(src.data(), rec.data());
    tq->k_format().decode(rec.data(), rec_k.data());
    for (int j = 0; j < D; ++j) EXPECT_EQ(got_k[D + j], rec_k[j]) << "position " << pos;
  }
  EXPECT_THROW(tq->read(seq, first - 1, got_k.data(), got_v.data()), Error);

  for (int pos = 250; pos < 300; pos += 25) tq->append(seq, k.data() + pos * H * D, v.data() + pos * H * D, 25);  // goes on rotating
  EXPECT_EQ(tq->length(seq), 300);
  EXPECT_LE(300 - tq->first_kept(seq), W + 64);
  EXPECT_GE(300 - tq->first_kept(seq), W - 1);
  const std::string path = temp_path("converted_rotating.tqkv");
  tq->save(path);
  const auto loaded = KVCache::load(path);
  EXPECT_EQ(loaded->first_kept(seq), tq->first_kept(seq));
  for (int pos = tq->first_kept(seq); pos < 300; ++pos) {
    tq->read(seq, pos, dk.data(), dv.data());
    loaded->read(seq, pos, got_k.data(), got_v.data());
    ASSERT_EQ(dk, got_k) << "position " << pos;
    ASSERT_EQ(dv, got_v) << "position " << pos;
  }
  std::remove(path.c_str());
  KVCache with_sinks(H, D, tq_options(8, 3, 4));
  EXPECT_THROW(with_sinks.add_sequence_from(0, 100), Error);  // its sink tier would be gone
}

// Reads every position of a sequence (K and V, original domain): [length][2][H][D].
std::vector<float> read_all(const KVCache& c, int seq) {
  const size_t per = static_cast<size_t>(c.n_kv_heads()) * c.head_dim();
  std::vector<float> out(static_cast<size_t>(c.length(seq)) * 2 * per);
  for (int p = 0; p < c.length(seq); ++p) c.read(seq, p, out.data() + 2 * p * per, out.data() + (2 * p + 1) * per);
  return out;
}

KVCacheOptions small_blocks(const VectorFormatSpec& spec, int min_tokens = 0) {
  KVCacheOptions o;
  o.k = o.v = spec;
  o.block_tokens = 16;
  o.min_tokens = min_tokens;
  return o;
}

TEST(KVCache, ForkSharesBlocksAndCopiesOnWrite) {
  for (const VectorFormatSpec& spec : {tq_spec(3), VectorFormatSpec{}}) {
    KVCache c(2, 64, small_blocks(spec, 4));
    const int parent = c.add_sequence();
    const auto kv = gaussian(41 * 2 * 64 * 2, 7);
    const float* k = kv.data();
    const float* v = kv.data() + 41 * 2 * 64;
    c.append(parent, k, v, 36);  // 4 sink positions, 2 full blocks of 16, none partial
    c.append(parent, k + 36 * 128, v + 36 * 128, 2);  // a third block, partly filled
    EXPECT_EQ(c.memory().blocks_in_use, 3);
    c.fork_sequence(parent, 5);
    // The child holds the same positions in the same blocks: none was allocated or copied.
    EXPECT_EQ(c.length(5), 38);
    EXPECT_EQ(c.memory().blocks_in_use, 3);
    EXPECT_EQ(c.memory().blocks_shared, 3);
    EXPECT_EQ(read_all(c, 5), read_all(c, parent));
    // Appending to the child copies the partly filled block it shares (one more block), nothing else.
    EXPECT_EQ(c.demand({{5, 1}}).needed, 1);
    c.append(5, k + 38 * 128, v + 38 * 128, 1);
    EXPECT_EQ(c.memory().blocks_in_use, 4);
    EXPECT_EQ(c.memory().blocks_shared, 2);
    // The parent owns its partial block alone now: appending writes in place.
    EXPECT_EQ(c.demand({{parent, 1}}).needed, 0);
    c.append(parent, k + 39 * 128, v + 39 * 128, 1);
    EXPECT_EQ(c.memory().blocks_in_use, 4);
    // They diverged at position 38; what came before is still the same.
    const auto a = read_all(c, parent), b = read_all(c, 5);
    const size_t per_pos = 2 * 2 * 64;
    EXPECT_TRUE(std::equal(a.begin(), a.begin() + 38 * per_pos, b.begin()));
    EXPECT_FALSE(std::equal(a.begin() + 38 * per_pos, a.end(), b.begin() + 38 * per_pos));
    // Removing the parent leaves the child's positions intact and frees only the parent's own block.
    c.remove_sequence(parent);
    EXPECT_EQ(c.memory().blocks_in_use, 3);
    EXPECT_EQ(c.memory().blocks_shared, 0);
    EXPECT_EQ(read_all(c, 5), b);
  }
}

TEST(KVCache, TruncateThenAppendEqualsNeverHavingAppended) {
  for (const VectorFormatSpec& spec : {tq_spec(4), tq_spec(8), VectorFormatSpec{}}) {
    const auto kv = gaussian(60 * 2 * 64 * 2, 11);
    const float* k = kv.data();
    const float* v = kv.data() + 60 * 2 * 64;
    const auto other = gaussian(60 * 2 * 64 * 2, 12);
    KVCache once(2, 64, small_blocks(spec, 3)), again(2, 64, small_blocks(spec, 3));
    const int a = once.add_sequence(), b = again.add_sequence();
    once.append(a, k, v, 50);
    // `again` appends 20 positions, then 25 others it takes back, then the same 30 as `once`.
    again.append(b, k, v, 20);
    again.append(b, other.data(), other.data() + 60 * 128, 25);
    EXPECT_EQ(again.memory().blocks_in_use, 3);
    again.truncate(b, 20);
    EXPECT_EQ(again.length(b), 20);
    EXPECT_EQ(again.memory().blocks_in_use, 2);  // 3 sink positions, then positions 3..18 and 19
    again.append(b, k + 20 * 128, v + 20 * 128, 30);
    EXPECT_EQ(read_all(again, b), read_all(once, a));
    // Back into the sink tier and up again.
    again.truncate(b, 2);
    EXPECT_EQ(again.memory().blocks_in_use, 0);
    again.append(b, k + 2 * 128, v + 2 * 128, 48);
    EXPECT_EQ(read_all(again, b), read_all(once, a));
    expect_error_mentioning([&] { again.truncate(b, 51); }, "holds 50");
    expect_error_mentioning([&] { again.truncate(b, -1); }, "cannot truncate");
  }
}

TEST(KVCache, TruncatingARotatingCacheNeedsItsWindow) {
  KVCacheOptions o = small_blocks(VectorFormatSpec{});
  o.window = 20;
  KVCache c(1, 64, o);
  const int s = c.add_sequence();
  const auto kv = gaussian(100 * 64 * 2, 3);
  for (int p = 0; p < 100; ++p) c.append(s, kv.data() + p * 64, kv.data() + (100 + p) * 64, 1);
  EXPECT_GT(c.first_kept(s), 0);
  ASSERT_EQ(c.first_kept(s), 80);  // blocks of 16: 80..99 holds the last 20
  c.truncate(s, 99);                // the next query sees 80..98, still held
  expect_error_mentioning([&] { c.truncate(s, 90); }, "positions before 80 are no longer held (they left the sliding window)");
}

TEST(KVCache, ABoundedPoolSaysWhatAnAppendNeeds) {
  KVCacheOptions o = small_blocks(tq_spec(3));
  o.max_blocks = 2;
  KVCache c(2, 64, o);
  const int s = c.add_sequence(), t = c.add_sequence();
  const auto kv = gaussian(40 * 2 * 64 * 2, 5);
  const BlockDemand d = c.demand({{s, 20}, {t, 1}});
  EXPECT_EQ(d.needed, 3);
  EXPECT_EQ(d.available, 2);
  EXPECT_EQ(d.capacity, 2);
  c.append(s, kv.data(), kv.data() + 40 * 128, 20);
  EXPECT_EQ(c.demand({{t, 1}}).available, 0);
  expect_error_mentioning([&] { c.append(t, kv.data(), kv.data() + 40 * 128, 1); }, "the KV block pool is full");
  c.remove_sequence(s);
  EXPECT_EQ(c.demand({{t, 1}}).available, 2);
}

TEST(StateCache, ForkCopiesAndTruncateCannotGoBack) {
  StateShape shape;
  shape.conv_channels = 4;
  shape.conv_kernel = 3;
  shape.state_heads = 2;
  shape.state_dk = 3;
  shape.state_dv = 3;
  StateCache c(shape);
  const int s = c.add_sequence();
  c.recurrent_state(s)[5] = 2.5f;
  c.advance(s, 7);
  c.fork_sequence(s, 9);
  EXPECT_EQ(c.length(9), 7);
  EXPECT_EQ(c.recurrent_state(9)[5], 2.5f);
  c.recurrent_state(9)[5] = 1.0f;
  EXPECT_EQ(c.recurrent_state(s)[5], 2.5f);
  c.truncate(s, 7);
  expect_error_mentioning([&] { c.truncate(s, 3); }, "a recurrent state holds no earlier positions");
}

TEST(StateCache, SnapshotRestoreGoesBackAndTruncateStaysRefused) {
  StateShape shape;
  shape.conv_channels = 5;
  shape.conv_kernel = 4;
  shape.state_heads = 2;
  shape.state_dk = 3;
  shape.state_dv = 4;
  StateCache c(shape);
  const int s = c.add_sequence();
  for (int i = 0; i < 15; ++i) c.conv_state(s)[i] = static_cast<float>(i);
  for (int i = 0; i < 24; ++i) c.recurrent_state(s)[i] = static_cast<float>(100 + i);
  c.advance(s, 32);
  const StateSnapshot snap = c.snapshot(s);
  EXPECT_EQ(snap.length(), 32);
  EXPECT_EQ(snap.bytes(), (15 + 24) * 4);
  // The state moves on; the snapshot does not.
  c.conv_state(s)[3] = -1.0f;
  c.recurrent_state(s)[7] = -2.0f;
  c.advance(s, 10);
  expect_error_mentioning([&] { c.truncate(s, 32); }, "cannot truncate sequence 0 from 42 to 32 positions");
  EXPECT_EQ(c.truncate_problem(s, 42), "");
  c.restore(s, snap);
  EXPECT_EQ(c.length(s), 32);
  EXPECT_EQ(c.conv_state(s)[3], 3.0f);
  EXPECT_EQ(c.recurrent_state(s)[7], 107.0f);
  // Into another sequence (prefix reuse: a new sequence starts from a saved prefix), and a fork is a copy.
  const int t = c.add_sequence();
  c.restore(t, snap);
  EXPECT_EQ(c.length(t), 32);
  EXPECT_EQ(c.recurrent_state(t)[23], 123.0f);
  c.fork_sequence(t, 7);
  c.recurrent_state(7)[0] = 5.0f;
  EXPECT_EQ(c.recurrent_state(t)[0], 100.0f);
  // A snapshot of another shape is refused, naming both.
  StateShape other = shape;
  other.state_dv = 8;
  StateCache d(other);
  const int u = d.add_sequence();
  expect_error_mentioning([&] { d.restore(u, snap); }, "cannot restore a snapshot of a state of conv 5x4, recurrent 2x3x4");
  expect_error_mentioning([&] { c.snapshot(99); }, "no sequence 99");
}

// ------------------------------------------------------------------ block-mean centring

KVCacheOptions centred_options(int k_bits, int v_bits, bool ck, bool cv, int run, int block, int min_tokens = 0, int window = 0) {
  TurboQuantCacheOptions o;
  o.k_bits = k_bits;
  o.v_bits = v_bits;
  o.min_tokens_before_quant = min_tokens;
  o.block_tokens = block;
  o.center_k = ck;
  o.center_v = cv;
  o.center_tokens = run;
  return turboquant_cache_options(o, window);
}

// x [n][H][D] plus a per-channel offset that drifts along the positions.
std::vector<float> drifting(int n, int H, int D, float size, uint64_t seed) {
  auto x = gaussian(static_cast<size_t>(n) * H * D, seed);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < D; ++j)
        x[(static_cast<size_t>(t) * H + h) * D + j] += size * std::sin(0.37f * j + h) + 0.5f * size * std::sin(0.01f * t + j);
  return x;
}

double read_back_mse(const KVCache& c, int seq, const std::vector<float>& k, const std::vector<float>& v) {
  const size_t per = static_cast<size_t>(c.n_kv_heads()) * c.head_dim();
  std::vector<float> rk(per), rv(per);
  double err = 0;
  for (int p = 0; p < c.length(seq); ++p) {
    c.read(seq, p, rk.data(), rv.data());
    for (size_t j = 0; j < per; ++j) {
      err += (rk[j] - k[p * per + j]) * (rk[j] - k[p * per + j]);
      err += (rv[j] - v[p * per + j]) * (rv[j] - v[p * per + j]);
    }
  }
  return err / (2.0 * c.length(seq) * per);
}

// The run still filling is FP16 (read back exactly as binary16), the completed ones are quantized around
// their means (closer than without centring when the data carries a drifting offset), and the memory
// report counts the means.
TEST(KVCache, CentringKeepsTheFillingRunInFP16AndCountsTheMeans) {
  const int H = 2, D = 64, T = 128, C = 32, M = 3, n = M + 2 * T + 45;  // the last run holds 13 positions
  const auto k = drifting(n, H, D, 4.0f, 1), v = drifting(n, H, D, 4.0f, 2);
  KVCache plain(H, D, centred_options(3, 3, false, false, 0, T, M));
  KVCache centred(H, D, centred_options(3, 3, true, true, C, T, M));
  const int a = plain.add_sequence(), b = centred.add_sequence();
  plain.append(a, k.data(), v.data(), n);
  // In uneven pieces: runs complete inside an append and across appends.
  for (int done = 0, step = 1; done < n; step = step * 3 % 71 + 1) {
    const int m = std::min(step, n - done);
    centred.append(b, k.data() + static_cast<size_t>(done) * H * D, v.data() + static_cast<size_t>(done) * H * D, m);
    done += m;
  }
  const int filling_from = n - (n - M) % C;
  std::vector<float> rk(H * D), rv(H * D);
  for (int p = filling_from; p < n; ++p) {
    centred.read(b, p, rk.data(), rv.data());
    for (int j = 0; j < H * D; ++j) {
      ASSERT_EQ(rk[j], round_to_f16(k[static_cast<size_t>(p) * H * D + j])) << "position " << p;
      ASSERT_EQ(rv[j], round_to_f16(v[static_cast<size_t>(p) * H * D + j])) << "position " << p;
    }
  }
  std::vector<Segment> segs;
  centred.segments(b, segs);
  ASSERT_EQ(segs.size(), 5u);  // sink, block 0, block 1's encoded runs, block 2's encoded run, the filling run
  EXPECT_EQ(segs.back().first_pos, filling_from);
  EXPECT_EQ(segs.back().k_format->type(), KVType::f16);
  EXPECT_NE(segs[1].k_mean, nullptr);
  EXPECT_NE(segs[1].v_mean, nullptr);
  // The drifting offset: centred runs read back much closer (the filling run aside, which is exact).
  EXPECT_LT(read_back_mse(centred, b, k, v), 0.5 * read_back_mse(plain, a, k, v));
  // Memory: the runs' means (K and V, binary16, every KV head) beside the records.
  const int runs = (n - M + C - 1) / C;
  EXPECT_EQ(centred.memory().main_bytes, plain.memory().main_bytes + static_cast<int64_t>(runs) * H * 2 * D * 2);
  EXPECT_DOUBLE_EQ(centred.main_bits_per_value(), plain.main_bits_per_value() + 16.0 / C);
  EXPECT_NE(centred.describe().find("K and V centred per 32 positions"), std::string::npos) << centred.describe();
}

// Truncating inside the filling run, or at a run's start, then appending equals never having appended;
// truncating into a completed run keeps its means (the positions appended again are encoded around them).
TEST(KVCache, CentredTruncateForkSaveAndLoad) {
  const int H = 2, D = 64, T = 64, C = 16;
  const auto k = drifting(200, H, D, 2.0f, 3), v = drifting(200, H, D, 2.0f, 4), other = gaussian(200 * H * D, 5);
  for (const bool ck : {true, false}) {
    const KVCacheOptions o = centred_options(4, 3, ck, true, C, T, 2);
    KVCache once(H, D, o), again(H, D, o);
    const int a = once.add_sequence(), b = again.add_sequence();
    once.append(a, k.data(), v.data(), 150);
    again.append(b, k.data(), v.data(), 40);  // runs [2,18) [18,34) done, [34,50) filling
    again.append(b, other.data(), other.data(), 5);
    again.truncate(b, 40);  // inside the filling run
    again.append(b, k.data() + 40 * H * D, v.data() + 40 * H * D, 110);
    EXPECT_EQ(read_all(again, b), read_all(once, a));
    again.truncate(b, 66);  // a run's start
    again.append(b, other.data(), other.data(), 20);
    again.truncate(b, 66);
    again.append(b, k.data() + 66 * H * D, v.data() + 66 * H * D, 84);
    EXPECT_EQ(read_all(again, b), read_all(once, a));
    again.truncate(b, 60);  // inside the completed run [50, 66)
    again.append(b, k.data() + 60 * H * D, v.data() + 60 * H * D, 90);
    // The run's means came from these same positions, so encoding them again around those means (one
    // position at a time) gives the codes the completed run had.
    EXPECT_EQ(read_all(again, b), read_all(once, a));

    // A fork shares the filling run's block and copies its FP16 run; both continue on their own.
    once.fork_sequence(a, 9);
    once.append(9, other.data(), other.data() + 1, 30);
    once.append(a, k.data() + 150 * H * D, v.data() + 150 * H * D, 30);
    const auto pa = read_all(once, a), p9 = read_all(once, 9);
    // The completed runs are the same; the run that was filling at the fork, [146, 162), was completed with
    // other positions in each, so each has its own means.
    EXPECT_TRUE(std::equal(pa.begin(), pa.begin() + 146 * 2 * H * D, p9.begin()));
    KVCache direct(H, D, o);
    const int d = direct.add_sequence();
    direct.append(d, k.data(), v.data(), 180);
    EXPECT_EQ(read_all(direct, d), pa);

    // Save and load keep the means and the filling runs (both sequences have one).
    const std::string path = temp_path("centred.tqkv");
    once.save(path);
    const auto loaded = KVCache::load(path);
    EXPECT_EQ(loaded->describe(), once.describe());
    EXPECT_EQ(read_all(*loaded, a), pa);
    EXPECT_EQ(read_all(*loaded, 9), p9);
    EXPECT_EQ(loaded->memory().bytes_in_use(), once.memory().bytes_in_use());
    // And go on filling exactly as the original does.
    loaded->append(9, k.data(), v.data(), 20);
    once.append(9, k.data(), v.data(), 20);
    EXPECT_EQ(read_all(*loaded, 9), read_all(once, 9));
    std::remove(path.c_str());
  }
}

// A version 1 file (before centring: no center_* fields, no tail_pos) still loads.
TEST(KVCache, LoadsVersionOneFiles) {
  const std::string path = temp_path("v2.tqkv");
  KVCache cache(1, 64, tq_options(4, 3, 2));
  const int s = cache.add_sequence();
  const auto x = gaussian(40 * 64, 9);
  cache.append(s, x.data(), x.data() + 64, 30);
  auto bytes = cache.to_bytes();
  uint32_t len;
  std::memcpy(&len, bytes.data() + 12, 4);
  nlohmann::json header = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(bytes.data() + 16), len));
  for (const char* f : {"center_k", "center_v", "center_tokens"}) header.erase(f);
  for (auto& js : header["sequences"]) js.erase("tail_pos");
  const std::string text = header.dump();
  std::vector<uint8_t> v1(16);
  std::memcpy(v1.data(), bytes.data(), 8);
  const uint32_t version = 1, text_len = static_cast<uint32_t>(text.size());
  std::memcpy(v1.data() + 8, &version, 4);
  std::memcpy(v1.data() + 12, &text_len, 4);
  v1.insert(v1.end(), text.begin(), text.end());
  v1.insert(v1.end(), bytes.begin() + 16 + len, bytes.end() - 8);
  const uint64_t hash = fnv1a(v1.data(), v1.size());
  v1.insert(v1.end(), reinterpret_cast<const uint8_t*>(&hash), reinterpret_cast<const uint8_t*>(&hash) + 8);
  const auto loaded = KVCache::from_bytes(v1, "version 1 bytes");
  EXPECT_EQ(read_all(*loaded, s), read_all(cache, s));
  EXPECT_FALSE(loaded->options().centred());
  // A tail_pos that is not on the run grid is named.
  KVCache c2(1, 64, centred_options(4, 3, true, false, 16, 64));
  const int s2 = c2.add_sequence();
  c2.append(s2, x.data(), x.data() + 64, 20);
  auto b2 = c2.to_bytes();
  std::memcpy(&len, b2.data() + 12, 4);
  std::string t2(reinterpret_cast<const char*>(b2.data() + 16), len);
  const size_t at = t2.find("\"tail_pos\":16");
  ASSERT_NE(at, std::string::npos) << t2;
  t2[at + 12] = '7';  // 17: inside a run
  std::memcpy(b2.data() + 16, t2.data(), len);
  const uint64_t h2 = fnv1a(b2.data(), b2.size() - 8);
  std::memcpy(b2.data() + b2.size() - 8, &h2, 8);
  expect_error_mentioning([&] { KVCache::from_bytes(b2, "bad"); }, "inconsistent filling run");
}

// Converting an FP16 prompt cache to a centred TurboQuant one gives what filling it directly with the
// same (binary16) values gives.
TEST(PromptCache, ConvertsToACentredCache) {
  const int H = 2, D = 64, n = 300;
  PromptCache caches = make_prompt_cache({LayerSpec{LayerKind::full_attention, H, D, 0, StateShape{}}}, KVType::f16, 64);
  auto* dense = dynamic_cast<KVCache*>(caches[0].get());
  const int seq = dense->add_sequence();
  auto k = drifting(n, H, D, 3.0f, 21), v = drifting(n, H, D, 3.0f, 22);
  for (auto* x : {&k, &v})
    for (float& f : *x) f = round_to_f16(f);
  dense->append(seq, k.data(), v.data(), n);
  TurboQuantCacheOptions o;
  o.k_bits = o.v_bits = 4;
  o.center_k = o.center_v = true;
  o.center_tokens = 64;
  o.block_tokens = 128;
  ASSERT_EQ(convert_cache_to_turboquant(caches, o), 1);
  auto* tq = dynamic_cast<KVCache*>(caches[0].get());
  ASSERT_TRUE(tq->options().centred());
  KVCache direct(H, D, turboquant_cache_options(o, 0));
  direct.add_sequence_with_id(seq);
  direct.append(seq, k.data(), v.data(), n);
  EXPECT_EQ(read_all(*tq, seq), read_all(direct, seq));
}

TEST(KVCache, BadCentringOptionsSayWhatIsWrong) {
  expect_error_mentioning([] { KVCache(1, 64, centred_options(4, 4, true, false, 48, 256)); }, "power of two");
  expect_error_mentioning([] { KVCache(1, 64, centred_options(4, 4, true, false, 512, 256)); }, "divide the block");
  expect_error_mentioning([] { KVCache(1, 64, centred_options(4, 4, true, false, 8, 256)); }, "at least 16");
  KVCacheOptions dense;
  dense.center_k = true;
  expect_error_mentioning([&] { KVCache(1, 64, dense); }, "quantized K type");
}

TEST(KVCache, BadOptionsSayWhatIsWrong) {
  TurboQuantCacheOptions o;
  o.k_bits = 9;
  EXPECT_THROW(turboquant_cache_options(o), Error);
  o.k_bits = 8;
  o.group_size = 48;
  try {
    turboquant_cache_options(o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("group size"), std::string::npos);
  }
  KVCacheOptions bad;
  bad.sink_type = KVType::q8_0;
  EXPECT_THROW(KVCache(1, 64, bad), Error);
  KVCacheOptions q;
  q.k.type = KVType::q8_0;
  EXPECT_THROW(KVCache(1, 48, q), Error);  // not a multiple of 32
  EXPECT_THROW(parse_kv_type("q5_k"), Error);
  // The option at fault is named, not the block pool built from it.
  KVCacheOptions zero_block;
  zero_block.block_tokens = 0;
  expect_error_mentioning([&] { KVCache(1, 64, zero_block); }, "block size");
  expect_error_mentioning([] { KVCache(0, 64, KVCacheOptions{}); }, "KV head");
  KVCache cache(1, 64, KVCacheOptions{});
  const int seq = cache.add_sequence();
  expect_error_mentioning([&] { cache.append(seq, nullptr, nullptr, 1); }, "null pointer");
}

}  // namespace
}  // namespace tq
