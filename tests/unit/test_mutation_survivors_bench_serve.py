"""``oea bench serve``'s engine detection and check at the edges the generated mutants of ``make mutation`` found
unguarded (docs/testing.md, "Generated mutants"): a flag written ``--flag=value`` whose value holds ``=``, the
``--engine`` error's words, a base URL with a trailing slash, answers that are not a list of model objects, a
server that answers late, and proxy variables that must not reroute the loopback probe."""

from __future__ import annotations

import time
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from fake_servers import QuietHandler, serving

from oea.bench.serve.engines import check_engine, detect_engine, served_engine


def models_handler(status: int, body: Any, delay_s: float = 0.0) -> type[BaseHTTPRequestHandler]:
    """A server whose ``GET /v1/models`` (that path only: anything else is a 404) answers ``status`` with ``body``
    as JSON, after ``delay_s``."""

    class Models(QuietHandler):
        def do_GET(self) -> None:
            time.sleep(delay_s)
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
    with serving(models_handler(200, {"data": [{"owned_by": "sglang"}]}, delay_s=2.0)) as url:
        started = time.monotonic()
        assert served_engine(url, timeout=0.3) == "unknown"
        assert time.monotonic() - started < 1.9
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
