"""What the SGLang check scripts share (they run inside .venv-sglang, against SGLang's real routing code on CPU).

Importing this module sets the process up as every script needs it: one compute thread, Dynamo off (SGLang's
grouped top-k helpers are ``@torch.compile``'d and Inductor on CPU costs ~20 s per new shape), and SGLang's
CPU engine off (it needs ``sgl_kernel``, which has no CPU build). Then: SGLang's run-time context published for
a test process, SGLang's modules, a batch in a forward mode, a ``select_experts`` call, the two comparisons of
routings the checks report (same routing, bit-identical output), the check record list and the warnings logged.

Shape legend: M = rows, k = slots per row.
"""

from __future__ import annotations

import contextlib
import logging
import os
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)

import torch

torch.set_num_threads(1)
torch._dynamo.config.disable = True

Routing = tuple[torch.Tensor, torch.Tensor]  # ids [M, k], weights [M, k]


def publish_test_context(args: Any | None = None, dp_rank: int | None = None, **server_args: Any) -> Any:
    """Publish SGLang's run-time context for this process (a test process, world rank 0, DP rank ``dp_rank``)
    and return its ``ServerArgs``: ``args`` when given, else ``ServerArgs(model_path="dummy", device="cpu",
    **server_args)``."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    args = ServerArgs(model_path="dummy", device="cpu", **server_args) if args is None else args
    publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=dp_rank))
    return args


def sglang_modules(args: Any | None = None, **server_args: Any) -> SimpleNamespace:
    """The context published (``publish_test_context(args, **server_args)``) and the SGLang modules the checks
    drive: ``topk``, ``fc`` (forward context), ``plugins``, ``ForwardMode``."""
    import sglang.srt.layers.moe.topk as topk
    import sglang.srt.model_executor.forward_context as fc
    import sglang.srt.plugins as plugins
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    publish_test_context(args, **server_args)
    return SimpleNamespace(topk=topk, fc=fc, plugins=plugins, ForwardMode=ForwardMode)


def in_mode(sg: SimpleNamespace, mode_name: str | None, non_padded: torch.Tensor | None = None
            ) -> contextlib.AbstractContextManager[Any]:
    """SGLang's own ``forward_context(...)`` with a batch in ``mode_name`` (None: no forward context)."""
    if mode_name is None:
        return contextlib.nullcontext()
    ctx = sg.fc.ForwardContext(attn_backend=None)
    bound = None if non_padded is None else (lambda: non_padded)
    batch = SimpleNamespace(forward_mode=getattr(sg.ForwardMode, mode_name), moe_num_token_non_padded=bound)
    return sg.fc.forward_context(ctx, forward_batch=batch)  # looked up at call time: the hooked version


def select(sg: SimpleNamespace, config: Any, logits: torch.Tensor, layer_id: int = 0, **kwargs: Any) -> Routing:
    """SGLang's ``select_experts`` on router ``logits`` [M, N] (the hidden states are not read)."""
    out = sg.topk.select_experts(hidden_states=torch.zeros(logits.shape[0], 4), router_logits=logits,
                                 topk_config=config, layer_id=layer_id, **kwargs)
    return out.topk_ids.clone(), out.topk_weights.clone()


def same(a: Routing, b: Routing) -> tuple[bool, str]:
    """Whether two routings agree (``oea.routing.routing_difference``: slot order and filler slots aside)."""
    from oea.routing import routing_difference

    difference = routing_difference(a[0].long(), a[1].float(), b[0].long(), b[1].float())
    return difference is None, difference or "equal"


def identical(a: Routing, b: Routing) -> tuple[bool, str]:
    """Whether two outputs are bit for bit the same (dtypes, slot order and all): what "untouched" means."""
    ok = a[0].dtype == b[0].dtype and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    if ok:
        return True, "bitwise identical"
    same_ids = a[0].shape == b[0].shape and torch.equal(a[0].long(), b[0].long())
    diff = (a[1].float() - b[1].float()).abs().max().item() if a[1].shape == b[1].shape else "shape"
    return False, f"changed: dtypes {a[0].dtype}/{b[0].dtype}, ids equal {same_ids}, max weight diff {diff}"


class Checks:
    """The report's check records: ``check(name, ok, detail)`` appends one; ``records`` is the JSON list."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, name: str, ok: bool, detail: str) -> None:
        self.records.append({"name": name, "ok": bool(ok), "detail": detail})


def logged_warnings() -> list[str]:
    """The messages of every warning logged from now on (a handler on the root logger)."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger().addHandler(_Collect(level=logging.WARNING))
    return messages
