"""A conversion holds about ``memory_limit`` bytes whatever the checkpoint's size: each
direction converts 128 MiB (two 64 MiB tensors, each twice the limit) with a 32 MiB limit,
in a fresh process whose peak RSS growth is measured (Linux: VmHWM reset through
/proc/self/clear_refs after a warm-up conversion of a tiny checkpoint, so imports,
thread pools and allocator arenas are not counted)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self/status")

LIMIT = 32 << 20
TENSOR = 64 << 20

CHILD = textwrap.dedent("""
    import os, sys, json
    direction, src, dst, warm, limit = sys.argv[1:6]
    limit = int(limit)
    if direction.endswith(("torch_save", "dcp")):
        import torch
    from zarrckpt import convert

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024

    fn = getattr(convert, direction)
    fn(warm, dst + ".warm", memory_limit=limit)        # imports, threads, arenas
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                   # VmHWM := VmRSS
    before = status("VmRSS")
    report = fn(src, dst, memory_limit=limit)
    print(json.dumps({"growth": status("VmHWM") - before, "bytes": report.bytes}))
""")


def _write_safetensors(path: str, n: int, nbytes: int) -> None:
    from zarrckpt.format import dtypes
    from zarrckpt.interop.safetensors_io import Planned, header_bytes

    items = [Planned(f"layers.{i}.weight", dtypes.by_zarr("float32"), (nbytes // 4 // 1024, 1024), None)
             for i in range(n)]
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(header_bytes(items, {"format": "pt"}))
        for it in items:
            left = it.nbytes
            while left:
                k = min(left, 8 << 20)
                f.write(rng.integers(0, 255, k, dtype=np.uint8).tobytes())
                left -= k


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from zarrckpt.tools import convert

    d = tmp_path_factory.mktemp("mem")
    big, small = str(d / "big.safetensors"), str(d / "small.safetensors")
    _write_safetensors(big, 2, TENSOR)
    _write_safetensors(small, 2, 1 << 20)
    paths = {"safetensors": (big, small)}
    for name, src in (("zarrckpt", None),):
        paths[name] = (str(d / "big_ck"), str(d / "small_ck"))
        convert.from_safetensors(big, paths[name][0])
        convert.from_safetensors(small, paths[name][1])
    paths["torch_save"] = (str(d / "big.pt"), str(d / "small.pt"))
    paths["dcp"] = (str(d / "big_dcp"), str(d / "small_dcp"))
    for i in range(2):
        convert.to_torch_save(paths["zarrckpt"][i], paths["torch_save"][i])
        convert.to_dcp(paths["zarrckpt"][i], paths["dcp"][i])
    return d, paths


@pytest.mark.parametrize("direction,source", [
    ("from_safetensors", "safetensors"), ("to_safetensors", "zarrckpt"),
    ("from_torch_save", "torch_save"), ("to_torch_save", "zarrckpt"),
    ("from_dcp", "dcp"), ("to_dcp", "zarrckpt"),
])
def test_peak_memory_is_bounded(inputs, direction, source):
    import json

    d, paths = inputs
    big, small = paths[source]
    dst = str(d / f"out_{direction}") + (".pt" if direction == "to_torch_save" else "")
    out = subprocess.run([sys.executable, "-c", CHILD, direction, big, dst, small, str(LIMIT)],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bytes"] == 2 * TENSOR  # the whole checkpoint went through: 4x the limit
    assert result["growth"] <= LIMIT, f"{direction}: peak RSS grew {result['growth'] >> 20} MiB, limit 32 MiB"
