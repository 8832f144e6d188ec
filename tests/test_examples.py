"""Every script in examples/ runs (the README's first command runs one of them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")))
def test_example_runs(script, tmp_path):
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "checkpoint at" in out.stdout
    for name in PRODUCES.get(script, ()):  # what an example promises besides a checkpoint
        with open(tmp_path / "ckpt" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    for line in SAYS.get(script, ()):  # what an example promises to have done
        assert line in out.stdout, out.stdout
    if script in CHECKS:
        CHECKS[script](out)


def _reshard_demo(out: subprocess.CompletedProcess) -> None:
    """The save time it prints is the report's total, and the phases add up to it (it
    printed the sum of report["seconds"], which holds the total too: twice the time). The
    model-only load warns about nothing (it warned once per rank)."""
    m = re.search(r"in (\d+\.\d{3}) s \(((?:\w+ \d+\.\d{3}(?:, )?)+)\)\n", out.stdout)
    assert m, out.stdout
    phases = [float(p.split()[1]) for p in m[2].split(", ")]
    assert set(p.split()[0] for p in m[2].split(", ")) >= {"plan", "write", "commit"}, m[2]
    assert abs(float(m[1]) - sum(phases)) <= 0.0005 * (len(phases) + 1) + 1e-9, m[0]
    assert "zarrckpt.load(" not in out.stderr, out.stderr


CHECKS = {"reshard_demo.py": _reshard_demo}


PRODUCES = {"analyse_run.py": ["norms.png"]}
# the tiers example resumes, after the kill and node1's wiped tier, from the peers' copies
SAYS = {"train_with_tiers.py": ["resumed from step 14 (source: peers,"]}
