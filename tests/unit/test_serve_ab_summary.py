"""Serving A/B additions: the A/B summary (medians over rounds, ratios paired by round), engine step time and
routing share, rotated arm order in restart mode, load average per row, and vLLM's CPU memory default in
the launcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from oea.bench.serve.ab import engine_summary, restart_order, wait_for_load, with_load
from oea.bench.serve.summary import ab_summary, plot_ab
from oea.launch.vllm import memory_defaults, start_server


def _row(arm: str, conc: int, rnd: int, tpot: float, tput: float, **extra: float) -> dict:
    return {"arm": arm, "max_concurrency": conc, "round": rnd, "median_tpot_ms": tpot, "median_itl_ms": tpot,
            "mean_tpot_ms": tpot, "output_throughput": tput, "loadavg": [2.0 + rnd, 2.0, 2.0], **extra}


def test_ab_summary_pairs_rounds_and_reports_cis() -> None:
    off = [100.0, 130.0, 90.0, 120.0]  # round-to-round drift larger than the effect
    rows = [_row("off", 16, r, t, 1000 / t, engine_active_experts=48.0) for r, t in enumerate(off)]
    rows += [_row("k3", 16, r, 0.7 * t, 1000 / (0.7 * t), engine_active_experts=24.0) for r, t in enumerate(off)]
    rows += [_row("off", 1, 0, 50.0, 20.0), _row("k3", 1, 0, 50.0, 20.0)]
    summary = ab_summary(rows, baseline="off")
    k3 = next(e for e in summary if e["arm"] == "k3" and e["max_concurrency"] == 16)
    assert k3["median_tpot_ms_ratio"] == pytest.approx(0.7)
    assert k3["median_tpot_ms_ratio_ci"] == pytest.approx([0.7, 0.7])  # paired: the drift cancels
    assert k3["output_throughput_ratio"] == pytest.approx(1 / 0.7)
    assert k3["median_tpot_ms"] == pytest.approx(0.7 * 110.0) and k3["rounds"] == 4
    lo, hi = k3["median_tpot_ms_ci"]
    assert lo < k3["median_tpot_ms"] < hi
    assert k3["engine_active_experts"] == 24.0 and k3["loadavg_1m_range"] == [2.0, 5.0]
    off16 = next(e for e in summary if e["arm"] == "off" and e["max_concurrency"] == 16)
    assert "median_tpot_ms_ratio" not in off16 and off16["median_tpot_ms_rounds"] == off
    assert [(e["max_concurrency"], e["arm"]) for e in summary] == [(1, "off"), (1, "k3"), (16, "off"), (16, "k3")]
    with pytest.raises(ValueError, match="--baseline-arm must be one of"):
        ab_summary(rows, baseline="k9")


def test_ab_summary_pairs_the_common_rounds_only(tmp_path: Path) -> None:
    rows = [_row("off", 4, r, 10.0 + r, 100.0) for r in range(3)] + [_row("k5", 4, r, 8.0, 120.0) for r in range(2)]
    k5 = next(e for e in ab_summary(rows) if e["arm"] == "k5")
    assert k5["median_tpot_ms_ratio"] == pytest.approx(8.0 / 10.5) and k5["median_tpot_ms_ratio_pairs"] == 2
    one = [_row("off", 4, r, 10.0 + r, 100.0) for r in range(3)] + [_row("k5", 4, 7, 8.0, 120.0)]
    k5 = next(e for e in ab_summary(one) if e["arm"] == "k5")
    assert k5["median_tpot_ms_ratio"] == pytest.approx(8.0 / 11.0) and k5["median_tpot_ms_ratio_pairs"] == 0
    assert plot_ab(ab_summary(rows), tmp_path / "ab.png").stat().st_size > 0


def test_engine_summary_step_time_and_routing_share() -> None:
    rows = [{"pid": 7, "step": s, "time": 100.0 + 0.1 * s, "decode": True, "rows": 16, "active": [20, 30],
             "routing_us": [200.0, 200.0]} for s in range(1, 6)]
    rows.append({"pid": 7, "step": 6, "time": 100.9, "decode": False, "rows": 40, "active": [60, 60]})
    out = engine_summary(rows, 99.0, 101.0)
    assert out["engine_step_ms_median"] == pytest.approx(100.0)
    assert out["engine_routing_share_call"] == pytest.approx(0.002)  # 200 µs of 100 ms
    assert out["engine_routing_share_step"] == pytest.approx(0.004)  # two layers
    assert out["engine_decode_steps"] == 5 and out["engine_active_experts"] == 25.0


def test_restart_order_rotates_every_arm_through_every_position() -> None:
    names = ["off", "k5", "k3"]
    orders = [restart_order(names, r) for r in range(3)]
    assert orders == [["off", "k5", "k3"], ["k5", "k3", "off"], ["k3", "off", "k5"]]
    for arm in names:
        assert sorted(order.index(arm) for order in orders) == [0, 1, 2]


def test_rows_record_the_load_average() -> None:
    row: dict = {"arm": "a"}
    with_load(lambda r: r.update(seen=True))(row)
    assert len(row["loadavg"]) == 3 and row["seen"] is True


def test_vllm_cpu_memory_default_only_when_nothing_sizes_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert memory_defaults({}, ["--model", "m"]) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert memory_defaults({"VLLM_CPU_KVCACHE_SPACE": "4"}, ["--model", "m"]) == {}
    assert memory_defaults({}, ["--model", "m", "--gpu-memory-utilization", "0.5"]) == {}
    assert memory_defaults({}, ["--kv-cache-memory-bytes=1000000"]) == {}
    seen = {}

    class FakePopen:
        def __init__(self, cmd: list[str], env: dict, **kw: object) -> None:
            seen.update(cmd=cmd, env=env, preexec_fn=kw.get("preexec_fn"))

    monkeypatch.setattr("oea.launch.server_process.subprocess.Popen", FakePopen)
    start_server(["--model", "m"], {"PATH": "/bin"}, python="py")
    assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1" and seen["cmd"][-2:] == ["--host", "127.0.0.1"]
    assert seen["preexec_fn"] is None  # no priority change unless asked
    start_server(["--model", "m"], {"VLLM_CPU_KVCACHE_SPACE": "3"}, python="py", nice=5)
    assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "3" and callable(seen["preexec_fn"])
    with pytest.raises(ValueError, match=r"--server-nice must be in -20\.\.19, got 40"):
        start_server(["--model", "m"], {}, python="py", nice=40)


def test_restart_rounds_can_extend_an_earlier_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import oea.bench.serve.ab as serve_ab
    import oea.launch.vllm as launch
    from oea.bench.serve.client import BenchConfig

    started, seeds = [], []

    class FakeServer:
        base_url = "http://127.0.0.1:1"

    def fake_start(args, env, python=None, log_path=None, nice=None):
        started.append((env.get("OEA_K0"), Path(env["OEA_METRICS_FILE"]).name, nice))
        return FakeServer()

    def fake_run(arms, cfg, progress, enrich):
        seeds.append(cfg.seed)
        return [{"arm": arms[0].name, "max_concurrency": 1}]

    import oea.launch.server_process as server_process

    monkeypatch.setattr(launch, "start_server", fake_start)
    monkeypatch.setattr(server_process, "wait_healthy", lambda server, timeout, timeout_name=None: None)
    monkeypatch.setattr(server_process, "stop_server", lambda server: None)
    monkeypatch.setattr(serve_ab, "run_benchmark", fake_run)
    import oea.launch.priority as priority

    own_priority = []
    monkeypatch.setattr(priority, "set_priority", lambda nice, flag: own_priority.append((nice, flag)))
    cfg = BenchConfig(rounds=2, seed=7)
    rows = serve_ab.run_restarted({"off": {}, "k3": {"OEA_K0": "3"}}, ["--", "--model", "m"], cfg, tmp_path,
                                  tmp_path / "ab.jsonl", None, 1.0, progress=False, server_nice=-5, first_round=3)
    assert [(r["arm"], r["round"]) for r in rows] == [("k3", 3), ("off", 3), ("off", 4), ("k3", 4)]
    assert started[0] == ("3", "engine-k3-round3.jsonl", -5) and seeds == [307, 307, 407, 407]
    assert own_priority == [(-5, "--server-nice")]  # the client gets the servers' priority
    assert len((tmp_path / "ab.jsonl").read_text().splitlines()) == 4
    with pytest.raises(ValueError, match="--first-round must be >= 0"):
        serve_ab.run_restarted({"off": {}}, ["--model", "m"], cfg, tmp_path, None, None, 1.0, False, first_round=-1)


def test_wait_for_load_polls_until_the_machine_is_quiet() -> None:
    loads = iter([9.0, 8.0, 3.0, 1.0])
    slept: list[float] = []
    waited = wait_for_load(4.0, 600.0, poll=10.0, loadavg=lambda: (next(loads), 0.0, 0.0), sleep=slept.append)
    assert waited == 20.0 and slept == [10.0, 10.0]
    assert wait_for_load(None, 600.0, loadavg=lambda: (99.0, 0.0, 0.0), sleep=slept.append) == 0.0
    assert wait_for_load(1.0, 25.0, poll=10.0, loadavg=lambda: (99.0, 0.0, 0.0), sleep=lambda s: None) == 30.0


def test_set_priority_sets_nice_and_the_session_autogroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import oea.launch.priority as priority

    calls = []
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 0\n")
    monkeypatch.setattr(priority, "AUTOGROUP", group)
    monkeypatch.setattr(priority.os, "setpriority", lambda *args: calls.append(args))
    priority.set_priority(-10)
    assert calls == [(priority.os.PRIO_PROCESS, 0, -10)] and group.read_text() == "-10"
    group.write_text("")  # some containers show the file empty: no autogroup to set, the nice value still set
    priority.set_priority(5)
    assert calls[-1] == (priority.os.PRIO_PROCESS, 0, 5) and group.read_text() == ""
    with pytest.raises(ValueError, match=r"--nice must be in -20\.\.19, got 25"):
        priority.set_priority(25)

    def refuse(*_args: object) -> None:
        raise PermissionError("EPERM")

    monkeypatch.setattr(priority.os, "setpriority", refuse)
    with pytest.raises(ValueError, match="--server-nice -5: not permitted"):
        priority.set_priority(-5, "--server-nice")
