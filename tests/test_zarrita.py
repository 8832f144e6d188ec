"""zarrita.js (the JavaScript Zarr reader, run by Node.js) lists every array of a checkpoint
from the root's consolidated metadata alone (one read of ``zarr.json``, spec §6.7) and reads
their values, sharded arrays included. zarrita 0.7.5 and @zarrita/storage 0.2.0 are installed
with npm from its registry into ``~/.cache/zarrckpt-tests`` (once)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

import zarrckpt

ZARRITA = ("zarrita@0.7.5", "@zarrita/storage@0.2.0")

SCRIPT = r"""
import * as zarr from "zarrita";
import FileSystemStore from "@zarrita/storage/fs";
const fs = new FileSystemStore(process.argv[2]);
const gets = [];
const store = await zarr.withConsolidatedMetadata({
  get: (key, opts) => { gets.push(key); return fs.get(key, opts); },
  getRange: (key, range, opts) => { gets.push(key); return fs.getRange(key, range, opts); },
}, { format: "v3" });
const arrays = store.contents().filter((c) => c.kind === "array").map((c) => c.path).sort();
const listing = [...gets];
const values = {}, refused = {};
for (const p of arrays) {
  let a;
  try {
    a = await zarr.open.v3(zarr.root(store).resolve(p), { kind: "array" });
  } catch (e) {  // zarrita has no bfloat16 (README: generic readers)
    refused[p] = String(e.message);
    continue;
  }
  const chunk = await zarr.get(a);
  values[p] = { shape: chunk.shape, data: Array.from(chunk.data, Number) };
}
console.log(JSON.stringify({ arrays, listing, reads: gets.slice(listing.length), values, refused }));
"""


@pytest.fixture(scope="module")
def zarrita():
    """The directory holding node_modules with zarrita, and the script."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("Node.js and npm are not installed")
    where = os.path.join(os.path.expanduser("~"), ".cache", "zarrckpt-tests", "zarrita-0.7.5")
    if not os.path.isdir(os.path.join(where, "node_modules", "zarrita")):
        os.makedirs(where, exist_ok=True)
        r = subprocess.run(["npm", "install", "--prefix", where, "--no-audit", "--no-fund", *ZARRITA],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    with open(os.path.join(where, "list.mjs"), "w") as f:
        f.write(SCRIPT)
    return where


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"layers.0": {"w": torch.randn(3, 4, generator=g), "b": torch.ones(4)},
                      "big": torch.randn(1024, 1024, generator=g),  # 4 MiB: sharded, inner chunks
                      "ids": torch.arange(6, dtype=torch.int32),
                      "norm": torch.randn(8, generator=g).bfloat16()},
            "step": 3}


def test_zarrita_lists_every_array_from_one_read_and_reads_them(tmp_path, zarrita):
    path = tmp_path / "c"
    sd = state()
    zarrckpt.save(sd, path)
    r = subprocess.run(["node", os.path.join(zarrita, "list.mjs"), str(path)], capture_output=True, text=True,
                       timeout=300, cwd=zarrita)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = {"/model/layers.0/w", "/model/layers.0/b", "/model/big", "/model/ids", "/model/norm"}
    assert set(out["arrays"]) == want, out["arrays"]
    assert out["listing"] == ["/zarr.json"]  # every array listed from the root alone
    assert not [k for k in out["reads"] if k.endswith("zarr.json")], out["reads"]  # nor opened from theirs
    for key in want - {"/model/norm"}:
        t = sd["model"]
        for part in key.split("/")[2:]:
            t = t[part]
        got = out["values"][key]
        assert got["shape"] == list(t.shape), key
        assert np.array_equal(np.asarray(got["data"], dtype=t.numpy().dtype), t.numpy().reshape(-1)), key
    assert list(out["refused"]) == ["/model/norm"] and "bfloat16" in out["refused"]["/model/norm"]
    assert any(k.startswith("/model/big/c/") for k in out["reads"])
