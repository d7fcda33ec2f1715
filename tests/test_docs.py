"""The documentation stands alone: no paths of a particular machine, no clock times, and every
repository file it cites exists (code comments citing docs/ too)."""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = sorted([REPO / "README.md", REPO / "BENCHMARKS.md", *(REPO / "docs").glob("*.md")])
CODE = sorted(p for d in ("tasks", "flows", "tests") for p in (REPO / d).rglob("*.py")
              if p.name != Path(__file__).name)

# An absolute path on some machine: /work/..., /tmp/..., a home directory, ... (not a URL's path,
# not ~/.aws: those are the same on every machine).
MACHINE_PATH = re.compile(r"(?<![\w.:/~-])/(?:work|tmp|root|home|Users|mnt|scratch|var/tmp)/")
# A citation of something outside the repository.
OUTSIDE = re.compile(r"(?<!\.)\.\./|\bshared/(?:design|contracts|data)\b")
# In code, `../` is also a value (path-traversal input that is refused): only the design folder counts.
OUTSIDE_IN_CODE = re.compile(r"\.\./shared\b|\bshared/(?:design|contracts|data)\b")
CLOCK_TIME = re.compile(r"\b\d{1,2}:\d{2}(?:-\d{1,2}:\d{2})? UTC\b")
# A repository path: a top-level folder of the repository, then a path (globs and <placeholders>
# allowed), or a top-level file.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:tasks|flows|tests|docs|profiles|\.ci)/[\w.*<>/-]*|"
    r"(?:README|BENCHMARKS)\.md|prefect\.yaml|pyproject\.toml)")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Written by runs, git-ignored: cited as where output goes, not as files of the repository.
OUTPUT_DIRS = ("profiles/measured",)


def cited_paths(text: str) -> set[str]:
    return {m.group(1).rstrip(".,;:") for m in REPO_PATH.finditer(text)}


def exists(cited: str) -> bool:
    """A cited path exists: literally, as a glob, or up to its first <placeholder>."""
    if cited.startswith(OUTPUT_DIRS):
        return True
    if "<" in cited:
        cited = cited[: cited.index("<")].rsplit("/", 1)[0]
    if any(c in cited for c in "*?["):
        return bool(glob.glob(str(REPO / cited)))
    return (REPO / cited).exists()


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_no_machine_paths_or_outside_citations(path: Path):
    bad = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1)
           if MACHINE_PATH.search(line) or OUTSIDE.search(line) or CLOCK_TIME.search(line)]
    assert not bad, f"{rel(path)}: machine path, clock time or citation outside the repository: {bad}"


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_cited_repository_files_exist(path: Path):
    text = path.read_text()
    missing = sorted(p for p in cited_paths(text) if not exists(p))
    links = [m.group(1) for m in MD_LINK.finditer(text) if "://" not in m.group(1)]
    missing += [link for link in links if not (path.parent / link).exists()]
    assert not missing, f"{rel(path)} cites what the repository does not have: {missing}"


def test_code_cites_only_docs_that_exist():
    bad = []
    for path in CODE:
        text = path.read_text()
        if OUTSIDE_IN_CODE.search(text):
            bad.append((rel(path), OUTSIDE_IN_CODE.search(text).group(0)))
        bad += [(rel(path), doc) for doc in re.findall(r"\bdocs/[\w-]+\.md", text) if not (REPO / doc).exists()]
    assert not bad, f"code cites documents outside the repository or missing: {bad}"


@pytest.mark.parametrize("text, machine_path", [
    ("run `cd /work/wt-x && make`", True),
    ("wrote /tmp/bad/empty.csv", True),
    ("in /home/me/spotfill", True),
    ("UI at http://127.0.0.1:4200/api", False),
    ("IMDS `/latest/api/token`", False),
    ("`~/.aws` config", False),
])
def test_machine_path_pattern(text: str, machine_path: bool):
    assert bool(MACHINE_PATH.search(text)) is machine_path


def test_citation_checks_catch_what_they_must():
    assert OUTSIDE.search("see shared/design/model.md") and OUTSIDE.search("../profiles/x.json")
    assert not OUTSIDE.search("checkpoint .../ckpt-9.pt")
    assert CLOCK_TIME.search("runs at 09:14-09:37 UTC") and not CLOCK_TIME.search("ratio 0.44")
    cited = cited_paths("`tasks/core/model.py`, docs/nothing.md, tests/runtime/test_*.py, "
                        "artifacts/<run-id>/report.md, profiles/measured/<workload>/.")
    assert {"tasks/core/model.py", "docs/nothing.md", "tests/runtime/test_*.py"} <= cited
    assert exists("tasks/core/model.py") and exists("tests/runtime/test_*.py")
    assert not exists("docs/nothing.md") and not exists("tasks/nothing_*.py")
