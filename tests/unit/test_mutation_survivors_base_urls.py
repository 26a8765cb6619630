"""A base URL may end in any character: a host name without a port (``http://boX``), or a path behind a proxy
(``http://127.0.0.1:8000/prefiX``). Each client that joins a path to a base URL strips only its trailing ``/``
(kills the generated mutants ``rstrip("XX/XX")`` of ``served_engine``, ``scrape`` and the soak's ``run_phases``,
once listed as equivalent on the belief that a base URL ends in a digit or ``/``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from oea.bench.serve.engine_counters import scrape
from oea.bench.serve.engines import served_engine
from oea.soak import client
from oea.soak.mix import Phase, SoakRequest


def _recorded_get(monkeypatch: pytest.MonkeyPatch, answer: httpx.Response) -> list[str]:
    """``httpx.get`` stood in: the URLs asked for, each answered with ``answer``."""
    urls: list[str] = []

    def get(url: str, **kwargs: Any) -> httpx.Response:
        urls.append(url)
        return answer

    monkeypatch.setattr(httpx, "get", get)
    return urls


@pytest.mark.parametrize("base_url", ["http://boX", "http://boX/", "http://127.0.0.1:8000/prefiX"])
def test_the_engine_probe_asks_the_models_path_under_a_base_url_that_ends_in_x(
        monkeypatch: pytest.MonkeyPatch, base_url: str) -> None:
    urls = _recorded_get(monkeypatch, httpx.Response(200, json={"data": [{"owned_by": "vllm"}]}))
    assert served_engine(base_url) == "vllm"
    assert urls == [base_url.rstrip("/") + "/v1/models"]


@pytest.mark.parametrize("base_url", ["http://boX", "http://127.0.0.1:8000/prefiX/"])
def test_the_counter_scrape_asks_the_metrics_path_under_a_base_url_that_ends_in_x(
        monkeypatch: pytest.MonkeyPatch, base_url: str) -> None:
    urls = _recorded_get(monkeypatch, httpx.Response(200, text=""))
    assert scrape(base_url) == {}
    assert urls == [base_url.rstrip("/") + "/metrics"]


def test_the_soak_posts_to_the_completions_path_under_a_base_url_that_ends_in_x(
        monkeypatch: pytest.MonkeyPatch) -> None:
    urls: list[str] = []
    real = httpx.AsyncClient

    def answer(request: httpx.Request) -> httpx.Response:
        urls.append(str(request.url))
        assert json.loads(request.content)["prompt"] == [0]
        return httpx.Response(200, json={"choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}],
                                         "usage": {"completion_tokens": 1}})

    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: real(transport=httpx.MockTransport(answer), **kwargs))
    request = SoakRequest(0, "complete", {"model": "m", "prompt": [0], "max_tokens": 1})
    outcomes, unsent = asyncio.run(client.run_phases("http://127.0.0.1:8000/prefiX/", [Phase((request,), 1)],
                                                     deadline=float("inf"), timeout_s=9.0))
    assert unsent == 0 and [o.outcome for o in outcomes] == ["completed"]
    assert urls == ["http://127.0.0.1:8000/prefiX/v1/completions"]
