"""Read a checkpoint with NumPy only: no torch, no zarrckpt internals, no full reads.

    python examples/read_with_numpy.py [directory]

A training job (torch, here a small bf16 model and AdamW) saves a checkpoint; then a
second interpreter in which ``import torch`` fails opens it with ``zarrckpt.open``:
a lazy view whose array leaves read only the chunks a NumPy index touches, and come
back as NumPy arrays (ml_dtypes for bfloat16).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def train_and_save(path: str) -> None:
    """The training side (needs torch)."""
    import torch
    import torch.nn as nn

    import zarrckpt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 16)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1, "note": "demo"}
    zarrckpt.save(state, path, metadata={"step": 1, "metrics": {"loss": 0.25}})


def read_with_numpy(path: str) -> None:
    """The reading side: NumPy and zarrckpt's torch-free reader."""
    import numpy as np

    import zarrckpt

    assert sys.modules.get("torch") is None  # never imported
    ck = zarrckpt.open(path)
    print(ck)  # the tree: groups, dtypes, shapes, sizes, chunk layout; values inline
    print("step", ck.step, "metrics", ck.metrics)

    w = ck["model/0.weight"]  # a LazyArray: nothing read yet
    print("model/0.weight:", w.shape, w.dtype, f"{w.nbytes} bytes, chunks {w.chunks}")
    rows = w[:4, ::64]  # NumPy indexing; reads only the chunks it touches
    print("first rows, every 64th column:\n", rows.astype(np.float32))

    model = ck["model"]  # a view of the subtree
    for name, arr in model.items():
        full = arr.to_numpy().astype(np.float32)
        print(f"  {name:10s} {str(arr.dtype):9s} {str(arr.shape):11s} norm {np.linalg.norm(full):8.3f}")
    exp_avg = ck["optim/state/0/exp_avg"]
    print("AdamW exp_avg of the first weight:", exp_avg.shape, exp_avg.dtype,
          "max |m| =", float(np.abs(exp_avg[...].astype(np.float32)).max()))
    print("lr:", ck["optim/param_groups/0/lr"], "note:", ck["note"])
    try:
        w.to_torch()
    except zarrckpt.MissingDependencyError as e:
        print("as expected without torch:", e)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--read":
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` now fails
        read_with_numpy(sys.argv[2])
        return
    base = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="zarrckpt-numpy-")
    path = os.path.join(base, "step_1")
    train_and_save(path)
    out = subprocess.run([sys.executable, __file__, "--read", path])
    if out.returncode:
        raise SystemExit(out.returncode)
    print(f"checkpoint at {path}")


if __name__ == "__main__":
    main()
