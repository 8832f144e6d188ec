"""A PyTorch model into JAX with a NamedSharding, a training step in JAX, and back.

    python examples/jax_roundtrip.py [directory]

1. PyTorch saves an MLP (bf16 weights) with ``zarrckpt.save``.
2. JAX loads it with ``zarrckpt.jax.load`` onto a (data, model) mesh of 8 CPU devices:
   weights split over "model" (column- then row-parallel), biases replicated. Each
   device's slice is read once per process, straight from the stored chunks.
3. JAX checks its forward pass against PyTorch's, takes one SGD step, and saves the new
   parameters with ``zarrckpt.jax.save``: chunks follow the sharding.
4. PyTorch loads them back into the model with ``zarrckpt.load``; the same step taken
   in PyTorch gives the same weights.

On a machine with accelerators, drop the XLA_FLAGS line and use the real devices.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
import zarrckpt.jax  # noqa: E402

LR = 0.5


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(torch.bfloat16)


def jax_forward(params: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["0.weight"].T + params["0.bias"])
    return h @ params["2.weight"].T + params["2.bias"]


def main() -> None:
    base = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="zarrckpt-jax-")
    torch_path, jax_path = os.path.join(base, "torch_step_0"), os.path.join(base, "jax_step_1")

    # 1. PyTorch saves
    model = make_model()
    zarrckpt.save({"model": model.state_dict(), "step": 0}, torch_path)

    # 2. JAX loads onto a 2 x 4 mesh: weights split over "model", biases replicated
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    ck = zarrckpt.open(torch_path)
    shardings = {
        "0.weight": NamedSharding(mesh, P("model", None)),  # column-parallel: output rows split
        "0.bias": NamedSharding(mesh, P("model")),
        "2.weight": NamedSharding(mesh, P(None, "model")),  # row-parallel: input columns split
        "2.bias": NamedSharding(mesh, P()),
    }
    target = {"model": {k: jax.ShapeDtypeStruct(ck[f"model/{k}"].shape, jnp.bfloat16, sharding=s)
                        for k, s in shardings.items()},
              "step": None}
    loaded = zarrckpt.jax.load(ck, target)
    params = loaded["model"]
    print("0.weight on", params["0.weight"].sharding, "shard shape",
          params["0.weight"].addressable_shards[0].data.shape)

    # 3. the same forward pass in both frameworks; one SGD step in JAX
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    xs = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P("data")))
    with torch.no_grad():
        want = model(torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    got = np.asarray(jax.jit(jax_forward)(params, xs)).astype(np.float32)
    print("forward |JAX - torch| max", float(np.abs(got - want).max()))
    assert np.allclose(got, want, atol=0.1), "the two forward passes disagree"

    def loss(p, x):
        return jnp.mean(jax_forward(p, x).astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss))(params, xs)
    new = jax.tree.map(lambda p, g: (p.astype(jnp.float32) - LR * g.astype(jnp.float32)).astype(p.dtype),
                       params, grads)
    report = zarrckpt.jax.save({"model": new, "step": loaded["step"] + 1}, jax_path, metadata={"step": 1})
    print("JAX saved", report["arrays"], "arrays,", report["bytes_written"], "bytes")
    print(zarrckpt.open(jax_path))  # chunks follow the sharding; mesh and placements recorded

    # 4. back into PyTorch, and the same step taken there
    state = {"model": make_model().state_dict(), "step": 0}
    zarrckpt.load(state, jax_path)
    model.load_state_dict(state["model"])
    assert state["step"] == 1
    for name, p in model.state_dict().items():
        same = np.array_equal(p.float().numpy(), np.asarray(new[name]).astype(np.float32))
        assert same, f"{name} differs after the round trip"
    print("PyTorch loaded the JAX-trained weights bit for bit")

    ref = make_model()
    out = ref(torch.from_numpy(x).to(torch.bfloat16)).float()
    out.pow(2).mean().backward()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_((p.float() - LR * p.grad.float()).to(p.dtype))
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref.state_dict().values(),
                                                                          model.state_dict().values()))
    print("the same SGD step in PyTorch differs by at most", diff)
    assert diff < 0.05
    print(f"checkpoint at {jax_path}")


if __name__ == "__main__":
    main()
