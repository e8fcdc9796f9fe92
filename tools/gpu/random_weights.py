#!/usr/bin/env python3
"""A model folder with a real model's config, tokenizer and tensor shapes, and random BF16 weights.

Speed does not depend on the weights' values, and a trained model may be too large to carry to the GPU
machine, so the GPU model benchmark runs on a stand-in made in two steps:

  tools/gpu/random_weights.py plan ../shared/models/tq-llama-hd128 .gpu/tq-llama-hd128
      (here, no PyTorch needed) copies config.json, generation_config.json and the tokenizer files, and
      writes shapes.json: every tensor's name, dtype and shape, read from the safetensors headers;
  tools/gpu/random_weights.py plan --shape llama-3.1-8b ../shared/models/tq-llama-hd128 .gpu/llama-3.1-8b
      the same for a named real model's shape (SHAPES below), with the tokenizer (and its vocabulary size)
      of the source folder, so that a GPU benchmark runs a realistic shape;
  tools/gpu/random_weights.py plan --shape gpt-oss-20b ../shared/models/tq-llama-hd128 .gpu/gpt-oss-20b
      GPT-OSS-20B's shape (24 layers alternating a 128-token window and full attention, 64 heads of 64 and
      8 KV heads, 32 experts of 2880 top-4 stored as MXFP4 planes, its vocabulary of 201088 rows) with the
      source folder's tokenizer (its ids are a subset of the rows);
  tools/gpu/random_weights.py make .gpu/tq-llama-hd128
      (on the GPU machine, with torch and safetensors) writes model.safetensors: norm weights 1, every
      other tensor N(0, 0.02^2), in BF16 (F32 where planned so), seeded (drawn on the GPU when there is
      one); MXFP4 planes (U8) as random codes and E8M0 scales 2^-7 .. 2^-3 (weights of a few hundredths).
"""
import json
import math
import os
import shutil
import struct
import sys

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


# Real models' shapes (their config.json fields); the vocabulary comes from the tokenizer's folder.
SHAPES = {
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False, dtype="bfloat16",
                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
                        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
                        attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
                        tie_word_embeddings=False, vocab_size=201088, dtype="bfloat16",
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                             original_max_position_embeddings=4096, truncate=False),
                        quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=[
                            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"])),
}


def gpt_oss_layer_shapes(config, p):
    """One GPT-OSS layer's tensors as the published checkpoint stores them (experts as MXFP4 planes)."""
    H, I, E = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    x = p + "mlp.experts."
    return {
        p + "input_layernorm.weight": ["F32", [H]], p + "post_attention_layernorm.weight": ["F32", [H]],
        p + "self_attn.q_proj.weight": ["BF16", [q, H]], p + "self_attn.q_proj.bias": ["BF16", [q]],
        p + "self_attn.k_proj.weight": ["BF16", [kv, H]], p + "self_attn.k_proj.bias": ["BF16", [kv]],
        p + "self_attn.v_proj.weight": ["BF16", [kv, H]], p + "self_attn.v_proj.bias": ["BF16", [kv]],
        p + "self_attn.o_proj.weight": ["BF16", [H, q]], p + "self_attn.o_proj.bias": ["BF16", [H]],
        p + "self_attn.sinks": ["BF16", [config["num_attention_heads"]]],
        p + "mlp.router.weight": ["BF16", [E, H]], p + "mlp.router.bias": ["BF16", [E]],
        x + "gate_up_proj_blocks": ["U8", [E, 2 * I, H // 32, 16]], x + "gate_up_proj_scales": ["U8", [E, 2 * I, H // 32]],
        x + "gate_up_proj_bias": ["BF16", [E, 2 * I]],
        x + "down_proj_blocks": ["U8", [E, H, I // 32, 16]], x + "down_proj_scales": ["U8", [E, H, I // 32]],
        x + "down_proj_bias": ["BF16", [E, H]],
    }


def plan_shape(name, src, dst):
    if name not in SHAPES:
        sys.exit(f"unknown shape {name} (known: {', '.join(SHAPES)})")
    with open(os.path.join(src, "config.json")) as f:
        source = json.load(f)
    config = dict(SHAPES[name])
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source and not (key == "vocab_size" and key in SHAPES[name]):  # a shape may keep its own vocabulary
            config[key] = source[key]
    H, I, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q, kv, V = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": ["BF16", [V, H]], "model.norm.weight": ["BF16", [H]]}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = ["BF16", [V, H]]
    for l in range(L):
        p = f"model.layers.{l}."
        if config["model_type"] == "gpt_oss":
            shapes.update(gpt_oss_layer_shapes(config, p))
            continue
        shapes[p + "input_layernorm.weight"] = ["BF16", [H]]
        shapes[p + "post_attention_layernorm.weight"] = ["BF16", [H]]
        shapes[p + "self_attn.q_proj.weight"] = ["BF16", [q, H]]
        shapes[p + "self_attn.k_proj.weight"] = ["BF16", [kv, H]]
        shapes[p + "self_attn.v_proj.weight"] = ["BF16", [kv, H]]
        shapes[p + "self_attn.o_proj.weight"] = ["BF16", [H, q]]
        shapes[p + "mlp.gate_proj.weight"] = ["BF16", [I, H]]
        shapes[p + "mlp.up_proj.weight"] = ["BF16", [I, H]]
        shapes[p + "mlp.down_proj.weight"] = ["BF16", [H, I]]
    os.makedirs(dst, exist_ok=True)
    for f in COPIED:
        if f != "config.json" and os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(dst, "shapes.json"), "w") as f:
        json.dump(shapes, f)
    params = sum(math.prod(s) for _, s in shapes.values())
    print(f"{dst}: {name} shape, vocab {V} from {src}: {len(shapes)} tensors, {params / 1e9:.2f} G elements")


def plan(src, dst):
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        sys.exit(f"no .safetensors files in {src}")
    shapes = {}
    for name in files:
        for tensor, info in safetensors_header(os.path.join(src, name)).items():
            if tensor != "__metadata__":
                shapes[tensor] = [info["dtype"], info["shape"]]
    os.makedirs(dst, exist_ok=True)
    for name in COPIED:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(dst, "shapes.json"), "w") as f:
        json.dump(shapes, f)
    print(f"{dst}: {len(shapes)} tensors planned from {len(files)} file(s)")


def make(folder):
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(folder, "shapes.json")) as f:
        shapes = json.load(f)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # an 8B shape draws in seconds on a GPU, minutes on the CPU
    gen = torch.Generator(device=device).manual_seed(1)
    tensors = {}
    for name, (dtype, shape) in shapes.items():
        if dtype == "U8" and name.endswith("_scales"):
            t = torch.randint(120, 125, shape, generator=gen, device=device, dtype=torch.uint8).cpu()
        elif dtype == "U8":
            t = torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8).cpu()
        elif "norm" in name:
            t = torch.ones(shape, dtype=torch.float32 if dtype == "F32" else torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.float32 if dtype == "F32" else torch.bfloat16).cpu()
        tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    print(f"{folder}/model.safetensors: {len(tensors)} tensors")


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "plan" and sys.argv[2] == "--shape":
        plan_shape(sys.argv[3], sys.argv[4], sys.argv[5])
    elif len(sys.argv) == 4 and sys.argv[1] == "plan":
        plan(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
