"""Every script in examples/ runs (the README's first command runs one of them)."""

from __future__ import annotations

import os
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


PRODUCES = {"analyse_run.py": ["norms.png"]}
# the tiers example resumes, after the kill and node1's wiped tier, from the peers' copies
SAYS = {"train_with_tiers.py": ["resumed from step 14 (source: peers,"]}
