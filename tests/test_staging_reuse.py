"""What later async saves reuse from earlier ones (plans, the staging record, the arena, the
device buffers) never makes a checkpoint hold anything but the values at its call.

Each save here: change the state (a training step), keep a copy of what it holds, call
``async_save``, wait for staging (the documented point after which the state may change),
overwrite every value with garbage at once, then load the checkpoint and compare it bit for
bit with the copy. The CPU runs the same staging steps as a GPU: ``_Staging.gathers`` is
patched so that small CPU leaves are "gathered" through a host emulation of the device
buffer whose span copy lands as late as a device->host copy may (issue 27: on GPUs, later
saves stored AdamW's 0-d CPU ``step`` tensors, which lie between gathered leaves, as the
device buffer's stale bytes). The GPU runs are in ``tests/gpu/``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.api import save as _save
from zarrckpt.distributed import staging
from zarrckpt.format import tree as ztree
from zarrckpt.planning.state import is_array_leaf, resolve_stateful


def _leaves(sd: dict) -> dict:
    return {ztree.key_of(p): v for p, v in ztree.flatten(resolve_stateful(sd), is_array_leaf)}


def _tensors(sd: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _leaves(sd).items() if isinstance(v, torch.Tensor)}


def _garbage(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.fill_(-7)


def _step(state: dict) -> None:
    """A training step: every tensor changes."""
    with torch.no_grad():
        for t in _tensors(state).values():
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)


def _save_and_check(state: dict, path, **kw) -> dict:
    """One async save of ``state``, the state overwritten right after ``wait_staged``; the
    checkpoint must hold the values at the call. Leaves the state as it was at the call."""
    ref = {k: v.detach().clone() for k, v in _tensors(state).items()}
    arrays = {k: np.array(v, copy=True) for k, v in _leaves(state).items() if isinstance(v, np.ndarray)}
    fut = zarrckpt.async_save(state, path, **kw)
    fut.wait_staged()
    for t in _tensors(state).values():
        _garbage(t)
    for k, v in _leaves(state).items():
        if isinstance(v, np.ndarray):
            v[...] = -1
    report = fut.result(timeout=120)
    got = _leaves(zarrckpt.load_state_dict(path))
    wrong = [k for k, v in ref.items() if not (got[k].dtype == v.dtype and torch.equal(got[k], v))]
    wrong += [k for k, v in arrays.items() if not np.array_equal(got[k], v)]
    assert not wrong, f"{path}: {len(wrong)} leaves hold values from after the call: {wrong[:5]}"
    with torch.no_grad():  # back to the values at the call
        for k, t in _tensors(state).items():
            t.copy_(ref[k])
    for k, v in _leaves(state).items():
        if isinstance(v, np.ndarray):
            v[...] = arrays[k]
    return report


@pytest.fixture
def gathered(monkeypatch):
    """Gather small float leaves of more than one element (host emulation of the device
    buffer); 0-d leaves and integers are copied straight, as AdamW's CPU ``step`` tensors
    and large leaves are on a GPU. Small steps, so that both buffers and several steps are
    used."""
    monkeypatch.setattr(_save._Staging, "gathers", classmethod(
        lambda cls, src, arena: src.dtype.is_floating_point and src.dim() > 0 and src.is_contiguous()
        and 0 < src.numel() * src.element_size() <= 64 << 10))
    monkeypatch.setattr(_save._Staging, "_BATCH", 96 << 10)
    monkeypatch.setattr(_save._Staging, "_FIRST", 32 << 10)
    _save.forget_staging()
    yield
    _save.forget_staging()


def _adamw_like(n: int = 24, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    params = {f"layers.{i}.w": torch.randn(32, 64, generator=g) for i in range(n)}
    params["embed"] = torch.randn(512, 128, generator=g)  # 256 KiB: copied straight
    state = {f"layers.{i}.w": {"exp_avg": torch.randn(32, 64, generator=g),
                               "exp_avg_sq": torch.rand(32, 64, generator=g).to(torch.bfloat16),
                               "step": torch.tensor(float(i))}  # 0-d, between gathered leaves
             for i in range(n)}
    return {"model": params, "optim": {"state": state, "lr": 1e-3},
            "counts": torch.arange(5), "flags": torch.rand(9, generator=g) > 0.5, "np": np.arange(6.0),
            "epoch": 3}


def test_later_saves_hold_the_values_at_the_call(tmp_path, gathered):
    """Issue 27: the first save and every later one (plans and staging reused, copies
    issued while the state is walked) hold the values at the call, for leaves gathered
    through the device buffer and the 0-d leaves that lie between them alike."""
    state = _adamw_like()
    for i in range(5):
        _step(state)
        _save_and_check(state, tmp_path / f"s{i}")
    st = _save._STAGED
    assert st is not None and any(s.groups for s in st.steps) and any(s.direct for s in st.steps)
    assert sum(1 for s in st.steps if s.groups) > 2  # both device buffers in turn


def test_gathered_spans_hold_only_gathered_leaves(tmp_path, gathered):
    """The arena span a step's one device->host copy writes holds none of the leaves copied
    another way (the invariant whose breach was issue 27)."""
    state = _adamw_like()
    _save_and_check(state, tmp_path / "a")
    _save_and_check(state, tmp_path / "b")
    st = _save._STAGED
    base = staging.shared_arena().base_ptr()
    spans = [(s.start, s.end) for s in st.steps if s.groups]
    assert spans
    others = [k for s in st.steps for k in s.direct] + list(st.values)
    for k in others:
        h = st.hosts[k]
        a = h.data_ptr() - base if isinstance(h, torch.Tensor) else None
        if a is None:
            continue  # NumPy values live outside the arena
        b = a + h.numel() * h.element_size()
        assert all(b <= s or a >= e for s, e in spans), k


def test_leaves_replaced_between_saves(tmp_path, gathered):
    """New tensor objects of the same shape (an optimizer that re-creates its state, a
    model re-loaded in place): the plans are reused, the copies come from the new leaves."""
    state = _adamw_like()
    _save_and_check(state, tmp_path / "a")
    for i in (0, 5, 23):
        state["optim"]["state"][f"layers.{i}.w"]["step"] = torch.tensor(100.0 + i)
        state["model"][f"layers.{i}.w"] = torch.full((32, 64), float(i))
    state["embed_new"] = None
    del state["embed_new"]
    _save_and_check(state, tmp_path / "b")
    _save_and_check(state, tmp_path / "c")


def test_release_and_reserve_staging_between_saves(tmp_path, gathered):
    """``release_staging()`` forgets the staging record and frees the arena; a larger
    ``reserve_staging()`` reallocates the arena: the next save stages afresh (its views
    would point into freed memory otherwise) and holds the values at its call."""
    state = _adamw_like()
    _save_and_check(state, tmp_path / "a")
    _save_and_check(state, tmp_path / "b")
    zarrckpt.release_staging()
    assert _save._STAGED is None
    _save_and_check(state, tmp_path / "c")
    _save_and_check(state, tmp_path / "d")
    before = _save._STAGED
    zarrckpt.reserve_staging(staging.shared_arena().capacity * 2)
    _save_and_check(state, tmp_path / "e")
    assert _save._STAGED is not before
    _save_and_check(state, tmp_path / "f")


@pytest.mark.parametrize("change", ["key added", "dtype", "shape", "gathered to straight", "value to tensor"])
def test_structure_changes_between_saves(tmp_path, gathered, change):
    """A state whose structure, a dtype or a shape changed gets new plans and new staging;
    changed leaves and unchanged ones hold the values at the call, then and after."""
    state = _adamw_like()
    _save_and_check(state, tmp_path / "a")
    _save_and_check(state, tmp_path / "b")
    token = _save._STAGED.token
    if change == "key added":
        state["optim"]["state"]["extra"] = {"step": torch.tensor(9.0), "exp_avg": torch.ones(4, 4)}
    elif change == "dtype":
        state["model"]["layers.3.w"] = state["model"]["layers.3.w"].to(torch.float16)
    elif change == "shape":
        state["model"]["layers.3.w"] = torch.ones(16, 64)
    elif change == "gathered to straight":  # same shape and dtype, now too big to gather
        state["model"]["layers.3.w"] = state["model"]["layers.3.w"].t().contiguous().t()
        state["model"]["embed"] = torch.randn(8, 8)
    else:
        state["optim"]["lr"] = torch.tensor(1e-3)
    _save_and_check(state, tmp_path / "c")
    assert _save._STAGED is None or _save._STAGED.token is not token
    for i in range(3):
        _step(state)
        _save_and_check(state, tmp_path / f"d{i}")


def test_a_load_between_saves(tmp_path, gathered):
    """A load into the live state between saves (resume, evaluation) shares the streaming
    arena and the read buffers, never the async staging: later saves stay exact."""
    state = _adamw_like()
    _save_and_check(state, tmp_path / "a")
    _step(state)
    _save_and_check(state, tmp_path / "b")
    zarrckpt.load(state, tmp_path / "a")
    _save_and_check(state, tmp_path / "c")
    _step(state)
    _save_and_check(state, tmp_path / "d")


def test_sync_saves_between_async_ones(tmp_path, gathered):
    """Sync saves stream through their own arena; async saves around them stay exact."""
    state = _adamw_like()
    _save_and_check(state, tmp_path / "a")
    _step(state)
    zarrckpt.save(state, tmp_path / "sync")
    _save_and_check(state, tmp_path / "b")
    _step(state)
    _save_and_check(state, tmp_path / "c")


def test_without_gathering(tmp_path):
    """The same state staged without gathering (the CPU path): every later save exact."""
    _save.forget_staging()
    state = _adamw_like()
    for i in range(3):
        _step(state)
        _save_and_check(state, tmp_path / f"s{i}")
