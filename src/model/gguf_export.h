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

}  // namespace tq
