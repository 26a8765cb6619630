"""Greedy completions of ``oea eval serve`` items from an OpenAI-compatible server (vLLM, SGLang).

One non-streamed ``POST /v1/completions`` per item, ``temperature`` 0, the item's ``max_tokens``, stopping at the
end of the line, with ``logprobs: 1`` so that the answer's tokens come back (``choices[0].logprobs.tokens``: the
position of the first token two arms disagree on). At most ``max_concurrency`` requests are in flight, so the
server batches that many sequences together: the co-batching OEA's routing depends on. An HTTP error, a timeout
or an answer without text is recorded on the item (``error``), never raised: the pairing drops the item and counts
it per arm.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from oea.eval.serve_tasks import Item

STOP = ["\n"]


@dataclass(frozen=True)
class Answer:
    """A server's answer to one item: ``text`` and its ``tokens`` (None when the server did not say them), or
    ``error`` (then ``text`` is '')."""

    item_id: str
    text: str = ""
    tokens: list[str] | None = None
    error: str = ""


def completion_body(model: str, item: Item) -> dict[str, Any]:
    """The request of one item: greedy, the item's ``max_tokens``, stop at the line's end, tokens back."""
    return {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0.0,
            "stop": STOP, "logprobs": 1, "stream": False}


def parse_answer(item_id: str, status: int, payload: Any) -> Answer:
    """An ``Answer`` from a response's status and decoded JSON body (errors named, never raised)."""
    if status != 200:
        return Answer(item_id, error=f"HTTP {status}: {str(payload)[:200]}")
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("text"), str):
        return Answer(item_id, error=f"no choices[0].text in the answer: {str(payload)[:200]}")
    logprobs = choices[0].get("logprobs")
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    return Answer(item_id, choices[0]["text"], list(tokens) if isinstance(tokens, list) else None)


async def _complete(base_url: str, model: str, items: Sequence[Item], max_concurrency: int, timeout: float,
                    on_done: Callable[[Answer], None] | None) -> list[Answer]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    gate = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits,
                                 trust_env=False) as client:
        async def one(item: Item) -> Answer:
            async with gate:
                try:
                    resp = await client.post(url, json=completion_body(model, item))
                    try:
                        payload: Any = resp.json()
                    except ValueError:
                        payload = resp.text
                    answer = parse_answer(item.item_id, resp.status_code, payload)
                except httpx.HTTPError as err:
                    answer = Answer(item.item_id, error=f"{type(err).__name__}: {err}"[:300])
            if on_done is not None:
                on_done(answer)
            return answer

        return list(await asyncio.gather(*(one(item) for item in items)))


def complete_items(base_url: str, model: str, items: Sequence[Item], max_concurrency: int, timeout: float = 600.0,
                   on_done: Callable[[Answer], None] | None = None) -> list[Answer]:
    """Answers to ``items`` (in their order), at most ``max_concurrency`` requests in flight, each bounded by
    ``timeout`` seconds."""
    if max_concurrency < 1:
        raise ValueError(f"--max-concurrency values must be >= 1, got {max_concurrency}")
    return asyncio.run(_complete(base_url, model, items, max_concurrency, timeout, on_done))
