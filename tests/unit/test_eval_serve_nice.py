"""``oea eval serve --server-nice``: restart mode gives every server it starts (and itself) the priority, checked
before any server starts; with running servers the flag is refused (their priority is not ours to set)."""

from __future__ import annotations

from typing import Any

import pytest

from oea.cli import main

RESTART = ["eval", "serve", "--serve-arm", "off=", "--serve-arm", "k3=OEA_K0=3", "--num-items", "2",
           "--max-concurrency", "1", "--no-progress"]
SERVER = ["--", "--model", "m", "--port", "8123"]


class _Stop(ValueError):
    """Raised by the stand-in server start: the run ends there, with what it was asked recorded."""


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stand-ins for the server start and for ``set_priority`` (the test process keeps its own priority)."""
    seen: dict[str, Any] = {"starts": [], "priority": []}

    def starter(engine: str, server_args: list[str], python: str | None) -> Any:
        def start(args: list[str], env: dict[str, str], python: str | None = None, log_path: Any = None,
                  nice: int | None = None) -> Any:
            seen["starts"].append({"env": env, "nice": nice})
            raise _Stop("stand-in server: not started")
        return start

    monkeypatch.setattr("oea.bench.serve.ab.server_starter", starter)
    monkeypatch.setattr("oea.launch.priority.set_priority", lambda nice, flag: seen["priority"].append((nice, flag)))
    return seen


def test_restart_mode_starts_every_server_and_the_client_at_the_priority(
        starts: dict[str, Any], tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*RESTART, "--server-nice", "7", "--engine-metrics-dir", str(tmp_path), *SERVER])
    assert code == 2 and "stand-in server: not started" in capsys.readouterr().err
    assert starts["priority"] == [(7, "--server-nice")]
    assert [s["nice"] for s in starts["starts"]] == [7]
    assert main([*RESTART, "--engine-metrics-dir", str(tmp_path), *SERVER]) == 2  # without the flag: no priority
    assert starts["priority"] == [(7, "--server-nice")] and starts["starts"][-1]["nice"] is None


def test_bad_priority_or_running_servers_are_refused_before_any_server(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    def no_server(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a server was started")

    monkeypatch.setattr("oea.bench.serve.ab.server_starter", no_server)
    assert main([*RESTART, "--server-nice", "40", "--engine-metrics-dir", str(tmp_path), *SERVER]) == 2
    assert "--server-nice must be in -20..19, got 40" in capsys.readouterr().err
    assert main(["eval", "serve", "--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9",
                 "--server-nice", "5"]) == 2
    assert "--server-nice sets the priority of the servers restart mode starts" in capsys.readouterr().err
