"""``oea bench serve``'s engine detection and A/B summary at the edges the generated mutants of ``make mutation``
found unguarded (docs/testing.md, "Generated mutants").

Engine detection: a flag written ``--flag=value`` whose value holds ``=``, the ``--engine`` error's words, a base
URL with a trailing slash, answers that are not a list of model objects, a server that answers late, and proxy
variables that must not reroute the loopback probe. The summary (``oea.bench.serve.summary``): ``--json``'s
per-arm ranges, the seed, which metrics get ratios and paired differences, the table cell by cell and the plot."""

from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from fake_servers import QuietHandler, serving

from oea.bench.serve.engines import check_engine, detect_engine, served_engine


def models_handler(status: int, body: Any, hold: threading.Event | None = None) -> type[BaseHTTPRequestHandler]:
    """A server whose ``GET /v1/models`` (that path only: anything else is a 404) answers ``status`` with ``body``
    as JSON, once ``hold`` is set (bounded at 30 s) when one is given."""

    class Models(QuietHandler):
        def do_GET(self) -> None:
            if hold is not None:
                hold.wait(30)
            self.send_json(body, status=status if self.path == "/v1/models" else 404)

    return Models


def test_a_flag_given_with_equals_is_named_by_what_comes_before_the_first_equals() -> None:
    assert detect_engine(["--model-path=/models/a=b"]) == "sglang"
    assert detect_engine(["--model=/models/--model-path=b"]) == "vllm"


def test_an_unknown_engine_is_refused_naming_the_flag_the_choices_and_the_value() -> None:
    assert check_engine(None) is None and check_engine("sglang") == "sglang"
    with pytest.raises(ValueError) as refused:
        check_engine("tgi")
    assert str(refused.value) == "--engine must be one of vllm, sglang, got 'tgi'"


def test_a_base_url_with_a_trailing_slash_asks_the_same_path() -> None:
    with serving(models_handler(200, {"data": [{"id": "m", "owned_by": "vLLM "}]})) as url:
        assert served_engine(url + "/") == "vllm"
        assert served_engine(url) == "vllm"


@pytest.mark.parametrize(("status", "body"), [
    (500, {"data": [{"owned_by": "vllm"}]}),  # an error answer says nothing, whatever its body
    (200, {"data": []}),
    (200, {"data": ["vllm"]}),
    (200, {"data": [{"id": "m"}]}),
    (200, {"object": "list"}),
    (200, ["vllm"]),
])
def test_an_answer_that_names_no_owner_is_unknown(status: int, body: Any) -> None:
    with serving(models_handler(status, body)) as url:
        assert served_engine(url) == "unknown"


def test_a_server_that_answers_after_the_timeout_is_unknown() -> None:
    """The answer is held until the probe has returned: "unknown" proves the probe gave up at its timeout (a
    probe that waited for the answer would wait the hold's 30 s, then say "sglang"), with no clock to assume."""
    answer = threading.Event()
    with serving(models_handler(200, {"data": [{"owned_by": "sglang"}]}, hold=answer)) as url:
        try:
            assert served_engine(url, timeout=0.3) == "unknown"
        finally:
            answer.set()
        assert served_engine(url, timeout=10.0) == "sglang"


def test_the_probe_ignores_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with serving(models_handler(200, {"data": [{"owned_by": "vllm"}]})) as url:
        assert served_engine(url) == "vllm"


def test_the_default_timeout_is_five_seconds_without_the_environments_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    calls: list[dict[str, Any]] = []

    def get(url: str, **kwargs: Any) -> Any:
        calls.append({"url": url, **kwargs})
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(httpx, "get", get)
    assert served_engine("http://127.0.0.1:9/") == "unknown"
    assert calls == [{"url": "http://127.0.0.1:9/v1/models", "timeout": 5.0, "trust_env": False}]


# ---------------------------------------------------------------- the serving A/B summary (``oea.bench.serve.summary``)


def _serve_row(arm: str, conc: int, rnd: int, tpot: float, **extra: Any) -> dict[str, Any]:
    return {"arm": arm, "max_concurrency": conc, "round": rnd, "median_tpot_ms": tpot, "median_itl_ms": tpot,
            "mean_tpot_ms": tpot, "mean_ttft_ms": 5.0, "output_throughput": 1000.0 / tpot, **extra}


def test_summarize_gives_each_arm_and_concurrency_the_median_and_range_over_rounds() -> None:
    """``--json``'s ``summary``: per (max_concurrency, arm), ordered by concurrency then arm name, the median and
    min..max over rounds of output tok/s and mean TPOT (rounds whose TPOT is NaN left out) and the median TTFT."""
    from oea.bench.serve.summary import summarize

    nan = float("nan")
    rows = [  # 'b' before 'a' and 16 before 2 in the file: the order is by concurrency, then arm
        {"arm": "b", "max_concurrency": 16, "output_throughput": 30.0, "mean_tpot_ms": 9.0, "mean_ttft_ms": 1.0},
        {"arm": "b", "max_concurrency": 16, "output_throughput": 10.0, "mean_tpot_ms": nan, "mean_ttft_ms": 7.0},
        {"arm": "b", "max_concurrency": 16, "output_throughput": 11.0, "mean_tpot_ms": 1.0, "mean_ttft_ms": 2.0},
        {"arm": "b", "max_concurrency": 16, "output_throughput": 99.0, "mean_tpot_ms": 2.0, "mean_ttft_ms": 3.0},
        {"arm": "a", "max_concurrency": 16, "output_throughput": 5.0, "mean_tpot_ms": nan, "mean_ttft_ms": 4.0},
        {"arm": "b", "max_concurrency": 2, "output_throughput": 1.0, "mean_tpot_ms": 1.0, "mean_ttft_ms": 1.0},
        {"arm": "c", "max_concurrency": 2, "output_throughput": 1.0, "mean_tpot_ms": 1.0, "mean_ttft_ms": 1.0},
        {"arm": "a", "max_concurrency": 2, "output_throughput": 1.0, "mean_tpot_ms": 1.0, "mean_ttft_ms": 1.0},
    ]
    out = summarize(rows)
    assert [(s["max_concurrency"], s["arm"]) for s in out] == [(2, "a"), (2, "b"), (2, "c"), (16, "a"), (16, "b")]
    b16 = out[-1]
    assert b16 == {"arm": "b", "max_concurrency": 16, "rounds": 4,
                   "output_throughput_median": 20.5, "output_throughput_min": 10.0, "output_throughput_max": 99.0,
                   "mean_tpot_ms_median": 2.0, "mean_tpot_ms_min": 1.0, "mean_tpot_ms_max": 9.0,
                   "mean_ttft_ms_median": 2.5}
    a16 = out[-2]  # its only round has no TPOT: NaN, not an error
    assert a16["rounds"] == 1 and a16["output_throughput_median"] == 5.0 and a16["mean_ttft_ms_median"] == 4.0
    assert all(math.isnan(a16[f"mean_tpot_ms_{stat}"]) for stat in ("median", "min", "max"))


def _printed_table(monkeypatch: pytest.MonkeyPatch, summary: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``print_ab_table`` hands rich: the console's width, the title, caption, headers, justification and
    cells (row by row) of its table; the printing itself still happens."""
    from rich.console import Console

    from oea.bench.serve.summary import print_ab_table

    seen: list[tuple[int, Any]] = []
    original = Console.print

    def record(self: Console, *objects: Any, **kwargs: Any) -> None:
        seen.append((self.width, objects[0]))
        original(self, *objects, **kwargs)

    monkeypatch.setattr(Console, "print", record)
    print_ab_table(summary)
    [(width, table)] = seen
    return {"width": width, "title": table.title, "caption": table.caption,
            "headers": [c.header for c in table.columns], "justify": {c.justify for c in table.columns},
            "rows": [list(row) for row in zip(*(c._cells for c in table.columns), strict=True)]}


def _entry(arm: str, **fields: Any) -> dict[str, Any]:
    return {"arm": arm, "max_concurrency": 16, "rounds": 3, "baseline": "off", **fields}


_FIGURES = {"median_tpot_ms": 100.04, "median_tpot_ms_ci": [90.0, 110.0], "median_itl_ms": 50.0,
            "median_itl_ms_ci": [40.0, 60.0], "output_throughput": 1234.56, "output_throughput_ci": [1200.0, 1300.0]}
_SPEC = {"spec_acceptance_rate": 0.7, "spec_acceptance_rate_ci": [0.65, 0.75], "spec_mean_accepted_length": 3.1,
         "spec_mean_accepted_length_ci": [3.0, 3.2]}
_ENGINE = {"engine_active_experts": 24.04, "engine_routing_us_per_call": 199.6, "engine_step_ms_median": 99.96,
           "engine_routing_share_step": 0.004}
_COMMON_COLUMNS = ["c", "arm", "rounds", "median TPOT ms", "TPOT ratio", "pairs", "median ITL ms", "out tok/s",
                   "tok/s ratio"]
_ENGINE_COLUMNS = ["active experts", "routing µs/call", "step ms", "routing share/step"]


def test_the_ab_table_has_every_column_and_cell_where_its_header_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """The A/B table, cell by cell: a figure with its interval, ``–`` where an entry lacks it, ratios with the rounds
    they pair (``–`` for the baseline, ``0 (unpaired)`` and ``(no CI)`` where fewer than two rounds are common, and
    then the caption), the speculation columns (verify steps with the rewritten ones, 0 when not counted), the
    engine columns; right-justified, 200 characters wide."""
    summary = [
        _entry("off", **_FIGURES, **_SPEC, **_ENGINE, engine_active_experts_stock=48.0, engine_verify_steps=50),
        _entry("k3", **_FIGURES, **_SPEC, **_ENGINE, median_tpot_ms_ratio=0.7, median_tpot_ms_ratio_ci=[0.65, 0.75],
               median_tpot_ms_ratio_pairs=3, output_throughput_ratio=1.4286, output_throughput_ratio_ci=[1.3, 1.5],
               spec_acceptance_rate_diff=0.05, spec_acceptance_rate_diff_ci=[-0.01, 0.06], engine_verify_steps=60,
               engine_verify_steps_rewritten=59),
        _entry("k5", rounds=1, median_tpot_ms=80.0, median_tpot_ms_ci=[80.0, 80.0], median_tpot_ms_ratio=0.8,
               median_tpot_ms_ratio_ci=None, median_tpot_ms_ratio_pairs=0, median_tpot_ms_ratio_note="no interval"),
    ]
    printed = _printed_table(monkeypatch, summary)
    assert printed["width"] == 200 and printed["justify"] == {"right"}
    assert printed["title"] == ("serving A/B (medians over rounds, 95% CI; ratios vs 'off', paired by round; engine "
                                "columns: means over rounds)")
    assert printed["caption"] == ("(no CI): fewer than 2 rounds in common with the baseline arm, so no interval; "
                                  "that ratio is of all rounds' medians, unpaired")
    assert printed["headers"] == [*_COMMON_COLUMNS, "acceptance", "Δ acceptance", "mean acc. length",
                                  "verify steps (rewritten)", *_ENGINE_COLUMNS]
    figures = ["100.0 [90.0–110.0]", "50.0 [40.0–60.0]", "1234.6 [1200.0–1300.0]"]
    spec = ["0.700 [0.650–0.750]", "3.10 [3.00–3.20]"]
    engine = ["200", "100.0", "0.40%"]
    assert printed["rows"] == [
        ["16", "off", "3", figures[0], "–", "–", figures[1], figures[2], "–", spec[0], "–", spec[1], "50 (0)",
         "24.0 (48.0)", *engine],
        ["16", "k3", "3", figures[0], "0.700 [0.650–0.750]", "3 rounds", figures[1], figures[2],
         "1.429 [1.300–1.500]", spec[0], "+0.050 [-0.010–+0.060]", spec[1], "60 (59)", "24.0", *engine],
        ["16", "k5", "1", "80.0 [80.0–80.0]", "0.800 (no CI)", "0 (unpaired)", "–", "–", "–", "–", "–", "–", "–",
         "–", "–", "–", "–"],
    ]


def test_a_one_arm_table_has_no_ratio_title_and_no_speculation_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    printed = _printed_table(monkeypatch, [_entry("off", **_FIGURES), _entry("off", max_concurrency=32)])
    assert printed["title"] == "serving (medians over rounds, 95% CI; engine columns: means over rounds)"
    assert printed["caption"] is None
    assert printed["headers"] == [*_COMMON_COLUMNS, *_ENGINE_COLUMNS]
    assert printed["rows"][1] == ["32", "off", "3", *["–"] * 10]
    two = _printed_table(monkeypatch, [_entry("off", **_FIGURES), _entry("k3", **_FIGURES)])
    assert two["title"].startswith("serving A/B (") and two["caption"] is None


def test_non_finite_figures_print_as_python_writes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """``inf`` and ``nan`` in lower case in every formatted cell (a rate or length the engine could not give)."""
    inf, nan = float("inf"), float("nan")
    fields = {key: inf for key in ("median_tpot_ms", "median_tpot_ms_ratio", "median_itl_ms", "output_throughput",
                                   "output_throughput_ratio", "spec_acceptance_rate", "spec_mean_accepted_length",
                                   "spec_acceptance_rate_diff")}
    fields |= {f"{key}_ci": [nan, inf] for key in fields}
    [row] = _printed_table(monkeypatch, [_entry("k3", **fields, median_tpot_ms_ratio_pairs=2)])["rows"]
    assert row[3:] == ["inf [nan–inf]", "inf [nan–inf]", "2 rounds", "inf [nan–inf]", "inf [nan–inf]",
                       "inf [nan–inf]", "inf [nan–inf]", "+inf [+nan–+inf]", "inf [nan–inf]", "–", "–", "–", "–", "–"]


def _plotted(monkeypatch: pytest.MonkeyPatch, summary: list[dict[str, Any]], path: Any, **kwargs: Any) -> Any:
    """``plot_ab``'s figure (kept from its ``savefig``; the PNG is still written) and the PNG's width and height."""
    from matplotlib.figure import Figure

    from oea.bench.serve.summary import plot_ab

    figures: list[Figure] = []
    original = Figure.savefig

    def record(self: Figure, *args: Any, **kw: Any) -> None:
        figures.append(self)
        original(self, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", record)
    assert plot_ab(summary, path, **kwargs) == path
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    [figure] = figures
    return figure, (int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big"))


def _bars(ax: Any) -> dict[str, dict[str, Any]]:
    """Each arm's error-bar line in ``ax``: points, bar ends, marker, colour, cap size."""
    out = {}
    for container in ax.containers:
        line, caps, bars = container.lines
        out[container.get_label()] = {
            "x": list(line.get_xdata()), "y": [float(v) for v in line.get_ydata()], "marker": line.get_marker(),
            "color": line.get_color(), "caps": sorted({c.get_markersize() for c in caps}),
            "bars": [[float(seg[0][1]), float(seg[1][1])] for bar in bars for seg in bar.get_segments()]}
    return out


def test_the_ab_plot_draws_each_arm_with_its_intervals_in_side_by_side_panels(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three panels side by side (15 x 4.2 in at 110 dpi: 1650 x 462 px) against max concurrency on a log2 axis:
    median TPOT, output tok/s and the TPOT ratio with a line at 1; one line per arm in its own colour, bars the 95%
    intervals (none where a ratio has no interval), a legend, a grid, the title above; drawn with Agg, then closed."""
    import matplotlib
    import matplotlib.pyplot as plt

    summary = [
        _entry("off", max_concurrency=1, median_tpot_ms=10.0, median_tpot_ms_ci=[9.0, 12.0], output_throughput=100.0,
               output_throughput_ci=[90.0, 101.0]),
        _entry("off", max_concurrency=4, median_tpot_ms=20.0, median_tpot_ms_ci=[19.0, 23.0], output_throughput=200.0,
               output_throughput_ci=[150.0, 260.0]),
        _entry("k3", max_concurrency=1, median_tpot_ms=7.0, median_tpot_ms_ci=[6.0, 8.5], output_throughput=140.0,
               output_throughput_ci=[130.0, 141.0], median_tpot_ms_ratio=0.7, median_tpot_ms_ratio_ci=[0.6, 0.75]),
        _entry("k3", max_concurrency=4, median_tpot_ms=15.0, median_tpot_ms_ci=[14.0, 15.5], output_throughput=250.0,
               output_throughput_ci=[240.0, 270.0], median_tpot_ms_ratio=0.75, median_tpot_ms_ratio_ci=None),
        _entry("k5", max_concurrency=4, output_throughput=300.0, output_throughput_ci=[280.0, 330.0]),  # no TPOT
    ]
    before = set(plt.get_fignums())
    figure, pixels = _plotted(monkeypatch, summary, tmp_path / "ab.png", title="the run")
    assert set(plt.get_fignums()) == before, "the figure is closed"
    assert matplotlib.get_backend() == "Agg"
    assert tuple(figure.get_size_inches()) == pytest.approx((15.0, 4.2)) and pixels == (1650, 462)
    assert figure._suptitle is not None and figure._suptitle.get_text() == "the run"
    axes = figure.axes
    positions = [ax.get_position() for ax in axes]
    assert len(axes) == 3 and len({round(p.y0, 6) for p in positions}) == 1
    assert positions[0].x1 <= positions[1].x0 and positions[1].x1 <= positions[2].x0
    assert [ax.get_ylabel() for ax in axes] == ["median TPOT (ms)", "output throughput (tok/s)", "TPOT / baseline TPOT"]
    for ax in axes:
        assert ax.get_xlabel() == "max concurrency"
        assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
        grid = ax.xaxis.get_gridlines()[0]
        assert grid.get_visible() and grid.get_alpha() == 0.3
    off, k3, k5 = ({"marker": "o", "caps": [6.0], "color": f"C{i}"} for i in range(3))
    assert _bars(axes[0]) == {"off": {**off, "x": [1, 4], "y": [10.0, 20.0], "bars": [[9.0, 12.0], [19.0, 23.0]]},
                              "k3": {**k3, "x": [1, 4], "y": [7.0, 15.0], "bars": [[6.0, 8.5], [14.0, 15.5]]}}
    assert _bars(axes[1]) == {
        "off": {**off, "x": [1, 4], "y": [100.0, 200.0], "bars": [[90.0, 101.0], [150.0, 260.0]]},
        "k3": {**k3, "x": [1, 4], "y": [140.0, 250.0], "bars": [[130.0, 141.0], [240.0, 270.0]]},
        "k5": {**k5, "x": [4], "y": [300.0], "bars": [[280.0, 330.0]]}}
    assert _bars(axes[2]) == {"k3": {**k3, "x": [1, 4], "y": [0.7, 0.75], "bars": [[0.6, 0.75], [0.75, 0.75]]}}
    assert [[t.get_text() for t in ax.get_legend().get_texts()] for ax in axes] == [["off", "k3"],
                                                                                   ["off", "k3", "k5"], ["k3"]]
    [one] = [line for line in axes[2].lines if list(line.get_ydata()) == [1.0, 1.0]]
    assert one.get_color() == "grey" and one.get_linewidth() == 0.8
    assert not any(list(line.get_ydata()) == [1.0, 1.0] for ax in axes[:2] for line in ax.lines)


def test_a_one_arm_plot_has_two_panels_no_title_and_every_arm_its_own_colour(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    one = [_entry("off", max_concurrency=c, median_tpot_ms=10.0, median_tpot_ms_ci=[9.0, 11.0],
                  output_throughput=100.0, output_throughput_ci=[90.0, 110.0]) for c in (1, 2)]
    figure, pixels = _plotted(monkeypatch, one, tmp_path / "one.png")
    assert len(figure.axes) == 2 and pixels == (1100, 462) and figure._suptitle is None
    twelve = [_entry(f"a{i}", max_concurrency=1, output_throughput=1.0 + i, output_throughput_ci=[1.0, 20.0])
              for i in range(12)]  # colours cycle after ten arms
    figure, _ = _plotted(monkeypatch, twelve, tmp_path / "twelve.png")
    colours = {arm: bar["color"] for arm, bar in _bars(figure.axes[1]).items()}
    assert colours == {f"a{i}": f"C{i % 10}" for i in range(12)}


def test_the_summary_is_reproducible_from_its_seed_and_the_default_seed_is_0() -> None:
    """Same rows, same seed: the same intervals (medians and paired ratios); no seed is seed 0."""
    from oea.bench.serve.summary import ab_summary

    tpots = [100.0 + (37 * r) % 41 for r in range(30)]  # 30 distinct rounds: many possible medians
    rows = [_serve_row("off", 8, r, t) for r, t in enumerate(tpots)]
    rows += [_serve_row("k3", 8, r, t * (0.6 + 0.01 * (r % 7))) for r, t in enumerate(tpots)]
    seeded = ab_summary(rows, seed=0)
    k3 = next(e for e in seeded if e["arm"] == "k3")
    assert k3["median_tpot_ms_ratio_ci"][0] < k3["median_tpot_ms_ratio_ci"][1], "an interval the seed moves"
    assert ab_summary(rows) == seeded and ab_summary(rows, seed=0) == seeded
    assert ab_summary(rows, seed=1) != seeded
    assert ab_summary(rows, seed=5) == ab_summary(rows, seed=5)


def test_every_arm_and_metric_is_summarised_and_only_the_acceptance_rate_gets_a_paired_difference() -> None:
    """An arm missing at one concurrency does not hide the arms after it; the baseline gets every metric (no
    ratio); a metric the baseline lacks gets no ratio but the later metrics still do; ``spec_acceptance_rate``
    alone gets ``_diff`` / ``_diff_ci``, from exactly two common rounds on (the mean paired difference)."""
    from oea.bench.serve.summary import ab_summary

    spec = [{"spec_acceptance_rate": 0.6, "spec_mean_accepted_length": 2.0},
            {"spec_acceptance_rate": 0.8, "spec_mean_accepted_length": 3.0}]
    rows = [_serve_row("off", 4, r, 100.0 + r, **spec[r]) for r in range(2)]
    rows += [_serve_row("k3", 4, r, 70.0 + r, spec_acceptance_rate=spec[r]["spec_acceptance_rate"] - 0.1 * (r + 1),
                        spec_mean_accepted_length=2.5) for r in range(2)]
    rows += [_serve_row("k5", 4, 0, 60.0, spec_mean_accepted_length=2.0),  # one common round
             _serve_row("k5", 4, 1, 61.0, spec_mean_accepted_length=2.0)]
    rows += [_serve_row("off", 1, 0, 10.0), _serve_row("k5", 1, 0, 9.0)]  # k3 did not run at concurrency 1
    rows += [_serve_row("k9", 2, 0, 9.0, spec_acceptance_rate=0.5), _serve_row("off", 2, 0, 10.0),
             _serve_row("k9", 2, 1, 9.5, spec_acceptance_rate=0.5), _serve_row("off", 2, 1, 11.0)]
    summary = ab_summary(rows, baseline="off")
    assert [(e["max_concurrency"], e["arm"]) for e in summary] == [(1, "off"), (1, "k5"), (2, "off"), (2, "k9"),
                                                                  (4, "off"), (4, "k3"), (4, "k5")]
    figures = ("median_tpot_ms", "median_itl_ms", "output_throughput", "mean_tpot_ms")
    spec_figures = ("spec_acceptance_rate", "spec_mean_accepted_length")
    per_round = {f"{m}{suffix}" for m in (*figures, *spec_figures) for suffix in ("", "_ci", "_rounds")}
    ratios = {f"{m}{suffix}" for m in (*figures, *spec_figures) for suffix in ("_ratio", "_ratio_ci", "_ratio_pairs")}
    entry = {(e["max_concurrency"], e["arm"]): e for e in summary}
    frame = {"arm", "max_concurrency", "rounds", "baseline"}
    assert set(entry[4, "off"]) == frame | per_round
    assert set(entry[4, "k3"]) == frame | per_round | ratios | {"spec_acceptance_rate_diff",
                                                                "spec_acceptance_rate_diff_ci"}
    assert entry[4, "k3"]["spec_acceptance_rate_diff"] == pytest.approx(-0.15)  # (-0.1 - 0.2) / 2
    assert entry[4, "k3"]["spec_mean_accepted_length_ratio"] == pytest.approx(1.0)  # 2.5 / median(2, 3)
    k9 = entry[2, "k9"]  # the baseline has no acceptance rate here: no ratio, the later metrics go on
    assert "spec_acceptance_rate" in k9
    assert not {"spec_acceptance_rate_ratio", "spec_acceptance_rate_ratio_ci", "spec_acceptance_rate_diff"} & set(k9)
    assert {f"{m}_ratio" for m in figures} <= set(k9)
    assert set(entry[1, "k5"]) >= {"median_tpot_ms_ratio", "median_tpot_ms_ratio_note"}



def test_step_counts_sum_the_rounds_that_have_them() -> None:
    """A round without an engine count (its metrics file had no such steps) adds nothing to the arm's sum; an arm
    none of whose rounds has it gets no count at all."""
    from oea.bench.serve.summary import ab_summary

    rows = [_serve_row("off", 4, 0, 10.0, engine_verify_steps=7), _serve_row("off", 4, 1, 10.0),
            _serve_row("off", 4, 2, 10.0, engine_verify_steps=5, engine_decode_steps=2), _serve_row("k3", 4, 0, 9.0)]
    off, k3 = ab_summary(rows, baseline="off")
    assert (off["engine_verify_steps"], off["engine_decode_steps"]) == (12, 2)
    assert "engine_verify_steps_rewritten" not in off
    assert not any(key.startswith("engine_") for key in k3)


# ---------------------------------------------------------------- vLLM's speculative-decoding counters per round


_COUNTER_PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0"} not-a-number
vllm:num_requests_running{engine="0"} 3.0
vllm:spec_decode_num_drafts_total{engine="0"} 40.0
vllm:spec_decode_num_drafts_total{engine="1"} 2.5
vllm:spec_decode_num_draft_tokens_total 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 90.0
"""


def test_counters_skip_comments_other_series_and_unparsable_values_and_read_on() -> None:
    from oea.bench.serve.engine_counters import parse_spec_counters

    assert parse_spec_counters(_COUNTER_PAGE) == {"num_drafts": 42.5, "num_draft_tokens": 120.0,
                                                  "num_accepted_tokens": 90.0}
    assert parse_spec_counters('vllm:spec_decode_num_drafts_total{engine="0"} 7.0\n') == {"num_drafts": 7.0}


@pytest.mark.parametrize(("answer", "expected"), [
    ((200, _COUNTER_PAGE), {"num_drafts": 42.5, "num_draft_tokens": 120.0, "num_accepted_tokens": 90.0}),
    ((404, _COUNTER_PAGE), {}),  # an error page is never read, whatever it holds
    ((200, "vllm:num_requests_running 3\n"), {}),
    (None, {}),  # nothing listens
])
def test_a_scrape_asks_metrics_without_the_environments_proxies_and_reads_only_a_200(
        monkeypatch: pytest.MonkeyPatch, answer: tuple[int, str] | None, expected: dict[str, float]) -> None:
    import httpx

    from oea.bench.serve.engine_counters import scrape

    calls: list[dict[str, Any]] = []

    class Response:
        status_code, text = answer or (0, "")

    def get(url: str, **kwargs: Any) -> Any:
        calls.append({"url": url, **kwargs})
        if answer is None:
            raise httpx.ConnectError("refused")
        return Response()

    monkeypatch.setattr(httpx, "get", get)
    assert scrape("http://127.0.0.1:9/") == expected
    assert scrape("http://127.0.0.1:9", timeout=2.5) == expected
    assert calls == [{"url": "http://127.0.0.1:9/metrics", "timeout": 10.0, "trust_env": False},
                     {"url": "http://127.0.0.1:9/metrics", "timeout": 2.5, "trust_env": False}]


def test_a_round_needs_all_three_counters_in_both_scrapes() -> None:
    from oea.bench.serve.engine_counters import round_fields

    full = {"num_drafts": 10.0, "num_draft_tokens": 30.0, "num_accepted_tokens": 12.0}
    later = {"num_drafts": 14.0, "num_draft_tokens": 42.0, "num_accepted_tokens": 21.0}
    partial = {"num_drafts": 10.0, "num_draft_tokens": 30.0}
    assert round_fields(partial, later) == {} and round_fields(full, partial) == {}
    assert round_fields(full | {"other": 1.0}, later) == {} and round_fields(full, later | {"other": 1.0}) == {}
    assert round_fields(full, later) == {"spec_drafts": 4, "spec_draft_tokens": 12, "spec_accepted_tokens": 9,
                                         "spec_acceptance_rate": 0.75, "spec_mean_accepted_length": 3.25}
    one = round_fields(full, {"num_drafts": 11.0, "num_draft_tokens": 31.0, "num_accepted_tokens": 13.0})
    assert (one["spec_acceptance_rate"], one["spec_mean_accepted_length"]) == (1.0, 2.0)  # one draft of one token


# ---------------------------------------------------------------- prompts (``oea.bench.serve.prompts``)


def test_random_prompts_have_the_lengths_and_token_ids_asked_for() -> None:
    """Without ``range_ratio`` every prompt has exactly ``input_len`` token ids and ``max_tokens`` of
    ``output_len``; with one, lengths span [len * ratio, len] (at least 1); ids lie in ``token_range``
    (default [16, 4000))."""
    from oea.bench.serve.prompts import RANDOM_TOKEN_RANGE, random_prompts

    exact = random_prompts(20, 9, 4, seed=1)
    assert len(exact) == 20 and all(len(p.prompt) == 9 and p.output_len == 4 for p in exact)
    ids = [t for p in exact for t in p.prompt]
    assert RANDOM_TOKEN_RANGE == (16, 4000) and min(ids) >= 16 and max(ids) < 4000 and len(set(ids)) > 100
    assert {t for p in random_prompts(5, 6, 2, seed=0, token_range=(7, 8)) for t in p.prompt} == {7}
    spread = random_prompts(300, 4, 6, seed=2, range_ratio=0.5)
    assert {len(p.prompt) for p in spread} == {2, 3, 4} and {p.output_len for p in spread} == {3, 4, 5, 6}
    tiny = random_prompts(50, 3, 1, seed=0, range_ratio=0.01)  # 3 * 0.01 rounds to 0: lengths from 1
    assert {len(p.prompt) for p in tiny} == {1, 2, 3} and {p.output_len for p in tiny} == {1}
    assert [len(p.prompt) for p in random_prompts(3, 1, 1, seed=0, range_ratio=1.0)] == [1, 1, 1]


@pytest.mark.parametrize(("args", "message"), [
    ((0, 4, 1.0), "--random-input-len and --random-output-len must be >= 1, got 0, 4"),
    ((4, 0, 1.0), "--random-input-len and --random-output-len must be >= 1, got 4, 0"),
    ((4, 4, 0.0), "--random-range-ratio must be in (0, 1], got 0.0"),
    ((4, 4, 1.5), "--random-range-ratio must be in (0, 1], got 1.5"),
])
def test_random_prompts_refuse_what_the_flags_cannot_mean(args: tuple[int, int, float], message: str) -> None:
    from oea.bench.serve.prompts import random_prompts

    input_len, output_len, ratio = args
    with pytest.raises(ValueError) as refused:
        random_prompts(1, input_len, output_len, seed=0, range_ratio=ratio)
    assert str(refused.value) == message


def test_text_prompts_are_windows_that_start_at_a_line_of_a_long_enough_document() -> None:
    from oea.bench.serve.prompts import text_prompts

    doc = "".join(f"line {i:03d} " + "x" * (i % 7) + "\n" for i in range(80))  # every line different
    other = "".join(f"LINE {i:03d}\n" for i in range(80))
    exactly = "y" * 25  # not longer than the window: never used
    prompts = text_prompts(40, input_chars=25, output_len=3, seed=0, documents=[exactly, doc, other])
    assert len(prompts) == 40 and all(p.output_len == 3 and len(p.prompt) == 25 for p in prompts)
    sources = set()
    for p in prompts:
        source = doc if p.prompt.startswith("line ") else other
        assert p.prompt.startswith(("line ", "LINE ")), p.prompt
        start = source.index(p.prompt)
        assert start == 0 or source[start - 1] == "\n"
        sources.add(source)
    assert sources == {doc, other} and len({p.prompt for p in prompts}) > 20, "windows from all over both"
    assert text_prompts(1, 25, 1, seed=0, documents=[doc]) == text_prompts(1, 25, 1, seed=0, documents=[doc])
    with pytest.raises(ValueError) as refused:
        text_prompts(1, input_chars=25, output_len=3, seed=0, documents=[exactly])
    assert str(refused.value) == "no held-out document is longer than --text-input-chars=25"
    for chars, out in ((0, 3), (25, 0)):
        with pytest.raises(ValueError) as refused:
            text_prompts(1, input_chars=chars, output_len=out, seed=0, documents=[doc])
        assert str(refused.value) == f"--text-input-chars and --random-output-len must be >= 1, got {chars}, {out}"


def test_a_text_window_can_start_at_a_documents_first_character_and_is_never_cut_short() -> None:
    """Windows start anywhere from the document's first character (here a newline: the window is that line) to the
    last start that leaves ``input_chars`` characters; a one-character window is allowed."""
    from oea.bench.serve.prompts import text_prompts

    windows = {p.prompt for p in text_prompts(40, input_chars=1, output_len=1, seed=0, documents=["\nab"])}
    assert windows == {"\n", "a"}  # starts 0 and 1; from 1 the line starts at "a"
    lines = "a\nb\nc\nd\ne\n"
    assert {p.prompt for p in text_prompts(40, input_chars=3, output_len=1, seed=0, documents=[lines])} == {
        "a\nb", "b\nc", "c\nd", "d\ne"}  # the last start (6) leaves 3 characters: never "e\n"


def test_make_prompts_hands_each_dataset_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from oea.bench.serve import prompts

    assert prompts.make_prompts("random", 4, 3, 8, 5) == prompts.random_prompts(4, 8, 5, 3)
    assert (prompts.make_prompts("random", 4, 3, 8, 5, range_ratio=0.5)
            == prompts.random_prompts(4, 8, 5, 3, range_ratio=0.5))
    doc = "".join(f"line {i:04d}\n" for i in range(200))
    monkeypatch.setattr(prompts, "heldout_texts", lambda: [doc])
    default = prompts.make_prompts("text", 3, 1, 8, 5)
    assert default == prompts.text_prompts(3, 512, 5, 1, documents=[doc]) and len(default[0].prompt) == 512
    assert prompts.make_prompts("text", 2, 1, 8, 5, input_chars=30) == prompts.text_prompts(2, 30, 5, 1, [doc])
    with pytest.raises(ValueError) as refused:
        prompts.make_prompts("sharegpt", 1, 0, 8, 5)
    assert str(refused.value) == "--dataset must be one of ('random', 'text'), got 'sharegpt'"


def test_heldout_texts_are_the_models_documents_else_the_stdlib_split(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import oea.models
    import oea.models.data
    from oea.bench.serve.prompts import heldout_texts

    held, trained = tmp_path / "held.py", tmp_path / "trained.py"
    held.write_text("held = 1\n")
    trained.write_text("trained = 1\n")
    files = [oea.models.data.StdlibFile("held.py", held), oea.models.data.StdlibFile("trained.py", trained)]
    monkeypatch.setattr(oea.models.data, "stdlib_files", lambda: files)
    monkeypatch.setattr(oea.models.data, "split_files", lambda found: (found[1:], found[:1]))
    monkeypatch.setattr(oea.models, "heldout_documents", lambda: [("a.py", "a = 1\n"), ("b.py", "b = 2\n")])
    assert heldout_texts() == ["a = 1\n", "b = 2\n"]
    monkeypatch.setattr(oea.models, "heldout_documents", lambda: [])  # an empty list: the stdlib split
    assert heldout_texts() == ["held = 1\n"]
    for error in (FileNotFoundError("heldout_files.json"), ImportError("no model")):
        def missing(error: Exception = error) -> list[tuple[str, str]]:
            raise error

        monkeypatch.setattr(oea.models, "heldout_documents", missing)
        assert heldout_texts() == ["held = 1\n"]


def test_the_ab_tables_title_names_the_baseline_of_its_first_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A summary put together by hand from two A/B runs (their own baselines): the title names the first entry's
    baseline, the one ``ab_summary`` writes into every entry of one run."""
    summary = [_entry("off", **_FIGURES), _entry("k3", baseline="k5", **_FIGURES)]
    assert "ratios vs 'off'," in _printed_table(monkeypatch, summary)["title"]
