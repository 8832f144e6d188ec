"""Staged loads read whole stored inner chunks ("tiles") as they lie in the chunk files and
put them in order with one strided copy on the target's device (issue 16: the GPU ``moe``
load). On the CPU the same path serves casts; these tests run it there."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zarrckpt
from zarrckpt.api import load as zload
from zarrckpt.readers.checkpoint import Checkpoint
from zarrckpt.storage import _localfile, tile_grid


@st.composite
def tilings(draw):
    n = draw(st.integers(1, 3))
    tile = tuple(draw(st.integers(1, 5)) for _ in range(n))
    grid = tuple(draw(st.integers(1, 4)) for _ in range(n))
    # the box holds whole tiles, or ends inside the last one (the array's end)
    ext = tuple(draw(st.integers((g - 1) * t + 1, g * t)) for g, t in zip(grid, tile))
    return tile, grid, ext


@settings(max_examples=80, deadline=None)
@given(tilings(), st.sampled_from(["plain", "transposed", "sliced"]), st.booleans())
def test_untile_puts_tiles_in_order_into_any_strided_target(tiling, kind, cast):
    """_untile against NumPy: tiles in C order of their grid, padding included, into the
    target's part without padding; the target a plain tensor, a transposed or sliced view,
    with or without a cast."""
    tile, grid, ext = tiling
    n = len(tile)
    rng = np.random.default_rng(0)
    tiles = rng.standard_normal((int(np.prod(grid)), *tile)).astype(np.float32)
    padded = tiles.reshape(*grid, *tile).transpose([x for d in range(n) for x in (d, n + d)])
    want = padded.reshape([g * t for g, t in zip(grid, tile)])[tuple(slice(0, e) for e in ext)]
    dtype = torch.float64 if cast else torch.float32
    if kind == "plain":
        dst = torch.zeros(ext, dtype=dtype)
    elif kind == "transposed":
        dst = torch.zeros(ext[::-1], dtype=dtype).permute(*reversed(range(n)))
    else:
        dst = torch.zeros([e + 3 for e in ext], dtype=dtype)[tuple(slice(1, 1 + e) for e in ext)]
    scratch = {}

    def buf(slot, nbytes, device):
        scratch[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return scratch[slot]
    box = tuple((0, e) for e in ext)
    zload._untile(torch.from_numpy(tiles.reshape(-1)), grid, tile, box, dst, buf)
    np.testing.assert_array_equal(dst.numpy(), want.astype(dst.numpy().dtype))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_staged_loads_read_tiles_and_are_exact(tmp_path, monkeypatch, device):
    """A load through the staging arena (here: casts) reads tiles where its pieces are made
    of whole inner chunks (edge tiles with padding included), into plain and strided targets,
    also when the pieces are split; a piece that does not fit half of a tiny arena falls
    back to reading the region itself. Values exact either way."""
    calls = []
    real = _localfile.LocalArray._tile_units  # tiles read alone (read_tiles) or in a batch (read_now)
    monkeypatch.setattr(_localfile.LocalArray, "_tile_units",
                        lambda self, box, out: calls.append((self.key, box)) or real(self, box, out))
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(300, 170, generator=g), "v": torch.randn(16384, 64, generator=g),
          "e": torch.randn(3, 50, 70, generator=g)}
    zarrckpt.save(sd, tmp_path / "c", inner_chunk_bytes=4096)

    def targets():  # CUDA targets are staged whatever their dtype; CPU ones for the cast
        dt = torch.float64
        return {"w": torch.zeros(170, 300, dtype=dt, device=device).T,  # a transposed view
                "v": torch.zeros(16388, 64, dtype=dt, device=device)[2:16386],  # a slice
                "e": torch.zeros(3, 50, 70, dtype=dt, device=device)}

    real_staging = zload._Reads._staging
    for kw in ({}, {"max_inflight_bytes": 1 << 16}, {"max_staging_bytes": 1 << 14}, {"no room": True}):
        calls.clear()
        t = targets()
        if "no room" in kw:  # as where tiles (padding included) would not fit half of the arena
            monkeypatch.setattr(zload._Reads, "_staging", lambda self, *a: None if len(a) > 4 and a[4]
                                else real_staging(self, *a))
            kw = {}
        zarrckpt.load(t, tmp_path / "c", cast=True, **kw)
        for k, v in sd.items():
            assert torch.equal(t[k].cpu(), v.double()), (kw, k)
        keys = {k for k, _ in calls}
        if zload._Reads._staging is not real_staging:
            assert not keys, calls  # every region read as itself
        else:
            assert keys == {"w", "v", "e"}, calls
        if "max_inflight_bytes" in kw:  # pieces of 1 MiB: v (4 MiB) split along its first dimension
            assert len([c for c in calls if c[0] == "v"]) >= 4, calls


def test_a_region_off_tile_boundaries_is_read_as_itself(tmp_path, monkeypatch):
    """Resharded targets whose regions do not start on tile boundaries read the region (the
    tile path is taken only where a piece is made of whole inner chunks)."""
    calls = []
    real = _localfile.LocalArray._tile_units  # tiles read alone (read_tiles) or in a batch (read_now)
    monkeypatch.setattr(_localfile.LocalArray, "_tile_units",
                        lambda self, box, out: calls.append(box) or real(self, box, out))
    w = torch.randn(64, 64)
    zarrckpt.save({"w": w}, tmp_path / "c", inner_chunk_bytes=1024)  # tiles of 16 x 16
    ckpt = Checkpoint(tmp_path / "c")
    info = ckpt.array_infos(["w"])["w"]
    assert ckpt.tile_shape("w") == (16, 16)
    out = torch.zeros(30, 64, dtype=torch.float64)
    with ckpt.reading(), zload._Reads(ckpt, 1 << 20, 1 << 20) as reads:
        reads.add("w", info, [(((10, 40), (0, 64)), ((0, 30), (0, 64)))], out)
        second = torch.zeros(32, 64, dtype=torch.float64)
        reads.add("w", info, [(((16, 48), (0, 64)), ((0, 32), (0, 64)))], second)
        reads.finish()
    assert torch.equal(out, w[10:40].double()) and torch.equal(second, w[16:48].double())
    assert calls == [((16, 48), (0, 64))]


def test_tile_grid():
    assert tile_grid(((0, 64), (16, 48)), (16, 16), (64, 64)) == (4, 2)
    assert tile_grid(((48, 70),), (16,), (70,)) == (2,)  # ends at the array's end
    assert tile_grid(((8, 64),), (16,), (64,)) is None
    assert tile_grid(((0, 40),), (16,), (64,)) is None
    with pytest.raises(AssertionError):
        assert tile_grid(((0, 16),), (16,), (64,)) is None
