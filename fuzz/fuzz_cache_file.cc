// libFuzzer target: KV cache files (KVCache::save / from_bytes, magic "TQKVCACH") and prompt cache files
// (save_prompt_cache / load_prompt_cache, magic "TQPROMPT"), told apart by the magic, loaded as a run loads
// them: the framed JSON header (formats, block sizes, sinks, windows, sequences), the sizes the records must
// have before anything is allocated for them, the records, and for a prompt cache the fingerprint against
// the model's (the model of fuzz/make_seeds.cc's seeds); then every held position is read back (decoded).
// The harness rewrites the file's last 8 bytes with the FNV-1a checksum of what precedes them, so that
// mutations reach the header and the records instead of stopping at the checksum (which is tested in
// kv/cache_file_test.cc). Seeds: files the real writers wrote (fuzz/make_seeds.cc).
#include <cstring>

#include "codec/codebook.h"
#include "fuzz/fuzz_seed_model.h"
#include "fuzz/fuzz_util.h"
#include "kv/cache_file.h"
#include "kv/json_field.h"

namespace {

// Reads every held position of every sequence (bounded: a valid file may hold many).
void read_back(const tq::LayerCache& layer) {
  const auto* kv = dynamic_cast<const tq::KVCache*>(&layer);
  (void)layer.describe();
  (void)layer.memory();
  if (kv == nullptr) return;
  std::vector<float> k(static_cast<size_t>(kv->n_kv_heads()) * kv->head_dim()), v(k.size());  // [n_kv_heads][head_dim]
  int budget = 4096;
  for (int seq : kv->sequences())
    for (int pos = kv->first_kept(seq); pos < kv->length(seq) && budget > 0; ++pos, --budget) kv->read(seq, pos, k.data(), v.data());
}

}  // namespace

// The codebooks are computed once per (bits, group) and kept (codec/codebook.h): about 0.15 s of CPU each in
// this build (codebook.cc has no coverage instrumentation: fuzz/CMakeLists.txt), which a loaded machine can
// stretch past the 1 s timeout on the first input that names them (bits 6 and 1 did, on the shared machine).
// Computed here for every bit width at the seeds' group of 64, as a server computes its cache format's at
// start, so that -timeout measures what one file costs. Other groups pay theirs once (docs/RELIABILITY.md).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  for (int bits = 1; bits <= 8; ++bits) {
    (void)tq::lloyd_max_codebook(bits);
    (void)tq::absmax_codebook(bits, 64);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> bytes(data, data + size);
  if (bytes.size() >= 24) {
    const uint64_t hash = tq::fnv1a(bytes.data(), bytes.size() - 8);
    std::memcpy(bytes.data() + bytes.size() - 8, &hash, 8);
  }
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), "TQPROMPT", 8) == 0) {
    const std::string path =
        tq::fuzz::write_scratch("prompt.tqcache", {reinterpret_cast<const char*>(bytes.data()), bytes.size()});
    tq::fuzz::refused([&] {
      const tq::LoadedPromptCache loaded = tq::load_prompt_cache(path, tq::fuzz::seed_model_fingerprint());
      for (const auto& layer : loaded.caches) read_back(*layer);
    });
  } else {
    tq::fuzz::refused([&] { read_back(*tq::KVCache::from_bytes(bytes, "cache file 'fuzz.tqkv'")); });
  }
  return 0;
}
