"""One process: round trips of every leaf type and dtype, and every bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from _v11 import as_format_1_1

import zarrckpt
import zarrckpt.inspect
from zarrckpt.format import dtypes

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
DTYPES += [getattr(torch, n) for n in ("float8_e8m0fnu", "uint16", "uint32", "uint64", "complex128") if hasattr(torch, n)]


def bits(t: torch.Tensor) -> np.ndarray:
    return dtypes.to_numpy(t.contiguous()).reshape(-1).view(np.uint8)


def sample(dt: torch.dtype, shape=(5, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if dt == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dt.is_complex:
        return torch.randn(shape, generator=g, dtype=dt)
    if dt.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dt)
    return torch.randint(0, 100, shape, generator=g).to(dt)


@pytest.mark.parametrize("pack_bytes", [0, 64 << 10], ids=["arrays", "packed"])
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_dtype_round_trip(tmp_path, dt, pack_bytes):
    t = sample(dt)
    zarrckpt.save({"t": t, "scalar": sample(dt, ()), "empty": sample(dt, (0, 3))}, tmp_path / "c",
                  pack_bytes=pack_bytes)
    sd = zarrckpt.load_state_dict(tmp_path / "c")
    for k, v in {"t": t, "scalar": sample(dt, ()), "empty": sample(dt, (0, 3))}.items():
        assert sd[k].dtype == dt and sd[k].shape == v.shape
        np.testing.assert_array_equal(bits(sd[k]), bits(v))
    if pack_bytes == 0:
        meta = json.loads((tmp_path / "c" / "t" / "zarr.json").read_text())
        assert meta["attributes"]["zarrckpt"]["torch_dtype"] == str(dt).removeprefix("torch.")
    else:
        assert zarrckpt.open(tmp_path / "c").is_packed("t")
        assert not (tmp_path / "c" / "t").exists()


def test_values_round_trip_without_pickle(tmp_path):
    sd = {
        "step": 12, "lr": 3e-4, "nan": float("nan"), "inf": float("-inf"), "flag": True,
        "none": None, "name": "héllo", "betas": (0.9, 0.95), "list": [1, [2, 3], {"a": 4}],
        "groups": [{"params": [0, 1], "lr": 0.1, "betas": (0.9, 0.999)}],
        "int_keys": {0: {"exp_avg": torch.ones(2)}, 1: {}}, "blob": b"\x00\x01raw",
        "np": np.arange(6, dtype=np.int32).reshape(2, 3), "empty": {}, "el": [],
        "big": 2**70,
    }
    zarrckpt.save(sd, tmp_path / "c")
    out = zarrckpt.load_state_dict(tmp_path / "c")
    assert math.isnan(out.pop("nan"))
    expect = dict(sd)
    expect.pop("nan")
    assert out["betas"] == (0.9, 0.95) and isinstance(out["betas"], tuple)
    assert out["groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(out["int_keys"][0]["exp_avg"], torch.ones(2)) and out["int_keys"][1] == {}
    assert out["blob"] == b"\x00\x01raw"
    np.testing.assert_array_equal(out["np"], sd["np"])
    for k in ("step", "lr", "inf", "flag", "none", "name", "list", "empty", "el", "big"):
        assert out[k] == sd[k] and type(out[k]) is type(sd[k]), k
    # what is on storage: test_faults.test_every_stored_file_is_json_or_a_checksummed_chunk


def test_keys_with_odd_characters_stay_inside(tmp_path):
    sd = {"a/b": torch.ones(1), "..": torch.ones(2), "../../etc": torch.ones(3), "": torch.ones(4),
          "zarr.json": torch.ones(5), "__init__": torch.ones(6), "ünï": torch.ones(7), ".x": 1}
    zarrckpt.save(sd, tmp_path / "c")
    out = zarrckpt.load_state_dict(tmp_path / "c")
    assert set(out) == set(sd)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v)
    assert sorted(os.listdir(tmp_path)) == ["c"]  # nothing escaped the directory


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n, "t": torch.full((2,), float(self.n))}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        assert torch.equal(sd["t"], torch.full((2,), float(self.n)))


def test_stateful_and_in_place_load(tmp_path):
    c = Counter()
    c.n = 5
    w = torch.randn(3, 4)
    zarrckpt.save({"c": c, "model": {"w": w}}, tmp_path / "c")
    c2 = Counter()
    target = torch.zeros(3, 4, requires_grad=True)
    sd = {"c": c2, "model": {"w": target}}
    out = zarrckpt.load(sd, tmp_path / "c")
    assert out is sd and c2.n == 5 and sd["model"]["w"] is target
    assert torch.equal(target.detach(), w)


def test_load_state_dict_selected_keys(tmp_path):
    zarrckpt.save({"model": {"a": torch.ones(2), "b": torch.zeros(2)}, "optim": {"x": 1}}, tmp_path / "c")
    out = zarrckpt.load_state_dict(tmp_path / "c", keys=["model/a", "optim"])
    assert set(out) == {"model", "optim"} and set(out["model"]) == {"a"}
    with pytest.raises(KeyError, match="nope"):
        zarrckpt.load_state_dict(tmp_path / "c", keys=["nope"])


def test_load_state_dict_keys_suggest_near_keys_and_take_prefixes_with_a_slash(tmp_path):
    zarrckpt.save({"model": {"a": torch.ones(2), "b": torch.zeros(2)}, "optim": {"x": 1}}, tmp_path / "c")
    with pytest.raises(zarrckpt.MissingKeysError, match=r"'modle' in checkpoint .*did you mean 'model'") as ei:
        zarrckpt.load_state_dict(tmp_path / "c", keys=["modle"])
    assert isinstance(ei.value, KeyError)
    with pytest.raises(zarrckpt.MissingKeysError, match=r"did you mean 'model/a'"):
        zarrckpt.open(tmp_path / "c").to_dict(["model/aa"])
    for keys in (["model/"], ["model"]):  # a trailing slash is a prefix, as in the CLI
        out = zarrckpt.load_state_dict(tmp_path / "c", keys=keys)
        assert set(out) == {"model"} and set(out["model"]) == {"a", "b"}
    assert zarrckpt.open(tmp_path / "c").to_dict(["optim/"]) == {"optim": {"x": 1}}


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(4, 4).to_sparse(),
    lambda: torch.zeros(4, 4).to_sparse_csr(),
    lambda: torch.quantize_per_tensor(torch.zeros(4, 4), 0.1, 0, torch.qint8),
    lambda: torch.nested.nested_tensor([torch.zeros(4), torch.zeros(4)]),
], ids=["sparse_coo", "sparse_csr", "quantized", "nested"])
def test_unsupported_layout_targets_are_refused_with_the_reason(tmp_path, make):
    zarrckpt.save({"w": torch.ones(4, 4), "b": torch.ones(2)}, tmp_path / "c")
    b = torch.zeros(2)
    target = make()
    kind = {torch.sparse_coo: r"sparse tensor \(torch.sparse_coo\)",
            torch.sparse_csr: r"sparse tensor \(torch.sparse_csr\)"}.get(target.layout)
    reason = kind or ("quantized" if target.is_quantized else "nested")
    with pytest.raises(zarrckpt.UnsupportedValueError, match=rf"load target 'w' is a {reason}.*dense") as ei:
        zarrckpt.load({"w": target, "b": b}, tmp_path / "c")
    assert "share memory" not in str(ei.value)
    assert not b.any()  # refused before anything was loaded


def test_conjugate_view_targets_get_the_saved_values(tmp_path):
    v = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])
    zarrckpt.save({"w": v, "n": v}, tmp_path / "c")
    base, nbase = torch.zeros(3, dtype=torch.complex64), torch.zeros(3, dtype=torch.complex64)
    target = {"w": base.conj(), "n": torch._neg_view(nbase)}
    zarrckpt.load(target, tmp_path / "c")
    assert torch.equal(target["w"], v) and torch.equal(base, v.conj())
    assert torch.equal(target["n"], v) and torch.equal(nbase, -v)


def test_cast_and_key_map(tmp_path):
    w = torch.randn(4, 4).to(torch.bfloat16)
    zarrckpt.save({"model": {"old.weight": w}}, tmp_path / "c")
    target = {"model": {"new.weight": torch.zeros(4, 4, dtype=torch.float32)}}
    with pytest.raises(zarrckpt.MissingKeysError, match="model/new.weight"):
        zarrckpt.load(target, tmp_path / "c")
    km = {"model/new.weight": "model/old.weight"}
    with pytest.raises(zarrckpt.DTypeMismatchError, match=r"saved dtype torch.bfloat16, target torch.float32"):
        zarrckpt.load(target, tmp_path / "c", key_map=km)
    assert torch.count_nonzero(target["model"]["new.weight"]) == 0  # untouched
    zarrckpt.load(target, tmp_path / "c", key_map=km, cast=True)
    assert torch.equal(target["model"]["new.weight"], w.float())
    back = {"model": {"old.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}}
    zarrckpt.load(back, tmp_path / "c", key_map=lambda k: k)
    assert torch.equal(back["model"]["old.weight"], w)


def test_compression_zstd(tmp_path):
    t = torch.zeros(128, 256)  # 128 KiB: its own array (not packed), one chunk (not sharded)
    zarrckpt.save({"t": t}, tmp_path / "c", compression="zstd")
    meta = json.loads((tmp_path / "c" / "t" / "zarr.json").read_text())
    names = [c["name"] for c in meta["codecs"]]
    assert names == ["bytes", "zstd", "crc32c"]
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "c")["t"], t)


def test_large_tensor_uses_sharding_codec_and_reads_partially(tmp_path):
    t = torch.randn(1024, 1024)  # 4 MiB: outer chunk of 4 MiB, inner of 1 MiB
    zarrckpt.save({"t": t}, tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "t" / "zarr.json").read_text())
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    ck = zarrckpt.open(tmp_path / "c")
    part = ck.tensorstore("t")[:, 512:].read().result()
    np.testing.assert_array_equal(part, t[:, 512:].numpy())


# ------------------------------------------------------------------ bad input


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    zarrckpt.save({"model": {"w": torch.ones(4096, 8), "b": torch.ones(3)}}, tmp_path / "c")
    b = torch.full((3,), 9.0)
    with pytest.raises(zarrckpt.ShapeMismatchError, match=r"'model/w'.*saved shape \(4096, 8\), target \(4096, 4\)"):
        zarrckpt.load({"model": {"w": torch.zeros(4096, 4), "b": b}}, tmp_path / "c")
    assert torch.equal(b, torch.full((3,), 9.0))  # nothing half-loaded


def test_missing_and_unexpected_keys(tmp_path):
    zarrckpt.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(zarrckpt.MissingKeysError, match="'c'"):
        zarrckpt.load({"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)}, tmp_path / "c")
    a = torch.zeros(2)
    with pytest.raises(zarrckpt.UnexpectedKeysError, match="'b'"):
        zarrckpt.load({"a": a}, tmp_path / "c", strict="exact")
    assert torch.count_nonzero(a) == 0
    rep = {}  # the default, as DCP: keys the target lacks are reported, not an error
    zarrckpt.load({"a": a}, tmp_path / "c", report=rep)
    assert torch.equal(a, torch.ones(2)) and rep["unexpected"] == ["b"] and rep["missing"] == []
    a.zero_()
    with pytest.raises(ValueError, match="strict"):
        zarrckpt.load({"a": a}, tmp_path / "c", strict="yes")
    c = torch.zeros(2)
    rep = {}
    with pytest.warns(UserWarning, match="strict=False.*'b'"):  # stored values left: said, not silent
        zarrckpt.load({"a": a, "c": c}, tmp_path / "c", strict=False, report=rep)
    assert torch.equal(a, torch.ones(2)) and torch.count_nonzero(c) == 0
    assert rep["missing"] == ["c"] and rep["unexpected"] == ["b"]


def test_bad_paths(tmp_path):
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="no zarrckpt checkpoint"):
        zarrckpt.load_state_dict(tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        zarrckpt.open(tmp_path / "absent")
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="scheme"):
        zarrckpt.open("ftp://host/x")
    (tmp_path / "grp").mkdir()
    (tmp_path / "grp" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="not a zarrckpt checkpoint"):
        zarrckpt.open(tmp_path / "grp")


def test_refuses_to_overwrite(tmp_path):
    zarrckpt.save({"a": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(zarrckpt.CheckpointExistsError, match="overwrite=True"):
        zarrckpt.save({"a": torch.zeros(2)}, tmp_path / "c")
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "c")["a"], torch.ones(2))
    zarrckpt.save({"b": torch.zeros(3)}, tmp_path / "c", overwrite=True)
    assert set(zarrckpt.load_state_dict(tmp_path / "c")) == {"b"}
    assert not (tmp_path / "c" / "a").exists()  # old arrays are gone


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(zarrckpt.CheckpointExistsError, match="not a zarrckpt checkpoint"):
        zarrckpt.save({"a": torch.ones(2)}, tmp_path / "home", overwrite=True)
    assert (tmp_path / "home" / "thesis.tex").read_text() == "precious"


def test_incomplete_checkpoint_is_refused_and_can_be_replaced(tmp_path):
    zarrckpt.save({"a": torch.ones(2)}, tmp_path / "c")
    root = tmp_path / "c" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["zarrckpt"]["state"] = "pending"  # as an interrupted save leaves it
    root.write_text(json.dumps(doc))
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="interrupted"):
        zarrckpt.load_state_dict(tmp_path / "c")
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load({"a": torch.zeros(2)}, tmp_path / "c")
    zarrckpt.save({"a": torch.full((2,), 3.0)}, tmp_path / "c")  # a pending dir is ours to reuse
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "c")["a"], torch.full((2,), 3.0))


def _chunk_files(path):
    return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f != "zarr.json"]


@pytest.mark.parametrize("shape", [(64,), (1024, 1024)], ids=["plain-chunk", "sharded"])
def test_corrupted_chunk_is_detected(tmp_path, shape):
    zarrckpt.save({"w": torch.randn(shape)}, tmp_path / "c")
    (f,) = _chunk_files(tmp_path / "c" / "w")
    raw = bytearray(open(f, "rb").read())
    raw[len(raw) // 3] ^= 0x40
    open(f, "wb").write(raw)
    with pytest.raises(zarrckpt.CorruptChunkError, match="'w'"):
        zarrckpt.load_state_dict(tmp_path / "c")


def test_missing_chunk_is_an_error_not_zeros(tmp_path):
    zarrckpt.save({"w": torch.zeros(16)}, tmp_path / "c")  # all-zero data still has chunk files
    (f,) = _chunk_files(tmp_path / "c" / "w")
    os.remove(f)
    target = torch.full((16,), 5.0)
    with pytest.raises(zarrckpt.CorruptChunkError, match="'w'"):
        zarrckpt.load({"w": target}, tmp_path / "c")


def test_missing_array_metadata(tmp_path):
    """Format 1.1 reads each array's zarr.json: a missing one is an error. Format 1.2 takes
    the metadata from the root (spec §6.7): the load needs no array document, and verify
    reports the one generic readers miss."""
    zarrckpt.save({"w": torch.zeros(16)}, tmp_path / "c")
    os.remove(tmp_path / "c" / "w" / "zarr.json")
    assert zarrckpt.load_state_dict(tmp_path / "c")["w"].shape == (16,)
    assert [p.kind for p in zarrckpt.inspect.verify(tmp_path / "c").problems] == ["missing"]
    zarrckpt.save({"w": torch.zeros(16)}, tmp_path / "d")
    as_format_1_1(tmp_path / "d")
    os.remove(tmp_path / "d" / "w" / "zarr.json")
    with pytest.raises(zarrckpt.CorruptChunkError, match="zarr.json is missing"):
        zarrckpt.load_state_dict(tmp_path / "d")


def test_newer_major_version_is_refused(tmp_path):
    zarrckpt.save({"a": 1}, tmp_path / "c")
    root = tmp_path / "c" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["zarrckpt"]["version"] = "2.0"
    root.write_text(json.dumps(doc))
    with pytest.raises(zarrckpt.FormatError, match="version 2.0"):
        zarrckpt.open(tmp_path / "c")


def test_unsupported_value_names_key_and_type(tmp_path):
    with pytest.raises(zarrckpt.UnsupportedValueError, match=r"'opt/sched'.*set.*never pickles"):
        zarrckpt.save({"opt": {"sched": {1, 2}}}, tmp_path / "c")
    with pytest.raises(zarrckpt.UnsupportedValueError, match="complex32|dtype"):
        zarrckpt.save({"x": torch.zeros(2, dtype=torch.complex32)}, tmp_path / "d")
    assert not (tmp_path / "c").exists()


def test_unknown_save_option(tmp_path):
    with pytest.raises(TypeError, match="compresion"):
        zarrckpt.save({"a": 1}, tmp_path / "c", compresion="zstd")


def test_tensorstore_reads_independently(tmp_path):
    import tensorstore as ts

    t = torch.randn(300, 200).to(torch.bfloat16)
    zarrckpt.save({"m": {"w": t}}, tmp_path / "c")
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / "m" / "w")}}).result()
    np.testing.assert_array_equal(arr.read().result().reshape(-1).view(np.uint16), bits(t).view(np.uint16))


def test_import_and_open_without_torch(tmp_path):
    zarrckpt.save({"w": torch.arange(6, dtype=torch.float32), "step": 3}, tmp_path / "c")
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import zarrckpt
ck = zarrckpt.open({str(tmp_path / 'c')!r})
assert ck.read("w").tolist() == [0, 1, 2, 3, 4, 5], ck.read("w")
assert ck.read("step") == 3
assert "torch" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_plans_are_reused_across_saves_and_never_stale(tmp_path):
    """A second save of the same structure reuses the plans of the first (planning is in the
    blocking part of an async save); a change of shape, dtype or options is planned afresh."""
    from zarrckpt.planning import plan as _plan

    _plan._CACHE.clear()
    sd = {f"w{i}": torch.randn(64, 32) for i in range(20)}
    zarrckpt.save(sd, tmp_path / "a")
    first = dict(_plan._CACHE)
    assert len(first) == 20
    zarrckpt.save({k: v + 1 for k, v in sd.items()}, tmp_path / "b")
    assert _plan._CACHE == first  # every leaf a hit
    changed = dict(sd, w0=torch.randn(64, 33), w1=sd["w1"].double())
    zarrckpt.save(changed, tmp_path / "c", inner_chunk_bytes=1024)
    assert len(_plan._CACHE) == 40  # new options: every leaf planned again
    for name, want in [("b", {k: v + 1 for k, v in sd.items()}), ("c", changed)]:
        got = zarrckpt.load_state_dict(tmp_path / name)
        assert all(torch.equal(got[k], v) for k, v in want.items())
    assert zarrckpt.open(tmp_path / "c")["w0"].shape == (64, 33)
    assert zarrckpt.open(tmp_path / "c")["w1"].dtype == np.float64


def test_load_pauses_the_garbage_collector_and_restores_it(tmp_path, monkeypatch):
    """A full collection inside one rank's load stalls every rank (0.3 s of a 0.3 s GPU load):
    the collector is paused during a load, enabled again after it (also after an error), and
    one the caller had disabled stays disabled. The strict=False warning still points at the
    caller."""
    import gc
    import warnings

    from zarrckpt.api import load as zload

    seen = []
    real = zload.LoadRun.read
    monkeypatch.setattr(zload.LoadRun, "read", lambda self: seen.append(gc.isenabled()) or real(self))
    zarrckpt.save({"w": torch.ones(3), "extra": torch.ones(2)}, tmp_path / "c")
    target = {"w": torch.zeros(3)}
    assert gc.isenabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zarrckpt.load(target, tmp_path / "c", strict=False)
    assert seen == [False] and gc.isenabled() and torch.equal(target["w"], torch.ones(3))
    assert [w.filename for w in caught if "left 1 stored key" in str(w.message)] == [__file__]
    with pytest.raises(zarrckpt.ShapeMismatchError):
        zarrckpt.load({"w": torch.zeros(4)}, tmp_path / "c")
    assert gc.isenabled()
    gc.disable()
    try:
        zarrckpt.load(target, tmp_path / "c")
        assert not gc.isenabled()
    finally:
        gc.enable()
