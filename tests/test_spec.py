"""spec/format.md and its JSON Schema twin, checked against what zarrckpt writes.

The checks walk the files on disk (never the library's reader; data is read with zarr-python
alone) and re-derive the spec's rules (escaping §4, chunk presence §5.3, codecs §5.5, tree §6,
packed leaves §6.5, digests §6.6, commit §7; zarrckpt's own choices of Appendix C: chunk grid C.1,
inner chunks C.2, packing C.3, writers C.4) from the text of the spec, so
that a change in either the code or the spec that breaks the other fails here.
"""

from __future__ import annotations

import hashlib
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
from zarrckpt.format import dtypes as zdtypes
from zarrckpt.format import documents as zformat
from zarrckpt.format import layout as zlayout

import jsonschema  # noqa: E402  (a test dependency: fail loudly if missing, never skip)
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


def test_schema_formats_are_checked():
    """jsonschema checks ``"format": "date-time"`` only when rfc3339-validator is installed
    (the test extra installs it); without it every timestamp passes unchecked."""
    assert "date-time" in jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers


# ------------------------------------------------------------------ the spec's rules, re-derived

_SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def spec_escape(component: str | int) -> str:
    """§4.2, written from the text of the spec (not from zarrckpt.format.tree)."""
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
    """Appendix C.2 inner chunk rule."""
    floor = min(target, 65536)
    if not chunk or math.prod(chunk) * itemsize < min(2 * target, 4 * floor):  # step 1
        return None
    goal = min(target, max(floor, math.prod(chunk) * itemsize // 4))  # step 2

    def usable(n: int) -> int | None:
        if n < 2:
            return None
        p = next((p for p in range(2, math.isqrt(n) + 1) if n % p == 0), n)
        if p < n:
            return p
        return n if n <= 64 else None

    inner = list(chunk)
    while math.prod(inner) * itemsize > goal:  # step 3
        for d in sorted(range(len(inner)), key=lambda d: (chunk[d] // inner[d], -inner[d], d)):
            f = usable(inner[d])
            if f:
                inner[d] //= f
                break
        else:
            break
    return None if inner == list(chunk) else inner


FILL_VALUES = {"bool": False, "complex64": [0.0, 0.0], "complex128": [0.0, 0.0], "float8_e8m0fnu": "NaN"}


PACK_PATH = re.compile(r"\.packs/(0|[1-9][0-9]*)")


def spec_numpy_dtype(data_type: str) -> np.dtype:
    """§5.2 name -> little-endian NumPy dtype (ml_dtypes for bfloat16 / float8)."""
    import ml_dtypes

    special = data_type.startswith(("bfloat", "float8"))
    return np.dtype(getattr(ml_dtypes, data_type) if special else data_type).newbyteorder("<")


def spec_packing(leaves: list[tuple[str, int]], world: int) -> dict[str, tuple[int, int]]:
    """Appendix C.3 (informative) assignment: ``[(key, nbytes)]`` -> ``{key: (pack n, offset)}``."""
    lengths = [0] * world
    out = {}
    for key, nbytes in sorted(leaves):
        n = min(range(world), key=lambda i: (lengths[i], i))
        out[key] = (n, lengths[n])
        lengths[n] += -(-nbytes // 8) * 8
    return out


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
    assert re.fullmatch(r"[0-9a-f]{30}", attrs["save_id"]), attrs["save_id"]  # §6.1: zarrckpt writes 30

    leaves = list(spec_leaves(attrs["tree"]))
    array_nodes = {path: node["array"] for path, node in leaves if "array" in node}
    packed_nodes = {path: node["packed"] for path, node in leaves if "packed" in node}
    arrays = {rel: d for rel, d in docs.items() if d.get("node_type") == "array"}
    groups = {rel for rel, d in docs.items() if rel and d.get("node_type") == "group"}
    packs = {rel for rel in arrays if rel.startswith(".")}

    # §6.1 num_arrays: array nodes plus pack arrays; §6.2 array node value = key of its key path
    assert attrs["num_arrays"] == len(array_nodes) + len(packs) == len(arrays)
    # §6.6: the root digest over its own bytes, and the exact bytes of every array zarr.json
    raw = (root / "zarr.json").read_bytes()
    assert raw == compact(root_doc)  # §3.2: compact, ASCII, in order
    digests = attrs["digests"]
    assert digests["algorithm"] == "sha256" and spec_root_digest(raw, digests["root"]) == digests["root"]
    assert set(digests["arrays"]) == set(arrays)
    for apath, want in digests["arrays"].items():
        assert hashlib.sha256((root / apath / "zarr.json").read_bytes()).hexdigest() == want, apath
    for path, apath in array_nodes.items():
        assert apath == spec_key(path), f"key path {path!r}: array node says {apath!r}"
    # §6.5: the packs are exactly the arrays that packed nodes name, at .packs/<n>
    assert set(array_nodes.values()) | {d["pack"] for d in packed_nodes.values()} == set(arrays)
    assert all(PACK_PATH.fullmatch(p) for p in packs), packs
    # §4.4: distinct leaves, distinct keys
    assert len({spec_key(p) for p, _ in leaves}) == len(leaves)
    # §6.4: intermediate groups are exactly the proper prefixes of array paths (.packs included)
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
        assert (a["kind"] == "pack") == (apath in packs), where             # §5.6, §6.5
        if a["kind"] == "dtensor":
            assert len(a["placements"]) == len(a["mesh"]["shape"]), where
        if a["kind"] in ("bytes", "pack"):
            assert doc["data_type"] == "uint8" and len(doc["shape"]) == 1, where
        shape = doc["shape"]
        chunk = doc["chunk_grid"]["configuration"]["chunk_shape"]
        assert len(chunk) == len(shape), where
        if a["kind"] == "pack":                                              # C.1: one chunk
            assert chunk == [max(shape[0], 1)] and shape[0] % 8 == 0, where
        # C.2: sharded exactly when the inner chunk rule says so
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
        if inner is not None:  # §5.3: inner chunks overlapping the array are stored
            for key in expected:
                check_shard_index(base / key, [int(i) for i in key.split("/")[1:]], shape, chunk, inner, where)

    # §6.5: packed nodes
    ranges: dict[str, list[tuple[int, int]]] = {p: [] for p in packs}
    for path, d in packed_nodes.items():
        where = f"packed leaf {spec_key(path)!r}"
        assert_valid("packedNode", {"packed": d}, where)
        itemsize = zdtypes.by_zarr(d["data_type"]).numpy.itemsize
        assert d["nbytes"] == math.prod(d["shape"]) * itemsize, where
        assert d["offset"] % 8 == 0, where
        assert d["offset"] + d["nbytes"] <= arrays[d["pack"]]["shape"][0], where
        ranges[d["pack"]].append((d["offset"], d["offset"] + d["nbytes"]))
    for pack, rs in ranges.items():
        rs = sorted(r for r in rs if r[0] < r[1])
        assert all(a[1] <= b[0] for a, b in zip(rs, rs[1:])), f"{pack}: overlapping ranges {rs}"
        # informative: padding is zero (read with zarr-python alone)
        data = spec_read_pack(root, pack)
        covered = np.zeros(data.shape, bool)
        for lo, hi in rs:
            covered[lo:hi] = True
        assert not data[~covered].any(), f"{pack}: non-zero padding"
    return docs


def check_shard_index(path: Path, index: list[int], shape: list[int], chunk: list[int], inner: list[int],
                      where: str) -> None:
    """§5.3 / §5.5: the shard index at the end (16 bytes per inner chunk, row-major, then its
    CRC-32C): every inner chunk that overlaps the array is stored; the others may be absent."""
    import crc32c

    per = [c // n for c, n in zip(chunk, inner)]
    count = math.prod(per)
    data = path.read_bytes()
    table = data[-(16 * count + 4):-4]
    assert crc32c.crc32c(table) == int.from_bytes(data[-4:], "little"), where
    entries = np.frombuffer(table, dtype="<u8").reshape(count, 2)
    for j, (offset, nbytes) in zip(np.ndindex(*per), entries):
        overlaps = all(i * c + jj * n < s for i, c, jj, n, s in zip(index, chunk, j, inner, shape))
        absent = offset == nbytes == 2**64 - 1
        assert not (overlaps and absent), f"{where}: inner chunk {j} of shard {index} is missing"
        if not absent:
            assert offset + nbytes <= len(data) - 16 * count - 4, where


def spec_read_pack(root: Path, pack: str) -> np.ndarray:
    import zarr

    return zarr.open_array(root / pack, mode="r")[...]


def spec_read_leaf(root: Path, node: dict) -> Any:
    """An array leaf read with zarr-python alone, as §5.6 and §6.5 describe."""
    import zarr

    if "array" in node:
        a = zarr.open_array(root / node["array"], mode="r")
        data = a[...]
        return data.tobytes() if a.attrs["zarrckpt"]["kind"] == "bytes" else np.asarray(data)
    d = node["packed"]
    raw = spec_read_pack(root, d["pack"])[d["offset"]:d["offset"] + d["nbytes"]]
    if d["kind"] == "bytes":
        return raw.tobytes()
    return raw.view(spec_numpy_dtype(d["data_type"])).reshape(d["shape"])


def leaf_bytes(leaf: Any) -> tuple[tuple[int, ...], bytes]:
    """(shape, little-endian C-order bytes) of a saved leaf."""
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(leaf, np.ndarray):
        return leaf.shape, np.ascontiguousarray(leaf).tobytes()
    return (len(leaf),), bytes(leaf)


def flat_leaves(obj: Any, path: tuple = ()) -> dict[tuple, Any]:
    if isinstance(obj, dict) and obj:
        return {k: v for key, val in obj.items() for k, v in flat_leaves(val, path + (key,)).items()}
    if isinstance(obj, (list, tuple)) and obj:
        return {k: v for i, val in enumerate(obj) for k, v in flat_leaves(val, path + (i,)).items()}
    return {path: obj}


def check_values(root: Path, state: dict) -> None:
    """Every array leaf, packed or not, read with zarr-python alone equals the saved value."""
    tree = read_checkpoint_files(root)[""]["attributes"]["zarrckpt"]["tree"]
    saved = flat_leaves(state)
    for path, node in spec_leaves(tree):
        if "array" not in node and "packed" not in node:
            continue
        got, want = spec_read_leaf(root, node), saved[path]
        if isinstance(want, (bytes, bytearray, memoryview)):
            assert got == bytes(want), path
        else:
            shape, raw = leaf_bytes(want)
            assert isinstance(got, np.ndarray) and got.shape == shape, path
            assert np.ascontiguousarray(got).tobytes() == raw, path


# ------------------------------------------------------------------ (a) real saves


def varied_state() -> dict:
    return {
        "model": {
            "big.weight": torch.randn(160, 128),          # 80 KiB: above the default pack_bytes
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
    [{"pack_bytes": 0}, {}, {"pack_bytes": 200}, {"pack_bytes": 64 << 10},
     {"compression": "zstd", "inner_chunk_bytes": 256, "pack_bytes": 0},
     {"compression": "zstd", "inner_chunk_bytes": 256, "pack_bytes": 64 << 10},
     {"compression": {"name": "gzip", "level": 5}, "pack_bytes": 64 << 10}],
    ids=["unpacked", "default", "pack-200", "packed", "zstd-sharded", "zstd-sharded-packed", "gzip-packed"],
)
def test_saved_files_follow_schema_and_spec(tmp_path, options):
    state = varied_state()
    zarrckpt.save(state, tmp_path / "ckpt", **options)
    docs = check_checkpoint(tmp_path / "ckpt", inner_chunk_bytes=options.get("inner_chunk_bytes", 1 << 20))
    check_values(tmp_path / "ckpt", state)
    arrays = {k: d for k, d in docs.items() if d.get("node_type") == "array"}
    tree = docs[""]["attributes"]["zarrckpt"]["tree"]
    nodes = {spec_key(p): n for p, n in spec_leaves(tree)}

    def described(key: str) -> tuple[list[int], str, str]:
        """(shape, data_type, kind) of an array leaf, from its array or its packed node."""
        if "packed" in nodes[key]:
            d = nodes[key]["packed"]
            return d["shape"], d["data_type"], d["kind"]
        doc = arrays[nodes[key]["array"]]
        return doc["shape"], doc["data_type"], doc["attributes"]["zarrckpt"]["kind"]

    # C.3 (informative): which leaves zarrckpt packs, and where
    pack_bytes = options.get("pack_bytes", 0)  # 1.2: no packing unless asked (§6.5)
    sizes = {}
    for key in nodes:
        if "array" in nodes[key] or "packed" in nodes[key]:
            shape, data_type, kind = described(key)
            sizes[key] = (kind, math.prod(shape) * zdtypes.by_zarr(data_type).numpy.itemsize)
    small = [(k, n) for k, (kind, n) in sizes.items() if kind in ("tensor", "ndarray", "bytes") and n <= pack_bytes]
    packed = {k: (int(n["packed"]["pack"].split("/")[1]), n["packed"]["offset"])
              for k, n in nodes.items() if "packed" in n}
    assert packed == (spec_packing(small, 1) if pack_bytes > 0 and len(small) >= 2 else {})
    if pack_bytes == 0:
        assert not any(a.startswith(".") for a in arrays)
    else:
        assert "model/big.weight" in arrays and ".packs/0" in arrays

    # the escaping cases of §4.2 really reached storage (as array paths when nothing is packed)
    for segment in ["%", "%2Ehidden", "%5F_reserved", "zarr%2Ejson", "50%25", "unicode%20%C3%BC%2F%C3%A9",
                    "model/layer%2Fbias", "7/seven", "mixed/2/k", "mixed/3", "optim/state/0/step"]:
        assert segment in nodes, f"{segment!r} not among {sorted(nodes)}"
        if pack_bytes == 0:
            assert segment in arrays, f"{segment!r} not among {sorted(arrays)}"
    assert described("optim/state/0/step")[0] == []                    # 0-d
    assert described("empty")[0] == [0, 7]
    if "empty" in arrays:
        assert arrays["empty"]["chunk_grid"]["configuration"]["chunk_shape"] == [1, 7]  # C.1 empty dim
    assert described("fp8")[1] == "float8_e4m3fn"                      # §5.2, not float8_e4m3
    assert described("model/layer%2Fbias")[1] == "bfloat16"
    assert described("ids")[2] == "ndarray"
    assert described("rng")[1:] == ("uint8", "bytes")
    if options.get("inner_chunk_bytes"):
        assert arrays["model/big.weight"]["codecs"][0]["name"] == "sharding_indexed"
        if "model/layer.weight" in arrays:
            assert arrays["model/layer.weight"]["codecs"][0]["name"] == "sharding_indexed"
        if "model/prime" in arrays:
            assert arrays["model/prime"]["codecs"][0]["name"] == "bytes"  # prime extent > 64 stays whole
        if ".packs/0" in arrays:                                          # a pack is an array like any other
            assert arrays[".packs/0"]["codecs"][0]["name"] == "sharding_indexed"
    # §6.2 the tree's typed keys and value nodes
    top = dict((json.dumps(k), v) for k, v in tree["dict"])
    assert [k for k, _ in top["7"]["dict"]] == ["seven"]               # integer key stays an integer
    if pack_bytes == 0:
        assert top["7"] == {"dict": [["seven", {"array": "7/seven"}]]}
    assert top['"plain"'] == {"json": {"a": 1, "b": [1.5, "x", None], "c": {"d": True}}}
    values = dict(top['"values"']["dict"])
    assert values["nan"] == {"float": "nan"} and values["ninf"] == {"float": "-inf"}
    assert values["big"] == {"json": 2**70} and values["empty_tuple"] == {"tuple": []}
    assert top['"mixed"']["list"][1] == {"tuple": [{"json": 2.5}, {"float": "nan"}]}
    # the library's reader agrees with zarr-python on every leaf
    ckpt = zarrckpt.open(tmp_path / "ckpt")
    for key, node in nodes.items():
        if "array" in node or "packed" in node:
            got, want = ckpt.read(key), spec_read_leaf(tmp_path / "ckpt", node)
            assert got == want if isinstance(want, bytes) else got.tobytes() == want.tobytes(), key


def test_checkpoint_keys_are_the_spec_leaves(tmp_path):
    """§6.3: the keys a reader lists are the leaves of the stored tree."""
    zarrckpt.save(varied_state(), tmp_path / "ckpt")
    tree = read_checkpoint_files(tmp_path / "ckpt")[""]["attributes"]["zarrckpt"]["tree"]
    assert zarrckpt.open(tmp_path / "ckpt").keys() == [spec_key(p) for p, _ in spec_leaves(tree)]


def _staging_dirs(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(".") and ".zarrckpt-" in p.name and p.is_dir()]


def test_pending_root_follows_schema_and_is_refused(tmp_path, monkeypatch):
    """§7: a save that never reached its commit leaves pending roots that readers refuse: the
    claim at the path and, on a file system, the save's own directory beside it (§7.3)."""
    from zarrckpt.engine import commit as _commit

    monkeypatch.setattr(_commit, "publish", lambda *args, **kwargs: None)
    state = {"w": torch.ones(3), "n": 1, "small": {"a": torch.ones(2), "b": b"xy"}}
    zarrckpt.save(state, tmp_path / "ckpt")
    (staging,) = _staging_dirs(tmp_path)
    for where in (tmp_path / "ckpt", staging):
        root = read_checkpoint_files(where)[""]
        assert_valid("rootDocument", root)
        assert_valid("rootAttributesPending", root["attributes"]["zarrckpt"])
        assert not is_valid("rootAttributesCommitted", root["attributes"]["zarrckpt"])
        with pytest.raises(zarrckpt.IncompleteCheckpointError):  # §7.1, although every array is there
            zarrckpt.open(where)
    docs = read_checkpoint_files(staging)
    assert {k for k, d in docs.items() if d["node_type"] == "array"} == {"w", "small/a", "small/b"}
    for k in ("w", "small/a", "small/b"):
        assert_valid("arrayDocument", docs[k])
    assert os.listdir(tmp_path / "ckpt") == ["zarr.json"]  # the claim holds nothing else


def test_prepare_writes_only_the_pending_root_and_groups(tmp_path, monkeypatch):
    """Appendix C.5 step 2: before C1, rank 0 writes the pending root and the intermediate groups
    only; array zarr.json files and chunks come in the write step (step 3)."""
    from zarrckpt.api import save as _save

    seen: dict[str, Any] = {}

    def stop(self, *args, **kwargs):
        root = Path(self.target.store.local_path)
        seen["docs"] = read_checkpoint_files(root)
        seen["files"] = sorted(f for _, _, fs in os.walk(root) for f in fs)
        return RuntimeError("stopped before the write step")

    monkeypatch.setattr(_save.SaveRun, "write", stop)
    state = {"model": {"w": torch.ones(3, 4), "b": torch.ones(3)}, "opt": {"x": {"y": torch.ones(1 << 15)}}}
    with pytest.raises(RuntimeError, match="stopped"):
        zarrckpt.save(state, tmp_path / "ckpt")
    docs = seen["docs"]
    assert_valid("rootAttributesPending", docs[""]["attributes"]["zarrckpt"])
    # every leaf is an array of its own (1.2 writers do not pack): the groups above them
    assert set(docs) == {"", "model", "opt", "opt/x"}
    assert all(d == {"zarr_format": 3, "node_type": "group"} for k, d in docs.items() if k)
    assert seen["files"] == ["zarr.json"] * len(docs)  # no chunk, no array metadata
    assert not (tmp_path / "ckpt").exists() and not _staging_dirs(tmp_path)  # a failed save leaves nothing


def test_overwrite_uncommits_first(monkeypatch):
    """§7.3, stores that cannot move a directory (here memory://): replacing a committed
    checkpoint rewrites its root as pending before anything is deleted."""
    import uuid

    from zarrckpt.storage import _tensorstore

    url = f"memory://uncommit-{uuid.uuid4().hex}"
    zarrckpt.save({"w": torch.ones(3)}, url)
    seen = []
    real_clear = _tensorstore.TensorStoreStorage.clear

    def clear(self, *args, **kwargs):
        seen.append(self.read_json("zarr.json")["attributes"]["zarrckpt"]["state"])
        real_clear(self, *args, **kwargs)

    monkeypatch.setattr(_tensorstore.TensorStoreStorage, "clear", clear)
    with pytest.raises(zarrckpt.CheckpointExistsError):
        zarrckpt.save({"w": torch.zeros(3)}, url)
    assert seen == []
    zarrckpt.save({"w": torch.zeros(3)}, url, overwrite=True)
    assert seen == ["pending"]
    assert zarrckpt.open(url).read("w").tolist() == [0.0, 0.0, 0.0]


def test_overwrite_on_a_file_system_replaces_the_directory_at_once(tmp_path):
    """§7.3, file systems: the new checkpoint is written beside the path and exchanged with
    the old one in one step; the old one stays readable until then, nothing is left beside."""
    zarrckpt.save({"w": torch.ones(3)}, tmp_path / "ckpt")
    zarrckpt.save({"w": torch.zeros(3), "v": 1}, tmp_path / "ckpt", overwrite=True)
    check_checkpoint(tmp_path / "ckpt")
    assert zarrckpt.open(tmp_path / "ckpt").read("v") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


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
    """Appendix C.4's unaligned example and writer rule, against zarrckpt.format.layout."""
    from zarrckpt.format.layout import Layout, Shard

    lay = Layout((9, 4), (2, 2), (Shard(0), Shard(0)), key="w")
    assert lay.chunk_shape == (3, 4) and lay.aligned == (False, True)
    writes = {c: [w.index for w in lay.save_plan(c)[0]] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert writes == {(0, 0): [(0, 0)], (0, 1): [(1, 0)], (1, 0): [], (1, 1): [(2, 0)]}
    sends = lay.save_plan((1, 0))[1]
    assert [(s.dst, s.box[0]) for s in sends] == [((0, 1), (5, 6)), ((1, 1), (6, 7))]
    assert lay.metadata_writer() == (0, 0)  # C.4: the writer of chunk (0, 0)


def spec_pick(h: int, index: tuple, grid: tuple, split: tuple[int, int] | None) -> int:
    """Appendix C.4: the pick q of a chunk."""
    e, k = split if split else (-1, 1)
    lin = 0
    for d, (i, g) in enumerate(zip(index, grid)):
        if d == e:
            i, g = i // k, -(-g // k)
        lin = lin * g + i
    return h + k * lin + (index[e] % k if split else 0)


def spec_metadata_writer(h: int, shape: tuple, mesh: tuple, placements: tuple, grid: tuple,
                         split: tuple[int, int] | None) -> tuple:
    """Appendix C.4 (metadata writers) for aligned layouts: chunk (0, ..., 0) lies in the cell of the coordinates whose
    sharding mesh dims are 0; its writer is replica ``q mod R`` of that cell, ``q`` its pick
    (``h`` for an array with a zero-length dimension)."""
    replica_dims = [j for j, p in enumerate(placements) if p == "R"]
    r = h if 0 in shape else spec_pick(h, (0,) * len(shape), grid, split)
    r %= math.prod(mesh[j] for j in replica_dims)
    coord = [0] * len(mesh)
    for j in reversed(replica_dims):
        coord[j] = r % mesh[j]
        r //= mesh[j]
    return tuple(coord)


@pytest.mark.parametrize(
    "shape,mesh,placements",
    [((0, 6), (4,), ("R",)), ((8, 0), (2, 3), ("S0", "R")), ((0,), (3, 2), ("R", "S0")), ((), (5,), ("R",))],
)
def test_spec_metadata_writer_without_chunks(shape, mesh, placements):
    """Appendix C.4: arrays with a zero-length dimension (no chunks) and 0-d arrays."""
    from zarrckpt.format.layout import Layout, Replicate, Shard

    for key in ("a", "opt/x", "model/layer.weight", "%2Eh"):
        parsed = [Replicate() if p == "R" else Shard(int(p[1:])) for p in placements]
        lay = Layout(shape, mesh, parsed, key=key)
        h = zlib.crc32(key.encode())
        assert lay.metadata_writer() == spec_metadata_writer(h, shape, mesh, placements, lay.grid_shape, None)


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
    """Appendix C.1 chunk grid with replica split and C.4 writer choice, against zarrckpt.format.layout:
    every chunk written exactly once, by the replica the spec names."""
    from zarrckpt.format.layout import Layout, Replicate, Shard

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
    # C.4: the array's zarr.json is written by the writer of chunk (0, ..., 0)
    assert lay.metadata_writer() == spec_metadata_writer(h, shape, mesh, placements, lay.grid_shape, split)
    if split:  # C.4: the k chunks of one split cell are written by k different replicas
        e, k = split
        by_cell: dict[tuple, set] = {}
        for coord in np.ndindex(*mesh):
            for w in lay.save_plan(tuple(coord))[0]:
                cell = tuple(i // k if d == e else i for d, i in enumerate(w.index))
                by_cell.setdefault(cell, set()).add(coord)
        assert all(len(writers) == k for writers in by_cell.values()), by_cell


def spec_rank_state(rank: int, same: bool) -> dict:
    """The state every rank saves in the multi-process tests below."""
    state = {
        "a": torch.arange(10, dtype=torch.float32), "b": torch.ones(2), "c": torch.ones(3, dtype=torch.int8),
        "d": torch.arange(25, dtype=torch.float32).reshape(5, 5), "e": torch.empty(0, 3),
        "f": b"xyz", "g": np.arange(5), "x": {"y": {"z": torch.ones(4, dtype=torch.bfloat16)}},
        "big": torch.arange(20000, dtype=torch.float32),  # 80000 bytes: above pack_bytes
        "step": 7,
    }
    if not same:
        state["stage"] = {str(rank): torch.full((2,), float(rank))}
    return state


def rank_save_logging_puts(rank, world, path, same):
    """Save ``spec_rank_state`` and return the storage keys this rank put (zarr.json files
    other than the root, and small chunks), one by one or in batches of local files."""
    from zarrckpt.storage import _tensorstore

    log = []
    real_put, real_put_files = _tensorstore.TensorStoreStorage.put, _tensorstore.TensorStoreStorage.put_files

    def put(self, key, data):
        log.append(key)
        return real_put(self, key, data)

    def put_files(self, items):
        log.extend(key for key, *_ in items)
        return real_put_files(self, items)

    _tensorstore.TensorStoreStorage.put, _tensorstore.TensorStoreStorage.put_files = put, put_files
    try:
        zarrckpt.save(spec_rank_state(rank, same), path, pack_bytes=64 << 10)  # C.3, still as specified
    finally:
        _tensorstore.TensorStoreStorage.put, _tensorstore.TensorStoreStorage.put_files = real_put, real_put_files
    return log


def test_two_processes_pack_and_write_as_the_spec_says(tmp_path, clusters):
    """C.3 packs of two processes; §7.2 / C.4: who writes each zarr.json and chunk."""
    path = tmp_path / "ckpt"
    logs = clusters(2).run(rank_save_logging_puts, str(path), True)
    docs = check_checkpoint(path)
    check_values(path, spec_rank_state(0, True))
    tree = docs[""]["attributes"]["zarrckpt"]["tree"]
    nodes = {spec_key(p): n for p, n in spec_leaves(tree)}
    packed = {k: (int(n["packed"]["pack"].split("/")[1]), n["packed"]["offset"])
              for k, n in nodes.items() if "packed" in n}
    sizes = [(k, n["packed"]["nbytes"]) for k, n in nodes.items() if "packed" in n]
    assert sorted(packed) == ["a", "b", "c", "d", "e", "f", "g", "x/y/z"]
    assert packed == spec_packing(sizes, 2)
    assert {a for a, d in docs.items() if d.get("node_type") == "array"} == {"big", ".packs/0", ".packs/1"}
    assert docs[""]["attributes"]["zarrckpt"]["num_arrays"] == 3

    writers: dict[str, list[int]] = {}
    for rank, keys in enumerate(logs):
        for key in keys:
            writers.setdefault(key, []).append(rank)
    assert all(len(r) == 1 for r in writers.values()), writers  # every object written once
    expected = {
        ".packs/zarr.json": 0,                        # groups: rank 0 (x/y/z is packed: no group x)
        ".packs/0/zarr.json": 0, ".packs/0/c/0": 0,                         # pack n: rank n
        ".packs/1/zarr.json": 1, ".packs/1/c/0": 1,
        "big/zarr.json": zlib.crc32(b"big") % 2, "big/c/0": zlib.crc32(b"big") % 2,  # C.4
    }
    assert {k: r[0] for k, r in writers.items()} == expected


def test_two_processes_with_different_keys_pack_nothing(tmp_path, clusters):
    """C.3: zarrckpt packs only when every process holds the same tree."""
    path = tmp_path / "ckpt"
    clusters(2).run(rank_save_logging_puts, str(path), False)
    docs = check_checkpoint(path)
    tree = docs[""]["attributes"]["zarrckpt"]["tree"]
    assert not any("packed" in n for _, n in spec_leaves(tree))
    assert not any(k.startswith(".") for k in docs if k)
    state = spec_rank_state(0, False)
    state["stage"]["1"] = torch.full((2,), 1.0)
    check_values(path, state)


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


# ------------------------------------------------------------------ (c) bad documents: tests/test_bad_documents.py


# ------------------------------------------------------------------ (d) the worked example stays in sync


_EXAMPLE = re.compile(r"<!-- zarrckpt-example: (?P<name>[\w.-]+) -->\s*```[\w]*\n(?P<body>.*?)```", re.S)


def spec_examples() -> dict[str, str]:
    return {m["name"]: m["body"] for m in _EXAMPLE.finditer(SPEC.read_text(encoding="utf-8"))}


def spec_example(name: str) -> Any:
    return json.loads(spec_examples()[name])


def test_spec_header():
    head = SPEC.read_text(encoding="utf-8")[:800]
    assert "| **Version** | 1.3 |" in head and "draft, unreleased" in head and "2026-11-26" in head
    assert zformat.FORMAT_VERSION == "1.3"


def test_spec_examples_are_present():
    assert set(spec_examples()) >= {
        "save-script", "find", "root-zarr.json", "pending-zarr.json", "array-zarr.json",
        "chunk-head.bias", "packed-script", "packed-find", "packed-root-zarr.json", "pack-zarr.json",
        "chunk-pack", "dtensor-script", "dtensor-zarr.json", "zarr-python",
    }


@pytest.mark.parametrize(
    "name,definition",
    [("root-zarr.json", "rootDocument"), ("pending-zarr.json", "rootDocument"),
     ("array-zarr.json", "arrayDocument"), ("packed-root-zarr.json", "rootDocument"),
     ("pack-zarr.json", "arrayDocument"), ("dtensor-zarr.json", "arrayDocument")],
)
def test_spec_json_examples_validate(name, definition):
    doc = spec_example(name)
    assert_valid(definition, doc, f"spec example {name}")
    attrs = doc["attributes"]["zarrckpt"]
    assert_valid(None, attrs, f"spec example {name} attributes")
    assert re.fullmatch(r"[0-9a-f]{30}", attrs["save_id"])  # what zarrckpt writes (§6.1)
    if name.endswith("root-zarr.json"):
        assert attrs["version"] == zformat.FORMAT_VERSION
        leaves = [n for _, n in spec_leaves(attrs["tree"])]
        packs = {n["packed"]["pack"] for n in leaves if "packed" in n}
        assert attrs["num_arrays"] == sum("array" in n for n in leaves) + len(packs)  # §6.1
        # §6.6: the digests shown are those of the documents shown (as written: compact JSON)
        raw = compact(doc)
        digests = attrs["digests"]
        assert spec_root_digest(raw, digests["root"]) == digests["root"]
        assert set(digests["arrays"]) == {n["array"] for n in leaves if "array" in n} | packs
    if name == "array-zarr.json":
        root = spec_example("root-zarr.json")["attributes"]["zarrckpt"]
        assert attrs["save_id"] == root["save_id"]
        assert hashlib.sha256(compact(doc)).hexdigest() == root["digests"]["arrays"]["model/head.bias"]
    if name == "pack-zarr.json":
        root = spec_example("packed-root-zarr.json")["attributes"]["zarrckpt"]
        assert attrs["save_id"] == root["save_id"]
        assert hashlib.sha256(compact(doc)).hexdigest() == root["digests"]["arrays"][".packs/0"]


def compact(doc: Any) -> bytes:
    """§3.2: how zarrckpt writes a document (compact, ASCII, members in order)."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def spec_root_digest(raw: bytes, claimed: str) -> str:
    """§6.6, from the text: replace the one occurrence of the digest by 64 '0', SHA-256."""
    assert raw.count(claimed.encode()) == 1
    return hashlib.sha256(raw.replace(claimed.encode(), b"0" * 64)).hexdigest()


def _od_bytes(text: str) -> bytes:
    """Parse ``od -A d -t x1`` output."""
    out = bytearray()
    for line in text.strip().splitlines():
        out += bytes(int(x, 16) for x in line.split()[1:])
    return bytes(out)


VOLATILE = ("save_id", "created", "committed", "writer", "digests")


def test_worked_example_matches_a_fresh_save(tmp_path, monkeypatch):
    """Re-run Appendix A.1's and A.2's scripts; their files must match the ones the spec shows."""
    ex = spec_examples()
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {}
    exec(compile(ex["save-script"], "spec/format.md#save-script", "exec"), ns)
    exec(compile(ex["packed-script"], "spec/format.md#packed-script", "exec"), ns)

    def listing(name: str) -> list[str]:
        return sorted(
            [name] + [os.path.relpath(os.path.join(dp, n), tmp_path).replace(os.sep, "/")
                      for dp, dns, fns in os.walk(tmp_path / name) for n in dns + fns]
        )

    assert listing("ckpt") == ex["find"].split()
    assert listing("ckpt_packed") == ex["packed-find"].split()

    def same_root(docs: dict, example: str) -> None:
        root, shown = docs[""], spec_example(example)
        for doc in (root, shown):
            for k in VOLATILE:
                doc["attributes"]["zarrckpt"].pop(k)
            for entry in doc["consolidated_metadata"]["metadata"].values():  # §6.7: arrays' save_id
                entry.get("attributes", {}).get("zarrckpt", {}).pop("save_id", None)
        assert root == shown, example

    def same_array(doc: dict, example: str) -> None:
        shown = spec_example(example)
        doc["attributes"]["zarrckpt"].pop("save_id")
        shown["attributes"]["zarrckpt"].pop("save_id")
        assert doc == shown, example

    docs = check_checkpoint(tmp_path / "ckpt")
    same_root(docs, "root-zarr.json")
    same_array(docs["model/head.bias"], "array-zarr.json")
    assert (tmp_path / "ckpt/model/head.bias/c/0").read_bytes() == _od_bytes(ex["chunk-head.bias"])

    packed_docs = check_checkpoint(tmp_path / "ckpt_packed")
    same_root(packed_docs, "packed-root-zarr.json")
    same_array(packed_docs[".packs/0"], "pack-zarr.json")
    assert (tmp_path / "ckpt_packed/.packs/0/c/0").read_bytes() == _od_bytes(ex["chunk-pack"])
    check_values(tmp_path / "ckpt", ns["state"])
    check_values(tmp_path / "ckpt_packed", ns["state"])

    # Appendix B runs against the checkpoints A.1 and A.2 made, and returns the saved state
    ns = {}
    exec(compile(ex["zarr-python"], "spec/format.md#zarr-python", "exec"), ns)
    for state in (ns["state"], ns["packed"], ns["read_checkpoint"]("ckpt_packed")):
        assert state["step"] == 100 and state["lr_schedule"] == (0.1, 0.01) and state["rng"] == b"\x01\x02\x03\x04"
        np.testing.assert_array_equal(state["model"]["embed.weight"], np.arange(12, dtype=np.float32).reshape(3, 4))
        assert state["model"]["head.bias"].astype(np.float32).tolist() == [0.5, -1.0, 2.0]
        assert str(state["model"]["head.bias"].dtype) == "bfloat16"


def test_appendix_b_reads_every_kind_of_leaf(tmp_path, monkeypatch):
    """Appendix B's reader, on the varied state, packed and not, equals zarr-python reads of §6.5."""
    ns: dict[str, Any] = {}
    monkeypatch.chdir(tmp_path)
    exec(compile(spec_examples()["zarr-python"].split("\nstate = read_checkpoint")[0], "appendix-b", "exec"), ns)
    state = varied_state()
    for options in ({"pack_bytes": 0}, {}):
        path = tmp_path / f"ckpt{len(options)}"
        zarrckpt.save(state, path, **options)
        got = flat_leaves(ns["read_checkpoint"](str(path)))
        for key_path, want in flat_leaves(state).items():
            if isinstance(want, (bytes, bytearray, memoryview)):
                assert got[key_path] == bytes(want), key_path
            elif isinstance(want, (torch.Tensor, np.ndarray)):
                shape, raw = leaf_bytes(want)
                assert got[key_path].shape == shape and np.ascontiguousarray(got[key_path]).tobytes() == raw, key_path


def test_appendix_b_refuses_missing_chunks(tmp_path, monkeypatch):
    """§1.3 / Appendix B: the zarr-python reader checks the commit state and that every chunk
    exists (zarr-python alone would return fill values)."""
    ns: dict[str, Any] = {}
    monkeypatch.chdir(tmp_path)
    exec(compile(spec_examples()["zarr-python"].split("\nstate = read_checkpoint")[0], "appendix-b", "exec"), ns)
    zarrckpt.save({"w": torch.ones(6, 4), "big": torch.ones(300, 64)}, tmp_path / "c", pack_bytes=0,
                  inner_chunk_bytes=1024)
    assert ns["read_checkpoint"](str(tmp_path / "c"))["w"].tolist() == [[1.0] * 4] * 6
    os.remove(tmp_path / "c" / "big" / "c" / "0" / "0")
    with pytest.raises(AssertionError, match="missing chunks"):
        ns["read_checkpoint"](str(tmp_path / "c"))


def test_spec_edge_shard_example_is_the_golden_file():
    """§5.3's example ([10, 2] float32 over 4 processes, inner chunks [1, 2]) is
    tests/golden/v1.0/four_ranks_dtensor/edge_padding: inner chunks 1 and 2 of shard 3 absent."""
    base = REPO / "tests" / "golden" / "v1.0" / "four_ranks_dtensor" / "edge_padding"
    doc = json.loads((base / "zarr.json").read_text())
    assert doc["shape"] == [10, 2] and doc["chunk_grid"]["configuration"]["chunk_shape"] == [3, 2]
    assert doc["codecs"][0]["configuration"]["chunk_shape"] == [1, 2]
    check_shard_index(base / "c" / "3" / "0", [3, 0], [10, 2], [3, 2], [1, 2], "edge_padding")
    data = (base / "c" / "3" / "0").read_bytes()
    entries = np.frombuffer(data[-52:-4], dtype="<u8").reshape(3, 2)
    assert (entries[1:] == 2**64 - 1).all() and entries[0, 1] == 12


def test_content_hashes_are_in_the_schema(tmp_path):
    """Spec §6.6.2: a root with ``digests.content`` (incremental saves) is valid; another
    algorithm or a value that is not base64 is not."""
    import torch

    import zarrckpt

    zarrckpt.save({"w": torch.ones(4, 8), "b": torch.zeros(3)}, tmp_path / "c", content_hashes=True)
    root = json.loads((tmp_path / "c" / "zarr.json").read_text())
    content = root["attributes"]["zarrckpt"]["digests"]["content"]
    assert content["algorithm"] == "xxh3-128" and set(content["chunks"]) == {"w", "b"}
    assert_valid("rootDocument", root)
    content["algorithm"] = "md5"
    assert not is_valid("rootDocument", root)
    content["algorithm"] = "xxh3-128"
    content["chunks"]["w"] = "not base64!"
    assert not is_valid("rootDocument", root)
