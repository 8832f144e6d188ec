"""Leftovers of saves that died (spec §7.5): a retry to the same path removes them,
``clean_leftovers`` and ``zarrckpt clean`` find and remove them, and a save that is still
running in another process is never touched (its rank 0 holds the flock of its lock file)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import zarrckpt
from zarrckpt.tools import cli
from zarrckpt.readers.lazy import format_bytes
from zarrckpt.engine.commit import SaveLock
from zarrckpt.format.documents import lock_name
from zarrckpt.storage import open_storage

clean_leftovers = zarrckpt.clean_leftovers  # the public name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A save in another process that stops just before its commit, every chunk written:
# killed there with SIGKILL ("kill"), or blocked there until its stdin closes ("block").
SAVE_SCRIPT = """
import os, signal, sys, torch
sys.path.insert(0, {repo!r})
import zarrckpt
from zarrckpt.engine import commit as _commit

def stop(*args, **kwargs):
    if {how!r} == "block":
        print("ready", flush=True)
        sys.stdin.read()
    os.kill(os.getpid(), signal.SIGKILL)

_commit.publish = stop
{save}
"""


def _script(how: str, save: str) -> str:
    return SAVE_SCRIPT.format(repo=REPO, how=how, save=save)


def plain_save(path) -> str:
    return f"zarrckpt.save({{'w': torch.ones(256, 1024)}}, {str(path)!r})"


def killed_save(save: str) -> None:
    """Run ``save`` in a process SIGKILLed just before its commit."""
    p = subprocess.run([sys.executable, "-c", _script("kill", save)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr


class BlockedSave:
    """``save`` in a process held just before its commit (alive, its lock held)."""

    def __init__(self, save: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", _script("block", save)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.p.stdout.readline().strip()
        assert line == "ready", self.p.stderr.read()

    def kill(self) -> None:
        self.p.kill()
        self.p.communicate(timeout=60)

    def __enter__(self) -> BlockedSave:
        return self

    def __exit__(self, *exc) -> None:
        if self.p.poll() is None:
            self.kill()


def hidden(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


def test_a_killed_save_leaves_a_directory_a_claim_and_a_free_lock(tmp_path):
    killed_save(plain_save(tmp_path / "c"))
    (staging, lock) = hidden(tmp_path)
    assert staging.startswith(".zarrckpt-") and staging.endswith(".63") and lock == staging + ".lock"  # "c" in hex
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load_state_dict(tmp_path / "c")
    assert os.path.getsize(tmp_path / staging / "w" / "c" / "0" / "0") >= 256 * 1024 * 4


def test_retry_to_the_same_path_removes_the_dead_saves_leftovers(tmp_path):
    killed_save(plain_save(tmp_path / "c"))
    assert len(hidden(tmp_path)) == 2
    zarrckpt.save({"w": torch.zeros(3)}, tmp_path / "c")
    assert os.listdir(tmp_path) == ["c"]
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "c")["w"], torch.zeros(3))


def test_leftovers_of_another_path_stay_at_a_retry(tmp_path):
    killed_save(plain_save(tmp_path / "a"))
    zarrckpt.save({"w": torch.zeros(3)}, tmp_path / "b")
    assert len(hidden(tmp_path)) == 2  # only clean_leftovers of the directory removes them


def test_clean_leftovers_removes_dead_and_reports_sizes(tmp_path):
    killed_save(plain_save(tmp_path / "c"))
    zarrckpt.save({"w": torch.zeros(3)}, tmp_path / "done")
    found = clean_leftovers(tmp_path, dry_run=True)
    assert sorted(x.kind for x in found) == ["claim", "directory", "lock"]
    assert not any(x.live for x in found) and {x.name for x in found} == {"c"}
    assert max(x.nbytes for x in found) >= 256 * 1024 * 4
    assert len(hidden(tmp_path)) == 2 and "c" in os.listdir(tmp_path)  # dry run: nothing removed
    assert {x.path for x in clean_leftovers(tmp_path)} == {x.path for x in found}
    assert sorted(os.listdir(tmp_path)) == ["done"]
    assert clean_leftovers(tmp_path) == []


def test_a_live_save_in_another_process_is_never_touched(tmp_path):
    with BlockedSave(plain_save(tmp_path / "c")) as live:
        before = sorted(os.listdir(tmp_path))
        found = clean_leftovers(tmp_path)
        assert found and all(x.live for x in found), found
        assert sorted(os.listdir(tmp_path)) == before
        # a retry to that path takes over the claim, as §7.3 allows, but leaves the live save's
        # directory alone; the live save would then fail at its commit
        zarrckpt.save({"w": torch.zeros(3)}, tmp_path / "c")
        assert [n for n in before if n.startswith(".")] == hidden(tmp_path)
        live.kill()
    clean_leftovers(tmp_path)
    assert os.listdir(tmp_path) == ["c"]
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "c")["w"], torch.zeros(3))


def test_a_lock_file_deleted_before_it_is_locked_is_taken_again(tmp_path, monkeypatch):
    """The race of a cleaner that deletes a lock file between the save's open and its flock:
    the save locks a new file, and the cleaner, finding it held, leaves it."""
    import fcntl

    real = fcntl.flock
    calls = {"n": 0}
    path = tmp_path / lock_name("c", "ab" * 15)

    def flock(fd, op):
        calls["n"] += 1
        if calls["n"] == 1:
            assert clean_leftovers(tmp_path)[0].kind == "lock"  # not locked yet: taken for dead
            assert not path.exists()
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = SaveLock.acquire(open_storage(tmp_path / "c"), "ab" * 15)
    monkeypatch.undo()
    try:
        assert calls["n"] == 3 and path.exists()  # the save's, the cleaner's, the save's again
        (found,) = clean_leftovers(tmp_path)
        assert found.live and path.exists()
    finally:
        lock.release()
    assert not path.exists()


def test_clean_does_not_follow_foreign_or_committed_directories(tmp_path):
    zarrckpt.save({"w": torch.zeros(3)}, tmp_path / "c")
    os.makedirs(tmp_path / ".notes.zarrckpt-xyz")  # not a save id
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    assert clean_leftovers(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == [".notes.zarrckpt-xyz", "c", "plain"]


def test_clean_on_an_object_store_removes_nothing():
    url = "memory://clean/run"
    assert clean_leftovers(url) == []


# ------------------------------------------------------------------ zarrckpt clean


def run(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([str(a) for a in args])
    return code, capsys.readouterr().out


def test_cli_clean_lists_then_removes(tmp_path, capsys):
    killed_save(plain_save(tmp_path / "c"))
    code, out = run(capsys, "clean", tmp_path, "--dry-run")
    assert code == 0 and "would remove" in out and ".zarrckpt-" in out and "3 leftovers" in out, out
    assert len(hidden(tmp_path)) == 2
    code, out = run(capsys, "clean", tmp_path, "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] and len(doc["leftovers"]) == 3
    assert {x["kind"] for x in doc["leftovers"]} == {"claim", "directory", "lock"}
    code, out = run(capsys, "clean", tmp_path)
    assert code == 0 and "removed" in out, out
    assert os.listdir(tmp_path) == []
    code, out = run(capsys, "clean", tmp_path)
    assert code == 0 and "0 leftovers" in out


def test_cli_clean_says_what_a_dry_run_would_do(tmp_path, capsys):
    killed_save(plain_save(tmp_path / "c"))
    code, out = run(capsys, "clean", tmp_path, "--dry-run")
    assert code == 0 and out.splitlines()[-1] == (
        "would remove 3 leftovers of saves that died "
        f"({format_bytes(sum(x.nbytes for x in clean_leftovers(tmp_path, dry_run=True)))}) and keep 0 of "
        "running saves; nothing removed (--dry-run)"), out
    code, out = run(capsys, "clean", tmp_path)
    assert code == 0 and out.splitlines()[-1].startswith("removed 3 leftovers of saves that died ("), out
    assert out.splitlines()[-1].endswith("; kept 0 of running saves"), out
    code, out = run(capsys, "clean", tmp_path)
    assert code == 0 and out == "removed 0 leftovers of saves that died (0 B); kept 0 of running saves\n"


def test_cli_clean_of_a_directory_that_is_not_there_is_an_error(tmp_path, capsys):
    """It exited 0 saying "0 leftovers"; every other command exits 2."""
    for args in (["clean", tmp_path / "absent"], ["clean", tmp_path / "absent", "--dry-run", "--json"],
                 ["clean", f"file://{tmp_path}/absent"]):
        code = cli.main([str(a) for a in args])
        captured = capsys.readouterr()
        assert code == cli.EXIT_ERROR and captured.out == "", args
        assert captured.err == f"zarrckpt clean: error: no directory at {str(args[1])!r}\n", captured.err
    (tmp_path / "a_file").write_text("")
    assert cli.main(["clean", str(tmp_path / "a_file")]) == cli.EXIT_ERROR
    assert "is not a directory" in capsys.readouterr().err


def test_cli_clean_help_names_leftovers_as_they_are(capsys):
    """The help said .NAME.zarrckpt-ID; a save's leftovers are .zarrckpt-<id>.<name in hex>."""
    from zarrckpt.format.documents import lock_name, parse_leftover_name, staging_name

    with pytest.raises(SystemExit):
        cli.main(["clean", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ".NAME.zarrckpt-ID" not in text
    assert "(.zarrckpt-<save id>.<checkpoint name in hex>, with -old" in text and "the same name and .lock" in text
    sid = "0123456789abcdef"  # and the names the help describes are those the code makes and parses
    assert staging_name("step_1", sid) == f".zarrckpt-{sid}.{b'step_1'.hex()}"
    assert lock_name("step_1", sid) == staging_name("step_1", sid) + ".lock"
    assert parse_leftover_name(staging_name("step_1", sid) + "-old") == ("directory", "step_1", sid)


def test_cli_clean_keeps_a_live_save(tmp_path, capsys):
    with BlockedSave(plain_save(tmp_path / "c")):
        code, out = run(capsys, "clean", tmp_path)
        assert code == 0 and "live (kept)" in out and "removed" not in out.split("\n")[1], out
        assert len(hidden(tmp_path)) == 2


def test_cli_clean_on_an_object_store_says_why_nothing_is_removed(capsys):
    code, out = run(capsys, "clean", "memory://clean/cli")
    assert code == 0 and "object stores" in out


# ------------------------------------------------------------------ zarrckpt ls shows them


def test_ls_shows_the_leftovers_of_dead_saves_until_clean_removes_them(tmp_path, capsys):
    killed_save(plain_save(tmp_path / "c"))
    zarrckpt.save({"w": torch.zeros(3)}, tmp_path / "done")
    code, out = run(capsys, "ls", tmp_path)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["STEP", "STATE", "SIZE", "ARRAYS", "TIME", "PATH"], out
    assert "2 checkpoints: 1 pending (a save interrupted or still running), 1 committed" in out
    code, js = run(capsys, "ls", tmp_path, "--json")
    doc = json.loads(js)
    assert code == 0 and sorted(x["name"] for x in doc["checkpoints"]) == ["c", "done"]
    assert sorted(x["kind"] for x in doc["leftovers"]) == ["claim", "directory", "lock"]
    assert not any(x["live"] for x in doc["leftovers"]) and {x["name"] for x in doc["leftovers"]} == {"c"}
    total = sum(x["nbytes"] for x in doc["leftovers"])
    assert total >= 256 * 1024 * 4
    assert lines[-1] == f"3 leftovers of dead saves ({format_bytes(total)}): zarrckpt clean {tmp_path} removes them"
    assert "in progress" not in out
    # one checkpoint: the leftovers of its name, in its parent directory
    code, out = run(capsys, "ls", tmp_path / "c")
    assert code == 0 and f"3 leftovers of dead saves ({format_bytes(total)}): zarrckpt clean {tmp_path} " in out
    code, out = run(capsys, "ls", tmp_path / "done")
    assert code == 0 and "dead saves" not in out and json.loads(run(capsys, "ls", tmp_path / "done", "--json")[1])[
        "leftovers"] == []
    assert len(hidden(tmp_path)) == 2  # ls removes nothing
    run(capsys, "clean", tmp_path)
    code, out = run(capsys, "ls", tmp_path)
    assert code == 0 and "dead saves" not in out and "1 checkpoint: 1 committed" in out


def test_ls_counts_a_running_save_as_in_progress_not_as_leftovers(tmp_path, capsys):
    zarrckpt.save({"w": torch.zeros(3)}, tmp_path / "done")
    with BlockedSave(plain_save(tmp_path / "c")):
        code, out = run(capsys, "ls", tmp_path)
        assert code == 0 and "dead saves" not in out, out
        assert out.splitlines()[-1].startswith("1 save in progress (") and "written so far" in out
        doc = json.loads(run(capsys, "ls", tmp_path, "--json")[1])
        assert doc["leftovers"] and all(x["live"] for x in doc["leftovers"])
        assert len(hidden(tmp_path)) == 2


def test_ls_of_a_directory_holding_only_leftovers_names_them_in_its_error(tmp_path, capsys):
    killed_save(plain_save(tmp_path / "c"))
    shutil.rmtree(tmp_path / "c")  # the claim gone: only the dead save's directory and lock remain
    capsys.readouterr()
    assert cli.main(["ls", str(tmp_path)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "no zarrckpt checkpoints" in err and "2 leftovers of dead saves (" in err, err
    assert f"zarrckpt clean {tmp_path} removes them" in err
    assert cli.main(["ls", str(tmp_path / "nothing")]) == cli.EXIT_ERROR
    assert "dead saves" not in capsys.readouterr().err
