// gguf-export: a Llama model folder (HF) written as a GGUF file with ggml block-type matrices, by this
// project's reference quantizers (ops/kquant.h; llama.cpp's round-to-nearest scale search). For fixtures
// and benchmarks (docs/BENCHMARKS.md), not a converter for users' checkpoints.
//
//   build/bin/gguf-export <model folder> <out.gguf> [--type q4_k|q5_k|q6_k|q4_0|f32] [--embedding TYPE] [--dequantized]
//   (default: q4_k matrices, q6_k embedding, as llama.cpp's Q4_K_M keeps its output tensor at 6 bits)
//   --dequantized: every quantized tensor as F32 holding the values its type stores (the format's weight
//   error without its product's int8 activation rounding). --type q3_k (ops/q3_k.h) is written only so: the
//   engine has no Q3_K tensor type.
#include <cstdio>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "model/gguf_export.h"
#include "model/loader.h"

namespace {

tq::DType parse_type(const std::string& s) {
  if (s == "q4_0") return tq::DType::q4_0;
  if (s == "q4_k") return tq::DType::q4_k;
  if (s == "q5_k") return tq::DType::q5_k;
  if (s == "q6_k") return tq::DType::q6_k;
  if (s == "q8_0") return tq::DType::q8_0;
  if (s == "f32") return tq::DType::f32;
  if (s == "f16") return tq::DType::f16;
  if (s == "bf16") return tq::DType::bf16;
  tq::fail("unknown type '", s, "' (expected q4_0, q4_k, q5_k, q6_k, q8_0, f32, f16 or bf16)");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    TQ_CHECK(argc >= 3, "usage: gguf-export <model folder> <out.gguf> [--type T] [--embedding T] [--dequantized]");
    const std::string in = argv[1], out = argv[2];
    tq::LlamaGgufOptions o;
    for (int i = 3; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "--dequantized") {
        o.dequantized = true;
        continue;
      }
      TQ_CHECK(i + 1 < argc, flag, " needs a value");
      const std::string value = argv[++i];
      if (flag == "--type" && value == "q3_k") o.matrices_q3_k = true;
      else if (flag == "--type") o.matrices = parse_type(value);
      else if (flag == "--embedding") o.embedding = parse_type(value);
      else tq::fail("unknown flag ", flag);
    }
    TQ_CHECK(!o.matrices_q3_k || o.dequantized, "--type q3_k needs --dequantized: the engine has no Q3_K tensor type, "
             "so the file holds Q3_K's values as F32");
    TQ_CHECK(!std::filesystem::exists(out), "'", out, "' exists; not overwriting it");
    const tq::ModelFiles hf = tq::open_model(in);
    tq::write_llama_gguf(hf, out, o);
    std::printf("%s: %s%s matrices, %s embedding -> %s (%.1f MB)\n", in.c_str(), o.matrices_q3_k ? "Q3_K" : tq::dtype_name(o.matrices),
                o.dequantized ? " (dequantized to F32)" : "", tq::dtype_name(o.embedding), out.c_str(), static_cast<double>(std::filesystem::file_size(out)) / 1e6);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gguf-export: %s\n", e.what());
    return 1;
  }
}
