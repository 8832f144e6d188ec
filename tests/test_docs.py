"""The README and the documentation site (docs/): every code block runs, and the site builds.

The runner reads ``README.md`` and every page of ``docs/pages/`` and takes each fenced block
(fences at the start of a line, with a language after the backticks):

* ``python``: run with ``exec``, every block of a page in one namespace, in order, in a fresh
  temporary working directory per page, so a block may use what an earlier block of its
  page made (a model, a checkpoint under ``ckpt/``).
* ``bash``: run by ``bash -e`` in that same directory, with this interpreter's ``bin/`` first
  on ``PATH`` (so ``zarrckpt`` and ``python`` are this environment's).
* ``console``: a transcript; every line that starts with ``$ `` is a command, run as a
  ``bash`` line is. The output shown is illustrative (times and dates differ) and is not
  compared; the exit status must be 0, or 1, which the ``zarrckpt`` command uses for "the
  check found a difference or damage" (a transcript shows such a case on purpose).
* ``text``: output, a file layout or a diagram; not code, never run.

A block that cannot run here (a GPU, S3 credentials, many ranks, a package install, a long
benchmark) carries ``<!-- no-run: why -->`` on the line right before its fence; the runner
counts and lists those (``python tests/test_docs.py`` prints the list). Any other block that
fails fails its page's test, with the page and line in the traceback. A block with no
language is an error: say ``text`` if it is not code.

``test_site_builds_strict`` builds the site with ``mkdocs build --strict`` (warnings are
errors): a broken link, a page missing from the nav, an API name mkdocstrings cannot
resolve. It is skipped only where MkDocs is not installed (the ``test`` extra installs it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = DOCS / "pages"
LANGUAGES = ("python", "bash", "console", "text")
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(?P<why>\S.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the first line of code (1-based)
    lang: str
    code: str
    no_run: str | None  # the reason, for blocks marked no-run


def pages() -> list[Path]:
    return [REPO / "README.md"] + sorted(PAGES.rglob("*.md"))


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").split("\n")
    rel = str(path.relative_to(REPO))
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang = m["lang"]
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = NO_RUN.match(prev.strip())
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise AssertionError(f"{rel}:{i + 1}: a fence that is never closed")
        found.append(Block(rel, i + 2, lang, "\n".join(lines[i + 1:end]) + "\n", mark["why"] if mark else None))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return env


def _run_shell(block: Block, command: str, cwd: Path, ok: tuple[int, ...]) -> None:
    out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=cwd, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode in ok, (f"{block.page}:{block.line}: `{command.strip()}` exited {out.returncode}\n"
                                  f"{out.stdout}\n{out.stderr}")


def run_page(path: Path, workdir: Path) -> list[Block]:
    """Runs every runnable block of ``path`` in ``workdir``; returns the blocks it ran."""
    ran: list[Block] = []
    namespace: dict = {"__name__": "__docs__"}
    old = os.getcwd()
    os.chdir(workdir)
    try:
        for block in blocks(path):
            if block.no_run or block.lang == "text":
                continue
            if block.lang == "python":
                code = "\n" * (block.line - 1) + block.code  # tracebacks show the page's own line numbers
                exec(compile(code, str(REPO / block.page), "exec"), namespace)  # noqa: S102 - the docs' own code
            elif block.lang == "bash":
                _run_shell(block, block.code, workdir, (0,))
            elif block.lang == "console":
                commands = [line[2:] for line in block.code.split("\n") if line.startswith("$ ")]
                assert commands, f"{block.page}:{block.line}: a console block with no `$ ` command"
                for command in commands:
                    _run_shell(block, command, workdir, (0, 1))
            ran.append(block)
    finally:
        os.chdir(old)
    return ran


def _page_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_every_block_has_a_known_language():
    bad = [f"{b.page}:{b.line - 1}: ```{b.lang}" for b in all_blocks() if b.lang not in LANGUAGES]
    assert not bad, "blocks need one of " + ", ".join(LANGUAGES) + ":\n" + "\n".join(bad)


def test_no_run_blocks_say_why_and_are_listed(capsys):
    every = all_blocks()
    skipped = [b for b in every if b.no_run]
    code = [b for b in every if b.lang != "text"]
    assert all(len(b.no_run) >= 10 for b in skipped), [b for b in skipped if len(b.no_run) < 10]
    # a no-run mark on output would only hide a mistake
    assert not [b for b in skipped if b.lang == "text"], [b for b in skipped if b.lang == "text"]
    with capsys.disabled():
        print(f"\ndocs: {len(code) - len(skipped)} code blocks run, {len(skipped)} marked no-run:")
        for b in skipped:
            print(f"  {b.page}:{b.line} ({b.lang}): {b.no_run}")


@pytest.mark.parametrize("path", pages(), ids=_page_id)
def test_code_blocks_run(path, tmp_path):
    run_page(path, tmp_path)


def test_readme_test_command_is_the_one_ci_runs():
    """The README's test command is the one `.ci/run` runs, character for character."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    command = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'
    assert f"```bash\n{command}\n```" in readme
    assert f"  {command}\n" in ci
    demo = "pip install torch==2.13.0 && pip install -e . && python examples/reshard_demo.py"
    assert f"```bash\n{demo}\n```" in readme


def test_relative_links_resolve():
    """Links from the README, the pages, the spec and the benchmarks into the repository exist."""
    files = pages() + [REPO / "spec" / "format.md", REPO / "BENCHMARKS.md", REPO / "bench" / "README.md"]
    broken = []
    for path in files:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = {**_env(), "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(DOCS / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()


if __name__ == "__main__":  # python tests/test_docs.py: the blocks, run or not
    every = all_blocks()
    for b in every:
        state = "text" if b.lang == "text" else (f"no-run: {b.no_run}" if b.no_run else "run")
        print(f"{b.page}:{b.line}\t{b.lang}\t{state}")
    code = [b for b in every if b.lang != "text"]
    print(f"{len(code)} code blocks: {sum(not b.no_run for b in code)} run, {sum(bool(b.no_run) for b in code)} "
          f"no-run; {len(every) - len(code)} text blocks")
