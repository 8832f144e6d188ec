"""The benchmark's model shapes, built as FSDP2 training state (one AdamW step, fp32).

    linear       a stack of square Linear(H, H) with biases
    transformer  a token embedding (vocab x H), blocks of attention (q/k/v/o H x H with
                 biases) + MLP (H x 4H, 4H x H with biases) + two RMSNorms, a final RMSNorm
    moe          blocks of the same attention whose MLP is E experts (separate
                 Linear(H, F) / Linear(F, H), no bias) and a router H x E; a final RMSNorm
    many-small   moe at H = 1536 by default (F = H/4, E = 32): ~2,100 tensors for 4 GB,
                 1 KB to a few MB per rank each (issue 30's many-small-tensor shape)

The number of blocks makes params + exp_avg + exp_avg_sq about ``state_gb``; a shape's
fixed part (the embedding) is kept even when it alone is larger. Every model is built on
the meta device, ``fully_shard`` per block and at the root, ``to_empty``, initialised
per rank, one forward/backward and AdamW step, then ``get_state_dict``.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

SHAPES = ("linear", "transformer", "moe", "many-small")


class Attention(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.heads = max(1, h // 128)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape

        def split(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Expert(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class MoE(nn.Module):
    """Dense mixture for the benchmark: every expert sees every token, weighted by the
    router, so that every expert gets a gradient and AdamW state (as after many steps)."""

    def __init__(self, h: int, f: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList(Expert(h, f) for _ in range(experts))

    def forward(self, x):
        w = self.router(x).softmax(-1)
        return sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, h: int, mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(h), Attention(h)
        self.mlp_norm, self.mlp = nn.RMSNorm(h), mlp

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Net(nn.Module):
    def __init__(self, h: int, blocks: list[nn.Module], vocab: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h) if vocab else None
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(h)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def plan(shape: str, cfg) -> dict:
    """Width, blocks and sizes of a shape for ``cfg.state_gb`` (12 bytes per parameter)."""
    n = cfg.state_gb * 1e9 / 12
    h = cfg.hidden or (1536 if shape == "many-small" else 4096)
    attn = 4 * (h * h + h) + 2 * h
    if shape == "linear":
        while not cfg.hidden and h > 64 and n / (h * h + h) < 8:  # tiny states: several layers
            h //= 2
        per, fixed, extra = h * h + h, 0, {}
    elif shape == "transformer":
        per, fixed, extra = attn + 8 * h * h + 5 * h, cfg.vocab * h + h, {"vocab": cfg.vocab}
    elif shape in ("moe", "many-small"):
        f = cfg.expert_hidden or max(1, h // 4)
        per, fixed = attn + h * cfg.experts + 2 * cfg.experts * h * f, h
        extra = {"experts": cfg.experts, "expert_hidden": f}
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")
    blocks = max(1, round((n - fixed) / per))
    return {"shape": shape, "hidden": h, "blocks": blocks, **extra, "params": fixed + blocks * per}


def make_model(p: dict) -> tuple[nn.Module, list[nn.Module]]:
    """The model (on the current default device) and its blocks (the FSDP units)."""
    h = p["hidden"]
    if p["shape"] == "linear":
        model = nn.Sequential(*[nn.Linear(h, h) for _ in range(p["blocks"])])
        return model, list(model)
    if p["shape"] == "transformer":
        model = Net(h, [Block(h, MLP(h)) for _ in range(p["blocks"])], vocab=p["vocab"])
    else:
        model = Net(h, [Block(h, MoE(h, p["expert_hidden"], p["experts"])) for _ in range(p["blocks"])])
    return model, list(model.blocks)


def build_state(shape: str, cfg, device, mesh, seed: int = 1234):
    """FSDP2 (``fully_shard`` per block and the root) + AdamW after one step, fp32."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    p = plan(shape, cfg)
    with torch.device("meta"):
        model, blocks = make_model(p)
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    h = p["hidden"]
    gen = torch.Generator(device=device).manual_seed(seed + mesh.get_rank())
    with torch.no_grad():
        for prm in model.parameters():
            prm.to_local().uniform_(-h ** -0.5, h ** -0.5, generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if shape == "linear":
        x = torch.randn(4, h, device=device, generator=gen)
    elif shape == "transformer":
        x = torch.randint(0, p["vocab"], (1, 8), device=device, generator=gen)
    else:
        x = torch.randn(1, 4, h, device=device, generator=gen)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}, p


def tensor_stats(tensors) -> dict:
    """Count and per-rank (local) bytes of a state's tensors; min/median/max over those
    with at least one dimension (AdamW's 0-d ``step`` scalars are counted apart)."""
    local = [(t.to_local() if isinstance(t, DTensor) else t) for t in tensors]
    nbytes = sorted(t.numel() * t.element_size() for t in local if t.dim() >= 1)
    return {"tensors": len(local), "scalars": sum(1 for t in local if t.dim() == 0),
            "local_bytes_min": nbytes[0] if nbytes else 0,
            "local_bytes_median": statistics.median(nbytes) if nbytes else 0,
            "local_bytes_max": nbytes[-1] if nbytes else 0}


def saved_pair(shape: str, state_gb: float, root: str):
    """For the load probes (``load_knobs.py``, ``load_trace.py``), under torchrun: the
    process group (NCCL on GPUs, else gloo), this rank's device, the state of ``shape``
    (``build_state``, 32 experts, a 131,072-row vocabulary) saved once by zarrckpt to
    ``root/z`` and once by DCP (``FileSystemWriter``, 16 threads) to ``root/d``.
    Returns (state dict, plan, device, zarrckpt path, DCP path)."""
    import os
    import shutil
    import types

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import zarrckpt

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    cfg = types.SimpleNamespace(state_gb=state_gb, hidden=0, vocab=131072, experts=32, expert_hidden=0)
    sd, p = build_state(shape, cfg, device, mesh)
    zpath, dpath = os.path.join(root, "z"), os.path.join(root, "d")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    zarrckpt.save(sd, zpath)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(dpath, thread_count=16))
    return sd, p, device, zpath, dpath


def finish_pair(root: str) -> None:
    """The end of a load probe: every rank done, ``root`` removed, the group destroyed."""
    import shutil

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
