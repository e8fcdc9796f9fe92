#!/usr/bin/env python3
"""Trains a small Qwen3.5-architecture model (transformers' Qwen3_5ForCausalLM: Gated DeltaNet layers beside
gated full attention, dense MLPs) on the demo model's public-domain text, and writes it as transformers does
(save_pretrained: config.json of model_type qwen3_5_text, model.safetensors in BF16) with the tokenizer.

Run on a machine with PyTorch, transformers 5 (with Qwen3_5ForCausalLM) and tokenizers (the GPU machine):

    tools/train_demo/prepare_text.sh DATA            # on the Debian machine (apt-get download)
    python3 tools/train_demo/train_qwen3_5.py --data DATA --out OUT [--max-seconds 240]

The architecture is Qwen3.5's at a small size: 8 layers, [linear, linear, linear, full] twice (Qwen3.5's
full_attention_interval 4), hidden 512; full attention of 8 query and 2 KV heads of head_dim 256 (the real
models' head size: a quarter of it rotated, partial_rotary_factor 0.25, rope theta 10,000,000), the query
projection emitting the output gate beside each head, q/k RMSNorms; Gated DeltaNet layers of 4 key heads
and 8 value heads of 64 (each key head shared by 2 value heads, as the real 16 / 32), conv kernel 4; SwiGLU
of 1024; zero-centred RMSNorms (1 + w); tied embeddings; vocabulary a BPE of 4096 trained on the text (as
train_demo.py does). About 28 M parameters: 57 MB in BF16, which is about what the GPU machine can hand
back (scripts/test-cuda --train-qwen3-5 splits the archive into parts of 15 MiB).

Training is on 2048-token windows (the context of the saved config), so that long-context measurements
(KL divergence of a compressed cache against FP16 over 2048 tokens) read a model that uses all of it.
transformers' own Qwen3_5 modeling runs: the fla / causal-conv1d fast paths are absent on the GPU machine,
and the script prints which delta-rule and convolution functions are in use. --max-seconds plans the step
count from the first steps' timing so that the cosine schedule ends inside the budget. Persuasion is held
out; the held-out loss is printed for the trained model (F32 weights, BF16 autocast) and once more from the
written folder loaded back by transformers in BF16, so the file is what was measured. Writes
OUT/{config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
train_log.json}.
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training import (HELD_OUT, TRAIN_BOOKS, Corpus, add_dropout, evaluate, make_optimizer,  # noqa: E402
                      next_token_loss, save_tokenizer, train)

import transformers  # noqa: E402

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2


def make_config(vocab, eot, context):
    from transformers import Qwen3_5TextConfig
    kwargs = dict(vocab_size=vocab, hidden_size=512, intermediate_size=1024, num_hidden_layers=len(LAYER_TYPES),
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, max_position_embeddings=context,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, attention_dropout=0.0,
                  linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
                  linear_num_value_heads=8, layer_types=list(LAYER_TYPES), hidden_act="silu",
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                  bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    try:
        return Qwen3_5TextConfig(**kwargs)
    except TypeError as e:  # an older signature: rope as rope_theta + partial_rotary_factor
        print("config with rope_parameters refused:", repr(e)[:200], "- trying rope_theta / partial_rotary_factor", flush=True)
        rope = kwargs.pop("rope_parameters")
        return Qwen3_5TextConfig(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], **kwargs)


def report_kernels():
    """Which implementations of the delta rule and the short convolution this transformers calls: its torch
    code (modeling_qwen3_5) unless flash-linear-attention / causal-conv1d are installed."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    from transformers.utils import import_utils
    for flag in ("is_flash_linear_attention_available", "is_causal_conv1d_available"):
        f = getattr(import_utils, flag, None)
        print(f"{flag}: {f() if f else 'not in this transformers'}", flush=True)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(m, name, None)
        inner = getattr(fn, "__wrapped__", fn)
        print(f"{name}: {getattr(inner, '__module__', '?')}.{getattr(inner, '__name__', '?')}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2000, help="at most this many steps (fewer when --max-seconds says so)")
    ap.add_argument("--seq", type=int, default=2048, help="training window and the saved max_position_embeddings")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--max-seconds", type=float, default=240,
                    help="training time: the step count is planned from the first 50 steps so that the schedule ends in it")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print("transformers", transformers.__version__, "torch", torch.__version__, "device",
          torch.cuda.get_device_name() if dev == "cuda" else "cpu", flush=True)
    report_kernels()

    corpus = Corpus(args.data, args.vocab)
    tok, eot = corpus.tok, corpus.eot
    print(f"train tokens {len(corpus.train)}, held-out tokens {len(corpus.held)}, bytes/token {corpus.bytes_per_token():.2f}",
          flush=True)

    from transformers import Qwen3_5ForCausalLM
    config = make_config(args.vocab, eot, args.seq)
    model = Qwen3_5ForCausalLM(config).to(dev)
    model.config.use_cache = False  # training and evaluation forwards build no cache (generate passes its own)
    print("attention implementation:", model.config._attn_implementation, flush=True)
    # Dropout 0.1 on the embeddings and on every token mixer's and MLP's output, during training only.
    mixers = [layer.linear_attn if t == "linear_attention" else layer.self_attn for layer, t in zip(model.model.layers, LAYER_TYPES)]
    add_dropout(model, [model.model.embed_tokens] + mixers + [layer.mlp for layer in model.model.layers])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params} ({2 * n_params / 1e6:.1f} MB in BF16)", flush=True)
    # No decay on vectors (norms, A_log, dt_bias) nor on the conv1d taps.
    opt = make_optimizer(model, lr=args.lr, no_decay=lambda n, p: p.dim() < 2 or "conv1d" in n)

    def loss_fn(batch):
        return next_token_loss(model, batch)

    result = train(model, corpus, opt, loss_fn, args.steps, args.seq, args.batch, args.seed,
                   max_seconds=args.max_seconds + 30, plan_seconds=args.max_seconds)
    log, best = result["log"], (result["best_val"], result["best_step"])
    print(f"trained {result['steps']} steps of {args.batch} x {args.seq} tokens in {result['seconds']:.0f}s", flush=True)
    final = evaluate(model, corpus.held, args.seq, loss_fn, windows=32)
    final_1k = evaluate(model, corpus.held, 1024, loss_fn, windows=32)
    print(f"held-out Persuasion ({args.seq}-token windows): loss {final:.4f} ppl {math.exp(final):.2f}; "
          f"1024-token windows: loss {final_1k:.4f} ppl {math.exp(final_1k):.2f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    model.generation_config.temperature = 0.8
    model.generation_config.top_p = 0.95
    model.generation_config.do_sample = True
    model.generation_config.save_pretrained(args.out)
    save_tokenizer(tok, args.out, model_max_length=args.seq)
    with open(os.path.join(args.out, "config.json")) as f:
        saved = json.load(f)
    print("config.json:", {k: saved.get(k) for k in ("architectures", "model_type", "dtype", "torch_dtype", "layer_types",
                                                      "rope_parameters", "head_dim", "tie_word_embeddings")}, flush=True)
    from safetensors import safe_open
    names = []
    for fname in sorted(os.listdir(args.out)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(args.out, fname), framework="pt") as st:
                for k in st.keys():
                    names.append(k)
                    if ".layers." not in k or ".layers.0." in k or ".layers.3." in k:
                        print("saved", k, list(st.get_slice(k).get_shape()), st.get_slice(k).get_dtype(), flush=True)
    print(f"{len(names)} tensors written", flush=True)

    model.eval()
    prompt = tok.encode("It is a truth universally acknowledged").ids
    text = None
    try:
        with torch.no_grad():
            sample = model.generate(torch.tensor([[eot] + prompt], device=dev), max_new_tokens=60, do_sample=False)
        text = tok.decode(sample[0].tolist()[1:])
        print("greedy sample:", repr(text), flush=True)
    except Exception as e:  # noqa: BLE001 - the folder is written already; report whatever generate raised
        print("greedy sample failed:", repr(e)[:400], flush=True)

    # Read back by transformers in BF16: the held-out loss of the file.
    t0 = time.time()
    reloaded = Qwen3_5ForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16).to(dev)
    file_loss = evaluate(reloaded, corpus.held, args.seq, lambda b: next_token_loss(reloaded, b), windows=32)
    print(f"held-out Persuasion from the written folder (BF16, {args.seq}-token windows): loss {file_loss:.4f} "
          f"ppl {math.exp(file_loss):.2f} ({time.time() - t0:.0f}s)", flush=True)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(dict(args=vars(args), parameters=n_params, steps=result["steps"], kept_step=best[1], val_loss=best[0],
                       train_books=TRAIN_BOOKS, held_out=HELD_OUT, held_out_loss=final, held_out_ppl=math.exp(final),
                       held_out_loss_1024=final_1k, held_out_loss_from_file=file_loss, greedy_sample=text, log=log,
                       torch=torch.__version__, transformers=transformers.__version__), f, indent=1)


if __name__ == "__main__":
    main()
