"""spec/format.md and its JSON Schema twin, checked against what zarrckpt writes.

The checks walk the files on disk (never the library's reader) and re-derive the spec's rules
(escaping §4, chunk presence §5.3, chunk grid §5.4, inner chunks §5.5, tree §6) from the text
of the spec, so that a change in either the code or the spec that breaks the other fails here.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt import dtypes as zdtypes
from zarrckpt import format as zformat
from zarrckpt import layout as zlayout

jsonschema = pytest.importorskip("jsonschema")
from referencing import Registry, Resource  # noqa: E402  (ships with jsonschema >= 4.18)

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "spec" / "format.md"
SCHEMA_FILE = REPO / "spec" / "zarrckpt.schema.json"
PACKAGED_SCHEMA_FILE = REPO / "zarrckpt" / "schema" / "zarrckpt.schema.json"

SCHEMA = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
_REGISTRY = Registry().with_resource(SCHEMA["$id"], Resource.from_contents(SCHEMA))


def validator(definition: str | None = None) -> jsonschema.Draft202012Validator:
    """The whole schema, or one of its ``$defs``."""
    schema = SCHEMA if definition is None else {"$ref": f"{SCHEMA['$id']}#/$defs/{definition}"}
    return jsonschema.Draft202012Validator(
        schema, registry=_REGISTRY, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


def assert_valid(definition: str | None, doc: Any, where: str = "") -> None:
    errors = sorted(validator(definition).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, f"{where or definition}: " + "; ".join(
        f"at {'/'.join(map(str, e.absolute_path)) or '<top>'}: {e.message[:300]}" for e in errors
    )


def is_valid(definition: str | None, doc: Any) -> bool:
    return validator(definition).is_valid(doc)


# ------------------------------------------------------------------ the spec's rules, re-derived

_SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def spec_escape(component: str | int) -> str:
    """§4.2, written from the text of the spec (not from zarrckpt.tree)."""
    if isinstance(component, int):
        return str(component)
    if component == "":
        return "%"
    if component == "zarr.json":
        return "zarr%2Ejson"
    s = "".join(ch if ch in _SAFE else "".join(f"%{b:02X}" for b in ch.encode("utf-8")) for ch in component)
    if s.startswith("."):
        s = "%2E" + s[1:]
    elif s.startswith("__"):
        s = "%5F" + s[1:]
    return s


def spec_key(path: tuple) -> str:
    return "/".join(spec_escape(c) for c in path)


def spec_leaves(node: dict, path: tuple = ()):
    """§6.3: (key path, leaf node) of a stored tree."""
    ((kind, body),) = node.items()
    if kind in ("dict", "list", "tuple") and not body and path:
        yield path, node  # an empty container other than the root is a leaf
    elif kind == "dict":
        for k, v in body:
            yield from spec_leaves(v, path + (k,))
    elif kind in ("list", "tuple"):
        for i, v in enumerate(body):
            yield from spec_leaves(v, path + (i,))
    elif kind == "json" and isinstance(body, (dict, list)) and body:
        items = body.items() if isinstance(body, dict) else enumerate(body)
        for k, v in items:
            yield from spec_leaves({"json": v}, path + (k,))
    else:
        yield path, node


def spec_inner_chunk(chunk: list[int], itemsize: int, target: int) -> list[int] | None:
    """§5.5 inner chunk rule."""
    if not chunk or math.prod(chunk) * itemsize < 2 * target:
        return None

    def usable(n: int) -> int | None:
        if n < 2:
            return None
        p = next((p for p in range(2, math.isqrt(n) + 1) if n % p == 0), n)
        if p < n:
            return p
        return n if n <= 64 else None

    inner = list(chunk)
    while math.prod(inner) * itemsize > target:
        for d in sorted(range(len(inner)), key=lambda d: -inner[d]):
            f = usable(inner[d])
            if f:
                inner[d] //= f
                break
        else:
            break
    return None if inner == list(chunk) else inner


FILL_VALUES = {"bool": False, "complex64": [0.0, 0.0], "complex128": [0.0, 0.0], "float8_e8m0fnu": "NaN"}


# ------------------------------------------------------------------ reading a checkpoint off disk


def read_checkpoint_files(root: Path) -> dict[str, dict]:
    """``{relative dir ('' = root): zarr.json document}`` for every zarr.json on disk."""
    docs = {}
    for dirpath, _, files in os.walk(root):
        if "zarr.json" in files:
            rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
            with open(os.path.join(dirpath, "zarr.json"), encoding="utf-8") as f:
                text = f.read()
            for token in ("NaN", "Infinity"):
                assert not re.search(rf"(?<![\"\w]){token}(?![\"\w])", text), f"{rel}/zarr.json: bare {token}"
            docs["" if rel == "." else rel] = json.loads(text)
    return docs


def check_checkpoint(root: Path, *, inner_chunk_bytes: int = 1 << 20) -> dict[str, dict]:
    """Validate every document of a committed checkpoint against the schema and the spec's
    cross-document rules. Returns the documents."""
    docs = read_checkpoint_files(root)
    assert "" in docs, "no root zarr.json"
    root_doc = docs[""]
    assert_valid("rootDocument", root_doc, "root zarr.json")
    assert_valid(None, root_doc["attributes"]["zarrckpt"], "root attributes (top-level schema)")
    attrs = root_doc["attributes"]["zarrckpt"]
    assert attrs["state"] == "committed"

    leaves = list(spec_leaves(attrs["tree"]))
    array_nodes = {path: node["array"] for path, node in leaves if "array" in node}
    arrays = {rel: d for rel, d in docs.items() if d.get("node_type") == "array"}
    groups = {rel for rel, d in docs.items() if rel and d.get("node_type") == "group"}

    # §6.1 num_arrays, §6.2 array node value = key of its key path (§4.2, re-derived)
    assert attrs["num_arrays"] == len(array_nodes) == len(arrays)
    for path, apath in array_nodes.items():
        assert apath == spec_key(path), f"key path {path!r}: array node says {apath!r}"
    assert set(array_nodes.values()) == set(arrays)
    # §4.4: distinct leaves, distinct keys
    assert len({spec_key(p) for p, _ in leaves}) == len(leaves)
    # §6.4: intermediate groups are exactly the proper prefixes of array paths
    prefixes = {"/".join(a.split("/")[:i]) for a in arrays for i in range(1, a.count("/") + 1)}
    assert groups == prefixes
    for g in groups:
        assert_valid("groupDocument", docs[g], f"group {g!r}")

    for apath, doc in arrays.items():
        where = f"array {apath!r}"
        assert_valid("arrayDocument", doc, where)
        a = doc["attributes"]["zarrckpt"]
        assert_valid(None, a, where + " (top-level schema)")
        assert a["save_id"] == attrs["save_id"], where                      # §5.6
        assert a["torch_dtype"] == doc["data_type"], where                  # §5.6
        assert doc["fill_value"] == FILL_VALUES.get(doc["data_type"], 0), where  # §5.2
        leaf = apath.rsplit("/", 1)[-1]
        assert doc["dimension_names"] == [f"{leaf}.{d}" for d in range(len(doc["shape"]))], where
        if a["kind"] == "dtensor":
            assert len(a["placements"]) == len(a["mesh"]["shape"]), where
        if a["kind"] == "bytes":
            assert doc["data_type"] == "uint8" and len(doc["shape"]) == 1, where
        shape = doc["shape"]
        chunk = doc["chunk_grid"]["configuration"]["chunk_shape"]
        assert len(chunk) == len(shape), where
        # §5.5: sharded exactly when the inner chunk rule says so
        itemsize = zdtypes.by_zarr(doc["data_type"]).numpy.itemsize
        inner = spec_inner_chunk(chunk, itemsize, inner_chunk_bytes)
        codecs = doc["codecs"]
        if inner is None:
            assert codecs[0]["name"] == "bytes", where
        else:
            assert codecs[0]["name"] == "sharding_indexed", where
            assert codecs[0]["configuration"]["chunk_shape"] == inner, where
        # §5.3: every chunk of the grid is stored; nothing else is
        grid = [-(-s // c) for s, c in zip(shape, chunk)]
        expected = {"/".join(["c", *map(str, idx)]) for idx in np.ndindex(*grid)} if all(grid) or not shape else set()
        base = root / apath
        present = {
            os.path.relpath(os.path.join(dp, f), base).replace(os.sep, "/")
            for dp, _, fs in os.walk(base) for f in fs if f != "zarr.json"
        }
        assert present == expected, f"{where}: chunks {sorted(present)} != grid {sorted(expected)}"
    return docs


# ------------------------------------------------------------------ (a) real saves


def varied_state() -> dict:
    return {
        "model": {
            "layer.weight": torch.randn(64, 48),
            "layer/bias": torch.zeros(48, dtype=torch.bfloat16),
            "prime": torch.ones(67, dtype=torch.int64),
        },
        "optim": {
            "state": {
                0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(64, 48)},
                1: {"step": torch.tensor(1.0)},
            },
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.999)}],
        },
        "empty": torch.empty(0, 7),
        "fp8": torch.ones(8).to(torch.float8_e4m3fn),
        "e8m0": torch.ones(4).to(torch.float8_e8m0fnu),
        "flags": torch.tensor([True, False]),
        "cplx": torch.ones(3, dtype=torch.complex64),
        "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
        "rng": b"\x00\xffbytes",
        "unicode ü/é": torch.arange(3),
        "": torch.ones(1),
        ".hidden": torch.ones(1),
        "..": 2,
        "__reserved": torch.ones(2),
        "zarr.json": torch.ones(1),
        "50%": torch.ones(1),
        7: {"seven": torch.ones(1)},
        "values": {
            "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "none": None,
            "s": "text", "big": 2**70, "empty_dict": {}, "empty_list": [], "empty_tuple": (),
        },
        "plain": {"a": 1, "b": [1.5, "x", None], "c": {"d": True}},
        "mixed": [1, (2.5, float("nan")), {"k": torch.ones(1)}, b"\x01"],
    }


@pytest.mark.parametrize(
    "options",
    [{}, {"compression": "zstd", "inner_chunk_bytes": 256}, {"compression": {"name": "gzip", "level": 5}}],
    ids=["default", "zstd-sharded", "gzip"],
)
def test_saved_files_follow_schema_and_spec(tmp_path, options):
    zarrckpt.save(varied_state(), tmp_path / "ckpt", **options)
    docs = check_checkpoint(tmp_path / "ckpt", inner_chunk_bytes=options.get("inner_chunk_bytes", 1 << 20))
    arrays = {k: d for k, d in docs.items() if d.get("node_type") == "array"}
    # the escaping cases of §4.2 really reached storage
    for segment in ["%", "%2Ehidden", "%5F_reserved", "zarr%2Ejson", "50%25", "unicode%20%C3%BC%2F%C3%A9",
                    "model/layer%2Fbias", "7/seven", "mixed/2/k", "mixed/3", "optim/state/0/step"]:
        assert segment in arrays, f"{segment!r} not among {sorted(arrays)}"
    assert arrays["optim/state/0/step"]["shape"] == []                 # 0-d
    assert arrays["empty"]["chunk_grid"]["configuration"]["chunk_shape"] == [1, 7]  # §5.4 empty dim
    assert arrays["fp8"]["data_type"] == "float8_e4m3fn"               # §5.2, not float8_e4m3
    assert arrays["model/layer%2Fbias"]["data_type"] == "bfloat16"
    assert arrays["ids"]["attributes"]["zarrckpt"]["kind"] == "ndarray"
    assert arrays["rng"]["attributes"]["zarrckpt"]["kind"] == "bytes"
    if options.get("inner_chunk_bytes"):
        assert arrays["model/layer.weight"]["codecs"][0]["name"] == "sharding_indexed"
        assert arrays["model/prime"]["codecs"][0]["name"] == "bytes"   # prime extent > 64 stays whole
    # §6.2 the tree's typed keys and value nodes
    tree = docs[""]["attributes"]["zarrckpt"]["tree"]
    top = dict((json.dumps(k), v) for k, v in tree["dict"])
    assert top["7"] == {"dict": [["seven", {"array": "7/seven"}]]}     # integer key stays an integer
    assert top['"plain"'] == {"json": {"a": 1, "b": [1.5, "x", None], "c": {"d": True}}}
    values = dict(top['"values"']["dict"])
    assert values["nan"] == {"float": "nan"} and values["ninf"] == {"float": "-inf"}
    assert values["big"] == {"json": 2**70} and values["empty_tuple"] == {"tuple": []}
    assert top['"mixed"']["list"][1] == {"tuple": [{"json": 2.5}, {"float": "nan"}]}


def test_checkpoint_keys_are_the_spec_leaves(tmp_path):
    """§6.3: the keys a reader lists are the leaves of the stored tree."""
    zarrckpt.save(varied_state(), tmp_path / "ckpt")
    tree = read_checkpoint_files(tmp_path / "ckpt")[""]["attributes"]["zarrckpt"]["tree"]
    assert zarrckpt.open(tmp_path / "ckpt").keys() == [spec_key(p) for p, _ in spec_leaves(tree)]


def test_pending_root_follows_schema_and_is_refused(tmp_path, monkeypatch):
    """§7: a save that never reached its commit leaves a pending root that readers refuse."""
    from zarrckpt import _save

    monkeypatch.setattr(_save.SaveJob, "commit", lambda self, *args, **kwargs: None)
    zarrckpt.save({"w": torch.ones(3), "n": 1}, tmp_path / "ckpt")
    docs = read_checkpoint_files(tmp_path / "ckpt")
    assert_valid("rootDocument", docs[""])
    assert_valid("rootAttributesPending", docs[""]["attributes"]["zarrckpt"])
    assert not is_valid("rootAttributesCommitted", docs[""]["attributes"]["zarrckpt"])
    assert_valid("arrayDocument", docs["w"])
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.open(tmp_path / "ckpt")


@pytest.fixture
def world_of_one(tmp_path):
    """A one-process gloo group in this process, for real DTensors."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg_store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_attributes_follow_schema(tmp_path, world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh1 = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    mesh2 = init_device_mesh("cpu", (1, 1))
    state = {
        "shard": DTensor.from_local(torch.ones(6, 4), mesh1, [Shard(1)]),
        "repl": DTensor.from_local(torch.ones(3), mesh1, [Replicate()]),
        "strided": DTensor.from_local(torch.ones(8, 2), mesh2, [_StridedShard(0, split_factor=2), Shard(0)]),
    }
    zarrckpt.save(state, tmp_path / "ckpt")
    docs = check_checkpoint(tmp_path / "ckpt")
    attrs = {k: docs[k]["attributes"]["zarrckpt"] for k in state}
    assert attrs["shard"]["mesh"] == {"shape": [1], "dim_names": ["dp"], "device_type": "cpu"}
    assert attrs["shard"]["placements"] == [{"type": "shard", "dim": 1}]
    assert attrs["repl"]["placements"] == [{"type": "replicate"}]
    assert attrs["strided"]["mesh"]["dim_names"] is None
    assert attrs["strided"]["placements"] == [
        {"type": "strided_shard", "dim": 0, "split_factor": 2}, {"type": "shard", "dim": 0}]


def test_spec_placement_example():
    """§5.7's _StridedShard example, computed by the rule as the spec words it."""

    def chunk(seq, n, k):
        c = -(-len(seq) // n)
        return seq[min(k * c, len(seq)):min(k * c + c, len(seq))]

    def rows(dp, tp):
        idx = list(range(8))
        pieces = [chunk(idx, 2, i) for i in range(2)]                 # strided_shard, f = 2, n = 2
        idx = [x for p in pieces for x in chunk(p, 2, dp)]
        return chunk(idx, 2, tp)                                      # shard, n = 2

    assert [rows(0, 0), rows(0, 1), rows(1, 0), rows(1, 1)] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    runs = [zlayout.dim_runs(8, ((zlayout.StridedShard(0, 2), 2, a), (zlayout.Shard(0), 2, b)))
            for a in (0, 1) for b in (0, 1)]
    assert runs == [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]


def test_spec_writer_example():
    """§8.3's unaligned example and §8.2's writer rule, against zarrckpt.layout."""
    from zarrckpt.layout import Layout, Shard

    lay = Layout((9, 4), (2, 2), (Shard(0), Shard(0)), key="w")
    assert lay.chunk_shape == (3, 4) and lay.aligned == (False, True)
    writes = {c: [w.index for w in lay.save_plan(c)[0]] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert writes == {(0, 0): [(0, 0)], (0, 1): [(1, 0)], (1, 0): [], (1, 1): [(2, 0)]}
    sends = lay.save_plan((1, 0))[1]
    assert [(s.dst, s.box[0]) for s in sends] == [((0, 1), (5, 6)), ((1, 1), (6, 7))]


def spec_pick(h: int, index: tuple, grid: tuple, split: tuple[int, int] | None) -> int:
    """§8.2: the pick q of a chunk."""
    e, k = split if split else (-1, 1)
    lin = 0
    for d, (i, g) in enumerate(zip(index, grid)):
        if d == e:
            i, g = i // k, -(-g // k)
        lin = lin * g + i
    return h + k * lin + (index[e] % k if split else 0)


@pytest.mark.parametrize(
    "shape,mesh,placements,split_min,chunk",
    [
        ((8, 6), (4,), ("R",), 1, (2, 6)),            # plain tensor over 4 ranks, split 4 ways
        ((8, 6), (4,), ("R",), None, (8, 6)),         # no split: one writer for the whole array
        ((8, 6), (2, 2), ("R", "S1"), 1, (4, 3)),     # DDP x TP: each TP cell split over 2 replicas
        ((12, 6), (3, 2), ("S0", "R"), 1, (4, 3)),    # cells [4, 6]: the longer dim 1 is split 2 ways
        ((5, 4), (2,), ("S0",), 1, (3, 4)),           # no replicas: no split
    ],
)
def test_spec_writer_rule(shape, mesh, placements, split_min, chunk):
    """§5.4 chunk grid with replica split and §8.2 writer choice, against zarrckpt.layout:
    every chunk written exactly once, by the replica the spec names."""
    from zarrckpt.layout import Layout, Replicate, Shard

    parsed = [Replicate() if p == "R" else Shard(int(p[1:])) for p in placements]
    lay = Layout(shape, mesh, parsed, key="opt/x", replica_split_min_elems=split_min)
    assert lay.chunk_shape == chunk
    split = None
    for d, (c, s) in enumerate(zip(chunk, shape)):
        cell = max(r[1] - r[0] for r, _ in lay.partition(d))
        if c != cell:
            split = (d, cell // c)
    replica_dims = [j for j, p in enumerate(placements) if p == "R"]
    R = math.prod(mesh[j] for j in replica_dims)
    h = zlib.crc32(b"opt/x")
    written = []
    for coord in np.ndindex(*mesh):
        for w in lay.save_plan(tuple(coord))[0]:
            written.append(w.index)
            r = spec_pick(h, w.index, lay.grid_shape, split) % R
            expect = list(coord)
            for j in reversed(replica_dims):      # replica number in mixed radix, last dim fastest
                expect[j] = r % mesh[j]
                r //= mesh[j]
            assert tuple(coord) == tuple(expect), (w.index, coord, expect)
    assert sorted(written) == sorted(np.ndindex(*lay.grid_shape))
    if split:  # §8.2: the k chunks of one split cell are written by k different replicas
        e, k = split
        by_cell: dict[tuple, set] = {}
        for coord in np.ndindex(*mesh):
            for w in lay.save_plan(tuple(coord))[0]:
                cell = tuple(i // k if d == e else i for d, i in enumerate(w.index))
                by_cell.setdefault(cell, set()).add(coord)
        assert all(len(writers) == k for writers in by_cell.values()), by_cell


# ------------------------------------------------------------------ (b) the two schema copies


def test_schema_copies_are_identical():
    assert PACKAGED_SCHEMA_FILE.read_bytes() == SCHEMA_FILE.read_bytes(), (
        "zarrckpt/schema/zarrckpt.schema.json must be a copy of spec/zarrckpt.schema.json"
    )


def test_schema_is_a_valid_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_schema_data_types_match_the_library_table():
    assert sorted(SCHEMA["$defs"]["dataType"]["enum"]) == sorted(zdtypes.ZARR_NAMES)


# ------------------------------------------------------------------ (c) the schema rejects bad documents


SAVE_ID = "1f1c246b27834679a6cdb39815b19fe8"


def good_root() -> dict:
    return {
        "format": "zarrckpt", "version": "1.0", "state": "committed", "save_id": SAVE_ID,
        "world_size": 2, "created": "2026-11-26T04:26:36.445412Z", "writer": {"zarrckpt": "0.1.0"},
        "committed": "2026-11-26T04:26:37.394615Z", "num_arrays": 1,
        "tree": {"dict": [["w", {"array": "w"}], [3, {"list": [{"json": 1}, {"float": "nan"}]}]]},
    }


def good_dtensor() -> dict:
    return {
        "kind": "dtensor", "save_id": SAVE_ID, "torch_dtype": "bfloat16",
        "mesh": {"shape": [2, 4], "dim_names": ["dp", "tp"], "device_type": "cuda"},
        "placements": [{"type": "strided_shard", "dim": 0, "split_factor": 4}, {"type": "shard", "dim": 0}],
    }


def test_good_documents_are_accepted():
    """The bad-document tests below would pass vacuously if these failed."""
    assert_valid("rootAttributes", good_root())
    assert_valid(None, good_root())
    pending = {k: v for k, v in good_root().items() if k not in ("committed", "num_arrays", "tree")}
    assert_valid("rootAttributes", dict(pending, state="pending"))
    assert_valid("arrayAttributes", good_dtensor())
    assert_valid(None, good_dtensor())
    assert_valid("arrayAttributes", {"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "float32"})
    assert_valid("arrayAttributes", {"kind": "bytes", "save_id": SAVE_ID, "torch_dtype": "uint8"})
    assert_valid("rootAttributes", dict(good_root(), version="1.7", future_member={"x": 1}))  # §10
    assert_valid("treeNode", {"array": "a/%/%2Eb/%5F_c/zarr%2Ejson.x/-1/%C3%BC"})


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _root_with_tree(node: Any) -> dict:
    return dict(good_root(), tree={"dict": [["k", node]]})


BAD_ROOTS = {
    "missing version": _without(good_root(), "version"),
    "version 2.0 (another major)": dict(good_root(), version="2.0"),
    "version without minor": dict(good_root(), version="1"),
    "version with leading zero": dict(good_root(), version="1.01"),
    "other format": dict(good_root(), format="zarr"),
    "unknown state": dict(good_root(), state="done"),
    "committed without tree": _without(good_root(), "tree"),
    "committed without num_arrays": _without(good_root(), "num_arrays"),
    "pending with tree": dict(good_root(), state="pending"),
    "save_id not 32 hex": dict(good_root(), save_id="not-an-id"),
    "world_size 0": dict(good_root(), world_size=0),
    "created not UTC": dict(good_root(), created="2026-11-26 04:26:36"),
    "writer version not a string": dict(good_root(), writer={"zarrckpt": 1}),
    "tree is a list node": dict(good_root(), tree={"list": []}),
    "unknown node kind": _root_with_tree({"set": []}),
    "node with two members": _root_with_tree({"json": 1, "array": "k"}),
    "empty node": _root_with_tree({}),
    "node is not an object": _root_with_tree([1]),
    "float NaN spelled like JSON": _root_with_tree({"float": "NaN"}),
    "float node holding a number": _root_with_tree({"float": 1.5}),
    "dict entry with a bool key": dict(good_root(), tree={"dict": [[True, {"json": 1}]]}),
    "dict entry without node": dict(good_root(), tree={"dict": [["a"]]}),
    "dict entry with 3 elements": dict(good_root(), tree={"dict": [["a", {"json": 1}, 2]]}),
    "dict entry as object": dict(good_root(), tree={"dict": {"a": {"json": 1}}}),
    "nested bad node": _root_with_tree({"list": [{"tuple": [{"array": 3}]}]}),
    "array path escapes the directory": _root_with_tree({"array": "../etc/passwd"}),
    "array path with hidden segment": _root_with_tree({"array": "a/.hidden"}),
    "array path with empty segment": _root_with_tree({"array": "a//b"}),
    "array path is zarr.json": _root_with_tree({"array": "a/zarr.json"}),
    "array path with __ segment": _root_with_tree({"array": "__x"}),
    "array path with lower-case hex": _root_with_tree({"array": "a%2fb"}),
    "array path with a bad escape": _root_with_tree({"array": "a%zz"}),
    "array path with a space": _root_with_tree({"array": "a b"}),
    "empty array path": _root_with_tree({"array": ""}),
}


@pytest.mark.parametrize("doc", list(BAD_ROOTS.values()), ids=list(BAD_ROOTS))
def test_schema_rejects_bad_root_attributes(doc):
    assert not is_valid("rootAttributes", doc)
    assert not is_valid(None, doc)


def _with_placement(p: Any) -> dict:
    return dict(good_dtensor(), placements=[p, {"type": "shard", "dim": 0}])


BAD_ARRAYS = {
    "unknown placement type": _with_placement({"type": "partial"}),
    "placement without type": _with_placement({"dim": 0}),
    "shard without dim": _with_placement({"type": "shard"}),
    "shard with negative dim": _with_placement({"type": "shard", "dim": -1}),
    "shard with extra member": _with_placement({"type": "shard", "dim": 0, "split_factor": 2}),
    "strided_shard without split_factor": _with_placement({"type": "strided_shard", "dim": 0}),
    "strided_shard with split_factor 0": _with_placement({"type": "strided_shard", "dim": 0, "split_factor": 0}),
    "replicate with a dim": _with_placement({"type": "replicate", "dim": 0}),
    "placement as a string": _with_placement("Shard(0)"),
    "dtensor without mesh": _without(good_dtensor(), "mesh"),
    "dtensor without placements": _without(good_dtensor(), "placements"),
    "mesh with empty shape": dict(good_dtensor(), mesh={"shape": [], "dim_names": None, "device_type": "cpu"}),
    "mesh with size 0": dict(good_dtensor(), mesh={"shape": [0], "dim_names": None, "device_type": "cpu"}),
    "mesh dim_names not strings": dict(good_dtensor(), mesh={"shape": [2], "dim_names": [1], "device_type": "cpu"}),
    "tensor with placements": {"kind": "tensor", "save_id": SAVE_ID, "torch_dtype": "float32",
                               "placements": [{"type": "replicate"}]},
    "unknown kind": dict(good_dtensor(), kind="pickle"),
    "missing save_id": _without(good_dtensor(), "save_id"),
    "missing torch_dtype": _without(good_dtensor(), "torch_dtype"),
    "zarr-extensions float8_e4m3 name": dict(good_dtensor(), torch_dtype="float8_e4m3"),
    "torch-style dtype name": dict(good_dtensor(), torch_dtype="torch.float32"),
    "bytes that are not uint8": {"kind": "bytes", "save_id": SAVE_ID, "torch_dtype": "float32"},
}


@pytest.mark.parametrize("doc", list(BAD_ARRAYS.values()), ids=list(BAD_ARRAYS))
def test_schema_rejects_bad_array_attributes(doc):
    assert not is_valid("arrayAttributes", doc)
    assert not is_valid(None, doc)


def test_schema_rejects_bad_array_documents():
    good = spec_example("array-zarr.json")
    assert_valid("arrayDocument", good)
    bad = {
        "big endian": ("codecs", [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}]),
        "no checksum": ("codecs", [{"name": "bytes", "configuration": {"endian": "little"}}]),
        "checksum before compression": ("codecs", [
            {"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"},
            {"name": "zstd", "configuration": {"level": 1, "checksum": False}}]),
        "irregular grid": ("chunk_grid", {"name": "rectilinear", "configuration": {}}),
        "dot separator": ("chunk_key_encoding", {"name": "default", "configuration": {"separator": "."}}),
        "zarr v2": ("zarr_format", 2),
        "unknown data type": ("data_type", "float8_e4m3"),
    }
    for name, (member, value) in bad.items():
        assert not is_valid("arrayDocument", dict(good, **{member: value})), name


# ------------------------------------------------------------------ (d) the worked example stays in sync


_EXAMPLE = re.compile(r"<!-- zarrckpt-example: (?P<name>[\w.-]+) -->\s*```[\w]*\n(?P<body>.*?)```", re.S)


def spec_examples() -> dict[str, str]:
    return {m["name"]: m["body"] for m in _EXAMPLE.finditer(SPEC.read_text(encoding="utf-8"))}


def spec_example(name: str) -> Any:
    return json.loads(spec_examples()[name])


def test_spec_header():
    head = SPEC.read_text(encoding="utf-8")[:800]
    assert "| **Version** | 1.0 |" in head and "draft-stable" in head and "2026-11-26" in head
    assert zformat.FORMAT_VERSION == "1.0"


def test_spec_examples_are_present():
    assert set(spec_examples()) >= {
        "save-script", "find", "root-zarr.json", "pending-zarr.json", "array-zarr.json",
        "chunk-head.bias", "dtensor-script", "dtensor-zarr.json", "zarr-python",
    }


@pytest.mark.parametrize(
    "name,definition",
    [("root-zarr.json", "rootDocument"), ("pending-zarr.json", "rootDocument"),
     ("array-zarr.json", "arrayDocument"), ("dtensor-zarr.json", "arrayDocument")],
)
def test_spec_json_examples_validate(name, definition):
    doc = spec_example(name)
    assert_valid(definition, doc, f"spec example {name}")
    attrs = doc["attributes"]["zarrckpt"]
    assert_valid(None, attrs, f"spec example {name} attributes")
    if name == "root-zarr.json":
        assert attrs["version"] == zformat.FORMAT_VERSION
        assert attrs["num_arrays"] == sum("array" in n for _, n in spec_leaves(attrs["tree"]))
    if name == "array-zarr.json":
        assert attrs["save_id"] == spec_example("root-zarr.json")["attributes"]["zarrckpt"]["save_id"]


def _od_bytes(text: str) -> bytes:
    """Parse ``od -A d -t x1`` output."""
    out = bytearray()
    for line in text.strip().splitlines():
        out += bytes(int(x, 16) for x in line.split()[1:])
    return bytes(out)


VOLATILE = ("save_id", "created", "committed", "writer")


def test_worked_example_matches_a_fresh_save(tmp_path, monkeypatch):
    """Re-run Appendix A.1's script; its files must match the ones the spec shows."""
    ex = spec_examples()
    monkeypatch.chdir(tmp_path)
    exec(compile(ex["save-script"], "spec/format.md#save-script", "exec"), {})

    listing = sorted(
        ["ckpt"] + [os.path.relpath(os.path.join(dp, n), tmp_path).replace(os.sep, "/")
                    for dp, dns, fns in os.walk(tmp_path / "ckpt") for n in dns + fns]
    )
    assert listing == ex["find"].split()

    docs = check_checkpoint(tmp_path / "ckpt")
    root, shown = docs[""], spec_example("root-zarr.json")
    for doc in (root, shown):
        for k in VOLATILE:
            doc["attributes"]["zarrckpt"].pop(k)
    assert root == shown

    array, shown = docs["model/head.bias"], spec_example("array-zarr.json")
    array["attributes"]["zarrckpt"].pop("save_id")
    shown["attributes"]["zarrckpt"].pop("save_id")
    assert array == shown
    assert (tmp_path / "ckpt/model/head.bias/c/0").read_bytes() == _od_bytes(ex["chunk-head.bias"])

    # Appendix B runs against the checkpoint A.1 made, and returns the saved state
    ns: dict[str, Any] = {}
    exec(compile(ex["zarr-python"], "spec/format.md#zarr-python", "exec"), ns)
    state = ns["state"]
    assert state["step"] == 100 and state["lr_schedule"] == (0.1, 0.01) and state["rng"] == b"\x01\x02\x03\x04"
    np.testing.assert_array_equal(state["model"]["embed.weight"], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert state["model"]["head.bias"].astype(np.float32).tolist() == [0.5, -1.0, 2.0]
