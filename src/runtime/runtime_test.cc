#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/test_util.h"
#include "runtime/generate.h"
#include "runtime/kv_settings.h"
#include "runtime/perplexity.h"
#include "runtime/sampler.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

TEST(Sampler, GreedyAndTopKOnePickTheArgmax) {
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.9f};
  SamplingParams p;
  p.temperature = 0;
  Sampler greedy(p);
  EXPECT_EQ(greedy.sample(logits, {}), 1);
  p.temperature = 1.5f;
  p.top_k = 1;
  Sampler top1(p);
  for (int i = 0; i < 20; ++i) {
    auto l = logits;
    EXPECT_EQ(top1.sample(l, {}), 1);
  }
}

TEST(Sampler, SamplesTheSoftmaxDistributionAndIsSeeded) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -10.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 7;
  Sampler a(p), b(p);
  std::map<int, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    auto la = logits, lb = logits;
    const int x = a.sample(la, {});
    EXPECT_EQ(x, b.sample(lb, {}));  // same seed, same draws
    ++counts[x];
  }
  double z = std::exp(0.0) + std::exp(1.0) + std::exp(2.0) + std::exp(-10.0);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(counts[i] / double(n), std::exp(logits[i]) / z, 0.015) << i;
}

TEST(Sampler, TopPMinPAndRepetitionPenalty) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.5f;  // token 2 alone has p = 0.66 > 0.5
  Sampler nucleus(p);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> l = {0.0f, 1.0f, 2.0f};
    EXPECT_EQ(nucleus.sample(l, {}), 2);
  }
  p.top_p = 1.0f;
  p.min_p = 0.5f;  // keeps tokens with p >= 0.5 * p_max: token 1 (0.24 vs 0.33) is out
  Sampler minp(p);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> l = {0.0f, 1.0f, 2.0f};
    EXPECT_EQ(minp.sample(l, {}), 2);
  }
  SamplingParams r;
  r.temperature = 0;
  r.repetition_penalty = 2.0f;
  Sampler rep(r);
  std::vector<float> l = {1.0f, 1.5f, -1.0f};
  const std::vector<int32_t> history = {1, 2};
  EXPECT_EQ(rep.sample(l, history), 0);  // 1.5 / 2 < 1.0
  EXPECT_FLOAT_EQ(l[2], -2.0f);          // negative logits are multiplied
  SamplingParams bad;
  bad.top_p = 0;
  EXPECT_THROW(bad.validate(), Error);
}

TEST(KVSettings, FlagsResolveAndContradictionsAreErrors) {
  KVSettings a;
  a.k_bits = 8;
  a.v_bits = 3;
  a.fused = true;
  a.resolve();
  EXPECT_EQ(a.resolved_k_type(), "turboquant");
  EXPECT_EQ(a.cache_options().k.quantizer.bits, 8);
  EXPECT_EQ(a.cache_options().v.quantizer.bits, 3);
  KVSettings b;
  b.bits = 4;
  b.k_bits = 8;
  EXPECT_THROW(b.resolve(), Error);
  KVSettings c;
  c.k_bits = 8;
  EXPECT_THROW(c.resolve(), Error);  // --kv-v-bits missing
  KVSettings d;
  d.fused = true;
  EXPECT_THROW(d.resolve(), Error);  // nothing to fuse
  KVSettings e;
  e.k_type = "q8_0_rot";
  e.v_type = "q4_0";
  e.resolve();
  EXPECT_TRUE(e.cache_options().k.rotate);
  EXPECT_EQ(e.cache_options().v.type, KVType::q4_0);
  KVSettings f;
  f.k_type = "q5_k";
  EXPECT_THROW(f.resolve(), Error);
  KVSettings g;
  g.bits = 4;
  g.group_size = 48;
  EXPECT_THROW(g.resolve(), Error);
  // The int8-query scorer: opt-in, fused only, TurboQuant keys of 2-4 or 8 (uniform) bits; it reaches the
  // cache options and the description says which scorer runs.
  KVSettings h;
  h.k_bits = 4;
  h.v_bits = 4;
  h.fused = true;
  h.resolve();
  EXPECT_FALSE(h.cache_options().query_int8);
  EXPECT_NE(h.describe().find("exact scorer"), std::string::npos) << h.describe();
  h.query_int8 = true;
  h.resolve();
  EXPECT_TRUE(h.cache_options().query_int8);
  EXPECT_NE(h.describe().find("int8-query scorer"), std::string::npos) << h.describe();
  h.fused = false;
  testing_util::expect_error_mentioning([&] { h.resolve(); }, "needs --kv-fused");
  KVSettings i;
  i.k_bits = 6;
  i.v_bits = 4;
  i.fused = i.query_int8 = true;
  testing_util::expect_error_mentioning([&] { i.resolve(); }, "at 6 bits");
  KVSettings j;
  j.k_type = "q8_0";
  j.v_type = "q8_0";
  j.fused = j.query_int8 = true;
  testing_util::expect_error_mentioning([&] { j.resolve(); }, "K q8_0");
  EXPECT_TRUE(parse_kv_spec("k8v3+int8q").query_int8 && parse_kv_spec("k8v3+int8q").fused);
}

std::string shared(const std::string& rel) { return std::string(TQ_SHARED_DIR) + "/" + rel; }

TEST(KVSettings, CompactSpecsParseAndBadOnesSayWhy) {
  const KVSettings a = parse_kv_spec("k8v3+mt128+g=32+bt=256");
  EXPECT_EQ(a.k_bits, 8);
  EXPECT_EQ(a.v_bits, 3);
  EXPECT_EQ(a.min_tokens, 128);
  EXPECT_EQ(a.group_size, 32);
  EXPECT_EQ(a.block_tokens, 256);
  EXPECT_FALSE(a.fused);
  EXPECT_TRUE(parse_kv_spec("k4v4+fused").fused);
  EXPECT_FALSE(parse_kv_spec("f16").compressed());
  // Block-mean centring: K by default below 8 bits (on devices whose caches centre), none for K8 and the
  // baselines; explicit choices and the run length reach the cache options, and the means count in bits/value.
  EXPECT_EQ(parse_kv_spec("k4v4").resolved_center(), "k");
  EXPECT_EQ(parse_kv_spec("k4v4").resolved_center(false), "none");
  EXPECT_FALSE(parse_kv_spec("k4v4").cache_options(64, false).centred());
  EXPECT_EQ(parse_kv_spec("k8v3").resolved_center(), "none");
  EXPECT_EQ(parse_kv_spec("q4_0/q4_0").resolved_center(), "none");
  EXPECT_EQ(parse_kv_spec("k4v4+center=none").resolved_center(), "none");
  const KVCacheOptions co = parse_kv_spec("k8v3+center=kv+cblock=64").cache_options();
  EXPECT_TRUE(co.center_k && co.center_v);
  EXPECT_EQ(co.center_run(), 64);
  EXPECT_DOUBLE_EQ(parse_kv_spec("k8v3+center=kv+cblock=64").bits_per_value(128), 5.75 + 0.25);
  EXPECT_DOUBLE_EQ(parse_kv_spec("k4v4").bits_per_value(128), 4.25 + 16.0 / 256 / 2);
  EXPECT_THROW(parse_kv_spec("k4v4+center=q"), Error);
  EXPECT_THROW(parse_kv_spec("k4v4+cblock=48"), Error);
  EXPECT_THROW(parse_kv_spec("f16+center=k"), Error);
  try {
    parse_kv_spec("k8v3+pages=4");
    FAIL() << "an unknown option was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pages=4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_kv_spec("k8"), Error);
  // Numbers are whole or refused with the part named (std::stoi aborted on "mtx", sscanf took "k8v3x").
  for (const char* bad : {"k8v3x", "kxv3", "k8v3+mtx", "k8v3+mt=5z", "k8v3+g=", "k8v3+bt=99999999999"}) {
    try {
      parse_kv_spec(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("of '") + bad + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(Generate, Stories260KFromGgufWritesTheReadmeStory) {
  const std::string path = shared("models/stories260K/stories260K.gguf");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is absent (shared test data)";
  testing_util::CpuModel cpu(path, 1);
  Model& model = *cpu.model;
  const auto tok = load_model_tokenizer(model.files());
  const auto ids = tok->encode("Once upon a time", true);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 403, 407, 261, 378}));
  for (const char* kv_type : {"", "turboquant"}) {
    KVSettings kv;
    if (*kv_type) {
      kv.k_bits = 8;
      kv.v_bits = 8;
      kv.group_size = 32;  // head_dim of this model is 8: turboquant needs a group that divides it
    }
    if (*kv_type) {
      kv.resolve();
      // head_dim 8 is smaller than every supported group: the settings must refuse it clearly.
      EXPECT_THROW(build_prompt_cache(model.layer_specs(), kv), Error);
      EngineOptions eo;
      eo.kv = kv;
      EXPECT_THROW(Engine(model, eo), Error);
      continue;
    }
    kv.resolve();
    EngineOptions eo;
    eo.kv = kv;
    Engine engine(model, eo);
    GenerateOptions o;
    o.max_tokens = 60;
    o.sampling.temperature = 0;
    std::string streamed;
    const auto r = generate(engine, *tok, ids, o, [&](std::string_view t) { streamed += t; });
    EXPECT_EQ(streamed, r.text);
    EXPECT_NE(r.text.find("there was a little girl named Lily. She loved to play outside in the park."), std::string::npos)
        << r.text;
  }
}

// The demo model the project ships (models/demo).
std::string demo_model_dir() { return std::string(TQ_SOURCE_DIR) + "/models/demo"; }

// The attention path per layer is the one the settings ask for, and the reports count it: a cache
// with dense K and TurboQuant V took the fused path while the settings (and the run's summary) said
// standard, because only K's type was looked at.
TEST(Generate, DemoModelTakesTheAttentionPathTheSettingsAsk) {
  testing_util::CpuModel cpu(demo_model_dir(), 2);
  Model& model = *cpu.model;
  const auto tok = load_model_tokenizer(model.files());
  const auto ids = tok->encode("It is a truth", true);
  GenerateOptions o;
  o.max_tokens = 3;
  o.sampling.temperature = 0;
  struct Case {
    std::string k_type;
    int bits;
    bool fused;
    bool want_fused;
    bool query_int8 = false;  // the int8-query scorer (fused)
  };
  for (const Case& c : {Case{"f16", 3, false, false}, Case{"f16", 3, true, true}, Case{"", 3, false, false},
                        Case{"", 3, true, true}, Case{"f16", 0, false, true}, Case{"", 4, true, true, true}}) {
    KVSettings kv;
    kv.k_type = c.k_type;
    kv.bits = c.bits;
    kv.fused = c.fused;
    kv.query_int8 = c.query_int8;
    kv.resolve();
    EngineOptions eo;
    eo.kv = kv;
    Engine engine(model, eo);
    const auto r = generate(engine, *tok, ids, o, [](std::string_view) {});
    ASSERT_FALSE(r.layers.empty());
    for (const auto& layer : r.layers) {
      const AttentionStats& s = layer.stats;
      EXPECT_EQ(s.fused > 0, c.want_fused) << kv.describe() << ": " << layer.cache;
      EXPECT_EQ(s.standard > 0, !c.want_fused) << kv.describe() << ": " << layer.cache;
      EXPECT_EQ(s.fused_fallbacks, 0) << kv.describe();
    }
  }
}

TEST(Generate, DemoModelStopsAtStopStringsAndRespectsTheContext) {
  testing_util::CpuModel cpu(demo_model_dir(), 2);
  Model& model = *cpu.model;
  const auto tok = load_model_tokenizer(model.files());
  KVSettings kv;
  kv.k_bits = 8;
  kv.v_bits = 3;
  kv.fused = true;
  kv.resolve();
  const auto ids = tok->encode("It is a truth universally acknowledged", true);
  GenerateOptions o;
  o.max_tokens = 40;
  o.sampling.temperature = 0;
  EngineOptions eo;
  eo.kv = kv;
  eo.max_sequences = 4;
  Engine engine(model, eo);
  const auto full = generate(engine, *tok, ids, o, [](std::string_view) {});
  ASSERT_GT(full.text.size(), 20u);
  // Stop at a string the unrestricted run produced: the text ends right before it.
  const std::string stop = full.text.substr(10, 4);
  o.stop = {stop};
  std::string streamed;
  const auto cut = generate(engine, *tok, ids, o, [&](std::string_view t) { streamed += t; });
  EXPECT_EQ(cut.stop_reason, "stop string");
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(streamed, cut.text);
  // A prompt longer than the context is an error that says so.
  o.ctx_size = 4;
  const std::vector<int> before = engine.sequences();
  try {
    generate(engine, *tok, ids, o, [](std::string_view) {});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context"), std::string::npos) << e.what();
  }
  // The engine is untouched by the refused request (no sequence was added): it still takes a new generation.
  EXPECT_EQ(engine.sequences(), before);
  o.ctx_size = 0;
  o.stop.clear();
  const auto again = generate(engine, *tok, ids, o, [](std::string_view) {});
  EXPECT_EQ(again.text, full.text);
}

// The generation loop (generate_steps, which the GPU path drives too) feeds the prompt in chunks at the
// right positions: chunks of 3 give the tokens that one chunk gives, and the context ends a run with
// its own stop reason.
TEST(Generate, PromptChunksAndTheContextLimitInTheSharedLoop) {
  testing_util::CpuModel cpu(demo_model_dir(), 2);
  Model& model = *cpu.model;
  const auto tok = load_model_tokenizer(model.files());
  KVSettings kv;
  kv.resolve();
  const auto ids = tok->encode("It is a truth universally acknowledged", true);
  GenerateOptions o;
  o.max_tokens = 12;
  o.sampling.temperature = 0;
  auto run = [&](int chunk, int ctx, std::vector<int>* fed_positions) {
    EngineOptions eo;
    eo.kv = kv;
    Engine engine(model, eo);
    const int seq = engine.add_sequence();
    std::vector<float> logits;
    Sampler sampler(o.sampling);
    TokenSteps steps;
    steps.feed = [&](const int32_t* tokens, int n, int pos) {
      if (fed_positions) fed_positions->push_back(pos);
      const BatchEntry e{seq, std::span<const int32_t>(tokens, static_cast<size_t>(n)), pos, Logits::last};
      engine.forward({&e, 1});
      logits = engine.logits();
    };
    steps.next = [&](const std::vector<int32_t>& history) { return sampler.sample(logits, history); };
    GenerateOptions oc = o;
    oc.prefill_chunk = chunk;
    return generate_steps(steps, *tok, ids, {}, ctx, oc, [](std::string_view) {});
  };
  std::vector<int> positions;
  const auto whole = run(512, 1000, nullptr);
  const auto chunked = run(3, 1000, &positions);
  EXPECT_EQ(chunked.tokens, whole.tokens);
  EXPECT_EQ(whole.stop_reason, "max tokens");
  ASSERT_GE(positions.size(), 2u);
  const int n_prompt = static_cast<int>(ids.size());
  for (int i = 0; i * 3 < n_prompt; ++i) EXPECT_EQ(positions[static_cast<size_t>(i)], 3 * i);
  EXPECT_EQ(positions.back(), n_prompt + static_cast<int>(whole.tokens.size()) - 2);  // the last token is not fed
  // A context of prompt + 3 positions: three tokens fit (the third needs no forward pass).
  const auto short_run = run(512, n_prompt + 3, nullptr);
  EXPECT_EQ(short_run.stop_reason, "context full");
  EXPECT_EQ(short_run.tokens.size(), 3u);
  EXPECT_EQ(std::vector<int32_t>(whole.tokens.begin(), whole.tokens.begin() + 3), short_run.tokens);
}

// gpt-oss: the harmony stops are <|return|> and <|call|>, never <|end|> (it only closes the reasoning),
// whatever the config names; the streamed text keeps the markers when asked, for the channel parser.
TEST(Generate, HarmonyStopsAndMarkersInTheText) {
  const auto tok = load_tokenizer_dir(std::string(TQ_SOURCE_DIR) + "/tests/fixtures/text/gpt-oss-mini");
  ASSERT_TRUE(is_harmony_tokenizer(*tok));
  {
    testing_util::CpuModel cpu(demo_model_dir(), 1);
    EXPECT_FALSE(is_harmony_tokenizer(*load_model_tokenizer(cpu.model->files())));
  }
  ModelFiles files;
  files.config.eos_token_ids = {200007, 199999};  // a file that (wrongly) lists <|end|>
  const std::vector<int32_t> eos = eos_ids(files, *tok);
  EXPECT_EQ(eos, (std::vector<int32_t>{199999, 200002, 200012}));

  const std::string out = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.";
  std::vector<int32_t> script = tok->encode(out, false);
  script.push_back(200002);  // <|return|>
  script.push_back(tok->token_to_id("<|start|>"));
  for (bool as_text : {false, true}) {
    size_t next = 0;
    TokenSteps steps;
    steps.feed = [](const int32_t*, int, int) {};
    steps.next = [&](const std::vector<int32_t>&) { return script[next++]; };
    GenerateOptions o;
    o.max_tokens = 100;
    o.special_tokens_as_text = as_text;
    std::string streamed;
    const std::vector<int32_t> prompt = tok->encode("<|start|>user<|message|>Hi<|end|><|start|>assistant", false);
    const GenerateResult r = generate_steps(steps, *tok, prompt, eos, 1000, o, [&](std::string_view t) { streamed += t; });
    EXPECT_EQ(r.stop_reason, "eos");
    EXPECT_EQ(r.tokens.size(), script.size() - 2);
    EXPECT_EQ(r.text, streamed);
    EXPECT_EQ(r.text, as_text ? out : "analysisThink.assistantfinalDone.");
  }
}

}  // namespace
}  // namespace tq
