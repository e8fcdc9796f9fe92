// A GPT-OSS model opened from a Hugging Face folder, written as a GGUF file in llama.cpp's gpt-oss
// layout (what its converter writes), so that one model can be read both ways and the two compared,
// and so that an HF checkpoint can be run as GGUF.
//
// Layout: general.architecture "gpt-oss" and the gpt-oss.* keys that config_from_gguf reads; tensors
// token_embd, output (absent when tied), output_norm and per layer blk.N.{attn_norm, post_attention_norm,
// attn_q/k/v/output .weight and .bias, attn_sinks, ffn_gate_inp .weight and .bias, ffn_gate_exps,
// ffn_up_exps, ffn_down_exps .weight and .bias}. Q and K keep the HF row order (GPT-OSS's RoPE is
// NeoX-style; llama.cpp's converter does not permute them). Non-expert tensors are copied byte for
// byte in their own dtype. Experts come from the loaded per-expert views: MXFP4 as ggml MXFP4 (type 39,
// the same values, the nibbles reordered by mxfp4_block_to_gguf), unquantized ones in their dtype;
// gate = the even rows of HF's gate_up, up = the odd ones, their biases split the same way (F32).
// No tokenizer is written (the GGUF loader does not need one).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/loader.h"

namespace tq {

// The whole file in memory (every tensor is copied: a real checkpoint needs its size in RAM).
// `hf`: open_model of an HF gpt_oss folder. Throws tq::Error naming the folder for what the GGUF
// keys cannot say: yarn with truncate true or a non-default attention_factor, swiglu_limit other
// than 7 (llama.cpp hard-codes both), or another architecture / a GGUF input.
std::vector<uint8_t> gpt_oss_gguf_bytes(const ModelFiles& hf);

// The same, written to `path`.
void write_gpt_oss_gguf(const ModelFiles& hf, const std::string& path);

// A Llama model (HF folder) as a GGUF file in llama.cpp's llama layout, its matrices quantized by this
// project's reference quantizers (ops/kquant.h: round to nearest with llama.cpp's per-block scale search),
// so that k-quant files can be made from any small model. Layout: general.architecture "llama", the llama.*
// keys config_from_gguf reads, a gpt2-style tokenizer from the folder's tokenizer.json (tokens, token types,
// merges, BOS/EOS ids), tensors token_embd, output (absent when tied), output_norm and per layer
// blk.N.{attn_norm, ffn_norm} (F32), blk.N.{attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down}
// in `matrices`. attn_q / attn_k rows are permuted as llama.cpp's converter does for interleaved RoPE (per head,
// HF row i * head_dim / 2 + j becomes row 2 j + i). A matrix whose rows are not whole blocks of its type is an
// error naming it (no silent fallback to another type).
struct LlamaGgufOptions {
  DType matrices = DType::q4_k;   // the attention and MLP matrices
  DType embedding = DType::q6_k;  // token_embd (and output when untied)
  // Write every quantized tensor as F32 holding its dequantized values: the same model in float, so that a
  // test can tell the products' error from the format's.
  bool dequantized = false;
  // The attention and MLP matrices as ggml Q3_K blocks (ops/q3_k.h) instead of `matrices`. The engine has no
  // Q3_K type or product, so this needs `dequantized` (an error otherwise): the file holds Q3_K's values as F32.
  bool matrices_q3_k = false;
};
std::vector<uint8_t> llama_gguf_bytes(const ModelFiles& hf, const LlamaGgufOptions& options);
void write_llama_gguf(const ModelFiles& hf, const std::string& path, const LlamaGgufOptions& options);

}  // namespace tq
