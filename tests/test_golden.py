"""Golden checkpoints: every format version zarrckpt ever wrote stays readable, bit for bit.

``tests/golden/v<version>/`` holds small checkpoints written by that version (by
``tests/make_golden.py``) and ``manifest.json``, the state each one holds, described by
``make_golden.describe`` (array leaves by data type, shape and SHA-256 of their bytes). Each
checkpoint is read through ``load_state_dict``, ``load`` into preallocated targets,
``zarrckpt.open`` key by key, and zarr-python alone, and its documents are validated against
the JSON Schema (a 1.y schema accepts every 1.x document, x <= y).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zarrckpt
from make_golden import describe, leaf_bytes
from test_spec import assert_valid, spec_leaves, spec_numpy_dtype
from zarrckpt.format import dtypes as zdtypes

GOLDEN = Path(__file__).resolve().parent / "golden"
MANIFESTS = {d.name: json.loads((d / "manifest.json").read_text(encoding="utf-8"))
             for d in sorted(GOLDEN.iterdir()) if (d / "manifest.json").is_file()}
CASES = [(v, name) for v, m in MANIFESTS.items() for name in m["checkpoints"]]
IDS = [f"{v}-{name}" for v, name in CASES]


def golden(version: str, name: str) -> tuple[Path, dict]:
    return GOLDEN / version / name, MANIFESTS[version]["checkpoints"][name]["expected"]


def test_golden_files_exist():
    assert "v1.0" in MANIFESTS
    assert len(MANIFESTS["v1.0"]["checkpoints"]) >= 7


def flat_expected(node: dict, path: tuple = ()) -> dict[tuple, dict]:
    """Leaves of a description, keyed by key path, as a reader lists them (spec §6.3)."""
    if "leaf" not in node:
        ((kind, body),) = node.items()
        if kind == "dict" and body:
            return {p: v for k, sub in body for p, v in flat_expected(sub, path + (k,)).items()}
        if kind in ("list", "tuple") and body:
            return {p: v for i, sub in enumerate(body) for p, v in flat_expected(sub, path + (i,)).items()}
    return {path: node}


def same_array(got: Any, want: dict, where: str) -> None:
    _, data_type, shape, raw = leaf_bytes(got)
    assert (data_type, shape) == (want["data_type"], want["shape"]), where
    assert hashlib.sha256(raw).hexdigest() == want["sha256"], f"{where}: bytes differ"


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_load_state_dict_bit_for_bit(version, name):
    path, expected = golden(version, name)
    assert describe(zarrckpt.load_state_dict(path)) == expected


def build_target(node: dict) -> Any:
    """A state dict shaped like the description, tensors zeroed, values None."""
    if "leaf" in node:
        if node["leaf"] == "tensor":
            return torch.zeros(node["shape"], dtype=zdtypes.torch_dtype(zdtypes.by_zarr(node["data_type"])))
        return None  # ndarray / bytes: load sets the value
    ((kind, body),) = node.items()
    if kind == "dict":
        return {k: build_target(v) for k, v in body}
    if kind == "list":
        return [build_target(v) for v in body]
    if kind == "tuple":
        return tuple(build_target(v) for v in body)
    return None


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_load_in_place_bit_for_bit(version, name):
    path, expected = golden(version, name)
    target = build_target(expected)
    zarrckpt.load(target, path)
    assert describe(target) == expected


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_open_reads_every_key(version, name):
    path, expected = golden(version, name)
    from zarrckpt.format.tree import key_of

    ckpt = zarrckpt.open(path)
    want = {key_of(p): v for p, v in flat_expected(expected).items()}
    assert sorted(ckpt.keys()) == sorted(want)
    for key, node in want.items():
        got = ckpt.read(key)
        if "leaf" in node:
            assert ckpt.is_array(key), key
            same_array(got, node, key)
        else:
            assert describe(got) == node, key


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_zarr_python_reads_every_array(version, name):
    """Arrays of their own and packed leaves, read with zarr-python alone (spec Appendix B)."""
    import zarr

    from zarrckpt.interop.zarr_dtypes import register

    register()
    path, expected = golden(version, name)
    root = json.loads((path / "zarr.json").read_text(encoding="utf-8"))["attributes"]["zarrckpt"]
    want = flat_expected(expected)
    packs: dict[str, np.ndarray] = {}
    for kp, node in spec_leaves(root["tree"]):
        if "array" in node:
            a = zarr.open_array(path / node["array"], mode="r")
            data = a[...]
            got = data.tobytes() if a.attrs["zarrckpt"]["kind"] == "bytes" else np.asarray(data)
        elif "packed" in node:
            d = node["packed"]
            if d["pack"] not in packs:
                packs[d["pack"]] = zarr.open_array(path / d["pack"], mode="r")[...]
            raw = packs[d["pack"]][d["offset"]:d["offset"] + d["nbytes"]]
            got = raw.tobytes() if d["kind"] == "bytes" else raw.view(spec_numpy_dtype(d["data_type"])).reshape(d["shape"])
        else:
            continue
        same_array(got, want[kp], str(kp))


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_documents_follow_schema(version, name):
    path, _ = golden(version, name)
    for dirpath, _, files in os.walk(path):
        if "zarr.json" not in files:
            continue
        doc = json.loads(Path(dirpath, "zarr.json").read_text(encoding="utf-8"))
        rel = os.path.relpath(dirpath, path)
        if rel == ".":
            assert_valid("rootDocument", doc, f"{name} root")
        elif doc["node_type"] == "array":
            assert_valid("arrayDocument", doc, f"{name}/{rel}")
        else:
            assert_valid("groupDocument", doc, f"{name}/{rel}")


def test_edge_shard_inner_chunks_in_padding_are_absent():
    """Spec §5.3: an inner chunk wholly in the padding of an edge shard is not stored (index
    entry 2^64-1 twice); the golden 4-rank save has one, and every reader above read it."""
    shard = (GOLDEN / "v1.0" / "four_ranks_dtensor" / "edge_padding" / "c" / "3" / "0").read_bytes()
    index = np.frombuffer(shard[-(3 * 16 + 4):-4], dtype="<u8").reshape(3, 2)
    assert index[0].tolist() == [0, 12]
    assert (index[1:] == 2**64 - 1).all()


def test_golden_copy_still_reads_after_move(tmp_path):
    """Golden files carry no absolute path: a copy elsewhere reads the same."""
    src, expected = golden("v1.0", "one_packed")
    shutil.copytree(src, tmp_path / "copy")
    assert describe(zarrckpt.load_state_dict(tmp_path / "copy")) == expected
