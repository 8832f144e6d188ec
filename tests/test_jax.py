"""zarrckpt.jax: loading into sharded jax.Arrays and saving them, on CPU with 8 fake devices
(XLA_FLAGS is set before JAX initialises its backend: at collection, before any test runs),
a real 2-process JAX job, the torch -> JAX -> torch round trip, and JAX without torch."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
import zarrckpt.jax as zj  # noqa: E402
from _cluster import free_port  # noqa: E402
from test_lazy import run_blocked  # noqa: E402
from test_spec import check_checkpoint  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() != 8:
        pytest.fail(f"JAX has {jax.device_count()} devices: its backend started before this module set "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8 (run the JAX tests in a fresh process)")
    return jax.make_mesh((2, 4), ("x", "y"))


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.reshape(-1).view(np.uint8)


def file_metric(name: str) -> int:
    """Bytes read or written so far, through TensorStore or zarrckpt's direct chunk-file path."""
    return zarrckpt.storage.io_counters()[name]


def sample(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-100, 100, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 10).astype(np.float32).astype(dtype)


def put(a: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


# ------------------------------------------------------------------ save


def test_save_chunks_follow_the_sharding(tmp_path, mesh):
    arrays = {
        "w": (sample((16, 12), ml_dtypes.bfloat16), P("y", "x")),  # 4 x 2 tiles
        "v": (sample((8, 16), np.float32), P(None, ("y", "x"))),  # one dim over 8 devices, y major
        "r": (sample((6,), np.int32), P()),  # replicated on 8 devices
        "f8": (sample((8, 4), ml_dtypes.float8_e4m3fn), P("x")),  # 2 tiles, 4 replicas each
    }
    tree = {"params": {k: put(a, NamedSharding(mesh, spec)) for k, (a, spec) in arrays.items()},
            "opt": (np.arange(3.0), {"count": jnp.int32(4)}), "step": 3, "blob": b"\x00\x01", "lr": 0.5}
    report = zj.save(tree, tmp_path / "c", metadata={"step": 3})
    assert report["arrays"] == 7 and report["process"] == 0
    check_checkpoint(tmp_path / "c")  # schema, digests, groups, every chunk of the grid stored
    ck = zarrckpt.open(tmp_path / "c")
    assert ck.step == 3 and ck["lr"] == 0.5 and ck["blob"] == b"\x00\x01" and ck["opt/1/count"][()] == 4
    assert ck.checkpoint.info.writer["jax"] == jax.__version__
    w = ck["params/w"]
    assert w.kind == "dtensor" and w.chunks == (4, 6)  # the shard shape
    assert w.mesh == {"shape": [4, 2], "dim_names": ["y", "x"], "device_type": "cpu"}
    assert [str(p) for p in w.placements] == ["Shard(dim=0)", "Shard(dim=1)"]
    v = ck["params/v"]  # P(None, ("y", "x")): y outer, x inner, as DTensor nests mesh dims
    assert v.chunks == (8, 2) and v.mesh["dim_names"] == ["y", "x"]
    assert [str(p) for p in v.placements] == ["Shard(dim=1)", "Shard(dim=1)"]
    r = ck["params/r"]
    assert r.chunks == (6,) and [str(p) for p in r.placements] == ["Replicate()", "Replicate()"]
    assert ck["params/f8"].chunks == (4, 4) and ck["opt/0"].kind == "ndarray"
    assert ck["opt/1/count"].kind == "tensor"
    for k, (a, _) in arrays.items():
        np.testing.assert_array_equal(bits(ck[f"params/{k}"][...]), bits(a))
        assert ck[f"params/{k}"].dtype == a.dtype
    # each distinct shard is written once: the writers cover the chunk grid, one each
    assert len(w.writers) == 8 and len(set(w.writers.values())) == 8
    assert sorted(ck["params/f8"].writers) == [(0, 0), (1, 0)]


def test_save_each_shard_written_once(tmp_path, mesh):
    from zarrckpt.storage import FaultStorage

    a = sample((64, 32), np.float32)
    for name, spec, chunks in [("rep", P(), 1), ("tiles", P("x", "y"), 8), ("rows", P("x"), 2),
                               ("cols", P(None, ("y", "x")), 8)]:
        store = FaultStorage(tmp_path / name)  # no faults: it records every write
        report = zj.save({"a": put(a, NamedSharding(mesh, spec))}, store)
        # chunk writes: small-chunk puts (by key) and region writes (by box)
        writes = [(e.key, e.box) for e in store.events
                  if e.op == "write" or (e.op == "put" and not e.key.endswith("zarr.json"))]
        assert len(writes) == len(set(writes)) == chunks, (name, writes)  # one write per chunk
        assert report["bytes_written"] == a.nbytes, name  # not once per replica
        np.testing.assert_array_equal(zarrckpt.open(tmp_path / name)["a"][...], a)


def test_save_splits_big_replicated_arrays_over_replicas(tmp_path, mesh):
    a = sample((64, 16), np.float32)  # 4 KiB, replicated on 8 devices
    zj.save({"a": put(a, NamedSharding(mesh, P()))}, tmp_path / "c", replica_split_bytes=1024)
    la = zarrckpt.open(tmp_path / "c")["a"]
    assert la.chunks == (8, 16)  # split 8 ways along the longest dim
    assert la.layout is not None and sorted(set(la.writers.values())) == sorted(
        (i, j) for i in range(2) for j in range(4))
    np.testing.assert_array_equal(la[...], a)


def test_save_other_shardings(tmp_path, mesh):
    dev = jax.devices()[3]
    a = sample((5, 3), np.float32)
    single = jax.device_put(a, jax.sharding.SingleDeviceSharding(dev))
    tiled = put(sample((8, 8), np.int16), NamedSharding(mesh, P(("x", "y"), None)))
    zj.save({"single": single, "tiled": tiled}, tmp_path / "c")
    ck = zarrckpt.open(tmp_path / "c")
    assert ck["single"].kind == "tensor" and ck["single"].mesh is None
    np.testing.assert_array_equal(ck["single"][...], a)
    assert ck["tiled"].chunks == (1, 8) and ck["tiled"].mesh["shape"] == [2, 4]
    # the grid of boxes, for shardings that are not NamedShardings
    from zarrckpt.interop.jax import _grid_mesh

    mesh_shape, names, placements, coord_of = _grid_mesh(tiled.sharding, (8, 8))
    assert mesh_shape == (8,) and names is None and [str(p) for p in placements] == ["Shard(dim=0)"]
    assert sorted(coord_of.values()) == [(i,) for i in range(8)]
    rep = NamedSharding(mesh, P("x"))
    assert _grid_mesh(rep, (4, 2))[:3] == ((2, 4), None, (zarrckpt.format.layout.Shard(0), zarrckpt.format.layout.Replicate()))


def test_save_refuses_before_writing(tmp_path, mesh):
    with pytest.raises(zarrckpt.UnsupportedValueError, match="'bad'"):
        zj.save({"ok": jnp.ones(2), "bad": object()}, tmp_path / "c")
    with pytest.raises(zarrckpt.UnsupportedValueError, match="int4"):
        zj.save({"q": jnp.ones(4, jnp.int4)}, tmp_path / "c")
    with pytest.raises(zarrckpt.UnsupportedValueError, match="takes a dict"):
        zj.save([jnp.ones(2)], tmp_path / "c")
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())
    zj.save({"a": jnp.ones(2)}, tmp_path / "c")
    with pytest.raises(zarrckpt.CheckpointExistsError, match="overwrite=True"):
        zj.save({"a": jnp.zeros(2)}, tmp_path / "c")
    zj.save({"a": jnp.zeros(2)}, tmp_path / "c", overwrite=True, compression="zstd")
    assert zarrckpt.open(tmp_path / "c")["a"][...].tolist() == [0, 0]
    assert sorted(os.listdir(tmp_path)) == ["c"]  # nothing left beside it


# ------------------------------------------------------------------ load


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory):
    """A checkpoint saved by zarrckpt.save (torch), packed and unpacked leaves."""
    torch = pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("jaxload") / "c"
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": (torch.randn(16, 8, generator=g) * 10).to(torch.bfloat16),
                       "big": torch.randn(128, 64, generator=g),
                       "fp8": torch.randn(8, 8, generator=g).to(torch.float8_e5m2),
                       "n": torch.arange(8, dtype=torch.int64)},
             "step": 4, "blob": b"abc", "arr": np.arange(6, dtype=np.int16).reshape(2, 3)}
    zarrckpt.save(state, path, pack_bytes=1024, inner_chunk_bytes=4096)
    from zarrckpt.format import dtypes

    flat = {f"model/{k}": dtypes.to_numpy(v) for k, v in state["model"].items()}
    flat["arr"] = state["arr"]
    return path, flat


def test_load_with_one_sharding(torch_ckpt, mesh):
    path, flat = torch_ckpt
    rep = NamedSharding(mesh, P())
    with pytest.raises(zarrckpt.DTypeMismatchError, match="jax_enable_x64 is off"):
        zj.load(path, rep)
    out = zj.load(path, rep, cast=True)
    assert set(out) == {"model", "step", "blob", "arr"} and out["step"] == 4 and out["blob"] == b"abc"
    for k in ("model/w", "model/big", "model/fp8", "arr"):
        a = out[k.split("/")[0]][k.split("/")[1]] if "/" in k else out[k]
        assert isinstance(a, jax.Array) and a.sharding == rep and a.dtype == flat[k].dtype
        np.testing.assert_array_equal(bits(a), bits(flat[k]))
    assert out["model"]["n"].dtype == np.int32 and out["model"]["n"].tolist() == list(range(8))
    with jax.enable_x64(True):
        n = zj.load(path, rep, keys=["model/n"])["model"]["n"]
        assert n.dtype == np.int64 and n.tolist() == list(range(8))
    part = zj.load(zarrckpt.open(path)["model"], NamedSharding(mesh, P("x")), keys=["big", "w"])
    assert set(part) == {"big", "w"} and part["big"].sharding.spec == P("x")
    np.testing.assert_array_equal(np.asarray(part["big"]), flat["model/big"])


def test_load_into_a_pytree_target(torch_ckpt, mesh):
    path, flat = torch_ckpt
    target = {
        "model": {
            "weight": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("y", "x"))),
            "big": NamedSharding(mesh, P(None, ("x", "y"))),
            "fp8": jnp.zeros((8, 8), jnp.float8_e5m2, device=NamedSharding(mesh, P("x"))),
        },
        "step": None,
        "pair": (jax.ShapeDtypeStruct((2, 3), jnp.int16), "x"),
    }
    key_map = {"model/weight": "model/w", "pair/0": "arr", "pair/1": "blob"}
    with pytest.raises(zarrckpt.DTypeMismatchError, match="'model/weight'.*bfloat16.*cast=True"):
        zj.load(path, target, key_map=key_map)
    report: dict = {}
    out = zj.load(path, target, key_map=key_map, cast=True, report=report)
    w = out["model"]["weight"]
    assert w.dtype == jnp.float32 and w.sharding.spec == P("y", "x")
    np.testing.assert_array_equal(np.asarray(w), flat["model/w"].astype(np.float32))
    assert out["model"]["big"].sharding.spec == P(None, ("x", "y"))
    np.testing.assert_array_equal(bits(out["model"]["fp8"]), bits(flat["model/fp8"]))
    assert out["step"] == 4 and isinstance(out["pair"], tuple) and out["pair"][1] == b"abc"
    np.testing.assert_array_equal(np.asarray(out["pair"][0]), flat["arr"])
    assert report["arrays"] == 4 and report["bytes_fetched"] >= report["bytes_needed"] > 0
    only = zj.load(path, target, key_map=key_map, cast=True, keys=["model/big"])
    assert list(only) == ["model"] and list(only["model"]) == ["big"]
    # errors, before anything is read
    with pytest.raises(zarrckpt.MissingKeysError, match="'model/weight'"):
        zj.load(path, target, cast=True)
    bad = {"model": {"w": jax.ShapeDtypeStruct((8, 16), jnp.bfloat16, sharding=NamedSharding(mesh, P()))}}
    with pytest.raises(zarrckpt.ShapeMismatchError, match=r"'model/w': saved shape \(16, 8\), target \(8, 16\)"):
        zj.load(path, bad)
    with pytest.raises(zarrckpt.ShapeMismatchError, match="cannot take sharding"):
        zj.load(path, {"arr": NamedSharding(mesh, P("y"))})  # 2 rows over 4 devices
    with pytest.raises(zarrckpt.StateDictMismatchError, match="holds bytes"):
        zj.load(path, {"blob": NamedSharding(mesh, P())})
    with pytest.raises(zarrckpt.StateDictMismatchError, match="holds a int value"):
        zj.load(path, {"step": NamedSharding(mesh, P())})
    with pytest.raises(TypeError, match="pytree target"):
        zj.load(path, NamedSharding(mesh, P()), key_map={"a": "b"})


def test_each_process_reads_each_box_once(tmp_path, mesh):
    a = sample((64, 32), np.float32)
    zj.save({"a": put(a, NamedSharding(mesh, P("x", "y")))}, tmp_path / "c")  # chunks (32, 8)
    ck = zarrckpt.open(tmp_path / "c")
    ck["a"].info
    chunk = 32 * 8 * 4 + 4
    for spec, want in [(P("x", "y"), 8 * chunk),  # every chunk once
                       (P(), 8 * chunk),  # 8 replicas: still every chunk once
                       (P("x"), 8 * chunk),  # 4 replicas of each half
                       (P(None, "y"), 8 * chunk)]:
        before = file_metric("bytes_read")
        rep: dict = {}
        got = zj.load(ck, {"a": NamedSharding(mesh, spec)}, report=rep)["a"]
        assert file_metric("bytes_read") - before == want, spec
        assert rep["bytes_needed"] == a.nbytes == rep["bytes_fetched"]
        np.testing.assert_array_equal(np.asarray(got), a)
    # only the keys asked for are read
    zj.save({"a": put(a, NamedSharding(mesh, P("x", "y"))), "b": jnp.ones((1024,))}, tmp_path / "d")
    ck = zarrckpt.open(tmp_path / "d")
    ck.array_infos(["a", "b"])
    before = file_metric("bytes_read")
    zj.load(ck, NamedSharding(mesh, P()), keys=["b"])
    assert file_metric("bytes_read") - before == 4096 + 4


@pytest.mark.parametrize("save_spec,load_spec,unit_reads", [
    (P(("x", "y")), P(None, "y"), 8),   # row chunks, a column split on 4 devices: every box meets every chunk
    (P("x", "y"), P("y", "x"), 8),     # (32, 8) chunks, (16, 16) boxes: each chunk meets 2 boxes
    (P("x", "y"), P(None, ("y", "x")), 8),  # (32, 8) chunks, (64, 4) boxes: 2 boxes per chunk
    (P(("x", "y")), P("x", "y"), 8),    # (8, 32) chunks, (32, 8) boxes over 4 chunks each
])
def test_each_stored_byte_is_read_once_when_the_sharding_cuts_across_chunks(
        tmp_path, mesh, save_spec, load_spec, unit_reads):
    """Issue 29 item 3: boxes of different devices that share a stored chunk fetch it once
    per process (each device's box used to fetch every chunk it meets: 4x the bytes for the
    column split). Counted at the storage layer (TensorStore's kvstore metrics and the
    direct chunk-file path)."""
    a = sample((64, 32), np.float32)
    zj.save({"a": put(a, NamedSharding(mesh, save_spec))}, tmp_path / "c")
    ck = zarrckpt.open(tmp_path / "c")
    info = ck["a"].info
    assert info.inner_chunk_shape is None  # plain chunks, each a file of data + CRC-32C
    chunk = int(np.prod(info.chunk_shape)) * 4 + 4
    before = file_metric("bytes_read")
    rep: dict = {}
    got = zj.load(ck, {"a": NamedSharding(mesh, load_spec)}, report=rep)["a"]
    assert file_metric("bytes_read") - before == unit_reads * chunk, (save_spec, load_spec)
    assert rep["bytes_fetched"] == a.nbytes == rep["bytes_needed"]
    np.testing.assert_array_equal(np.asarray(got), a)
    assert got.sharding == NamedSharding(mesh, load_spec)
    for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), a[shard.index])


def test_shared_chunks_with_casts_and_two_targets_of_one_key(tmp_path, mesh):
    """One key loaded into two targets (another sharding, a cast): still each chunk once."""
    a = sample((64, 32), np.float32)
    zj.save({"a": put(a, NamedSharding(mesh, P(("x", "y"))))}, tmp_path / "c")
    ck = zarrckpt.open(tmp_path / "c")
    ck["a"].info
    before = file_metric("bytes_read")
    target = {"p": NamedSharding(mesh, P(None, "y")),
              "q": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x")))}
    got = zj.load(ck, target, key_map=lambda k: "a", cast=True)
    assert file_metric("bytes_read") - before == 8 * (8 * 32 * 4 + 4)
    np.testing.assert_array_equal(np.asarray(got["p"]), a)
    np.testing.assert_array_equal(np.asarray(got["q"]), a.astype(ml_dtypes.bfloat16))


def test_read_groups_read_each_unit_once():
    """The grouping alone, over random boxes and units, including groups whose bounding box
    has units no box needs (those are not read)."""
    from zarrckpt.interop.jax import _read_groups

    rng = np.random.default_rng(0)
    for _ in range(300):
        nd = int(rng.integers(1, 4))
        shape = tuple(int(rng.integers(1, 20)) for _ in range(nd))
        unit = tuple(int(rng.integers(1, 7)) for _ in range(nd))
        boxes = set()
        for _ in range(int(rng.integers(1, 7))):
            box = []
            for n in shape:
                a = int(rng.integers(0, n + 1))
                box.append((a, int(rng.integers(a, n + 1))))
            boxes.add(tuple(box))
        groups = _read_groups(sorted(boxes), unit, shape)
        seen: dict = {}
        members = []
        for region, mem, parts in groups:
            members += mem
            for m in mem:
                assert all(ra <= a and b <= rb for (a, b), (ra, rb) in zip(m, region))
            for part in parts:
                assert all(ra <= a <= b <= rb for (a, b), (ra, rb) in zip(part, region))
                ranges = [range(a // u, -(-b // u)) for (a, b), u in zip(part, unit)]
                for cell in itertools.product(*ranges):
                    seen[cell] = seen.get(cell, 0) + 1
        assert sorted(members) == sorted(boxes)
        needed = set()
        for box in (b for b in boxes if all(x < y for x, y in b)):  # an empty box reads nothing
            needed |= set(itertools.product(*[range(a // u, -(-b // u)) for (a, b), u in zip(box, unit)]))
        assert set(seen) == needed and set(seen.values()) <= {1}, (shape, unit, boxes, groups)


# ------------------------------------------------------------------ torch -> JAX -> torch


def test_round_trip_torch_jax_torch(tmp_path, mesh, clusters):
    """DTensors on a (2, 2) mesh of 4 gloo ranks -> JAX arrays with NamedShardings on 8 devices
    -> saved by JAX -> loaded by 4 torch ranks into DTensors of other placements: every bit."""
    import _roundtrip as rt
    import torch

    world = clusters(4)
    world.run(rt.save_torch, str(tmp_path / "torch"))
    shardings = {
        "model/w1": P("x", "y"), "model/w2": P("y", "x"), "model/b": P("y"), "model/fp8": P(("x", "y")),
        "optim/state/model.w1/exp_avg": P(), "optim/state/model.w1/step": P(), "buffers/count": P("x"),
    }
    target: dict = {"step": None}
    for key, spec in shardings.items():
        node = target
        parts = key.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = NamedSharding(mesh, spec)
    with jax.enable_x64(True):  # int64 buffers stay 64-bit
        loaded = zj.load(tmp_path / "torch", target)
        for key, spec in shardings.items():
            arr = loaded
            for p in key.split("/"):
                arr = arr[p]
            want = rt.global_tensor(key)
            assert arr.sharding.spec == spec and arr.shape == tuple(want.shape)
            np.testing.assert_array_equal(bits(arr), rt.bits(want))
        assert loaded["step"] == 10
        zj.save(loaded, tmp_path / "jax")
    check_checkpoint(tmp_path / "jax")
    ck = zarrckpt.open(tmp_path / "jax")
    assert ck["model/w1"].chunks == (8, 3) and ck["model/fp8"].chunks == (1, 8)
    results = world.run(rt.load_torch_and_compare, str(tmp_path / "jax"))
    for rank, res in enumerate(results):
        assert all(res.values()), (rank, res)
    sd = zarrckpt.load_state_dict(tmp_path / "jax")
    for key in shardings:
        t = sd
        for p in key.split("/"):
            t = t[p]
        assert isinstance(t, torch.Tensor) and t.dtype == rt.global_tensor(key).dtype
        np.testing.assert_array_equal(rt.bits(t), rt.bits(rt.global_tensor(key)))


# ------------------------------------------------------------------ many processes


def _run_job(scenario: str, where) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(TESTS, "_jax_multiprocess.py"), str(pid), str(port),
                               scenario, str(where)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in range(2)]
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        # gloo's C++ log lines share stdout and may land on the JSON's line, before or after
        # it ("[Gloo] Rank 1 is connected to {...}1 peer ranks"): find the JSON, raw_decode it
        lines = [ln[ln.index('{"process"'):] for ln in stdout.splitlines() if '{"process"' in ln]
        assert p.returncode == 0 and lines, stdout + stderr[-3000:]
        outs.append(json.JSONDecoder().raw_decode(lines[-1])[0])
    return sorted(outs, key=lambda o: o["process"])


def test_two_process_job_loads_only_its_own_shards(tmp_path, mesh):
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    zj.save({"x": put(full, NamedSharding(mesh, P("x", "y")))}, tmp_path / "src")  # chunks (32, 8)
    outs = _run_job("load", tmp_path)
    chunk = 32 * 8 * 4 + 4
    for o in outs:
        assert o["devices"] == 8 and o["local"] == 4 and "error" not in o, o
        assert o["sharded_ok"] and o["sharded_shards"] == 4 and o["replicated_ok"], o
        assert o["sharded_read"] == 4 * chunk, o  # its half: rows of its process, each chunk once
        assert o["replicated_read"] == 8 * chunk, o  # the whole array once, not once per device


def test_two_process_job_saves_each_shard_once(tmp_path):
    outs = _run_job("save", tmp_path)
    assert all("error" not in o for o in outs), outs
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    check_checkpoint(tmp_path / "out")
    ck = zarrckpt.open(tmp_path / "out")
    assert ck.world_size == 2 and ck.step == 5 and ck["step"] == 5
    np.testing.assert_array_equal(ck["x"][...], full)
    assert ck["x"].chunks == (32, 8) and ck["x"].mesh["dim_names"] == ["proc", "dev"]
    assert ck["y"][...].tolist() == list(range(8)) and ck["local"][...].tolist() == [7, 7, 7]
    # each process wrote the chunks of its own devices: half of x each, y and local once in all
    xs = [o["report_bytes"] for o in outs]
    assert sum(xs) == full.nbytes + 8 * 4 + 3 * 2 and all(b >= full.nbytes // 2 for b in xs), xs
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


@pytest.mark.parametrize("scenario, error", [("disagree", "SaveFailedError"), ("fail", "UnsupportedValueError")])
def test_two_process_job_fails_together(tmp_path, scenario, error):
    outs = _run_job(scenario, tmp_path)
    assert [o.get("error") for o in outs] == [error, error], outs
    if scenario == "fail":
        assert "process 1" in outs[0]["message"] and "object" in outs[1]["message"], outs
    assert not (tmp_path / "bad").exists() and not os.listdir(tmp_path)


# ------------------------------------------------------------------ without torch, without jax


def test_jax_round_trip_without_torch(tmp_path):
    out = run_blocked(f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import zarrckpt
mesh = jax.make_mesh((2, 4), ("x", "y"))
a = jax.device_put(jnp.arange(32.0, dtype=jnp.bfloat16).reshape(8, 4), NamedSharding(mesh, P("y", "x")))
zarrckpt.jax.save({{"a": a, "step": 1}}, {str(tmp_path / "c")!r})
b = zarrckpt.jax.load({str(tmp_path / "c")!r}, NamedSharding(mesh, P("x")))["a"]
assert b.dtype == jnp.bfloat16 and (np.asarray(b) == np.asarray(a)).all()
import sys
assert "torch" not in sys.modules
print("ok")
""")
    assert out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]


def test_missing_jax_is_named():
    out = run_blocked("""
import zarrckpt
try:
    import zarrckpt.jax
except zarrckpt.MissingDependencyError as e:
    assert "zarrckpt.jax needs jax" in str(e) and "zarrckpt[jax]" in str(e), e
    print("ok")
""", blocked=("torch", "jax"))
    assert out.stdout.strip() == "ok", out.stdout + out.stderr[-3000:]
