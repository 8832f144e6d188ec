"""What a newcomer hit in the first hour (issue 29, "Smaller things a newcomer hit"): each
case as they met it, and the behaviour they get now."""

from __future__ import annotations

import logging
import os
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


# ------------------------------------------------------------------ strict: what a load left


def test_strict_true_says_once_in_the_log_what_strict_false_warns(tmp_path, caplog):
    """One message in both modes: strict=True (stored keys the target lacks are normal, as in
    DCP) logs it at INFO, once; strict=False warns, naming both the stored keys it left and
    the target's keys it left as they were."""
    zarrckpt.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "c")
    a = torch.zeros(2)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="zarrckpt"):
        warnings.simplefilter("error")
        zarrckpt.load({"a": a}, tmp_path / "c")
    said = [r.getMessage() for r in caplog.records if "unloaded" in r.getMessage()]
    assert said == [f"zarrckpt.load(strict=True) left 1 stored key(s) of {str(tmp_path / 'c')!r} unloaded "
                    "(the target has no place for them): 'b'; report['unexpected'] and report['missing'] "
                    "list them"]
    c = torch.zeros(2)
    with pytest.warns(UserWarning) as caught:
        zarrckpt.load({"a": a, "c": c}, tmp_path / "c", strict=False)
    assert [str(w.message) for w in caught] == [
        f"zarrckpt.load(strict=False) left 1 stored key(s) of {str(tmp_path / 'c')!r} unloaded (the target "
        "has no place for them): 'b'; and left 1 key(s) of the target as they were (not in the checkpoint): "
        "'c'; report['unexpected'] and report['missing'] list them"]


def rank_load_strict_false(rank, world, path):
    zarrckpt.save({"model": {"w": torch.ones(4)}, "step": 3}, path)
    w = torch.zeros(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zarrckpt.load({"model": {"w": w}}, path, strict=False)
    assert torch.equal(w, torch.ones(4))
    return [str(x.message) for x in caught if "zarrckpt.load" in str(x.message)]


def test_strict_false_warns_once_per_job_not_once_per_rank(tmp_path, clusters):
    said = clusters(2).run(rank_load_strict_false, str(tmp_path / "c"))
    assert said[1] == [] and len(said[0]) == 1, said
    assert said[0][0].startswith("zarrckpt.load(strict=False) on rank 0 of 2 left 1 stored key(s)")
    assert "'step'" in said[0][0] and said[0][0].endswith("list them (each rank's own)")


# ------------------------------------------------------------------ load_state_dict(keys="model")


def test_load_state_dict_takes_one_key_as_a_string(tmp_path):
    """It used to split "model" into letters and refuse key 'm'."""
    zarrckpt.save({"model": {"w": torch.ones(2)}, "optim": {"lr": 0.1}, "step": 1}, tmp_path / "c")
    sd = zarrckpt.load_state_dict(tmp_path / "c", keys="model")
    assert list(sd) == ["model"] and torch.equal(sd["model"]["w"], torch.ones(2))
    assert zarrckpt.load_state_dict(tmp_path / "c", keys="step") == {"step": 1}
    assert list(zarrckpt.load_state_dict(tmp_path / "c", keys=["model", "step"])) == ["model", "step"]
    with pytest.raises(zarrckpt.MissingKeysError, match="'modle'"):
        zarrckpt.load_state_dict(tmp_path / "c", keys="modle")


# ------------------------------------------------------------------ a target that is not Stateful


class _Weights:
    """Holds tensors, but offers neither state_dict() nor load_state_dict()."""

    def __init__(self) -> None:
        self.w = torch.zeros(2)


class _HalfStateful(_Weights):
    def state_dict(self) -> dict:
        return {"w": self.w}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("cls", [_Weights, _HalfStateful])
def test_an_object_that_is_not_stateful_is_named_as_the_reason(tmp_path, cls, strict):
    """It used to say "key 'model' not in checkpoint ... pass strict=False", which would
    skip the whole subtree."""
    zarrckpt.save({"model": {"w": torch.ones(2)}, "step": 1}, tmp_path / "c")
    obj = cls()
    with pytest.raises(zarrckpt.StateDictMismatchError) as e:
        zarrckpt.load({"model": obj, "step": 0}, tmp_path / "c", strict=strict)
    text = str(e.value)
    assert f"key 'model': the checkpoint holds a subtree there (1 key(s): 'model/w'), but the target holds " \
           f"an object of type {cls.__name__}, which is neither a dict/list nor Stateful" in text
    assert ("no state_dict() or load_state_dict()" if cls is _Weights else "no load_state_dict()") in text
    assert "strict=False" not in text and torch.equal(obj.w, torch.zeros(2))


# ------------------------------------------------------------------ the README, true to the code

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    """The README and the pages of docs/ (where the README's detail may move), one text."""
    import glob

    paths = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                                 recursive=True))
    texts = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            texts.append(f.read())
    return "\n".join(texts)


def _pending(url: str) -> None:
    from zarrckpt.format import documents as fmt
    from zarrckpt.storage import open_storage

    doc = fmt.root_metadata(state="pending", save_id=fmt.new_save_id(), world_size=1, created=fmt.utc_now(),
                            writer={"zarrckpt": "test"})
    st = open_storage(url)
    st.make_dir()
    st.write_atomic("zarr.json", fmt.encode_document(doc))


def test_a_pending_checkpoint_is_replaced_as_the_readme_says(tmp_path):
    """The README said any later save reuses an interrupted overwrite on object stores;
    there it takes overwrite=True (on a file system a dead save's claim is reused)."""
    url = f"memory://pending-{tmp_path.name}/ck"
    _pending(url)
    with pytest.raises(zarrckpt.CheckpointExistsError, match="overwrite=True"):
        zarrckpt.save({"w": torch.ones(2)}, url)
    zarrckpt.save({"w": torch.ones(2)}, url, overwrite=True)
    assert torch.equal(zarrckpt.load_state_dict(url)["w"], torch.ones(2))
    _pending(str(tmp_path / "local"))
    zarrckpt.save({"w": torch.ones(2)}, tmp_path / "local")  # no overwrite needed
    text = " ".join(_readme().split())
    start = text.index("**Overwrite, on object stores**")
    paragraph = text[start:text.index("- **", start)]
    assert "which a later save replaces only with `overwrite=True`" in paragraph, paragraph
    assert "any later save may reuse" not in paragraph


def test_the_readme_verify_example_shows_what_verify_prints(tmp_path, capsys):
    """The README's `zarrckpt verify` example said 7 arrays, 7 chunks for the checkpoint its
    `zarrckpt info` example shows with 16 arrays. Rebuilt here as the examples describe it."""
    import re

    from zarrckpt.tools import cli

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512)).square().mean().backward()
    optim.step()
    with zarrckpt.CheckpointManager(tmp_path / "run1") as mgr:
        mgr.save(300, {"model": model.state_dict(), "optim": optim.state_dict()})
    path = tmp_path / "run1" / "step_00000300"
    counts = r"(\d+ arrays, \d+ chunks, [\d.]+ [KMG]?i?B) read in [\d.]+ s"
    assert cli.main(["verify", str(path), "-q"]) == 0
    real = re.search(counts, capsys.readouterr().out)[1]
    readme = _readme()
    shown = re.search(r"\$ zarrckpt verify ckpt/run1/step_00000300\nok: ckpt/run1/step_00000300: " + counts, readme)
    assert shown and shown[1] == real, (shown and shown[1], real)
    assert f"{real.split(',')[0]}, " in readme[readme.index("$ zarrckpt info ckpt/run1/step_00000300"):]
    (path / "model" / "0.bias" / "c" / "0").unlink()  # the damaged/ example: one chunk fewer
    assert cli.main(["verify", str(path), "-q"]) == 1
    real = re.search(r"FAILED: .*: 1 problem in 1 array \(" + counts, capsys.readouterr().out)[1]
    shown = re.search(r"FAILED: damaged/: 2 problems in 2 arrays \(" + counts, readme)
    assert shown and shown[1] == real, (shown and shown[1], real)
