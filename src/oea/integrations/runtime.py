"""What every engine adapter needs at run time, engine-free: warn-once, graph-capture detection, the
process rank and method wrapping. The adapters' ``state.py`` bind these to their logger and state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

WRAPPED = "_oea_wrapped"  # marks a function this project put in place of an engine's own


class WarnOnce:
    """Logs a warning the first time its key is seen in this process, prefixed ``oea: ``.

    ``seen`` gives the set of keys already warned about (the adapter's per-process state, which tests swap).
    """

    def __init__(self, log: logging.Logger, seen: Callable[[], set[str]]) -> None:
        self.log = log
        self.seen = seen

    def __call__(self, key: str, message: str) -> bool:
        """Warn with ``message`` unless ``key`` was seen; returns whether it warned."""
        return self._once(key, lambda: self.log.warning("oea: %s", message))

    def exception(self, key: str, message: str) -> bool:
        """``__call__`` with the current exception's traceback (inside an ``except`` block)."""
        return self._once(key, lambda: self.log.exception("oea: %s", message))

    def _once(self, key: str, emit: Callable[[], None]) -> bool:
        seen = self.seen()
        if key in seen:
            return False
        seen.add(key)
        emit()
        return True


def graph_capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph.

    A capture needs an initialised CUDA context, so ``is_initialized`` answers first: the test never
    initialises CUDA itself (``is_available`` may), costs nothing on CPU-only hosts and is False there.
    """
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def tracing() -> bool:
    """Inside a graph being compiled (Dynamo) or captured (CUDA graphs): a decision must then live on the device."""
    return torch.compiler.is_compiling() or graph_capturing()


def process_rank() -> int:
    """This process's global rank in the engine's ``torch.distributed`` world (0 when there is none)."""
    dist = torch.distributed
    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


def wrap_method(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.name`` by ``make(original)`` once (idempotent: a wrapper of ours is not wrapped again).

    The wrapper is marked (``WRAPPED``) and keeps the original as ``__wrapped__``. Returns whether it wrapped.
    """
    original = getattr(owner, name, None)
    if original is None or getattr(original, WRAPPED, False):
        return False
    wrapper = make(original)
    setattr(wrapper, WRAPPED, True)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    return True


def call_after(owner: Any, name: str, after: Callable[[], Any]) -> bool:
    """``wrap_method`` with a wrapper that runs the original, then ``after()``, and returns the original's result."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = wrapper.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]  # the original (a seam for tests)
            after()
            return out

        return wrapper

    return wrap_method(owner, name, make)
