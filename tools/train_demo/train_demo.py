#!/usr/bin/env python3
"""Trains the embedded demo model: a small Llama on public-domain English from Debian packages.

tools/train_demo/prepare_text.sh gathers the text (Jane Austen's novels from r-cran-janeaustenr as laid
out in ../shared/data/janeausten, the Jargon File, The Devil's Dictionary, the fortune cookie files).
Run on a machine with PyTorch, transformers and tokenizers (the project's GPU machine):

    python3 tools/train_demo/train_demo.py --data <dir from prepare_text.sh> --out models/demo

Persuasion is held out of training (the evaluation text of docs/BENCHMARKS.md); the last 3% of every
training text is a validation split that picks the saved step (early stopping). Everything is seeded;
the script prints the loss curve and held-out perplexity, and writes an HF folder (config.json,
generation_config.json, model.safetensors in float16, tokenizer.json, tokenizer_config.json) and
train_log.json.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training import (HELD_OUT, TRAIN_BOOKS, Corpus, add_dropout, evaluate, make_optimizer,  # noqa: E402
                      next_token_loss, save_tokenizer, train)

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    corpus = Corpus(args.data, args.vocab)
    tok, eot = corpus.tok, corpus.eot
    print(f"train tokens {len(corpus.train)}, held-out tokens {len(corpus.held)}, bytes/token {corpus.bytes_per_token():.2f}")

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=eot,
                         eos_token_id=eot, pad_token_id=eot)
    config.attention_dropout = 0.1
    model = LlamaForCausalLM(config).to(dev)
    # Dropout 0.1 on the embeddings and on every attention and MLP output, during training only.
    add_dropout(model, [model.model.embed_tokens] + [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params}")
    opt = make_optimizer(model, lr=2e-3)

    def loss_fn(batch):
        return next_token_loss(model, batch)

    result = train(model, corpus, opt, loss_fn, args.steps, args.seq, args.batch, args.seed)
    log, best = result["log"], (result["best_val"], result["best_step"])
    final = evaluate(model, corpus.held, args.seq, loss_fn, windows=64)
    print(f"held-out Persuasion: loss {final:.4f} ppl {math.exp(final):.2f}")
    model.eval()
    prompt = tok.encode("It is a truth universally acknowledged").ids
    with torch.no_grad():
        sample = model.generate(torch.tensor([[eot] + prompt], device=dev), max_new_tokens=60, do_sample=False)
    text = tok.decode(sample[0].tolist()[1:])
    print("greedy sample:", repr(text))

    os.makedirs(args.out, exist_ok=True)
    model.half().save_pretrained(args.out, safe_serialization=True)
    model.generation_config.temperature = 0.8
    model.generation_config.top_p = 0.95
    model.generation_config.do_sample = True
    model.generation_config.save_pretrained(args.out)
    save_tokenizer(tok, args.out, model_max_length=2048)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(dict(args=vars(args), parameters=n_params, kept_step=best[1], val_loss=best[0], train_books=TRAIN_BOOKS, held_out=HELD_OUT,
                       held_out_loss=final, held_out_ppl=math.exp(final), greedy_sample=text, log=log,
                       torch=torch.__version__, transformers=__import__("transformers").__version__), f, indent=1)


if __name__ == "__main__":
    main()
