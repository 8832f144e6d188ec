"""torchtitan's own trainer with zarrckpt's checkpointer backend and with torchtitan's DCP
backend, on GPUs (issue 17): kill-and-resume loss identity and save/load seconds.

For each async mode (``--modes``) and backend (``zarrckpt``: ``--override.imports
zarrckpt.interop.torchtitan.use_zarrckpt``; ``dcp``: torchtitan's default
``CheckpointManager``), three launches of ``torchrun bench/torchtitan_launch.py --module
torchtitan_config --config llama3_debugmodel_bench ...`` (torchtitan.train's ``main`` and
``Trainer``; FSDP2 over NCCL, one process per GPU; the flags are in ``trainer_args``):

* ``whole``: steps 1..N, a checkpoint every ``--interval`` steps in that async mode, the
  last step saved synchronously (torchtitan always does);
* ``killed``: the same job in a fresh dump folder, SIGKILLed (torchrun, every rank and
  whatever they started, at once: torchrun starts each rank in a session of its own) as
  soon as rank 0's line for step ``--kill-at`` reaches the console; nothing is flushed or
  closed, an async save may be in flight;
* ``resumed``: the same command on the killed job's folder; torchtitan loads the latest
  checkpoint it finds and trains to N.

Losses are torchtitan's own: ``loss_metrics/global_avg_loss`` (and ``global_max_loss``,
``grad_norm``) from the TensorBoard events its MetricsProcessor writes (float32, the value
logged; the method of torchtitan's ``scripts/loss_compare.py``: ``--debug.deterministic
--debug.seed 42 --metrics.enable_tensorboard --metrics.log_freq 1``), compared with ``==``.
The killed run's events are lost with the kill (TensorBoard flushes on close), so its
losses are the console's (5 decimals). Save and load seconds are torchtitan's log lines
(``Finished staging/saving the checkpoint in``, ``Last step checkpoint completed in``,
``Finished loading the checkpoint in``), the same lines for both backends; zarrckpt's own
per-save report (``zarrckpt`` logger) adds when each async save committed.

What is not torchtitan 0.3.0 as shipped, all for torch < 2.12 (the GPU hosts have 2.11):
three missing torch symbols added by ``bench/torchtitan_launch.py``, the loss unchunked by
``bench/torchtitan_config.py``, and ``--parallelism.spmd_backend partial_dtensor`` (each
file says why). If the first uninterrupted run fails, that scenario runs again and every
launch from then on gets ``--retry-extra`` (default ``--training.disable_cuda_graphs``:
torchtitan's CUDA graph of
the step failed on torch 2.11, "CUDA graph BlockMask structure must remain constant across
training steps"). The data set is ``bench/torchtitan_assets/c4_test`` (made by
``make-assets`` from this repository's documents: torchtitan's wheel does not ship its
``c4_test`` file, nor does the stored copy of its repository); the tokenizer is torchtitan's
test tokenizer (``bench/torchtitan_assets/tokenizer``).

    bash bench/torchtitan_trainer.sh [ARGS]                           # on a 2-GPU host
    python bench/torchtitan_trainer.py run --out result.json [ARGS]   # where everything is installed
    python bench/torchtitan_trainer.py make-assets                    # once, committed
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ASSETS = os.path.join(HERE, "torchtitan_assets")

# ---- assets -----------------------------------------------------------------------------


def make_assets() -> str:
    """``c4_test/data.json`` (JSON lines, ``{"text": ...}``, as torchtitan's c4_test) from
    this repository's README, spec, benchmarks and package source: paragraphs grouped into
    documents of at least 1,500 characters."""
    files = ["README.md", "spec/format.md", "BENCHMARKS.md"]
    files += sorted(glob.glob("zarrckpt/**/*.py", root_dir=REPO, recursive=True))
    docs, cur = [], []
    for rel in files:
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            text = f.read()
        for para in re.split(r"\n\s*\n", text):
            para = para.strip()
            if not para:
                continue
            cur.append(para)
            if sum(len(p) for p in cur) >= 1500:
                docs.append("\n\n".join(cur))
                cur = []
    if cur:
        docs.append("\n\n".join(cur))
    out = os.path.join(ASSETS, "c4_test", "data.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    print(f"{out}: {len(docs)} documents, {os.path.getsize(out)} bytes")
    return out


# ---- one launch ---------------------------------------------------------------------------

STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+)\s+grad_norm:\s*([-\d.naninf]+)")
TIME_RES = {
    "staged": re.compile(r"Finished staging the checkpoint in ([\d.]+) seconds"),
    "saved": re.compile(r"Finished saving the checkpoint in ([\d.]+) seconds"),
    "last": re.compile(r"Last step checkpoint completed in ([\d.]+)s"),
    "loaded": re.compile(r"Finished loading the checkpoint in ([\d.]+) seconds"),
}
START_RE = re.compile(r"Training starts at step (\d+)")
PATCH_RE = re.compile(r"torchtitan_launch: torch (\S+); added where missing: (.*)$")
LOADING_RE = re.compile(r"Loading the checkpoint from (\S+?)\.?$")
# zarrckpt's own report of each save / load (logger "zarrckpt"): "zarrckpt async save PATH: {...}"
ZREPORT_RE = re.compile(r"- zarrckpt - INFO - zarrckpt (async save|save|load) (\S+): (\{.*\})\s*$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_args(a, backend: str, mode: str, dump: str, tb: str) -> list[str]:
    args = ["--module", "torchtitan_config", "--config", "llama3_debugmodel_bench",  # bench/torchtitan_config.py
            "--dump_folder", dump,
            "--hf_assets_path", os.path.join(ASSETS, "tokenizer"),
            "--dataloader.dataset", "c4_test",
            "--dataloader.dataset_path", os.path.join(ASSETS, "c4_test"),
            "--training.steps", str(a.steps),
            "--checkpoint.enable",
            "--checkpoint.interval", str(a.interval),
            "--checkpoint.async_mode", mode,
            "--checkpoint.keep_latest_k", "0",
            "--checkpoint.no-last-save-model-only",
            "--debug.deterministic", "--debug.seed", "42",
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
            "--metrics.save_tb_folder", tb, "--metrics.disable_color_printing",
            # plain FSDP2 on the dp mesh: the spmd_types default needs torch >= 2.12 (see
            # bench/torchtitan_launch.py)
            "--parallelism.spmd_backend", "partial_dtensor"]
    if backend == "zarrckpt":
        args += ["--override.imports", "zarrckpt.interop.torchtitan.use_zarrckpt"]
    return args + list(a.extra)


def launch(a, backend: str, mode: str, dump: str, tb: str, log_path: str,
           kill_at: int | None = None) -> dict:
    """One torchrun job; returns what its log says. With ``kill_at``, SIGKILL the whole
    process group once rank 0 has logged that step."""
    target = ["-m", "torchtitan.train"] if a.launcher == "module" else [a.launcher]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.nproc}",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{free_port()}",
           "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
           *target, *trainer_args(a, backend, mode, dump, tb)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", LOG_RANK="0", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PYTORCH_ALLOC_CONF="expandable_segments:True",
               PYTHONPATH=os.pathsep.join(p for p in (HERE, REPO, os.environ.get("PYTHONPATH")) if p))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO, start_new_session=True)
    out = {"cmd": " ".join(cmd), "steps": {}, "times": {k: [] for k in TIME_RES},
           "zarrckpt_reports": [], "killed": False}
    killed_after = None
    timed_out = threading.Event()

    def on_timeout() -> None:  # a hung launch must not eat the device time
        timed_out.set()
        _killpg(proc)

    left = a.deadline - time.monotonic()
    if left < 20:
        raise TimeoutError("no time left under --time-s for another launch")
    timer = threading.Timer(min(a.launch_timeout, left), on_timeout)
    timer.start()
    with open(log_path, "w") as log:
        for line in proc.stdout:
            log.write(line)
            m = STEP_RE.search(line)
            if m:
                out["steps"][int(m.group(1))] = {"loss": m.group(2), "grad_norm": m.group(3)}
            for k, r in TIME_RES.items():
                m2 = r.search(line)
                if m2:
                    out["times"][k].append(float(m2.group(1)))
            m6 = PATCH_RE.search(line)
            if m6:
                out["torch"], out["launch_patches"] = m6.group(1), m6.group(2).strip()
            m3 = START_RE.search(line)
            if m3:
                out["start_step"] = int(m3.group(1))
            m4 = LOADING_RE.search(line)
            if m4:
                out["loaded_from"] = m4.group(1)
            m5 = ZREPORT_RE.search(line)
            if m5:
                try:
                    rep = ast.literal_eval(m5.group(3))
                except (ValueError, SyntaxError):
                    rep = m5.group(3)
                out["zarrckpt_reports"].append({"kind": m5.group(1), "path": m5.group(2), "report": rep})
            if kill_at is not None and m and int(m.group(1)) >= kill_at and not out["killed"]:
                out["killed_pids"] = _killpg(proc)
                out["killed"] = True
                killed_after = int(m.group(1))
    rc = proc.wait()
    timer.cancel()
    out["rc"], out["wall_s"] = rc, round(time.monotonic() - t0, 2)
    out["timed_out"] = timed_out.is_set()
    if killed_after is not None:
        out["killed_after_step_log"] = killed_after
    return out


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (torchrun starts each rank in a session of its own, so
    a process-group kill would miss the ranks)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _killpg(proc) -> list[int]:
    """SIGKILL torchrun, every rank and whatever they started, at once; wait until none
    runs. Returns the pids killed."""
    pids = _descendants(proc.pid) + [proc.pid]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t = time.monotonic()
    while any(_alive(p) for p in pids) and time.monotonic() - t < 30:
        time.sleep(0.05)
    return pids


def tb_scalars(dump: str, tb: str) -> dict:
    """Every scalar TensorBoard holds for the run: tag -> {step: float}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for d in sorted(glob.glob(os.path.join(dump, tb, "*"))):
        acc = EventAccumulator(d, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                out.setdefault(tag, {})[ev.step] = ev.value
    return out


def step_dirs(dump: str) -> list[str]:
    d = os.path.join(dump, "checkpoint")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


# ---- the comparison -------------------------------------------------------------------------

LOSS_TAGS = ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm")


def scenario(a, backend: str, mode: str) -> dict:
    base = os.path.join(a.workdir, f"{backend}-{mode}")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    res: dict = {"backend": backend, "async_mode": mode}
    whole_dump, run_dump = os.path.join(base, "whole"), os.path.join(base, "run")
    res["whole"] = launch(a, backend, mode, whole_dump, "tb_whole", os.path.join(base, "whole.log"))
    res["whole"]["tb"] = tb_scalars(whole_dump, "tb_whole")
    res["whole"]["dirs"] = step_dirs(whole_dump)
    if res["whole"]["rc"] != 0:  # nothing to compare against: spare the device time
        res["error"] = f"uninterrupted run failed (rc {res['whole']['rc']})"
        res["log_tail"] = tail(os.path.join(base, "whole.log"))
        return res
    res["killed"] = launch(a, backend, mode, run_dump, "tb_killed", os.path.join(base, "killed.log"),
                           kill_at=a.kill_at)
    res["killed"]["dirs_after_kill"] = step_dirs(run_dump)
    res["resumed"] = launch(a, backend, mode, run_dump, "tb_resumed", os.path.join(base, "resumed.log"))
    res["resumed"]["tb"] = tb_scalars(run_dump, "tb_resumed")
    res["resumed"]["dirs"] = step_dirs(run_dump)
    res["verdict"] = verdict(res)
    return res


def verdict(res: dict) -> dict:
    whole, killed, resumed = res["whole"], res["killed"], res["resumed"]
    v: dict = {"whole_rc": whole["rc"], "killed_by_sigkill": killed["rc"] in (-9, 137) or killed["killed"],
               "resumed_rc": resumed["rc"], "resumed_from_step": resumed.get("start_step", 0) - 1
               if "start_step" in resumed else None}
    wt, rt = whole.get("tb", {}), resumed.get("tb", {})
    for tag in LOSS_TAGS:
        w, r = wt.get(tag, {}), rt.get(tag, {})
        steps = sorted(r)
        v[tag] = {"steps_compared": steps,
                  "bit_identical": bool(steps) and all(s in w and w[s] == r[s] for s in steps),
                  "differing_steps": [s for s in steps if w.get(s) != r[s]]}
    # the killed run's console losses (5 decimals) against the whole run's
    ks = killed["steps"]
    v["killed_console_losses_match"] = bool(ks) and all(
        whole["steps"].get(s, {}).get("loss") == ks[s]["loss"] for s in ks)
    v["whole_steps_logged"] = sorted(whole["steps"])
    v["losses_bit_identical"] = all(v[t]["bit_identical"] for t in LOSS_TAGS) and \
        v["resumed_from_step"] is not None and v["resumed_from_step"] > 0
    return v


def main_run(a) -> None:
    t0 = time.monotonic()
    a.deadline = t0 + a.time_s
    result: dict = {"argv": sys.argv, "steps": a.steps, "interval": a.interval, "kill_at": a.kill_at,
                    "nproc": a.nproc, "scenarios": [], "skipped": []}
    result["env"] = env_info()
    todo = [(b, m) for m in a.modes.split(",") for b in a.backends.split(",")]
    for backend, mode in todo:
        walls = [sc[k]["wall_s"] for sc in result["scenarios"] for k in ("whole", "killed", "resumed")
                 if isinstance(sc.get(k), dict)]
        need = 3 * max(walls) if walls else 0  # a scenario is three launches
        if a.deadline - time.monotonic() < need:
            result["skipped"].append(f"{backend}/{mode}: {a.deadline - time.monotonic():.0f} s left "
                                     f"under --time-s, about {need:.0f} s needed")
            continue
        print(f"=== {backend} / {mode}", flush=True)
        try:
            sc = scenario(a, backend, mode)
            if sc["whole"]["rc"] != 0 and a.retry_extra and not result.get("retried_with"):
                # e.g. CUDA graph capture failing on this torch: once, then for every scenario
                result["retried_with"] = a.retry_extra.split()
                result["failed_before_retry"] = {"backend": backend, "async_mode": mode,
                                                 "steps_logged": sorted(sc["whole"]["steps"]),
                                                 "wall_s": sc["whole"]["wall_s"],
                                                 "log_tail": tail(os.path.join(a.workdir, f"{backend}-{mode}",
                                                                               "whole.log"))}
                a.extra = list(a.extra) + a.retry_extra.split()
                print(f"=== {backend} / {mode} again with {a.retry_extra}", flush=True)
                sc = scenario(a, backend, mode)
        except Exception as e:  # noqa: BLE001 - record and go on with the next
            sc = {"backend": backend, "async_mode": mode, "error": repr(e)}
        result["scenarios"].append(sc)
        print(json.dumps({"backend": backend, "mode": mode, "verdict": sc.get("verdict"),
                          "error": sc.get("error")}, default=str), flush=True)
        summarize(result)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    result["total_s"] = round(time.monotonic() - t0, 1)
    summarize(result)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result["summary"], indent=1, default=str))


def summarize(result: dict) -> None:
    rows = []
    ref = None
    for sc in result["scenarios"]:
        if "verdict" not in sc:
            rows.append({"backend": sc["backend"], "async_mode": sc["async_mode"], "error": sc.get("error")})
            continue
        w, r, k = sc["whole"], sc["resumed"], sc["killed"]
        loss = w.get("tb", {}).get(LOSS_TAGS[0], {})
        if ref is None and loss:
            ref = loss
        rows.append({
            "backend": sc["backend"], "async_mode": sc["async_mode"],
            "losses_bit_identical_after_resume": sc["verdict"]["losses_bit_identical"],
            "resumed_from_step": sc["verdict"]["resumed_from_step"],
            "steps_compared": sc["verdict"][LOSS_TAGS[0]]["steps_compared"],
            "whole_losses_equal_first_scenario": loss == ref if loss else None,
            "async_blocked_s": w["times"]["staged"] + k["times"]["staged"] + r["times"]["staged"],
            "sync_saved_s": w["times"]["saved"] + k["times"]["saved"] + r["times"]["saved"],
            "last_step_save_s": w["times"]["last"] + r["times"]["last"],
            "load_s": r["times"]["loaded"],
            # zarrckpt's own report: an async save's seconds until committed (rank 0)
            "zarrckpt_async_until_committed_s": [
                round(z["report"]["seconds"]["total"], 3) for x in (w, k, r) for z in x["zarrckpt_reports"]
                if z["kind"] == "async save" and isinstance(z["report"], dict)],
            "killed_last_step_logged": max(k["steps"]) if k["steps"] else None,
            "wall_s": [w["wall_s"], k["wall_s"], r["wall_s"]],
        })
    result["summary"] = rows


def tail(path: str, n: int = 60) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.readlines()[-n:]
    except OSError as e:
        return [repr(e)]


def env_info() -> dict:
    info: dict = {"host": socket.gethostname(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001
        info["torch_error"] = repr(e)
    for mod in ("torchtitan", "zarrckpt", "tensorstore", "zarr", "datasets", "torchdata", "tensorboard"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            info[mod] = f"import failed: {e!r}"
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("make-assets")
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--workdir", default="/tmp/zarrckpt-torchtitan")
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--interval", type=int, default=5)
    r.add_argument("--kill-at", type=int, default=12)
    r.add_argument("--nproc", type=int, default=2)
    r.add_argument("--backends", default="zarrckpt,dcp")
    r.add_argument("--modes", default="async,async_with_pinned_mem")
    r.add_argument("--time-s", type=float, default=1e9,
                   help="wall-clock limit for all launches: a scenario starts only if it fits "
                        "(3x the longest launch so far), a launch is killed at the limit")
    r.add_argument("--launch-timeout", type=float, default=240)
    r.add_argument("--retry-extra", default="--training.disable_cuda_graphs",
                   help="flags added to every launch if the first one fails ('' for none)")
    r.add_argument("--launcher", default=os.path.join(HERE, "torchtitan_launch.py"),
                   help="script torchrun runs (default: bench/torchtitan_launch.py, torchtitan.train "
                        "with two torch symbols added where missing); 'module': -m torchtitan.train")
    r.add_argument("extra", nargs="*", help="more trainer flags (after --)")
    a = p.parse_args()
    if a.cmd == "make-assets":
        make_assets()
    else:
        main_run(a)


if __name__ == "__main__":
    main()
