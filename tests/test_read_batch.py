"""Small reads of many arrays go to the reader threads in batches (``ReadBatch``, issue 30):
one pool task for many small tensors instead of a task, a future and a GIL hand-off each.

What must hold: every value arrives (straight into CPU targets and through the staging
arena, tiles and plain boxes), far fewer tasks than arrays run, big reads keep their own
tasks, and a damaged chunk in a batch fails the load naming its own array, not the batch's
first one, and leaves the target as a failed load always does (no partial success hidden).
"""

from __future__ import annotations

import pytest
import torch

import zarrckpt
from zarrckpt import errors
from zarrckpt.api import load as zload
from zarrckpt.storage import _localfile


def many(n: int = 120, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:03d}": torch.randn(64 + i % 7, 33, generator=g) for i in range(n)}


@pytest.fixture
def tasks(monkeypatch):
    """Counts the batch tasks run and the reads in them."""
    seen = {"tasks": 0, "reads": 0, "keys": []}
    inner = _localfile._run_reads

    def counting(items):
        seen["tasks"] += 1
        seen["reads"] += len(items)
        seen["keys"] += [key for _, key, *_ in items]
        return inner(items)
    monkeypatch.setattr(_localfile, "_run_reads", counting)
    return seen


def fresh_like(sd: dict, **kw) -> dict:
    return {k: torch.full_like(v, float("nan"), **kw) for k, v in sd.items()}


def test_small_reads_share_tasks_and_every_value_arrives(tmp_path, tasks):
    sd = many()
    zarrckpt.save(sd, tmp_path / "c")
    out = fresh_like(sd)
    zarrckpt.load(out, tmp_path / "c")
    for k in sd:
        assert torch.equal(out[k], sd[k]), k
    assert tasks["reads"] >= len(sd)  # every array went through a batch
    assert tasks["tasks"] <= len(sd) // 8, tasks["tasks"]  # and they shared tasks


def test_staged_reads_share_tasks_too(tmp_path, tasks, monkeypatch):
    """Targets that go through the arena (device tensors, casts) read tiles in batches; the
    copies out of a half wait for that half's batch (a half switched with a batch not yet
    submitted would copy bytes not read yet: NaN here)."""
    sd = many(90, seed=1)
    zarrckpt.save(sd, tmp_path / "c")
    monkeypatch.setattr(zload, "_direct", lambda local, saved: False)  # as for GPU targets
    out = fresh_like(sd)
    # a small arena: many switches between halves, each with reads still batched
    zarrckpt.load(out, tmp_path / "c", max_staging_bytes=256 << 10)
    for k in sd:
        assert torch.equal(out[k], sd[k]), k
    assert tasks["reads"] >= len(sd) and tasks["tasks"] < len(sd)


def test_cast_targets_through_batches(tmp_path, tasks):
    sd = many(40, seed=2)
    zarrckpt.save(sd, tmp_path / "c")
    out = fresh_like(sd, dtype=torch.float64)
    zarrckpt.load(out, tmp_path / "c", cast=True)
    for k in sd:
        assert torch.equal(out[k], sd[k].double()), k
    assert tasks["reads"] >= len(sd)


def test_big_reads_keep_their_own_tasks(tmp_path, tasks):
    """A read over ReadBatch.SMALL is not batched: it is split among reader threads."""
    big = torch.arange(3 * (_localfile.ReadBatch.SMALL // 4), dtype=torch.float32)
    sd = {"big": big, **many(20)}
    zarrckpt.save(sd, tmp_path / "c")
    out = fresh_like(sd)
    zarrckpt.load(out, tmp_path / "c")
    assert torch.equal(out["big"], big)
    assert "big" not in tasks["keys"]


@pytest.mark.parametrize("staged", [False, True])
def test_a_damaged_chunk_in_a_batch_names_its_own_array(tmp_path, tasks, monkeypatch, staged):
    sd = many(60, seed=3)
    path = tmp_path / "c"
    zarrckpt.save(sd, path)
    victim = "t037"
    chunk = next(p for p in (path / victim / "c").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x04
    chunk.write_bytes(bytes(data))
    if staged:
        monkeypatch.setattr(zload, "_direct", lambda local, saved: False)
    with pytest.raises(errors.CorruptChunkError, match=victim):
        zarrckpt.load(fresh_like(sd), path)
    assert tasks["tasks"] >= 1 and victim in tasks["keys"]  # it was read in a batch


def test_a_bool_byte_other_than_0_or_1_in_a_batch_is_refused(tmp_path, tasks):
    """Spec §5.2: the bool check runs for reads done in a batch as for reads on their own."""
    sd = {f"m{i:02d}": torch.rand(300) > 0.5 for i in range(30)}
    path = tmp_path / "c"
    zarrckpt.save(sd, path)
    from zarrckpt.storage._localfile import ChunkCodec  # noqa: F401 - layout as written
    import crc32c
    chunk = next(p for p in (path / "m17" / "c").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    # an unsharded chunk: its bytes then its CRC-32C; a sharded one: inner chunk 0 first
    body_end = 300 if len(data) == 304 else None
    if body_end is None:
        pytest.skip("bool arrays of this size are stored sharded here")  # pragma: no cover
    data[5] = 2
    data[300:304] = crc32c.crc32c(bytes(data[:300])).to_bytes(4, "little")
    chunk.write_bytes(bytes(data))
    with pytest.raises(errors.CorruptChunkError, match="m17"):
        zarrckpt.load({k: torch.zeros_like(v) for k, v in sd.items()}, path)


def test_the_load_report_splits_the_read_phase(tmp_path):
    """report['seconds'] times the open; report['read_seconds'] says where the read phase
    went on the calling thread (BENCHMARKS.md reads it to tell a reader-bound load from a
    caller-bound one)."""
    sd = many(30)
    zarrckpt.save(sd, tmp_path / "c")
    report: dict = {}
    zarrckpt.load(fresh_like(sd), tmp_path / "c", report=report)
    assert report["seconds"]["open"] > 0
    parts = report["read_seconds"]
    assert set(parts) == {"wait_reads", "issue", "copy", "device_sync"}
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(report["seconds"]["read"], rel=1e-6, abs=1e-6)


def test_a_smaller_in_flight_bound_makes_smaller_batches(tmp_path, tasks, monkeypatch):
    """A batch holds at most a piece's bytes: max_inflight_bytes=1 MiB keeps each batch
    within 1 MiB (and progress reported as they go), the default within 8 MiB."""
    sd = {f"t{i:03d}": torch.randn(128, 128) for i in range(100)}  # 64 KiB each
    zarrckpt.save(sd, tmp_path / "c")
    sizes = []
    real = _localfile.ReadBatch.submit

    def submit(self):
        sizes.append(self.nbytes)
        return real(self)
    monkeypatch.setattr(_localfile.ReadBatch, "submit", submit)
    zarrckpt.load(fresh_like(sd), tmp_path / "c", max_inflight_bytes=1 << 20)
    small = [n for n in sizes if n]
    assert small and max(small) <= (1 << 20) + max(v.nbytes for v in sd.values())
    sizes.clear()
    zarrckpt.load(fresh_like(sd), tmp_path / "c")
    assert max(n for n in sizes if n) > (1 << 20)  # 64 reads of 64 KiB: 4 MiB
