"""Export a training checkpoint to a Hugging Face folder.

A tiny GPT-2 (the parameter names and layout of transformers' ``GPT2LMHeadModel``) is
trained for a few steps and checkpointed with zarrckpt, model and optimizer together.
``zarrckpt.convert.to_safetensors`` then writes only the model, in bfloat16, as
sharded ``model-0000N-of-0000M.safetensors`` files with ``model.safetensors.index.json``,
next to a ``config.json``: the folder ``from_pretrained`` reads. The script loads it back
the way transformers does (config -> model -> index -> shards) and checks the logits;
when transformers itself is installed, it loads the folder with
``GPT2LMHeadModel.from_pretrained`` too.

    python examples/export_to_hf.py [work_dir]
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import zarrckpt
from zarrckpt.tools import convert

CONFIG = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_positions": 64,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": None, "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 0,
}


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored as (in, out)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class Block(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        d = c["n_embd"]
        self.n_head = c["n_head"]
        self.ln_1 = nn.LayerNorm(d, eps=c["layer_norm_epsilon"])
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = Conv1D(d, 3 * d), Conv1D(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=c["layer_norm_epsilon"])
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = Conv1D(d, 4 * d), Conv1D(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(b, t, d))
        h = self.mlp.c_fc(self.ln_2(x))
        return x + self.mlp.c_proj(F.gelu(h, approximate="tanh"))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.transformer.wpe = nn.Embedding(c["n_positions"], c["n_embd"])
        self.transformer.h = nn.ModuleList(Block(c) for _ in range(c["n_layer"]))
        self.transformer.ln_f = nn.LayerNorm(c["n_embd"], eps=c["layer_norm_epsilon"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tr = self.transformer
        x = tr.wte(ids) + tr.wpe(torch.arange(ids.shape[1]))
        for block in tr.h:
            x = block(x)
        return tr.ln_f(x) @ tr.wte.weight.T  # lm_head tied to the embedding


def train(model: nn.Module, steps: int) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, CONFIG["vocab_size"], (4, 32), generator=g)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
    return optim


def load_like_transformers(folder: str) -> nn.Module:
    """What ``from_pretrained`` does with the folder: config -> model -> index -> shards."""
    from zarrckpt.interop.safetensors_io import Source  # or safetensors.torch.load_file

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    model = GPT2LMHeadModel(config)
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        try:
            from safetensors.torch import load_file
        except ImportError:  # read it with zarrckpt's own safetensors reader
            src = Source(os.path.join(folder, shard), 1 << 30)
            state.update({leaf.path[0]: torch.from_numpy(leaf.read(tuple((0, s) for s in leaf.shape))
                                                         .view("int16")).view(torch.bfloat16)
                          for leaf in src.leaves()})
            src.close()
        else:
            state.update(load_file(os.path.join(folder, shard)))
    assert set(state) == set(index["weight_map"]), "the index lists exactly the tensors of the shards"
    dtype = getattr(torch, config["torch_dtype"])
    assert all(t.dtype == dtype for t in state.values())
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


def main(work: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    optim = train(model, steps=20)

    ckpt = os.path.join(work, "step_20")
    zarrckpt.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 20}, ckpt)
    print(f"training checkpoint at {ckpt}: {len(zarrckpt.open(ckpt))} keys")

    hf = os.path.join(work, "hf_model")
    report = convert.to_safetensors(ckpt, hf, keys={"model/": ""}, dtype="bfloat16", max_shard_size="200KB")
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    print(f"Hugging Face checkpoint at {hf}: {len(report.files)} files, "
          f"{report.arrays} tensors, {report.bytes / 2**20:.1f} MiB read")
    for name in sorted(os.listdir(hf)):
        print("   ", name)

    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
        got = load_like_transformers(hf)(ids)
    err = (got - want).abs().max().item()
    assert err < 0.1 * want.abs().max().item(), err  # bfloat16 weights: close, not equal
    print(f"reloaded like from_pretrained: max |logit difference| {err:.4f} (bfloat16 weights)")

    try:
        from transformers import GPT2LMHeadModel as HF
    except ImportError:
        return
    with torch.no_grad():
        hf_logits = HF.from_pretrained(hf, torch_dtype=torch.float32)(ids).logits
    err = (hf_logits - got).abs().max().item()
    assert math.isfinite(err) and err < 1e-3, err
    print(f"transformers.GPT2LMHeadModel.from_pretrained: same logits (max difference {err:.2e})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="export_to_hf_"))
