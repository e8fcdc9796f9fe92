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
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

TRAIN_BOOKS = ["emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility", "jargon", "devil",
               "fortunes"]
HELD_OUT = "persuasion"


def read(data, name):
    with open(os.path.join(data, name + ".txt"), encoding="utf-8") as f:
        return f.read()


def next_token_loss(model, batch):
    """Mean cross-entropy of predicting batch[:, t + 1] from batch[:, :t + 1] (the shift done here)."""
    logits = model(batch[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def build_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


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

    texts = [read(args.data, b) for b in TRAIN_BOOKS]
    held = read(args.data, HELD_OUT)
    tok = build_tokenizer(texts, args.vocab)
    eot = tok.token_to_id("<|endoftext|>")
    ids, val_ids = [], []
    for t in texts:
        enc = tok.encode(t).ids
        cut = int(len(enc) * 0.97)
        ids.append(eot)
        ids.extend(enc[:cut])
        val_ids.append(eot)
        val_ids.extend(enc[cut:])
    data = torch.tensor(ids, dtype=torch.long)
    val = torch.tensor(val_ids, dtype=torch.long)
    held_ids = torch.tensor(tok.encode(held).ids, dtype=torch.long)
    print(f"train tokens {len(data)}, held-out tokens {len(held_ids)}, bytes/token {sum(map(len, texts)) / len(data):.2f}")

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=eot,
                         eos_token_id=eot, pad_token_id=eot)
    config.attention_dropout = 0.1
    model = LlamaForCausalLM(config).to(dev)
    # Dropout 0.1 on the embeddings and on every attention and MLP output, during training only.
    def drop(_module, _inputs, output):
        if isinstance(output, tuple):
            return (torch.nn.functional.dropout(output[0], 0.1, model.training),) + tuple(output[1:])
        return torch.nn.functional.dropout(output, 0.1, model.training)
    model.model.embed_tokens.register_forward_hook(drop)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.95))
    warmup = 60

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)

    def evaluate(tokens, windows=16):
        model.eval()
        losses = []
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
            for w in range(windows):
                chunk = tokens[w * args.seq:(w + 1) * args.seq + 1].to(dev)
                if len(chunk) < args.seq + 1:
                    break
                losses.append(next_token_loss(model, chunk[None]).float().item())
        model.train()
        return sum(losses) / len(losses)

    log = []
    best = (float("inf"), -1, None)
    start = time.time()
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()]).to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = next_token_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            val_loss = evaluate(val, windows=32)
            held_loss = evaluate(held_ids)
            log.append(dict(step=step, train=loss.item(), val=val_loss, held_out=held_loss, seconds=time.time() - start))
            print(f"step {step} train {loss.item():.3f} val {val_loss:.3f} held-out {held_loss:.3f} ({time.time() - start:.0f}s)",
                  flush=True)
            if val_loss < best[0]:
                best = (val_loss, step, {k: v.detach().clone() for k, v in model.state_dict().items()})

    print(f"keeping step {best[1]} (validation loss {best[0]:.4f})")
    model.load_state_dict(best[2])
    final = evaluate(held_ids, windows=64)
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
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                       add_bos_token=True, model_max_length=2048, tokenizer_class="PreTrainedTokenizerFast"), f, indent=1)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(dict(args=vars(args), parameters=n_params, kept_step=best[1], val_loss=best[0], train_books=TRAIN_BOOKS, held_out=HELD_OUT,
                       held_out_loss=final, held_out_ppl=math.exp(final), greedy_sample=text, log=log,
                       torch=torch.__version__, transformers=__import__("transformers").__version__), f, indent=1)


if __name__ == "__main__":
    main()
