"""``oea bench routing``: the naive yardstick is a correct OEA, and the CLI reports every shape."""

from __future__ import annotations

import json

import torch

import oea
from oea.bench.routing.run import naive_oea
from oea.cli import main


def test_naive_yardstick_matches_oea_when_the_union_is_large():
    torch.manual_seed(0)
    logits = torch.randn(16, 64) * 3
    spec = oea.RouterSpec(64, 8)
    ids, w = oea.route(logits, spec, oea.OEAConfig(3))
    n_ids, n_w = naive_oea(logits, 8, 3)
    assert int(oea.active_experts(ids, w)) >= 8  # no short rows, so the naive fallback never fires
    for i in range(16):
        assert set(ids[i].tolist()) == set(n_ids[i].tolist())
        torch.testing.assert_close(w[i].sort().values, n_w[i].sort().values)


def test_cli_json_reports_every_shape_and_the_targets(capsys):
    code = main(["bench", "routing", "--num-experts", "32", "64", "--batch-sizes", "1", "16",
                 "--repeats", "5", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    shapes = {(r["num_experts"], r["batch_size"]) for r in result["rows"]}
    assert shapes == {(32, 1), (32, 16), (64, 1), (64, 16)}
    for row in result["rows"]:
        assert row["vanilla_us"] > 0 and row["oea_us"] > 0 and row["naive_us"] > 0
        assert row["oea_vs_vanilla"] == row["oea_us"] / row["vanilla_us"]
        assert row["fast_impl"] == "numba" and row["fast_us"] > 0 and row["stock_us"] > 0
        assert row["fast_vs_vanilla"] == row["fast_us"] / row["vanilla_us"]
        assert row["fast_vs_stock"] == row["fast_us"] / row["stock_us"]
        for name in ("vanilla_us", "oea_us", "naive_us", "fast_us", "stock_us", "oea_vs_vanilla", "naive_vs_oea",
                     "fast_vs_vanilla", "fast_vs_stock"):
            low, high = row[f"{name}_ci"]  # median / ratio of medians with its bootstrap interval
            assert low <= row[name] <= high
    assert set(result["targets"]) >= {"oea_vs_vanilla_max_B>=16", "naive_vs_oea_min_B>=16",
                                      "fast_vs_vanilla_max_B>=16"}
    assert result["device"] == "cpu"


def test_cli_rejects_bad_arguments(capsys):
    assert main(["bench", "routing", "--k0", "9", "--repeats", "5", "--json"]) == 2
    assert "--k0" in capsys.readouterr().err


def test_figures_are_medians_of_the_timed_calls(monkeypatch):
    """Each variant's figure is the median of its timed calls (an outlier call does not move it), warm-up
    calls are not timed, and the ratios are ratios of those medians."""
    from oea.bench.routing import run as routing

    clock = [0]
    durations_ns = {"vanilla": [1000, 3000, 2000, 900_000, 4000], "oea": [2000, 2000, 5000, 6000, 3000],
                    "naive": [40_000, 10_000, 20_000, 30_000, 50_000], "fast": [1500, 1000, 1200, 1100, 700_000],
                    "stock": [600, 500, 400, 800, 700]}
    pool = 2

    def variant(name):
        calls = iter([10**9] * pool + durations_ns[name])  # warm-up calls take "1 s" and must not count

        def call(x):
            clock[0] += next(calls)

        return call

    monkeypatch.setattr(routing.time, "perf_counter_ns", lambda: clock[0])
    monkeypatch.setattr(routing, "_variants", lambda *args, **kwargs: {n: variant(n) for n in durations_ns})
    row = routing.measure(64, 4, 8, 2, repeats=5, seed=0, pool=pool)
    assert (row["vanilla_us"], row["oea_us"], row["naive_us"]) == (3.0, 3.0, 30.0)
    assert row["oea_vs_vanilla"] == 1.0 and row["naive_vs_oea"] == 10.0
    assert (row["fast_us"], row["stock_us"]) == (1.2, 0.6)
    assert row["fast_vs_vanilla"] == 1.2 / 3.0 and row["fast_vs_stock"] == 1.2 / 0.6


def _result(batch_sizes: list[int]) -> dict:
    from oea.bench.routing.run import run

    return run([64, 256], batch_sizes, 8, 3, repeats=5, threads=1, seed=0)


def _printed(result: dict, width: int, monkeypatch) -> str:
    import io

    from rich.console import Console

    from oea.bench.routing import run as routing

    buffer = io.StringIO()
    monkeypatch.setattr(routing, "wide_console", lambda: Console(file=buffer, width=width, force_terminal=False))
    routing._print_table(result)
    return buffer.getvalue()


def test_the_table_never_cuts_a_cell_on_a_narrow_terminal(monkeypatch):
    from oea.console import format_interval

    result = _result([16])
    for width in (80, 120):
        text = _printed(result, width, monkeypatch)
        assert "…" not in text, text
        cells = " ".join(text.split())  # a wrapped cell continues on the next line of its column
        for row in result["rows"]:
            assert f"│ {row['num_experts']} │ 16 │" in cells
        if width == 120:  # wide enough that each ratio interval stays on one line
            row = result["rows"][0]
            assert format_interval(row["oea_vs_vanilla"], row["oea_vs_vanilla_ci"], 2) in text


def test_the_table_without_a_batch_of_16_says_the_targets_were_not_measured(monkeypatch):
    text = _printed(_result([1, 4]), 200, monkeypatch)
    assert "B >= 16: not measured" in text
