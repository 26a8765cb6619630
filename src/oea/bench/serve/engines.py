"""Which engine ``oea bench serve`` starts or talks to: ``--engine vllm|sglang``, detected from a restart-mode
command when not given, and checked against what a server says it is.

A server says its engine in ``GET /v1/models``: both vLLM's and SGLang's OpenAI-compatible servers name
themselves in each model's ``owned_by`` (``"vllm"``, ``"sglang"``).
"""

from __future__ import annotations

from collections.abc import Sequence

ENGINES: tuple[str, ...] = ("vllm", "sglang")
NAMES: dict[str, str] = {"vllm": "vLLM", "sglang": "SGLang"}
# flags only SGLang's launch_server takes (vLLM names the model --model, the degree --tensor-parallel-size)
SGLANG_FLAGS: tuple[str, ...] = ("--model-path", "--tp-size", "--attention-backend", "--mem-fraction-static",
                                 "--max-running-requests", "--disable-cuda-graph")


def detect_engine(server_args: Sequence[str]) -> str:
    """The engine a restart-mode command starts: ``"sglang"`` when its arguments use a flag only SGLang's
    ``launch_server`` has (``SGLANG_FLAGS``, e.g. ``--model-path``), else ``"vllm"``."""
    for arg in server_args:
        if arg.split("=", 1)[0] in SGLANG_FLAGS:
            return "sglang"
    return "vllm"


def check_engine(engine: str | None) -> str | None:
    """``engine`` when it is one of ``ENGINES`` (or None); else ``ValueError`` naming ``--engine``."""
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    return engine


def served_engine(base_url: str, timeout: float = 5.0) -> str:
    """What the server at ``base_url`` says it is: the ``owned_by`` of its first ``/v1/models`` entry (``"vllm"``,
    ``"sglang"``, ...; ``"unknown"`` when it does not say)."""
    import httpx

    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout, trust_env=False)
        data = resp.json().get("data") or [] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return "unknown"
    owner = data[0].get("owned_by") if data and isinstance(data[0], dict) else None
    return str(owner).strip().lower() if owner else "unknown"


def require_engine(base_url: str, engine: str, strict: bool = True) -> None:
    """``ValueError`` (one line naming what the server said) unless the server at ``base_url`` says it is
    ``engine``; with ``strict=False`` (a server this process started as ``engine``) only when it says it is
    another one."""
    found = served_engine(base_url)
    if found != engine and (strict or found != "unknown"):
        said = f"owned_by {found!r}" if found != "unknown" else "no owned_by"
        raise ValueError(f"--engine {engine}: the server at {base_url} is not {NAMES[engine]} "
                         f"(GET /v1/models says {said})")
