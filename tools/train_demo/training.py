"""What the training scripts of tools/train_demo share: the text and its tokenizer, the optimizer and its
learning-rate schedule, the training loop with its evaluation and early stopping, and the tokenizer files
written beside a model.

Used by train_demo.py (the demo Llama), train_gpt_oss.py (GPT-OSS) and train_qwen3_5.py (Qwen3.5). The
text is what tools/train_demo/prepare_text.sh gathers: TRAIN_BOOKS are trained on, HELD_OUT (Persuasion,
the evaluation text of docs/BENCHMARKS.md) is not; the last 3% of every training text is the validation
split that picks the saved step.
"""
import json
import math
import os
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TRAIN_BOOKS = ["emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility", "jargon", "devil",
               "fortunes"]
HELD_OUT = "persuasion"
EOT = "<|endoftext|>"


def read(data, name):
    with open(os.path.join(data, name + ".txt"), encoding="utf-8") as f:
        return f.read()


def build_tokenizer(texts, vocab_size):
    """A byte-level BPE of vocab_size trained on texts, with <|endoftext|> as its one special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


class Corpus:
    """The tokenized text: train (every training text after an <|endoftext|>, less its last 3%), val (those
    last 3%s), held (the held-out book), as 1-D long tensors; tok, eot, texts (the training texts)."""

    def __init__(self, data, vocab_size):
        self.texts = [read(data, b) for b in TRAIN_BOOKS]
        held = read(data, HELD_OUT)
        self.tok = build_tokenizer(self.texts, vocab_size)
        self.eot = self.tok.token_to_id(EOT)
        ids, val_ids = [], []
        for t in self.texts:
            enc = self.tok.encode(t).ids
            cut = int(len(enc) * 0.97)
            ids += [self.eot] + enc[:cut]
            val_ids += [self.eot] + enc[cut:]
        self.train = torch.tensor(ids, dtype=torch.long)
        self.val = torch.tensor(val_ids, dtype=torch.long)
        self.held = torch.tensor(self.tok.encode(held).ids, dtype=torch.long)

    def bytes_per_token(self):
        return sum(map(len, self.texts)) / len(self.train)


def next_token_loss(model, batch):
    """Mean cross-entropy of predicting batch[:, t + 1] from batch[:, :t + 1] (the shift done here)."""
    logits = model(batch[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def add_dropout(model, modules, p=0.1):
    """Dropout p on the outputs of modules (the first element where a module returns a tuple), in training only."""
    def drop(_module, _inputs, output):
        if isinstance(output, tuple):
            return (torch.nn.functional.dropout(output[0], p, model.training),) + tuple(output[1:])
        return torch.nn.functional.dropout(output, p, model.training)
    for m in modules:
        m.register_forward_hook(drop)


def make_optimizer(model, lr, no_decay=lambda name, p: p.dim() < 2):
    """AdamW (betas 0.9, 0.95), weight decay 0.1 on the parameters no_decay does not name."""
    decay = [p for n, p in model.named_parameters() if not no_decay(n, p)]
    rest = [p for n, p in model.named_parameters() if no_decay(n, p)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


class Schedule:
    """The learning-rate factor: linear warmup over `warmup` steps, then a cosine from 1 to 0.1 at `steps`
    (which the loop may lower once it knows how long a step takes)."""

    def __init__(self, steps, warmup=60):
        self.steps, self.warmup = steps, warmup

    def __call__(self, step):
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def evaluate(model, tokens, seq, loss_fn, windows=16):
    """Mean loss_fn over up to `windows` consecutive windows of seq + 1 tokens (one at a time, under BF16
    autocast); the model is back in training mode afterwards."""
    dev = next(model.parameters()).device.type
    model.eval()
    losses = []
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
        for w in range(windows):
            chunk = tokens[w * seq:(w + 1) * seq + 1].to(dev)
            if len(chunk) < seq + 1:
                break
            losses.append(loss_fn(chunk[None]).float().item())
    model.train()
    return sum(losses) / len(losses)


def train(model, corpus, opt, loss_fn, steps, seq, batch, seed, max_seconds=None, plan_seconds=None,
          eval_loss_fn=None, eval_every=50):
    """Trains for `steps` steps of `batch` random windows of seq + 1 training tokens (BF16 autocast, gradients
    clipped at 1), evaluating every eval_every steps and at the last (32 validation windows, 16 held-out);
    loads the state of the best validation loss back into the model. loss_fn(batch) is the training loss,
    eval_loss_fn(batch) the evaluation one (default the same). max_seconds: stop after that long (the
    schedule stays the one of `steps`). plan_seconds: once steps 10-50 and the first evaluations are timed,
    lower `steps` (and the schedule's end with it) so that training takes about that long.
    Returns dict(best_val, best_step, log, steps, seconds)."""
    dev = next(model.parameters()).device.type
    eval_loss_fn = eval_loss_fn or loss_fn
    schedule = Schedule(steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    data = corpus.train
    log = []
    best = (float("inf"), -1, None)
    start = time.time()
    marks = {}
    eval_seconds = 0.0
    model.train()
    step = 0
    while step < schedule.steps:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = loss_fn(chunk)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if plan_seconds is not None and step in (10, 50):
            if dev == "cuda":
                torch.cuda.synchronize()
            marks[step] = time.time()
        last = step == schedule.steps - 1 or (max_seconds is not None and time.time() - start > max_seconds)
        if step % eval_every == 0 or last:
            t0 = time.time()
            val_loss = evaluate(model, corpus.val, seq, eval_loss_fn, windows=32)
            held_loss = evaluate(model, corpus.held, seq, eval_loss_fn)
            eval_seconds += time.time() - t0
            log.append(dict(step=step, train=loss.item(), val=val_loss, held_out=held_loss, seconds=time.time() - start))
            print(f"step {step} train {loss.item():.3f} val {val_loss:.3f} held-out {held_loss:.3f} ({time.time() - start:.0f}s)",
                  flush=True)
            if val_loss < best[0]:
                best = (val_loss, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if plan_seconds is not None and step == 50 and 10 in marks:
            per_step = (marks[50] - marks[10]) / 40
            per_eval = eval_seconds / 2  # steps 0 and 50
            elapsed = time.time() - start
            # elapsed + (n - 51) per_step + (n - 51) / eval_every per_eval = plan_seconds
            fit = 51 + int((plan_seconds - elapsed) / (per_step + per_eval / eval_every))
            if fit < schedule.steps:
                schedule.steps = max(fit, 100)
            print(f"step time {per_step:.3f}s, evaluation {per_eval:.1f}s: {schedule.steps} steps in about {plan_seconds:.0f}s",
                  flush=True)
        step += 1
        if last:
            break

    print(f"keeping step {best[1]} (validation loss {best[0]:.4f})", flush=True)
    model.load_state_dict(best[2])
    return dict(best_val=best[0], best_step=best[1], log=log, steps=step, seconds=time.time() - start)


def save_tokenizer(tok, out, model_max_length):
    """tokenizer.json and a tokenizer_config.json naming <|endoftext|> as BOS, EOS and padding."""
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(dict(bos_token=EOT, eos_token=EOT, pad_token=EOT, add_bos_token=True, model_max_length=model_max_length,
                       tokenizer_class="PreTrainedTokenizerFast"), f, indent=1)
