// turboquant-serve in process, on the demo model (CPU), over real HTTP on 127.0.0.1 (any free port, so
// tests may run in parallel): batching is invisible, the prefix cache reuses blocks and changes
// nothing, streaming follows OpenAI's chunk contract, and faults leave the server up and other
// requests intact. Every loop is bounded in count and time.
#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "core/rng.h"
#include "core/test_sanitizers.h"
#include "device/cpu_device.h"
#include "model/writer.h"
#include "serve/chat_page.h"
#include "serve/server.h"
#include "model/architecture.h"
#include "runtime/memory_plan.h"

namespace tq::serve {
namespace {

using namespace std::chrono_literals;

const std::string kDemo = std::string(TQ_SOURCE_DIR) + "/models/demo";

// A server on its own thread; stopped and joined on destruction.
class TestServer {
 public:
  explicit TestServer(ServerOptions o, bool load_now = true) {
    o.host = "127.0.0.1";
    o.port = 0;
    if (o.model_path.empty()) o.model_path = kDemo;
    if (o.index_html.empty()) o.index_html = chat_page();
    o.kv.resolve();
    server_ = std::make_unique<Server>(o);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->listen(); });
    if (load_now) load();
  }
  ~TestServer() {
    server_->stop();
    thread_.join();
  }
  void load() { server_->load(std::make_unique<CpuDevice>(2)); }
  int port() const { return port_; }
  Server& server() { return *server_; }
  std::unique_ptr<httplib::Client> client(const std::string& key = "") const {
    auto c = std::make_unique<httplib::Client>("127.0.0.1", port_);
    c->set_read_timeout(60, 0);
    c->set_connection_timeout(5, 0);
    if (!key.empty()) c->set_bearer_token_auth(key.c_str());
    return c;
  }

 private:
  std::unique_ptr<Server> server_;
  int port_ = 0;
  std::thread thread_;
};

json post(const TestServer& s, const std::string& path, const json& body, int* status = nullptr) {
  auto c = s.client();
  auto r = c->Post(path.c_str(), dump(body), "application/json");
  if (!r) {
    ADD_FAILURE() << "no response from " << path << " (" << httplib::to_string(r.error()) << ")";
    return json();
  }
  if (status) *status = r->status;
  else EXPECT_EQ(r->status, 200) << r->body;
  return json::parse(r->body, nullptr, false);
}

// The value of an unlabelled Prometheus sample (-1 when absent).
double metric(const TestServer& s, const std::string& name) {
  auto r = s.client()->Get("/metrics");
  if (!r || r->status != 200) return -1;
  const std::regex re("(^|\n)" + name + " ([0-9.e+-]+)");
  std::smatch m;
  return std::regex_search(r->body, m, re) ? std::stod(m[2]) : -1;
}

json greedy_completion(const std::string& prompt, int max_tokens) {
  return json{{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
}

// A raw TCP connection to the server (for what httplib's client cannot do: stall, hang up early).
class RawSocket {
 public:
  explicit RawSocket(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    timeval tv{10, 0};  // no read in a test waits longer than this
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawSocket() { close(); }
  bool connected() const { return connected_; }
  bool send(const std::string& s) { return ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size()); }
  // Reads once: the bytes, "" at EOF or on a timeout.
  std::string read_some() {
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

// The "data: ..." payloads of an SSE body.
std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const size_t end = body.find("\n\n", at);
    out.push_back(body.substr(at + 6, end - at - 6));
    at = end;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------

TEST(Serve, HealthSaysLoadingThenOkAndIsPublicWithAKey) {
  ServerOptions o;
  o.api_key = "sesame";
  TestServer s(o, /*load_now=*/false);
  auto c = s.client();
  auto h = c->Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_EQ(json::parse(h->body)["status"], "loading");
  s.load();
  h = c->Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(json::parse(h->body)["status"], "ok");
  // The key guards everything else.
  auto m = c->Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 401);
  EXPECT_EQ(json::parse(m->body)["error"]["type"], "authentication_error");
  auto wrong = s.client("open");
  m = wrong->Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 401);
  auto right = s.client("sesame");
  m = right->Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  EXPECT_EQ(json::parse(m->body)["data"][0]["id"], "demo");
  auto page = c->Get("/");  // the chat page is public too
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->body.find("<html"), std::string::npos);
}

TEST(Serve, ThirtyTwoConcurrentGreedyRequestsMatchTheSameRequestsAlone) {
  ServerOptions o;
  o.parallel = 8;  // more requests than slots: the rest queue
  o.batch_tokens = 64;  // prompts in chunks mixed with other sequences' decode tokens
  TestServer s(o);
  const char* subjects[] = {"a cat", "a dog", "the king", "a little girl", "the sun", "a bird", "the sea", "an old man"};
  std::vector<json> requests;
  for (int i = 0; i < 32; ++i)
    requests.push_back(greedy_completion(std::string("Once upon a time there was ") + subjects[i % 8] + (i >= 8 ? " who liked" : "") +
                                             std::string(static_cast<size_t>(i / 8), '!'),
                                         12 + i % 5));
  std::vector<std::string> alone;
  for (const json& r : requests) alone.push_back(post(s, "/v1/completions", r)["choices"][0]["text"]);
  std::vector<std::future<json>> futures;
  for (const json& r : requests) futures.push_back(std::async(std::launch::async, [&s, r] { return post(s, "/v1/completions", r); }));
  for (size_t i = 0; i < futures.size(); ++i) {
    const json got = futures[i].get();
    EXPECT_EQ(got["choices"][0]["text"], alone[i]) << "request " << i;
    EXPECT_EQ(got["usage"]["completion_tokens"], requests[i]["max_tokens"]) << "request " << i;  // finish "length" (no EOS this early)
    EXPECT_EQ(got["choices"][0]["finish_reason"], "length");
  }
  EXPECT_EQ(metric(s, "turboquant_requests_running"), 0);
  EXPECT_GT(metric(s, "turboquant_generation_tokens_total"), 0);
}

// A second prompt that extends the first reuses the first one's whole blocks (sink tier included) and
// generates what a server without the cache generates. o's cache has blocks of 16 positions after `sink`.
void check_prefix_reuse(ServerOptions o, int sink) {
  o.kv.block_tokens = 16;
  TestServer cached(o);
  ServerOptions plain_o = o;
  plain_o.prefix_cache = false;
  TestServer plain(plain_o);
  std::vector<int> base;  // token ids
  for (int i = 0; i < 70; ++i) base.push_back(100 + (i * 37) % 900);
  std::vector<int> longer = base;
  for (int i = 0; i < 9; ++i) longer.push_back(1000 + i);
  const json first = post(cached, "/v1/completions", json{{"prompt", base}, {"max_tokens", 8}, {"temperature", 0}});
  EXPECT_EQ(first["timings"]["cached_n"], 0);
  const json second = post(cached, "/v1/completions", json{{"prompt", longer}, {"max_tokens", 8}, {"temperature", 0}});
  // The first request held its 70 prompt tokens and 7 fed ones: the last boundary at or below 77.
  const int reused = second["timings"]["cached_n"];
  EXPECT_EQ(reused, sink + (77 - sink) / 16 * 16);
  EXPECT_EQ(second["usage"]["prompt_tokens_details"]["cached_tokens"], reused);
  EXPECT_EQ(second["timings"]["prompt_n"], static_cast<int>(longer.size()) - reused);
  const json reference = post(plain, "/v1/completions", json{{"prompt", longer}, {"max_tokens", 8}, {"temperature", 0}});
  EXPECT_EQ(reference["timings"]["cached_n"], 0);
  EXPECT_EQ(second["choices"][0]["text"], reference["choices"][0]["text"]);
  EXPECT_GE(metric(cached, "turboquant_prefix_cache_hits_total"), reused);
  EXPECT_EQ(metric(cached, "turboquant_prefix_cache_queries_total"), static_cast<double>(base.size() + longer.size()));
  // The same prompt again: a hit again (the boundary below its last token), the same text.
  const json third = post(cached, "/v1/completions", json{{"prompt", longer}, {"max_tokens", 8}, {"temperature", 0}});
  EXPECT_EQ(third["choices"][0]["text"], reference["choices"][0]["text"]);
  EXPECT_EQ(third["timings"]["cached_n"].get<int>(), sink + (78 - sink) / 16 * 16);
}

TEST(Serve, APromptSharingAPrefixReusesCachedBlocksAndGivesTheSameText) { check_prefix_reuse(ServerOptions{}, 0); }

TEST(Serve, PrefixReuseOverACompressedCacheWithASinkTier) {
  ServerOptions o;
  o.kv.k_bits = 8;
  o.kv.v_bits = 3;
  o.kv.min_tokens = 32;  // boundaries at 48, 64, 80, ...
  o.kv.fused = true;
  check_prefix_reuse(o, 32);
}

// A model with sliding-window layers (the demo model's weights with Mistral's window of 16 on every layer):
// its caches cannot truncate back past the window, so the prefix entry is a fork taken when the first prompt
// reaches its last boundary (64); the second prompt reuses it and generates what a server without the cache
// generates.
TEST(Serve, SlidingWindowModelsReusePrefixesForkedAtBoundaries) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / ("tq_serve_swa_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::copy(kDemo, dir);
  json config = json::parse(std::ifstream(dir / "config.json"));
  config["architectures"] = json::array({"MistralForCausalLM"});
  config["model_type"] = "mistral";
  config["sliding_window"] = 16;
  std::ofstream(dir / "config.json") << config.dump();
  ServerOptions o;
  o.model_path = dir.string();
  o.kv.block_tokens = 16;
  TestServer cached(o);
  ServerOptions plain_o = o;
  plain_o.prefix_cache = false;
  TestServer plain(plain_o);
  const json props = json::parse(cached.client()->Get("/props")->body);
  EXPECT_EQ(props["prefix_cache"], true);
  EXPECT_NE(props["prefix_cache_state"].get<std::string>().find("forked at prompts' block boundaries"), std::string::npos);
  std::vector<int> base;
  for (int i = 0; i < 70; ++i) base.push_back(100 + (i * 37) % 900);
  std::vector<int> longer = base;
  for (int i = 0; i < 9; ++i) longer.push_back(1000 + i);
  // 40 generated tokens take the first sequence to 110 positions, past 64 + the window: at its end it can no
  // longer go back to 64, so only the fork taken on the way can give that prefix.
  const json first = post(cached, "/v1/completions", json{{"prompt", base}, {"max_tokens", 40}, {"temperature", 0}, {"ignore_eos", true}});
  EXPECT_EQ(first["timings"]["cached_n"], 0);
  EXPECT_EQ(first["choices"][0]["text"],
            post(plain, "/v1/completions", json{{"prompt", base}, {"max_tokens", 40}, {"temperature", 0}, {"ignore_eos", true}})["choices"][0]["text"]);
  const json second = post(cached, "/v1/completions", json{{"prompt", longer}, {"max_tokens", 8}, {"temperature", 0}});
  EXPECT_EQ(second["timings"]["cached_n"], 64);  // the first prompt's last boundary before its last token
  const json reference = post(plain, "/v1/completions", json{{"prompt", longer}, {"max_tokens", 8}, {"temperature", 0}});
  EXPECT_EQ(second["choices"][0]["text"], reference["choices"][0]["text"]);
  EXPECT_EQ(metric(cached, "turboquant_prefix_cache_hits_total"), 64);
  std::filesystem::remove_all(dir);
}

// A tiny random Qwen3.5 (a Gated DeltaNet layer, then a full-attention layer) with the demo model's
// tokenizer, in `dir`: a recurrent state cannot go back, so its prefix entries are forks taken at the
// prompts' boundaries (the state copied there).
void write_tiny_hybrid(const std::filesystem::path& dir) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) std::filesystem::copy_file(std::filesystem::path(kDemo) / f, dir / f);
  constexpr int V = 4096, H = 32, heads = 2, kv = 1, hd = 32, I = 48, hk = 1, hv = 2, dk = 16, dv = 16, K = 4;
  constexpr int conv = 2 * hk * dk + hv * dv;
  SplitMix64 rng(17);
  SafetensorsWriter w;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, double scale) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::vector<float> v(n);
    for (float& x : v) x = static_cast<float>(scale * rng.normal());
    w.add(name, DType::f32, std::move(shape), v);
  };
  add("model.embed_tokens.weight", {V, H}, 1.0);
  add("lm_head.weight", {V, H}, 0.2);
  add("model.norm.weight", {H}, 0.1);
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, 0.1);
    add(p + "post_attention_layernorm.weight", {H}, 0.1);
    if (l == 0) {
      const std::string a = p + "linear_attn.";
      add(a + "in_proj_qkv.weight", {conv, H}, 0.2);
      add(a + "in_proj_z.weight", {hv * dv, H}, 0.2);
      add(a + "in_proj_b.weight", {hv, H}, 0.2);
      add(a + "in_proj_a.weight", {hv, H}, 0.2);
      add(a + "conv1d.weight", {conv, 1, K}, 0.5);
      add(a + "A_log", {hv}, 0.5);
      add(a + "dt_bias", {hv}, 0.5);
      add(a + "norm.weight", {dv}, 1.0);
      add(a + "out_proj.weight", {H, hv * dv}, 0.2);
    } else {
      const std::string a = p + "self_attn.";
      add(a + "q_proj.weight", {heads * hd * 2, H}, 0.2);
      add(a + "k_proj.weight", {kv * hd, H}, 0.2);
      add(a + "v_proj.weight", {kv * hd, H}, 0.2);
      add(a + "o_proj.weight", {H, heads * hd}, 0.2);
      add(a + "q_norm.weight", {hd}, 0.1);
      add(a + "k_norm.weight", {hd}, 0.1);
    }
    add(p + "mlp.gate_proj.weight", {I, H}, 0.2);
    add(p + "mlp.up_proj.weight", {I, H}, 0.2);
    add(p + "mlp.down_proj.weight", {H, I}, 0.2);
  }
  write_bytes_to_file((dir / "model.safetensors").string(), w.bytes());
  const json config = {{"architectures", {"Qwen3_5ForCausalLM"}}, {"model_type", "qwen3_5_text"}, {"num_hidden_layers", 2},
                       {"hidden_size", H}, {"intermediate_size", I}, {"num_attention_heads", heads}, {"num_key_value_heads", kv},
                       {"head_dim", hd}, {"layer_types", {"linear_attention", "full_attention"}}, {"attn_output_gate", true},
                       {"linear_num_key_heads", hk}, {"linear_num_value_heads", hv}, {"linear_key_head_dim", dk},
                       {"linear_value_head_dim", dv}, {"linear_conv_kernel_dim", K}, {"rms_norm_eps", 1e-6}, {"vocab_size", V},
                       {"tie_word_embeddings", false}, {"eos_token_id", 0}, {"max_position_embeddings", 2048},
                       {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25}}}};
  std::ofstream(dir / "config.json") << config.dump();
}

TEST(Serve, HybridModelsReusePrefixesForkedAtBoundaries) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / ("tq_serve_hybrid_" + std::to_string(::getpid()));
  write_tiny_hybrid(dir);
  ServerOptions o;
  o.model_path = dir.string();
  o.kv.block_tokens = 16;
  TestServer cached(o);
  ServerOptions plain_o = o;
  plain_o.prefix_cache = false;
  TestServer plain(plain_o);
  const json props = json::parse(cached.client()->Get("/props")->body);
  EXPECT_NE(props["prefix_cache_state"].get<std::string>().find("recurrent layers"), std::string::npos) << props.dump();
  std::vector<int> base;
  for (int i = 0; i < 70; ++i) base.push_back(100 + (i * 37) % 900);
  std::vector<int> longer = base;
  for (int i = 0; i < 9; ++i) longer.push_back(1000 + i);
  const json body = {{"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};
  json a = body, b = body;
  a["prompt"] = base;
  b["prompt"] = longer;
  EXPECT_EQ(post(cached, "/v1/completions", a)["choices"][0]["text"], post(plain, "/v1/completions", a)["choices"][0]["text"]);
  const json second = post(cached, "/v1/completions", b);
  EXPECT_EQ(second["timings"]["cached_n"], 64);  // the state copied when the first prompt reached 64
  EXPECT_EQ(second["choices"][0]["text"], post(plain, "/v1/completions", b)["choices"][0]["text"]);
  // The same prompt again: its last boundary is 64 too, so the same entry serves it, with the same text.
  const json third = post(cached, "/v1/completions", b);
  EXPECT_EQ(third["timings"]["cached_n"], 64);
  EXPECT_EQ(third["choices"][0]["text"], second["choices"][0]["text"]);
  std::filesystem::remove_all(dir);
}

TEST(Serve, StreamingFollowsTheChunkContract) {
  ServerOptions o;
  o.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";
  TestServer s(o);
  const json body{{"messages", json::array({json{{"role", "system"}, {"content", "Tell a story."}},
                                           json{{"role", "user"}, {"content", json::array({json{{"type", "text"}, {"text", "Once upon a time"}}})}}})},
                  {"max_tokens", 20},
                  {"temperature", 0},
                  {"stream", true},
                  {"stream_options", json{{"include_usage", true}}}};
  auto r = s.client()->Post("/v1/chat/completions", dump(body), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  const std::vector<std::string> events = sse_events(r->body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string id, content;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json c = json::parse(events[i]);
    if (i == 0) id = c["id"];
    EXPECT_EQ(c["id"], id);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_TRUE(c.contains("created"));
    EXPECT_EQ(c["model"], "demo");
    if (i + 2 == events.size()) {  // the usage chunk
      EXPECT_TRUE(c["choices"].empty());
      EXPECT_EQ(c["usage"]["completion_tokens"], 20);
      EXPECT_GT(c["usage"]["prompt_tokens"].get<int>(), 5);
      continue;
    }
    EXPECT_TRUE(c["usage"].is_null());
    const json& choice = c["choices"][0];
    if (i == 0) EXPECT_EQ(choice["delta"]["role"], "assistant");
    else EXPECT_FALSE(choice["delta"].contains("role"));
    if (i + 3 == events.size()) {
      EXPECT_EQ(choice["finish_reason"], "length");
      EXPECT_EQ(c["timings"]["predicted_n"], 20);
    } else {
      EXPECT_TRUE(choice["finish_reason"].is_null());
    }
    if (choice["delta"].contains("content")) content += choice["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(id.rfind("chatcmpl-", 0), 0u);
  // The same request unstreamed: the same text, and exact usage.
  json whole = body;
  whole.erase("stream");
  whole.erase("stream_options");
  const json w = post(s, "/v1/chat/completions", whole);
  EXPECT_EQ(w["choices"][0]["message"]["content"], content);
  EXPECT_EQ(w["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(w["usage"]["total_tokens"], w["usage"]["prompt_tokens"].get<int>() + 20);
  // Chat logprobs: one entry per token, their texts making the content, alternatives sorted.
  json with_lp = whole;
  with_lp["logprobs"] = true;
  with_lp["top_logprobs"] = 2;
  const json l = post(s, "/v1/chat/completions", with_lp);
  const json& entries = l["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(entries.size(), 20u);
  std::string joined;
  for (const json& t : entries) {
    joined += t["token"].get<std::string>();
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_EQ(t["bytes"].size(), t["token"].get<std::string>().size());
    ASSERT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_GE(t["top_logprobs"][0]["logprob"].get<double>(), t["top_logprobs"][1]["logprob"].get<double>());
    EXPECT_EQ(t["top_logprobs"][0]["token"], t["token"]);  // greedy: the chosen token is the likeliest
  }
  EXPECT_EQ(joined, l["choices"][0]["message"]["content"]);
  EXPECT_EQ(joined, content);
}

TEST(Serve, StopStringsAndLogprobs) {
  TestServer s(ServerOptions{});
  const json free = post(s, "/v1/completions", greedy_completion("Once upon a time", 30));
  const std::string text = free["choices"][0]["text"];
  ASSERT_GT(text.size(), 12u);
  const std::string stop = text.substr(6, 3);  // a piece from inside the greedy text
  json with_stop = greedy_completion("Once upon a time", 30);
  with_stop["stop"] = json::array({"never appears in a story 123", stop});
  const json stopped = post(s, "/v1/completions", with_stop);
  EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(stopped["choices"][0]["text"], text.substr(0, text.find(stop)));
  // Streamed, the text before the stop string is the same and nothing of it leaks.
  with_stop["stream"] = true;
  auto r = s.client()->Post("/v1/completions", dump(with_stop), "application/json");
  ASSERT_TRUE(r);
  std::string streamed;
  for (const std::string& e : sse_events(r->body))
    if (e != "[DONE]") streamed += json::parse(e)["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(streamed, stopped["choices"][0]["text"]);

  json lp = greedy_completion("Once upon a time", 6);
  lp["logprobs"] = 3;
  const json got = post(s, "/v1/completions", lp);
  const json& l = got["choices"][0]["logprobs"];
  ASSERT_EQ(l["tokens"].size(), 6u);
  std::string joined;
  for (size_t i = 0; i < 6; ++i) {
    joined += l["tokens"][i].get<std::string>();
    EXPECT_LE(l["token_logprobs"][i].get<double>(), 0.0);
    EXPECT_EQ(l["top_logprobs"][i].size(), 3u);
    // Greedy: the chosen token is the likeliest.
    double best = -1e9;
    for (const auto& [tok, v] : l["top_logprobs"][i].items()) best = std::max(best, v.get<double>());
    EXPECT_NEAR(l["token_logprobs"][i].get<double>(), best, 1e-6);
  }
  EXPECT_EQ(joined, got["choices"][0]["text"]);
  EXPECT_EQ(got["choices"][0]["text"], free["choices"][0]["text"].get<std::string>().substr(0, joined.size()));
}

TEST(Serve, BadRequestsAreRefusedAndTheServerGoesOn) {
  ServerOptions o;
  o.ctx_size = 128;
  o.max_body_bytes = 4096;
  TestServer s(o);
  auto c = s.client();
  auto r = c->Post("/v1/completions", "{\"prompt\": ", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "invalid_json");
  r = c->Post("/v1/completions", R"({"prompt": "a", "max_tokens": "ten"})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(json::parse(r->body)["error"]["message"].get<std::string>().find("max_tokens"), std::string::npos);
  // A prompt longer than the context: both lengths named.
  std::vector<int> ids(200, 300);
  r = c->Post("/v1/completions", dump(json{{"prompt", ids}}), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  const std::string msg = json::parse(r->body)["error"]["message"];
  EXPECT_NE(msg.find("200"), std::string::npos) << msg;
  EXPECT_NE(msg.find("128"), std::string::npos) << msg;
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(json::parse(r->body)["error"]["param"], "prompt");
  // A body over the limit.
  r = c->Post("/v1/completions", dump(json{{"prompt", std::string(10000, 'a')}}), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "request_too_large");
  // n other than 1, chat without a template.
  r = c->Post("/v1/completions", R"({"prompt": "a", "n": 3})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  r = c->Post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}]})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "no_chat_template");
  r = c->Get("/v2/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  // A known path with another method: 405 naming the method it takes.
  r = c->Get("/v1/completions");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 405);
  EXPECT_EQ(r->get_header_value("Allow"), "POST");
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "method_not_allowed");
  r = c->Post("/metrics", "{}", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 405);
  EXPECT_EQ(r->get_header_value("Allow"), "GET");
  // Unknown fields are ignored; the server still answers.
  json ok = greedy_completion("Once upon a time", 4);
  ok["an_unknown_field"] = json{{"nested", json::array({1, 2})}};
  ok["user"] = "someone";
  const json got = post(s, "/v1/completions", ok);
  EXPECT_EQ(got["usage"]["completion_tokens"], 4);
  // tokenize / detokenize round trip.
  const json t = post(s, "/tokenize", json{{"content", "Once upon a time"}});
  EXPECT_FALSE(t["tokens"].empty());
  EXPECT_EQ(post(s, "/detokenize", json{{"tokens", t["tokens"]}})["content"], "Once upon a time");
}

// reasoning_effort and chat_template_kwargs reach the chat template: the prompt the server computes is
// the text the template makes of them (the same tokens as /tokenize of that text, and the same greedy
// continuation as /v1/completions of those tokens). The demo model does not reason: its answers have no
// reasoning_content. Wrong types are refused with the field named.
TEST(Serve, ReasoningEffortAndTemplateKwargsReachTheChatTemplate) {
  ServerOptions o;
  o.chat_template =
      "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
      "{% if style is defined %}Style: {{ style }}\n{% endif %}"
      "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";
  TestServer s(o);
  const json messages = json::array({json{{"role", "user"}, {"content", "Once upon a time"}}});
  auto chat = [&](const json& extra) {
    json body{{"messages", messages}, {"max_tokens", 6}, {"temperature", 0}, {"logprobs", true}};
    for (const auto& [k, v] : extra.items()) body[k] = v;
    return post(s, "/v1/chat/completions", body);
  };
  auto tokens_of = [&](const std::string& text) { return post(s, "/tokenize", json{{"content", text}})["tokens"]; };
  struct Case {
    json extra;
    std::string rendered;
  } cases[] = {
      {json::object(), "user: Once upon a time\nassistant:"},
      {json{{"reasoning_effort", "high"}}, "Reasoning: high\nuser: Once upon a time\nassistant:"},
      {json{{"reasoning_effort", "low"}, {"chat_template_kwargs", json{{"style", "terse"}, {"reasoning_effort", "medium"}}}},
       "Reasoning: low\nStyle: terse\nuser: Once upon a time\nassistant:"},
  };
  for (const Case& c : cases) {
    const json w = chat(c.extra);
    const json want = tokens_of(c.rendered);
    EXPECT_EQ(w["usage"]["prompt_tokens"], want.size()) << c.rendered;
    EXPECT_FALSE(w["choices"][0]["message"].contains("reasoning_content"));
    const json l = post(s, "/v1/completions", json{{"prompt", want}, {"max_tokens", 6}, {"temperature", 0}, {"logprobs", 0}});
    std::vector<std::string> from_chat;
    for (const json& t : w["choices"][0]["logprobs"]["content"]) from_chat.push_back(t["token"]);
    EXPECT_EQ(json(from_chat), l["choices"][0]["logprobs"]["tokens"]) << c.rendered;
  }
  // Streamed: no chunk has reasoning_content for a model that does not reason.
  auto r = s.client()->Post("/v1/chat/completions",
                            dump(json{{"messages", messages}, {"max_tokens", 6}, {"stream", true}, {"reasoning_effort", "high"}}),
                            "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body.find("reasoning_content"), std::string::npos);

  for (const auto& [field, value] : {std::pair<const char*, json>{"reasoning_effort", 3}, {"reasoning_effort", "maximal"},
                                     {"chat_template_kwargs", "style=terse"}, {"chat_template_kwargs", json{{"messages", json::array()}}}}) {
    int status = 0;
    const json e = post(s, "/v1/chat/completions", json{{"messages", messages}, {field, value}}, &status);
    EXPECT_EQ(status, 400) << field << " = " << value.dump();
    EXPECT_EQ(e["error"]["param"], field) << e.dump();
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  }
}

TEST(Serve, AClientStallingInItsHeadersIsTimedOut) {
  ServerOptions o;
  o.timeout_seconds = 1;
  TestServer s(o);
  RawSocket raw(s.port());
  ASSERT_TRUE(raw.connected());
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le";
  for (char ch : head) {  // byte by byte, then nothing
    ASSERT_TRUE(raw.send(std::string(1, ch)));
    std::this_thread::sleep_for(2ms);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::string got = raw.read_some();  // the server closes the connection (EOF) after its read timeout
  while (!got.empty() && std::chrono::steady_clock::now() - t0 < 8s) got = raw.read_some();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, 5.0) << "the stalled connection was not closed";
  // Others are served meanwhile and after.
  EXPECT_EQ(post(s, "/v1/completions", greedy_completion("Once", 3))["usage"]["completion_tokens"], 3);
}

TEST(Serve, AClientLeavingMidStreamIsCancelledAndItsBlocksGoBack) {
  ServerOptions o;
  o.prefix_cache = false;  // what the pool holds after the test is then exactly what requests hold
  o.kv.block_tokens = 16;
  TestServer s(o);
  // A request that runs meanwhile must not notice.
  const json other = greedy_completion("There was a little dog", 40);
  const std::string expected = post(s, "/v1/completions", other)["choices"][0]["text"];
  auto running_other = std::async(std::launch::async, [&] { return post(s, "/v1/completions", other); });

  RawSocket raw(s.port());
  ASSERT_TRUE(raw.connected());
  // Sampled, with EOS (id 0 in the demo vocabulary) biased away: it runs until the client leaves.
  const std::string body = dump(json{{"prompt", "Once upon a time"}, {"max_tokens", 1500}, {"temperature", 0.8},
                                     {"logit_bias", json{{"0", -100}}}, {"stream", true}});
  ASSERT_TRUE(raw.send("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
                       std::to_string(body.size()) + "\r\n\r\n" + body));
  std::string got;
  for (int i = 0; i < 50 && got.find("data: ") == std::string::npos; ++i) got += raw.read_some();
  ASSERT_NE(got.find("data: "), std::string::npos) << got;
  // The gauges are published after each step: wait (bounded) for the one that admitted the stream.
  auto wait_for = [&](auto done) {
    const auto t0 = std::chrono::steady_clock::now();
    while (!done() && std::chrono::steady_clock::now() - t0 < 10s) std::this_thread::sleep_for(5ms);
    return done();
  };
  EXPECT_TRUE(wait_for([&] { return metric(s, "turboquant_kv_pool_blocks_in_use") > 0; }));
  EXPECT_EQ(running_other.get()["choices"][0]["text"], expected);
  EXPECT_TRUE(wait_for([&] { return metric(s, "turboquant_requests_running") == 1; }));  // the stream alone
  raw.close();
  // Within a few steps (bounded here by time) the request is gone and its blocks are back.
  const std::string cancelled = "turboquant_requests_finished_total\\{reason=\"cancelled\"\\}";
  EXPECT_TRUE(wait_for([&] {
    return metric(s, cancelled) == 1 && metric(s, "turboquant_kv_pool_blocks_in_use") == 0 && metric(s, "turboquant_requests_running") == 0;
  })) << "cancelled " << metric(s, cancelled) << ", blocks in use " << metric(s, "turboquant_kv_pool_blocks_in_use");
  // The server goes on.
  EXPECT_EQ(post(s, "/v1/completions", other)["choices"][0]["text"], expected);
}

TEST(Serve, AFullKvPoolQueuesRequestsAndEveryOneIsAnsweredExactly) {
  // Under ThreadSanitizer (where the full size took minutes) the same, smaller: 6 requests of 40 + 60
  // positions, 4 running at a time (400 positions together) in a pool of 250 positions' bytes.
  constexpr bool kSmall = testing_util::kThreadSanitizer;
  const int n_requests = kSmall ? 6 : 8, prompt_tokens = kSmall ? 40 : 60, max_tokens = kSmall ? 60 : 150;
  const int64_t pool_positions = kSmall ? 250 : 600;
  ServerOptions o;
  o.parallel = 4;
  o.kv.block_tokens = 16;
  o.prefix_cache = false;
  // 8 layers x 2 KV heads x 64 dims x (K + V) x FP16 = 4 KiB a position: 600 positions' bytes (about 700
  // positions in all, in whole blocks) are fewer than 4 sequences of 60 + 150 positions need together.
  o.kv_pool_bytes = pool_positions * 4096;
  TestServer s(o);
  std::vector<json> requests;
  for (int i = 0; i < n_requests; ++i) {
    std::vector<int> ids;
    for (int k = 0; k < prompt_tokens; ++k) ids.push_back(200 + (k * 13 + i * 7) % 800);
    requests.push_back(json{{"prompt", ids}, {"max_tokens", max_tokens}, {"temperature", 0}});
  }
  std::vector<std::string> alone;
  for (const json& r : requests) alone.push_back(post(s, "/v1/completions", r)["choices"][0]["text"]);
  std::vector<std::future<json>> futures;
  for (const json& r : requests) futures.push_back(std::async(std::launch::async, [&s, r] { return post(s, "/v1/completions", r); }));
  for (size_t i = 0; i < futures.size(); ++i) EXPECT_EQ(futures[i].get()["choices"][0]["text"], alone[i]) << "request " << i;
  EXPECT_GT(metric(s, "turboquant_kv_pool_waits_total"), 0);  // the pool did run full
  EXPECT_GT(metric(s, "turboquant_preemptions_total"), 0);    // and sequences were set back, then recomputed
  EXPECT_EQ(metric(s, "turboquant_kv_pool_blocks_in_use"), 0);
  const json props = json::parse(s.client()->Get("/props")->body);
  EXPECT_GT(props["kv_pool"]["bytes_capacity"].get<int64_t>(), 0);
  EXPECT_LE(props["kv_pool"]["bytes_capacity"].get<int64_t>(), 2 * pool_positions * 4096);
  EXPECT_EQ(props["kv"]["describe"], "K f16, V f16");
  // The demo model has full-attention layers only: its prefix cache is on as asked (a model with
  // sliding-window or recurrent layers reports "off (asked for, but ...)").
  EXPECT_EQ(props["prefix_cache_state"], props["prefix_cache"].get<bool>() ? "on" : "off");
}

// The up-front memory check on both sides of a budget set to the plan's own total: the same options load
// with that budget and are refused, naming the numbers, with one byte less (runtime/memory_plan.h).
TEST(Serve, RefusesUpFrontARunThatDoesNotFitTheMemoryBudget) {
  const ModelFiles headers = open_model_headers(kDemo);
  PlanRequest r;
  r.layers = layer_specs_for(headers.config);
  r.config = headers.config;
  r.weight_bytes = file_tensor_bytes(headers.tensors());
  r.kv.resolve();
  r.context = 256;
  r.parallel = 2;
  r.prefill_chunk = 512;  // ServerOptions::batch_tokens
  const int64_t total = plan_memory(r).total_bytes();
  for (const int64_t budget : {total, total - 1}) {
    ServerOptions o;
    o.parallel = 2;
    o.ctx_size = 256;
    o.memory_budget_bytes = budget;
    TestServer s(o, /*load_now=*/false);
    if (budget == total) {
      EXPECT_NO_THROW(s.load());
    } else {
      try {
        s.load();
        ADD_FAILURE() << "a budget one byte below the plan's " << total << " bytes was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("more than the"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(std::to_string(budget) + " bytes"), std::string::npos) << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace tq::serve
