"""``oea eval lm-eval``'s summary line shows every routing mean with its interval (lm-eval itself stubbed)."""

from __future__ import annotations

import json

import pytest

import oea.eval.lm_eval_bridge as bridge
from oea.cli import main
from oea.console import format_interval


def _fake_run(samples: bridge.StepSamples):
    def run_lm_eval(model, tasks, **kwargs):
        return {"results": {"t": {"exact_match,none": 0.5, "exact_match_stderr,none": 0.1}},
                "oea": {"policy": "oea", "k0": kwargs["k0"], "decode_only": True, "decode_steps": 5, "tokens": 20,
                        **samples.fields()}}
    return run_lm_eval


def test_every_routing_mean_is_printed_with_its_interval(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    samples = bridge.StepSamples(active=[10.0, 12.0, 11.0, 13.0, 9.0], vanilla=[20.0, 22.0, 21.0, 24.0, 19.0],
                                 per_token=[2.5, 2.75, 3.0, 2.25, 2.5])
    monkeypatch.setattr(bridge, "run_lm_eval", _fake_run(samples))
    assert main(["eval", "lm-eval", "--tasks", "t", "--k0", "2"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    fields = samples.fields()
    for key, digits in (("mean_active_experts", 1), ("mean_active_experts_vanilla", 1), ("active_vs_vanilla", 2),
                        ("mean_experts_per_token", 2)):
        assert fields[f"{key}_ci"] is not None
        assert format_interval(fields[key], fields[f"{key}_ci"], digits) in line, key
    assert "(n=1)" not in line and "95% interval" in line

    assert main(["eval", "lm-eval", "--tasks", "t", "--k0", "2", "--json"]) == 0
    routing = json.loads(capsys.readouterr().out)[0]["oea"]
    assert all(routing[f"{key}_ci"] == fields[f"{key}_ci"] for key in
               ("mean_active_experts", "mean_active_experts_vanilla", "active_vs_vanilla", "mean_experts_per_token"))
