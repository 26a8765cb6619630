"""``oea bench serve``'s parser (``oea.bench.serve.cli``) and A/B driver (``oea.bench.serve.ab``) at the edges the
generated mutants of ``make mutation`` found unguarded (docs/testing.md, "Generated mutants").

The parser: every flag's default, type, choices, count and help as ``oea bench serve --help`` shows them, and the
handler handing the parsed flags to ``ab.main``. The driver: the arms from the command line and their errors, the
restart-mode round order and files, the engine summary of a round, and ``main``'s checks and output, with stand-ins
for the benchmark and the servers (no request is sent)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from oea.cli import build_parser

SERVE_HELP = 'serving benchmark / A/B against OpenAI-compatible /v1/completions servers'
SERVE_DESCRIPTION = ('Streamed /v1/completions load at each --max-concurrency; TTFT, TPOT, ITL, E2EL '
                     '(mean/median/p99), output tok/s, req/s as vLLM and SGLang define them. Arms: '
                     '--base-url (one server), --base-url-a/--base-url-b (two servers), --arm '
                     'NAME=URL (any number), or --serve-arm NAME=ENV ... -- <server args> (one vLLM '
                     'or SGLang server restarted per arm and round: --engine, or detected from the '
                     'arguments). Rounds alternate arm order (A B, B A, ...; restart mode rotates '
                     'it). With several arms: medians over rounds with 95% CIs and ratios to '
                     '--baseline-arm paired by round.')
FLAG_HELP = {
    '--base-url': ('one server, e.g. http://127.0.0.1:8000'),
    '--base-url-a': ("A/B: arm 'a' server"),
    '--base-url-b': ("A/B: arm 'b' server"),
    '--arm': ('an arm on a running server'),
    '--serve-arm': ('restart mode: an arm served by a fresh vLLM or SGLang server (--engine) with'
                        " ENV (space-separated VAR=VALUE, e.g. 'OEA_K0=3'; empty for stock) and the "
                        "server arguments after '--'"),
    '--serve-arm-args': ('restart mode: server arguments for one --serve-arm only, added after '
                             "those after '--' (shell-split; e.g. speculative decoding in some arms "
                             'of the run and not in others)'),
    '--engine': ("the servers' engine: restart mode starts it (default: sglang when the arguments"
                     " after '--' use a flag only SGLang's launch_server has, e.g. --model-path; else"
                     ' vllm); with running servers, each must say it is this engine (GET /v1/models)'),
    '--model': ("model name sent in requests (default: the server's first /v1/models entry)"),
    '--dataset': ('prompts: random token ids (exact lengths) or windows of held-out text'),
    '--num-prompts': ('requests per (arm, concurrency, round)'),
    '--random-input-len': ('random dataset: prompt length in tokens'),
    '--random-output-len': ('max_tokens (with ignore_eos)'),
    '--random-range-ratio': ('random dataset: input and output lengths drawn from [ratio x len, '
                                 'len] (1.0: exact), as in SGLang'),
    '--text-input-chars': ('text dataset: prompt length in characters'),
    '--max-concurrency': ('requests in flight at once; one sweep point per value'),
    '--rounds': ('measured rounds per arm and concurrency'),
    '--warmup-requests': ('unrecorded requests per arm before measuring'),
    '--seed': ('fixes the prompts (each concurrency and round gets its own, the same for every '
                   'arm)'),
    '--timeout': ('per-request timeout (s)'),
    '--output-file': ('append one JSON line per measured round (sglang field names)'),
    '--plot': ('PNG of TPOT and output tok/s vs concurrency, one line per arm'),
    '--summarize': ("run nothing: the table (or --json, --plot) of an earlier run's --output-file"),
    '--engine-metrics-dir': ("restart mode: directory for each server's OEA_METRICS_FILE and log "
                                 '(default: next to --output-file)'),
    '--engine-metrics': ("an arm's OEA_METRICS_FILE (vLLM or SGLang plugin): adds engine_* fields"
                             " (routing us per call, active experts per decode step) for each round's"
                             ' time window'),
    '--baseline-arm': ('A/B summary: ratios against this arm (default: the first arm)'),
    '--first-round': ('restart mode: number the rounds from R (extend an earlier A/B in the same '
                          '--output-file)'),
    '--max-load': ('restart mode: start each server only once the 1-minute load average is <= L'),
    '--load-wait': ('restart mode: longest wait for --max-load before starting anyway (seconds)'),
    '--server-nice': ('restart mode: scheduling priority of each server and of this client, '
                          'session autogroup included (-20..19; e.g. -10 so that other jobs on a '
                          'shared machine do not time the server; below 0 needs root)'),
    '--python': ('restart mode: interpreter with the engine installed (default: this one)'),
    '--health-timeout': ("restart mode: longest wait for each server's /health (seconds)"),
    '--no-progress': ('no progress bar'),
    '--json': ('print the rows and summary as JSON'),
    'vllm_args': ("restart mode: '--' then the server's arguments (vLLM's api_server or SGLang's "
                      'launch_server)'),
}
FLAGS = {  # flag: (action, default, type, choices, nargs, metavar)
    '--base-url': ('StoreAction', None, None, None, None, None),
    '--base-url-a': ('StoreAction', None, None, None, None, None),
    '--base-url-b': ('StoreAction', None, None, None, None, None),
    '--arm': ('AppendAction', [], None, None, None, 'NAME=URL'),
    '--serve-arm': ('AppendAction', [], None, None, None, 'NAME=ENV'),
    '--serve-arm-args': ('AppendAction', [], None, None, None, 'NAME=ARGS'),
    '--engine': ('StoreAction', None, None, ('vllm', 'sglang'), None, None),
    '--model': ('StoreAction', None, None, None, None, None),
    '--dataset': ('StoreAction', 'random', None, ('random', 'text'), None, None),
    '--num-prompts': ('StoreAction', 32, 'int', None, None, None),
    '--random-input-len': ('StoreAction', 128, 'int', None, None, None),
    '--random-output-len': ('StoreAction', 128, 'int', None, None, None),
    '--random-range-ratio': ('StoreAction', 1.0, 'float', None, None, None),
    '--text-input-chars': ('StoreAction', 512, 'int', None, None, None),
    '--max-concurrency': ('StoreAction', [1, 2, 4, 8, 16, 32], 'int', None, '+', 'C'),
    '--rounds': ('StoreAction', 1, 'int', None, None, None),
    '--warmup-requests': ('StoreAction', 2, 'int', None, None, None),
    '--seed': ('StoreAction', 0, 'seed', None, None, None),
    '--timeout': ('StoreAction', 600.0, 'float', None, None, None),
    '--output-file': ('StoreAction', None, None, None, None, None),
    '--plot': ('StoreAction', None, None, None, None, None),
    '--summarize': ('StoreAction', None, None, None, None, 'FILE'),
    '--engine-metrics-dir': ('StoreAction', None, None, None, None, None),
    '--engine-metrics': ('AppendAction', [], None, None, None, 'NAME=FILE'),
    '--baseline-arm': ('StoreAction', None, None, None, None, 'NAME'),
    '--first-round': ('StoreAction', 0, 'int', None, None, 'R'),
    '--max-load': ('StoreAction', None, 'float', None, None, 'L'),
    '--load-wait': ('StoreAction', 1800.0, 'float', None, None, 'S'),
    '--server-nice': ('StoreAction', None, 'int', None, None, 'N'),
    '--python': ('StoreAction', None, None, None, None, None),
    '--health-timeout': ('StoreAction', 900.0, 'float', None, None, None),
    '--no-progress': ('StoreTrueAction', False, None, None, 0, None),
    '--json': ('StoreTrueAction', False, None, None, 0, None),
    'vllm_args': ('StoreAction', None, None, None, '...', None),
}


def _serve_parser() -> tuple[argparse.ArgumentParser, str | None]:
    """``oea bench serve``'s parser and its line in ``oea bench --help``."""
    def subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    bench = subparsers(subparsers(build_parser()).choices["bench"])
    line = next(c.help for c in bench._choices_actions if c.dest == "serve")
    return bench.choices["serve"], line


def test_bench_serve_is_listed_and_described_as_in_its_help() -> None:
    parser, line = _serve_parser()
    assert line == SERVE_HELP
    assert parser.description == SERVE_DESCRIPTION


def test_every_flag_has_its_default_type_choices_and_help() -> None:
    parser, _ = _serve_parser()
    actions = parser._actions[1:]  # after -h
    got = {(a.option_strings[0] if a.option_strings else a.dest):
           (type(a).__name__.strip("_"), a.default, getattr(a.type, "__name__", a.type), a.choices, a.nargs, a.metavar)
           for a in actions}
    assert got == FLAGS
    assert {(a.option_strings[0] if a.option_strings else a.dest): a.help for a in actions} == FLAG_HELP
    assert [a.required for a in actions if not a.option_strings] == [True]  # the server arguments after '--'


def test_defaults_of_a_bare_command_line() -> None:
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:8000"])
    assert (args.dataset, args.num_prompts, args.max_concurrency, args.rounds, args.seed) == (
        "random", 32, [1, 2, 4, 8, 16, 32], 1, 0)
    assert (args.timeout, args.load_wait, args.health_timeout, args.random_range_ratio) == (600.0, 1800.0, 900.0, 1.0)
    assert args.vllm_args == [] and args.arm == [] and not args.json and not args.no_progress


def test_the_handler_hands_the_parsed_flags_to_the_ab_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    from oea.bench.serve import ab

    seen: list[Any] = []

    def main(args: argparse.Namespace) -> int:
        seen.append(args)
        return 7

    monkeypatch.setattr(ab, "main", main)
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:8000", "--rounds", "3"])
    assert args.handler(args) == 7
    assert seen == [args] and seen[0].rounds == 3


# ---------------------------------------------------------------- ab.py: the arms from the command line


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *argv])


def test_arms_on_running_servers_in_the_order_of_their_flags() -> None:
    from oea.bench.serve.ab import parse_arms
    from oea.bench.serve.client import Arm

    args = _args("--arm", "k3=http://h:3/?x=y", "--base-url-b", "http://h:2", "--base-url", "https://h:0",
                 "--base-url-a", "http://h:1", "--arm", "k5=http://h:5")
    assert parse_arms(args) == [Arm("server", "https://h:0"), Arm("a", "http://h:1"), Arm("b", "http://h:2"),
                                Arm("k3", "http://h:3/?x=y"), Arm("k5", "http://h:5")]
    assert parse_arms(_args()) == []


@pytest.mark.parametrize(("argv", "message"), [
    (["--base-url-a", "http://h:1"], "--base-url-a and --base-url-b go together"),
    (["--base-url-b", "http://h:1"], "--base-url-a and --base-url-b go together"),
    (["--arm", "k3"], "--arm must be NAME=URL, got 'k3'"),
    (["--arm", "=http://h:1"], "--arm must be NAME=URL, got '=http://h:1'"),
    (["--arm", "k3="], "--arm must be NAME=URL, got 'k3='"),
    (["--arm", "a=http://h:1", "--arm", "a=http://h:2"], "arm names must be unique, got ['a', 'a']"),
    (["--base-url-a", "http://h:1", "--base-url-b", "http://h:2", "--arm", "b=http://h:3"],
     "arm names must be unique, got ['a', 'b', 'b']"),
    (["--base-url", "h:1"], "--base-url must be an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000), "
                            "got 'h:1'"),
    (["--base-url-a", "http://h:1", "--base-url-b", "ftp://h:2"], "--base-url-b must be an http:// or https://"),
    (["--base-url-a", "http:///x", "--base-url-b", "http://h:2"], "--base-url-a must be an http:// or https://"),
    (["--arm", "k3=http//h"], "--arm k3=URL must be an http:// or https:// URL with a host"),
])
def test_bad_arms_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    from oea.bench.serve.ab import parse_arms

    with pytest.raises(ValueError) as err:
        parse_arms(_args(*argv))
    assert str(err.value).startswith(message)


def test_restart_mode_arms_and_their_own_server_arguments() -> None:
    from oea.bench.serve.ab import parse_serve_arm_args, parse_serve_arms

    arms = parse_serve_arms(["off=", "k3=OEA_K0=3 OEA_MIN_BATCH='1'"])
    assert arms == {"off": {}, "k3": {"OEA_K0": "3", "OEA_MIN_BATCH": "1"}} and list(arms) == ["off", "k3"]
    with pytest.raises(ValueError, match=r"^--serve-arm names must be unique, got 'off' twice$"):
        parse_serve_arms(["off=", "k3=", "off=OEA_K0=1"])
    with pytest.raises(ValueError, match=r"^--serve-arm must be NAME=ENV"):
        parse_serve_arms(["off"])
    assert parse_serve_arm_args(["k3=--speculative 'a b' --x=1=2"], arms) == {"k3": ["--speculative", "a b",
                                                                                   "--x=1=2"]}
    assert parse_serve_arm_args([], arms) == {}
    bad = {"k3": "--serve-arm-args must be NAME=ARGS (server arguments for that arm), got 'k3'",
           "=--x": "--serve-arm-args must be NAME=ARGS (server arguments for that arm), got '=--x'",
           "k3=  ": "--serve-arm-args must be NAME=ARGS (server arguments for that arm), got 'k3=  '",
           "k5=--x": "--serve-arm-args k5: no --serve-arm of that name (arms: off, k3)"}
    for spec, message in bad.items():
        with pytest.raises(ValueError) as err:
            parse_serve_arm_args([spec], arms)
        assert str(err.value) == message
    with pytest.raises(ValueError) as err:
        parse_serve_arm_args(["k3=--x", "off=--y", "k3=--z"], arms)
    assert str(err.value) == "--serve-arm-args k3: given twice"


def test_engine_metrics_files_by_arm() -> None:
    from pathlib import Path

    from oea.bench.serve.ab import parse_engine_metrics

    assert parse_engine_metrics(["a=/m/a.jsonl", "b=x=y.jsonl"]) == {"a": Path("/m/a.jsonl"), "b": Path("x=y.jsonl")}
    for spec in ("a", "=f", "a="):
        with pytest.raises(ValueError) as err:
            parse_engine_metrics([spec])
        assert str(err.value) == f"--engine-metrics must be NAME=FILE, got {spec!r}"


def test_the_request_mix_takes_every_flag() -> None:
    from oea.bench.serve.ab import bench_config
    from oea.bench.serve.client import BenchConfig

    args = _args("--model", "m", "--dataset", "text", "--num-prompts", "5", "--random-input-len", "7",
                 "--random-output-len", "9", "--random-range-ratio", "0.5", "--text-input-chars", "33",
                 "--max-concurrency", "3", "1", "--rounds", "4", "--warmup-requests", "6", "--seed", "11",
                 "--timeout", "2.5")
    assert bench_config(args) == BenchConfig(model="m", dataset="text", num_prompts=5, random_input_len=7,
                                             random_output_len=9, random_range_ratio=0.5, text_input_chars=33,
                                             concurrencies=(3, 1), rounds=4, warmup_requests=6, seed=11,
                                             timeout=2.5)


# ---------------------------------------------------------------- ab.py: rounds, load, engine rows


def test_restart_mode_rotates_the_arm_order_each_round() -> None:
    from oea.bench.serve.ab import restart_order

    names = ["off", "k5", "k3"]
    assert [restart_order(names, r) for r in range(5)] == [
        ["off", "k5", "k3"], ["k5", "k3", "off"], ["k3", "off", "k5"], ["off", "k5", "k3"], ["k5", "k3", "off"]]
    assert [restart_order(["a", "b"], r) for r in (0, 1, 2, 7)] == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert names == ["off", "k5", "k3"]


def test_waiting_for_the_load_polls_until_it_is_at_most_the_bound_or_the_time_is_up() -> None:
    from oea.bench.serve.ab import wait_for_load

    def run(loads: list[float], max_load: float | None, timeout: float, **kw: Any) -> tuple[float, list[float]]:
        slept: list[float] = []
        it = iter(loads)
        waited = wait_for_load(max_load, timeout, loadavg=lambda: (next(it), 99.0, 99.0), sleep=slept.append, **kw)
        return waited, slept

    assert run([], None, 100.0) == (0.0, [])  # no bound: the load is never read
    assert run([5.0, 4.0, 2.0, 9.0], 2.0, 100.0) == (30.0, [15.0, 15.0])  # 2.0 is at most 2.0
    assert run([5.0, 5.0, 5.0, 5.0], 2.0, 30.0) == (30.0, [15.0, 15.0])
    assert run([5.0, 5.0, 5.0, 5.0], 2.0, 29.0, poll=10.0) == (30.0, [10.0, 10.0, 10.0])
    assert run([5.0], 2.0, 0.0) == (0.0, [])


def test_each_round_records_the_load_average_then_the_engine_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    from oea.bench.serve import ab

    monkeypatch.setattr(ab.os, "getloadavg", lambda: (1.5, 2.5, 3.5))
    row: dict[str, Any] = {}
    ab.with_load(None)(row)
    assert row == {"loadavg": [1.5, 2.5, 3.5]}
    seen: list[dict[str, Any]] = []
    ab.with_load(lambda r: seen.append(dict(r)))(row)
    assert seen == [{"loadavg": [1.5, 2.5, 3.5]}]


def _step(t: float, decode: bool = True, **kw: Any) -> dict[str, Any]:
    return {"time": t, "decode": decode, "rows": kw.pop("rows", 2), "active": kw.pop("active", [2]), **kw}


def test_the_engine_summary_of_a_rounds_window() -> None:
    from oea.bench.serve.ab import engine_summary

    rows = [
        _step(10.0, pid=7, step=1, rows=4, active=[2, 4], routing_us=[10.0, 20.0]),  # at the window's start
        _step(10.5, pid=7, step=2, rows=2, active=[6], routing_us=[60.0], active_stock=[8]),  # 500 ms after step 1
        _step(10.5, pid=7, step=3, rows=2, active=[1], routing_us=[]),  # a gap of 0: left out
        _step(11.5, pid=8, step=2, rows=4, active=[3]),  # another process: its step 1 is not here
        _step(21.0, pid=8, step=9, rows=4, active=[4], routing_us=[30.0]),  # end + 1 s: still in
        _step(9.99, active=[100], routing_us=[1e6]), _step(21.01, active=[100], routing_us=[1e6]),
        _step(12.0, decode=False, active=[100], routing_us=[1e6]),  # a prompt step
    ]
    out = engine_summary(rows, 10.0, 20.0)
    assert out == pytest.approx({
        "engine_decode_steps": 5, "engine_routing_us_per_call": 30.0, "engine_routing_us_median": 25.0,
        "engine_active_experts": 20 / 6, "engine_mean_decode_rows": 3.2, "engine_active_experts_stock": 8.0,
        "engine_step_ms_median": 500.0, "engine_routing_share_call": 30.0 / 1e3 / 500.0,
        "engine_routing_share_step": 40.0 / 1e3 / 500.0})


def test_the_engine_summary_of_speculative_steps_and_of_nothing() -> None:
    from oea.bench.serve.ab import engine_summary

    rows = [_step(1.0, decode=False, verify=True, oea=True, tokens_per_request=[1, 3]),
            _step(2.0, decode=False, verify=True, oea=True, tokens_per_request=[4]),
            _step(2.5, decode=False, verify=True, oea=False),
            _step(3.0, decode=True, verify=False, oea=True),
            _step(4.0, decode=True, verify=False, oea=0, tokens_per_request=[]),
            _step(5.0, decode=False, verify=False, oea=True, tokens_per_request=[50])]
    out = engine_summary(rows, 0.0, 10.0)
    assert math.isnan(out.pop("engine_routing_us_per_call")) and math.isnan(out.pop("engine_routing_us_median"))
    assert out == {"engine_decode_steps": 5, "engine_active_experts": 2, "engine_mean_decode_rows": 2,
                   "engine_verify_steps": 3, "engine_verify_steps_rewritten": 2, "engine_decode_steps_rewritten": 1,
                   "engine_mean_tokens_per_request": 3.0}
    plain = engine_summary([_step(1.0, verify=False, oea=True)], 0.0, 10.0)
    assert "engine_mean_tokens_per_request" not in plain and plain["engine_verify_steps"] == 0
    empty = engine_summary(rows, 20.0, 30.0)
    assert empty["engine_decode_steps"] == 0 and sorted(empty) == sorted(
        ["engine_decode_steps", "engine_routing_us_per_call", "engine_routing_us_median", "engine_active_experts",
         "engine_mean_decode_rows"])
    assert all(math.isnan(v) for k, v in empty.items() if k != "engine_decode_steps")


def test_the_enricher_reads_the_arms_metrics_file_after_a_flush(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    from oea.bench.serve import ab

    slept: list[float] = []
    monkeypatch.setattr(ab.time, "sleep", slept.append)
    path = tmp_path / "engine-k3.jsonl"
    enrich = ab.engine_enricher({"k3": path, "off": tmp_path / "none.jsonl"})
    row = {"arm": "other", "start_time": 0.0, "end_time": 10.0}
    enrich(row)
    assert row == {"arm": "other", "start_time": 0.0, "end_time": 10.0} and slept == []
    row = {"arm": "off", "start_time": 0.0, "end_time": 10.0}
    enrich(row)  # no file yet: no wait, no steps
    assert slept == [] and row["engine_decode_steps"] == 0
    path.write_text(json.dumps(_step(5.0, routing_us=[7.0])) + "\n")
    row = {"arm": "k3", "start_time": 0.0, "end_time": 10.0}
    enrich(row)
    assert slept == [1.0] and row["engine_decode_steps"] == 1 and row["engine_routing_us_per_call"] == 7.0
    ab.engine_enricher({"k3": path}, flush_wait=0.25)(dict(row))
    assert slept == [1.0, 0.25]


# ---------------------------------------------------------------- ab.py: restart mode with stand-in servers


class _Restart:
    """Stand-ins for the server launcher, health wait, engine check, load wait and benchmark of restart mode:
    each records its calls in ``log``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_arm: str | None = None) -> None:
        from oea.bench.serve import ab
        from oea.launch import priority, server_process

        self.log: list[tuple[Any, ...]] = []
        self.servers: list[Any] = []
        monkeypatch.setenv("OEA_K0", "9")  # the stock arm must not inherit it
        monkeypatch.setattr(ab, "server_starter", lambda engine, args, python: (
            self.log.append(("starter", engine, list(args), python)) or self.start))
        monkeypatch.setattr(server_process, "wait_healthy", lambda server, **kw: self.log.append(
            ("healthy", server.base_url, kw)))
        monkeypatch.setattr(server_process, "stop_server", lambda server: self.log.append(("stop", server.base_url)))
        monkeypatch.setattr(ab, "require_engine", lambda url, engine, **kw: self.log.append(
            ("engine", url, engine, kw)))
        monkeypatch.setattr(ab, "wait_for_load", lambda max_load, wait: self.log.append(("load", max_load, wait))
                            or 2.5)
        monkeypatch.setattr(priority, "set_priority", lambda nice, flag: self.log.append(("nice", nice, flag)))
        monkeypatch.setattr(ab.os, "getloadavg", lambda: (1.0, 2.0, 3.0))
        self.fail_arm = fail_arm

        def run_benchmark(arms: list[Any], cfg: Any, progress: bool, enrich: Any) -> list[dict[str, Any]]:
            import signal

            (arm,) = arms
            self.log.append(("bench", arm.name, arm.base_url, cfg.rounds, cfg.seed, progress))
            if self.fail_arm is not None and arm.name == self.fail_arm:
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
            row = {"arm": arm.name, "start_time": 0.0, "end_time": 1.0}
            enrich(row)
            return [row]

        monkeypatch.setattr(ab, "run_benchmark", run_benchmark)

    def start(self, args: list[str], env: dict[str, str], python: str | None, log_path: Path,
              nice: int | None) -> Any:
        metrics = Path(env["OEA_METRICS_FILE"])
        self.log.append(("start", list(args), {k: v for k, v in env.items() if k.startswith("OEA")}, python,
                         log_path.name, nice, metrics.exists()))
        server = argparse.Namespace(base_url=f"http://127.0.0.1:{9000 + len(self.servers)}")
        self.servers.append(server)
        return server


def _cfg(**kw: Any) -> Any:
    from oea.bench.serve.client import BenchConfig

    return BenchConfig(**{"model": "m", "concurrencies": (1,), "rounds": 2, "seed": 5, **kw})


def test_restart_mode_starts_one_server_per_arm_and_round_in_the_rotated_order(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    import signal

    from oea.bench.serve.ab import run_restarted
    from oea.bench.serve.client import load_rows

    stand_in = _Restart(monkeypatch)
    out_dir = tmp_path / "deep" / "metrics"
    out_dir.mkdir(parents=True)
    (out_dir / "engine-k3-round3.jsonl").write_text("stale\n")  # an earlier run's: removed before the server starts
    before = signal.getsignal(signal.SIGTERM)
    rows = run_restarted({"off": {}, "k3": {"OEA_K0": "3"}}, ["--", "--model", "m"], _cfg(), out_dir,
                         tmp_path / "rows.jsonl", "/py", 60.0, progress=False, server_nice=-5, first_round=3,
                         max_load=4.0, load_wait=30.0, engine="vllm", arm_args={"k3": ["--spec", "1"]})
    assert signal.getsignal(signal.SIGTERM) == before
    assert stand_in.log[:2] == [("nice", -5, "--server-nice"), ("starter", "vllm", ["--model", "m"], "/py")]
    calls = stand_in.log[2:]
    order = [(c[1], c[3]) for c in calls if c[0] == "bench"]
    assert order == [("k3", 1), ("off", 1), ("off", 1), ("k3", 1)]  # round 3: k3 off; round 4: off k3
    assert [c[4] for c in calls if c[0] == "bench"] == [305, 305, 405, 405]  # the round's own prompts
    assert all(c[5] is False for c in calls if c[0] == "bench")
    starts = [c for c in calls if c[0] == "start"]
    assert [(c[1], c[2], c[3], c[4], c[5], c[6]) for c in starts] == [
        (["--model", "m", "--spec", "1"], {"OEA_METRICS_FILE": str(out_dir / "engine-k3-round3.jsonl"),
                                           "OEA_TIMING": "1", "OEA_K0": "3"}, "/py", "server-k3-round3.log", -5, False),
        (["--model", "m"], {"OEA_METRICS_FILE": str(out_dir / "engine-off-round3.jsonl"), "OEA_TIMING": "1"},
         "/py", "server-off-round3.log", -5, False),
        (["--model", "m"], {"OEA_METRICS_FILE": str(out_dir / "engine-off-round4.jsonl"), "OEA_TIMING": "1"},
         "/py", "server-off-round4.log", -5, False),
        (["--model", "m", "--spec", "1"], {"OEA_METRICS_FILE": str(out_dir / "engine-k3-round4.jsonl"),
                                           "OEA_TIMING": "1", "OEA_K0": "3"}, "/py", "server-k3-round4.log", -5, False),
    ]
    first = calls[:6]
    assert first == [("load", 4.0, 30.0), starts[0], ("healthy", "http://127.0.0.1:9000",
                                                       {"timeout": 60.0, "timeout_name": "--health-timeout"}),
                     ("engine", "http://127.0.0.1:9000", "vllm", {"strict": False}),
                     ("bench", "k3", "http://127.0.0.1:9000", 1, 305, False), ("stop", "http://127.0.0.1:9000")]
    assert [c[1] for c in calls if c[0] == "stop"] == [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    assert [(r["arm"], r["round"], r["engine"], r["arm_env"], r.get("arm_server_args"), r["load_wait_s"],
             r["loadavg"], r["engine_decode_steps"]) for r in rows] == [
        ("k3", 3, "vllm", {"OEA_K0": "3"}, ["--spec", "1"], 2.5, [1.0, 2.0, 3.0], 0),
        ("off", 3, "vllm", {}, None, 2.5, [1.0, 2.0, 3.0], 0),
        ("off", 4, "vllm", {}, None, 2.5, [1.0, 2.0, 3.0], 0),
        ("k3", 4, "vllm", {"OEA_K0": "3"}, ["--spec", "1"], 2.5, [1.0, 2.0, 3.0], 0)]
    assert "arm_server_args" not in rows[1]
    assert load_rows(tmp_path / "rows.jsonl") == json.loads(json.dumps(rows))


def test_restart_mode_defaults_and_the_engine_detected_from_the_arguments(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    from oea.bench.serve.ab import run_restarted

    stand_in = _Restart(monkeypatch)
    out_dir = tmp_path / "a" / "b"
    rows = run_restarted({"off": {}}, ["--model-path", "m"], _cfg(rounds=1), out_dir, None, None, 9.0,
                         progress=True)
    assert out_dir.is_dir() and not list(out_dir.iterdir())
    assert stand_in.log[0] == ("starter", "sglang", ["--model-path", "m"], None)
    assert ("load", None, 1800.0) in stand_in.log and not any(c[0] == "nice" for c in stand_in.log)
    start = next(c for c in stand_in.log if c[0] == "start")
    assert start[4:6] == ("server-off-round0.log", None)
    assert next(c for c in stand_in.log if c[0] == "bench")[3:] == (1, 5, True)
    assert [(r["round"], r["engine"], r["arm_env"]) for r in rows] == [(0, "sglang", {})]
    assert "arm_server_args" not in rows[0]


def test_sigterm_in_restart_mode_stops_the_server_and_restores_the_handler(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    import signal

    from oea.bench.serve.ab import run_restarted

    stand_in = _Restart(monkeypatch, fail_arm="k3")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match=f"^signal {int(signal.SIGTERM)}$"):
        run_restarted({"off": {}, "k3": {}}, ["--model", "m"], _cfg(), tmp_path, tmp_path / "rows.jsonl", None, 9.0,
                      progress=False, engine="vllm")
    assert signal.getsignal(signal.SIGTERM) == before
    assert [c[0] for c in stand_in.log][-2:] == ["bench", "stop"]
    assert [c[1] for c in stand_in.log if c[0] == "bench"] == ["off", "k3"]
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize(("vllm_args", "first_round", "engine", "message"), [
    (["--model", "m"], -1, None, "^--first-round must be >= 0, got -1$"),
    (["--"], 0, None, r"^restart mode needs the server arguments after '--' \(vLLM's api_server or SGLang's "
                       r"launch_server\)$"),
    ([], 0, None, "^restart mode needs the server arguments"),
    (["--model", "m"], 0, "trt", "--engine"),
])
def test_restart_mode_refusals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, vllm_args: list[str],
                               first_round: int, engine: str | None, message: str) -> None:
    from oea.bench.serve.ab import run_restarted

    stand_in = _Restart(monkeypatch)
    with pytest.raises(ValueError, match=message):
        run_restarted({"off": {}}, vllm_args, _cfg(), tmp_path / "out", None, None, 9.0, progress=False,
                      first_round=first_round, engine=engine)
    assert stand_in.log == [] and not (tmp_path / "out").exists()


def test_the_server_starter_of_each_engine(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    import functools
    import sys

    from oea.bench.serve import ab
    from oea.launch import sglang_server, vllm

    probes: list[tuple[str, str]] = []
    found = {"sgl_kernel": False}
    monkeypatch.setattr(ab, "_importable", lambda python, module: probes.append((python, module)) or found[module])
    assert ab.server_starter("vllm", ["--device", "cpu"], None) is vllm.start_server and probes == []
    starter = ab.server_starter("sglang", ["--model-path", "m", "--device", "cpu"], "/py")
    assert isinstance(starter, functools.partial) and starter.func is sglang_server.start_server
    assert starter.keywords == {"stand_in": True} and starter.args == () and probes == [("/py", "sgl_kernel")]
    assert capsys.readouterr().err == (
        "oea bench serve: no sgl_kernel in the SGLang interpreter: each CPU server runs with oea's sgl_kernel "
        "stand-in (SGLang's torch-native paths; oea.launch.sglang_server)\n")
    assert ab.server_starter("sglang", ["--device=cpu"], None).keywords == {"stand_in": True}
    assert probes[-1] == (sys.executable, "sgl_kernel")
    capsys.readouterr()
    found["sgl_kernel"] = True
    assert ab.server_starter("sglang", ["--device", "cpu"], None).keywords == {"stand_in": False}
    probes.clear()
    assert ab.server_starter("sglang", ["--device", "cuda"], None).keywords == {"stand_in": False}
    assert probes == [] and capsys.readouterr().err == ""


def test_whether_an_interpreter_finds_a_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import subprocess
    import sys

    from oea.bench.serve import ab

    assert ab._importable(sys.executable, "json") is True
    assert ab._importable(sys.executable, "no_such_module_oea_h9") is False
    assert ab._importable(str(tmp_path / "no-python"), "json") is False
    calls: list[tuple[list[str], dict[str, Any]]] = []

    def run(cmd: list[str], **kw: Any) -> Any:
        calls.append((cmd, kw))
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(ab.subprocess, "run", run)
    assert ab._importable("/py", "sgl_kernel") is False
    assert calls == [(["/py", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('sgl_kernel') "
                                    "is None)"], {"capture_output": True, "timeout": 120})]


def test_running_servers_must_say_they_are_the_engine_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from oea.bench.serve import ab, client
    from oea.bench.serve.client import Arm

    log: list[tuple[Any, ...]] = []
    monkeypatch.setattr(client, "check_reachable", lambda url: log.append(("reach", url)))
    monkeypatch.setattr(ab, "require_engine", lambda url, engine, **kw: log.append(("engine", url, engine, kw)))
    arms = [Arm("a", "http://h:1"), Arm("b", "http://h:2")]
    ab.check_running_engine(arms, None)
    assert log == []
    ab.check_running_engine(arms, "sglang")
    assert log == [("reach", "http://h:1"), ("engine", "http://h:1", "sglang", {}), ("reach", "http://h:2"),
                   ("engine", "http://h:2", "sglang", {})]
    with pytest.raises(ValueError, match="--engine"):
        ab.check_running_engine(arms, "trt")


# ---------------------------------------------------------------- ab.py: --summarize and main


def _row(arm: str, concurrency: int, round_index: int, tpot: float) -> dict[str, Any]:
    return {"arm": arm, "max_concurrency": concurrency, "round": round_index, "median_tpot_ms": tpot,
            "median_itl_ms": tpot, "mean_tpot_ms": tpot, "mean_ttft_ms": 20.0, "output_throughput": 1000.0 / tpot,
            "loadavg": [1.0, 1.0, 1.0]}


def _rows() -> list[dict[str, Any]]:
    return [_row(a, 4, r, t + r) for r in range(3) for a, t in (("off", 10.0), ("k3", 8.0))]


@pytest.mark.parametrize("extra", [["--serve-arm", "off="], ["--base-url", "http://h:1"], ["--base-url-a", "http://h:1"],
                                   ["--arm", "a=http://h:1"], ["--output-file", "o.jsonl"], ["--", "--model", "m"],
                                   ["--model", "m", "--", "x"]])
def test_summarize_cannot_be_combined_with_servers(tmp_path: Path, extra: list[str]) -> None:
    from oea.bench.serve.ab import summarized_rows

    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    if extra[0] == "--model":
        args = _args("--summarize", str(path))
        args.vllm_args = ["x"]
    else:
        args = _args("--summarize", str(path), *extra)
    with pytest.raises(ValueError) as err:
        summarized_rows(args)
    assert str(err.value) == ("--summarize reads an earlier run: it cannot be combined with servers, arms or "
                              "--output-file")
    assert summarized_rows(_args("--summarize", str(path), "--")) == _rows()


def test_summarize_refusals_word_for_word(tmp_path: Path) -> None:
    from oea.bench.serve.ab import summarized_rows

    def refusal(path: Path) -> str:
        with pytest.raises(ValueError) as err:
            summarized_rows(_args("--summarize", str(path)))
        return str(err.value)

    assert refusal(tmp_path) == (f"--summarize {tmp_path} is a directory; give the JSONL file an earlier "
                                 "--output-file wrote")
    assert refusal(tmp_path / "none.jsonl") == f"--summarize: no such file: {tmp_path / 'none.jsonl'}"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\n")
    assert refusal(bad).startswith(f"--summarize: {bad} is not JSON lines written by oea bench serve (Expecting")
    needed = "arm, max_concurrency, round, output_throughput, mean_tpot_ms, mean_ttft_ms"
    for missing in ("arm", "max_concurrency", "round", "output_throughput", "mean_tpot_ms", "mean_ttft_ms"):
        rows = _rows()
        del rows[1][missing]
        bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert refusal(bad) == f"--summarize: {bad} has no oea bench serve rows (each needs {needed})"
    bad.write_text("\n")
    assert refusal(bad) == f"--summarize: {bad} has no oea bench serve rows (each needs {needed})"


class _Bench:
    """``run_benchmark`` and ``run_restarted`` stood in: they record their arguments and return ``_rows()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: Exception | None = None) -> None:
        from oea.bench.serve import ab

        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self.checked: list[tuple[Any, Any]] = []

        def run_benchmark(arms: Any, cfg: Any, **kw: Any) -> list[dict[str, Any]]:
            self.calls.append(("bench", (arms, cfg), kw))
            if error is not None:
                raise error
            return _rows()

        def run_restarted(*a: Any, **kw: Any) -> list[dict[str, Any]]:
            self.calls.append(("restart", a, kw))
            return _rows()

        monkeypatch.setattr(ab, "run_benchmark", run_benchmark)
        monkeypatch.setattr(ab, "run_restarted", run_restarted)
        monkeypatch.setattr(ab, "check_running_engine", lambda arms, engine: self.checked.append((arms, engine)))
        monkeypatch.setattr(ab.os, "getloadavg", lambda: (1.0, 2.0, 3.0))


def test_main_runs_the_arms_and_prints_the_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from oea.bench.serve import ab
    from oea.bench.serve.client import Arm
    from oea.bench.serve.summary import ab_summary, summarize

    bench = _Bench(monkeypatch)
    out = tmp_path / "new" / "rows.jsonl"
    metrics = tmp_path / "k3.jsonl"
    metrics.write_text(json.dumps(_step(0.5, routing_us=[4.0])) + "\n")
    monkeypatch.setattr(ab.time, "sleep", lambda s: None)
    args = _args("--arm", "off=http://h:1", "--arm", "k3=http://h:2", "--seed", "3", "--output-file", str(out),
                 "--engine-metrics", f"k3={metrics}", "--baseline-arm", "k3", "--json", "--engine", "vllm",
                 "--no-progress", "--")
    assert ab.main(args) == 0  # a folder of --output-file that does not exist yet is accepted (made when written)
    assert bench.checked == [([Arm("off", "http://h:1"), Arm("k3", "http://h:2")], "vllm")]
    ((kind, (arms, cfg), kw),) = bench.calls
    assert kind == "bench" and arms == bench.checked[0][0] and cfg.seed == 3
    assert kw["output_file"] == out and kw["progress"] is False
    row = {"arm": "k3", "start_time": 0.0, "end_time": 1.0}
    kw["enrich"](row)
    assert row["loadavg"] == [1.0, 2.0, 3.0] and row["engine_routing_us_per_call"] == 4.0
    text = capsys.readouterr().out
    assert text == json.dumps({"rows": _rows(), "summary": summarize(_rows()),
                               "ab": ab_summary(_rows(), baseline="k3", seed=3)}, indent=1) + "\n"
    printed = json.loads(text)
    assert [(e["arm"], e["baseline"]) for e in printed["ab"]] == [("off", "k3"), ("k3", "k3")]


def test_main_without_engine_metrics_records_the_load_only(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from oea.bench.serve import ab

    bench = _Bench(monkeypatch)
    assert ab.main(_args("--base-url", "http://h:1")) == 0
    ((_, _, kw),) = bench.calls
    assert kw["output_file"] is None and kw["progress"] is True
    row = {"arm": "server", "start_time": 0.0, "end_time": 1.0}
    kw["enrich"](row)
    assert row == {"arm": "server", "start_time": 0.0, "end_time": 1.0, "loadavg": [1.0, 2.0, 3.0]}
    assert bench.checked[0][1] is None
    table = capsys.readouterr().out
    assert "k3" in table and "off" in table and not table.lstrip().startswith("{")


def test_main_reports_an_unreachable_server_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from oea.bench.serve import ab
    from oea.bench.serve.client import ServerUnreachable

    _Bench(monkeypatch, error=ServerUnreachable("http://h:1: connection refused"))
    assert ab.main(_args("--base-url", "http://h:1")) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "oea bench serve: error: http://h:1: connection refused\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--serve-arm", "off=", "--base-url", "http://h:1"],
     "--serve-arm (restart mode) cannot be combined with --base-url/--arm"),
    (["--serve-arm", "off=", "--base-url-a", "http://h:1", "--base-url-b", "http://h:2"],
     "--serve-arm (restart mode) cannot be combined with --base-url/--arm"),
    (["--serve-arm", "off=", "--arm", "a=http://h:1"], "--serve-arm (restart mode) cannot be combined with "
                                                       "--base-url/--arm"),
    (["--base-url", "http://h:1", "--serve-arm-args", "off=--x"],
     "--serve-arm-args is only used with --serve-arm (restart mode)"),
    (["--base-url", "http://h:1", "--", "--model", "m"],
     "server arguments after '--' are only used with --serve-arm (restart mode)"),
    ([], "give a server: --base-url URL, --base-url-a URL --base-url-b URL, --arm NAME=URL, or --serve-arm "
         "NAME=ENV ... -- <vllm args>"),
    (["--base-url", "http://h:1", "--engine-metrics", "k3"], "--engine-metrics must be NAME=FILE, got 'k3'"),
])
def test_main_refuses_before_any_request(monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str) -> None:
    from oea.bench.serve import ab

    bench = _Bench(monkeypatch)
    with pytest.raises(ValueError) as err:
        ab.main(_args(*argv))
    assert str(err.value) == message and bench.calls == [] and bench.checked == []


def test_main_checks_the_plot_and_output_file_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from oea.bench.serve import ab

    bench = _Bench(monkeypatch)
    with pytest.raises(ValueError, match="--plot"):
        ab.main(_args("--base-url", "http://h:1", "--plot", str(tmp_path / "ab.txt")))
    with pytest.raises(ValueError) as err:
        ab.main(_args("--base-url", "http://h:1", "--output-file", str(tmp_path)))
    assert str(err.value) == f"--output-file {tmp_path}: is a folder; give a file name"
    with pytest.raises(ValueError) as err:
        ab.main(_args("--base-url", "http://h:1", "--plot", str(tmp_path)))
    assert str(err.value) == f"--plot {tmp_path}: is a folder; give a file name"
    assert bench.calls == []


def test_main_in_restart_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    from oea.bench.serve import ab

    bench = _Bench(monkeypatch)
    out = tmp_path / "runs" / "rows.jsonl"
    args = _args("--serve-arm", "off=", "--serve-arm", "k3=OEA_K0=3", "--serve-arm-args", "k3=--spec 1",
                 "--output-file", str(out), "--python", "/py", "--health-timeout", "7", "--server-nice", "-3",
                 "--max-load", "4", "--load-wait", "9", "--engine", "sglang", "--rounds", "2", "--no-progress",
                 "--", "--model-path", "m")
    assert ab.main(args) == 0
    ((kind, a, kw),) = bench.calls
    assert kind == "restart"
    assert a[:2] == ({"off": {}, "k3": {"OEA_K0": "3"}}, ["--", "--model-path", "m"])
    assert a[2].rounds == 2 and a[3:] == (out.parent, out, "/py", 7.0)
    assert kw == {"progress": False, "server_nice": -3, "first_round": 0, "max_load": 4.0, "load_wait": 9.0,
                  "engine": "sglang", "arm_args": {"k3": ["--spec", "1"]}}
    assert "k3" in capsys.readouterr().out
    bench.calls.clear()
    assert ab.main(_args("--serve-arm", "off=", "--engine-metrics-dir", str(tmp_path / "m"), "--", "x")) == 0
    assert bench.calls[0][1][3] == tmp_path / "m" and bench.calls[0][1][4] is None
    assert bench.calls[0][2]["progress"] is True and bench.calls[0][2]["arm_args"] == {}
    bench.calls.clear()
    monkeypatch.chdir(tmp_path)
    assert ab.main(_args("--serve-arm", "off=", "--", "x")) == 0
    assert bench.calls[0][1][3] == Path("oea-bench-serve")


def test_main_extending_an_ab_summarises_every_round_in_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from oea.bench.serve import ab

    _Bench(monkeypatch)
    out = tmp_path / "rows.jsonl"
    earlier = [_row("off", 4, 9, 50.0), _row("k3", 4, 9, 5.0)]
    out.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    assert ab.main(_args("--serve-arm", "off=", "--first-round", "9", "--output-file", str(out), "--json",
                         "--", "x")) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == earlier  # the file's rows, not only this run's
    assert ab.main(_args("--serve-arm", "off=", "--first-round", "9", "--json", "--", "x")) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == _rows()


def test_main_plots_with_a_title_of_the_request_mix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from oea.bench.serve import ab, summary

    _Bench(monkeypatch)
    plots: list[tuple[Any, str, str]] = []
    monkeypatch.setattr(summary, "plot_ab", lambda ab_rows, path, title: plots.append((ab_rows, path, title)))
    ab.main(_args("--base-url", "http://h:1", "--plot", str(tmp_path / "a.png"), "--random-input-len", "64",
                  "--random-output-len", "32", "--text-input-chars", "99", "--seed", "2", "--baseline-arm", "k3"))
    ab.main(_args("--base-url", "http://h:1", "--plot", str(tmp_path / "b.png"), "--dataset", "text",
                  "--text-input-chars", "99", "--random-input-len", "64", "--random-output-len", "32"))
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    ab.main(_args("--summarize", str(path), "--plot", str(tmp_path / "c.png")))
    assert [(p[1], p[2]) for p in plots] == [(str(tmp_path / "a.png"), "random in=64 out=32 tokens"),
                                             (str(tmp_path / "b.png"), "text in=99 chars out=32 tokens"),
                                             (str(tmp_path / "c.png"), "ab.jsonl")]
    assert plots[0][0] == summary.ab_summary(_rows(), baseline="k3", seed=2)
    assert plots[2][0] == summary.ab_summary(_rows(), baseline=None, seed=0)


def test_main_summarize_writes_nothing_and_needs_no_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from oea.bench.serve import ab

    bench = _Bench(monkeypatch)
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert ab.main(_args("--summarize", str(path), "--json")) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == _rows()
    assert bench.calls == [] and bench.checked == [] and sorted(tmp_path.iterdir()) == [path]


def test_summarize_accepts_rows_with_exactly_the_needed_fields(tmp_path: Path) -> None:
    from oea.bench.serve.ab import summarized_rows

    row = {"arm": "off", "max_concurrency": 1, "round": 0, "output_throughput": 10.0, "mean_tpot_ms": 5.0,
           "mean_ttft_ms": 20.0}
    path = tmp_path / "ab.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert summarized_rows(_args("--summarize", str(path))) == [row]


def test_a_decode_step_period_under_a_millisecond_counts() -> None:
    from oea.bench.serve.ab import engine_summary

    out = engine_summary([_step(1.0, pid=1, step=1), _step(1.0005, pid=1, step=2)], 0.0, 10.0)
    assert out["engine_step_ms_median"] == pytest.approx(0.5)


def test_main_summarises_with_the_seed_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from oea.bench.serve import ab
    from oea.bench.serve.summary import ab_summary

    rows = [_row(a, 4, r, t * (1.0 + 0.37 * ((r * 7 + len(a)) % 11) / 10)) for r in range(12)
            for a, t in (("off", 10.0), ("k3", 8.0))]
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ab_summary(rows, seed=7) != ab_summary(rows, seed=0)  # the bootstrap's intervals follow the seed
    assert ab.main(_args("--summarize", str(path), "--seed", "7", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["ab"] == json.loads(json.dumps(ab_summary(rows, seed=7)))
