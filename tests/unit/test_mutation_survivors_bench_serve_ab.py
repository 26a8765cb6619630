"""``oea bench serve``'s parser (``oea.bench.serve.cli``) and A/B driver (``oea.bench.serve.ab``) at the edges the
generated mutants of ``make mutation`` found unguarded (docs/testing.md, "Generated mutants").

The parser: every flag's default, type, choices, count and help as ``oea bench serve --help`` shows them, and the
handler handing the parsed flags to ``ab.main``. The driver: the arms from the command line and their errors, the
restart-mode round order and files, the engine summary of a round, and ``main``'s checks and output, with stand-ins
for the benchmark and the servers (no request is sent)."""

from __future__ import annotations

import argparse
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
