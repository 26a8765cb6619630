"""``oea soak``'s command line (``oea.soak.cli``) at the edges the generated mutants of ``make mutation`` found
unguarded (docs/testing.md, "Generated mutants"): every flag as ``oea soak --help`` documents it (its default,
type, choices and words); what ``_main`` hands ``session.run`` for an attached server and for started arms
(the config from the flags, the arms and their environment, the process groups, the output folder, the engine,
``--nice``); each refusal in its words and exit status 2; the priority set for this process; the summary
printed as JSON or as the report; the exit status from the verdict.

``session.run``, ``os.setpriority``, ``os.getpgid`` and ``print_result`` are stood in and recorded: no server,
no engine, no priority changed."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from oea.cli import main
from oea.soak import cli, report, session
from oea.soak.mix import MixShares
from oea.soak.monitor import SoakError
from oea.soak.runner import SoakConfig
from oea.soak.servers import Arm

# dest: (flags, default, required, choices, metavar, nargs, action, the value type's name)

FLAGS: dict[str, tuple[Any, ...]] = {
    'base_url': (('--base-url',), None, False, None, None, None, '_StoreAction', None),
    'name': (('--name',), 'server', False, None, None, None, '_StoreAction', None),
    'server_pid': (('--server-pid',), None, False, None, None, None, '_StoreAction', 'integer >= 1'),
    'k0': (('--k0',), None, False, None, None, None, '_StoreAction', 'integer >= 1'),
    'metrics_file': (('--metrics-file',), None, False, None, None, None, '_StoreAction', None),
    'trace_file': (('--trace-file',), None, False, None, None, None, '_StoreAction', None),
    'arm': (('--arm',), [], False, None, 'NAME=ENV', None, '_AppendAction', None),
    'engine': (('--engine',), None, False, ('vllm', 'sglang'), None, None, '_StoreAction', None),
    'python': (('--python',), None, False, None, None, None, '_StoreAction', None),
    'requests': (('--requests',), None, True, None, None, None, '_StoreAction', 'integer in 1..1000000'),
    'duration': (('--duration',), None, True, None, None, None, '_StoreAction', 'number >= 1.0 and <= 86400.0'),
    'warmup': (('--warmup',), 64, False, None, None, None, '_StoreAction', 'integer in 0..100000'),
    'seed': (('--seed',), 0, False, None, None, None, '_StoreAction', 'seed'),
    'max_concurrency': (('--max-concurrency',), 32, False, None, None, None, '_StoreAction', 'integer in 1..1024'),
    'timeout': (('--timeout',), 300.0, False, None, None, None, '_StoreAction', 'number >= 1.0 and <= 86400.0'),
    'abort_share': (('--abort-share',), 0.3, False, None, None, None, '_StoreAction', 'number >= 0.0 and <= 1.0'),
    'refuse_share': (('--refuse-share',), 0.06, False, None, None, None, '_StoreAction', 'number >= 0.0 and <= 1.0'),
    'no_probe': (('--no-probe',), False, False, None, None, 0, '_StoreTrueAction', None),
    'baseline': (('--baseline',), None, False, None, 'NAME', None, '_StoreAction', None),
    'identical_outputs': (('--identical-outputs',), [], False, None, 'NAME', '+', '_StoreAction', None),
    'health_timeout': (('--health-timeout',), 900.0, False, None, None, None, '_StoreAction',
                       'number >= 1.0 and <= 86400.0'),
    'nice': (('--nice',), None, False, None, 'N', None, '_StoreAction', 'int'),
    'keep_engine_caches': (('--keep-engine-caches',), False, False, None, None, 0, '_StoreTrueAction', None),
    'out': (('--out',), None, False, None, None, None, '_StoreAction', None),
    'json': (('--json',), False, False, None, None, 0, '_StoreTrueAction', None),
    'engine_args': ((), None, True, None, None, '...', '_StoreAction', None),
}
HELPS = {
    'base_url': ('attach to a running server, e.g. http://127.0.0.1:8000 (loopback only)'),
    'name': ("--base-url: the arm's name"),
    'server_pid': ("--base-url: a pid of the server, to watch its process group's memory and restarts"),
    'k0': ("--base-url: the server's OEA_K0 (bounds the metrics check)"),
    'metrics_file': ("--base-url: the server's OEA_METRICS_FILE, to check it"),
    'trace_file': ("--base-url: the server's OEA_TRACE_FILE, to check it"),
    'arm': ("an arm with its own server (ENV: space-separated VAR=VALUE, e.g. 'OEA_K0=3 "
        "OEA_METRICS_FILE=m.jsonl OEA_TRACE_FILE=t.safetensors'; empty for OEA off); repeat"),
    'engine': ("--arm: the engine each arm's server runs (default: sglang when the server arguments use an "
        'SGLang-only flag such as --model-path, else vllm)'),
    'python': ('--arm: the interpreter with the engine installed (default: this one)'),
    'requests': ('requests of the mix per arm (after the warm-up)'),
    'duration': ('seconds per arm after which no request is started (the soak stops by itself)'),
    'warmup': ('requests of another seed before the memory baseline'),
    'seed': ('the mix (the same in every arm)'),
    'max_concurrency': ('the top of the ramp and the size of the bursts'),
    'timeout': ("one request's time limit (s)"),
    'abort_share': ('share of requests whose client disconnects'),
    'refuse_share': ('share of requests the engine must refuse'),
    'no_probe': ('skip the exactness probe (seeded sampling, one request at a time, after the warm-up)'),
    'baseline': ('the arm the others are compared with (default: the first)'),
    'identical_outputs': ("arms whose probe outputs must equal the baseline's token for token (OEA_K0 = top_k)"),
    'health_timeout': ("--arm: longest wait for each server's /health (s)"),
    'nice': ("scheduling priority (-20..19) of this client and of each --arm server (a server's own "
        "session's autogroup included): e.g. 15 to soak beside other work on a shared machine"),
    'keep_engine_caches': ("--arm: start each server with the engine's shape caches as configured (default: oneDNN's "
        'primitive cache off, ONEDNN_PRIMITIVE_CACHE_CAPACITY=0, so that the memory check sees a leak'
        " rather than a cache filling with new matmul shapes; an arm's own value wins)"),
    'out': ("folder for each arm's report (<arm>.json, every request) and soak.json"),
    'json': ('print the summary and the checks as JSON'),
    'engine_args': ("--arm: '--' then the server arguments (vLLM's api_server, SGLang's launch_server)"),
}
DESCRIPTION = ('Sends a seeded mix to a server on 127.0.0.1 (prompt and output lengths from 1 token '
               'to the model length, concurrency ramping 1 -> --max-concurrency and bursts, streaming'
               ' and not, n > 1, logprobs, stop strings, max_tokens = 1, seeded sampling, clients '
               'that disconnect mid-stream, and requests the engine must refuse) and reports per arm:'
               " sent / completed / refused (the engine's status) / aborted / failed, health over "
               "time, the server's memory after warm-up and at the end, the time taken. Then checks "
               'what must hold (docs/reliability.md). Exit status: 0 every check held, 1 one failed, '
               '2 bad input (no server, not vLLM / SGLang, unbounded limits).')
HELP = 'hold a local vLLM / SGLang server under a seeded, messy request mix; check what must hold'


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oea")
    cli.register(parser.add_subparsers(), None)  # type: ignore[arg-type]
    return parser


def test_every_flag_is_registered_as_documented() -> None:
    parser = _parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    soak = commands.choices["soak"]
    assert soak.description == DESCRIPTION and commands._choices_actions[0].help == HELP
    assert [a.dest for a in soak._actions[1:]] == list(FLAGS)
    for action in soak._actions[1:]:
        kind = getattr(action.type, "__name__", None) if action.type else None
        assert (tuple(action.option_strings), action.default, action.required, action.choices, action.metavar,
                action.nargs, type(action).__name__, kind) == FLAGS[action.dest], action.dest
        assert action.help == HELPS[action.dest], action.dest
    assert soak.get_default("handler") is cli._main


class Run:
    """``session.run`` stood in: its arguments recorded, the result given back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, held: bool = True, error: str | None = None) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.held, self.error = held, error
        self.printed: list[dict[str, Any]] = []
        self.priority: list[tuple[int, int, int]] = []
        monkeypatch.setattr(session, "run", self.run)
        monkeypatch.setattr(report, "print_result", self.printed.append)
        monkeypatch.setattr(os, "setpriority", lambda which, who, value: self.priority.append((which, who, value)))

    def run(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((args, kwargs))
        if self.error:
            kwargs["say"]("about to fail")
            raise SoakError(self.error)
        kwargs["say"]("soaking")
        return {"held": self.held, "arms": {"a": {"sent": 3}}, "reports": {"a": {"outcomes": []}}}


COMMON = ["--requests", "7", "--duration", "30"]
SERVER = ["--", "--model", "/m", "--port", "8077"]


def test_an_attached_server_is_one_arm_with_its_environment_and_group(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    stage = Run(monkeypatch)
    monkeypatch.setattr(os, "getpgid", lambda pid: pid * 10)
    code = main(["soak", "--base-url", "http://127.0.0.1:8000/", "--name", "oea", "--server-pid", "42",
                 "--k0", "3", "--metrics-file", "m.jsonl", "--trace-file", "t.safetensors", *COMMON])
    out, err = capsys.readouterr()
    assert code == 0 and err == "oea soak: soaking\n" and out == ""
    [(args, kwargs)] = stage.calls
    arms, cfg, engine_args, python, out_dir, baseline, identical, health_timeout, pgids = args
    assert arms == [Arm("oea", {"OEA_K0": "3", "OEA_METRICS_FILE": "m.jsonl", "OEA_TRACE_FILE": "t.safetensors"},
                        base_url="http://127.0.0.1:8000")]
    assert cfg == SoakConfig(requests=7, duration_s=30.0, seed=0, max_concurrency=32, warmup=64, timeout_s=300.0,
                             probe=True, shares=MixShares(abort=0.3, refuse=0.06))
    assert (engine_args, python, out_dir, baseline, identical, health_timeout, pgids) == (
        [], None, None, None, [], 900.0, {"oea": 420})
    assert (kwargs["engine"], kwargs["nice"], kwargs["keep_engine_caches"]) == ("vllm", None, False)
    assert stage.printed == [{"held": True, "arms": {"a": {"sent": 3}}, "reports": {"a": {"outcomes": []}}}]
    assert stage.priority == []


def test_an_attached_server_without_its_pid_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Run(monkeypatch)
    assert main(["soak", "--base-url", "http://localhost:8000", *COMMON]) == 0
    [(args, _kwargs)] = stage.calls
    assert args[0] == [Arm("server", {}, base_url="http://localhost:8000")] and args[8] is None


def test_started_arms_get_every_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    stage = Run(monkeypatch, held=False)
    code = main(["soak", "--arm", "off=", "--arm", "on=OEA_K0=2", "--python", "/py", "--seed", "9",
                 "--max-concurrency", "5", "--warmup", "3", "--timeout", "12.5", "--abort-share", "0.25",
                 "--refuse-share", "0.125", "--no-probe", "--baseline", "on", "--identical-outputs", "off", "on",
                 "--health-timeout", "60", "--nice", "7", "--keep-engine-caches", "--out", str(tmp_path / "o"),
                 "--engine", "sglang", "--json", *COMMON, *SERVER])
    out, err = capsys.readouterr()
    assert code == 1  # the verdict did not hold
    assert json.loads(out) == {"held": False, "arms": {"a": {"sent": 3}}}
    assert out == json.dumps({"held": False, "arms": {"a": {"sent": 3}}}, indent=1) + "\n"
    assert err == "oea soak: soaking\n" and stage.printed == []
    [(args, kwargs)] = stage.calls
    assert args == ([Arm("off", {}), Arm("on", {"OEA_K0": "2"})],
                    SoakConfig(requests=7, duration_s=30.0, seed=9, max_concurrency=5, warmup=3, timeout_s=12.5,
                               probe=False, shares=MixShares(abort=0.25, refuse=0.125)),
                    ["--model", "/m", "--port", "8077"], "/py", tmp_path / "o", "on", ["off", "on"], 60.0, None)
    assert (kwargs["engine"], kwargs["nice"], kwargs["keep_engine_caches"]) == ("sglang", 7, True)
    assert stage.priority == [(os.PRIO_PROCESS, 0, 7)]


def test_the_engine_is_read_from_the_server_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Run(monkeypatch)
    assert main(["soak", "--arm", "a=", *COMMON, "--", "--model-path", "/m", "--port", "30000"]) == 0
    assert stage.calls[0][1]["engine"] == "sglang"


@pytest.mark.parametrize("nice", ["-20", "19", "0"])
def test_each_priority_in_range_is_set_for_this_process(monkeypatch: pytest.MonkeyPatch, nice: str) -> None:
    stage = Run(monkeypatch)
    assert main(["soak", "--nice", nice, "--arm", "a=", *COMMON, *SERVER]) == 0
    assert stage.priority == [(os.PRIO_PROCESS, 0, int(nice))] and stage.calls[0][1]["nice"] == int(nice)


REFUSALS = [
    (["--nice", "20", "--arm", "a=", *COMMON, *SERVER], "--nice must be in -20..19, got 20"),
    (["--nice", "-21", "--arm", "a=", *COMMON, *SERVER], "--nice must be in -20..19, got -21"),
    ([*COMMON], "give either --base-url (a running server) or --arm NAME=ENV ... -- <server arguments>"),
    (["--base-url", "http://127.0.0.1:1", "--arm", "a=", *COMMON, *SERVER],
     "give either --base-url (a running server) or --arm NAME=ENV ... -- <server arguments>"),
    (["--base-url", "http://127.0.0.1:1", *COMMON, *SERVER],
     "--base-url attaches to a running server: no server arguments after '--'"),
    (["--arm", "a=", *COMMON], "--arm starts a server per arm: give its arguments after '--' (vLLM: -- --model DIR "
     "--port 8077 --max-model-len 512; SGLang: -- --model-path DIR --port 30000 --context-length 512)"),
    (["--arm", "a=", *COMMON, "--"], "--arm starts a server per arm: give its arguments after '--' (vLLM: -- "
     "--model DIR --port 8077 --max-model-len 512; SGLang: -- --model-path DIR --port 30000 --context-length 512)"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSALS)
def test_each_refusal_is_one_line_and_exit_status_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                    argv: list[str], message: str) -> None:
    stage = Run(monkeypatch)
    assert main(["soak", *argv]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"oea soak: error: {message}\n")
    assert stage.calls == [] and stage.priority == []


def test_a_priority_that_is_not_permitted_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    stage = Run(monkeypatch)

    def refuse(_which: int, _who: int, _value: int) -> None:
        raise PermissionError("denied")

    monkeypatch.setattr(os, "setpriority", refuse)
    assert main(["soak", "--nice", "-5", "--arm", "a=", *COMMON, *SERVER]) == 2
    err = capsys.readouterr().err
    assert err == "oea soak: error: --nice -5: not permitted (below 0 needs root or CAP_SYS_NICE)\n"
    assert stage.calls == []


def test_the_soaks_own_error_is_one_line_after_what_was_said(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    Run(monkeypatch, error="a: SGLang server exited with code 1")
    assert main(["soak", "--arm", "a=", *COMMON, *SERVER]) == 2
    assert capsys.readouterr() == ("", "oea soak: about to fail\noea soak: error: a: SGLang server exited with "
                                       "code 1\n")


def test_the_server_arguments_are_checked_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    stage = Run(monkeypatch)
    assert main(["soak", "--arm", "a=", *COMMON, "--", "--model", "/m", "--host", "0.0.0.0"]) == 2
    assert "oea soak: error: " in capsys.readouterr().err and stage.calls == []


def test_a_server_pid_that_is_gone_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    stage = Run(monkeypatch)

    def gone(pid: int) -> int:
        raise ProcessLookupError(pid)

    monkeypatch.setattr(os, "getpgid", gone)
    assert main(["soak", "--base-url", "http://127.0.0.1:1", "--server-pid", "77", *COMMON]) == 2
    assert capsys.readouterr().err == "oea soak: error: --server-pid 77: no such process\n" and stage.calls == []


def test_the_process_group_is_the_pids_own() -> None:
    assert cli._pgid(os.getpid()) == os.getpgid(0)
