#include "model/tq_convert.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>

#include <nlohmann/json.hpp>

#include "codec/rotation.h"
#include "core/error.h"
#include "core/read_file.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/tq_weights.h"
#include "ops/tq_weights.h"

namespace tq {

namespace fs = std::filesystem;

namespace {

// What a source tensor is, for the skip rules.
enum class Role { attn, mlp, embed, head, other };

Role role_of(const std::string& name, int64_t& layer) {
  static const std::regex kLinear(R"(model\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight)");
  std::smatch m;
  layer = -1;
  if (std::regex_match(name, m, kLinear)) {
    layer = std::stoll(m[1].str());
    return m[2].str() == "self_attn" ? Role::attn : Role::mlp;
  }
  if (name == "model.embed_tokens.weight") return Role::embed;
  if (name == "lm_head.weight") return Role::head;
  static const std::regex kLayer(R"(model\.layers\.(\d+)\..*)");
  if (std::regex_match(name, m, kLayer)) layer = std::stoll(m[1].str());
  return Role::other;
}

// One tensor of the output file, declared before any data is written.
struct OutEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
};

class File {
 public:
  explicit File(const std::string& path) : path_(path), f_(std::fopen(path.c_str(), "wb")) {
    TQ_CHECK(f_ != nullptr, "'", path, "': cannot create the file");
  }
  ~File() {
    if (f_) std::fclose(f_);
  }
  void write(const void* p, size_t n) {
    TQ_CHECK(n == 0 || std::fwrite(p, 1, n, f_) == n, "'", path_, "': write failed (disk full?)");
    written_ += n;
  }
  uint64_t written() const { return written_; }
  void close() {
    TQ_CHECK(std::fclose(f_) == 0, "'", path_, "': close failed");
    f_ = nullptr;
  }

 private:
  std::string path_;
  std::FILE* f_;
  uint64_t written_ = 0;
};

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::u8: return "U8";
    default: break;
  }
  fail("a ", dtype_name(t), " tensor cannot be copied into safetensors");
}

// R H R^T for the rotation R of a matrix's columns: H of the rotated inputs R x, from H of the inputs x.
std::vector<double> rotated_hessian(const std::vector<double>& h, int64_t cols, const Rotation& rotation) {
  const size_t n = static_cast<size_t>(cols);
  std::vector<float> t(n * n), row(n);  // t [n][n] = H R^T; row [n]: one row or column being rotated
  for (size_t i = 0; i < n; ++i) {  // row i of H R^T = R applied to row i of H
    for (size_t j = 0; j < n; ++j) row[j] = static_cast<float>(h[i * n + j]);
    rotation.forward(row.data());
    std::copy(row.begin(), row.end(), t.begin() + static_cast<std::ptrdiff_t>(i * n));
  }
  std::vector<double> out(n * n);
  for (size_t j = 0; j < n; ++j) {  // column j of H R^T, rotated, is column j of R H R^T
    for (size_t i = 0; i < n; ++i) row[i] = t[i * n + j];
    rotation.forward(row.data());
    for (size_t i = 0; i < n; ++i) out[i * n + j] = row[i];
  }
  return out;
}

}  // namespace

TqConvertReport convert_to_turboquant(const std::string& input, const std::string& output, const TqConvertOptions& options,
                                      ThreadPool& pool, const std::function<void(size_t, size_t, const std::string&)>& progress) {
  std::error_code ec;
  TQ_CHECK(!fs::exists(output, ec), "output '", output, "' exists; turboquant-convert never overwrites (remove it or pick another)");
  TQ_CHECK(fs::exists(input, ec), "input '", input, "' does not exist");
  TQ_CHECK(fs::path(input).extension() != ".gguf", "'", input,
           "': GGUF input is not supported yet; convert from the Hugging Face folder");
  TQ_CHECK(fs::is_directory(input, ec), "input '", input, "' is not a model folder");
  const ModelConfig config = load_hf_config(input);
  const ModelArch a = config.arch;
  TQ_CHECK((a == ModelArch::llama || a == ModelArch::mistral || a == ModelArch::qwen2 || a == ModelArch::qwen3) &&
               config.num_experts == 0,
           "'", input, "': turboquant-convert handles the Llama family (llama, mistral, qwen2, qwen3), not ", architecture_name(a));
  for (int b : {options.bits, options.attn_bits, options.mlp_bits})
    TQ_CHECK(b == 0 || (b >= 2 && b <= 4), "bits must be 2, 3 or 4, got ", b);
  TQ_CHECK(options.bits != 0, "bits must be 2, 3 or 4, got 0");
  TQ_CHECK(options.group_size == 32 || options.group_size == 64 || options.group_size == 128, "group size must be 32, 64 or 128, got ",
           options.group_size);
  const std::string partial = output + ".partial";
  TQ_CHECK(!fs::exists(partial, ec), "'", partial, "' exists (an earlier run that failed?); remove it first");

  SafetensorsModel src = SafetensorsModel::open(input);
  const TensorSet& tensors = src.tensors();

  // ---- the plan: every tensor quantized or copied, with the reason when it is not quantized
  TqQuantization q;
  q.bits = options.bits;
  q.group_size = options.group_size;
  q.attn_bits = options.attn_bits ? options.attn_bits : options.bits;
  q.mlp_bits = options.mlp_bits ? options.mlp_bits : options.bits;
  q.codebook = options.codebook;
  q.norm_correction = options.scale_fit == ops::TqScaleFit::norm_correction;
  q.scale_fit = ops::scale_fit_name(options.scale_fit);
  if (options.calibration) {
    TQ_CHECK(options.calibration->tokens > 0, "GPTQ calibration of no tokens");
    TQ_CHECK(options.gptq_damp > 0 && options.gptq_damp < 1, "GPTQ damping ", options.gptq_damp, " is not in (0, 1)");
    q.calibration_text = options.calibration->text;
    q.calibration_tokens = options.calibration->tokens;
    q.calibration_damp = options.gptq_damp;
  }
  q.rotation_seed = options.rotation_seed;
  q.quantize_extras = options.quantize_extras;
  TqConvertReport report;
  std::vector<OutEntry> entries;
  std::vector<int> plan;  // [tensors]: index into q.tensors, -1 when copied
  const int g = options.group_size;
  for (const TensorView& t : tensors.all()) {
    TqTensorReport r;
    r.name = t.name;
    r.bytes_in = t.nbytes;
    const Role role = role_of(t.name, r.layer);
    const bool matrix = t.shape.size() == 2;
    const bool floats = t.dtype == DType::f32 || t.dtype == DType::f16 || t.dtype == DType::bf16;
    if (role == Role::other) r.skip_reason = matrix ? "not a linear layer of the rules" : "norm or vector";
    else if ((role == Role::embed || role == Role::head) && !options.quantize_extras)
      r.skip_reason = role == Role::embed ? "embedding (--quantize-extras includes it)" : "output head (--quantize-extras includes it)";
    else if (!matrix || !floats) r.skip_reason = std::string("a ") + dtype_name(t.dtype) + " tensor of " + shape_string(t.shape);
    else if (t.shape[0] < 32 || t.shape[1] < 32) r.skip_reason = "under 32 rows or columns";
    else if (t.shape[1] % g != 0) r.skip_reason = "input dimension not a multiple of the group size";
    if (r.skip_reason.empty()) {
      const int bits = role == Role::attn ? q.attn_bits : role == Role::mlp ? q.mlp_bits : q.bits;
      TqTensorEntry e;
      e.name = t.name.substr(0, t.name.size() - 7);  // drop ".weight"
      e.shape = t.shape;
      e.bits = bits;
      e.group_size = g;
      e.seed = tq_rotation_seed(options.rotation_seed, tq_rotation_key(t.name));
      e.rotation_block = 0;  // the quantizer's, below
      plan.push_back(static_cast<int>(q.tensors.size()));
      q.tensors.push_back(e);
      const ops::DType dt = ops::tq_dtype(bits);
      entries.push_back({e.name + ".tq_codes", "U8", {t.shape[0], t.shape[1] * bits / 8},
                         static_cast<uint64_t>(t.shape[0]) * ops::tq_code_bytes(dt, t.shape[1])});
      entries.push_back({e.name + ".tq_scales", "F16", {t.shape[0], t.shape[1] / g}, static_cast<uint64_t>(t.shape[0] * (t.shape[1] / g)) * 2});
      r.quantized = true;
      r.bits = bits;
      r.group_size = g;
      r.bytes_out = entries[entries.size() - 2].bytes + entries.back().bytes;
    } else {
      plan.push_back(-1);
      q.skipped.push_back(t.name);
      q.skip_reasons.push_back(r.skip_reason);
      entries.push_back({t.name, safetensors_dtype(t.dtype), t.shape, t.nbytes});
      r.bytes_out = t.nbytes;
    }
    report.bytes_in += r.bytes_in;
    report.bytes_out += r.bytes_out;
    report.tensors.push_back(r);
  }

  // ---- the header, then the data in declaration order
  fs::create_directories(partial);
  // A run that fails leaves nothing behind (not even the .partial folder).
  struct Cleanup {
    const std::string& path;
    bool done = false;
    ~Cleanup() {
      std::error_code ignored;
      if (!done) fs::remove_all(path, ignored);
    }
  } cleanup{partial};
  const std::string weights_path = (fs::path(partial) / "model.safetensors").string();
  {
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    nlohmann::ordered_json meta = {{"format", "pt"}};
    for (const auto& [alias, target] : tensors.aliases()) {
      const TensorView* t = tensors.find(target);
      bool quantized = false;
      for (size_t i = 0; i < tensors.all().size(); ++i) quantized |= &tensors.all()[i] == t && plan[i] >= 0;
      if (!quantized) meta[alias] = target;  // a quantized target's alias is dropped: the config's tie says it
    }
    h["__metadata__"] = meta;
    uint64_t offset = 0;
    for (const OutEntry& e : entries) {
      h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes}}};
      offset += e.bytes;
    }
    std::string header = h.dump();
    while ((8 + header.size()) % 8 != 0) header.push_back(' ');
    File f(weights_path);
    const uint64_t len = header.size();
    f.write(&len, 8);
    f.write(header.data(), header.size());
    const uint64_t data_start = f.written();
    std::map<std::string, std::unique_ptr<ops::TqGptqFactor>> factors;  // rotation key -> GPTQ factor, one layer's
    int64_t factor_layer = -2;

    for (size_t i = 0; i < tensors.all().size(); ++i) {
      const TensorView& t = tensors.all()[i];
      TqTensorReport& r = report.tensors[i];
      if (plan[i] < 0) {
        f.write(t.data, t.nbytes);
      } else {
        TqTensorEntry& e = q.tensors[static_cast<size_t>(plan[i])];
        ops::TqQuantizeOptions qo;
        qo.bits = e.bits;
        qo.group_size = e.group_size;
        qo.codebook = options.codebook;
        qo.scale_fit = options.scale_fit;
        qo.seed = e.seed;
        const int64_t rows = t.shape[0], cols = t.shape[1];
        const ops::TqRowQuantizer quantizer(cols, qo);
        e.rotation_block = quantizer.params().rotation_block;
        // GPTQ for the layer matrices when calibrated: the factor of this input's H in this rotation.
        const ops::TqGptqFactor* factor = nullptr;
        if (options.calibration && r.layer >= 0) {
          const std::string key = tq_rotation_key(t.name);
          if (factor_layer != r.layer) {
            factors.clear();  // a layer's matrices are contiguous in the file: keep one layer's factors
            factor_layer = r.layer;
          }
          auto it = factors.find(key);
          if (it == factors.end()) {
            const auto h = options.calibration->hessians.find(key);
            TQ_CHECK(h != options.calibration->hessians.end(), "GPTQ: the calibration has no inputs of '", key, "' (for ", t.name, ")");
            TQ_CHECK(h->second.size() == static_cast<size_t>(cols * cols), "GPTQ: the calibration's H of '", key, "' is not ", cols,
                     " x ", cols);
            it = factors.emplace(key, std::make_unique<ops::TqGptqFactor>(rotated_hessian(h->second, cols, quantizer.rotation()), cols,
                                                                          options.gptq_damp)).first;
          }
          factor = it->second.get();
          r.gptq = true;
        }
        const size_t cb = quantizer.code_bytes(), groups = static_cast<size_t>(quantizer.groups());
        std::vector<uint16_t> scales(static_cast<size_t>(rows) * groups);  // [rows][groups]: written after the codes
        constexpr int64_t kBlock = 256;                                   // rows in memory at a time
        std::vector<uint8_t> codes(static_cast<size_t>(kBlock) * cb);     // [kBlock][code bytes]
        std::vector<double> err(static_cast<size_t>(pool.size())), ref(static_cast<size_t>(pool.size()));  // per thread
        for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
          const int64_t n = std::min(kBlock, rows - r0);
          pool.parallel_for(static_cast<size_t>(n), [&](size_t b, size_t e2, int thread) {
            std::vector<float> w(static_cast<size_t>(cols)), back(static_cast<size_t>(cols));  // [cols] each
            for (size_t k = b; k < e2; ++k) {
              const int64_t row = r0 + static_cast<int64_t>(k);
              read_row_f32(t, row, w.data());
              uint8_t* c = codes.data() + k * cb;
              uint16_t* s = scales.data() + static_cast<size_t>(row) * groups;
              if (factor) quantizer.quantize_gptq(w.data(), *factor, c, s);
              else quantizer.quantize(w.data(), c, s);
              const ops::WeightView one = ops::WeightView::turboquant(quantizer.dtype(), c, s, 1, cols, quantizer.params());
              ops::tq_weight_row(one, 0, back.data());
              double de = 0, dr = 0;
              for (int64_t j = 0; j < cols; ++j) {
                const double d = static_cast<double>(back[j]) - w[j];
                de += d * d;
                dr += static_cast<double>(w[j]) * w[j];
              }
              err[static_cast<size_t>(thread)] += de;
              ref[static_cast<size_t>(thread)] += dr;
            }
          });
          f.write(codes.data(), static_cast<size_t>(n) * cb);
        }
        f.write(scales.data(), scales.size() * 2);
        double de = 0, dr = 0;
        for (size_t k = 0; k < err.size(); ++k) {
          de += err[k];
          dr += ref[k];
        }
        r.rel_error = dr > 0 ? std::sqrt(de / dr) : 0.0;
      }
      if (progress) progress(i + 1, tensors.all().size(), t.name);
    }
    TQ_CHECK(f.written() - data_start == offset, "internal error: wrote ", f.written() - data_start, " data bytes, declared ", offset);
    f.close();
  }

  // ---- config.json with the quantization block; every other file of the folder as it is
  nlohmann::ordered_json cfg = nlohmann::ordered_json::parse(read_whole_file((fs::path(input) / "config.json").string()));
  cfg.erase("quantization_config");
  cfg["quantization"] = tq_quantization_json(q);
  {
    const std::string text = cfg.dump(2) + "\n";
    File f((fs::path(partial) / "config.json").string());
    f.write(text.data(), text.size());
    f.close();
  }
  for (const fs::directory_entry& d : fs::directory_iterator(input)) {
    if (!d.is_regular_file()) continue;
    const std::string name = d.path().filename().string();
    const bool weights = d.path().extension() == ".safetensors" || name.ends_with(".safetensors.index.json") ||
                         d.path().extension() == ".bin" || d.path().extension() == ".pth";
    if (weights || name == "config.json") continue;
    fs::copy_file(d.path(), fs::path(partial) / name);
  }
  fs::rename(partial, output);
  cleanup.done = true;
  return report;
}

}  // namespace tq
