#!/usr/bin/env python3
"""A model folder with a real model's config, tokenizer and tensor shapes, and random BF16 weights.

Speed does not depend on the weights' values, and a trained model may be too large to carry to the GPU
machine, so the GPU model benchmark runs on a stand-in made in two steps:

  tools/gpu/random_weights.py plan ../shared/models/tq-llama-hd128 .gpu/tq-llama-hd128
      (here, no PyTorch needed) copies config.json, generation_config.json and the tokenizer files, and
      writes shapes.json: every tensor's name, dtype and shape, read from the safetensors headers;
  tools/gpu/random_weights.py make .gpu/tq-llama-hd128
      (on the GPU machine, with torch and safetensors) writes model.safetensors: norm weights 1, every
      other tensor N(0, 0.02^2), in BF16, seeded.
"""
import json
import os
import shutil
import struct
import sys

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


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
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, (_, shape) in shapes.items():
        t = torch.ones(shape) if "norm" in name else torch.randn(shape, generator=gen) * 0.02
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    print(f"{folder}/model.safetensors: {len(tensors)} tensors")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "plan":
        plan(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
