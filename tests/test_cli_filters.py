"""``zarrckpt`` key filters, option order, ``ls`` steps, JSON text and the typed info
report (issue 18, items 2 and 9): a ``-k`` pattern that selects nothing is an error with a
did-you-mean, in the command and in :mod:`zarrckpt.inspect`; options may come before or
after the paths; ``ls`` shows a ``step_<N>`` directory's step; ``to_json`` returns text;
``convert``'s refusal names ``--overwrite``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.tools import inspect as zi
from zarrckpt.errors import MissingKeysError
from test_cli import run, write  # noqa: E402 - tests/ is on sys.path (conftest)


def small_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)},
            "optim": {"m": torch.zeros(4)},
            "step": 7}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints that differ in ``model/w`` only."""
    base = tmp_path_factory.mktemp("filters")
    a, b = base / "a", base / "b"
    zarrckpt.save(small_state(), a)
    other = small_state()
    other["model"]["w"] = other["model"]["w"] + 1
    zarrckpt.save(other, b)
    return a, b


# ------------------------------------------------------------------ a filter that selects nothing


def one_line_error(code: int, out: str, err: str, command: str) -> str:
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith(f"zarrckpt {command}: error: "), err
    return err


@pytest.mark.parametrize("command", ["info", "diff", "stats"])
def test_a_key_pattern_selecting_nothing_is_an_error(ckpts, capsys, command):
    a, b = ckpts
    paths = [a, b] if command == "diff" else [a]
    for pattern in ("modle", "modle/*.w"):
        err = one_line_error(*run(capsys, command, *paths, "-k", pattern), command)
        noun = "array" if command == "stats" else "key"
        assert f"{pattern!r} selects no {noun} of {a}" in err and "did you mean 'model" in err, err
    # one good and one bad pattern: the bad one is named
    err = one_line_error(*run(capsys, command, *paths, "-k", "model", "-k", "optm"), command)
    assert "'optm'" in err and "'model'" not in err.split("did you mean")[0] and "'optim'" in err, err
    # nothing close: the top-level keys are listed instead
    err = one_line_error(*run(capsys, command, *paths, "-k", "zzzzzz"), command)
    assert "top-level keys: model, optim" in err, err


def test_stats_pattern_selecting_only_values_is_an_error(ckpts, capsys):
    err = one_line_error(*run(capsys, "stats", ckpts[0], "-k", "step"), "stats")
    assert "'step' selects no array" in err, err


@pytest.mark.parametrize("keys", [["modle/="], ["modle/"], ["model/", "optm/=o/"]])
def test_convert_key_filter_selecting_nothing_writes_nothing(ckpts, tmp_path, capsys, keys):
    dst = tmp_path / "out.safetensors"
    args = [a for k in keys for a in ("-k", k)]
    err = one_line_error(*run(capsys, "convert", ckpts[0], dst, *args), "convert")
    bad = next(k.split("=")[0] for k in keys if not k.startswith("model/"))
    assert f"{bad!r} selects no key" in err and "did you mean" in err, err
    assert not dst.exists()


@pytest.mark.parametrize("source", ["m.safetensors", "m.pt", "dcp_dir"])
def test_convert_key_filter_checked_against_every_source_format(ckpts, tmp_path, capsys, source):
    src = tmp_path / source
    to = {"m.safetensors": "safetensors", "m.pt": "torch_save", "dcp_dir": "dcp"}[source]
    assert run(capsys, "convert", ckpts[0], src, "--to", to)[0] == 0
    err = one_line_error(*run(capsys, "convert", src, tmp_path / "out", "-k", "modle"), "convert")
    assert f"'modle' selects no key of {src}" in err and "did you mean 'model" in err, err
    assert not (tmp_path / "out").exists()
    prefix = "model." if to == "safetensors" else "model/"  # safetensors names are flat
    code, out, err = run(capsys, "convert", src, tmp_path / "out", "-k", prefix, "--json")
    assert code == 0 and json.loads(out)["leaves"] == 2, err


def test_inspect_functions_raise_missing_keys(ckpts):
    a, b = ckpts
    for call in (lambda: zi.info(a, keys="modle"), lambda: zi.diff(a, b, keys=["modle"]),
                 lambda: zi.stats(a, keys="modle/*")):
        with pytest.raises(MissingKeysError, match=r"'modle.*' selects no (key|array) of .*did you mean 'model"):
            call()
    with pytest.raises(KeyError):
        zi.info(a, keys=["model", "optim/x"])
    assert [leaf.key for leaf in zi.info(a, keys=["model/", "optim"]).leaves] == ["model/w", "model/b", "optim/m"]


def test_diff_pattern_matching_one_side_only_is_not_an_error(ckpts, tmp_path, capsys):
    c = tmp_path / "c"
    zarrckpt.save({"extra": torch.ones(2)}, c)
    code, out, _ = run(capsys, "diff", ckpts[0], c, "-k", "extra")
    assert code == 1 and "only in B: extra" in out


# ------------------------------------------------------------------ options before or after the paths


ORDERS = {
    "info": [["info", "-k", "model", "{a}"], ["info", "{a}", "-k", "model"], ["info", "--keys", "model", "{a}"]],
    "diff": [["diff", "-k", "model", "{a}", "{b}"], ["diff", "{a}", "{b}", "-k", "model"],
             ["diff", "{a}", "-k", "model", "{b}"]],
    "stats": [["stats", "-k", "model", "{a}", "{b}"], ["stats", "{a}", "{b}", "-k", "model"],
              ["stats", "{a}", "-k", "model", "{b}"]],
    "convert": [["convert", "-k", "model/", "--dtype", "float16", "{a}", "{out}"],
                ["convert", "{a}", "{out}", "-k", "model/", "--dtype", "float16"],
                ["convert", "{a}", "-k", "model/", "{out}", "--dtype", "float16"]],
}


@pytest.mark.parametrize("command,order", [(c, i) for c, orders in ORDERS.items() for i in range(len(orders))])
def test_options_before_or_after_the_paths(ckpts, tmp_path, capsys, command, order):
    a, b = ckpts
    out_path = tmp_path / "out.safetensors"
    args = [x.format(a=a, b=b, out=out_path) for x in ORDERS[command][order]]
    code, out, err = run(capsys, *args, "--json")
    assert err == "", err
    doc = json.loads(out)
    if command == "info":
        assert code == 0 and [leaf["key"] for leaf in doc["leaves"]] == ["model/w", "model/b"]
    elif command == "diff":
        assert code == 1 and doc["a"].endswith("/a") and doc["b"].endswith("/b")
        assert [d["key"] for d in doc["leaves"]] == ["model/w", "model/b"]
    elif command == "stats":
        assert code == 0 and [c["url"][-1] for c in doc["checkpoints"]] == ["a", "b"]
        assert all([t["key"] for t in c["tensors"]] == ["model/w", "model/b"] for c in doc["checkpoints"])
    else:
        from safetensors.numpy import load_file

        assert code == 0 and doc["leaves"] == 2
        assert {k: v.dtype for k, v in load_file(out_path).items()} == {"model.w": np.float16,
                                                                         "model.b": np.float16}


def test_several_patterns_are_several_flags(ckpts, capsys):
    code, out, _ = run(capsys, "info", "-k", "model/w", "--keys", "optim", ckpts[0], "--json")
    assert code == 0 and [leaf["key"] for leaf in json.loads(out)["leaves"]] == ["model/w", "optim/m"]


# ------------------------------------------------------------------ ls: the step of a step_<N> directory


def test_ls_shows_the_step_of_a_step_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write(run_dir / "step_1000", {"w": np.zeros(2, np.float32)}, {"step": 999})  # a leaf "step" that differs
    write(run_dir / "step_2000", {"w": np.zeros(2, np.float32)}, {"step": 2000})
    write(run_dir / "final", {"w": np.zeros(2, np.float32)}, {"step": 3000})  # not a step directory
    code, out, _ = run(capsys, "ls", run_dir)
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:4]]
    assert [(r[0], r[-1].rsplit("/", 1)[-1]) for r in rows] == [("1000", "step_1000"), ("2000", "step_2000"),
                                                                 ("3000", "final")]
    assert "step_1000: saved step 999" in out and "step_2000: saved" not in out
    doc = {x["name"]: x for x in json.loads(run(capsys, "ls", run_dir, "--json")[1])["checkpoints"]}
    assert (doc["step_1000"]["step"], doc["step_1000"]["saved_step"]) == (1000, 999)
    assert (doc["final"]["step"], doc["final"]["saved_step"]) == (3000, 3000)
    assert [x.step for x in zi.ls(run_dir)] == [1000, 2000, 3000]
    assert [c.step for c in zi.stats(run_dir)] == [1000, 2000, 3000]


# ------------------------------------------------------------------ JSON text, the typed info report


def test_to_json_returns_text_the_cli_prints(ckpts, capsys):
    a, b = ckpts
    for cli_args, result in ((["info", a], zi.info(a)), (["diff", a, b], zi.diff(a, b)), (["ls", a], zi.ls(a))):
        text = zi.to_json(result)
        assert isinstance(text, str)
        printed = json.loads(run(capsys, *cli_args, "--json")[1])
        if cli_args[0] == "ls":  # {"checkpoints": zi.ls(...), "leftovers": zi.leftovers(...)}
            assert printed["leftovers"] == json.loads(zi.to_json(zi.leftovers(a)))
            printed = printed["checkpoints"]
        got = json.loads(text)
        if cli_args[0] == "info":
            assert got == printed
        else:
            assert got.keys() == printed.keys() if isinstance(got, dict) else len(got) == len(printed)
    rep = zi.diff(a, b)
    assert json.loads(rep.to_json()) == rep.as_dict() == json.loads(zi.to_json(rep))
    assert json.loads(zi.to_json({"x": float("nan"), "y": (1, 2)})) == {"x": "nan", "y": [1, 2]}


def test_info_report_is_typed(ckpts):
    ci = zi.info(ckpts[0])
    assert isinstance(ci, zi.CheckpointInfo) and ci.state == "committed" and ci.step == 7
    assert all(isinstance(leaf, zi.LeafInfo) for leaf in ci.leaves) and ci.meshes == []
    d = ci.as_dict()
    assert d["num_keys"] == 4 and d["leaves"][0] == {**d["leaves"][0], "key": "model/w", "shape": [6, 4]}
    assert json.loads(ci.to_json()) == d
    mesh = zi.MeshInfo((2, 4), ("dp", "tp"))
    assert str(mesh) == "(dp=2, tp=4)" and zi.to_dict(mesh) == {"shape": [2, 4], "dim_names": ["dp", "tp"]}
    assert str(zi.MeshInfo((3,))) == "(3)"


# ------------------------------------------------------------------ convert: the flag, not the argument


def test_convert_refusal_names_the_flag(ckpts, tmp_path, capsys):
    dst = tmp_path / "m.safetensors"
    assert run(capsys, "convert", ckpts[0], dst)[0] == 0
    err = one_line_error(*run(capsys, "convert", ckpts[0], dst), "convert")
    assert "--overwrite" in err and "overwrite=True" not in err, err
    assert run(capsys, "convert", ckpts[0], dst, "--overwrite")[0] == 0
    back = tmp_path / "back"
    assert run(capsys, "convert", dst, back)[0] == 0
    err = one_line_error(*run(capsys, "convert", dst, back), "convert")
    assert "--overwrite" in err and "overwrite=True" not in err, err
