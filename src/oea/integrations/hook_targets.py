"""What an engine plugin relies on in the engine's source, declared once per plugin (``vllm/targets.py``,
``sglang/targets.py``) and checked against the released wheels' source with ``ast`` (no import, no CUDA
torch; ``tests/engines/test_cuda_release_targets.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HookTarget:
    """One name of the engine the plugin patches, wraps, calls or reads.

    Attributes:
        module: the engine module (``vllm.v1.worker.worker_base``).
        name: ``Class``, ``Class.method``, ``Class.attribute`` or ``function`` inside it.
        kind: ``"function"`` (a def, method or property), ``"class"``, or ``"attribute"`` (assigned as
            ``self.<name>``, a class-level or dataclass field, or a property, in the class or a base class).
        parameters: names the function must have (any position); ``leading``: its first parameters, in order.
        calls: names the function's body must call (what the hook relies on happening after it); ``a|b``:
            either.
        why: what the plugin does with it.
    """

    module: str
    name: str
    kind: str = "function"
    parameters: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    why: str = ""

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"
