"""``oea doctor --metrics-url``: the verdicts of ``--metrics-file`` from a server's ``oea_*`` series, read over
HTTP from a real prometheus_client endpoint fed by the exporter (``serve_port``)."""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import free_port
from test_prometheus_export import STEPS, feed

from oea.integrations.doctor.live import live_checks, parse_exposition
from oea.integrations.doctor.run import format_text, run_doctor
from oea.integrations.prometheus import serve_port
from oea.integrations.served import served_checks


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(URL of a /metrics serving the exporter's series of ``STEPS``, the metrics file of the same steps)."""
    directory, file = feed(tmp_path, STEPS)
    port = free_port()
    served = serve_port(str(directory), f"127.0.0.1:{port}", logging.getLogger("test"))
    assert served is not None
    try:
        yield f"http://127.0.0.1:{port}/metrics", file  # type: ignore[misc]
    finally:
        served[1].shutdown()
        served[1].server_close()


def _by_name(checks: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in checks}


def test_prometheus_doctor_url_judges_as_the_metrics_file(endpoint: tuple[str, Path]) -> None:
    url, file = endpoint
    live, offline = _by_name(live_checks(url)), _by_name(served_checks(file, 2))
    assert live["OEA engaged"] == offline["OEA engaged"]
    assert live["OEA engaged"]["detail"].startswith("OEA engaged in 2 of 3 decode forwards with >= 2 real rows (67%)")
    assert live["metrics endpoint"]["ok"]
    assert live["metrics endpoint"]["detail"] == f"{url}: 6 forwards, 4 decode on rank(s) [0]"
    assert "vs the engine's own routing of the same logits" in live["active experts"]["detail"]
    reasons = live["passthrough reasons"]
    assert not reasons["ok"], "a failed layer fails the check"
    assert "below_min_batch 1, layer_failed 1, verify_not_applied 1" in reasons["detail"]


def test_prometheus_doctor_url_exit_codes_and_text(endpoint: tuple[str, Path]) -> None:
    url, _ = endpoint
    report, code = run_doctor("transformers", metrics_url=url)
    assert code == 1 and not report["served"]["ok"]  # the failed layer
    assert f"served (--metrics-url {url}): FAILED" in format_text(report)
    report, code = run_doctor("transformers", metrics_url="http://127.0.0.1:1/metrics")
    [only] = report["served"]["checks"]
    assert code == 1 and only["name"] == "metrics endpoint" and "unreachable" in only["detail"]


def test_prometheus_doctor_url_without_oea_series() -> None:
    class Plain(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"# HELP vllm:x x\n# TYPE vllm:x counter\nvllm:x_total 3.0\n"
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Plain)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        [only] = live_checks(url)
        assert not only["ok"] and "no oea_* series there" in only["detail"]
    finally:
        server.shutdown()
        server.server_close()


def test_prometheus_doctor_parses_the_exposition_format() -> None:
    text = (
        "# HELP oea_forwards_total x\n# TYPE oea_forwards_total counter\n"
        'oea_forwards_total{engine="vllm",model_name="a \\"b\\"",phase="decode",rank="0"} 12.0\n'
        "oea_plain 3\nbroken line\n"
    )
    assert parse_exposition(text) == [
        ("oea_forwards_total", {"engine": "vllm", "model_name": 'a \\"b\\"', "phase": "decode", "rank": "0"}, 12.0),
        ("oea_plain", {}, 3.0),
    ]
