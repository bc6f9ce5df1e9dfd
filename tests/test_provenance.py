"""bench/common.git_commit: the commit a GPU row is recorded under. `.commit` (written before a GPU call and carried to
the host, whose git metadata is stale) names the rows unless the checkout's history shows it is stale (a fresh clone
or later work: session 44 noticed a clean clone reporting an old .commit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout.strip()


def _commit(repo: Path, name: str, text: str) -> str:
    (repo / name).write_text(text)
    _git(repo, "add", name)
    _git(repo, "commit", "-qm", name)
    return _git(repo, "rev-parse", "--short", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    _commit(tmp_path, "code.py", "a = 1\n")
    return tmp_path


def test_the_commit_that_records_commit_keeps_its_hash(repo: Path):
    code = _git(repo, "rev-parse", "--short", "HEAD")
    _commit(repo, ".commit", code + "\n")   # the workflow: write .commit, commit it, run on the GPU
    assert common.git_commit(repo) == code


def test_later_code_changes_make_commit_stale(repo: Path):
    code = _git(repo, "rev-parse", "--short", "HEAD")
    _commit(repo, ".commit", code + "\n")
    later = _commit(repo, "code.py", "a = 2\n")   # a fresh clone of later work: .commit's mtime is the clone's
    assert common.git_commit(repo) == later
    (repo / "code.py").write_text("a = 3\n")
    assert common.git_commit(repo) == later + "+dirty"


def test_a_commit_git_does_not_know_or_newer_than_head_wins(repo: Path):
    (repo / ".commit").write_text("deadbee\n")   # the GPU host: metadata older than the commit
    assert common.git_commit(repo) == "deadbee"
    old = _git(repo, "rev-parse", "--short", "HEAD")
    new = _commit(repo, "code.py", "a = 2\n")
    (repo / ".commit").write_text(new + "\n")
    _git(repo, "checkout", "-q", old)   # HEAD older than the recorded commit
    assert common.git_commit(repo) == new


def test_no_commit_file_is_head(repo: Path):
    assert common.git_commit(repo) == _git(repo, "rev-parse", "--short", "HEAD")
