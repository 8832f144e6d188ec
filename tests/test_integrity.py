"""Metadata integrity (spec §6.6) and hostile checkpoints on storage (spec §3.2, §5, §6).

Every byte that decides what a reader returns is verified: a flipped bit in the root
``zarr.json`` (tree, values, packed offsets, digests), in an array ``zarr.json`` or in a chunk
(crc32c) is an error, never a different value. Files that are not regular files cannot hang
a reader. Paths that hold another format say what they are.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _v11 import as_format_1_1

import zarrckpt
import zarrckpt.inspect
from zarrckpt import errors
from zarrckpt.format import documents as fmt

REPO = Path(__file__).resolve().parent.parent


def small_state() -> dict:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                  "b": torch.tensor([0.5, -1.0], dtype=torch.bfloat16)},
        "big": torch.arange(20000, dtype=torch.float32),  # an array of its own (> pack_bytes)
        "step": 1000,
        "lr": [0.1, float("inf")],
        "rng": b"\x01\x02\x03",
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("integrity") / "ckpt"
    zarrckpt.save(small_state(), path, pack_bytes=64 << 10)  # packed leaves (deprecated) are still checked
    return path


@pytest.fixture(scope="module")
def saved_v11(saved, tmp_path_factory) -> Path:
    """``saved`` as a 1.1 checkpoint (no consolidated metadata, spec §6.7): its readers read
    and digest-check every array ``zarr.json`` (§6.6), which 1.2 readers take from the root."""
    return as_format_1_1(copy_of(saved, tmp_path_factory.mktemp("integrity11") / "ckpt"))


def copy_of(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def root_attrs(path: Path) -> dict:
    return json.loads((path / "zarr.json").read_bytes())["attributes"]["zarrckpt"]


def read_everything(path: Path) -> None:
    ckpt = zarrckpt.open(path)
    for key in ckpt.keys():
        ckpt.read(key)
    zarrckpt.load_state_dict(path)


# ------------------------------------------------------------------ what a save records


def test_committed_root_records_digests_of_every_array_and_itself(saved):
    attrs = root_attrs(saved)
    assert attrs["version"] == fmt.FORMAT_VERSION == "1.3"
    digests = attrs["digests"]
    assert digests["algorithm"] == "sha256"
    assert set(digests["arrays"]) == {"big", ".packs/0"} and attrs["num_arrays"] == 2
    for path, want in digests["arrays"].items():
        data = (saved / path / "zarr.json").read_bytes()
        assert fmt.sha256_hex(data) == want
        assert fmt.encode_document(json.loads(data)) == data  # written with encode_document
    raw = (saved / "zarr.json").read_bytes()
    assert fmt.encode_document(json.loads(raw)) == raw
    assert fmt.root_digest(raw, digests["root"]) == digests["root"]
    # the recipe of §6.6, in plain Python
    import hashlib

    zeroed = raw.replace(digests["root"].encode(), b"0" * 64)
    assert hashlib.sha256(zeroed).hexdigest() == digests["root"]


def test_root_metadata_builds_a_verifiable_root():
    docs = {"a": {"x": 1}, ".packs/0": {"y": [1, 2]}}
    doc = fmt.root_metadata(state="committed", save_id="a" * 30, world_size=1, created="2026-11-26T00:00:00Z",
                            writer={"zarrckpt": "x"}, tree={"dict": []}, array_docs=docs,
                            metadata={"step": 3})
    attrs = doc["attributes"]["zarrckpt"]
    assert list(attrs["digests"]["arrays"]) == [".packs/0", "a"]  # sorted by path
    assert attrs["num_arrays"] == 2 and attrs["metadata"] == {"step": 3}
    data = fmt.encode_document(doc)
    assert fmt.root_digest(data, attrs["digests"]["root"]) == attrs["digests"]["root"]
    with pytest.raises(ValueError, match="num_arrays"):
        fmt.root_metadata(state="committed", save_id="a" * 30, world_size=1, created="x", writer={},
                          tree={"dict": []}, num_arrays=3, array_docs=docs)
    pending = fmt.root_metadata(state="pending", save_id="a" * 30, world_size=1, created="x", writer={})
    assert "digests" not in pending["attributes"]["zarrckpt"]
    with pytest.raises(errors.UnsupportedValueError, match="metadata"):
        fmt.root_metadata(state="committed", save_id="a" * 30, world_size=1, created="x", writer={},
                          tree={"dict": []}, array_docs={}, metadata={"bad": float("nan")})


# ------------------------------------------------------------------ flipped bits


def test_every_bit_flip_of_the_root_is_refused(saved):
    raw = (saved / "zarr.json").read_bytes()
    fmt.parse_root_bytes(raw, "x")
    for i in range(len(raw)):
        for bit in range(8):
            bad = bytearray(raw)
            bad[i] ^= 1 << bit
            with pytest.raises(errors.ZarrckptError):
                fmt.parse_root_bytes(bytes(bad), "x")


def test_bit_flips_of_the_root_fail_open_on_storage(saved, tmp_path):
    """The same through zarrckpt.open (a byte in ~40, one bit each), never a different value."""
    path = copy_of(saved, tmp_path / "c")
    raw = (saved / "zarr.json").read_bytes()
    for i in range(0, len(raw), 41):
        bad = bytearray(raw)
        bad[i] ^= 1 << (i % 8)
        (path / "zarr.json").write_bytes(bytes(bad))
        with pytest.raises(errors.ZarrckptError):
            read_everything(path)


def test_every_bit_flip_of_an_array_zarr_json_is_refused(saved_v11, tmp_path):
    saved = saved_v11
    path = copy_of(saved, tmp_path / "c")
    for array, key in (("big", "big"), (".packs/0", "model/w")):
        raw = (saved / array / "zarr.json").read_bytes()
        for i in range(len(raw)):
            bad = bytearray(raw)
            bad[i] ^= 1 << (i % 8)
            (path / array / "zarr.json").write_bytes(bytes(bad))
            with pytest.raises(errors.IntegrityError, match=repr(key)):
                zarrckpt.open(path).read(key)
        (path / array / "zarr.json").write_bytes(raw)
    read_everything(path)


def test_a_1_2_reader_takes_array_metadata_from_the_root_and_verify_checks_the_documents(saved, tmp_path):
    """Format 1.2 (spec §6.7): an edited array zarr.json changes nothing zarrckpt returns
    (the metadata comes from the root, under its digest), and verify reports the document."""
    path = copy_of(saved, tmp_path / "c")
    f = path / "big" / "zarr.json"
    f.write_bytes(f.read_bytes().replace(b'"shape":[20000]', b'"shape":[19000]'))
    assert zarrckpt.open(path)["big"].shape == (20000,)
    read_everything(path)
    report = zarrckpt.inspect.verify(path)
    assert [(p.kind, p.array) for p in report.problems] == [("digest", "big")]


@pytest.mark.parametrize("edit", ["shape", "step", "offset", "digest", "version", "drop digests"])
def test_the_edits_of_issue_7_are_caught(saved_v11, tmp_path, edit):
    """A shape [20000] -> [19000], a value 1000 -> 1001, a packed offset, a recorded digest,
    the version, the digests themselves: each is an error, naming what changed (a 1.1
    checkpoint: the array zarr.json is read; 1.2 readers take it from the root)."""
    path = copy_of(saved_v11, tmp_path / "c")
    root = (path / "zarr.json").read_bytes()
    if edit == "shape":
        f = path / "big" / "zarr.json"
        f.write_bytes(f.read_bytes().replace(b'"shape":[20000]', b'"shape":[19000]'))
        expect, key = errors.IntegrityError, "big"
    else:
        change = {"step": (b'"json":1000', b'"json":1001'), "offset": (b'"offset":0,', b'"offset":8,'),
                  "version": (b'"version":"1.1"', b'"version":"1.0"'),
                  "drop digests": (b'"digests"', b'"digestz"')}.get(edit)
        if edit == "digest":
            h = root_attrs(path)["digests"]["arrays"]["big"]
            change = (h.encode(), ("0" if h[0] != "0" else "1").encode() + h[1:].encode())
        assert root.count(change[0]) == 1, edit
        (path / "zarr.json").write_bytes(root.replace(*change))
        expect, key = (errors.FormatError if edit == "drop digests" else errors.IntegrityError), "zarr.json"
    with pytest.raises(expect, match=key) as ei:
        read_everything(path)
    assert isinstance(ei.value, errors.FormatError)


def test_in_place_load_verifies_digests(saved_v11, tmp_path):
    path = copy_of(saved_v11, tmp_path / "c")
    f = path / "big" / "zarr.json"
    f.write_bytes(f.read_bytes().replace(b'"fill_value":0', b'"fill_value":1'))
    target = small_state()
    with pytest.raises(errors.IntegrityError, match="'big'"):
        zarrckpt.load(target, path)


def test_a_flipped_chunk_bit_is_refused(saved, tmp_path):
    """Chunks carry CRC-32C (§5.5): a flipped bit in data is refused too."""
    path = copy_of(saved, tmp_path / "c")
    for chunk, key in ((path / "big" / "c" / "0", "big"), (path / ".packs" / "0" / "c" / "0", "model/w")):
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x10
        chunk.write_bytes(bytes(data))
        with pytest.raises(errors.CorruptChunkError):
            zarrckpt.open(path).read(key)


def test_format_1_0_without_digests_still_reads():
    """Golden 1.0 checkpoints carry no digests; they read, structurally checked only."""
    path = REPO / "tests" / "golden" / "v1.0" / "one_packed"
    info = zarrckpt.open(path).info
    assert info.version == "1.0" and info.array_digests is None


# ------------------------------------------------------------------ hostile trees on storage


def rewrite_root(path: Path, change) -> None:
    """Apply ``change(attrs)`` to the root and reseal it (a hostile writer, not damage)."""
    doc = json.loads((path / "zarr.json").read_bytes())
    attrs = doc["attributes"]["zarrckpt"]
    change(attrs)
    attrs["digests"]["root"] = fmt.ZERO_DIGEST
    attrs["digests"]["root"] = fmt.sha256_hex(fmt.encode_document(doc))
    (path / "zarr.json").write_bytes(fmt.encode_document(doc))


def _set_node(attrs: dict, key: str, node: dict) -> None:
    for entry in attrs["tree"]["dict"]:
        if entry[0] == key:
            entry[1] = node


@pytest.mark.parametrize("name,change,match", [
    ("array node naming another key's array",
     lambda a: a["tree"]["dict"].append(["other", {"array": "big"}]), "own key's array"),
    ("array node naming a pack",
     lambda a: _set_node(a, "big", {"array": ".packs/0"}), "own key's array"),
    ("array node outside the checkpoint",
     lambda a: _set_node(a, "big", {"array": "../ckpt2/big"}), "own key's array"),
    ("keys 3 and '3' in one dict",
     lambda a: a["tree"]["dict"].extend([[3, {"json": 1}], ["3", {"json": 2}]]), "same stored name"),
    ("duplicate keys", lambda a: a["tree"]["dict"].append(["step", {"json": 1}]), "duplicate key"),
    ("packed range outside its pack",
     lambda a: a["tree"]["dict"][0][1]["dict"][0][1]["packed"].update(offset=4096), "outside pack"),
    ("a tree 300 levels deep", lambda a: a["tree"]["dict"].append(
        ["deep", __import__("functools").reduce(lambda n, _: {"list": [n]}, range(300), {"json": 1})]),
     "levels deep"),
    ("a value 600 levels deep",
     lambda a: _set_node(a, "lr", {"json": __import__("functools").reduce(lambda v, _: [v], range(600), 1)}),
     "nested too deeply|levels deep"),
    ("num_arrays off by one", lambda a: a.update(num_arrays=3), "num_arrays"),
])
def test_hostile_trees_are_refused_at_open(saved, tmp_path, name, change, match):
    path = copy_of(saved, tmp_path / "c")
    rewrite_root(path, change)
    with pytest.raises(errors.FormatError, match=match):
        read_everything(path)


def test_hostile_array_documents_are_refused_when_read(saved_v11, tmp_path):
    """A resealed checkpoint whose array zarr.json is hostile: a list, or attributes that are
    not an object (the digest matches: a hostile writer, not damage)."""
    for bad in ([1, 2], {"zarr_format": 3, "node_type": "array", "attributes": 5}):
        path = copy_of(saved_v11, tmp_path / f"c{len(str(bad))}")
        data = fmt.encode_document(bad) if isinstance(bad, dict) else json.dumps(bad).encode()
        (path / "big" / "zarr.json").write_bytes(data)
        rewrite_root(path, lambda a: a["digests"]["arrays"].update(big=fmt.sha256_hex(data)))
        with pytest.raises(errors.FormatError, match="'big'"):
            zarrckpt.open(path).read("big")


# ------------------------------------------------------------------ the writing side


@pytest.mark.parametrize("bad,match", [
    ({"deep": __import__("functools").reduce(lambda v, _: {"x": v}, range(40), {"w": torch.ones(1)})},
     "more than 32 levels"),
    ({"deep_value": __import__("functools").reduce(lambda v, _: [v], range(40), 1)}, "more than 32 levels"),
    ({"key\udc80": torch.ones(1)}, "not valid Unicode"),
    ({"s": "text\ud800"}, "not valid Unicode"),
    ({"n": 10**1200}, "more than 1000 decimal digits"),
    ({3: 1, "3": 2}, "same stored name"),
])
def test_writers_refuse_before_anything_is_written(tmp_path, bad, match):
    """Planning refuses (§6.2 limits); an existing checkpoint at the path stays as it was."""
    zarrckpt.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(errors.UnsupportedValueError, match=match):
        zarrckpt.save(bad, tmp_path / "c", overwrite=True)
    assert zarrckpt.open(tmp_path / "c").read("w").tolist() == [1.0, 1.0]
    with pytest.raises(errors.UnsupportedValueError, match=match):
        zarrckpt.save(bad, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_subclasses_of_plain_values_are_stored_as_their_base_type(tmp_path):
    """§6.2: int/float/str subclasses (IntEnum, numpy.float64, str subclasses) are stored and
    read back as int/float/str."""
    import enum

    class Color(enum.IntEnum):
        RED = 1

    class Name(str):
        pass

    state = {"c": Color.RED, "f": np.float64(0.25), "s": Name("x"), "k": {Color.RED: "one"}}
    zarrckpt.save(state, tmp_path / "c")
    tree = root_attrs(tmp_path / "c")["tree"]
    assert dict(tree["dict"])["k"] == {"dict": [[1, {"json": "one"}]]}
    back = zarrckpt.load_state_dict(tmp_path / "c")
    assert back == {"c": 1, "f": 0.25, "s": "x", "k": {1: "one"}}
    assert [type(back[k]) for k in "cfs"] == [int, float, str]


# ------------------------------------------------------------------ non-regular files never hang


FIFO_SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys
    sys.path.insert(0, {repo!r})
    import torch, zarrckpt
    base = {base!r}
    src = os.path.join(base, "src")
    zarrckpt.save({{"w": torch.ones(3), "w2": torch.ones(2), "big": torch.ones(20000), "v": 1}}, src,
                  pack_bytes=64 << 10)
    out = {{}}
    for name, rel, key in [("chunk", "big/c/0", "big"), ("array zarr.json", "big/zarr.json", "big"),
                           ("pack chunk", ".packs/0/c/0", "w"), ("pack zarr.json", ".packs/0/zarr.json", "w"),
                           ("root zarr.json", "zarr.json", None), ("chunk as a directory", "big/c/0", "big")]:
        dst = os.path.join(base, name.replace(" ", "_"))
        shutil.copytree(src, dst)
        os.remove(os.path.join(dst, rel))
        if "directory" in name:
            os.mkdir(os.path.join(dst, rel))
        else:
            os.mkfifo(os.path.join(dst, rel))
        try:
            c = zarrckpt.open(dst)
            v = c.read(key)
            out[name] = ["read", [float(x) for x in v.reshape(-1)[:2]]]
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
        from zarrckpt.readers.verify import verify
        report = verify(dst)
        out[name].append([p.message for p in report.problems])
    print(json.dumps(out))
""")


def test_non_regular_files_are_refused_without_hanging(tmp_path):
    code = FIFO_SCRIPT.format(repo=str(REPO), base=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (cls, msg, problems) in out.items():
        assert problems or name == "root zarr.json", name  # verify walks every file
        if name in ("array zarr.json", "pack zarr.json"):
            # the consolidated root holds the array's metadata: a load never opens its zarr.json
            assert (cls, msg) == ("read", [1.0, 1.0]), (name, cls, msg)
            continue
        assert cls in ("FormatError", "CorruptChunkError"), (name, cls, msg)
        if "directory" not in name:
            assert "FIFO" in msg, (name, msg)
    assert out["chunk as a directory"][0] in ("FormatError", "CorruptChunkError")


# ------------------------------------------------------------------ other formats at the path


@pytest.mark.parametrize("layout,expect", [
    ({".metadata": b"x", "__0_0.distcp": b"x"}, "PyTorch Distributed Checkpoint"),
    ({"model.safetensors": b"x"}, "safetensors"),
    ({"model.safetensors.index.json": b"{}", "model-00001-of-00002.safetensors": b"x"}, "safetensors"),
    ({"pytorch_model.bin": b"x"}, "torch.save"),
    ({"step_10.pt": b"x"}, "torch.save"),
    ({}, r"no zarr\.json"),
    ({"notes.txt": b"x"}, r"no zarr\.json"),
])
def test_not_found_says_what_is_there(tmp_path, layout, expect):
    path = tmp_path / "d"
    path.mkdir()
    for name, data in layout.items():
        (path / name).write_bytes(data)
    with pytest.raises(errors.CheckpointNotFoundError, match=expect) as ei:
        zarrckpt.open(path)
    if expect != r"no zarr\.json":
        assert "zarrckpt.convert" in str(ei.value) and "from_" in str(ei.value)


@pytest.mark.parametrize("name,expect", [("model.safetensors", "safetensors file"), ("ckpt.pt", "torch.save file"),
                                         ("ckpt.pth", "torch.save file"), ("w.bin", "torch.save file"),
                                         ("notes.txt", "is a file")])
def test_a_file_is_not_a_checkpoint(tmp_path, name, expect):
    (tmp_path / name).write_bytes(b"x")
    with pytest.raises(errors.CheckpointNotFoundError, match=expect):
        zarrckpt.open(tmp_path / name)
    with pytest.raises(FileNotFoundError):  # CheckpointNotFoundError is one
        zarrckpt.load_state_dict(tmp_path / name)


# ------------------------------------------------------------------ TensorStore handles, packed keys too


def test_tensorstore_of_packed_and_unpacked_keys(saved):
    ckpt = zarrckpt.open(saved)
    assert ckpt.is_packed("model/w") and not ckpt.is_packed("big")
    for key in ("model/w", "model/b", "big"):
        ts_arr = ckpt.tensorstore(key)
        want = ckpt.read(key)
        assert tuple(ts_arr.shape) == want.shape and str(ts_arr.dtype.numpy_dtype) == str(want.dtype)
        assert ts_arr.read().result().tobytes() == want.tobytes()
    assert ckpt.tensorstore("model/w")[1:3, 0:2].read().result().tolist() == [[4.0, 5.0], [8.0, 9.0]]
    assert ckpt.tensorstore("rng").read().result().tobytes() == b"\x01\x02\x03"
    with pytest.raises(KeyError):
        ckpt.tensorstore("step")


def test_bytesio_is_stored_like_bytes(tmp_path):
    """§5.6: kind bytesio is a 1-d uint8 array (or packed); readers return its bytes."""
    for pack_bytes in (0, 1 << 16):
        path = tmp_path / f"c{pack_bytes}"
        zarrckpt.save({"buf": io.BytesIO(b"abc"), "x": torch.ones(2)}, path, pack_bytes=pack_bytes)
        ckpt = zarrckpt.open(path)
        assert ckpt.read("buf") == b"abc"
        assert ckpt.array_info("buf").kind == "bytesio"


def _relabel_1_0(path: Path) -> None:
    """A hostile edit: the root relabelled format 1.0, its digests (and 1.2's consolidated
    metadata) dropped, so that no document would be digest-checked."""
    doc = json.loads((path / "zarr.json").read_bytes())
    doc.pop("consolidated_metadata", None)
    attrs = doc["attributes"]["zarrckpt"]
    attrs["version"] = "1.0"
    attrs.pop("digests")
    (path / "zarr.json").write_bytes(fmt.encode_document(doc))


@pytest.mark.parametrize("state, what", [
    ({"w": torch.ones(3)}, "metadata"),
    ({"buf": __import__("io").BytesIO(b"abc")}, "bytesio"),
])
def test_a_checkpoint_relabelled_1_0_to_drop_its_digests_is_refused(tmp_path, state, what):
    """Spec §9/§10 (review item B15): what 1.0 cannot hold (metadata, the bytesio and
    sharded_tensor kinds) marks a later checkpoint relabelled 1.0."""
    path = tmp_path / "c"
    zarrckpt.save(state, path, metadata={"step": 1} if what == "metadata" else None)
    _relabel_1_0(path)
    with pytest.raises(errors.FormatError, match="1.0"):
        read_everything(path)


def test_consolidated_metadata_of_a_root_before_1_2_is_ignored(saved_v11, tmp_path):
    """Only a 1.2 root's digest covers consolidated metadata: an older root's (a generic tool
    may add one) is not used; the array documents are read and digest-checked."""
    path = copy_of(saved_v11, tmp_path / "c")
    doc = json.loads((path / "zarr.json").read_bytes())
    forged = json.loads((path / "big" / "zarr.json").read_bytes())
    forged["shape"] = [7]
    doc["consolidated_metadata"] = {"kind": "inline", "must_understand": False,
                                    "metadata": {"big": forged, ".packs": {"zarr_format": 3, "node_type": "group"},
                                                 ".packs/0": json.loads((path / ".packs/0/zarr.json").read_bytes())}}
    attrs = doc["attributes"]["zarrckpt"]
    attrs["digests"]["root"] = fmt.ZERO_DIGEST
    attrs["digests"]["root"] = fmt.sha256_hex(fmt.encode_document(doc))
    (path / "zarr.json").write_bytes(fmt.encode_document(doc))
    assert zarrckpt.open(path)["big"].shape == (20000,)
    read_everything(path)


# ------------------------------------------------ shard index entries of padding inner chunks

EDGE = REPO / "tests" / "golden" / "v1.2" / "four_ranks_dtensor"  # "edge_padding": [10, 2], chunks [9, 2],
# inner chunks [1, 2]: chunk [1, 0] holds row 9, its inner chunks [1, 0] ... [8, 0] lie wholly in padding


def _set_index_entry(shard: Path, entry: int, off: int, nbytes: int) -> None:
    """Rewrite one (offset, nbytes) entry of a shard's index, with a correct index CRC-32C."""
    import crc32c

    data = bytearray(shard.read_bytes())
    count = 9
    start = len(data) - (16 * count + 4)
    table = np.frombuffer(bytes(data[start:-4]), "<u8").reshape(count, 2).copy()
    table[entry] = (off, nbytes)
    data[start:-4] = table.tobytes()
    data[-4:] = crc32c.crc32c(bytes(data[start:-4])).to_bytes(4, "little")
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("entry,where", [(1, "outside"), (8, "outside"), (1, "over the index"),
                                         (1, "overflowing")])
def test_padding_index_entry_outside_its_shard_is_refused(tmp_path, entry, where):
    """§5.5: a present index entry MUST lie wholly inside the shard, before its index, and
    readers MUST refuse one that does not -- also the entry of an inner chunk wholly in the
    padding, which no reader needs to decode. Every read path refuses it, naming the array,
    the chunk and the inner chunk."""
    path = copy_of(EDGE, tmp_path / "c")
    shard = path / "edge_padding" / "c" / "1" / "0"
    end = shard.stat().st_size - (16 * 9 + 4)  # where the inner chunks end (12 bytes: row 9 + CRC)
    off, nbytes = {"outside": (4096, 12), "over the index": (end - 4, 12),
                   "overflowing": (2**64 - 2, 12)}[where]
    _set_index_entry(shard, entry, off, nbytes)
    match = r"array 'edge_padding': chunk c/1/0 inner chunk \[%d, 0\]: index entry .* outside" % entry
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.open(path).read("edge_padding")
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.load_state_dict(path, ["edge_padding"])
    target = {"edge_padding": torch.zeros(10, 2)}
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.load(target, path, strict=False)


def test_padding_index_entry_inside_its_shard_is_read(tmp_path):
    """The MUST-read counterpart: a present entry of a padding inner chunk that lies inside
    the shard (here: over row 9's bytes) is not decoded, and the array reads as saved."""
    path = copy_of(EDGE, tmp_path / "c")
    want = zarrckpt.open(EDGE).read("edge_padding")
    _set_index_entry(path / "edge_padding" / "c" / "1" / "0", 3, 0, 12)
    assert np.array_equal(zarrckpt.open(path).read("edge_padding"), want)
    assert np.array_equal(zarrckpt.load_state_dict(path, ["edge_padding"])["edge_padding"].numpy(), want)


@pytest.mark.parametrize("entry,where", [(1, "outside"), (8, "over the index"), (1, "overflowing")])
def test_padding_index_entry_outside_its_shard_is_refused_through_tensorstore(tmp_path, entry, where):
    """The same rule on the TensorStore path (object stores, compressed arrays,
    ``chunk_io="tensorstore"``), which checks only the entries it decodes: an edge shard's
    index is read and its present padding entries checked (issue 28 item 11, reader rule A4);
    one inside the shard still reads."""
    ts_opts = zarrckpt.StorageOptions(chunk_io="tensorstore")
    path = copy_of(EDGE, tmp_path / "c")
    shard = path / "edge_padding" / "c" / "1" / "0"
    end = shard.stat().st_size - (16 * 9 + 4)
    want = zarrckpt.open(EDGE).read("edge_padding")
    _set_index_entry(shard, 3, 0, 12)  # inside: read as saved
    assert np.array_equal(zarrckpt.load_state_dict(path, ["edge_padding"], storage=ts_opts)["edge_padding"].numpy(),
                          want)
    off, nbytes = {"outside": (4096, 12), "over the index": (end - 4, 12), "overflowing": (2**64 - 2, 12)}[where]
    _set_index_entry(shard, entry, off, nbytes)
    match = r"array 'edge_padding': chunk c/1/0 inner chunk \[%d, 0\]: index entry .* outside" % entry
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.load_state_dict(path, ["edge_padding"], storage=ts_opts)
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.load({"edge_padding": torch.zeros(10, 2)}, path, strict=False, storage=ts_opts)


JSONV = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8)
                     | st.just("0" * 64),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                     max_leaves=8)
PATHS = st.lists(st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
                         min_size=1, max_size=5), min_size=1, max_size=3).map("/".join)


@given(docs=st.dictionaries(PATHS, st.dictionaries(st.text(max_size=5), JSONV, max_size=3), max_size=5),
       metadata=st.dictionaries(st.text(max_size=6), JSONV, max_size=3),
       trap=st.booleans())
def test_committed_root_bytes_are_its_plain_json_encoding(docs, metadata, trap):
    """root_metadata puts the root's bytes together from its array documents' encodings and
    writes the digest in place of the zeros; they must be exactly the compact JSON of the
    document (spec §3.1), also when a user value spells the digests' own members."""
    if trap:
        metadata = {**metadata, "digests": {"algorithm": "sha256", "root": "0" * 64}}
    docs = {p: d for p, d in docs.items() if not any(q.startswith(p + "/") for q in docs)}
    doc = fmt.root_metadata(state="committed", save_id="a" * 30, world_size=1, created="2026-11-26T00:00:00Z",
                            writer={"zarrckpt": "x"}, tree={"dict": []}, array_docs=docs, metadata=metadata)
    data = fmt.root_bytes(doc)
    assert data == json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()
    assert data == fmt.encode_document(doc)
    digest = doc["attributes"]["zarrckpt"]["digests"]["root"]
    assert fmt.root_digest(data, digest) == digest
