"""Stateful leaves (``state_dict()``/``load_state_dict()``): a fresh optimizer restored from
a checkpoint, the caller's objects left in their slots, and what cannot be filled."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

import zarrckpt


def model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def train(model, optim, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def assert_same_optim_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i, state in sa["state"].items():
        assert state.keys() == sb["state"][i].keys()
        for name, v in state.items():
            w = sb["state"][i][name]
            assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), (i, name)


@pytest.mark.parametrize("pack_bytes", [0, 64 << 10], ids=["arrays", "packed"])
def test_fresh_adamw_as_stateful_is_restored_bit_exact(tmp_path, pack_bytes):
    model, optim = model_and_optim(0)
    train(model, optim, 2)
    zarrckpt.save({"model": model, "optim": optim}, tmp_path / "c", pack_bytes=pack_bytes)

    model2, optim2 = model_and_optim(1)  # other weights, and a never-stepped optimizer
    assert optim2.state_dict()["state"] == {}
    sd = {"model": model2, "optim": optim2}
    rep = {}
    zarrckpt.load(sd, tmp_path / "c", report=rep)
    assert sd["model"] is model2 and sd["optim"] is optim2 and rep["unexpected"] == []
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert_same_optim_state(optim, optim2)
    assert optim2.state_dict()["state"][0]["step"].item() == 2
    # and training goes on identically
    assert train(model2, optim2, 3, start=2) == train(model, optim, 3, start=2)
    assert_same_optim_state(optim, optim2)


def test_fresh_optimizer_state_dict_in_a_plain_dict_is_filled_in_place(tmp_path):
    model, optim = model_and_optim(0)
    train(model, optim, 2)
    zarrckpt.save({"optim": optim.state_dict()}, tmp_path / "c")
    _, optim2 = model_and_optim(1)
    osd = optim2.state_dict()
    state = osd["state"]
    zarrckpt.load({"optim": osd}, tmp_path / "c")
    assert osd["state"] is state and set(state) == {0, 1, 2, 3}
    assert torch.equal(state[0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
    optim2.load_state_dict(osd)
    assert_same_optim_state(optim, optim2)


def test_strict_false_warns_about_stored_keys_it_leaves(tmp_path):
    zarrckpt.save({"model": {"w": torch.ones(2), "extra": torch.ones(3)}}, tmp_path / "c")
    w = torch.zeros(2)
    with pytest.warns(UserWarning, match=r"strict=False.*'model/extra'"):
        zarrckpt.load({"model": {"w": w}}, tmp_path / "c", strict=False)
    assert torch.equal(w, torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default strict=True reports them, as DCP does
        zarrckpt.load({"model": {"w": w}}, tmp_path / "c")


# ------------------------------------------- PyTorch's test_stateful_and_non_stateful_loads


class _TrackedDict(dict):
    """A state dict that records whether an item was (re)assigned."""

    def __init__(self):
        super().__init__()
        self.set_item_called = False

    def __setitem__(self, key, value):
        self.set_item_called = True
        super().__setitem__(key, value)


class _Foo(Stateful):
    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"t": torch.full((2,), 3.0), "n": 7}

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


class _Empty(Stateful):
    def __init__(self):
        self.load_state_dict_called = False

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        self.load_state_dict_called = True


@pytest.mark.parametrize("stateful", [_Empty, _Foo])
def test_stateful_and_non_stateful_loads(tmp_path, stateful):
    # ported from torch/test/distributed/checkpoint/e2e/test_e2e_save_and_load.py
    foo = stateful()
    sd = _TrackedDict()
    sd["foo"] = foo
    sd.set_item_called = False
    zarrckpt.save(sd, tmp_path / "a")
    zarrckpt.load(sd, tmp_path / "a")
    assert sd["foo"] is foo  # loaded in place ...
    assert not sd.set_item_called  # ... and not re-assigned in the caller's dict
    if stateful is _Empty:
        assert foo.load_state_dict_called
    else:
        assert foo.loaded["n"] == 7 and torch.equal(foo.loaded["t"], torch.full((2,), 3.0))

    sd = _TrackedDict()
    t = torch.rand(10, 10)
    sd["foo"] = {"replicated": t.clone(), "bytes": [1, 2, 3, 4]}
    zarrckpt.save(sd, tmp_path / "b")
    sd["foo"]["replicated"].zero_()
    sd["foo"]["bytes"] = [0, 0, 0, 0]
    sd.set_item_called = False
    zarrckpt.load(sd, tmp_path / "b")
    assert sd.set_item_called  # the non-Stateful entry is updated
    assert torch.equal(sd["foo"]["replicated"], t) and sd["foo"]["bytes"] == [1, 2, 3, 4]


def test_stateful_nested_in_a_list_stays_in_its_slot(tmp_path):
    foo = _Foo()
    sd = {"objs": [foo, 5]}
    zarrckpt.save(sd, tmp_path / "c")
    sd["objs"][1] = 0
    zarrckpt.load(sd, tmp_path / "c")
    assert sd["objs"][0] is foo and sd["objs"][1] == 5 and foo.loaded["n"] == 7


# ------------------------------------------- sharded optimizers need get_state_dict


def _rank_fresh_fsdp_optimizer(rank, world, path):
    from test_fsdp import build, train_step

    model, optim = build(world)
    train_step(model, optim, 0, rank, world)
    zarrckpt.save({"model": model, "optim": optim}, path)
    model2, optim2 = build(world)
    try:
        zarrckpt.load({"model": model2, "optim": optim2}, path)
    except zarrckpt.StateDictMismatchError as e:
        return str(e)
    return None


def test_fresh_fsdp2_optimizer_is_refused_with_what_to_call(tmp_path, clusters):
    msgs = clusters(2).run(_rank_fresh_fsdp_optimizer, str(tmp_path / "c"))
    for msg in msgs:
        assert msg is not None and "'optim/state'" in msg
        assert "get_state_dict(model, optim)" in msg and "set_state_dict" in msg
