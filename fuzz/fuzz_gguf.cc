// libFuzzer target: a .gguf file loaded as turboquant loads one (open_model): the header, metadata of
// every type (nested arrays included), the tensor table (dimensions, ggml types, offsets, alignment), the
// hyperparameters (config_from_gguf: general.architecture and the <arch>.* keys), validate_weights against
// them, then the vocabulary (tokenizer.ggml.*: load_model_tokenizer) and a short text through it.
// Input: the file's bytes. Seeds: stories260K.gguf with its dimensions made small, and small files of
// the other architectures' keys (fuzz/make_seeds.cc).
#include "fuzz/fuzz_util.h"
#include "model/loader.h"
#include "ops/ops.h"
#include "runtime/generate.h"
#include "text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = tq::fuzz::write_scratch("model.gguf", {reinterpret_cast<const char*>(data), size});
  tq::fuzz::refused([&] {
    // What GgufFile reads before the config: every key described (the loader logs them).
    const tq::GgufFile g = tq::GgufFile::open(path);
    for (const std::string& k : g.keys()) (void)g.find(k)->describe();
  });
  tq::fuzz::refused([&] {
    const tq::ModelFiles m = tq::open_model(path);
    // The RoPE table every architecture builds first (its dims are ints: the config must not narrow into them).
    const tq::ops::RopeConfig rc = tq::rope_config(m.config);
    if (rc.head_dim != m.config.head_dim || rc.rotary_dim != m.config.rope_dim) __builtin_trap();
    const tq::ops::RopeTable rope(rc);
    const std::unique_ptr<tq::Tokenizer> tok = tq::load_model_tokenizer(m);
    const std::vector<int32_t> ids = tok->encode("Once upon a time, <s> there was\n a cat.");
    (void)tok->decode(ids);
  });
  return 0;
}
