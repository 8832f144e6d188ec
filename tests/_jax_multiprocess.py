"""One process of a 2-process JAX job on CPU (4 devices each), for tests/test_jax.py.

    python _jax_multiprocess.py <process id> <coordinator port> <scenario> <directory>

Prints one JSON line: what the process saw (bytes TensorStore read or wrote, checks,
the error it raised)."""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
import zarrckpt.jax as zj  # noqa: E402


def metric(name: str) -> int:
    """Bytes read or written so far, through TensorStore or zarrckpt's direct chunk-file path."""
    return zarrckpt.storage.io_counters()[name]


def main() -> None:
    pid, port, scenario, where = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    mesh = jax.make_mesh((2, 4), ("proc", "dev"))
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    out: dict = {"process": pid, "devices": jax.device_count(), "local": jax.local_device_count()}
    try:
        if scenario == "load":
            ck = zarrckpt.open(f"{where}/src")
            ck["x"].info  # metadata read before counting
            before = metric("bytes_read")
            got = zj.load(ck, {"x": NamedSharding(mesh, P("proc", "dev"))})["x"]
            out["sharded_read"] = metric("bytes_read") - before
            out["sharded_ok"] = all(np.array_equal(np.asarray(s.data), full[s.index]) for s in got.addressable_shards)
            out["sharded_shards"] = len(got.addressable_shards)
            before = metric("bytes_read")
            got = zj.load(ck, {"x": NamedSharding(mesh, P())})["x"]
            out["replicated_read"] = metric("bytes_read") - before
            out["replicated_ok"] = all(np.array_equal(np.asarray(s.data), full) for s in got.addressable_shards)
        elif scenario == "save":
            x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("proc", "dev")), lambda i: full[i])
            y = jax.make_array_from_callback((8,), NamedSharding(mesh, P()), lambda i: np.arange(8, dtype=np.int32)[i])
            before = metric("bytes_written")
            report = zj.save({"x": x, "y": y, "local": np.full(3, 7, np.int16), "step": 5}, f"{where}/out",
                             metadata={"step": 5})
            out["written"] = metric("bytes_written") - before
            out["report_bytes"] = report["bytes_written"]
        elif scenario == "disagree":
            tree = {"x": np.zeros(4, np.float32)}
            if pid == 1:
                tree["extra"] = 1
            zj.save(tree, f"{where}/bad")
        elif scenario == "fail":
            tree = {"x": np.zeros(4, np.float32), "y": object() if pid == 1 else 1}
            zj.save(tree, f"{where}/bad")
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = type(e).__name__
        out["message"] = str(e)[:500]
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
