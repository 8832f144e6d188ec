"""The ``zarrckpt`` command (zarrckpt/cli.py) and the torch-free API behind it
(zarrckpt.inspect): info, verify on a corpus of damaged checkpoints, diff, stats, ls
(local and S3), convert in every direction, --json, exit statuses, progress, and no
torch where none is needed.

Most commands run in-process through ``cli.main`` (an interpreter start costs more than
the command); the real entry points run as subprocesses: ``python -m zarrckpt``, the
installed ``zarrckpt`` script, and ``python -m zarrckpt`` where torch cannot be imported.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import crc32c
import ml_dtypes
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.tools import inspect as zi
from zarrckpt.tools import cli
from zarrckpt.format import dtypes as zdt
from zarrckpt.format import documents as fmt
from zarrckpt.engine.writer import Writer

REPO = Path(__file__).resolve().parent.parent
F32 = zdt.by_zarr("float32")


# ------------------------------------------------------------------ helpers


def run(capsys, *args) -> tuple[int, str, str]:
    """``zarrckpt ARGS`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def run_process(*args, env=None, exe=(sys.executable, "-m", "zarrckpt")) -> subprocess.CompletedProcess:
    return subprocess.run([*exe, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=REPO)


def write(path, arrays: dict, values: dict | None = None, *, chunks: dict | None = None,
          inner_chunk_bytes: int = 64, metadata: dict | None = None, pack_bytes: int = 64 << 10) -> Path:
    """A checkpoint made by the streaming Writer (no torch): ``arrays`` of NumPy arrays,
    chunked as ``chunks[key]`` says (default: whole, packed when small)."""
    chunks = chunks or {}
    with Writer(path, inner_chunk_bytes=inner_chunk_bytes, metadata=metadata, pack_bytes=pack_bytes) as w:
        for key, data in arrays.items():
            if key not in chunks:
                w.add((key,), data)
                continue
            a = w.add_array((key,), data.shape, zdt.by_numpy(data.dtype), chunk_shape=chunks[key])
            for start in a.chunk_starts():
                a.write(start, data[tuple(slice(lo, hi) for lo, hi in a.chunk_box(start))])
        for key, v in (values or {}).items():
            w.add((key,), v)
    return Path(path)


def grid_arrays() -> dict:
    return {"plain": np.arange(20, dtype=np.float32).reshape(5, 4),      # 3 chunks of [2, 4], no sharding
            "shard": np.arange(60, dtype=np.float32).reshape(10, 6),     # 2 shards [8, 6] of inner [4, 3];
            "small": np.arange(3, dtype=np.int16)}                       # the edge shard lacks its padding


GRID_CHUNKS = {"plain": (2, 4), "shard": (8, 6)}


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    """Multi-chunk arrays, a shard with absent padding inner chunks, a pack, a value."""
    return write(tmp_path_factory.mktemp("grid") / "ckpt", grid_arrays(), {"step": 7}, chunks=GRID_CHUNKS)


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"layers.0.weight": torch.randn(300, 200, generator=g),          # its own array
                  "layers.0.bias": torch.randn(200, generator=g).to(torch.bfloat16),  # packed
                  "fp8": torch.randn(16, 8, generator=g).to(torch.float8_e4m3fn),
                  "scale": torch.tensor(2.5), "empty": torch.zeros(0, 4)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 100,
        "rng": b"\x01\x02\x03",
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    zarrckpt.save(state(), path, pack_bytes=64 << 10)  # packed leaves (deprecated) are still shown and checked
    return path


def copy(src: Path, tmp_path: Path, name: str = "c") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def pending_root(path: Path) -> None:
    """The root of a save that never committed (spec §7.1)."""
    doc = fmt.root_metadata(state="pending", save_id=fmt.new_save_id(), world_size=2, created=fmt.utc_now(),
                            writer={"zarrckpt": "test"})
    path.mkdir(parents=True, exist_ok=True)
    (path / "zarr.json").write_bytes(fmt.encode_document(doc))


# ------------------------------------------------------------------ info


def test_info_tree_totals_and_json(saved, capsys):
    code, out, err = run(capsys, "info", saved)
    assert code == 0 and err == ""
    assert "committed, format 1.3" in out and "by 1 process" in out and "step     100" in out
    lines = out.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.split()[:2] == ["KEY", "DTYPE"]):]
    assert "model/" in [line.strip() for line in lines]
    row = next(line for line in lines if "layers.0.weight" in line)
    assert "float32" in row and "[300, 200]" in row and "234.4 KiB" in row and "chunks [300, 200]" in row
    assert "packed" in next(line for line in lines if "layers.0.bias" in line)
    assert "float8_e4m3fn" in next(line for line in lines if " fp8 " in line)
    assert "[]" in next(line for line in lines if "scale" in line)
    assert "= " in next(line for line in lines if line.startswith("  step "))
    assert "11 keys, 8 arrays" in out

    code, out, _ = run(capsys, "info", saved, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["state"] == "committed" and doc["world_size"] == 1 and doc["num_keys"] == 11
    leaves = {leaf["key"]: leaf for leaf in doc["leaves"]}
    w = leaves["model/layers.0.weight"]
    assert (w["dtype"], w["shape"], w["nbytes"], w["packed"]) == ("float32", [300, 200], 240000, False)
    assert leaves["model/layers.0.bias"]["packed"] and leaves["model/layers.0.bias"]["dtype"] == "bfloat16"
    assert leaves["step"] == {**leaves["step"], "kind": "value", "value": 100}
    assert doc["nbytes"] == sum(leaf["nbytes"] for leaf in doc["leaves"])


def test_info_depth_and_key_filter(saved, capsys):
    code, out, _ = run(capsys, "info", saved, "--depth", "1")
    assert code == 0
    model = next(line for line in out.splitlines() if line.strip().startswith("model/"))
    assert "5 keys, 5 arrays" in model and "layers.0.weight" not in out
    code, out, _ = run(capsys, "info", saved, "--keys", "optim", "--json")
    assert sorted(leaf["key"] for leaf in json.loads(out)["leaves"]) == [
        "optim/param_groups/0/lr", "optim/param_groups/0/params/0", "optim/state/0/exp_avg", "optim/state/0/step"]
    code, out, _ = run(capsys, "info", saved, "-k", "model/*.bias", "--json")
    assert [leaf["key"] for leaf in json.loads(out)["leaves"]] == ["model/layers.0.bias"]


def test_info_of_an_uncommitted_save_says_so(tmp_path, capsys):
    pending_root(tmp_path / "p")
    code, out, err = run(capsys, "info", tmp_path / "p")
    assert code == 0 and "pending" in out and "never committed" in out and "2 process" in out
    assert json.loads(run(capsys, "info", tmp_path / "p", "--json")[1])["state"] == "pending"


def _save_dtensor(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    w = distribute_tensor(torch.arange(48, dtype=torch.float32).reshape(8, 6), mesh, [Shard(0)])
    zarrckpt.save({"w": w, "step": 5}, path, pack_bytes=0)


def test_two_rank_dtensor_checkpoint(tmp_path, clusters, capsys):
    path = tmp_path / "dt"
    clusters(2).run(_save_dtensor, str(path))
    code, out, _ = run(capsys, "info", path)
    assert code == 0 and "by 2 processes" in out and "mesh     (dp=2)" in out
    assert "dtensor (dp=2) [Shard(0)]" in next(line for line in out.splitlines() if line.strip().startswith("w "))
    leaf = json.loads(run(capsys, "info", path, "--json")[1])["leaves"][0]
    assert leaf["mesh"] == {"shape": [2], "dim_names": ["dp"]} and leaf["placements"] == ["Shard(0)"]
    assert leaf["chunks"] == [8, 6]  # both shards grouped into one chunk (chunk_target_bytes, spec C.1 step 3)
    assert zi.info(path).meshes == [zi.MeshInfo((2,), ("dp",))]
    code, out, _ = run(capsys, "verify", path, "--json")
    assert code == 0 and json.loads(out)["chunks"] == 1
    flip(path / "w" / "c" / "0" / "0", 5)  # the one chunk, written by one rank from both shards
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and "CHECKSUM" in out and "w chunk c/0/0" in out


# ------------------------------------------------------------------ verify


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path, n: int) -> None:
    path.write_bytes(path.read_bytes()[:-n])


def mark_inner_missing(path: Path, entry: int) -> None:
    """Set one shard index entry to 'absent' (2**64 - 1 twice), with a correct index CRC:
    a shard whose inner chunk overlapping the array is missing (spec §5.3)."""
    data = bytearray(path.read_bytes())
    n = 4  # inner chunks per shard of the grid's "shard" array: [8, 6] / [4, 3]
    index = data[-(16 * n + 4):-4]
    index[16 * entry:16 * entry + 16] = b"\xff" * 16
    data[-(16 * n + 4):] = bytes(index) + crc32c.crc32c(bytes(index)).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def edit_root(path: Path, old: bytes, new: bytes) -> None:
    """Change the root and record its new digest: a root that passes §6.6 but says
    something wrong."""
    raw = (path / "zarr.json").read_bytes()
    digest = json.loads(raw)["attributes"]["zarrckpt"]["digests"]["root"]
    edited = raw.replace(old, new, 1)
    assert edited != raw
    (path / "zarr.json").write_bytes(edited.replace(digest.encode(), fmt.root_digest(edited, digest).encode()))


def edit(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert old in data, (path, old)
    path.write_bytes(data.replace(old, new, 1))


# name -> (damage, problem kind, where: the tensor/array and the chunk named)
DAMAGE = {
    "flipped byte in a chunk": (lambda p: flip(p / "plain/c/1/0", 3), "CHECKSUM", "plain chunk c/1/0"),
    "flipped byte in an inner chunk": (lambda p: flip(p / "shard/c/0/0", 60), "CHECKSUM", "shard chunk c/0/0 inner [0, 1]"),
    "deleted shard": (lambda p: os.remove(p / "shard/c/1/0"), "MISSING", "shard chunk c/1/0: not in storage"),
    "truncated shard": (lambda p: truncate(p / "shard/c/0/0", 7), "CHECKSUM", "shard chunk c/0/0: shard index"),
    "truncated chunk": (lambda p: truncate(p / "plain/c/2/0", 2), "CHECKSUM", "plain chunk c/2/0"),
    "inner chunk missing from its shard": (lambda p: mark_inner_missing(p / "shard/c/1/0", 1), "MISSING",
                                           "shard chunk c/1/0 inner [0, 1]"),
    "array zarr.json changed": (lambda p: edit(p / "plain/zarr.json", b'"fill_value":0', b'"fill_value":1'),
                                "DIGEST", "plain: array 'plain': plain/zarr.json does not match its digest"),
    "array zarr.json deleted": (lambda p: os.remove(p / "plain/zarr.json"), "MISSING", "plain: its zarr.json"),
    "root changed": (lambda p: edit(p / "zarr.json", b'{"json":7}', b'{"json":8}'), "DIGEST",
                     "root zarr.json: "),
    "root not JSON": (lambda p: truncate(p / "zarr.json", 3), "ROOT", "root zarr.json: "),
    "pack deleted": (lambda p: os.remove(p / ".packs/0/c/0"), "MISSING",
                     ".packs/0 (holds small) chunk c/0: not in storage"),
    "packed leaf outside its pack": (lambda p: edit_root(p, b'"offset":0', b'"offset":64'), "PACK",
                                     ".packs/0 (holds small): packed leaf 'small': bytes 64..70 lie outside"),
    "uncommitted save": (lambda p: pending_root(p), "UNCOMMITTED", "root zarr.json: "),
}


def test_a_healthy_checkpoint_verifies(grid, saved, capsys):
    for path, jobs in ((grid, "1"), (grid, "3"), (saved, "2")):
        code, out, err = run(capsys, "verify", path, "--jobs", jobs)
        assert code == 0 and out.startswith("ok: ") and err == "", out + err
    rep = json.loads(run(capsys, "verify", grid, "--json")[1])
    # 3 plain chunks + 2 shards + 1 pack chunk; the edge shard's padding inner chunks are absent
    assert rep["ok"] and rep["arrays"] == 3 and rep["chunks"] == 6 and rep["problems"] == []
    assert rep["bytes"] == 20 * 4 + 10 * 6 * 4 + 8  # every element once, and the pack (6 bytes padded to 8)
    assert len(list((grid / "shard/c/1").iterdir())) == 1


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_verify_names_what_is_broken(grid, tmp_path, capsys, damage):
    fn, kind, where = DAMAGE[damage]
    path = copy(grid, tmp_path)
    fn(path)
    code, out, err = run(capsys, "verify", path)
    assert code == 1, out + err
    assert out.splitlines()[-1].startswith("FAILED"), out
    problems = [line for line in out.splitlines()[:-1]]
    assert len(problems) == 1, out  # exactly the damage, nothing else
    assert problems[0].split()[0] == kind and where in problems[0], problems[0]
    rep = json.loads(run(capsys, "verify", path, "--json")[1])
    assert rep["ok"] is False and len(rep["problems"]) == 1
    assert rep["problems"][0]["kind"] == kind.lower()


def test_verify_damage_in_a_checkpoint_saved_by_save(saved, tmp_path, capsys):
    path = copy(saved, tmp_path)
    flip(path / "model/layers.0.weight/c/0/0", 1000)
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and "CHECKSUM    model/layers.0.weight chunk c/0/0: " in out and "Digest mismatch" in out
    os.remove(path / ".packs/0/c/0")
    rep = zi.verify(path)
    assert {(p.kind, p.array, p.chunk) for p in rep.problems} == {
        ("checksum", "model/layers.0.weight", "c/0/0"), ("missing", ".packs/0", "c/0")}
    pack = next(p for p in rep.problems if p.array == ".packs/0")
    assert "model/layers.0.bias" in pack.keys and "rng" in pack.keys


def test_verify_reads_shards_in_bounded_groups(grid, tmp_path):
    """A shard larger than max_read_bytes is read in groups of inner chunks, not whole."""
    arrays = {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}
    path = write(tmp_path / "c", arrays, chunks={"w": (64, 64)}, inner_chunk_bytes=1024, pack_bytes=0)
    info = zarrckpt.open(path).array_info("w")
    assert info.inner_chunk_shape == (16, 16)
    seen = []

    def progress(p):
        seen.append(p.bytes_done)

    rep = zi.verify(path, max_read_bytes=2048, progress=progress, jobs=1)
    assert rep.ok and rep.chunks == 1 and rep.bytes == 64 * 64 * 4
    assert len(seen) == 8 and all(b - a == 2048 for a, b in zip([0] + seen, seen))  # two inner chunks each


# ------------------------------------------------------------------ diff


def diff_pair(tmp_path, change=None, **b_extra) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal((64, 32)).astype(np.float32),
            "b": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
            "e": np.zeros((0, 4), np.float32), "s": np.array(1.5, np.float32)}
    base["w"][3, 3] = np.nan
    other = {k: v.copy() for k, v in base.items()}
    if change:
        change(other)
    other.update(b_extra)
    a = write(tmp_path / "a", base, {"n": 3}, chunks={"w": (16, 32)})
    b = write(tmp_path / "b", other, {"n": 3}, chunks={k: (16, 32) for k in other if k == "w"
                                                       and other["w"].shape == (64, 32)})
    return a, b


def test_diff_identical(tmp_path, capsys):
    a, b = diff_pair(tmp_path)
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 0 and "same: 5 keys, bit-identical" in out


def test_diff_one_changed_value(tmp_path, capsys):
    def bump(d):
        d["w"][5, 3] += 0.5

    a, b = diff_pair(tmp_path, bump)
    code, out, _ = run(capsys, "diff", a, b)
    row = next(line for line in out.splitlines() if line.startswith("w "))
    assert code == 1 and row.split()[:5] == ["w", "different", "1", "of", "2048"]
    expected = abs(np.float32(np.float32(0.5) + zarrckpt.open(a)["w"][5, 3]) - zarrckpt.open(a)["w"][5, 3])
    d = json.loads(run(capsys, "diff", a, b, "--json")[1])["leaves"][0]
    assert d["max_abs"] == pytest.approx(float(expected)) and d["num_different"] == 1
    assert d["max_rel"] == pytest.approx(float(expected) / abs(float(zarrckpt.open(b)["w"][5, 3])))
    assert "different: 1 of 5 common keys differ" in out
    assert run(capsys, "diff", a, b, "--atol", "0.6")[0] == 0
    code, out, _ = run(capsys, "diff", a, b, "--atol", "0.6")
    assert "within tolerance" in out and "close" in out
    assert run(capsys, "diff", a, b, "--atol", "0.1")[0] == 1
    assert run(capsys, "diff", a, b, "--rtol", "10")[0] == 0


def test_diff_keys_shapes_dtypes_values(tmp_path, capsys):
    def reshape(d):
        d["w"] = d["w"][:, :31].copy()
        d["b"] = d["b"].astype(np.float32)
        d.pop("s")

    a, b = diff_pair(tmp_path, reshape, extra=np.ones(2, np.float32))
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1
    assert "only in A: s" in out and "only in B: extra" in out
    assert "shape [64, 32] -> [64, 31]" in out and "dtype bfloat16 -> float32" in out
    rep = zi.diff(a, b)
    status = {d.key: d.status for d in rep.leaves}
    assert status == {"w": "shape", "b": "dtype", "e": "identical", "n": "identical"}
    assert next(d for d in rep.leaves if d.key == "b").num_different == 0  # bf16 values are exact in f32
    c = write(tmp_path / "c", {"w": np.zeros(1, np.float32)}, {"n": 4, "b": "x"})
    rep = zi.diff(a, c, keys=["n", "b"])
    assert {d.key: d.status for d in rep.leaves} == {"n": "different", "b": "kind"}
    code, out, _ = run(capsys, "diff", a, c, "-k", "n")
    assert code == 1 and "3 -> 4" in out


def test_diff_reads_chunk_by_chunk(tmp_path, monkeypatch):
    """Memory is bounded by chunks: no read is larger than one stored chunk of [16, 32]."""
    a, b = diff_pair(tmp_path)
    from zarrckpt.readers.checkpoint import CheckpointView

    reads = []
    real = CheckpointView.read_box

    def spy(view, key, box):
        out = real(view, key, box)
        reads.append((key, out.size))
        return out

    monkeypatch.setattr(CheckpointView, "read_box", spy)
    assert zi.diff(a, b, jobs=1).same
    w_reads = [n for k, n in reads if k == "w"]
    assert w_reads == [16 * 32] * 8  # 4 chunks, from each side
    reads.clear()
    zi.stats(a, jobs=2)
    assert [n for k, n in reads if k == "w"] == [16 * 32] * 4


# ------------------------------------------------------------------ stats


def reference_stats(x: np.ndarray) -> dict:
    x = x.astype(np.float64).reshape(-1)
    f = x[np.isfinite(x)]
    return {"norm": np.sqrt((f * f).sum()), "mean": f.mean(), "std": f.std(), "min": f.min(), "max": f.max(),
            "zeros": np.mean(x == 0), "nan": np.mean(np.isnan(x)), "inf": np.mean(np.isinf(x))}


def test_stats_match_numpy(tmp_path, capsys):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((50, 8)) * 3 + 1).astype(np.float32)
    w[0, :3] = 0
    w[7, 1], w[20, 2], w[33, 5] = np.nan, np.inf, -np.inf
    b = rng.standard_normal(37).astype(ml_dtypes.bfloat16)
    arrays = {"w": w, "b": b, "i": np.arange(-3, 9, dtype=np.int64), "nan": np.full(4, np.nan, np.float32),
              "empty": np.zeros((0, 2), np.float32)}
    path = write(tmp_path / "c", arrays, chunks={"w": (16, 8)})
    code, out, _ = run(capsys, "stats", path, "--json")
    assert code == 0
    (ck,) = json.loads(out)["checkpoints"]
    got = {t["key"]: t for t in ck["tensors"]}
    for key in ("w", "b", "i"):
        want = reference_stats(arrays[key])
        for name, value in want.items():
            assert got[key][name] == pytest.approx(value, rel=1e-12, abs=1e-12), (key, name)
        assert got[key]["numel"] == arrays[key].size
    assert got["w"]["nan"] == 1 / 400 and got["w"]["inf"] == 2 / 400 and got["w"]["zeros"] == 3 / 400
    assert got["nan"]["nan"] == 1.0 and got["nan"]["norm"] is None and got["nan"]["mean"] is None
    assert got["empty"]["numel"] == 0 and got["empty"]["zeros"] is None
    code, out, _ = run(capsys, "stats", path)
    row = next(line for line in out.splitlines() if line.split()[0] == "w")
    assert f"{reference_stats(w)['norm']:.4g}" in row and "0.75%" in row and "0.5%" in row  # zeros, inf


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A CheckpointManager run: steps 10, 20, 30 (with the loss), and an interrupted save at 40."""
    root = tmp_path_factory.mktemp("run") / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with zarrckpt.CheckpointManager(root) as mgr:
        for step in (10, 20, 30):
            with torch.no_grad():
                model.weight.mul_(1.5)
            mgr.save(step, {"model": model.state_dict()}, metrics={"loss": 1.0 / step})
    pending_root(root / "step_00000040")
    return root


def test_stats_of_a_run_table_per_step_and_plot(run_dir, tmp_path, capsys):
    png = tmp_path / "norms.png"
    code, out, err = run(capsys, "stats", run_dir, "--plot", png)
    assert code == 0, err
    for step in (10, 20, 30):
        assert f"step {step}  {run_dir}/step_{step:08d}" in out
    assert "step 40" not in out
    table = out[out.index("norm by step"):]
    assert table.splitlines()[1].split() == ["KEY", "10", "20", "30"]
    norms = [float(x) for x in next(line for line in table.splitlines() if "model/weight" in line).split()[1:]]
    assert norms[1] == pytest.approx(norms[0] * 1.5, rel=1e-3) and norms[2] == pytest.approx(norms[0] * 2.25, rel=1e-3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    doc = json.loads(run(capsys, "stats", run_dir / "step_00000010", run_dir / "step_00000030", "--json")[1])
    assert [c["step"] for c in doc["checkpoints"]] == [10, 30] and doc["plot"] is None


@pytest.mark.parametrize("name, magic", [("norms.jpg", b"\xff\xd8\xff"), ("norms.JPEG", b"\xff\xd8\xff"),
                                         ("norms.svg", b"<?xml"), ("norms.pdf", b"%PDF"),
                                         ("norms", b"\x89PNG\r\n\x1a\n")])
def test_stats_plot_writes_the_format_its_suffix_names(run_dir, tmp_path, capsys, name, magic):
    """--plot out.jpg wrote PNG bytes under .jpg."""
    out = tmp_path / name
    code, _, err = run(capsys, "stats", run_dir, "--plot", out, "-q")
    assert code == 0, err
    assert out.read_bytes()[:len(magic)] == magic


def test_stats_plot_refuses_a_suffix_it_cannot_write_before_reading(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli.zi, "stats", lambda *a, **k: pytest.fail("read before refusing the suffix"))
    code, out, err = run(capsys, "stats", run_dir, "--plot", tmp_path / "norms.xyz")
    assert code == 2 and out == "" and not (tmp_path / "norms.xyz").exists()
    assert err.startswith(f"zarrckpt stats: error: cannot write a plot to '{tmp_path / 'norms.xyz'}': no image "
                          "format is named .xyz; matplotlib writes ") and ".jpg" in err and ".png" in err, err


def test_plot_norms_refuses_a_format_pillow_cannot_write(tmp_path, monkeypatch):
    from PIL import Image

    import zarrckpt.inspect as zi

    Image.init()
    monkeypatch.delitem(Image.SAVE, "WEBP")
    with pytest.raises(zarrckpt.MissingDependencyError, match="pillow cannot write WEBP"):
        zi.plot_norms([], tmp_path / "n.webp")
    assert zi.plot_format(tmp_path / "n.webp.png") == "png"


# ------------------------------------------------------------------ ls


def test_ls_a_run_directory(run_dir, capsys):
    code, out, _ = run(capsys, "ls", run_dir)
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:5]]
    assert [(r[0], r[1]) for r in rows] == [("10", "committed"), ("20", "committed"), ("30", "committed"),
                                             ("40", "pending")]
    assert rows[0][2:4] == ["144", "B"] and rows[3][2] == "-"  # Linear(8, 4): 32 + 4 float32
    assert "4 checkpoints: 3 committed, 1 pending (a save interrupted or still running)" in out
    doc = json.loads(run(capsys, "ls", run_dir, "--json")[1])
    assert [(x["kind"], x["name"], x["live"]) for x in doc["leftovers"]] == [("claim", "step_00000040", False)]
    assert f"1 leftover of dead saves ({doc['leftovers'][0]['nbytes']} B): zarrckpt clean {run_dir} removes them" in out
    doc = doc["checkpoints"]
    assert [x["step"] for x in doc] == [10, 20, 30, 40] and doc[3]["world_size"] == 2
    assert doc[0]["time"].endswith("Z") and doc[0]["nbytes"] == 144
    assert json.loads(run(capsys, "ls", run_dir / "step_00000020", "--json")[1])["checkpoints"][0]["step"] == 20


def test_on_s3(s3, tmp_path, capsys, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(tmp_path))
    base = s3.url(s3.fresh_prefix() + "run").rstrip("/")
    for step in (1, 2):
        write(f"{base}/step_{step:08d}", grid_arrays(), {"step": step}, chunks=GRID_CHUNKS,
              metadata={"step": step})
    zarrckpt.storage.open_storage(f"{base}/step_00000003").write_atomic("zarr.json", fmt.encode_document(
        fmt.root_metadata(state="pending", save_id=fmt.new_save_id(), world_size=1, created=fmt.utc_now(),
                          writer={})))
    code, out, err = run(capsys, "ls", base)
    assert code == 0, err
    assert [line.split()[:2] for line in out.splitlines()[1:4]] == [["1", "committed"], ["2", "committed"],
                                                                     ["3", "pending"]]
    assert f"{base}/step_00000001" in out
    code, out, _ = run(capsys, "verify", f"{base}/step_00000002")
    assert code == 0 and out.startswith("ok: ")
    code, out, _ = run(capsys, "diff", f"{base}/step_00000001", f"{base}/step_00000002")
    assert code == 1 and "1 -> 2" in out


# ------------------------------------------------------------------ convert


def hf_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed.weight": torch.randn(120, 64, generator=g),                       # 30 KB
        "model.layers.0.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.fp8": torch.randn(9, 5, generator=g).to(torch.float8_e5m2),
        "model.layers.1.weight": torch.randn(64, 64, generator=g),
        "model.norm": torch.tensor(0.25, dtype=torch.bfloat16),                        # 0-d
        "model.empty": torch.zeros(0, 3),
        "lm_head.weight": torch.randn(100, 64, generator=g).to(torch.float16),
    }


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    zarrckpt.save(hf_state(), path)
    return path


def test_convert_safetensors_sharded_both_ways(hf_ckpt, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    code, text, err = run(capsys, "convert", hf_ckpt, out, "--to", "safetensors", "--max-shard-size", "40KB")
    assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all(f"wrote {out / f}" in text for f in files)
    loaded = {}
    for f in files:
        loaded.update(load_file(out / f))
    want = hf_state()
    assert sorted(loaded) == sorted(want)
    for k in want:
        assert loaded[k].dtype == want[k].dtype and loaded[k].shape == want[k].shape
        assert torch.equal(loaded[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8))
    code, text, _ = run(capsys, "convert", out, tmp_path / "back", "--json")
    rep = json.loads(text)
    assert code == 0 and rep["source_format"] == "safetensors" and rep["destination_format"] == "zarrckpt"
    assert zi.diff(hf_ckpt, tmp_path / "back").same


def test_convert_keys_and_dtype(hf_ckpt, tmp_path, capsys):
    from safetensors import safe_open

    dst = tmp_path / "layers.safetensors"
    code, _, err = run(capsys, "convert", hf_ckpt, dst, "--keys", "model.layers.0.=l0.", "--keys", "model.norm",
                       "--dtype", "float32")
    assert code == 0, err
    with safe_open(dst, "pt") as f:
        names = sorted(f.keys())
        assert names == ["l0.fp8", "l0.weight", "model.norm"]
        assert all(f.get_tensor(n).dtype == torch.float32 for n in names)
        assert torch.equal(f.get_tensor("l0.weight"), hf_state()["model.layers.0.weight"].float())
    code, _, err = run(capsys, "convert", hf_ckpt, tmp_path / "x", "--to", "safetensors", "--pack-bytes", "0")
    assert code == 2 and "--pack-bytes applies to zarrckpt output only" in err


@pytest.mark.parametrize("fmt_name,dst", [("torch_save", "m.pt"), ("dcp", "dcp_dir")])
def test_convert_torch_formats_both_ways(hf_ckpt, tmp_path, capsys, fmt_name, dst):
    code, text, err = run(capsys, "convert", hf_ckpt, tmp_path / dst, "--to", fmt_name, "--memory-limit", "64KiB")
    assert code == 0 and f"({fmt_name})" in text, err
    code, text, err = run(capsys, "convert", tmp_path / dst, tmp_path / "back", "--json")
    assert code == 0 and json.loads(text)["source_format"] == fmt_name, err
    assert zi.diff(hf_ckpt, tmp_path / "back").same


# ------------------------------------------------------------------ the real entry points, errors


def test_python_m_zarrckpt_and_the_installed_script(grid, tmp_path, capsys):
    bad = copy(grid, tmp_path)
    flip(bad / "plain/c/0/0", 2)
    r = run_process("verify", bad)
    assert r.returncode == 1 and "CHECKSUM    plain chunk c/0/0" in r.stdout and r.stderr == ""
    script = shutil.which("zarrckpt") or os.path.join(os.path.dirname(sys.executable), "zarrckpt")
    r = run_process("info", grid, "--json", exe=(script,))
    assert r.returncode == 0 and json.loads(r.stdout)["leaves"][0]["key"] == "plain", r.stderr
    r = run_process("info", tmp_path / "nope", exe=(script,))
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [f"zarrckpt info: error: no zarrckpt checkpoint at '{tmp_path / 'nope'}' "
                                     "(no zarr.json)"]
    code, _, err = run(capsys, "diff", grid, bad)
    assert code == 2 and "'plain'" in err and "checksum" in err  # damage met while reading: an input error


@pytest.mark.parametrize("args", [("info", "{missing}"), ("verify", "{missing}"), ("ls", "{missing}"),
                                  ("stats", "{missing}"), ("diff", "{missing}", "{missing}"),
                                  ("convert", "{missing}", "{tmp}/out"), ("info", "{file}")])
def test_bad_paths_are_one_line_errors(tmp_path, capsys, args):
    (tmp_path / "f.bin").write_bytes(b"x" * 10)
    args = [a.format(missing=tmp_path / "nope", tmp=tmp_path, file=tmp_path / "f.bin") for a in args]
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith(f"zarrckpt {args[0]}: error: ")


def test_usage_errors_and_no_traceback(tmp_path, grid, capsys):
    assert run(capsys, "verify", grid, "--jobs", "0")[0] == 2
    assert run(capsys, "diff", grid, grid, "--atol", "-1")[0] == 2
    code, _, err = run(capsys, "convert", grid, tmp_path / "x")
    assert code == 2 and "say --to" in err
    code, _, err = run(capsys, "bogus")
    assert code == 2 and "invalid choice" in err


def test_progress_only_on_a_terminal(grid, capsys, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    fake = Tty()
    monkeypatch.setattr(sys, "stderr", fake)
    assert cli.main(["verify", str(grid)]) == 0
    drawn = fake.getvalue()
    assert "\rverify [########################] 100% 328 B/328 B" in drawn and drawn.endswith("\r\x1b[K")
    fake = Tty()
    monkeypatch.setattr(sys, "stderr", fake)
    assert cli.main(["verify", str(grid), "--quiet"]) == 0 and fake.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    assert cli.main(["verify", str(grid)]) == 0 and sys.stderr.getvalue() == ""


BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(name + " is blocked in this test")
sys.meta_path.insert(0, Block())
"""


def test_no_torch_needed_except_for_torch_formats(grid, tmp_path):
    code = BLOCK_TORCH + f"""
import contextlib, io, json, runpy
from zarrckpt.tools import cli
grid, tmp = {str(grid)!r}, {str(tmp_path)!r}
def run(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()
assert run("info", grid)[0] == 0
assert run("verify", grid)[0] == 0
assert run("diff", grid, grid)[0] == 0
assert run("stats", grid, "--json")[0] == 0
assert run("ls", grid)[0] == 0
assert run("convert", grid, tmp + "/g.safetensors")[0] == 0
assert run("convert", tmp + "/g.safetensors", tmp + "/back")[0] == 0
assert run("diff", grid, tmp + "/back", "-k", "plain", "-k", "shard", "-k", "small")[0] == 0
code, out, err = run("convert", grid, tmp + "/g.pt")
assert code == 2 and "needs torch" in err, err
sys.argv = ["zarrckpt", "verify", grid, "--json"]
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        runpy.run_module("zarrckpt", run_name="__main__")
    except SystemExit as e:
        assert e.code == 0, e.code
assert json.loads(out.getvalue())["ok"] is True
assert "torch" not in sys.modules
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr
