"""zarr-python, dask and xarray on checkpoints: every array read by zarr-python (bf16 and fp8
included), xarray.open_zarr with the stored dimension_names and no explicit import, the
zarrckpt xarray engine, and zarrckpt.open_run over a CheckpointManager run (per-layer
norms per step in one expression, each stored chunk read once)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.format import dtypes
from test_lazy import run_blocked

xr = pytest.importorskip("xarray")
zarr = pytest.importorskip("zarr")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int64, torch.uint8, torch.bool, torch.complex64]
DTYPES += [getattr(torch, n) for n in ("float8_e8m0fnu",) if hasattr(torch, n)]


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)


def sample(dt: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if dt == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dt.is_floating_point and not dt.is_complex:
        return torch.randint(0, 100, shape, generator=g).to(dt)
    if dt == getattr(torch, "float8_e8m0fnu", None):
        return torch.rand(shape, generator=g).abs().add(0.1).to(dt)
    return (torch.randn(shape, generator=g) * 4).to(dt)


def file_bytes_read() -> int:
    """Bytes read from storage, through TensorStore or zarrckpt's direct chunk-file reads."""
    return zarrckpt.storage.io_counters()["bytes_read"]


def chunk_bytes(path) -> int:
    """Bytes of every chunk file (not the documents) under a checkpoint directory."""
    total = 0
    for dp, _, fs in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dp, f)) for f in fs if f != "zarr.json")
    return total


# ------------------------------------------------------------------ zarr-python and xarray.open_zarr


def test_zarr_python_reads_every_array(tmp_path):
    state = {"model": {str(dt).removeprefix("torch."): sample(dt, (6, 10)) for dt in DTYPES}}
    state["model"]["sharded"] = sample(torch.bfloat16, (256, 64))  # 32 KiB with 4 KiB inner chunks
    zarrckpt.save(state, tmp_path / "c", pack_bytes=0, inner_chunk_bytes=4096)
    group = zarr.open_group(tmp_path / "c", mode="r")
    assert group.attrs["zarrckpt"]["state"] == "committed"
    for name, t in state["model"].items():
        arr = group[f"model/{name}"]
        assert arr.dtype == dtypes.to_numpy(t).dtype, name
        np.testing.assert_array_equal(bits(arr[...]), bits(dtypes.to_numpy(t)), err_msg=name)
    assert group["model/sharded"].shards == (256, 64) and group["model/sharded"].chunks != (256, 64)


def test_xarray_open_zarr_uses_dimension_names(tmp_path):
    """xarray.open_zarr on a group of a checkpoint: dimensions from the stored
    dimension_names, no warnings, bf16/fp8 read bit-exactly (zarrckpt imported first)."""
    w = sample(torch.bfloat16, (8, 4))
    zarrckpt.save({"model": {"w": w, "b": sample(torch.float8_e4m3fn, (4,))}}, tmp_path / "c", pack_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no guessing of dimension names, no fallbacks
        ds = xr.open_zarr(tmp_path / "c", group="model", consolidated=False)
    assert dict(ds.sizes) == {"w.0": 8, "w.1": 4, "b.0": 4}
    assert ds["w"].dims == ("w.0", "w.1") and ds["b"].dtype.name == "float8_e4m3fn"
    np.testing.assert_array_equal(bits(ds["w"].values), bits(dtypes.to_numpy(w)))


def test_xarray_open_datatree_lists_every_array_from_the_root_alone(tmp_path):
    """xarray's ``open_datatree(consolidated=True)`` lists every group and array, bf16
    included, from the root's consolidated metadata: with every other ``zarr.json`` removed
    it still finds them all and reads their values (spec §6.7)."""
    path = tmp_path / "c"
    sd = {"model": {"layers.0": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)},
                    "head": torch.arange(6, dtype=torch.int32), "norm": torch.ones(3).bfloat16()}, "step": 3}
    zarrckpt.save(sd, path)
    removed = [os.path.join(d, "zarr.json") for d, _, fs in os.walk(path) if d != str(path) and "zarr.json" in fs]
    for f in removed:
        os.remove(f)
    assert len(removed) == 6  # four arrays and two groups
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = xr.open_datatree(path, engine="zarr", consolidated=True)
        assert sorted(tree["model"].data_vars) == ["head", "norm"]
        assert sorted(tree["model/layers.0"].data_vars) == ["b", "w"]
        assert np.array_equal(tree["model/layers.0"]["w"].values, sd["model"]["layers.0"]["w"].numpy())
        assert np.array_equal(tree["model"]["head"].values, sd["model"]["head"].numpy())
        assert tree["model"]["norm"].dtype.name == "bfloat16"


def test_xarray_finds_the_engine_without_import(tmp_path):
    """Without ``import zarrckpt``: xarray.open_dataset with no engine picks zarrckpt's engine
    for a checkpoint directory (loading it registers the bf16/fp8 types, so open_zarr works
    afterwards too). zarr-python itself has no such hook (test_zarr_dtypes.py)."""
    w = sample(torch.bfloat16, (8, 4))
    zarrckpt.save({"model": {"w": w}}, tmp_path / "c", pack_bytes=0)
    np.save(tmp_path / "w.npy", bits(dtypes.to_numpy(w)))
    out = run_blocked(f"""
import sys
import numpy as np, xarray as xr
ds = xr.open_dataset({str(tmp_path / "c")!r})
assert list(ds.data_vars) == ["model/w"] and ds["model/w"].dtype.name == "bfloat16", ds
got = np.ascontiguousarray(ds["model/w"].values).reshape(-1).view(np.uint8)
assert (got == np.load({str(tmp_path / "w.npy")!r})).all()
g = xr.open_zarr({str(tmp_path / "c")!r}, group="model", consolidated=False)
assert g["w"].dims == ("w.0", "w.1")
assert "torch" not in sys.modules
print("ok")
""")
    assert out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]


# ------------------------------------------------------------------ runs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A CheckpointManager run of 4 steps (an interrupted fifth step and a foreign file too)."""
    root = tmp_path_factory.mktemp("run") / "run"
    weights = {}
    with zarrckpt.CheckpointManager(root, pack_bytes=0, inner_chunk_bytes=8192) as mgr:
        for i, step in enumerate((100, 200, 300, 400)):
            g = torch.Generator().manual_seed(step)
            state = {"model": {"layers.0.weight": torch.randn(64, 32, generator=g) * (i + 1),
                               "layers.1.weight": (torch.randn(128, 64, generator=g) * (i + 1)).to(torch.bfloat16),
                               "layers.1.bias": torch.randn(64, generator=g)},
                     "step": step}
            if step >= 200:
                state["model"]["head"] = torch.ones(3)  # not in every checkpoint
            weights[step] = state["model"]
            mgr.save(step, state, metrics={"loss": 10.0 / (i + 1), "note": "x"})
    os.makedirs(root / "step_00000500")
    (root / "step_00000500" / "zarr.json").write_text(
        '{"zarr_format":3,"node_type":"group","attributes":{"zarrckpt":{"format":"zarrckpt","version":"1.1",'
        '"state":"pending","save_id":"00000000000000000000000000000a","world_size":1,'
        '"created":"2026-01-01T00:00:00Z","writer":{}}}}')
    (root / "notes.txt").write_text("not a checkpoint")
    return root, weights


def test_open_run_norms_per_layer_per_step_read_each_chunk_once(run):
    root, weights = run
    with pytest.warns(UserWarning, match=r"left out 1 array\(s\): model/head \(not in every checkpoint\)"):
        ds = zarrckpt.open_run(root)
    assert list(ds["step"].values) == [100, 200, 300, 400]
    assert list(ds.data_vars) == ["model/layers.0.weight", "model/layers.1.weight", "model/layers.1.bias"]
    w = ds["model/layers.1.weight"]
    assert w.dims == ("step", "model/layers.1.weight.0", "model/layers.1.weight.1")
    assert w.dtype.name == "bfloat16" and w.attrs["kind"] == "tensor"
    assert w.data.chunks == ((1, 1, 1, 1), (128,), (64,))  # one stored chunk per step
    assert ds["metrics/loss"].values.tolist() == [10.0, 5.0, 10 / 3, 2.5] and "metrics/note" not in ds.coords
    assert ds["path"].values[0].endswith("step_00000100")
    before = file_bytes_read()
    norms = ds.map(lambda v: np.sqrt((v.astype("float32") ** 2).sum([d for d in v.dims if d != "step"]))).compute()
    fetched = file_bytes_read() - before
    stored = sum(chunk_bytes(root / f"step_{s:08d}") for s in (100, 200, 300, 400)) \
        - sum(os.path.getsize(root / f"step_{s:08d}" / "model" / "head" / "c" / "0") for s in (200, 300, 400))
    assert fetched == stored, (fetched, stored)  # every chunk of every step read exactly once
    for step in (100, 200, 300, 400):
        for name in ("layers.0.weight", "layers.1.weight", "layers.1.bias"):
            want = float(torch.linalg.vector_norm(weights[step][name].float()))
            assert norms[f"model/{name}"].sel(step=step).item() == pytest.approx(want, rel=1e-5)


def test_open_run_from_paths_keys_and_mismatches(run, tmp_path):
    root, weights = run
    paths = [root / "step_00000300", root / "step_00000100"]
    ds = zarrckpt.open_run(paths, keys=["model/layers.1.weight", "model/layers.1.bias"])
    assert list(ds["step"].values) == [100, 300] and list(ds.data_vars) == ["model/layers.1.weight",
                                                                             "model/layers.1.bias"]
    np.testing.assert_array_equal(bits(ds["model/layers.1.bias"].sel(step=300).values),
                                  bits(weights[300]["layers.1.bias"].numpy()))
    with pytest.raises(KeyError, match="'model/head' is missing from 1 checkpoint"):
        zarrckpt.open_run([root / "step_00000100", root / "step_00000200"], keys=["model"])
    with pytest.raises(KeyError, match=r"no array leaf 'model/head' \(nor under it\) in checkpoint '.*step_00000100'"):
        zarrckpt.open_run([root / "step_00000100", root / "step_00000200"], keys=["model/head"])
    with pytest.raises(KeyError, match="no array leaf 'nothing'"):
        zarrckpt.open_run(paths, keys=["nothing"])
    # steps: recorded, else the step_<N> name, else the position; never twice the same
    zarrckpt.save({"w": torch.ones(2)}, tmp_path / "a")
    zarrckpt.save({"w": torch.ones(3)}, tmp_path / "step_00000007")
    with pytest.warns(UserWarning, match=r"'w' is float32\[2\] at step 0 but float32\[3\]"):
        ds = zarrckpt.open_run([tmp_path / "a", tmp_path / "step_00000007"])
    assert list(ds["step"].values) == [0, 7] and not ds.data_vars
    with pytest.raises(zarrckpt.ShapeMismatchError):
        zarrckpt.open_run([tmp_path / "a", tmp_path / "step_00000007"], keys=["w"])
    for name in ("b", "c"):
        zarrckpt.save({"w": torch.ones(2)}, tmp_path / name, metadata={"step": 3})
    with pytest.raises(ValueError, match="several checkpoints have step 3"):
        zarrckpt.open_run([tmp_path / "b", tmp_path / "c"])
    single = zarrckpt.open_run(tmp_path / "a")
    assert single["w"].shape == (1, 2)
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="step_<N>"):
        zarrckpt.open_run(tmp_path / "nothing")


def test_checkpoint_to_xarray_and_the_engine(run):
    root, weights = run
    ck = zarrckpt.open(root / "step_00000200")
    ds = ck["model"].to_xarray()
    assert set(ds.data_vars) == {"layers.0.weight", "layers.1.weight", "layers.1.bias", "head"}
    assert ds["layers.0.weight"].dims == ("layers.0.weight.0", "layers.0.weight.1") and ds.attrs["step"] == 200
    np.testing.assert_array_equal(ds["layers.0.weight"].values, weights[200]["layers.0.weight"].numpy())
    eng = xr.open_dataset(root / "step_00000200", engine="zarrckpt", keys=["model/layers.0.weight"])
    assert list(eng.data_vars) == ["model/layers.0.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = xr.open_dataset(root, engine="zarrckpt")
    assert whole.sizes["step"] == 4
    from zarrckpt.interop.xarray import ZarrckptBackendEntrypoint

    assert ZarrckptBackendEntrypoint().guess_can_open(root / "step_00000100")
    assert not ZarrckptBackendEntrypoint().guess_can_open(root)
    assert "zarrckpt" in xr.backends.list_engines()


def test_open_run_without_torch_and_without_xarray(run):
    root, _ = run
    out = run_blocked(f"""
import warnings, numpy as np
warnings.simplefilter("ignore")
import zarrckpt
ds = zarrckpt.open_run({str(root)!r}, keys=["model/layers.0.weight"])
assert float(np.abs(ds["model/layers.0.weight"]).max().compute()) > 0
import sys
assert "torch" not in sys.modules
print("ok")
""")
    assert out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]
    out = run_blocked(f"""
import zarrckpt
try:
    zarrckpt.open_run({str(root)!r})
except zarrckpt.MissingDependencyError as e:
    assert e.package == "xarray" and "zarrckpt[xarray]" in str(e), e
    print("ok")
""", blocked=("torch", "xarray"))
    assert out.stdout.strip() == "ok", out.stdout + out.stderr[-3000:]


def test_a_dataset_over_a_replaced_checkpoint_refuses_to_compute(tmp_path):
    zarrckpt.save({"w": torch.arange(6000.0).reshape(60, 100)}, tmp_path / "c", pack_bytes=0)
    ds = zarrckpt.open(tmp_path / "c").to_xarray()
    assert float(ds["w"].sum().compute()) == float(sum(range(6000)))
    zarrckpt.save({"w": torch.zeros(60, 100)}, tmp_path / "c", overwrite=True, pack_bytes=0)
    with pytest.raises(zarrckpt.CheckpointChangedError):
        ds["w"].sum().compute(scheduler="threads")
    assert float(zarrckpt.open(tmp_path / "c").to_xarray()["w"].sum().compute()) == 0.0
