#include "kv/cache_file.h"

#include <cstring>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "kv/json_field.h"

namespace tq {

namespace {

constexpr char kMagic[8] = {'T', 'Q', 'P', 'R', 'O', 'M', 'P', 'T'};
constexpr char kKVCacheMagic[8] = {'T', 'Q', 'K', 'V', 'C', 'A', 'C', 'H'};  // KVCache::save's
// Version 2: its layers may be centred KV caches (KV cache file version 2, kv/cache.cc); version 1 files,
// whose layers are version 1, still load.
constexpr uint32_t kVersion = 2;
constexpr uint32_t kOldestVersion = 1;
constexpr size_t kPreamble = 16;  // magic, version, header length
constexpr size_t kTrailer = 8;    // the checksum

const char* kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::full_attention: return "full_attention";
    case LayerKind::sliding_attention: return "sliding_attention";
    case LayerKind::linear_attention: return "linear_attention";
  }
  return "?";
}

LayerKind parse_kind(const std::string& s) {
  for (LayerKind k : {LayerKind::full_attention, LayerKind::sliding_attention, LayerKind::linear_attention})
    if (s == kind_name(k)) return k;
  fail("unknown layer kind '", s, "' (full_attention, sliding_attention, linear_attention)");
}

std::string state_words(const StateShape& s) {
  std::ostringstream os;
  os << "conv " << s.conv_channels << "x" << std::max(0, s.conv_kernel - 1) << ", recurrent " << s.state_heads << "x" << s.state_dk << "x"
     << s.state_dv;
  return os.str();
}

std::string heads_words(const LayerFingerprint& l) {
  std::ostringstream os;
  os << l.n_kv_heads << " KV heads of " << l.head_dim;
  return os.str();
}

// What a cache of this layer holds: "a state cache of conv 96x3, recurrent 4x32x32".
std::string cache_words(const LayerFingerprint& l) {
  switch (l.kind) {
    case LayerKind::linear_attention: return "a state cache of " + state_words(l.state);
    case LayerKind::sliding_attention: return "a sliding-window KV cache (window " + std::to_string(l.window) + ") of " + heads_words(l);
    case LayerKind::full_attention: break;
  }
  return "a full-attention KV cache of " + heads_words(l);
}

// What the model's layer is: "full attention with 2 KV heads of 64".
std::string layer_words(const LayerFingerprint& l) {
  switch (l.kind) {
    case LayerKind::linear_attention: return "linear attention with a state of " + state_words(l.state);
    case LayerKind::sliding_attention: return "sliding-window attention (window " + std::to_string(l.window) + ") with " + heads_words(l);
    case LayerKind::full_attention: break;
  }
  return "full attention with " + heads_words(l);
}

bool same_shape(const LayerFingerprint& a, const LayerFingerprint& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == LayerKind::linear_attention)
    return a.state.conv_channels == b.state.conv_channels && a.state.conv_kernel == b.state.conv_kernel &&
           a.state.state_heads == b.state.state_heads && a.state.state_dk == b.state.state_dk && a.state.state_dv == b.state.state_dv;
  return a.n_kv_heads == b.n_kv_heads && a.head_dim == b.head_dim && (a.kind != LayerKind::sliding_attention || a.window == b.window);
}

nlohmann::json fingerprint_json(const ModelFingerprint& f) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerFingerprint& l : f.layers) {
    nlohmann::json j = {{"kind", kind_name(l.kind)}};
    if (l.kind == LayerKind::linear_attention) {
      j["conv_channels"] = l.state.conv_channels;
      j["conv_kernel"] = l.state.conv_kernel;
      j["state_heads"] = l.state.state_heads;
      j["state_dk"] = l.state.state_dk;
      j["state_dv"] = l.state.state_dv;
    } else {
      j["n_kv_heads"] = l.n_kv_heads;
      j["head_dim"] = l.head_dim;
      j["window"] = l.window;
      j["format"] = l.format;
    }
    layers.push_back(j);
  }
  return {{"architecture", f.architecture}, {"layers", layers}};
}

ModelFingerprint fingerprint_from_json(const nlohmann::json& j) {
  ModelFingerprint f;
  f.architecture = j.at("architecture").get<std::string>();
  for (const nlohmann::json& jl : j.at("layers")) {
    LayerFingerprint l;
    l.kind = parse_kind(jl.at("kind").get<std::string>());
    if (l.kind == LayerKind::linear_attention) {
      l.state.conv_channels = integer_field<int>(jl, "conv_channels");
      l.state.conv_kernel = integer_field<int>(jl, "conv_kernel");
      l.state.state_heads = integer_field<int>(jl, "state_heads");
      l.state.state_dk = integer_field<int>(jl, "state_dk");
      l.state.state_dv = integer_field<int>(jl, "state_dv");
      TQ_CHECK(l.state.conv_channels >= 0 && l.state.conv_kernel >= 0 && l.state.state_heads >= 0 && l.state.state_dk >= 0 &&
                   l.state.state_dv >= 0,
               "a state shape of ", state_words(l.state));
    } else {
      l.n_kv_heads = integer_field<int>(jl, "n_kv_heads");
      l.head_dim = integer_field<int>(jl, "head_dim");
      l.window = integer_field<int>(jl, "window");
      l.format = jl.at("format").get<std::string>();
    }
    f.layers.push_back(l);
  }
  return f;
}

// A state's floats: conv [conv_channels][conv_kernel - 1], then recurrent [state_heads][state_dk][state_dv].
size_t state_floats(const StateShape& s, size_t* conv = nullptr) {
  const size_t c = static_cast<size_t>(s.conv_channels) * static_cast<size_t>(std::max(0, s.conv_kernel - 1));
  if (conv) *conv = c;
  return c + static_cast<size_t>(s.state_heads) * static_cast<size_t>(s.state_dk) * static_cast<size_t>(s.state_dv);
}

struct SavedSequence {
  int id = 0, length = 0;
};

}  // namespace

ModelFingerprint model_fingerprint(const std::string& architecture, const std::vector<LayerSpec>& layers) {
  ModelFingerprint f{architecture, {}};
  for (const LayerSpec& s : layers) {
    LayerFingerprint l;
    l.kind = s.kind;
    if (s.kind == LayerKind::linear_attention) {
      l.state = s.state;
    } else {
      l.n_kv_heads = s.n_kv_heads;
      l.head_dim = s.head_dim;
      l.window = s.kind == LayerKind::sliding_attention ? s.window : 0;
    }
    f.layers.push_back(l);
  }
  return f;
}

namespace {
LayerFingerprint kv_fingerprint(const KVCache& kv) {
  LayerFingerprint l;
  l.kind = kv.options().window > 0 ? LayerKind::sliding_attention : LayerKind::full_attention;
  l.n_kv_heads = kv.n_kv_heads();
  l.head_dim = kv.head_dim();
  l.window = kv.options().window;
  l.format = kv.describe();
  return l;
}
}  // namespace

ModelFingerprint cache_fingerprint(const std::string& architecture, const PromptCache& caches) {
  ModelFingerprint f{architecture, {}};
  for (size_t i = 0; i < caches.size(); ++i) {
    LayerFingerprint l;
    if (const auto* kv = dynamic_cast<const KVCache*>(caches[i].get())) {
      l = kv_fingerprint(*kv);
    } else if (const auto* state = dynamic_cast<const RecurrentStateCache*>(caches[i].get())) {
      l.kind = LayerKind::linear_attention;
      l.state = state->shape();
    } else {
      fail("layer ", i, "'s cache (", caches[i]->describe(),
           ") cannot go into a prompt cache file: it holds KV caches in host memory (KVCache) and recurrent states");
    }
    f.layers.push_back(l);
  }
  return f;
}

std::string first_difference(const ModelFingerprint& held, const ModelFingerprint& model, const std::string& holder) {
  std::ostringstream os;
  if (held.architecture != model.architecture) {
    os << holder << " is of a " << held.architecture << " model; this model is " << model.architecture;
  } else if (held.layers.size() != model.layers.size()) {
    os << holder << " holds " << held.layers.size() << " layers; this model has " << model.layers.size();
  } else {
    for (size_t i = 0; i < held.layers.size(); ++i) {
      const LayerFingerprint &a = held.layers[i], &b = model.layers[i];
      if (!same_shape(a, b)) {
        os << "layer " << i << ": " << holder << " holds " << cache_words(a) << "; this model's layer " << i << " is " << layer_words(b);
        break;
      }
      if (!a.format.empty() && !b.format.empty() && a.format != b.format) {
        os << "layer " << i << ": " << holder << " holds a KV cache of " << a.format << "; the one expected is " << b.format;
        break;
      }
    }
  }
  return os.str();
}

// File: magic[8] "TQPROMPT", u32 version, u32 header length L, L bytes of JSON (fingerprint, metadata,
// sequences, the byte size of each layer's record), the layer records in layer order, then the u64 FNV-1a
// of every byte before it. A KV layer's record is what KVCache::save writes; a state layer's is, per
// sequence in the header's order, its conv state then its recurrent state (float32). docs/FORMATS.md.
void save_prompt_cache(const std::string& path, const PromptCache& caches, const ModelFingerprint& model,
                       const PromptCacheMetadata& metadata) {
  const ModelFingerprint held = cache_fingerprint(model.architecture, caches);
  const std::string difference = first_difference(held, model, "the prompt cache");
  TQ_CHECK(difference.empty(), "cannot save a prompt cache to '", path, "': the caches are not this model's: ", difference);
  std::vector<SavedSequence> seqs;
  if (!caches.empty())
    for (int id : caches[0]->sequences()) seqs.push_back({id, caches[0]->length(id)});
  for (size_t l = 0; l < caches.size(); ++l) {
    TQ_CHECK(caches[l]->sequences().size() == seqs.size(), "cannot save a prompt cache to '", path, "': layer ", l, " holds ",
             caches[l]->sequences().size(), " sequences, layer 0 ", seqs.size());
    for (const SavedSequence& s : seqs)
      TQ_CHECK(caches[l]->has_sequence(s.id) && caches[l]->length(s.id) == s.length, "cannot save a prompt cache to '", path,
               "': sequence ", s.id, " holds ", s.length, " positions in layer 0 but not in layer ", l);
  }

  std::vector<std::vector<uint8_t>> records;
  for (const auto& cache : caches) {
    if (const auto* kv = dynamic_cast<const KVCache*>(cache.get())) {
      records.push_back(kv->to_bytes());
      continue;
    }
    const auto& state = dynamic_cast<const RecurrentStateCache&>(*cache);  // cache_fingerprint refused any other
    std::vector<uint8_t> r;
    for (const SavedSequence& s : seqs) {
      const StateSnapshot snap = state.snapshot(s.id);
      for (const std::vector<float>* a : {&snap.conv(), &snap.recurrent()}) {
        const auto* p = reinterpret_cast<const uint8_t*>(a->data());
        r.insert(r.end(), p, p + a->size() * sizeof(float));
      }
    }
    records.push_back(std::move(r));
  }

  nlohmann::json jseqs = nlohmann::json::array(), sizes = nlohmann::json::array();
  for (const SavedSequence& s : seqs) jseqs.push_back({{"id", s.id}, {"length", s.length}});
  for (const auto& r : records) sizes.push_back(r.size());
  const nlohmann::json header = {{"fingerprint", fingerprint_json(held)}, {"metadata", metadata}, {"sequences", jseqs}, {"layer_bytes", sizes}};
  const std::string text = header.dump();

  std::vector<uint8_t> bytes = framed_header(kMagic, kVersion, text);
  auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  };
  for (const auto& r : records) put(r.data(), r.size());
  const uint64_t hash = fnv1a(bytes.data(), bytes.size());
  put(&hash, 8);
  std::ofstream f(path, std::ios::binary);
  TQ_CHECK(f.good(), "cannot open '", path, "' for writing");
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  TQ_CHECK(f.good(), "writing the prompt cache file '", path, "' failed");
}

LoadedPromptCache load_prompt_cache(const std::string& path, const ModelFingerprint& model) {
  std::ifstream f(path, std::ios::binary);
  TQ_CHECK(f.good(), "cannot open the prompt cache file '", path, "'");
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::string name = "prompt cache file '" + path + "'";
  TQ_CHECK(bytes.size() < 8 || std::memcmp(bytes.data(), kKVCacheMagic, 8) != 0, name,
           " is a single layer's KV cache file (KVCache::save), not a prompt cache");
  const std::string header_text = framed_header_text(bytes, kMagic, kVersion, name, "prompt cache file", kOldestVersion);
  const size_t len = header_text.size();

  LoadedPromptCache out;
  std::vector<SavedSequence> seqs;
  std::vector<uint64_t> sizes;
  try {
    const nlohmann::json header = nlohmann::json::parse(header_text);
    out.fingerprint = fingerprint_from_json(header.at("fingerprint"));
    out.metadata = header.at("metadata").get<PromptCacheMetadata>();
    for (const nlohmann::json& js : header.at("sequences")) seqs.push_back({integer_field<int>(js, "id"), integer_field<int>(js, "length")});
    for (const nlohmann::json& n : header.at("layer_bytes")) sizes.push_back(n.get<uint64_t>());
  } catch (const nlohmann::json::exception& e) {
    fail(name, " has a malformed header: ", e.what());
  } catch (const Error& e) {
    fail(name, " has a malformed header: ", e.what());
  }
  // Another model's cache would run and be wrong: this is the check that matters most, so it comes first.
  const std::string difference = first_difference(out.fingerprint, model);
  TQ_CHECK(difference.empty(), name, " holds another model's cache: ", difference);
  TQ_CHECK(sizes.size() == out.fingerprint.layers.size(), name, " is inconsistent: its header has ", sizes.size(), " layer sizes for ",
           out.fingerprint.layers.size(), " layers");
  for (size_t i = 0; i < seqs.size(); ++i) {
    TQ_CHECK(seqs[i].id >= 0 && seqs[i].length >= 0, name, " is inconsistent: sequence ", seqs[i].id, " of ", seqs[i].length, " positions");
    for (size_t j = 0; j < i; ++j) TQ_CHECK(seqs[j].id != seqs[i].id, name, " is inconsistent: it lists sequence ", seqs[i].id, " twice");
  }

  // The records must be in the payload before anything is built from them: a header that lies about the
  // sizes would otherwise allocate what it names.
  size_t off = kPreamble + len;
  const size_t end = bytes.size() - kTrailer;
  for (size_t l = 0; l < sizes.size(); ++l) {
    const std::string layer_name = name + ", layer " + std::to_string(l);
    TQ_CHECK(sizes[l] <= end - off, name, " is truncated: layer ", l, "'s record of ", sizes[l], " bytes is past the end of the file");
    const std::span<const uint8_t> record(bytes.data() + off, static_cast<size_t>(sizes[l]));
    off += static_cast<size_t>(sizes[l]);
    const LayerFingerprint& fp = out.fingerprint.layers[l];
    if (fp.kind == LayerKind::linear_attention) {
      size_t conv = 0;
      const size_t floats = state_floats(fp.state, &conv);
      // In 128 bits: no product overflows whatever the header says.
      const unsigned __int128 need = static_cast<unsigned __int128>(seqs.size()) * floats * sizeof(float);
      TQ_CHECK(need == record.size(), layer_name, " holds ", record.size(), " bytes; ", seqs.size(), " states of ", state_words(fp.state),
               " are ", static_cast<uint64_t>(need));
      auto cache = std::make_unique<StateCache>(fp.state);
      const auto* p = reinterpret_cast<const uint8_t*>(record.data());
      for (const SavedSequence& s : seqs) {
        std::vector<float> c(conv), r(floats - conv);
        std::memcpy(c.data(), p, conv * sizeof(float));
        std::memcpy(r.data(), p + conv * sizeof(float), r.size() * sizeof(float));
        p += floats * sizeof(float);
        cache->add_sequence_with_id(s.id);
        cache->restore(s.id, StateSnapshot(fp.state, std::move(c), std::move(r), s.length));
      }
      out.caches.push_back(std::move(cache));
      continue;
    }
    std::unique_ptr<KVCache> kv = KVCache::from_bytes(record, layer_name + "'s KV cache");
    // The record is what the header says it is, and holds the header's sequences.
    const LayerFingerprint got = kv_fingerprint(*kv);
    TQ_CHECK(same_shape(got, fp) && got.format == fp.format, name, " is inconsistent: its header says layer ", l, " holds ", cache_words(fp),
             " (", fp.format, "), its record ", cache_words(got), " (", got.format, ")");
    TQ_CHECK(kv->sequences().size() == seqs.size(), name, " is inconsistent: layer ", l, " holds ", kv->sequences().size(),
             " sequences, the header lists ", seqs.size());
    for (const SavedSequence& s : seqs)
      TQ_CHECK(kv->has_sequence(s.id) && kv->length(s.id) == s.length, name, " is inconsistent: the header lists sequence ", s.id, " of ",
               s.length, " positions, layer ", l, " does not hold it");
    out.caches.push_back(std::move(kv));
  }
  TQ_CHECK(off == end, name, " has ", end - off, " unexpected trailing bytes");
  return out;
}

}  // namespace tq
