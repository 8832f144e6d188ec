"""Analyse a whole training run's checkpoints with xarray and dask: the norm of every
layer at every saved step, in one expression, and a PNG plot.

    python examples/analyse_run.py [directory]

A small model is trained for 60 steps with a CheckpointManager saving every 10 steps
(with the loss as a metric). ``zarrckpt.open_run`` then gives one ``xarray.Dataset``:
per parameter (and optimizer moment) a dask-backed variable with a leading ``step``
dimension whose chunks are the stored chunks, and the recorded metrics as coordinates.
Computing the norms reads each stored chunk of each checkpoint once, in parallel, and
holds only a few chunks in memory at a time.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn

import zarrckpt


def train(root: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randn(512, 64)
    y = (x[:, :8].sum(1, keepdim=True) > 0).float()
    # every leaf is an array of its own (the default): generic Zarr tools see them all
    with zarrckpt.CheckpointManager(root, keep_every=10) as mgr:
        for step in range(1, 61):
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 0:
                mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()},
                         metrics={"loss": loss.item()})


def main() -> None:
    base = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="zarrckpt-run-")
    root = os.path.join(base, "run")
    train(root)

    run = zarrckpt.open_run(root, keys=["model"])  # a CheckpointManager root, or a list of paths
    print(run)

    # the norm of every parameter at every step: one expression, evaluated by dask
    norms = run.map(lambda v: np.sqrt((v.astype("float32") ** 2).sum([d for d in v.dims if d != "step"])))
    norms = norms.compute()
    steps = norms["step"].values
    print("\nstep  " + "  ".join(f"{k.removeprefix('model/'):>9s}" for k in norms.data_vars) + "   loss")
    for i, step in enumerate(steps):
        print(f"{step:4d}  " + "  ".join(f"{float(norms[k][i]):9.4f}" for k in norms.data_vars)
              + f"  {float(run['metrics/loss'][i]):.4f}")

    # how far each weight moved from the first checkpoint (a relative update size per layer)
    weights = [k for k in run.data_vars if k.endswith("weight")]
    first, last = run.isel(step=0), run.isel(step=-1)
    moved = {k: float(np.sqrt(((last[k].astype("float32") - first[k].astype("float32")) ** 2).sum())
                      / norms[k][0]) for k in weights}
    print("\nrelative change from step", steps[0], "to", steps[-1], {k: round(v, 4) for k, v in moved.items()})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for k in weights:
        ax1.plot(steps, norms[k].values, marker="o", label=k.removeprefix("model/"))
    ax1.set(xlabel="step", ylabel="Frobenius norm", title="weight norms per layer")
    ax1.legend()
    ax2.plot(steps, run["metrics/loss"].values, marker="o", color="black")
    ax2.set(xlabel="step", ylabel="loss", title="loss (checkpoint metadata)")
    fig.tight_layout()
    png = os.path.join(base, "norms.png")
    fig.savefig(png, dpi=80)
    print("plot at", png)
    print(f"checkpoint at {root}")


if __name__ == "__main__":
    main()
