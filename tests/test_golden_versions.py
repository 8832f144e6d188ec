"""Golden checkpoints of formats 1.1, 1.2 and 1.3 (``tests/golden/v1.1``, ``v1.2``, ``v1.3``, written by
``tests/make_golden.py``): what each version brought is in them, and a damaged copy is refused.

``tests/test_golden.py`` reads every golden version bit for bit against its ``manifest.json``
(``load_state_dict``, ``load`` in place, ``zarrckpt.open`` key by key, zarr-python alone, the
JSON Schema); ``tests/test_generic_readers.py`` reads them with TensorStore and zarr-python.
This file checks that the files cover every kind of leaf and the features of their version
(so that those reads mean something), reads 1.2's arrays through zarr-python's consolidated
metadata, and damages copies: one flipped chunk byte, one edited ``zarr.json``.
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

import zarrckpt
from make_golden import DATA_TYPES
from test_spec import spec_leaves
from zarrckpt import errors

GOLDEN = Path(__file__).resolve().parent / "golden"
NEW = ["v1.1", "v1.2", "v1.3"]
SIZE_LIMIT = 200_000  # bytes per version, manifest included


def manifest(version: str) -> dict:
    return json.loads((GOLDEN / version / "manifest.json").read_text(encoding="utf-8"))


def documents(path: Path) -> dict[str, dict]:
    """Every zarr.json of a checkpoint, by its node's path ('' for the root)."""
    out = {}
    for dirpath, _, files in os.walk(path):
        if "zarr.json" in files:
            rel = os.path.relpath(dirpath, path)
            out["" if rel == "." else rel.replace(os.sep, "/")] = json.loads(
                Path(dirpath, "zarr.json").read_text(encoding="utf-8"))
    return out


def tree_kinds(node: Any, found: set[str]) -> set[str]:
    ((kind, body),) = node.items()
    found.add(kind)
    if kind == "dict":
        for _, sub in body:
            tree_kinds(sub, found)
    elif kind in ("list", "tuple"):
        for sub in body:
            tree_kinds(sub, found)
    return found


def expected_by_key_path(node: dict, path: tuple = ()) -> dict[tuple, dict]:
    if "leaf" in node:
        return {path: node}
    ((kind, body),) = node.items()
    out: dict[tuple, dict] = {}
    if kind == "dict":
        for k, sub in body:
            out.update(expected_by_key_path(sub, path + (k,)))
    elif kind in ("list", "tuple"):
        for i, sub in enumerate(body):
            out.update(expected_by_key_path(sub, path + (i,)))
    return out


# ------------------------------------------------------------------ what the files hold


def test_new_versions_are_there_and_small():
    for version in NEW:
        m = manifest(version)
        assert m["format_version"] == version[1:]
        assert len(m["checkpoints"]) == 4
        for name in m["checkpoints"]:
            root = json.loads((GOLDEN / version / name / "zarr.json").read_bytes())
            assert root["attributes"]["zarrckpt"]["version"] == version[1:], name
            assert root["attributes"]["zarrckpt"]["state"] == "committed", name
        total = sum(f.stat().st_size for f in (GOLDEN / version).rglob("*") if f.is_file())
        assert total < SIZE_LIMIT, f"{version}: {total} bytes"


@pytest.mark.parametrize("version", NEW)
def test_every_kind_and_data_type_is_covered(version):
    kinds, packed_kinds, data_types, nodes = set(), set(), set(), set()
    zero_d, codecs = set(), set()
    for name, entry in manifest(version)["checkpoints"].items():
        docs = documents(GOLDEN / version / name)
        attrs = docs[""]["attributes"]["zarrckpt"]
        tree_kinds(attrs["tree"], nodes)
        assert attrs.get("metadata") == entry.get("metadata"), name  # §6.1, since 1.1
        for _, node in spec_leaves(attrs["tree"]):
            if "packed" in node:
                packed_kinds.add(node["packed"]["kind"])
        for path, doc in docs.items():
            if doc["node_type"] != "array":
                continue
            kind = doc["attributes"]["zarrckpt"]["kind"]
            kinds.add(kind)
            data_types.add((kind, doc["data_type"]))
            if doc["shape"] == []:
                zero_d.add(kind)
            chain = doc["codecs"][0]["configuration"]["codecs"] if doc["codecs"][0]["name"] == "sharding_indexed" \
                else doc["codecs"]
            codecs.update(c["name"] for c in [*doc["codecs"], *chain])
    assert kinds == {"tensor", "dtensor", "sharded_tensor", "ndarray", "bytes", "bytesio", "pack"}
    assert packed_kinds == {"tensor", "ndarray", "bytes", "bytesio"}
    assert nodes == {"dict", "list", "tuple", "array", "packed", "json", "float"}
    assert {dt for kind, dt in data_types if kind == "tensor"} == set(DATA_TYPES)
    assert {("dtensor", "bfloat16"), ("dtensor", "float8_e4m3fn"), ("ndarray", "bfloat16")} <= data_types
    assert {"tensor", "dtensor", "ndarray"} <= zero_d
    assert {"bytes", "crc32c", "sharding_indexed"} <= codecs
    assert codecs & {"zstd", "gzip"}


def test_1_1_roots_have_digests_and_no_consolidated_metadata():
    for name in manifest("v1.1")["checkpoints"]:
        root = json.loads((GOLDEN / "v1.1" / name / "zarr.json").read_bytes())
        assert "consolidated_metadata" not in root, name   # §6.7: from 1.2
        assert root["attributes"]["zarrckpt"]["digests"]["algorithm"] == "sha256", name  # §6.6: from 1.1
    # 1.1's writer packed by default (C.3): its default checkpoint holds a pack
    assert (GOLDEN / "v1.1" / "one_packed" / ".packs" / "0" / "zarr.json").is_file()


def test_1_2_consolidated_metadata_lists_every_node_as_stored():
    """§6.7: every array and intermediate group below the root, each equal to its zarr.json."""
    for name in manifest("v1.2")["checkpoints"]:
        docs = documents(GOLDEN / "v1.2" / name)
        consolidated = docs.pop("")["consolidated_metadata"]
        assert consolidated["kind"] == "inline" and consolidated["must_understand"] is False
        assert consolidated["metadata"] == docs, name
    assert not (GOLDEN / "v1.2" / "one_default" / ".packs").exists()  # 1.2 writers do not pack (§6.5)


def _chunk_shape(version: str, array: str) -> list[int]:
    doc = json.loads((GOLDEN / version / "four_ranks_dtensor" / array / "zarr.json").read_bytes())
    return doc["chunk_grid"]["configuration"]["chunk_shape"]


def test_1_3_roots_record_a_table_of_chunk_positions_for_every_array():
    """§6.6 (1.3): digests.chunks names every array, with 4 bytes per unit of its unit grid;
    roots before 1.3 have none."""
    import base64

    from zarrckpt.format import documents as fmt

    for name in manifest("v1.3")["checkpoints"]:
        root = json.loads((GOLDEN / "v1.3" / name / "zarr.json").read_bytes())
        attrs = root["attributes"]["zarrckpt"]
        assert attrs["version"] == "1.3"
        tables = attrs["digests"]["chunks"]
        assert set(tables) == set(attrs["digests"]["arrays"]), name
        for path, text in tables.items():
            doc = root["consolidated_metadata"]["metadata"][path]
            assert len(base64.b64decode(text, validate=True)) == 4 * int(np.prod(fmt.unit_grid(doc))), (name, path)
    for version in ("v1.1", "v1.2"):
        for name in manifest(version)["checkpoints"]:
            attrs = json.loads((GOLDEN / version / name / "zarr.json").read_bytes())["attributes"]["zarrckpt"]
            assert "chunks" not in attrs["digests"], (version, name)


def test_1_2_groups_shards_into_chunks():
    """C.1 step 3: with chunk_target_bytes the 1.2 writer's chunk holds several shards (cells);
    the 1.1 writer wrote one chunk per shard."""
    assert _chunk_shape("v1.1", "shard_shard") == [3, 2] and _chunk_shape("v1.2", "shard_shard") == [6, 4]
    assert _chunk_shape("v1.1", "st_rows") == [3, 6] and _chunk_shape("v1.2", "st_rows") == [9, 6]
    assert _chunk_shape("v1.1", "edge_padding") == [3, 2] and _chunk_shape("v1.2", "edge_padding") == [9, 2]


@pytest.mark.parametrize("version,shard,present", [("v1.1", "3/0", 1), ("v1.2", "1/0", 1)])
def test_inner_chunks_wholly_in_padding_are_absent(version, shard, present):
    """§5.3: the last shard of edge_padding (10 rows) holds row 9 only; the inner chunks (one row
    each) past row 9 are not stored: index entries 2**64 - 1 twice."""
    data = (GOLDEN / version / "four_ranks_dtensor" / "edge_padding" / "c" / shard).read_bytes()
    rows = _chunk_shape(version, "edge_padding")[0]
    index = np.frombuffer(data[-(rows * 16 + 4):-4], dtype="<u8").reshape(rows, 2)
    assert (index[:present] != 2**64 - 1).all()
    assert (index[present:] == 2**64 - 1).all()


def test_zarr_python_reads_1_2_arrays_through_consolidated_metadata():
    """zarr-python opens the group from the root alone (§6.7) and reads every array leaf."""
    import zarr

    from zarrckpt.interop.zarr_dtypes import register

    register()
    for name, entry in manifest("v1.2")["checkpoints"].items():
        path = GOLDEN / "v1.2" / name
        group = zarr.open_group(path, mode="r", use_consolidated=True)
        want = expected_by_key_path(entry["expected"])
        root = json.loads((path / "zarr.json").read_bytes())["attributes"]["zarrckpt"]
        seen = 0
        for kp, node in spec_leaves(root["tree"]):
            if "array" not in node:
                continue
            a = group[node["array"]]
            data = np.asarray(a[...])
            raw = data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes()
            assert (list(data.shape), hashlib.sha256(raw).hexdigest()) == \
                (want[kp]["shape"], want[kp]["sha256"]), (name, kp)
            seen += 1
        assert seen == root["num_arrays"] - sum(1 for k in root["digests"]["arrays"] if k.startswith(".packs/"))


# ------------------------------------------------------------------ damaged copies


DEFAULT = {"v1.1": "one_unpacked", "v1.2": "one_default", "v1.3": "one_default"}


def _copy(tmp_path: Path, version: str, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(GOLDEN / version / name, dst)
    return dst


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("version", NEW)
@pytest.mark.parametrize("name,chunk", [("one", "model/layer.weight/c/0/0"),
                                        ("four_ranks_dtensor", "shard_shard/c/0/0"),
                                        ("four_ranks_stages", "shared/c/0")])
def test_a_flipped_chunk_byte_is_refused(tmp_path, version, name, chunk):
    """§5.3/§5.5: the CRC-32C (or the zstd/gzip frame) of the chunk fails; the load fails, and
    reads of other arrays still work."""
    name = DEFAULT[version] if name == "one" else name
    path = _copy(tmp_path, version, name)
    _flip(path / chunk)
    array = chunk.split("/c/")[0]
    with pytest.raises(errors.CorruptChunkError):
        zarrckpt.load_state_dict(path)
    ckpt = zarrckpt.open(path)
    with pytest.raises(errors.CorruptChunkError):
        ckpt.read(array)
    other = next(k for k in ckpt.keys() if ckpt.is_array(k) and k != array)
    ckpt.read(other)


@pytest.mark.parametrize("version", NEW)
def test_an_edited_root_is_refused(tmp_path, version):
    """§6.6: any change to the root's bytes (here a re-indented document, same JSON) breaks its digest."""
    path = _copy(tmp_path, version, DEFAULT[version])
    doc = json.loads((path / "zarr.json").read_bytes())
    (path / "zarr.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    with pytest.raises(errors.IntegrityError):
        zarrckpt.load_state_dict(path)
    with pytest.raises(errors.IntegrityError):
        zarrckpt.open(path)


@pytest.mark.parametrize("version", NEW)
def test_an_edited_array_document_is_refused(tmp_path, version):
    """§6.6: an array zarr.json whose bytes differ from its digest. A 1.1 reader checks it before
    parsing it; a 1.2 reader takes the array's metadata from the root (§6.7) and need not read
    it, and zarrckpt verify compares it with its consolidated entry and its digest."""
    path = _copy(tmp_path, version, DEFAULT[version])
    doc_path = path / "model" / "layer.weight" / "zarr.json"
    doc = json.loads(doc_path.read_bytes())
    doc["attributes"]["zarrckpt"]["torch_dtype"] = "float16"  # a plausible edit: still valid JSON
    doc["data_type"] = "float16"
    doc_path.write_text(json.dumps(doc), encoding="utf-8")
    if version == "v1.1":
        with pytest.raises(errors.IntegrityError, match="layer.weight"):
            zarrckpt.load_state_dict(path)
    else:
        expected = manifest(version)["checkpoints"][DEFAULT[version]]["expected"]
        from make_golden import describe

        assert describe(zarrckpt.load_state_dict(path)) == expected  # the root's entry, not the file
    from zarrckpt.readers.verify import verify

    report = verify(path)
    assert not report.ok and any("layer.weight" in json.dumps(p.__dict__ if hasattr(p, "__dict__") else str(p))
                                 for p in report.problems)
