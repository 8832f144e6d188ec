"""What a newcomer hit in the first hour (issue 29, "Smaller things a newcomer hit"): each
case as they met it, and the behaviour they get now."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import zarrckpt

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")


def _nested() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


# ------------------------------------------------------------------ nested tensor leaves


@pytest.mark.parametrize("api", ["save", "async_save"])
@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_a_nested_tensor_leaf_is_refused_by_name(tmp_path, api, layout):
    """It used to raise torch's RuntimeError ("NestedTensorImpl doesn't support sizes"):
    the plan cache read the leaf's shape before the leaf was checked."""
    bad = (_nested() if layout == "strided"
           else torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged))
    state = {"w": torch.ones(4), "bad": bad}
    with pytest.raises(zarrckpt.UnsupportedValueError, match="'bad'.*nested"):
        if api == "save":
            zarrckpt.save(state, tmp_path / "c")
        else:
            zarrckpt.async_save(state, tmp_path / "c").result(timeout=120)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("api", ["save", "async_save"])
def test_a_nested_tensor_where_an_earlier_save_had_a_plain_one_is_refused_by_name(tmp_path, api):
    """A later save compares its leaves with the earlier save's (plan reuse): the nested
    leaf must fall back to fresh planning, where it is refused, not raise from the compare."""
    def run(state, path):
        if api == "save":
            zarrckpt.save(state, path)
        else:
            zarrckpt.async_save(state, path).result(timeout=120)

    run({"w": torch.ones(4), "bad": torch.ones(5)}, tmp_path / "a")
    with pytest.raises(zarrckpt.UnsupportedValueError, match="'bad'.*nested"):
        run({"w": torch.ones(4), "bad": _nested()}, tmp_path / "b")
    with pytest.raises(zarrckpt.UnsupportedValueError, match="'bad/0'.*nested"):  # in a list too
        run({"w": torch.ones(4), "bad": [_nested()]}, tmp_path / "b")
    assert not (tmp_path / "b").exists()
