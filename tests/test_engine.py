"""zarrckpt.engine.save driven directly: spec §7 over the one-process group, the torch group and a
fake two-rank group (two threads), the small-chunk decision, and agreement on failures."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.engine import commit as _commit, save as engine
from zarrckpt.format import dtypes
from zarrckpt.distributed import group as zdist
from zarrckpt.format import documents as fmt
from zarrckpt.format import tree as ztree
from zarrckpt.errors import SaveFailedError, ZarrckptError
from zarrckpt.storage import FaultStorage, open_storage

# ---- a fake group: ranks are threads of this process ------------------------------------


class _Table:
    """What the ranks of a ThreadGroup share: a slot per rank and a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def exchange(self, rank: int, value):
        """Every rank's ``value``, on every rank (two barriers: all write, all read)."""
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadGroup:
    """One rank of a group of threads: the engine's group protocol without processes."""

    def __init__(self, table: _Table, rank: int) -> None:
        self.table, self.rank, self.size = table, rank, table.size

    def agree(self, error, what, error_class):
        errors = self.table.exchange(self.rank, error)
        failed = [r for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        if error is not None and not isinstance(error, Exception):
            raise error
        first = errors[failed[0]]
        cls = type(first) if isinstance(first, ZarrckptError) else error_class
        raise cls(f"{what} failed on rank(s) {failed}: "
                  + "; ".join(f"rank {r}: {errors[r]!r}" for r in failed)) from error

    def broadcast(self, values):
        return list(self.table.exchange(self.rank, list(values))[0])


def run_ranks(size: int, fn, *args) -> list:
    """Run ``fn(group, *args)`` on ``size`` threads; every rank's result or exception."""
    table = _Table(size)
    out: list = [None] * size

    def rank_main(rank: int) -> None:
        try:
            out[rank] = fn(ThreadGroup(table, rank), *args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


# ---- a small save through the engine ------------------------------------------------------


class _Leaf:
    pass


_ARRAY = _Leaf()
W = np.arange(30, dtype=np.float32).reshape(5, 6)  # chunks of 2 rows: two whole, one edge
B = np.arange(5, dtype=np.int64)
Z = np.linspace(0, 1, 300).reshape(3, 100)  # compressed: always through TensorStore
SOURCES = {"w": W, "model/b": B, "model/z": Z}


def _docs(save_id: str) -> dict[str, dict]:
    def doc(key: str, data: np.ndarray, chunk: tuple[int, ...], compression=None) -> dict:
        dt = dtypes.by_numpy(data.dtype)
        return fmt.array_metadata(shape=data.shape, dtype=dt, chunk_shape=chunk,
                                  attrs=fmt.array_attrs(kind="tensor", save_id=save_id, dtype=dt),
                                  dimension_names=[f"{key.rsplit('/', 1)[-1]}.{d}" for d in range(data.ndim)],
                                  compression=compression)

    return {"w": doc("w", W, (2, 6)), "model/b": doc("b", B, (5,)),
            "model/z": doc("z", Z, (3, 100), fmt.compression_codec("zstd"))}


def _chunks(key: str, rows: list[int]) -> tuple[engine.ChunkWrite, ...]:
    """Chunks of ``key`` (chunk grid along dimension 0) at the given chunk rows."""
    data, step = SOURCES[key], {"w": 2, "model/b": 5, "model/z": 3}[key]
    return tuple(engine.ChunkWrite((r,) + (0,) * (data.ndim - 1),
                                   ((r * step, min((r + 1) * step, data.shape[0])),)
                                   + tuple((0, n) for n in data.shape[1:]),
                                   local=((r * step, min((r + 1) * step, data.shape[0])),)
                                   + tuple((0, n) for n in data.shape[1:]))
                 for r in rows)


def _host(key: str, out: engine.ChunkWriter) -> np.ndarray:
    return SOURCES[key]


def _failing_host(key: str, out: engine.ChunkWriter) -> np.ndarray:
    raise OSError(f"disk on fire while reading {key}")


def _interrupted_host(key: str, out: engine.ChunkWriter) -> np.ndarray:
    raise KeyboardInterrupt


# which rank writes which chunks (and which documents): 2 ranks, or everything on rank 0
PLAN = {
    2: {0: ({"w": [0, 2]}, ["w", "model/z"]), 1: ({"w": [1], "model/b": [0], "model/z": [0]}, ["model/b"])},
    1: {0: ({"w": [0, 1, 2], "model/b": [0], "model/z": [0]}, ["w", "model/b", "model/z"])},
}


def save_rank(group, path, host=_host, fail_rank: int | None = None) -> int:
    """One rank of a save, in the engine's call order (as zarrckpt.jax.save does); ``path``:
    a path or a Storage."""
    location = open_storage(path)
    save_id, created = engine.new_identity(group)
    docs = _docs(save_id)
    tree = ztree.encode_tree({"w": _ARRAY, "model": {"b": _ARRAY, "z": _ARRAY}, "step": 3},
                             lambda x: x is _ARRAY)
    root = functools.partial(fmt.root_metadata, save_id=save_id, world_size=group.size, created=created,
                             writer=fmt.writer_versions())
    target = engine.begin(group, location, save_id, False, root(state="pending"), fmt.group_paths(docs))
    chunks, my_docs = PLAN[group.size][group.rank]
    source = host if fail_rank in (None, group.rank) else _host
    arrays = [engine.ArrayWrite(key, docs[key], _chunks(key, rows), functools.partial(source, key))
              for key, rows in chunks.items()]
    try:
        error, written = None, 0
        try:
            written = engine.write_arrays(_commit.save_store(location, save_id), {k: docs[k] for k in my_docs},
                                          arrays, 1 << 20)
        except BaseException as e:  # noqa: BLE001 - reported to every rank at C2
            error = e
        engine.finish(group, location.url, target, error,
                      functools.partial(root, state="committed", tree=tree, array_docs=docs))
    except BaseException:
        engine.abandon(group, target)
        raise
    return written


def _check_saved(path) -> None:
    sd = zarrckpt.load_state_dict(path)
    assert sd["step"] == 3
    assert torch.equal(sd["w"], torch.from_numpy(W))
    assert torch.equal(sd["model"]["b"], torch.from_numpy(B))
    assert torch.equal(sd["model"]["z"], torch.from_numpy(Z))


@pytest.mark.parametrize("make_group", [engine.OneProcess, zdist.group], ids=["one-process", "torch-group"])
def test_one_process_save_is_readable(tmp_path, make_group):
    written = save_rank(make_group(), str(tmp_path / "ck"))
    assert written == W.nbytes + B.nbytes + Z.nbytes
    _check_saved(tmp_path / "ck")
    assert os.listdir(tmp_path) == ["ck"]  # no staging directory or lock file is left


def test_two_ranks_save_one_checkpoint(tmp_path):
    results = run_ranks(2, save_rank, str(tmp_path / "ck"))
    assert not any(isinstance(r, BaseException) for r in results), results
    assert sum(results) == W.nbytes + B.nbytes + Z.nbytes  # every chunk written once
    _check_saved(tmp_path / "ck")
    info = zarrckpt.open(tmp_path / "ck").info
    assert info.world_size == 2


def test_a_failed_write_on_one_rank_fails_both_and_leaves_nothing(tmp_path):
    results = run_ranks(2, save_rank, str(tmp_path / "ck"), _failing_host, 1)
    assert all(isinstance(r, SaveFailedError) for r in results), results
    for r in results:
        assert "writing the save to" in str(r) and "rank(s) [1]" in str(r) and "disk on fire" in str(r)
    assert os.listdir(tmp_path) == []  # no checkpoint, claim, staging directory or lock


def test_an_interrupted_rank_reraises_its_interrupt_and_the_other_is_told(tmp_path):
    results = run_ranks(2, save_rank, str(tmp_path / "ck"), _interrupted_host, 0)
    assert isinstance(results[0], KeyboardInterrupt)
    assert isinstance(results[1], SaveFailedError) and "rank(s) [0]" in str(results[1])
    assert os.listdir(tmp_path) == []


def test_one_process_failure_is_raised_as_itself_and_abandoned(tmp_path):
    with pytest.raises(OSError, match="disk on fire"):
        save_rank(engine.OneProcess(), str(tmp_path / "ck"), _failing_host)
    assert os.listdir(tmp_path) == []


def rank_engine_save(rank: int, world: int, path: str, fail: bool):
    """A save over the torch process group (dist.Group as the engine's group)."""
    group = zdist.group()
    identity = engine.new_identity(group)
    try:
        return identity, save_rank(group, path, _failing_host if fail else _host, 1 if fail else None)
    except SaveFailedError as e:
        return identity, f"{type(e).__name__}: {e}"


def test_torch_process_group_runs_the_engine(tmp_path, clusters):
    results = clusters(2).run(rank_engine_save, str(tmp_path / "ck"), False)
    assert results[0][0] == results[1][0]  # rank 0's save id and time on both ranks (broadcast)
    assert results[0][1] + results[1][1] == W.nbytes + B.nbytes + Z.nbytes
    _check_saved(tmp_path / "ck")
    failed = clusters(2).run(rank_engine_save, str(tmp_path / "bad"), True)
    for _, message in failed:
        assert message.startswith("SaveFailedError") and "rank(s) [1]" in message and "disk on fire" in message
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_claim_refused_on_rank_0_fails_every_rank_at_c1(tmp_path):
    zarrckpt.save({"x": torch.ones(2)}, tmp_path / "ck")
    results = run_ranks(2, save_rank, str(tmp_path / "ck"))
    assert all(isinstance(r, zarrckpt.CheckpointExistsError) for r in results), results
    assert "preparing the save" in str(results[1])
    assert zarrckpt.load_state_dict(tmp_path / "ck")["x"].tolist() == [1.0, 1.0]  # untouched


def test_whole_plain_chunks_take_the_small_chunk_path(tmp_path):
    store = FaultStorage(tmp_path / "ck")  # no faults: it counts the writes
    save_rank(engine.OneProcess(), store)
    # w: chunks 0 and 1 are whole (chunk 2 is an edge chunk); b: whole; z: compressed
    plain = sorted(e.key.split("/", 2)[2] for e in store.events if e.op == "put" and "/c/" in e.key)
    assert plain == ["model/b/c/0", "w/c/0/0", "w/c/1/0"] and store.counts["plain_chunk"] == 3
    _check_saved(tmp_path / "ck")


def test_fast_chunk_shape():
    docs = _docs("0" * 30)
    assert engine.fast_chunk_shape(docs["w"]) == (2, 6)
    assert engine.fast_chunk_shape(docs["model/z"]) is None  # compressed
    big = fmt.array_metadata(shape=(1 << 19,), dtype=dtypes.by_numpy(np.float32), chunk_shape=(1 << 19,),
                             attrs={}, dimension_names=["x.0"], inner_chunk_bytes=1 << 30)
    assert engine.fast_chunk_shape(big) is None  # 2 MiB: over SMALL_CHUNK_BYTES


def test_engine_imports_neither_torch_nor_jax():
    code = ("import sys, zarrckpt.engine.save; "
            "assert 'torch' not in sys.modules and 'jax' not in sys.modules, 'framework imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
