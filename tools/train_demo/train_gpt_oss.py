#!/usr/bin/env python3
"""Trains a small GPT-OSS-architecture model on the demo model's public-domain text, and writes it as
gpt-oss checkpoints are published: MXFP4 experts (`*_blocks` / `*_scales`), BF16 attention, router and
embeddings, F32 norms, `quantization_config` mxfp4.

Run on a machine with PyTorch, transformers (with GptOssForCausalLM) and tokenizers (the GPU machine):

    tools/train_demo/prepare_text.sh DATA            # on the Debian machine (apt-get download)
    python3 tools/train_demo/train_gpt_oss.py --data DATA --out OUT [--steps 1200]

The architecture is gpt-oss's at a small size: 8 layers alternating a 128-token sliding window (even
layers) and full attention, learned sink logits per head, q/k/v/o biases, YaRN RoPE exactly as the real
config (theta 150000, factor 32, beta_fast 32, beta_slow 1, original context 4096), 8 experts of width 256
with top-2 routing and the clamped SwiGLU with +1 (limit 7). The vocabulary is a BPE of 4096 trained on
the text (as tools/train_demo/train_demo.py does; o200k's 201088 rows would dwarf the model).
Persuasion is held out (the evaluation text of docs/BENCHMARKS.md). The experts train in BF16 and are
rounded to MXFP4 at the end (per 32 values of a row: the E8M0 scale 2^ceil(log2(absmax / 6)), each value
to the nearest E2M1 level); the held-out loss is printed before and after that rounding, and once more
from the written folder loaded back by transformers' own MXFP4 reader (dequantized), so the file is what
was trained. Writes OUT/{config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, train_log.json}.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training import HELD_OUT, TRAIN_BOOKS, Corpus, evaluate, make_optimizer, save_tokenizer, train  # noqa: E402

from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the positive levels; bit 3 is the sign
ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False}


def make_config(vocab, eot):
    layers = 8
    kwargs = dict(vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                  num_experts_per_tok=2, experts_per_token=2, sliding_window=128,
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                  max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True,
                  tie_word_embeddings=False, router_aux_loss_coef=0.02, output_router_logits=True,
                  bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, initial_context_length=4096)
    try:  # transformers 5: rope_parameters carries theta and the scaling
        config = GptOssConfig(rope_parameters=dict(ROPE, rope_theta=150000.0), **kwargs)
    except TypeError:
        config = GptOssConfig(rope_theta=150000.0, rope_scaling=dict(ROPE), **kwargs)
    return config


def mxfp4_quantize(w):
    """w [rows, K] float -> (codes uint8 [rows, K/32, 16], scales uint8 [rows, K/32], dequantized [rows, K]).
    Scale per 32 values: 2^ceil(log2(absmax / 6)) (the largest level 6 then covers the block), E8M0 = exponent
    + 127; each value to the nearest level (ties to the lower magnitude); adjacent-pair nibbles (value 2k in the
    low nibble of byte k)."""
    rows, K = w.shape
    blocks = w.float().reshape(rows, K // 32, 32)
    absmax = blocks.abs().amax(dim=-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(absmax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, exponent)[..., None]
    mag = scaled.abs().clamp(max=6.0)
    index = (mag[..., None] - E2M1.to(w.device)).abs().argmin(dim=-1)  # nearest level; argmin keeps the first
    nib = index | ((scaled < 0) & (index > 0)).to(torch.long) << 3
    dequant = E2M1.to(w.device)[index] * torch.where(scaled < 0, -1.0, 1.0) * torch.pow(2.0, exponent)[..., None]
    nib = nib.to(torch.uint8).reshape(rows, K // 32, 16, 2)
    codes = nib[..., 0] | (nib[..., 1] << 4)
    scales = (exponent + 127).to(torch.uint8)
    return codes, scales, dequant.reshape(rows, K)


def experts_module(layer):
    return layer.mlp.experts


def set_expert_weights(experts, gu_out_in, dn_in_major, E, H, I):
    """Writes gate_up [E, 2I, H] ([out, in]) back in the module's own layout."""
    with torch.no_grad():
        if tuple(experts.gate_up_proj.shape) == (E, H, 2 * I):
            experts.gate_up_proj.copy_(gu_out_in.transpose(1, 2).to(experts.gate_up_proj.dtype))
        else:
            experts.gate_up_proj.copy_(gu_out_in.to(experts.gate_up_proj.dtype))
        experts.down_proj.copy_(dn_in_major.to(experts.down_proj.dtype))


def down_is_input_major(experts, H, I):
    """Whether down_proj [E, a, b] is applied as h @ W (W [I, H]) rather than h @ W^T: probes the module."""
    E = experts.down_proj.shape[0]
    dev = experts.down_proj.device
    with torch.no_grad():
        saved = [p.detach().clone() for p in (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)]
        try:
            d = torch.zeros_like(experts.down_proj)
            d[:, 0, 1] = 1.0  # input-major: output 1 reads unit 0; [out, in]: output 0 reads unit 1
            experts.down_proj.copy_(d)
            experts.down_proj_bias.zero_()
            experts.gate_up_proj.zero_()
            experts.gate_up_proj_bias.zero_()
            # Gates of units 0 and 1 (even columns) 1 and 2, ups 0: h_0 = sigmoid(1.702), h_1 = 2 sigmoid(3.404).
            experts.gate_up_proj_bias[:, 0] = 1.0
            experts.gate_up_proj_bias[:, 2] = 2.0
            x = torch.zeros(1, 1, H, device=dev, dtype=experts.down_proj.dtype)
            weights = torch.zeros(1, E, device=dev, dtype=experts.down_proj.dtype)
            weights[0, 0] = 1.0
            indices = torch.zeros(1, experts_top_k(experts), dtype=torch.long, device=dev)
            y = call_experts(experts, x, indices, weights).reshape(-1)
        finally:
            for p, v in zip((experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias), saved):
                p.copy_(v)
    h0, h1 = torch.sigmoid(torch.tensor(1.702)).item(), 2 * torch.sigmoid(torch.tensor(3.404)).item()
    if abs(y[1].item() - h0) < 1e-2 and abs(y[0].item()) < 1e-4:
        return True
    if abs(y[0].item() - h1) < 1e-2 and abs(y[1].item()) < 1e-4:
        return False
    raise SystemExit(f"could not tell how down_proj is applied (probe output {y[:4].tolist()})")


def experts_top_k(experts):
    return getattr(experts, "top_k", None) or 2


def call_experts(experts, x, indices, weights):
    """The experts module's forward, whichever signature this transformers has."""
    try:
        return experts(x, router_indices=indices, routing_weights=weights)
    except TypeError:
        return experts(x.reshape(-1, x.shape[-1]), indices, weights)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=330, help="stop training after this long (keeps the best step)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    corpus = Corpus(args.data, args.vocab)
    tok, eot, held_ids = corpus.tok, corpus.eot, corpus.held
    print(f"train tokens {len(corpus.train)}, held-out tokens {len(held_ids)}", flush=True)

    config = make_config(args.vocab, eot)
    config._attn_implementation = "eager"  # the sinks: eager attention is transformers' reference path
    model = GptOssForCausalLM(config).to(dev)
    rot = model.model.rotary_emb
    print("rotary:", getattr(rot, "rope_type", "?"), "attention_scaling", getattr(rot, "attention_scaling", "?"), flush=True)
    if abs(float(getattr(rot, "attention_scaling", 1.0)) - (0.1 * math.log(32) + 1)) > 1e-4:
        raise SystemExit("the rotary embedding is not YaRN with factor 32: check the rope config for this transformers")
    E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size
    with torch.no_grad():  # sinks start away from zero, as trained gpt-oss sinks are
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 0.5)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params}", flush=True)
    opt = make_optimizer(model, lr=1.5e-3, no_decay=lambda n, p: p.dim() < 2 or "sinks" in n)

    def loss_of(batch, with_aux):
        out = model(input_ids=batch[:, :-1])
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        aux = getattr(out, "aux_loss", None)
        if with_aux and aux is not None:
            loss = loss + config.router_aux_loss_coef * aux
        return loss

    def eval_loss(batch):
        return loss_of(batch, False)

    def evaluate_held(windows=32, seq=1024):
        return evaluate(model, held_ids, seq, eval_loss, windows=windows)

    result = train(model, corpus, opt, lambda batch: loss_of(batch, True), args.steps, args.seq, args.batch, args.seed,
                   max_seconds=args.max_seconds, eval_loss_fn=eval_loss)
    log, best = result["log"], (result["best_val"], result["best_step"])
    before = evaluate_held()

    # MXFP4 experts: round, and put the rounded values back so that the model evaluated is the one written.
    input_major = down_is_input_major(experts_module(model.model.layers[0]), H, I)
    print("down_proj applied as", "h @ W [I, H]" if input_major else "h @ W^T [H, I]", flush=True)
    packed = []
    for layer in model.model.layers:
        ex = experts_module(layer)
        gu = ex.gate_up_proj.detach().float()
        gu = gu.transpose(1, 2) if tuple(gu.shape) == (E, H, 2 * I) else gu  # -> [E, 2I, H]
        dn = ex.down_proj.detach().float()
        dn_out_in = dn.transpose(1, 2) if input_major else dn  # -> [E, H, I]
        gu_c, gu_s, gu_q = mxfp4_quantize(gu.reshape(E * 2 * I, H))
        dn_c, dn_s, dn_q = mxfp4_quantize(dn_out_in.reshape(E * H, I))
        gu_q, dn_q = gu_q.reshape(E, 2 * I, H), dn_q.reshape(E, H, I)
        set_expert_weights(ex, gu_q, dn_q.transpose(1, 2) if input_major else dn_q, E, H, I)
        packed.append(dict(gate_up_blocks=gu_c.reshape(E, 2 * I, H // 32, 16), gate_up_scales=gu_s.reshape(E, 2 * I, H // 32),
                           down_blocks=dn_c.reshape(E, H, I // 32, 16), down_scales=dn_s.reshape(E, H, I // 32),
                           gate_up_bias=ex.gate_up_proj_bias.detach(), down_bias=ex.down_proj_bias.detach()))
    after = evaluate_held()
    print(f"held-out Persuasion (1024-token windows): loss {before:.4f} (BF16 experts), {after:.4f} (MXFP4 experts)", flush=True)

    # The checkpoint as gpt-oss's: experts as planes, the rest BF16, norms F32.
    from safetensors.torch import save_file
    tensors = {}
    for name, p in model.state_dict().items():
        if ".mlp.experts." in name:
            continue
        keep_f32 = name.endswith("norm.weight") or "layernorm" in name
        tensors[name] = p.detach().to(torch.float32 if keep_f32 else torch.bfloat16).contiguous().cpu()
    for l, pk in enumerate(packed):
        p = f"model.layers.{l}.mlp.experts."
        tensors[p + "gate_up_proj_blocks"] = pk["gate_up_blocks"].contiguous().cpu()
        tensors[p + "gate_up_proj_scales"] = pk["gate_up_scales"].contiguous().cpu()
        tensors[p + "gate_up_proj_bias"] = pk["gate_up_bias"].to(torch.bfloat16).contiguous().cpu()
        tensors[p + "down_proj_blocks"] = pk["down_blocks"].contiguous().cpu()
        tensors[p + "down_proj_scales"] = pk["down_scales"].contiguous().cpu()
        tensors[p + "down_proj_bias"] = pk["down_bias"].to(torch.bfloat16).contiguous().cpu()
    os.makedirs(args.out, exist_ok=True)
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("output_router_logits", None)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump(dict(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=True, temperature=0.8, top_p=0.95), f, indent=1)
    save_tokenizer(tok, args.out, model_max_length=131072)

    # Read back by transformers' own MXFP4 loader (dequantized): the held-out loss of the file.
    reloaded = None
    try:
        from transformers import Mxfp4Config
        reloaded = GptOssForCausalLM.from_pretrained(args.out, quantization_config=Mxfp4Config(dequantize=True),
                                                     dtype=torch.bfloat16).to(dev)
    except Exception as e:  # noqa: BLE001 - report whatever this transformers raises
        print("transformers could not load the MXFP4 folder:", repr(e)[:400], flush=True)
    file_loss = None
    if reloaded is not None:
        reloaded.config._attn_implementation = "eager"
        model = reloaded
        file_loss = evaluate_held()
        print(f"held-out Persuasion from the written folder (transformers' MXFP4 dequantization): loss {file_loss:.4f}", flush=True)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(dict(args=vars(args), parameters=n_params, kept_step=best[1], val_loss=best[0], train_books=TRAIN_BOOKS,
                       held_out=HELD_OUT, held_out_loss_bf16_experts=before, held_out_loss_mxfp4_experts=after,
                       held_out_loss_from_file=file_loss, log=log, torch=torch.__version__,
                       transformers=__import__("transformers").__version__), f, indent=1)


if __name__ == "__main__":
    main()
