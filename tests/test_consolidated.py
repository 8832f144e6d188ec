"""Format 1.2's consolidated metadata (spec §6.7; issue 16 item 2): the root lists every array
and group in zarr-python's form, generic readers list and open the whole checkpoint from it,
and a zarrckpt load reads one metadata document: the root."""

from __future__ import annotations

import glob
import json
import os
import warnings

import pytest
import torch

from _v11 import reseal_root

import zarrckpt
import zarrckpt.inspect
from zarrckpt.format import documents as fmt
from zarrckpt.storage import FaultStorage

zarr = pytest.importorskip("zarr")


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"layers.0": {"w": torch.randn(64, 32, generator=g).bfloat16(), "b": torch.ones(32)},
                      "head": torch.randn(1000, 64, generator=g)},
            "optim": {"state": {0: {"exp_avg": torch.zeros(64, 32)}}, "param_groups": [{"lr": 0.1}]},
            "step": 3, "rng": b"abc"}


def members(path) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr-python: consolidated metadata is not in the v3 spec yet
        g = zarr.open_group(str(path), mode="r", use_consolidated=True)
        return sorted(k for k, _ in g.members(max_depth=None))


def drop_node_documents(path) -> int:
    files = [f for f in glob.glob(f"{path}/**/zarr.json", recursive=True) if f != f"{path}/zarr.json"]
    for f in files:
        os.remove(f)
    return len(files)


@pytest.mark.parametrize("pack_bytes", [0, 1 << 20], ids=["unpacked", "packed"])
def test_root_lists_every_array_and_group(tmp_path, pack_bytes):
    path = tmp_path / "c"
    zarrckpt.save(state(), path, pack_bytes=pack_bytes)
    root = json.loads((path / "zarr.json").read_bytes())
    cm = root["consolidated_metadata"]
    assert cm["kind"] == "inline" and cm["must_understand"] is False
    arrays = set(root["attributes"]["zarrckpt"]["digests"]["arrays"])
    assert set(cm["metadata"]) == arrays | set(fmt.group_paths(arrays))
    assert list(cm["metadata"]) == sorted(cm["metadata"])
    for p in arrays:  # each entry is the array's own document, as stored
        assert cm["metadata"][p] == json.loads((path / p / "zarr.json").read_bytes())
    assert members(path) == sorted(cm["metadata"])


def test_zarr_python_lists_and_reads_from_the_root_alone(tmp_path):
    path = tmp_path / "c"
    zarrckpt.save(state(), path, pack_bytes=0)
    want = members(path)
    assert drop_node_documents(path) > 5
    assert members(path) == want  # listed from the root's one document
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = zarr.open_group(str(path), mode="r", use_consolidated=True)
        assert (g["model/head"][:] == state()["model"]["head"].numpy()).all()


def test_a_load_reads_one_metadata_document(tmp_path):
    """One document read, the root's; no array zarr.json. (The root is also re-checked by
    conditional requests, which move no bytes while it is unchanged: spec §7.3.)"""
    store = FaultStorage()
    zarrckpt.save(state(), store, pack_bytes=0)
    before, n = store.counts.copy(), len(store.events)
    target = state()
    for t in (target["model"]["head"], target["model"]["layers.0"]["b"]):
        t.zero_()
    zarrckpt.load(target, store)
    events = store.events[n:]
    documents = [e.key for e in events if e.key.endswith("zarr.json") and e.op in ("read_bytes", "get")]
    assert documents == ["zarr.json"], documents
    assert {e.key for e in events if e.op == "read_if_changed"} == {"zarr.json"}
    assert store.counts["get"] == before["get"]
    assert torch.equal(target["model"]["head"], state()["model"]["head"])


def test_zarrckpt_reads_without_the_node_documents(tmp_path):
    path = tmp_path / "c"
    zarrckpt.save(state(), path)
    drop_node_documents(path)
    got = zarrckpt.load_state_dict(path)
    assert torch.equal(got["model"]["head"], state()["model"]["head"])
    assert torch.equal(got["model"]["layers.0"]["w"], state()["model"]["layers.0"]["w"])
    ck = zarrckpt.open(path)
    assert ck["model/head"][:2, :3].shape == (2, 3)
    report = zarrckpt.inspect.verify(path)  # verify still checks the documents generic readers need
    assert not report.ok and {p.kind for p in report.problems} == {"missing"}


_rewrite_root = reseal_root  # a consistent forgery: the root's digest matches again


def test_verify_reports_an_array_document_that_differs_from_its_entry(tmp_path):
    path = tmp_path / "c"
    zarrckpt.save(state(), path, pack_bytes=0)
    _rewrite_root(path, lambda d: d["consolidated_metadata"]["metadata"]["model/head"].update(
        dimension_names=["x", "y"]))
    assert zarrckpt.open(path)["model/head"].dimension_names == ("x", "y")  # the reader used the entry
    report = zarrckpt.inspect.verify(path)
    assert [(p.kind, p.array) for p in report.problems] == [("metadata", "model/head")]
    assert "consolidated" in report.problems[0].message


@pytest.mark.parametrize("change, match", [
    (lambda d: d.pop("consolidated_metadata"), "must carry consolidated_metadata"),
    (lambda d: d["consolidated_metadata"]["metadata"].pop("model/head"), "missing"),
    (lambda d: d["consolidated_metadata"]["metadata"].update({"extra": {"zarr_format": 3, "node_type": "group"}}),
     "not in the tree"),
    (lambda d: d["consolidated_metadata"].update(kind="external"), "inline"),
    (lambda d: d["consolidated_metadata"].update(must_understand=True), "must_understand"),
    (lambda d: d["consolidated_metadata"]["metadata"]["model"].update(node_type="array"), "group document"),
    (lambda d: d["consolidated_metadata"]["metadata"]["model/head"].update(shape=[7]), "model/head"),
])
def test_a_bad_consolidated_member_is_refused(tmp_path, change, match):
    path = tmp_path / "c"
    zarrckpt.save(state(), path, pack_bytes=0)
    _rewrite_root(path, change)
    with pytest.raises(zarrckpt.FormatError, match=match):
        zarrckpt.load_state_dict(path)


def test_an_edited_entry_without_a_new_digest_is_refused(tmp_path):
    path = tmp_path / "c"
    zarrckpt.save(state(), path, pack_bytes=0)
    data = (path / "zarr.json").read_bytes().replace(b'"dimension_names":["head.0"', b'"dimension_names":["head.X"')
    (path / "zarr.json").write_bytes(data)
    with pytest.raises(zarrckpt.IntegrityError):
        zarrckpt.open(path)
