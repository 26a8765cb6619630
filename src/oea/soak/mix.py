"""The soak's seeded request mix and its concurrency schedule.

Every request is drawn from its own generator (``random.Random(f"{seed}:{index}")``), so request ``i`` is the
same in every arm and in every run with the same seed, whatever the other requests are. What a request is
meant to do (``plan``):

* ``complete``: a well-formed completion: prompt and output lengths from 1 token to the model length
  (log-uniform, so short requests dominate and a few reach ``max_model_len``, or SGLang's slightly shorter
  served lengths), streamed or not, ``n`` > 1,
  ``logprobs``, stop strings, ``max_tokens`` = 1, greedy or ``temperature`` > 0 with a ``seed``;
* ``abort``: the same kind of request whose client disconnects: a stream closed after ``abort_after`` chunks
  (0: right after the response headers), or a non-streamed request given up after ``abort_after_s``;
* ``refuse``: a request the engine must refuse: a prompt longer than the model length
  (``prompt_too_long``), a negative ``max_tokens`` (``negative_max_tokens``), a body that is not JSON
  (``malformed_json``).

``schedule`` cuts the requests into phases: concurrency ramping 1, 2, 4, ... up to the maximum, then
alternating bursts (every request of the phase released at the same instant after the engine went idle)
and steady load at the maximum.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

PLANS = ("complete", "abort", "refuse")
REFUSALS = ("prompt_too_long", "negative_max_tokens", "malformed_json")
# Token ids of prompts: above typical special tokens, below any real vocabulary size (as oea bench serve).
TOKEN_RANGE = (16, 4000)
STOP_STRINGS = ("\n", " the", "e", "(", "::", "return")


@dataclass(frozen=True)
class MixShares:
    """Shares of the mix, each in [0, 1]; ``abort + refuse`` at most 1."""

    abort: float = 0.3
    refuse: float = 0.06
    stream: float = 0.5
    n_above_one: float = 0.15
    sampled: float = 0.4
    logprobs: float = 0.2
    stop: float = 0.15
    one_token: float = 0.1
    full_length: float = 0.03  # prompt + max_tokens exactly the model length

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"--{name.replace('_', '-')}-share must be in [0, 1], got {value!r}")
        if self.abort + self.refuse > 1.0:
            raise ValueError(f"--abort-share + --refuse-share must be at most 1, got {self.abort} + {self.refuse}")


@dataclass(frozen=True)
class SoakRequest:
    """One request of the mix.

    ``body`` is the JSON body (``raw`` replaces it for a malformed one); ``expected_tokens`` is the completion
    length per choice the engine must produce when nothing stops it early (greedy ``ignore_eos`` without stop
    strings), else None.
    """

    index: int
    plan: str
    body: dict[str, Any]
    refusal: str | None = None
    raw: bytes | None = None
    abort_after: int | None = None  # streamed aborts: chunks read before disconnecting
    abort_after_s: float | None = None  # non-streamed aborts: seconds before giving up
    expected_tokens: int | None = None
    tags: tuple[str, ...] = field(default=())

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))

    @property
    def prompt_len(self) -> int:
        prompt = self.body.get("prompt")
        return len(prompt) if isinstance(prompt, list) else 0

    def payload(self) -> bytes:
        """The bytes sent: the JSON body, or the malformed bytes of a ``malformed_json`` refusal."""
        return self.raw if self.raw is not None else json.dumps(self.body).encode()


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high], uniform in log scale."""
    if high <= low:
        return low
    return min(high, max(low, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]


def make_request(seed: int, index: int, model: str, max_model_len: int, shares: MixShares,
                 token_ids: bool = False, max_prompt_len: int | None = None, max_total_len: int | None = None
                 ) -> SoakRequest:
    """Request ``index`` of the mix of ``seed`` for a server of ``max_model_len`` tokens; ``token_ids`` asks
    for the output token ids (vLLM's and SGLang's ``return_token_ids``), so that outputs compare exactly.

    Well-formed requests stay within what the engine serves in full: prompts of at most ``max_prompt_len``
    tokens (default ``max_model_len - 1``) and prompt + ``max_tokens`` at most ``max_total_len`` (default
    ``max_model_len``; ``oea.soak.monitor.serving_limits``); a too-long prompt is longer than the model."""
    total = max_total_len or max_model_len
    top = min(max_prompt_len or max_model_len - 1, total - 1)
    if max_model_len < 2 or total > max_model_len or top < 1:
        raise ValueError(f"max_model_len must be >= 2 (a prompt and one output token) and the served lengths "
                         f"within it, got {max_model_len} (prompt {max_prompt_len}, total {max_total_len})")
    rng = random.Random(f"{seed}:{index}")
    draw = rng.random()
    plan = "refuse" if draw < shares.refuse else "abort" if draw < shares.refuse + shares.abort else "complete"
    if plan == "refuse":
        return _refusal(rng, index, model, max_model_len)
    tags: list[str] = []
    if rng.random() < shares.full_length:
        prompt_len = rng.randint(1, top)
        max_tokens = total - prompt_len
        tags.append("full_length")
    else:
        prompt_len = _log_uniform(rng, 1, top)
        max_tokens = 1 if rng.random() < shares.one_token else _log_uniform(rng, 1, total - prompt_len)
    body: dict[str, Any] = {"model": model, "prompt": _tokens(rng, prompt_len), "max_tokens": max_tokens,
                            "ignore_eos": rng.random() < 0.5}
    if token_ids:
        body["return_token_ids"] = True
    if rng.random() < shares.sampled:
        body.update(temperature=round(rng.uniform(0.5, 1.2), 3), seed=rng.randrange(2**31), top_p=0.95)
        tags.append("sampled")
        if rng.random() < shares.n_above_one / max(shares.sampled, 1e-9):  # n > 1 needs sampling (vLLM)
            body["n"] = rng.randint(2, 4)
    else:
        body["temperature"] = 0.0
    if rng.random() < shares.logprobs:
        body["logprobs"] = rng.randint(0, 5)
    if rng.random() < shares.stop:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    stream = (plan == "abort" and rng.random() < 0.8) or (plan == "complete" and rng.random() < shares.stream)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    expected = None
    if body["ignore_eos"] and "stop" not in body:
        expected = max_tokens
    abort_after = abort_after_s = None
    if plan == "abort":
        if stream:
            abort_after = rng.randint(0, max(0, min(max_tokens, 64) - 1))
        else:
            abort_after_s = round(rng.uniform(0.02, 1.0), 3)
    return SoakRequest(index, plan, body, abort_after=abort_after, abort_after_s=abort_after_s,
                       expected_tokens=expected, tags=tuple(tags))


def _refusal(rng: random.Random, index: int, model: str, max_model_len: int) -> SoakRequest:
    kind = REFUSALS[rng.randrange(len(REFUSALS))]
    body: dict[str, Any] = {"model": model, "prompt": _tokens(rng, rng.randint(1, 16)), "max_tokens": 8,
                            "temperature": 0.0}
    raw = None
    if kind == "prompt_too_long":
        body["prompt"] = _tokens(rng, max_model_len + rng.randint(1, 64))
    elif kind == "negative_max_tokens":
        body["max_tokens"] = -rng.randint(1, 5)
    else:
        text = json.dumps(body).encode()
        raw = text[: rng.randint(1, len(text) - 1)]  # cut inside the object: never valid JSON
    return SoakRequest(index, "refuse", body, refusal=kind, raw=raw)


def make_mix(seed: int, count: int, model: str, max_model_len: int, shares: MixShares | None = None,
             first: int = 0, token_ids: bool = False, max_prompt_len: int | None = None,
             max_total_len: int | None = None) -> list[SoakRequest]:
    """Requests ``first .. first + count - 1`` of the mix of ``seed`` (the lengths: ``make_request``)."""
    shares = shares or MixShares()
    return [make_request(seed, first + i, model, max_model_len, shares, token_ids, max_prompt_len, max_total_len)
            for i in range(count)]


def probe_requests(model: str, count: int = 6, token_ids: bool = False) -> list[SoakRequest]:
    """The exactness probe: seeded sampling with ``n`` = 4 (decode steps of 4 rows), ``logprobs`` and fixed
    lengths, sent one at a time on an idle server so that the batches are the same in every arm."""
    rng = random.Random("probe")
    probes = []
    for i in range(count):
        body = {"model": model, "prompt": _tokens(rng, rng.randint(4, 48)), "max_tokens": 24, "n": 4,
                "temperature": 0.9, "seed": 1000 + i, "logprobs": 2, "ignore_eos": True}
        if token_ids:
            body["return_token_ids"] = True
        probes.append(SoakRequest(-1 - i, "complete", body, expected_tokens=24, tags=("probe",)))
    return probes


@dataclass(frozen=True)
class Phase:
    """Requests sent with at most ``concurrency`` in flight; a ``burst`` releases them all at once after the
    previous phase drained and the engine was idle for ``idle_s``."""

    requests: tuple[SoakRequest, ...]
    concurrency: int
    burst: bool = False
    idle_s: float = 0.0


def ramp_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to ``max_concurrency`` (which is always the last level)."""
    if max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    levels = [1]
    while levels[-1] * 2 < max_concurrency:
        levels.append(levels[-1] * 2)
    if levels[-1] != max_concurrency:
        levels.append(max_concurrency)
    return levels


def schedule(requests: list[SoakRequest], max_concurrency: int, ramp_share: float = 0.3,
             burst_idle_s: float = 1.5) -> list[Phase]:
    """The phases: the first ``ramp_share`` of the requests ramp up the concurrency levels (equal parts), the
    rest alternate a burst of ``max_concurrency`` requests released together and a steady block of
    ``4 x max_concurrency`` requests at ``max_concurrency``."""
    levels = ramp_levels(max_concurrency)
    ramp_count = int(len(requests) * ramp_share)
    phases: list[Phase] = []
    start = 0
    for i, level in enumerate(levels):
        end = ramp_count * (i + 1) // len(levels)
        if end > start:
            phases.append(Phase(tuple(requests[start:end]), level))
        start = max(start, end)
    burst = True
    while start < len(requests):
        size = max_concurrency if burst else 4 * max_concurrency
        block = tuple(requests[start:start + size])
        phases.append(Phase(block, len(block) if burst else max_concurrency, burst, burst_idle_s if burst else 0.0))
        start += len(block)
        burst = not burst
    return phases
