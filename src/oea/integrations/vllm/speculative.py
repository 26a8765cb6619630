"""Speculative decoding in vLLM: what the plugin reads of it, and what an engine step carried.

vLLM (0.32, V1 engine) schedules a speculative *verify* step like a decode step in which each request runs
1 + d tokens: the token sampled in the previous step and the d draft tokens its proposer (n-gram, draft
model, EAGLE, MTP) made for it. The plugin reads two things:

* at model load, ``VllmConfig.speculative_config``: None when speculation is off, else its ``method`` and
  ``num_speculative_tokens`` (the most drafts per request; it sizes the recording buffer);
* in every step, ``SchedulerOutput.num_scheduled_tokens`` ``{request id: tokens}`` and
  ``SchedulerOutput.scheduled_spec_decode_tokens`` ``{request id: [draft token ids]}`` (only requests with
  drafts; the scheduler pads with ``-1`` placeholders, which still run as rows of the forward).

Where either is not in that layout (a vLLM that moved them), the plugin cannot tell a verify step from a
prefill chunk: it warns once (``steps.py``) and every step with drafts keeps vLLM's routing, with or without
``OEA_APPLY_TO_VERIFY``; plain decode steps (one token per request) are rewritten as usual. A step output
without the draft field is no problem while speculation is off (there are no drafts to read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DRAFTS_FIELD = "scheduled_spec_decode_tokens"
TOKENS_FIELD = "num_scheduled_tokens"
UNREADABLE = ("verify steps keep vLLM's routing (OEA_APPLY_TO_VERIFY has no effect); decode steps are "
              "rewritten as usual")


@dataclass(frozen=True)
class Speculation:
    """vLLM's speculative-decoding settings as the plugin read them at model load."""

    method: str
    num_speculative_tokens: int


@dataclass(frozen=True)
class StepShape:
    """What one engine step carried, per scheduled request in the scheduler's order.

    ``tokens[i]``: tokens request i runs in the step (1 + its drafts in a decode or verify step, a chunk of
    its prompt in prefill); ``drafts[i]``: draft tokens among them (0 without speculation).
    """

    tokens: tuple[int, ...]
    drafts: tuple[int, ...]

    @property
    def carries_drafts(self) -> bool:
        """At least one request runs draft tokens (a verify step, or a prefill chunk batched with one)."""
        return any(self.drafts)

    @property
    def decode_shaped(self) -> bool:
        """Every request runs exactly its last sampled token plus its drafts (vLLM's uniform-decode test)."""
        return bool(self.tokens) and all(n == 1 + d for n, d in zip(self.tokens, self.drafts, strict=True))

    @property
    def verify(self) -> bool:
        """A speculative verify step: decode-shaped, and some request carries draft tokens (a step that also
        runs a prefill chunk is a mixed step, not a verify step)."""
        return self.decode_shaped and self.carries_drafts


def read_speculation(vllm_config: Any) -> tuple[Speculation | None, str]:
    """``(settings or None, problem)``: None with ``""`` when speculation is off; None with a description when
    ``speculative_config`` is set but not in the layout the plugin reads."""
    if vllm_config is None:
        return None, ""  # a model runner without a config (a stand-in): nothing is known, nothing is claimed
    if not hasattr(vllm_config, "speculative_config"):
        return None, f"{type(vllm_config).__name__} has no speculative_config"
    config = vllm_config.speculative_config
    if config is None:
        return None, ""
    drafts = getattr(config, "num_speculative_tokens", None)
    if isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1:
        return None, (f"{type(config).__name__} has no integer num_speculative_tokens >= 1 "
                      f"(got {drafts!r})")
    return Speculation(str(getattr(config, "method", None) or "?"), drafts), ""


def step_shape(scheduler_output: Any, speculating: bool = False) -> tuple[StepShape, str]:
    """``(shape, problem)`` of one step from its ``SchedulerOutput``; ``problem`` is ``""`` when the draft
    tokens could be read, else what was wrong (the shape then counts no drafts). A missing draft field is a
    problem only while ``speculating`` (speculation on); a malformed one always is."""
    scheduled = getattr(scheduler_output, TOKENS_FIELD, None) or {}
    if not isinstance(scheduled, Mapping):
        return StepShape((), ()), f"SchedulerOutput.{TOKENS_FIELD} is a {type(scheduled).__name__}, not a dict"
    tokens = tuple(int(n) for n in scheduled.values())
    none = StepShape(tokens, (0,) * len(tokens))
    spec = getattr(scheduler_output, DRAFTS_FIELD, _MISSING)
    if spec is _MISSING:
        return none, f"SchedulerOutput has no {DRAFTS_FIELD}" if speculating else ""
    if spec is None:
        return none, ""
    if not isinstance(spec, Mapping) or not all(isinstance(v, Sequence) for v in spec.values()):
        return none, f"SchedulerOutput.{DRAFTS_FIELD} is not a dict of token lists (a {type(spec).__name__})"
    return StepShape(tokens, tuple(len(spec.get(req, ())) for req in scheduled)), ""


_MISSING = object()
