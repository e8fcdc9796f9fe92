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
  tools/gpu/random_weights.py plan --shape qwen3.6-35b-a3b ../shared/models/tq-llama-hd128 .gpu/qwen3.6-35b-a3b
      Qwen3.6-35B-A3B's shape as the text-only checkpoint transformers writes (Qwen3_5MoeForCausalLM,
      model_type qwen3_5_moe_text): 40 layers, every 4th full attention (16 query heads of 256 with the
      output gate in q_proj, 2 KV heads, q/k norms, a quarter of each head rotated, theta 10^7), the others
      Gated DeltaNet (16 key heads, 32 value heads of 128, conv kernel 4); 256 experts of 512 top-8 stored
      fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]) beside a shared expert of 512 with its sigmoid
      gate; hidden 2048, its vocabulary of 248320 rows: 34.7 G parameters, 69 GB in BF16 (more than the GPU
      machine's disk: scripts/test-cuda --bench-qwen3-6 makes it in memory, under /dev/shm);
      --shape qwen3.6-tiny is the same kind at a test size (4 layers, hidden 128, 8 experts of 64, the
      source's vocabulary), for checking the plan against the loader on the CPU; --shape qwen3.6-depth has
      Qwen3.6's 40 layers and heads at hidden 512 with 8 experts (0.6 G parameters), for `check`;
  tools/gpu/random_weights.py make .gpu/tq-llama-hd128
      (on the GPU machine with torch; without torch, small folders only, in plain Python) writes
      model.safetensors, one tensor at a time (host memory stays at the largest tensor): norm weights 1,
      every other tensor N(0, 0.02^2), in BF16 (F32 where planned so), seeded (drawn on the GPU when there
      is one); MXFP4 planes (U8) as random codes and E8M0 scales 2^-7 .. 2^-3 (weights of a few
      hundredths). Qwen3.5 / 3.6 folders (model_type qwen3_5*): their zero-centred RMSNorms (1 + w) at 0,
      the DeltaNet output norm (a plain weight) at 1, A_log = log U(0.5, 8) and dt_bias U(-1, 1) (decays
      in the range trained models have), conv1d taps U(-1/sqrt(K), 1/sqrt(K)) as nn.Conv1d draws them, so
      that activations stay finite and far from zero through every layer.
  tools/gpu/random_weights.py tq --bits 4 [--group-size 64] .gpu/llama-3.1-8b-tq4
      (after `plan`, before `make`; Llama-family folders) turns the plan into a TurboQuant weight folder
      (docs/FORMATS.md "TurboQuant weights") with no conversion pass: every q/k/v/o/gate/up/down_proj.weight
      becomes its P.tq_codes (U8 [out, in*b/8], random codes: every byte drawn uniformly) and P.tq_scales
      (F16 [out, in/g], U(0.01, 0.03)), and config.json gets the quantization block (lloyd_max levels of
      this build, the largest Hadamard block of each `in`, q/k/v sharing one seed and gate/up another).
      `make` then draws an 8B shape's 4.5 GB (TQ4) in seconds on a GPU; the values are noise, the speed is
      the format's;
  tools/gpu/random_weights.py check .gpu/qwen3.6-depth
      (with torch and transformers) loads a made folder with the class its config names: no tensor may be
      missing, unexpected or of another shape; prints the hidden state's RMS after every layer for 256 random
      tokens and fails unless it and the logits are finite.
"""
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import time

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def qwen3_5_layer_types(layers, interval=4):
    """Qwen3.5's rule (full_attention_interval 4): layer i is full attention when i + 1 is a multiple of 4."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


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
    "qwen3.6-35b-a3b": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
                            num_hidden_layers=40, layer_types=qwen3_5_layer_types(40), num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, attn_output_gate=True, attention_bias=False,
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512, router_aux_loss_coef=0.001,
                            max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                            vocab_size=248320, dtype="bfloat16",
                            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                                 mrope_section=[11, 11, 10], mrope_interleaved=True)),
}
# The same kind at a test size (the loader check on the CPU; not a real model): 3 DeltaNet layers and one
# full-attention layer with head_dim 256, each key head shared by 2 value heads, 8 experts; the vocabulary
# of the source folder.
SHAPES["qwen3.6-tiny"] = dict(SHAPES["qwen3.6-35b-a3b"], hidden_size=128, num_hidden_layers=4, layer_types=qwen3_5_layer_types(4),
                              num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=64, shared_expert_intermediate_size=64, max_position_embeddings=4096)
del SHAPES["qwen3.6-tiny"]["vocab_size"]
# Qwen3.6's depth and heads (40 layers; 16 / 2 heads of 256; DeltaNet 16 / 32 heads of 128) at hidden 512 with 8
# experts: 0.6 G parameters, for `check` (activations through 40 layers of drawn weights) on the GPU machine.
SHAPES["qwen3.6-depth"] = dict(SHAPES["qwen3.6-35b-a3b"], hidden_size=512, num_experts=8, max_position_embeddings=4096)
del SHAPES["qwen3.6-depth"]["vocab_size"]


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


def qwen3_5_layer_shapes(config, p, layer):
    """One Qwen3.5 / 3.6 layer's tensors as transformers' Qwen3_5(Moe)ForCausalLM names them (what
    src/model/weights.cc validate_qwen3_5_layer reads): the token mixer (gated full attention or Gated
    DeltaNet), then the dense MLP or the experts (fused, as published) with the shared expert and its gate."""
    H, hd = config["hidden_size"], config["head_dim"]
    shapes = {p + "input_layernorm.weight": ["BF16", [H]], p + "post_attention_layernorm.weight": ["BF16", [H]]}
    if config["layer_types"][layer] == "full_attention":
        q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
        a = p + "self_attn."
        shapes.update({a + "q_proj.weight": ["BF16", [2 * q, H]],  # per head: its query, then its output gate
                       a + "k_proj.weight": ["BF16", [kv, H]], a + "v_proj.weight": ["BF16", [kv, H]],
                       a + "o_proj.weight": ["BF16", [H, q]], a + "q_norm.weight": ["BF16", [hd]],
                       a + "k_norm.weight": ["BF16", [hd]]})
    else:
        nv, dv, K = config["linear_num_value_heads"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
        key, value = config["linear_num_key_heads"] * config["linear_key_head_dim"], nv * dv
        conv = 2 * key + value  # q, k and v through the short convolution
        a = p + "linear_attn."
        shapes.update({a + "in_proj_qkv.weight": ["BF16", [conv, H]], a + "in_proj_z.weight": ["BF16", [value, H]],
                       a + "in_proj_b.weight": ["BF16", [nv, H]], a + "in_proj_a.weight": ["BF16", [nv, H]],
                       a + "conv1d.weight": ["BF16", [conv, 1, K]], a + "dt_bias": ["BF16", [nv]], a + "A_log": ["BF16", [nv]],
                       a + "norm.weight": ["BF16", [dv]], a + "out_proj.weight": ["BF16", [H, value]]})
    m = p + "mlp."
    if "num_experts" not in config:
        I = config["intermediate_size"]
        shapes.update({m + "gate_proj.weight": ["BF16", [I, H]], m + "up_proj.weight": ["BF16", [I, H]],
                       m + "down_proj.weight": ["BF16", [H, I]]})
        return shapes
    E, I, Is = config["num_experts"], config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    shapes.update({m + "gate.weight": ["BF16", [E, H]],
                   m + "experts.gate_up_proj": ["BF16", [E, 2 * I, H]],  # per expert: gate rows, then up rows
                   m + "experts.down_proj": ["BF16", [E, H, I]],
                   m + "shared_expert.gate_proj.weight": ["BF16", [Is, H]], m + "shared_expert.up_proj.weight": ["BF16", [Is, H]],
                   m + "shared_expert.down_proj.weight": ["BF16", [H, Is]], m + "shared_expert_gate.weight": ["BF16", [1, H]]})
    return shapes


def plan_shape(name, src, dst):
    if name not in SHAPES:
        sys.exit(f"unknown shape {name} (known: {', '.join(SHAPES)})")
    with open(os.path.join(src, "config.json")) as f:
        source = json.load(f)
    config = dict(SHAPES[name])
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source and not (key == "vocab_size" and key in SHAPES[name]):  # a shape may keep its own vocabulary
            config[key] = source[key]
    H, L, V = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": ["BF16", [V, H]], "model.norm.weight": ["BF16", [H]]}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = ["BF16", [V, H]]
    for l in range(L):
        p = f"model.layers.{l}."
        if config["model_type"] == "gpt_oss":
            shapes.update(gpt_oss_layer_shapes(config, p))
            continue
        if config["model_type"].startswith("qwen3_5"):
            shapes.update(qwen3_5_layer_shapes(config, p, l))
            continue
        I = config["intermediate_size"]
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
    print(f"{dst}: {name} shape, vocab {V} from {src}: {len(shapes)} tensors, {params / 1e9:.2f} G elements "
          f"({params:,}; {stored_bytes(shapes) / 1e9:.2f} GB as planned)")


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


ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1}


def stored_bytes(shapes):
    return sum(math.prod(shape) * ITEMSIZE[dtype] for dtype, shape in shapes.values())


def initial(name, dtype, shape, zero_centred):
    """How a tensor is drawn: ("const", v), ("normal", std), ("uniform", lo, hi), ("log_uniform", lo, hi) (the log
    of a uniform draw) or ("int", lo, hi) (U8 codes in [lo, hi))."""
    if name.endswith(".tq_scales"):
        return ("uniform", 0.01, 0.03)  # TurboQuant group scales (`tq`): positive, weights of a few hundredths
    if dtype == "U8":
        return ("int", 120, 125) if name.endswith("_scales") else ("int", 0, 256)
    if zero_centred:  # Qwen3.5 / 3.6
        if name.endswith("linear_attn.norm.weight"):
            return ("const", 1.0)  # the gated RMSNorm of the DeltaNet output multiplies by w itself
        if "norm" in name:
            return ("const", 0.0)  # Qwen3_5RMSNorm multiplies by (1 + w)
        if name.endswith("A_log"):
            return ("log_uniform", 0.5, 8.0)
        if name.endswith("dt_bias"):
            return ("uniform", -1.0, 1.0)
        if "conv1d" in name:
            bound = 1.0 / math.sqrt(shape[-1])
            return ("uniform", -bound, bound)
    elif "norm" in name:
        return ("const", 1.0)
    return ("normal", 0.02)


def draw_torch(torch, how, dtype, shape, gen, device):
    """The tensor's bytes (a NumPy view), drawn on `device`."""
    td = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(dtype)
    if how[0] == "int":
        t = torch.randint(how[1], how[2], shape, generator=gen, device=device, dtype=torch.uint8)
    elif how[0] == "const":
        t = torch.full(shape, how[1], dtype=td)
    elif how[0] == "normal":
        t = (torch.randn(shape, generator=gen, device=device) * how[1]).to(td)
    else:
        u = torch.rand(shape, generator=gen, device=device) * (how[2] - how[1]) + how[1]
        t = (u.log() if how[0] == "log_uniform" else u).to(td)
    return t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def draw_python(how, dtype, count, rng):
    """The same without torch (slow: small folders only), little-endian bytes."""
    import array
    if how[0] == "int":
        return bytes(rng.randrange(how[1], how[2]) for _ in range(count))
    if how[0] == "const":
        values = [how[1]] * count
    elif how[0] == "normal":
        values = [rng.gauss(0.0, how[1]) for _ in range(count)]
    else:
        values = [rng.uniform(how[1], how[2]) for _ in range(count)]
        if how[0] == "log_uniform":
            values = [math.log(v) for v in values]
    f32 = array.array("f", values)
    if dtype == "F32":
        return f32.tobytes()
    bits = array.array("I")
    bits.frombytes(f32.tobytes())
    if dtype == "BF16":  # round to nearest even (the values are finite)
        return array.array("H", ((x + 0x7FFF + ((x >> 16) & 1)) >> 16 for x in bits)).tobytes()
    return struct.pack(f"<{count}e", *values)  # F16


PYTHON_LIMIT = 20_000_000  # elements the plain-Python fallback draws (about a minute)


def make(folder):
    with open(os.path.join(folder, "shapes.json")) as f:
        shapes = json.load(f)
    model_type = ""
    if os.path.exists(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        model_type = config.get("model_type") or config.get("text_config", {}).get("model_type", "")
    zero_centred = model_type.startswith("qwen3_5")
    try:
        import torch
    except ImportError:
        torch = None
    elements = sum(math.prod(shape) for _, shape in shapes.values())
    if torch is None and elements > PYTHON_LIMIT:
        sys.exit(f"{folder}: {elements:,} elements need torch (plain Python draws {PYTHON_LIMIT:,} at most)")
    total = stored_bytes(shapes)
    free = shutil.disk_usage(folder).free
    if free < total:
        sys.exit(f"{folder}: {total / 1e9:.1f} GB of weights do not fit in the {free / 1e9:.1f} GB free there")
    if torch is not None:
        device = "cuda" if torch.cuda.is_available() else "cpu"  # an 8B shape draws in seconds on a GPU, minutes on the CPU
        gen = torch.Generator(device=device).manual_seed(1)
    else:
        import random
        device, gen = "cpu (plain Python)", random.Random(1)
    # The safetensors layout, written one tensor at a time: widest dtypes first (every tensor aligned to its
    # element size), otherwise in the planned order; the header padded to 8 bytes.
    order = sorted(shapes.items(), key=lambda kv: -ITEMSIZE[kv[1][0]])
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in order:
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path = os.path.join(folder, "model.safetensors")
    start = time.time()
    with open(path + ".part", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, (dtype, shape) in order:
            how = initial(name, dtype, shape, zero_centred)
            if torch is not None:
                f.write(draw_torch(torch, how, dtype, shape, gen, device))
            else:
                f.write(draw_python(how, dtype, math.prod(shape), gen))
    os.replace(path + ".part", path)
    seconds = time.time() - start
    print(f"{path}: {len(shapes)} tensors, {elements:,} elements, {total / 1e9:.2f} GB drawn on {device} in {seconds:.0f} s"
          f"{' (zero-centred norms at 0, DeltaNet output norm at 1)' if zero_centred else ''}")


def largest_hadamard_block(n):
    """The largest m * 2^k (m in 1, 12, 20, 28) dividing n (codec/rotation.h Rotation::largest_supported_block)."""
    best = 1
    for m in (1, 12, 20, 28):
        if n % m == 0:
            p = 1
            while (n // m) % (2 * p) == 0:
                p *= 2
            best = max(best, m * p)
    return best


TQ_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                  "mlp.down_proj")


def plan_tq(folder, bits, group):
    """A planned Llama-family folder's projections as TurboQuant planes, and config.json's quantization block."""
    if bits not in (2, 3, 4) or group not in (32, 64, 128):
        sys.exit(f"--bits {bits} --group-size {group}: TurboQuant weights have 2, 3 or 4 bits in groups of 32, 64 or 128")
    with open(os.path.join(folder, "shapes.json")) as f:
        shapes = json.load(f)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    tensors, out = {}, {}
    for name, (dtype, shape) in shapes.items():
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        if base is None or not base.split("model.layers.", 1)[-1].split(".", 1)[-1] in TQ_PROJECTIONS or len(shape) != 2:
            out[name] = [dtype, shape]
            continue
        rows, cols = shape
        if cols % group != 0 or (cols * bits) % 8 != 0:
            sys.exit(f"{name}: in = {cols} is not a multiple of the group size {group}")
        # q/k/v read one input (one rotation, one seed), gate/up another; the seeds are plain distinct numbers
        # (the loader reads the stored seed; a converted folder derives them from rotation_seed instead).
        layer, proj = base.rsplit(".", 1)
        key = layer + "." + {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                             "up_proj": "gate_up_proj"}.get(proj, proj)
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "little")
        out[base + ".tq_codes"] = ["U8", [rows, cols * bits // 8]]
        out[base + ".tq_scales"] = ["F16", [rows, cols // group]]
        tensors[base] = {"shape": [rows, cols], "bits": bits, "group_size": group, "rotation_block": largest_hadamard_block(cols),
                         "seed": seed}
    if not tensors:
        sys.exit(f"{folder}: no q/k/v/o/gate/up/down_proj.weight in the plan (tq is for Llama-family plans)")
    config["quantization"] = {"mode": "turboquant-cpp", "format_version": 1, "bits": bits, "group_size": group, "attn_bits": bits,
                              "mlp_bits": bits, "codebook": "lloyd_max", "scale": "rms", "norm_correction": False,
                              "rotation": "blockwise_hadamard", "rotation_seed": 0, "quantize_extras": False, "tensors": tensors,
                              "skipped": {}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(folder, "shapes.json"), "w") as f:
        json.dump(out, f)
    print(f"{folder}: {len(tensors)} matrices planned as TQ{bits} (groups of {group}); {stored_bytes(out) / 1e9:.2f} GB as planned")


def check(folder):
    """Loads a made folder with transformers (the class config.json names), fails on missing, unexpected or
    mismatched tensors, and runs 256 random tokens through it: the RMS of the hidden state after every layer
    and of the logits, which must be finite."""
    import torch
    import transformers
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    cls = getattr(transformers, config["architectures"][0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, info = cls.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True)
    problems = {k: list(v)[:8] for k, v in info.items() if v and k != "error_msgs"}
    print(f"{folder}: transformers {transformers.__version__} {cls.__name__}:", "every tensor read" if not problems else problems)
    model = model.to(device).eval()
    ids = torch.randint(0, config["vocab_size"], (1, 256), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    rms = [h.float().pow(2).mean().sqrt().item() for h in out.hidden_states]
    logits = out.logits.float()
    finite = all(math.isfinite(r) for r in rms) and bool(torch.isfinite(logits).all())
    print("hidden-state RMS after each layer:", " ".join(f"{r:.3g}" for r in rms))
    print(f"logits: std {logits.std().item():.3g}, max |.| {logits.abs().max().item():.3g}; {'finite' if finite else 'NOT FINITE'}")
    if problems or not finite:
        sys.exit(1)


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "plan" and sys.argv[2] == "--shape":
        plan_shape(sys.argv[3], sys.argv[4], sys.argv[5])
    elif len(sys.argv) == 4 and sys.argv[1] == "plan":
        plan(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "tq" and sys.argv[2] == "--bits":
        args = sys.argv[4:]
        group = 64
        if len(args) == 3 and args[0] == "--group-size":
            group = int(args[1])
            args = args[2:]
        if len(args) != 1:
            sys.exit(__doc__)
        plan_tq(args[0], int(sys.argv[3]), group)
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
