"""Plain tensors are saved once, from one of the ranks that hold them (issue 28 item 8).

Ranks whose plain leaves of one key differ in shape or dtype (a per-rank tensor, or a
``dtensor.to_local()`` of uneven shards, passed where a DTensor was meant) are refused on
every rank before anything is written, naming the key and the ranks and suggesting a
DTensor; ``check_replicas=True`` also compares their values (one CRC-32C per leaf and
rank), for debugging runs. Before the fix the first case stored rank 0's tensor and
reported success.
"""

from __future__ import annotations

import os

import pytest
import torch

import zarrckpt


def _outcome(fn):
    try:
        fn()
        return "ok"
    except zarrckpt.ZarrckptError as e:
        return f"{type(e).__name__}: {e}"


def w_refused(rank, world, path, case, use_async):
    """Every rank saves a state whose plain leaf ``w`` differs between ranks; returns what
    the save raised and whether anything is at the path."""
    if case == "shape":
        state = {"w": torch.full((rank + 1, 2), float(rank)), "same": torch.ones(3)}
    elif case == "dtype":
        state = {"w": torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64), "same": torch.ones(3)}
    elif case == "values":
        state = {"w": torch.full((2, 2), float(rank)), "same": torch.ones(3)}
    else:  # values that agree
        state = {"w": torch.full((2, 2), 5.0), "same": torch.ones(3)}
    check = case in ("values", "agree")

    def run():
        if use_async:
            zarrckpt.async_save(state, path, check_replicas=check).result(timeout=60)
        else:
            zarrckpt.save(state, path, check_replicas=check)

    out = _outcome(run)
    import torch.distributed as dist
    dist.barrier()
    return out, os.path.exists(path) and bool(os.listdir(path)) if os.path.isdir(path) else os.path.exists(path)


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
@pytest.mark.parametrize("case", ["shape", "dtype", "values"])
def test_plain_leaves_that_differ_are_refused(clusters, tmp_path, case, use_async):
    path = str(tmp_path / f"{case}-{use_async}")
    results = clusters(2).run(w_refused, path, case, use_async)
    for msg, exists in results:
        assert "'w'" in msg, msg
        assert "DTensor" in msg and "nothing was written" in msg, msg
        assert not exists, f"{path} was written"
        if case != "values":
            assert "rank(s) 0" in msg and "rank(s) 1" in msg, msg
            assert "'same'" not in msg, msg


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_check_replicas_passes_equal_values(clusters, tmp_path, use_async):
    path = str(tmp_path / "agree")
    results = clusters(2).run(w_refused, path, "agree", use_async)
    assert [m for m, _ in results] == ["ok", "ok"]
    assert torch.equal(zarrckpt.load_state_dict(path)["w"], torch.full((2, 2), 5.0))


def test_values_that_differ_are_saved_from_one_rank_without_the_check(clusters, tmp_path):
    """The documented default: no value check (it would read every plain leaf); a plain
    leaf is taken to be the same on every rank that holds it."""
    path = str(tmp_path / "unchecked")
    assert clusters(2).run(w_unchecked, path) == ["ok", "ok"]
    assert zarrckpt.load_state_dict(path)["w"].shape == (2, 2)


def w_unchecked(rank, world, path):
    return _outcome(lambda: zarrckpt.save({"w": torch.full((2, 2), float(rank))}, path))


def test_check_replicas_is_validated():
    with pytest.raises(ValueError, match="check_replicas"):
        zarrckpt.save({"w": torch.ones(1)}, "/nonexistent/never", check_replicas="yes")


def w_checked(rank, world, path, case, use_async):
    """check_replicas over plain leaves of every kind: bf16/fp8 (no buffer protocol of their
    own), a key only rank 1 holds (pipeline stages), and packed small leaves (pack_bytes)."""
    import warnings

    state = {"b": torch.full((3,), 2.0, dtype=torch.bfloat16), "f8": torch.ones(4).to(torch.float8_e4m3fn),
             "ok": torch.ones(2)}
    if rank == 1:
        state["only1"] = torch.arange(3.0)
    opts = {"check_replicas": True}
    if case == "differ":
        state["b"] = torch.full((3,), float(rank), dtype=torch.bfloat16)
    if case == "packed":
        opts["pack_bytes"] = 1 << 10
        state["small"] = torch.full((2,), float(rank))

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if use_async:
                zarrckpt.async_save(state, path, **opts).result(timeout=60)
            else:
                zarrckpt.save(state, path, **opts)

    return _outcome(run)


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
@pytest.mark.parametrize("case", ["agree", "differ", "packed"])
def test_check_replicas_on_bf16_fp8_partial_and_packed_leaves(clusters, tmp_path, case, use_async):
    """Review findings: the CRC took a buffer of the array (bf16/fp8 have none: ValueError on
    one rank, the others waiting in the gather); packed leaves were never compared."""
    path = str(tmp_path / f"{case}-{use_async}")
    out = clusters(2).run(w_checked, path, case, use_async)
    if case == "agree":
        assert out == ["ok", "ok"], out
        got = zarrckpt.load_state_dict(path)
        assert got["b"].dtype == torch.bfloat16 and torch.equal(got["only1"], torch.arange(3.0))
    else:
        key = "'b'" if case == "differ" else "'small'"
        assert all(o.startswith(("UnsupportedValueError", "SaveFailedError")) and key in o for o in out), out


# ---- DTensors on meshes smaller than the world (CI failure, 2026-11-27) ---------------------


def w_submesh(rank, world, path, differ, use_async):
    """A 2 x 2 world; ``d`` is a DTensor sharded over ``mesh["dp"]`` alone, so both tp
    indices hold it whole (as FSDP leaves a norm that TP does not split). ``differ``: the
    ranks also hold different keys (the planner's slow path, as pipeline stages do)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    dp = mesh["dp"].get_local_rank()
    d = DTensor.from_local(full[dp * 4:(dp + 1) * 4].clone(), mesh["dp"], [Shard(0)], run_check=False)
    state = {"d": d}
    if differ:
        state[f"own{rank}"] = torch.full((2,), float(rank))
    if use_async:
        report = zarrckpt.async_save(state, path).result()
    else:
        report = zarrckpt.save(state, path)
    return report["bytes_written"]


@pytest.mark.parametrize("differ", [False, True], ids=["same-keys", "different-keys"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_dtensor_held_by_two_meshes_is_written_once(clusters, tmp_path, differ, use_async):
    """Both meshes wrote every file of ``d`` (the same bytes), racing on them: with the
    incremental saves' create-exclusive files one rank failed with 'File exists'. Now the
    mesh holding the lowest global rank writes it; the bytes written add up to the state."""
    path = str(tmp_path / "ck")
    written = clusters(4).run(w_submesh, path, differ, use_async)
    assert sum(written) == 64 * 4 + (4 * 2 * 4 if differ else 0)
    sd = zarrckpt.load_state_dict(path)
    assert torch.equal(sd["d"], torch.arange(64, dtype=torch.float32).reshape(8, 8))
