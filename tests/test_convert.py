"""zarrckpt.convert: bit-exact round trips between zarrckpt and safetensors, torch.save and
DCP (both ways, every pair), names and dtypes kept, key selection, casting, bad inputs."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.tools import convert
from zarrckpt.format import dtypes
from zarrckpt.errors import (CheckpointExistsError, CheckpointNotFoundError, FormatError,
                             UnsupportedValueError)

st = pytest.importorskip("safetensors.torch")

SMALL = 1 << 20  # memory_limit: 64 KiB pieces, so the larger tensors go in many pieces


def random_bits(shape, dtype, seed):
    """Every bit pattern, NaN payloads included: round trips must keep bits, not values."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def tensors() -> dict[str, torch.Tensor]:
    return {
        "model.embed.weight": random_bits((300, 129), torch.float32, 0),  # 155 KB: several pieces
        "model.layers.0.attn.weight": random_bits((64, 48), torch.bfloat16, 1),
        "model.layers.0.mlp.weight": random_bits((33, 17), torch.float16, 2),
        "model.layers.0.fp8": random_bits((5, 7), torch.float8_e4m3fn, 3),
        "model.layers.0.fp8_e5m2": random_bits((11,), torch.float8_e5m2, 4),
        "model.norm.scale": random_bits((), torch.bfloat16, 5),  # 0-d
        "model.empty": torch.empty(0, 4),
        "model.empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "ids": torch.arange(-5, 20, dtype=torch.int64),
        "mask": random_bits((9,), torch.bool, 6),
        "bytes_u8": random_bits((70000,), torch.uint8, 7),  # over pack_bytes: an array of its own
        "weird/name with spaces.%": random_bits((3,), torch.float64, 8),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def assert_same(got: dict, want: dict) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for k in want:
        assert same(got[k], want[k]), k


def load_zarr_flat(path) -> dict[str, torch.Tensor]:
    ckpt = zarrckpt.open(path)
    out = {}
    for k in ckpt.array_keys():
        a = ckpt.read(k)
        out[zarrckpt.format.tree.unescape(k) if "/" not in k else k] = dtypes.from_numpy(np.array(a), dtypes.by_numpy(a.dtype))
    return out


def load_safetensors_folder(folder) -> dict[str, torch.Tensor]:
    out = {}
    for n in sorted(os.listdir(folder)):
        if n.endswith(".safetensors"):
            out.update(st.load_file(os.path.join(folder, n)))
    return out


# ------------------------------------------------------------------ safetensors


@pytest.mark.parametrize("shard", [None, 40_000])
def test_safetensors_round_trip(tmp_path, shard):
    want = tensors()
    st.save_file(want, tmp_path / "in.safetensors", metadata={"format": "pt", "note": "kept"})
    r = convert.from_safetensors(tmp_path / "in.safetensors", tmp_path / "ck", memory_limit=SMALL)
    assert r.arrays == len(want) and not r.skipped
    assert_same(load_zarr_flat(tmp_path / "ck"), want)  # one key per name, unchanged
    assert zarrckpt.open(tmp_path / "ck").info.metadata["safetensors_metadata"] == {"format": "pt", "note": "kept"}
    r = convert.to_safetensors(tmp_path / "ck", tmp_path / "out", max_shard_size=shard, memory_limit=SMALL)
    files = sorted(os.listdir(tmp_path / "out"))
    if shard is None:
        assert files == ["model.safetensors"]
    else:
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and shards == [f for f in files if f.endswith(".safetensors")]
        assert sorted(index["weight_map"]) == sorted(want)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    assert_same(load_safetensors_folder(tmp_path / "out"), want)
    with open(tmp_path / "out" / files[0], "rb") as fh:  # the safetensors metadata came back
        n = int.from_bytes(fh.read(8), "little")
        assert json.loads(fh.read(n))["__metadata__"] == {"format": "pt", "note": "kept"}


def test_sharded_index_in(tmp_path):
    """A sharded checkpoint whose tensors are split across three files by its index."""
    want = tensors()
    names = sorted(want)
    parts = [names[0::3], names[1::3], names[2::3]]
    folder = tmp_path / "hf"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        st.save_file({n: want[n] for n in part}, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1},
                                                                     "weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    assert convert.detect_format(folder) == "safetensors"
    r = convert.convert(folder, tmp_path / "ck", memory_limit=SMALL)
    assert r.source_format == "safetensors" and r.arrays == len(want)
    assert_same(load_zarr_flat(tmp_path / "ck"), want)


def test_single_file_out_and_existing(tmp_path):
    want = tensors()
    st.save_file(want, tmp_path / "in.safetensors")
    convert.from_safetensors(tmp_path / "in.safetensors", tmp_path / "ck")
    out = tmp_path / "one.safetensors"
    convert.to_safetensors(tmp_path / "ck", out)
    assert_same(st.load_file(out), want)
    with pytest.raises(CheckpointExistsError):
        convert.to_safetensors(tmp_path / "ck", out)
    with pytest.raises(CheckpointExistsError):  # a committed checkpoint is not replaced silently
        convert.from_safetensors(tmp_path / "in.safetensors", tmp_path / "ck")
    convert.from_safetensors(tmp_path / "in.safetensors", tmp_path / "ck", overwrite=True)
    # an export replaces an earlier one with other shards, and keeps the folder's other files
    folder = tmp_path / "hf"
    convert.to_safetensors(tmp_path / "ck", folder, max_shard_size=40_000)
    (folder / "config.json").write_text("{}")
    convert.to_safetensors(tmp_path / "ck", folder, overwrite=True)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]


# ------------------------------------------------------------------ torch.save


def nested_state() -> dict:
    t = tensors()
    return {
        "model": {k: v for k, v in t.items() if k.startswith("model.")},
        "optim": {"state": {0: {"exp_avg": t["model.layers.0.attn.weight"].clone(), "step": torch.tensor(7.0)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "list": [t["ids"], (t["mask"], "x")],
        "step": 12,
        "nan": float("nan"),
        "blob": b"\x00\x01raw",
        "weird/name with spaces.%": t["weird/name with spaces.%"],
        "big": t["bytes_u8"],
    }


def assert_nested_same(got, want, where="") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_nested_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_nested_same(a, b, f"{where}/{i}")
    elif isinstance(want, float) and want != want:
        assert got != got, where
    else:
        assert got == want and type(got) is type(want), where


def test_torch_save_round_trip(tmp_path):
    want = nested_state()
    torch.save(want, tmp_path / "in.pt")
    r = convert.from_torch_save(tmp_path / "in.pt", tmp_path / "ck", memory_limit=SMALL)
    assert not r.skipped
    ckpt = zarrckpt.open(tmp_path / "ck")
    assert "model/model.layers.0.attn.weight" in ckpt and "optim/state/0/exp_avg" in ckpt
    assert_nested_same(zarrckpt.load_state_dict(tmp_path / "ck"), want)
    convert.to_torch_save(tmp_path / "ck", tmp_path / "out.pt", memory_limit=SMALL)
    with zipfile.ZipFile(tmp_path / "out.pt") as zf:
        assert zf.testzip() is None  # every record's CRC-32 is right
    assert_nested_same(torch.load(tmp_path / "out.pt", weights_only=True), want)


def test_torch_save_views_and_single_tensor(tmp_path):
    base = random_bits((40, 30), torch.float32, 9)
    want = {"t": base.t(), "cols": base[:, 3:7], "rows": base[10:12], "shared": base}
    torch.save(want, tmp_path / "views.pt")  # views keep their strides and the whole storage
    convert.from_torch_save(tmp_path / "views.pt", tmp_path / "ck", memory_limit=64 << 10)
    got = zarrckpt.load_state_dict(tmp_path / "ck")
    for k, v in want.items():
        assert same(got[k], v.contiguous()), k
    torch.save(base, tmp_path / "one.pt")
    convert.from_torch_save(tmp_path / "one.pt", tmp_path / "ck1")
    assert same(zarrckpt.load_state_dict(tmp_path / "ck1")["value"], base)


# ------------------------------------------------------------------ DCP


def test_dcp_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    want = nested_state()
    want["rng"] = io.BytesIO(b"raw bytes io")
    dcp.save(want, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(CheckpointNotFoundError, match="DCP"):  # reader.py names what it is
        zarrckpt.open(tmp_path / "dcp")
    assert convert.detect_format(tmp_path / "dcp") == "dcp"
    convert.from_dcp(tmp_path / "dcp", tmp_path / "ck", memory_limit=SMALL)
    got = zarrckpt.load_state_dict(tmp_path / "ck")
    assert zarrckpt.open(tmp_path / "ck").node("rng")  # the BytesIO leaf
    assert got.pop("rng").getvalue() == b"raw bytes io"
    want.pop("rng")
    # DCP flattens: dict keys become strings (its own loader rebuilds them so); a tuple is
    # one DCP value, kept whole
    want["optim"]["state"] = {"0": want["optim"]["state"][0]}
    assert_nested_same(got, want)
    convert.to_dcp(tmp_path / "ck", tmp_path / "dcp2", memory_limit=SMALL)  # big tensors: several chunks
    dcp_to_torch_save(tmp_path / "dcp2", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=False)
    assert back.pop("rng").getvalue() == b"raw bytes io"
    assert_nested_same(back, want)  # the tuple (of a tensor and a str) is one DCP item, as dcp.save makes it
    # and DCP's own in-place load of the whole state into a state dict of its shape
    target = zeroed(want)
    target["rng"] = io.BytesIO()
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp2"), no_dist=True)
    assert target.pop("rng").getvalue() == b"raw bytes io"
    assert_nested_same(target, want)


def zeroed(obj):
    """``obj`` with every tensor zeroed: a target of its shape for DCP's in-place load."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: zeroed(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(zeroed(v) for v in obj)
    return obj


def _dcp_rank(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = random_bits((9, 6), torch.bfloat16, 11)
    sd = {"w0": distribute_tensor(full, mesh, [Shard(0)]), "w1": distribute_tensor(full, mesh, [Shard(1)]),
          "plain": full.clone(), "step": 3}
    dcp.save(sd, checkpoint_id=path)
    dist.destroy_process_group()


def test_dcp_from_two_ranks(tmp_path):
    """A DCP checkpoint of DTensors saved by two processes: tensors in chunks across files."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_dcp_rank, args=(2, port, str(tmp_path / "dcp")), nprocs=2, start_method="spawn")
    assert len([n for n in os.listdir(tmp_path / "dcp") if n.endswith(".distcp")]) == 2
    convert.from_dcp(tmp_path / "dcp", tmp_path / "ck", memory_limit=SMALL)
    got = zarrckpt.load_state_dict(tmp_path / "ck")
    full = random_bits((9, 6), torch.bfloat16, 11)
    for k in ("w0", "w1", "plain"):
        assert same(got[k], full), k
    assert got["step"] == 3


# ------------------------------------------------------------------ every pair, chained


def test_every_pair_chained(tmp_path):
    """safetensors -> zarrckpt -> torch.save -> zarrckpt -> DCP -> zarrckpt -> safetensors:
    every tensor comes back bit for bit with its name and dtype."""
    want = tensors()
    st.save_file(want, tmp_path / "a.safetensors")
    convert.from_safetensors(tmp_path / "a.safetensors", tmp_path / "z1", memory_limit=SMALL)
    convert.to_torch_save(tmp_path / "z1", tmp_path / "b.pt", memory_limit=SMALL)
    assert_same(torch.load(tmp_path / "b.pt", weights_only=True), want)
    convert.from_torch_save(tmp_path / "b.pt", tmp_path / "z2", memory_limit=SMALL)
    convert.to_dcp(tmp_path / "z2", tmp_path / "c", memory_limit=SMALL)
    convert.from_dcp(tmp_path / "c", tmp_path / "z3", memory_limit=SMALL)
    convert.to_safetensors(tmp_path / "z3", tmp_path / "d.safetensors", memory_limit=SMALL)
    assert_same(st.load_file(tmp_path / "d.safetensors"), want)
    for z in ("z1", "z2", "z3"):
        assert_same(load_zarr_flat(tmp_path / z), want)


# ------------------------------------------------------------------ selection and casting


def test_keys_and_dtype(tmp_path):
    state = {"model": {"w": random_bits((4, 4), torch.float32, 1), "b": torch.ones(4, dtype=torch.float16),
                       "n": torch.arange(3)},
             "optim": {"m": torch.ones(2)}, "step": 5}
    zarrckpt.save(state, tmp_path / "ck")
    r = convert.to_safetensors(tmp_path / "ck", tmp_path / "hf", keys={"model/": ""}, dtype="bf16")
    out = st.load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(out) == ["b", "n", "w"]
    assert out["w"].dtype == torch.bfloat16 and out["b"].dtype == torch.bfloat16 and out["n"].dtype == torch.int64
    assert torch.equal(out["w"], state["model"]["w"].to(torch.bfloat16))  # round to nearest even, as torch
    assert not r.skipped  # nothing selected was left out
    r = convert.to_safetensors(tmp_path / "ck", tmp_path / "all.safetensors")
    assert dict(r.skipped) == {"step": "not a tensor (safetensors holds tensors only)"}
    assert sorted(st.load_file(tmp_path / "all.safetensors")) == ["model.b", "model.n", "model.w", "optim.m"]
    # selection by prefix, a mapping of dtypes, a callable
    convert.from_safetensors(tmp_path / "all.safetensors", tmp_path / "sel", keys=["model."],
                             dtype={"float16": "float32"})
    c = zarrckpt.open(tmp_path / "sel")
    assert sorted(c.keys()) == ["model.b", "model.n", "model.w"]
    assert c.read("model.b").dtype == np.float32 and c.read("model.w").dtype == np.float32
    convert.from_safetensors(tmp_path / "all.safetensors", tmp_path / "fn",
                             keys=lambda k: "enc/" + k.replace(".", "/") if k.startswith("model.") else None)
    assert sorted(zarrckpt.open(tmp_path / "fn").keys()) == ["enc/model/b", "enc/model/n", "enc/model/w"]
    seen = []
    convert.to_torch_save(tmp_path / "ck", tmp_path / "p.pt", progress=seen.append)
    assert seen[-1].bytes_done == seen[-1].bytes_total > 0 and seen[-1].leaves_done == seen[-1].leaves_total


def test_name_collision_and_strict(tmp_path):
    zarrckpt.save({"a": {"b.c": torch.ones(1)}, "a.b": {"c": torch.ones(1)}}, tmp_path / "ck")
    with pytest.raises(UnsupportedValueError, match="both have the safetensors name 'a.b.c'"):
        convert.to_safetensors(tmp_path / "ck", tmp_path / "x.safetensors")
    assert not os.path.exists(tmp_path / "x.safetensors")
    zarrckpt.save({"c": torch.ones(2, dtype=torch.complex128), "f": torch.ones(2)}, tmp_path / "ck2")
    with pytest.raises(UnsupportedValueError, match="complex128"):
        convert.to_safetensors(tmp_path / "ck2", tmp_path / "y.safetensors")
    r = convert.to_safetensors(tmp_path / "ck2", tmp_path / "y.safetensors", strict=False)
    assert [k for k, _ in r.skipped] == ["c"]


def test_failure_leaves_nothing(tmp_path):
    st.save_file(tensors(), tmp_path / "in.safetensors")

    def boom(p):
        if p.bytes_done > 100_000:
            raise KeyboardInterrupt

    for fn, dst in ((convert.from_safetensors, tmp_path / "ck"),):
        with pytest.raises(KeyboardInterrupt):
            fn(tmp_path / "in.safetensors", dst, progress=boom, memory_limit=SMALL)
        assert not os.path.exists(dst) and os.listdir(tmp_path) == ["in.safetensors"]
    convert.from_safetensors(tmp_path / "in.safetensors", tmp_path / "ck")
    for fn, dst in ((convert.to_safetensors, tmp_path / "hf"), (convert.to_torch_save, tmp_path / "t.pt"),
                    (convert.to_dcp, tmp_path / "dcp")):
        with pytest.raises(KeyboardInterrupt):
            fn(tmp_path / "ck", dst, progress=boom, memory_limit=SMALL)
        left = os.listdir(dst) if os.path.isdir(dst) else []
        assert not os.path.exists(dst) or not left, (fn, left)
    assert sorted(os.listdir(tmp_path)) in (["ck", "in.safetensors"], ["ck", "hf", "in.safetensors"])


# ------------------------------------------------------------------ bad inputs


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("header,data,error,match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, FormatError, "truncated"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, FormatError, "no tensor owns"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, FormatError, "no gap or overlap"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, FormatError, "needs 12"),
    ({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", UnsupportedValueError, "F4"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", FormatError, "bad shape"),
    ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, FormatError, "data_offsets"),
    ({"__metadata__": {"a": 1}}, b"", FormatError, "__metadata__"),
])
def test_bad_safetensors(tmp_path, header, data, error, match):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(_safetensors_bytes(header, data))
    with pytest.raises(error, match=match):
        convert.from_safetensors(p, tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck")


def test_bad_files(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(FormatError, match="not a safetensors file"):
        convert.from_safetensors(tmp_path / "junk.safetensors", tmp_path / "ck")
    with pytest.raises(CheckpointNotFoundError):
        convert.from_safetensors(tmp_path / "missing.safetensors", tmp_path / "ck")
    with pytest.raises(CheckpointNotFoundError):
        convert.from_dcp(tmp_path, tmp_path / "ck")
    with pytest.raises(CheckpointNotFoundError):  # not a checkpoint of any kind
        convert.convert(tmp_path / "junk.safetensors.txt", tmp_path / "ck")
    # an index naming a file that is not there, or disagreeing with its files
    folder = tmp_path / "hf"
    folder.mkdir()
    st.save_file({"a": torch.ones(2)}, folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointNotFoundError, match="model-00002-of-00002"):
        convert.from_safetensors(folder, tmp_path / "ck")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FormatError, match="disagree"):
        convert.from_safetensors(folder, tmp_path / "ck")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(FormatError, match="not a file beside the index"):
        convert.from_safetensors(folder, tmp_path / "ck")
    # torch.save files: only what weights_only admits; the legacy format is named
    torch.save({"x": torch.ones(1), "obj": zipfile.ZipInfo("x")}, tmp_path / "obj.pt")
    with pytest.raises(UnsupportedValueError, match="weights_only=True"):
        convert.from_torch_save(tmp_path / "obj.pt", tmp_path / "ck")
    torch.save({"x": torch.ones(1)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(FormatError, match="before torch 1.6"):
        convert.from_torch_save(tmp_path / "legacy.pt", tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck")


class _Evil:
    def __reduce__(self):
        return (open, (os.path.join(os.environ["EVIL_DIR"], "pwned"), "w"))


def test_dcp_metadata_is_not_trusted(tmp_path, monkeypatch):
    """A .metadata that names anything DCP does not write is refused before any of it runs;
    one whose fields break the rules is refused by name."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    md_path = tmp_path / "dcp" / ".metadata"
    with open(md_path, "rb") as fh:
        md = pickle.load(fh)  # the test's own file: trusted
    monkeypatch.setenv("EVIL_DIR", str(tmp_path))
    md.planner_data = {"w": _Evil()}
    with open(md_path, "wb") as fh:
        pickle.dump(md, fh)
    with pytest.raises(FormatError, match=r"refers to (io|builtins)\.open"):
        convert.from_dcp(tmp_path / "dcp", tmp_path / "ck")
    assert not (tmp_path / "pwned").exists()
    md.planner_data = {"w": ("w",)}
    (info,) = md.storage_data.values()
    info.relative_path = "../../etc/passwd"
    with open(md_path, "wb") as fh:
        pickle.dump(md, fh)
    with pytest.raises(FormatError, match="not a file of the directory"):
        convert.from_dcp(tmp_path / "dcp", tmp_path / "ck")
    md_path.write_bytes(b"not a pickle")
    with pytest.raises(FormatError, match="not a readable DCP metadata"):
        convert.from_dcp(tmp_path / "dcp", tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck")


def test_dcp_value_refused_by_weights_only(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3), "obj": zipfile.ZipInfo("x")}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(UnsupportedValueError, match="weights_only"):
        convert.from_dcp(tmp_path / "dcp", tmp_path / "ck")
    r = convert.from_dcp(tmp_path / "dcp", tmp_path / "ck", strict=False)
    assert [k for k, _ in r.skipped] == ["obj"]
    assert zarrckpt.open(tmp_path / "ck").keys() == ["w"]


def test_destinations_refused(tmp_path):
    zarrckpt.save({"w": torch.ones(2)}, tmp_path / "ck")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "other.txt").write_text("x")
    with pytest.raises(CheckpointExistsError, match="not a DCP checkpoint"):
        convert.to_dcp(tmp_path / "ck", tmp_path / "full", overwrite=True)
    convert.to_dcp(tmp_path / "ck", tmp_path / "dcp")
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        convert.to_dcp(tmp_path / "ck", tmp_path / "dcp")
    convert.to_dcp(tmp_path / "ck", tmp_path / "dcp", overwrite=True)
    with pytest.raises(CheckpointExistsError):  # a foreign directory is never written into
        convert.from_dcp(tmp_path / "dcp", tmp_path / "full")
    with pytest.raises(ValueError, match="one side must be zarrckpt"):
        convert.convert(tmp_path / "dcp", tmp_path / "x", to_format="safetensors")


def test_exists_error_names_the_option(tmp_path, capsys):
    """A refusal to replace the destination names overwrite=True, and carries it as
    ``option`` so the command line says --overwrite (issue 18)."""
    from zarrckpt.tools.cli import main

    zarrckpt.save({"w": torch.ones(2), "x": None}, tmp_path / "ck")
    torch.save({"w": torch.ones(2), "x": None}, tmp_path / "in.pt")
    for run in (lambda: convert.from_torch_save(tmp_path / "in.pt", tmp_path / "ck"),
                lambda: convert.to_torch_save(tmp_path / "ck", tmp_path / "in.pt")):
        with pytest.raises(CheckpointExistsError, match="overwrite=True") as e:
            run()
        assert e.value.option == "overwrite=True"
    assert main(["convert", str(tmp_path / "in.pt"), str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    assert main(["convert", str(tmp_path / "in.pt"), str(tmp_path / "ck"), "--overwrite"]) == 0
    assert zarrckpt.load_state_dict(tmp_path / "ck")["x"] is None


# ------------------------------------------------------------------ keys= that select nothing


def _sources(tmp_path) -> dict:
    """One small state in every source format: {format: (path, converter from it, destination)}."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)}, "optim": {"m": torch.ones(3)}, "step": 3}
    zarrckpt.save(state, tmp_path / "ck")
    torch.save(state, tmp_path / "in.pt")
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    st.save_file({"model.w": state["model"]["w"], "model.b": state["model"]["b"]}, tmp_path / "in.safetensors")
    return {"zarrckpt": (tmp_path / "ck", convert.to_safetensors, tmp_path / "out.safetensors"),
            "safetensors": (tmp_path / "in.safetensors", convert.from_safetensors, tmp_path / "out"),
            "torch_save": (tmp_path / "in.pt", convert.from_torch_save, tmp_path / "out"),
            "dcp": (tmp_path / "dcp", convert.from_dcp, tmp_path / "out")}


@pytest.mark.parametrize("source", ["zarrckpt", "safetensors", "torch_save", "dcp"])
@pytest.mark.parametrize("form", ["prefix", "list", "mapping"])
def test_keys_selecting_nothing_write_nothing(tmp_path, source, form):
    """A keys= prefix (or the old prefix of a mapping) that selects no key of the source is a
    MissingKeysError naming it with the closest keys, raised before anything is written:
    never an empty checkpoint or file."""
    from zarrckpt.errors import MissingKeysError

    src, fn, dst = _sources(tmp_path)[source]
    good = "model." if source == "safetensors" else "model/"  # safetensors names are flat
    bad = "modle." if source == "safetensors" else "modle/"
    keys = {"prefix": bad, "list": [good, bad], "mapping": {good: "m/", bad: "x/"}}[form]
    with pytest.raises(MissingKeysError) as e:
        fn(src, dst, keys=keys)
    assert str(e.value).startswith(f"key pattern {bad!r} selects no key of {src} (did you mean 'model"), e.value
    assert not os.path.exists(dst)
    r = fn(src, dst, keys={"prefix": good, "list": [good], "mapping": {good: "m/"}}[form])  # the good one alone
    assert r.leaves == 2


def test_keys_selecting_nothing_other_targets(tmp_path):
    """The same for every destination format, a callable selecting nothing, and a pattern
    that selects only inside a plain-JSON subtree (which is selected)."""
    from zarrckpt.errors import MissingKeysError

    zarrckpt.save({"model": {"w": torch.ones(2)}, "optim": {"param_groups": [{"lr": 0.1}]}}, tmp_path / "ck")
    for to, dst in ((convert.to_torch_save, tmp_path / "o.pt"), (convert.to_dcp, tmp_path / "dcp"),
                    (convert.to_safetensors, tmp_path / "st")):
        with pytest.raises(MissingKeysError, match=r"'optm/' selects no key of .*did you mean 'optim'\?"):
            to(tmp_path / "ck", dst, keys=["model/", "optm/"])
        assert not os.path.exists(dst)
        with pytest.raises(MissingKeysError, match=r"keys=<lambda> selects no key of .*top-level keys: model, optim"):
            to(tmp_path / "ck", dst, keys=lambda k: None)
        assert not os.path.exists(dst)
    convert.to_torch_save(tmp_path / "ck", tmp_path / "o.pt", keys="optim/param_groups/0/lr")
    assert torch.load(tmp_path / "o.pt", weights_only=True) == {"optim": {"param_groups": [{"lr": 0.1}]}}


def test_to_dcp_items_as_dcp_save_makes_them(tmp_path):
    """to_dcp stores what dcp.save stores, item for item (DCP's flattening rule): a tuple,
    and a list of neither tensors nor dicts, is one item (AdamW's betas, a group's params);
    a list holding a tensor or a dict is traversed; an empty dict leaves no item and is
    listed in the report. dcp.load into the state dict and dcp_to_torch_save read it all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from zarrckpt.interop.dcp import read_metadata

    state = {"optim": {"state": {}, "param_groups": [{"betas": (0.9, 0.999), "params": [0, 1], "fused": None,
                                                      "eps": float("inf")}]},
             "pair": (torch.ones(2), {3: "three"}),  # a tuple of a tensor and an int-keyed dict: one value
             "mixed": [torch.zeros(3), [1, b"\x07"], [torch.ones(1)], {"k": ()}],
             "blobs": [b"\x01", float("nan")],
             "nested": [[1, 2], [3, (4,)]]}
    zarrckpt.save(state, tmp_path / "ck", pack_bytes=0)  # arrays of their own, read in pieces
    r = convert.to_dcp(tmp_path / "ck", tmp_path / "dcp", memory_limit=64 << 10)
    assert r.skipped == [("optim/state", "an empty dict, for which DCP stores nothing (dcp.save drops it too)")]
    dcp.save(state, checkpoint_id=str(tmp_path / "ref"), no_dist=True)
    names = {k: type(v).__name__ for k, v in read_metadata(str(tmp_path / "dcp")).state_dict_metadata.items()}
    assert names == {k: type(v).__name__ for k, v in read_metadata(str(tmp_path / "ref")).state_dict_metadata.items()}
    assert names["optim.param_groups.0.betas"] == names["pair"] == names["nested"] == "BytesStorageMetadata"
    assert "mixed.1" in names and "mixed.3.k" in names
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    want = dict(state, optim={"param_groups": state["optim"]["param_groups"]})  # DCP drops the empty dict
    back = torch.load(tmp_path / "back.pt", weights_only=False)
    assert back["pair"][1] == {3: "three"}  # inside a value: keys kept as they are
    assert_nested_same({k: back[k] for k in want}, want)
    target = zeroed(state)
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_nested_same(target, state)
    convert.from_dcp(tmp_path / "dcp", tmp_path / "ck2")  # and zarrckpt reads it back the same
    assert_nested_same(zarrckpt.load_state_dict(tmp_path / "ck2"), {k: back[k] for k in back})


@pytest.mark.parametrize("dt", [torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16, torch.bool])
def test_torch_save_strided_views_of_every_dtype(tmp_path, dt):
    """A torch.save'd transposed view is read element-strided from the file; for
    float8_e5m2 NumPy's as_strided raised "data type '<f1' not understood" (issue 28
    item 11, the converters' copy of the bug)."""
    from zarrckpt.convert import from_torch_save

    t = (torch.randn(64, 33) > 0) if dt == torch.bool else torch.randn(64, 33).to(dt)
    torch.save({"w": t.t()}, tmp_path / "m.pt")
    from_torch_save(tmp_path / "m.pt", tmp_path / "z")
    got = zarrckpt.load_state_dict(tmp_path / "z")["w"]
    assert got.dtype == dt and torch.equal(got.view(torch.uint8) if dt.itemsize == 1 else got.view(torch.int16),
                                           t.t().contiguous().view(torch.uint8 if dt.itemsize == 1 else torch.int16))
