"""zarrckpt.open as a lazy, read-only view: LazyArray leaves (NumPy indexing that reads
only the chunks it touches), sub-views, values, metadata, repr, conversions, and all of
it without torch."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.format import dtypes
from zarrckpt.readers.lazy import normalize_index

BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name in {blocked!r} or any(name.startswith(b + ".") for b in {blocked!r}):
            raise ImportError(name + " is blocked in this test")
sys.meta_path.insert(0, Block())
"""


def run_blocked(code: str, blocked=("torch",), env=None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where importing any of ``blocked`` fails."""
    full = BLOCK_TORCH.format(blocked=tuple(blocked)) + code
    return subprocess.run([sys.executable, "-c", full], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a.view(np.uint8)


def file_bytes_read() -> int:
    """Bytes read from storage, through TensorStore (lazy slices) or directly (whole reads)."""
    return zarrckpt.storage.io_counters()["bytes_read"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint with packed and unpacked arrays of several dtypes, values and metadata."""
    path = tmp_path_factory.mktemp("lazy") / "c"
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {
            "layers.0.weight": (torch.randn(37, 24, generator=g) * 10).to(torch.bfloat16),  # packed
            "layers.0.bias": torch.randn(24, generator=g),  # packed
            "big": torch.randn(512, 384, generator=g),  # 768 KiB: its own array, sharded
            "fp8": torch.randn(64, 48, generator=g).to(torch.float8_e4m3fn),
            "ints": torch.arange(-50, 50, dtype=torch.int64).reshape(10, 10),
            "cube": torch.arange(60, dtype=torch.int32).reshape(3, 4, 5),
        },
        "optim": {"param_groups": [{"lr": 0.1, "params": [0, 1]}],
                  "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)}}},
        "step": 7,
        "blob": b"hello",
        "nan": float("nan"),
        "table": np.arange(12, dtype=np.int16).reshape(3, 4),
    }
    zarrckpt.save(state, path, inner_chunk_bytes=16 << 10, metadata={"step": 100, "metrics": {"loss": 1.5}},
                  pack_bytes=64 << 10)  # packed leaves (deprecated) are still read and described
    return path, state


def expected(state, key):
    node = state
    for part in key.split("/"):
        node = node[part]
    return dtypes.to_numpy(node) if isinstance(node, torch.Tensor) else node


# ------------------------------------------------------------------ the lazy array


def test_lazy_array_describes_itself_without_reading_data(saved):
    path, state = saved
    ck = zarrckpt.open(path)
    big = ck["model/big"]
    assert isinstance(big, zarrckpt.LazyArray)
    assert (big.shape, big.dtype, big.ndim, big.size) == ((512, 384), np.dtype(np.float32), 2, 512 * 384)
    assert big.nbytes == 512 * 384 * 4 and big.itemsize == 4 and len(big) == 512
    assert big.chunks == (512, 384) and big.inner_chunks is not None
    assert np.prod(big.inner_chunks) * 4 <= 16 << 10
    assert big.kind == "tensor" and not big.packed and big.data_type == "float32"
    assert big.dimension_names == ("big.0", "big.1")
    assert big.mesh is None and big.placements is None and big.layout is None and big.writers is None
    w = ck["model/layers.0.weight"]
    assert w.packed and w.dtype == np.dtype(ml_dtypes.bfloat16) and w.shape == (37, 24)
    assert w.chunks == (37, 24) and w.inner_chunks is None and w.attrs["kind"] == "tensor"
    assert ck["model/fp8"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert ck["table"].kind == "ndarray" and ck["table"].dtype == np.int16
    assert "bfloat16[37, 24]" in repr(w) and "packed" in repr(w)
    assert "chunks [512, 384] (inner" in repr(big)


INDEXES = [
    np.s_[...], np.s_[:], np.s_[3], np.s_[-1], np.s_[-3:], np.s_[2:9:3], np.s_[::-1], np.s_[8:1:-2],
    np.s_[:, 5], np.s_[..., -2], np.s_[None, 1:3], np.s_[1:3, None, ::2], np.s_[5:2], np.s_[-100:100],
    np.s_[[0, 3, -1]], np.s_[[0, 3], [1, -1]], np.s_[:, [2, 0, 2]], np.s_[[[0, 1], [2, 3]], 1:3],
    np.s_[2, [0, 3]], np.s_[3, 2], np.s_[np.array([True, False] * 5)], np.s_[:, np.arange(4) % 3 == 0],
    np.s_[np.int64(2), ::-3], np.s_[10], np.s_[:, [0, 100]], np.s_[1, 2, 3], np.s_[..., None],
    np.s_[np.array([[True, False, True, False]] * 3)], np.s_[-4:-1, ..., -1],
    np.s_[1, :, [0, 3]], np.s_[[0, -1], 1:3, [2, 2]], np.s_[-1, ..., [1, 0]],
]


@pytest.mark.parametrize("key", ["model/big", "model/layers.0.weight", "model/fp8", "model/ints",
                                 "model/cube", "table"])
@pytest.mark.parametrize("index", INDEXES, ids=[str(i) for i in range(len(INDEXES))])
def test_indexing_is_numpys(saved, key, index):
    path, state = saved
    full = expected(state, key)
    ck = zarrckpt.open(path)
    a = ck[key]
    try:
        want = full[index]
    except IndexError:
        with pytest.raises(IndexError):
            a[index]
        return
    got = a[index]
    assert np.shape(got) == np.shape(want), (index, np.shape(got), np.shape(want))
    assert np.asarray(got).dtype == full.dtype
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))


def test_normalize_index_errors():
    with pytest.raises(IndexError, match="out of bounds for axis 0 with size 4"):
        normalize_index(4, (4, 5))
    with pytest.raises(IndexError, match="out of bounds for axis 1 with size 5"):
        normalize_index((0, [1, -6]), (4, 5))
    with pytest.raises(IndexError, match="too many indices"):
        normalize_index((0, 0, 0), (4, 5))
    with pytest.raises(IndexError, match="single ellipsis"):
        normalize_index((..., ...), (4, 5))
    with pytest.raises(IndexError, match="valid indices"):
        normalize_index(1.5, (4,))
    with pytest.raises(IndexError, match="boolean scalar"):
        normalize_index(True, (4,))
    # what TensorStore is given: no negative numbers anywhere, NumPy's meaning kept
    assert normalize_index((-1, slice(None, None, -1)), (4, 5)) == (3, slice(4, -1, -1))


def test_reads_only_the_inner_chunks_it_touches(saved):
    path, state = saved
    ck = zarrckpt.open(path)
    big = ck["model/big"]
    inner = big.inner_chunks
    unit = int(np.prod(inner)) * 4
    big[0, 0]  # open the array, read its shard index once
    before = file_bytes_read()
    got = big[: inner[0], : inner[1]]  # exactly one inner chunk
    one = file_bytes_read() - before
    np.testing.assert_array_equal(got, expected(state, "model/big")[: inner[0], : inner[1]])
    assert unit <= one <= unit + 4096, (one, unit)  # the inner chunk (+ CRC) and the shard index
    before = file_bytes_read()
    big[[0, 511], -1]  # two rows far apart: two inner chunks, not the rows in between
    two = file_bytes_read() - before
    assert 2 * unit <= two <= 2 * unit + 8192, (two, unit)
    before = file_bytes_read()
    big.to_numpy()
    assert file_bytes_read() - before >= big.nbytes


def test_conversions(saved):
    path, state = saved
    ck = zarrckpt.open(path)
    for key in ("model/big", "model/layers.0.weight", "model/fp8", "table"):
        a, want = ck[key], expected(state, key)
        np.testing.assert_array_equal(bits(a.to_numpy()), bits(want))
        np.testing.assert_array_equal(bits(np.asarray(a)), bits(want))
        np.testing.assert_array_equal(bits(a.tensorstore().read().result()), bits(want))
        d = a.dask()
        assert d.chunks == tuple((c,) * (s // c) + ((s % c,) if s % c else ()) for s, c in zip(a.shape, a.chunks))
        np.testing.assert_array_equal(bits(d.compute()), bits(want))
        t = a.to_torch()
        assert t.dtype == getattr(torch, a.data_type) and t.shape == a.shape
        np.testing.assert_array_equal(bits(dtypes.to_numpy(t)), bits(want))
    assert np.asarray(ck["model/ints"], dtype=np.float64).dtype == np.float64


@pytest.mark.parametrize("pack_bytes", [0, 1024])
def test_zero_d_and_empty_arrays(tmp_path, pack_bytes):
    zarrckpt.save({"e": torch.zeros(0, 5), "s": torch.tensor(3.5), "b": torch.zeros(3, 0, dtype=torch.bfloat16)},
                  tmp_path / "c", pack_bytes=pack_bytes)
    ck = zarrckpt.open(tmp_path / "c")
    e, s, b = ck["e"], ck["s"], ck["b"]
    assert e[...].shape == (0, 5) and e[:, 2].shape == (0,) and e.dask().compute().shape == (0, 5)
    assert b[1].shape == (0,) and b.to_torch().shape == (3, 0) and b.to_torch().dtype == torch.bfloat16
    assert s[()] == 3.5 and s[...].shape == () and s.dask().compute() == 3.5 and s.ndim == 0
    assert s.to_torch().shape == () and s.to_torch().item() == 3.5
    with pytest.raises(TypeError, match="0-d"):
        len(s)
    with pytest.raises(IndexError, match="too many indices"):
        s[0]


def test_missing_chunk_fails_instead_of_reading_fill_values(tmp_path):
    zarrckpt.save({"w": torch.ones(64, 64)}, tmp_path / "c", pack_bytes=0)
    os.remove(tmp_path / "c" / "w" / "c" / "0" / "0")
    w = zarrckpt.open(tmp_path / "c")["w"]
    with pytest.raises(zarrckpt.CorruptChunkError, match="'w'"):
        w[0]
    with pytest.raises(zarrckpt.CorruptChunkError, match="'w'"):
        w.dask().compute()


# ------------------------------------------------------------------ views


def test_views_mapping_and_values(saved):
    path, state = saved
    ck = zarrckpt.open(path)
    assert ck.keys()[:2] == ["model/layers.0.weight", "model/layers.0.bias"]
    assert len(ck) == len(ck.keys()) == len(list(ck))
    assert "model/big" in ck and "step" in ck and "model" not in ck and 3 not in ck
    assert ck.groups() == ["model", "optim"]
    model = ck["model"]
    assert isinstance(model, zarrckpt.CheckpointView) and model.prefix == "model"
    assert model.keys() == ["layers.0.weight", "layers.0.bias", "big", "fp8", "ints", "cube"]
    assert len(model) == 6 and "big" in model and "model/big" not in model
    assert model["big"].key == "model/big" and model.array("big").shape == (512, 384)
    assert model.read("ints").tolist() == state["model"]["ints"].tolist()
    assert model.tensorstore("layers.0.bias").shape == (24,)
    assert model.array_info("fp8").dtype.zarr == "float8_e4m3fn"
    assert model.is_packed("layers.0.bias") and not model.is_packed("big") and model.is_array("big")
    items = dict(model.items())
    assert set(items) == set(model.keys()) and all(isinstance(v, zarrckpt.LazyArray) for v in items.values())
    # nested views, values, lists
    assert ck["optim"]["state"]["0"].keys() == ["step", "exp_avg"]
    assert ck["optim/state/0/step"][()] == 3.0
    assert ck["optim/param_groups/0/lr"] == 0.1
    assert ck["optim"]["param_groups"].to_dict() == [{"lr": 0.1, "params": [0, 1]}]
    assert ck["step"] == 7 and ck["blob"] == b"hello" and np.isnan(ck["nan"])
    assert ck.get("absent", 5) == 5
    d = model.to_dict()
    assert set(d) == set(state["model"]) and isinstance(d["big"], np.ndarray)
    lazy = ck["optim"].to_dict(lazy=True)
    assert isinstance(lazy["state"][0]["exp_avg"], zarrckpt.LazyArray)
    assert lazy["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    only = ck["model"].to_dict(["big"])
    assert list(only) == ["big"] and np.array_equal(only["big"], state["model"]["big"].numpy())
    with pytest.raises(KeyError, match="did you mean 'model/big'"):
        ck["model/bgi"]
    with pytest.raises(KeyError, match="under 'model'"):
        model["nothing"]
    with pytest.raises(KeyError, match="is a value"):
        ck.array("step")
    assert ck.array("blob").to_numpy().tobytes() == b"hello"


def test_metadata_step_and_metrics(saved, tmp_path):
    path, _ = saved
    ck = zarrckpt.open(path)
    assert ck.step == 100 and ck.metrics == {"loss": 1.5} and ck.metadata["step"] == 100
    assert ck["model"].step == 100 and ck.world_size == 1 and len(ck.save_id) == 30
    zarrckpt.save({"w": torch.ones(2), "step": 12}, tmp_path / "a")
    a = zarrckpt.open(tmp_path / "a")
    assert a.step == 12 and a.metrics == {} and a.metadata == {}
    zarrckpt.save({"w": torch.ones(2), "step": "x"}, tmp_path / "b")
    assert zarrckpt.open(tmp_path / "b").step is None


def test_repr_is_a_tree(saved):
    path, _ = saved
    ck = zarrckpt.open(path)
    lines = repr(ck).splitlines()
    assert len(ck) == 15
    assert lines[0].startswith(f"<zarrckpt.Checkpoint {str(path)!r} step 100: 15 keys (10 arrays), saved ")
    assert lines[0].endswith(" by 1 process>")
    assert "  model/" in lines and "  optim/" in lines
    assert "    layers.0.weight  bfloat16[37, 24] 1.7 KiB, packed" in lines
    assert any(line.startswith("    big  float32[512, 384] 768.0 KiB, chunks [512, 384] (inner ") for line in lines)
    assert "  step = 7" in lines and "  blob  bytes (5 B)" in lines and "        lr = 0.1" in lines
    assert "        params = [0, 1]" in lines  # a short list of values on one line
    sub = repr(zarrckpt.open(path)["optim/state"]).splitlines()
    assert sub[0] == f"<zarrckpt.CheckpointView 'optim/state' of {str(path)!r}: 2 keys (2 arrays)>"
    assert sub[1:] == ["  0/", "    step  float32[] 4 B, packed", "    exp_avg  float32[4] 16 B, packed"]


def test_dtensor_layout_is_described(tmp_path, clusters):
    """A DTensor saved by 4 ranks on a (2, 2) mesh: its mesh, placements and writers."""
    clusters(4).run(_save_dtensor, str(tmp_path / "c"))
    a = zarrckpt.open(tmp_path / "c")["w"]
    assert a.kind == "dtensor" and a.mesh == {"shape": [2, 2], "dim_names": ["dp", "tp"], "device_type": "cpu"}
    assert [str(p) for p in a.placements] == ["Shard(dim=0)", "Shard(dim=1)"]
    assert a.chunks == (4, 3) and a.layout.mesh_shape == (2, 2)
    assert a.writers == {(i, j): (i, j) for i in range(2) for j in range(2)}
    assert "mesh (dp=2, tp=2) [Shard(0), Shard(1)]" in repr(a)
    np.testing.assert_array_equal(a[...], np.arange(48, dtype=np.float32).reshape(8, 6))
    # reading one chunk's rows and columns reads that chunk only
    a[0, 0]
    before = file_bytes_read()
    np.testing.assert_array_equal(a[4:8, 3:], np.arange(48, dtype=np.float32).reshape(8, 6)[4:, 3:])
    assert file_bytes_read() - before == 4 * 3 * 4 + 4  # one chunk and its CRC


def _save_dtensor(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w = distribute_tensor(torch.arange(48, dtype=torch.float32).reshape(8, 6), mesh, [Shard(0), Shard(1)])
    zarrckpt.save({"w": w}, path, chunk_target_bytes=None)  # one chunk per shard: one writer each


def test_pickled_checkpoint_reopens_and_notices_a_replacement(tmp_path):
    zarrckpt.save({"w": torch.arange(4.0)}, tmp_path / "c", pack_bytes=0)
    ck = zarrckpt.open(tmp_path / "c")
    w = pickle.loads(pickle.dumps(ck["w"]))
    assert w[...].tolist() == [0, 1, 2, 3]
    data = pickle.dumps(ck)
    zarrckpt.save({"w": torch.zeros(4)}, tmp_path / "c", overwrite=True)
    with pytest.raises(zarrckpt.CheckpointChangedError, match="replaced"):
        pickle.loads(data)


# ------------------------------------------------------------------ a handle across an overwrite


def _old_and_new(path):
    """A handle opened on one save, then the path overwritten with other values and shapes."""
    zarrckpt.save({"big": torch.arange(20000.0), "small": torch.ones(3), "step": 1, "lr": [0.1, 0.2]},
                  path)
    ck = zarrckpt.open(path)
    big, small = ck["big"], ck["small"]
    assert big.shape == (20000,) and small.shape == (3,)  # metadata read before the overwrite
    zarrckpt.save({"big": torch.zeros(30000), "small": torch.zeros(5), "step": 2, "lr": [0.3]},
                  path, overwrite=True)
    return ck, big, small


READS_THROUGH_A_HANDLE = {
    "lazy slice": lambda ck, big, small: big[:10],
    "lazy packed slice": lambda ck, big, small: small[:2],
    "to_numpy": lambda ck, big, small: big.to_numpy(),
    "np.asarray": lambda ck, big, small: np.asarray(small),
    "dask": lambda ck, big, small: big.dask(chunks=5000).sum().compute(scheduler="sync"),
    "read array": lambda ck, big, small: ck.read("big"),
    "read packed": lambda ck, big, small: ck.read("small"),
    "value": lambda ck, big, small: ck["step"],
    "read value": lambda ck, big, small: ck.read("lr/0"),
    "sub-view value": lambda ck, big, small: ck["lr"]["0"],
    "to_dict": lambda ck, big, small: ck.to_dict(),
    "items": lambda ck, big, small: ck.items(),
    "tensorstore": lambda ck, big, small: ck.tensorstore("big"),
}


@pytest.mark.parametrize("read", list(READS_THROUGH_A_HANDLE), ids=list(READS_THROUGH_A_HANDLE))
def test_reads_through_a_handle_after_an_overwrite_are_refused(tmp_path, read):
    ck, big, small = _old_and_new(tmp_path / "c")
    with pytest.raises(zarrckpt.CheckpointChangedError, match="replaced while it was being read"):
        READS_THROUGH_A_HANDLE[read](ck, big, small)
    with pytest.raises(zarrckpt.CheckpointChangedError):
        ck.check_unchanged()
    fresh = zarrckpt.open(tmp_path / "c")  # a new handle reads the new save
    assert fresh["step"] == 2 and fresh["big"].shape == (30000,) and fresh["lr"].to_dict() == [0.3]
    assert not fresh["big"][:10].any() and fresh.read("small").tolist() == [0] * 5


def test_a_read_that_races_an_overwrite_is_caught_after_it(tmp_path, monkeypatch):
    """The check comes after the data: an overwrite landing while a read is in flight is
    caught, whichever save's bytes the read returned."""
    from zarrckpt.readers import checkpoint as reader

    zarrckpt.save({"big": torch.arange(20000.0), "step": 1}, tmp_path / "c", pack_bytes=0)
    ck = zarrckpt.open(tmp_path / "c")
    real_wait, real_open = reader.wait_all, reader.Checkpoint._stored

    def overwrite():
        zarrckpt.save({"big": torch.full((20000,), 7.0), "step": 2}, tmp_path / "c", overwrite=True,
                      pack_bytes=0)

    def wait_then_overwrite(reads):
        out = real_wait(reads)  # the data is read (old bytes) ...
        overwrite()  # ... and the checkpoint is replaced before the call returns
        return out

    monkeypatch.setattr(reader, "wait_all", wait_then_overwrite)
    with pytest.raises(zarrckpt.CheckpointChangedError):
        ck.read("big")
    monkeypatch.undo()

    ck = zarrckpt.open(tmp_path / "c")
    big = ck["big"]

    def open_then_overwrite(self, key):
        array = real_open(self, key)  # opened on the old save; the read comes after the overwrite
        overwrite()
        return array

    monkeypatch.setattr(reader.Checkpoint, "_stored", open_then_overwrite)
    with pytest.raises(zarrckpt.CheckpointChangedError):
        big[:5]


def test_unchanged_handle_reads_without_fetching_the_root_again(tmp_path):
    zarrckpt.save({"big": torch.arange(20000.0)}, tmp_path / "c", pack_bytes=0)
    before = file_bytes_read()
    ck = zarrckpt.open(tmp_path / "c")
    assert file_bytes_read() - before >= (tmp_path / "c" / "zarr.json").stat().st_size  # counted
    before = file_bytes_read()
    ck.check_unchanged()
    assert file_bytes_read() == before  # a conditional read: no bytes while unchanged
    os.utime(tmp_path / "c" / "zarr.json", ns=(1, 1))  # the same bytes, touched: still the same save
    assert ck.read("big")[-1] == 19999.0


# ------------------------------------------------------------------ without torch


def test_everything_reads_without_torch(saved):
    path, state = saved
    out = run_blocked(f"""
import numpy as np, ml_dtypes
import zarrckpt
ck = zarrckpt.open({str(path)!r})
w = ck["model"]["layers.0.weight"]
assert w.dtype == np.dtype(ml_dtypes.bfloat16) and w[-1, ::5].shape == (5,)
assert ck["model/big"][:2, :3].shape == (2, 3) and ck["model/fp8"].to_numpy().dtype.name == "float8_e4m3fn"
assert ck["step"] == 7 and ck.step == 100 and ck.metrics == {{"loss": 1.5}}
assert ck["model/big"].dask().sum().compute() == ck.read("model/big").sum()
assert "bfloat16[37, 24]" in repr(ck)
for call in (lambda: w.to_torch(), lambda: zarrckpt.save({{}}, "x"), lambda: zarrckpt.load({{}}, "x"),
             lambda: zarrckpt.load_state_dict("x"), lambda: zarrckpt.async_save({{}}, "x"),
             lambda: zarrckpt.wait_for_saves(), lambda: zarrckpt.reserve_staging(1)):
    try:
        call()
    except zarrckpt.MissingDependencyError as e:
        assert e.package == "torch" and "needs torch" in str(e) and "zarrckpt[torch]" in str(e), e
        assert isinstance(e, ImportError)
    else:
        raise AssertionError("no error")
import sys
assert "torch" not in sys.modules
print("ok")
""")
    assert out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_dask_missing_is_named(saved):
    path, _ = saved
    out = run_blocked(f"""
import zarrckpt
try:
    zarrckpt.open({str(path)!r})["model/big"].dask()
except zarrckpt.MissingDependencyError as e:
    assert "LazyArray.dask() needs dask" in str(e) and "zarrckpt[dask]" in str(e), e
    print("ok")
""", blocked=("torch", "dask"))
    assert out.stdout.strip() == "ok", out.stdout + out.stderr


def test_public_names():
    for name in ("CheckpointView", "LazyArray", "MissingDependencyError", "open_run"):
        assert name in zarrckpt.__all__ and hasattr(zarrckpt, name)
    assert all(hasattr(zarrckpt, n) for n in zarrckpt.__all__)
    mine = ["CheckpointView", "LazyArray", "MissingDependencyError", "open_run"]
    for name in mine:  # placed in order among their neighbours
        i = zarrckpt.__all__.index(name)
        assert zarrckpt.__all__[i - 1].lower() <= name.lower() <= zarrckpt.__all__[i + 1].lower()
    assert issubclass(zarrckpt.MissingDependencyError, zarrckpt.ZarrckptError)
    assert issubclass(zarrckpt.MissingDependencyError, ImportError)
