"""scripts/check_free_space.py: make install and make test stop on a disk too full for what they write.

A CI run once failed 22 s in, with `No space left on device` inside pip in one of four interleaved install logs;
these tests pin the early one-line refusal instead, using a stand-in for shutil.disk_usage.
"""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from project_scripts import load_script

free_space = load_script("check_free_space")
Usage = namedtuple("Usage", "total used free")
GIB = 1024**3


def _make_env(repo: Path, name: str) -> None:
    (repo / name / "bin").mkdir(parents=True)
    (repo / name / "bin" / "python").write_text("")


def _free(monkeypatch: pytest.MonkeyPatch, by_path: dict[Path, float]) -> None:
    def disk_usage(path: Path) -> Usage:
        return Usage(0, 0, int(by_path[Path(path)] * GIB))

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_a_fresh_clone_needs_every_environment_and_the_scratch_files(tmp_path: Path) -> None:
    need, missing = free_space.needed_gib(tmp_path)
    assert missing == [".venv", ".venv-vllm", ".venv-sglang"]
    assert need == pytest.approx(3.2 + 3.8 + 3.1 + 2.0)


def test_built_environments_are_not_counted_again(tmp_path: Path) -> None:
    _make_env(tmp_path, ".venv")
    _make_env(tmp_path, ".venv-sglang")
    need, missing = free_space.needed_gib(tmp_path)
    assert missing == [".venv-vllm"]
    assert need == pytest.approx(3.8 + 2.0)


def test_same_filesystem_refuses_below_the_sum_and_names_what_it_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    _free(monkeypatch, {tmp_path: 12.0, temp: 12.0})
    line = free_space.shortfall(tmp_path, temp)
    assert line is not None
    assert "12.0 GiB free" in line and "12.1 GiB needed" in line
    assert ".venv, .venv-vllm, .venv-sglang" in line
    _free(monkeypatch, {tmp_path: 12.2, temp: 12.2})
    assert free_space.shortfall(tmp_path, temp) is None


def test_with_every_environment_built_only_the_scratch_files_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (".venv", ".venv-vllm", ".venv-sglang"):
        _make_env(tmp_path, name)
    temp = tmp_path / "tmp"
    temp.mkdir()
    _free(monkeypatch, {tmp_path: 1.5, temp: 1.5})
    line = free_space.shortfall(tmp_path, temp)
    assert line is not None and "builds no environment" in line and "2.0 GiB needed" in line
    _free(monkeypatch, {tmp_path: 2.5, temp: 2.5})
    assert free_space.shortfall(tmp_path, temp) is None


def test_a_separate_temp_filesystem_is_checked_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, temp = tmp_path / "repo", tmp_path / "tmp"
    repo.mkdir()
    temp.mkdir()
    monkeypatch.setattr(free_space, "filesystem_of", lambda path: 1 if path == repo else 2)
    _free(monkeypatch, {repo: 11.0, temp: 1.0})
    line = free_space.shortfall(repo, temp)
    assert line is not None and "temp folder" in line and "TMPDIR" in line
    _free(monkeypatch, {repo: 9.0, temp: 50.0})
    line = free_space.shortfall(repo, temp)
    assert line is not None and "10.1 GiB needed" in line
    _free(monkeypatch, {repo: 10.2, temp: 2.1})
    assert free_space.shortfall(repo, temp) is None


def test_the_command_exits_1_with_the_line_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(free_space.tempfile, "gettempdir", lambda: str(tmp_path))
    _free(monkeypatch, {tmp_path: 0.5})
    assert free_space.main(["--repo", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("check_free_space: 0.5 GiB free")
    _free(monkeypatch, {tmp_path: 100.0})
    assert free_space.main(["--repo", str(tmp_path)]) == 0
