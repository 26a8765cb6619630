"""The timed decode step of ``oea bench decode``: static KV cache, greedy next token, and how it runs.

Graph modes (``--graph``):

* ``none``: eager PyTorch (the CPU default).
* ``capture`` (the CUDA default): the eager step — forward of ``[B, 1]`` tokens with the OEA hooks,
  argmax, next input, position + 1 — captured once in a ``torch.cuda.CUDAGraph`` after three warm-up
  steps on a side stream, then replayed. Nothing in it synchronises with the host: the attention mask
  is left to transformers (no padding), the experts run ``grouped_mm`` (offsets from ``histc``), and
  ``oea.route`` and the hook counters are graph-safe. If capture fails anyway, the decoder warns,
  records the error and falls back to ``compile``.
* ``compile``: ``torch.compile(mode="reduce-overhead", fullgraph=True)`` of the forward (CUDA graphs
  through Inductor on CUDA; plain Inductor code on CPU).
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

GRAPH_MODES: tuple[str, ...] = ("auto", "none", "capture", "compile")


def resolve_graph_mode(requested: str, device: str) -> str:
    """``auto`` -> ``capture`` on CUDA, ``none`` on CPU; ``capture`` needs CUDA (``ValueError`` naming ``--graph``)."""
    if requested not in GRAPH_MODES:
        raise ValueError(f"--graph must be one of {list(GRAPH_MODES)}, got {requested!r}")
    if requested == "auto":
        return "capture" if device == "cuda" else "none"
    if requested == "capture" and device != "cuda":
        raise ValueError("--graph capture needs --device cuda (CUDA graphs); use none or compile on CPU")
    return requested


class StepTimer:
    """Times a callable: ``perf_counter`` on CPU, CUDA events (synchronised) on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class Decoder:
    """Greedy decode of one batch size with a static KV cache, in graph mode ``mode`` (none/capture/compile).

    ``run(prompts [B, P])`` -> (tokens [B, 1 + new_tokens] int64 on CPU, step seconds [new_tokens]).
    ``mode`` reads the mode actually used (``capture`` may have fallen back to ``compile``);
    ``fallback_error`` the capture error when it did.
    """

    def __init__(self, model: Any, batch_size: int, prompt_tokens: int, new_tokens: int, device: str,
                 mode: str = "none") -> None:
        from transformers import StaticCache

        if mode not in GRAPH_MODES[1:]:
            raise ValueError(f"Decoder mode must be one of {list(GRAPH_MODES[1:])}, got {mode!r}")
        self.model, self.new_tokens, self.device, self.mode = model, new_tokens, device, mode
        self.cache = StaticCache(config=model.config, max_cache_len=prompt_tokens + new_tokens + 1)
        self.ids = torch.zeros(batch_size, 1, dtype=torch.int64, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        # transformers >= 5.2x names the cache argument ``cache`` (``past_key_values`` is deprecated there)
        self.cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self.graph: Any = None
        self.fallback_error: str | None = None
        self._compiled: Callable[..., Any] | None = None

    # -- steps ---------------------------------------------------------------------------------
    def _forward_step(self, forward: Callable[..., Any]) -> None:
        logits = forward(input_ids=self.ids, cache_position=self.position, use_cache=True,
                         **{self.cache_arg: self.cache}).logits
        self.ids.copy_(logits[:, -1].argmax(dim=-1, keepdim=True))
        self.position.add_(1)

    def eager_step(self) -> None:
        """One decode step: forward of the current tokens, greedy next tokens into ``self.ids``, position + 1."""
        self._forward_step(self.model.__call__)

    def compiled_step(self) -> None:
        """The same step through ``torch.compile(mode="reduce-overhead")`` (compiled on first use)."""
        if self._compiled is None:
            self._compiled = torch.compile(self.model.__call__, mode="reduce-overhead", fullgraph=True,
                                           dynamic=False)
        if self.device == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        self._forward_step(self._compiled)

    def capture(self, capture_fn: Callable[[], Any] | None = None) -> None:
        """Capture ``eager_step`` in a CUDA graph (three warm-up steps on a side stream first); on failure
        warn, keep the error in ``fallback_error`` and switch to ``compile``. ``capture_fn`` replaces the
        capture (tests)."""
        try:
            self.graph = (capture_fn or self._capture_cuda_graph)()
        except RuntimeError as err:
            self.fallback_error = f"{type(err).__name__}: {err}"
            warnings.warn(f"oea bench decode: CUDA-graph capture of the decode step failed ({self.fallback_error}); "
                          "falling back to torch.compile(mode='reduce-overhead')", RuntimeWarning, stacklevel=2)
            self.mode = "compile"

    def _capture_cuda_graph(self) -> Any:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.eager_step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.eager_step()
        return graph

    def step_function(self) -> Callable[[], None]:
        """The step in the current mode (capture: the graph's replay)."""
        if self.mode == "capture":
            return self.graph.replay
        return self.compiled_step if self.mode == "compile" else self.eager_step

    # -- a run ---------------------------------------------------------------------------------
    def prefill(self, prompts: torch.Tensor) -> None:
        """Reset the cache, run the prompts (eager) and set the first generated token and the position."""
        self.cache.reset()
        prompts = prompts.to(self.device)
        length = prompts.shape[1]
        logits = self.model(input_ids=prompts, cache_position=torch.arange(length, device=self.device),
                            use_cache=True, **{self.cache_arg: self.cache}).logits
        self.ids.copy_(logits[:, -1].argmax(dim=-1, keepdim=True))
        self.position.fill_(length)

    @torch.no_grad()
    def run(self, prompts: torch.Tensor, timer: StepTimer, steps: int | None = None
            ) -> tuple[torch.Tensor, list[float]]:
        """Prefill ``prompts`` (untimed), then ``steps`` (default ``new_tokens``) timed greedy steps. In
        capture mode the first run captures the graph (its warm-up steps move the cache, so the prompts
        are prefilled again)."""
        self.prefill(prompts)
        if self.mode == "capture" and self.graph is None:
            self.capture()
            self.prefill(prompts)
        step = self.step_function()
        tokens, seconds = [self.ids[:, 0].clone()], []
        for _ in range(self.new_tokens if steps is None else min(steps, self.new_tokens)):
            seconds.append(timer(step))
            tokens.append(self.ids[:, 0].clone())
        return torch.stack(tokens, dim=1).cpu(), seconds
