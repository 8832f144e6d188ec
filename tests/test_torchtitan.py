"""zarrckpt as torchtitan's checkpointer backend (zarrckpt.interop.torchtitan).

The backend is driven as torchtitan's trainer drives it (``Trainer.__init__`` builds it with
``config.checkpoint.build(dataloader=, model_parts=, optimizers=, lr_schedulers=,
states={"train_state": ...}, sd_adapter=, base_folder=)``; ``Trainer.train`` calls
``load(step=config.checkpoint.load_step)``, then per step ``maybe_wait_for_staging()``
before ``optimizers.step()`` and ``save(step, last_step=...)``), on 2 gloo ranks with a
tiny FSDP2 model (two ``nn.Linear`` under ``fully_shard`` on a CPU mesh), torchtitan's
``OptimizersContainer`` (AdamW), ``LRSchedulersContainer``, ``ParallelAwareDataloader``
(its state is per dp rank, pickled bytes) and a train_state Stateful.

torchtitan's own ``Trainer`` is not run here: ``import torchtitan.trainer`` (and the llama3
config registry) fails without triton, a GPU package not installed here; the wheel does not
ship the tokenizer and ``c4_test`` assets its debug configs read (``tests/assets/...`` of the
torchtitan repository); and ``torchtitan.tools.utils.device_type`` falls back to "cuda"
without a GPU. Running it on CPU would take patching all three. The loop below is the part
of ``Trainer.train`` that touches the checkpointer, in its order.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402

WORLD = 2


# ---- the job, run on every rank ---------------------------------------------------------


class _Data(torch.utils.data.IterableDataset):
    """Deterministic batches per dp rank; Stateful (its position), as torchtitan's are."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pos = rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.pos)
            self.pos += 1
            x = torch.randn(4, 16, generator=g)
            yield x, x[:, :8].sin() * 0.5

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


class _TrainState:
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _build(rank: int, world: int, folder: str, ckpt: dict, *, backend: str = "zarrckpt",
           seed: int = 0, steps: int = 12):
    """Model, optimizer, scheduler, dataloader, train state and checkpointer, as
    torchtitan's Trainer builds them (``config.checkpoint.build(...)``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    ocfg = default_adamw(lr=1e-2)
    ocfg.implementation = "for-loop"
    optimizers = ocfg.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, decay_type="linear",
                                                 min_lr_factor=0.1).build(optimizers=optimizers,
                                                                          training_steps=12)  # the same schedule in every job
    dataloader = ParallelAwareDataloader(_Data(rank), dp_rank=rank, dp_world_size=world, batch_size=None)
    train_state = _TrainState()
    if backend == "zarrckpt":
        from zarrckpt.torchtitan import ZarrckptCheckpointManager as cls
    else:
        from torchtitan.components.checkpointer.dcp import CheckpointManager as cls
    config = cls.Config(**{"enable": True, "folder": "checkpoint", **ckpt})
    checkpointer = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder=folder)
    return model, optimizers, lr_schedulers, dataloader, train_state, checkpointer


def _full_params(model) -> dict:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _train(rank, world, folder, ckpt, steps, *, stop_after=None, seed=0, backend="zarrckpt",
           snapshot_at=(), on_save=None):
    """Trainer.train's checkpointer calls around a training loop. Returns the per-step
    losses (as floats of the all-reduced mean), the full parameters at the end and at
    ``snapshot_at`` steps, and the final train state."""
    import torch.distributed as dist

    model, optimizers, lr_schedulers, dataloader, ts, ck = _build(rank, world, folder, ckpt,
                                                                  backend=backend, seed=seed, steps=steps)
    loaded = ck.load(step=ckpt.get("load_step", -1))
    start = ts.step
    losses, snaps = {}, {}
    it = iter(dataloader)
    while ts.step < steps:
        ts.step += 1
        x, y = next(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ck.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        ts.ntokens_seen += x.shape[0]
        red = loss.detach().clone()
        dist.all_reduce(red)
        losses[ts.step] = red.item()
        ck.save(ts.step, last_step=(ts.step == steps))
        if on_save is not None:
            on_save(ck, ts.step)
        if ts.step in snapshot_at:
            snaps[ts.step] = _full_params(model)
        if stop_after is not None and ts.step == stop_after:
            break  # "killed": no close(), no last-step save
    else:
        ck.maybe_wait_for_saving()
        ck.close()
    if stop_after is not None:
        ck.maybe_wait_for_saving()  # what a killed job committed before dying
    import zarrckpt

    zarrckpt.wait_for_saves()
    if hasattr(ck, "wait_for_purge"):
        ck.wait_for_purge()
    dist.barrier()
    return {"loaded": loaded, "start": start, "losses": losses, "params": _full_params(model),
            "snaps": snaps, "step": ts.step, "ntokens": ts.ntokens_seen,
            "last_epoch": lr_schedulers.schedulers[0].last_epoch,
            "optim_state": len(optimizers.optimizers[0].state), "pos": dataloader.dataset.pos}


def _steps_on_disk(folder: str) -> list[int]:
    d = os.path.join(folder, "checkpoint")
    if not os.path.isdir(d):
        return []
    return sorted(int(n[5:]) for n in os.listdir(d) if n.startswith("step-") and n[5:].isdigit())


# ---- workers (importable: the cluster runs them by name) -------------------------------


def w_interval_purge(rank, world, folder, async_mode):
    seen = {}

    def on_save(ck, step):
        ck.maybe_wait_for_saving()  # an async save claims step-N in the background
        if rank == 0:
            ck.wait_for_purge()
            seen[step] = _steps_on_disk(folder)
    import torch.distributed as dist

    if rank == 0:  # not checkpoints: never loaded, never purged
        d = os.path.join(folder, "checkpoint")
        os.makedirs(os.path.join(d, "step-1"))  # e.g. a DCP step of another backend, or a stray dir
        os.makedirs(os.path.join(d, ".step-99.zarrckpt-deadbeef"))  # looks like zarrckpt's save dir
    dist.barrier()
    out = _train(rank, world, folder, {"interval": 2, "keep_latest_k": 2, "async_mode": async_mode,
                                      "last_save_model_only": False}, 9, on_save=on_save)
    out["seen"] = seen
    out["final"] = _steps_on_disk(folder)
    return out


class _HeldFuture(cf.Future):
    """A save that the manager sees in flight until the test releases it."""


def w_inflight_never_purged(rank, world, folder):
    """A job that resumes from an early step (load_step) while later committed steps
    exist: its async save of step 3 is the oldest step directory; DCP's purge (newest k
    directory names) would delete it while it is written. Here it is kept while in flight."""
    import threading

    import torch.distributed as dist
    import zarrckpt
    import zarrckpt.interop.torchtitan as zt

    _train(rank, world, folder, {"interval": 1, "keep_latest_k": 0}, 7)  # steps 1..7 committed
    release = threading.Event()
    real = zt.async_save

    def held(*a, **kw):  # the save runs for real; its future ends only when released
        fut = real(*a, **kw)
        out = cf.Future()

        def finish():
            release.wait(60)
            try:
                out.set_result(fut.result())
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)
        threading.Thread(target=finish, daemon=True).start()
        return out

    model, optimizers, lr, dl, ts, ck = _build(rank, world, folder, {"interval": 1, "keep_latest_k": 2,
                                                                      "async_mode": "async", "load_step": 2})
    ck.load(step=2)
    assert ts.step == 2
    zt.async_save = held
    try:
        ck.save(3)
        if rank == 0:
            ck.wait_for_purge()
        dist.barrier()
        during = _steps_on_disk(folder)
        assert ck.save_future is not None and not ck.save_future.done()
    finally:
        zt.async_save = real
    release.set()
    ck.maybe_wait_for_saving()
    ck.save(4)  # the save of 4 is in flight, 3 committed: keep {4, 7}... and 3 was kept until now
    ck.maybe_wait_for_saving()
    ck.close()
    zarrckpt.wait_for_saves()
    dist.barrier()
    return {"during": during, "after": _steps_on_disk(folder)}


def w_async_equals_sync(rank, world, folder, async_mode):
    import zarrckpt

    sync = _train(rank, world, os.path.join(folder, "sync"), {"interval": 2, "keep_latest_k": 0,
                                                              "last_save_model_only": False}, 6)
    asy = _train(rank, world, os.path.join(folder, "async"), {"interval": 2, "keep_latest_k": 0,
                                                              "async_mode": async_mode,
                                                              "last_save_model_only": False}, 6)
    same = True
    if rank == 0:
        for step in (2, 4, 6):
            a = zarrckpt.open(os.path.join(folder, "sync", "checkpoint", f"step-{step}"))
            b = zarrckpt.open(os.path.join(folder, "async", "checkpoint", f"step-{step}"))
            assert sorted(a.keys()) == sorted(b.keys())
            for k in a.keys():
                va, vb = a.read(k), b.read(k)
                same &= bool((va == vb).all()) if hasattr(va, "shape") else va == vb
    return {"same": same, "steps": _steps_on_disk(os.path.join(folder, "async")),
            "losses": (sync["losses"], asy["losses"])}


def w_future_types(rank, world, folder, async_mode):
    model, optimizers, lr, dl, ts, ck = _build(rank, world, folder, {"interval": 1, "async_mode": async_mode})
    ck.save(1)
    kinds = {"save_future": isinstance(ck.save_future, cf.Future),
             "staging": ck.staging_future is not None}
    ck.maybe_wait_for_staging()
    ck.maybe_wait_for_saving()
    kinds["cleared"] = ck.save_future is None and ck.staging_future is None
    ck.close()
    return kinds


def w_load_latest_and_step(rank, world, folder):
    first = _train(rank, world, folder, {"interval": 2, "keep_latest_k": 0, "last_save_model_only": False},
                   6, snapshot_at=(4, 6))
    latest = _train(rank, world, folder, {"interval": 100, "load_only": True}, 6, seed=7)
    at4 = _train(rank, world, folder, {"interval": 100, "load_only": True, "load_step": 4}, 4, seed=7)
    return {"first": first, "latest": latest, "at4": at4}


def w_kill_resume(rank, world, folder, async_mode):
    ck = {"interval": 3, "keep_latest_k": 2, "async_mode": async_mode, "last_save_model_only": False}
    whole = _train(rank, world, os.path.join(folder, "whole"), ck, 12)
    run = os.path.join(folder, "run")
    killed = _train(rank, world, run, ck, 12, stop_after=8)  # saved 3, 6; killed after 8
    resumed = _train(rank, world, run, ck, 12, seed=123)  # another init: the load must matter
    return {"whole": whole, "killed": killed, "resumed": resumed}


def _sigkill_job(rank, world, port, folder):
    """A job in processes of its own, killed (SIGKILL, every rank) right after the async
    save of step 6 was started: that save may or may not have committed."""
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))

    def on_save(ck, step):
        if step == 6:
            os.kill(os.getpid(), signal.SIGKILL)

    _train(rank, world, folder, _KILL_CK, 12, on_save=on_save)


_KILL_CK = {"interval": 3, "keep_latest_k": 2, "async_mode": "async", "last_save_model_only": False}


def w_after_sigkill(rank, world, folder):
    whole = _train(rank, world, os.path.join(folder, "whole"), _KILL_CK, 12)
    resumed = _train(rank, world, os.path.join(folder, "run"), _KILL_CK, 12, seed=123)
    return {"whole": whole, "resumed": resumed}


def w_exclude(rank, world, folder):
    _train(rank, world, folder, {"interval": 4, "keep_latest_k": 0, "last_save_model_only": False}, 4)
    return _train(rank, world, folder, {"interval": 100, "load_only": True,
                                        "exclude_from_loading": ["train_state", "lr_scheduler", "dataloader"]},
                  0, seed=5)


def w_initial_load(rank, world, folder, model_only):
    src = _train(rank, world, os.path.join(folder, "src"), {"interval": 4, "keep_latest_k": 0,
                                                            "last_save_model_only": False}, 4)
    path = os.path.abspath(os.path.join(folder, "src", "checkpoint", "step-4"))
    dst = _train(rank, world, os.path.join(folder, "dst"),
                 {"interval": 2, "initial_load_path": path, "initial_load_model_only": model_only,
                  "last_save_model_only": False}, 0, seed=9)
    return {"src": src, "dst": dst}


def w_last_step_export(rank, world, folder):
    import zarrckpt

    src = _train(rank, world, os.path.join(folder, "src"),
                 {"interval": 100, "last_save_model_only": True, "export_dtype": "bfloat16"}, 3)
    path = os.path.abspath(os.path.join(folder, "src", "checkpoint", "step-3"))
    ck = zarrckpt.open(path)
    info = {"keys": sorted(ck.keys()), "dtypes": sorted({str(ck.read(k).dtype) for k in ck.keys()}),
            "meta": ck.metadata}
    into_fp32 = _train(rank, world, os.path.join(folder, "dst"),
                       {"interval": 100, "initial_load_path": path, "load_only": True}, 0, seed=3)
    # the export found as the latest step of the folder (a re-run of the same job): model only
    again = _train(rank, world, os.path.join(folder, "src"), {"interval": 100, "load_only": True}, 0, seed=3)
    return {"src": src, "info": info, "into_fp32": into_fp32, "again": again}


def w_first_step(rank, world, folder):
    _train(rank, world, folder, {"interval": 5, "keep_latest_k": 0, "enable_first_step_checkpoint": True,
                                 "last_save_model_only": False}, 7)
    return _steps_on_disk(folder)


def w_load_only(rank, world, folder):
    out = _train(rank, world, folder, {"interval": 1, "load_only": True, "enable_first_step_checkpoint": True},
                 3)
    return {"steps": _steps_on_disk(folder), "loaded": out["loaded"],
            "exists": os.path.exists(os.path.join(folder, "checkpoint"))}


def w_from_dcp(rank, world, folder, model_only):
    import torch.distributed as dist
    import zarrckpt.convert

    dcp = _train(rank, world, os.path.join(folder, "dcp"), {"interval": 4, "keep_latest_k": 0,
                                                            "last_save_model_only": False}, 4,
                 backend="dcp")
    dst = os.path.abspath(os.path.join(folder, f"converted-{model_only}"))
    if rank == 0:
        zarrckpt.convert.from_dcp(os.path.join(folder, "dcp", "checkpoint", "step-4"), dst)
    dist.barrier()
    out = _train(rank, world, os.path.join(folder, f"run-{model_only}"),
                 {"interval": 100, "initial_load_path": dst, "initial_load_model_only": model_only,
                  "load_only": True}, 0, seed=11)
    import zarrckpt

    return {"dcp": dcp, "out": out, "keys": sorted(zarrckpt.open(dst).keys())}


def w_timing(rank, world, folder, reps, width):
    """Save and load seconds of torchtitan's DCP backend and of zarrckpt's, alternating,
    on the same job (a sync save of every state, then a load of it into a fresh job)."""
    import torch.distributed as dist

    times = {"dcp": {"save": [], "load": []}, "zarrckpt": {"save": [], "load": []}}
    for i in range(reps):
        for backend in ("dcp", "zarrckpt") if i % 2 == 0 else ("zarrckpt", "dcp"):
            base = os.path.join(folder, f"{backend}-{i}")
            m, o, lr, dl, ts, ck = _build(rank, world, base, {"interval": 1, "keep_latest_k": 0},
                                          backend=backend)
            x, y = next(iter(dl))
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            dist.barrier()
            t = time.perf_counter()
            ck.save(1)
            dist.barrier()
            times[backend]["save"].append(time.perf_counter() - t)
            ck.close()
            m, o, lr, dl, ts, ck = _build(rank, world, base, {"interval": 1, "keep_latest_k": 0},
                                          backend=backend, seed=1)
            o.state_dict()  # optimizer state materialized before timing, for both
            dist.barrier()
            t = time.perf_counter()
            assert ck.load()
            dist.barrier()
            times[backend]["load"].append(time.perf_counter() - t)
            ck.close()
    return times


# ---- tests ------------------------------------------------------------------------------


@pytest.fixture
def world(clusters):
    return clusters(WORLD)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_selects_backend(tmp_path):
    """The checkpoint section's Config type picks the class build() constructs; the
    override swaps torchtitan's DCP section for this one, keeping its fields."""
    from torchtitan.components.checkpointer.base import BaseCheckpointManager
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from zarrckpt.torchtitan import ZarrckptCheckpointManager

    cfg = ZarrckptCheckpointManager.Config(enable=True, interval=5, async_mode="async")
    assert isinstance(cfg, BaseCheckpointManager.Config) and type(cfg)._owner is ZarrckptCheckpointManager
    disabled = ZarrckptCheckpointManager.Config().build(dataloader=None, model_parts=[], optimizers=None,
                                                        lr_schedulers=None, states={}, sd_adapter=None,
                                                        base_folder=str(tmp_path))
    assert isinstance(disabled, ZarrckptCheckpointManager) and not disabled.save(1) and not disabled.load()
    with pytest.raises(ValueError, match="HF"):
        ZarrckptCheckpointManager.Config(last_save_in_hf=True)
    with pytest.raises(ValueError, match="async_mode"):
        ZarrckptCheckpointManager.Config(async_mode="sometimes")

    # torchtitan's Trainer.Config cannot be imported here (torchtitan.trainer imports triton);
    # a config tree with the same ``checkpoint`` field stands in for it
    from dataclasses import dataclass, field

    from torchtitan.config import Configurable

    @dataclass(kw_only=True, slots=True)
    class Job(Configurable.Config):
        checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)
        override: OverrideConfig = field(default_factory=OverrideConfig)

    job = Job()
    job.checkpoint = CheckpointManager.Config(enable=True, interval=7, keep_latest_k=3,
                                              async_mode="async_with_pinned_mem", folder="ck")
    job.override = OverrideConfig(imports=[("zarrckpt.interop.torchtitan.use_zarrckpt",
                                            {"compression": "zstd"})])
    apply_overrides(job.override, job)
    assert type(job.checkpoint) is ZarrckptCheckpointManager.Config
    c = job.checkpoint
    assert (c.enable, c.interval, c.keep_latest_k, c.async_mode, c.folder, c.compression) == (
        True, 7, 3, "async_with_pinned_mem", "ck", "zstd")


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_interval_and_keep_latest_k(world, tmp_path, async_mode):
    out = world.run(w_interval_purge, str(tmp_path), async_mode)[0]
    # saves at 2, 4, 6, 8 and the last step 9; 2 kept (the in-flight one counts among them);
    # step-1 (not a checkpoint) and the hidden directory are never touched
    assert out["seen"][2] == [1, 2]
    assert out["seen"][4] == [1, 2, 4]
    assert out["seen"][6] == [1, 4, 6]
    assert out["seen"][8] == [1, 6, 8]
    assert out["final"] == [1, 6, 8, 9]  # no purge after the last step, as DCP
    assert os.path.isdir(tmp_path / "checkpoint" / ".step-99.zarrckpt-deadbeef")
    assert not [n for n in os.listdir(tmp_path / "checkpoint") if ".purging-" in n]


def test_save_in_flight_is_never_purged(world, tmp_path):
    out = world.run(w_inflight_never_purged, str(tmp_path))[0]
    # committed 1..7; the save of 3 in flight; keep_latest_k=2 over {3 (in flight), 1, 2, 4..7}:
    # 1, 2, 4, 5 deleted, 3 kept while written
    assert out["during"] == [3, 6, 7]
    # then 4 is saved (in flight during its purge): newest two of {3, 4, 6, 7} are 6, 7;
    # 3 is committed and purged, 4 is kept while written
    assert out["after"] == [4, 6, 7]


@pytest.mark.parametrize("async_mode", ["async", "async_with_pinned_mem"])
def test_async_modes_write_what_sync_writes(world, tmp_path, async_mode):
    out = world.run(w_async_equals_sync, str(tmp_path), async_mode)[0]
    assert out["steps"] == [2, 4, 6]
    assert out["same"]
    assert out["losses"][0] == out["losses"][1]


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_futures_torchtitan_expects(world, tmp_path, async_mode):
    out = world.run(w_future_types, str(tmp_path), async_mode)
    for r in out:
        assert r["save_future"] == (async_mode != "disabled")
        assert r["staging"] == (async_mode == "async_with_pinned_mem")
        assert r["cleared"]


def test_load_latest_and_load_step(world, tmp_path):
    out = world.run(w_load_latest_and_step, str(tmp_path))
    for r in out:
        first, latest, at4 = r["first"], r["latest"], r["at4"]
        assert latest["loaded"] and latest["start"] == 6 and latest["step"] == 6
        assert _same(latest["params"], first["params"])
        assert at4["loaded"] and at4["start"] == 4
        assert _same(at4["params"], first["snaps"][4])
        assert at4["last_epoch"] == 4 and latest["last_epoch"] == 6
        assert latest["pos"] == 6 and at4["pos"] == 4  # the dataloader's per-rank state


@pytest.mark.parametrize("async_mode", ["disabled", "async_with_pinned_mem"])
def test_kill_and_resume_is_bit_exact(world, tmp_path, async_mode):
    out = world.run(w_kill_resume, str(tmp_path), async_mode)
    for r in out:
        whole, killed, resumed = r["whole"], r["killed"], r["resumed"]
        assert resumed["loaded"] and resumed["start"] == 6
        losses = {**{s: v for s, v in killed["losses"].items() if s <= 6}, **resumed["losses"]}
        assert losses == whole["losses"]  # floats compared exactly
        assert _same(resumed["params"], whole["params"])
        assert (resumed["ntokens"], resumed["last_epoch"], resumed["pos"]) == (
            whole["ntokens"], whole["last_epoch"], whole["pos"])


def test_resume_after_sigkill_during_async_save(world, tmp_path):
    """Real kills: both ranks SIGKILLed while the async save of step 6 is in flight. The
    resumed job loads the latest committed step (6 if that save committed before the
    kill, else 3) and continues bit-exactly as the uninterrupted run."""
    import multiprocessing as mp

    from _cluster import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_sigkill_job, args=(r, WORLD, port, str(tmp_path / "run")))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [-9, -9]
    for r in world.run(w_after_sigkill, str(tmp_path)):
        whole, resumed = r["whole"], r["resumed"]
        assert resumed["loaded"] and resumed["start"] in (3, 6)
        print(f"resumed from step {resumed['start']}")
        assert {s: whole["losses"][s] for s in resumed["losses"]} == resumed["losses"]
        assert _same(resumed["params"], whole["params"])
        assert (resumed["ntokens"], resumed["last_epoch"], resumed["pos"]) == (
            whole["ntokens"], whole["last_epoch"], whole["pos"])


def test_exclude_from_loading(world, tmp_path):
    for r in world.run(w_exclude, str(tmp_path)):
        assert r["loaded"] and r["start"] == 0 and r["last_epoch"] == 0 and r["pos"] == 0
        assert r["optim_state"] == 2 * 2  # loaded (weights and biases of both layers)


@pytest.mark.parametrize("model_only", [True, False])
def test_initial_load_path(world, tmp_path, model_only):
    for r in world.run(w_initial_load, str(tmp_path), model_only):
        src, dst = r["src"], r["dst"]
        assert dst["loaded"] and _same(dst["params"], src["params"])
        if model_only:
            assert dst["start"] == 0 and dst["last_epoch"] == 0 and dst["pos"] == 0
        else:
            assert dst["start"] == 4 and dst["last_epoch"] == 4 and dst["pos"] == 4


def test_last_step_model_only_bf16_export(world, tmp_path):
    for r in world.run(w_last_step_export, str(tmp_path)):
        info = r["info"]
        assert info["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert info["dtypes"] == ["bfloat16"]
        assert info["meta"]["torchtitan"] == {"model_only": True, "dtype": "bfloat16"}
        expect = {k: v.to(torch.bfloat16).float() for k, v in r["src"]["params"].items()}
        for case in ("into_fp32", "again"):
            got = r[case]
            assert got["loaded"] and got["start"] == 0
            assert all(v.dtype == torch.float32 for v in got["params"].values())
            assert _same(got["params"], expect)


def test_first_step_checkpoint(world, tmp_path):
    assert world.run(w_first_step, str(tmp_path))[0] == [1, 5, 7]


def test_load_only_never_saves(world, tmp_path):
    for r in world.run(w_load_only, str(tmp_path)):
        assert r == {"steps": [], "loaded": False, "exists": False}


@pytest.mark.parametrize("model_only", [True, False])
def test_initial_load_from_converted_dcp(world, tmp_path, model_only):
    """A checkpoint written by torchtitan's own DCP backend, converted with
    zarrckpt.convert.from_dcp, as initial_load_path."""
    for r in world.run(w_from_dcp, str(tmp_path), model_only):
        dcp, out = r["dcp"], r["out"]
        assert {"0.weight", "2.weight", "train_state/step"} <= set(r["keys"])
        assert out["loaded"] and _same(out["params"], dcp["params"])
        if model_only:
            assert out["start"] == 0 and out["last_epoch"] == 0
        else:
            assert out["start"] == 4 and out["last_epoch"] == 4 and out["pos"] == 4


def test_timing_against_dcp(world, tmp_path, capsys):
    reps = 10
    out = world.run(w_timing, str(tmp_path), reps, 0)[0]
    with capsys.disabled():
        for backend, t in out.items():
            for phase, xs in t.items():
                xs = sorted(xs)
                print(f"\n{backend:8s} {phase}: median {xs[len(xs) // 2] * 1e3:7.1f} ms, "
                      f"min {xs[0] * 1e3:7.1f} ms over {reps}")
