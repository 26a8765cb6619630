"""The hooks the plugin puts into SGLang, and whether they are in place.

* Decode detection, chosen by signature (``decode_detection``): an AROUND hook on
  ``forward_context(ctx, *, forward_batch)`` where it carries the batch (0.5.23+); else on
  ``ModelRunner.forward(self, forward_batch)`` plus the graph runners' capture (``capture_forward_mode``):
  0.5.12, which has no ``forward_context``, and 0.5.13-0.5.22, whose ``forward_context(ctx)`` never sees
  the batch. Each pushes the batch's ``ForwardMode`` on the per-thread stack of ``state.py`` for the
  duration of the forward (or capture).
* The rewrite: ``routing.post_process_before`` and ``routing.select_experts_before`` (BEFORE hooks).
* ``OEA_METRICS_FILE``: the phase hooks also hold each forward's metrics row (``metrics.forward``).
* CUDA-graph padding: ``padding.replay_around`` on the graph runners' replay preparation; the phase hooks
  also push each forward's row frame (``padding.batch_rows``).

``hook_plan`` lists (target, hook, kind) for the installed SGLang; ``target_hooked`` tells whether a
hook is in a target's wrapper chain (put there by SGLang's ``HookRegistry`` or by ``plugin._patch``).
Target names are read from ``targets`` at call time.
"""

from __future__ import annotations

import contextlib
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any

import oea.integrations.sglang.metrics as metrics
import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.recording as recording
import oea.integrations.sglang.targets as targets
from oea.integrations.sglang.routing import post_process_before, select_experts_around_legacy, select_experts_before
from oea.integrations.sglang.state import STATE, forward_mode, log, warn_once

_NO_MODE = object()


def _forward_context_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``forward_context(ctx, *, forward_batch=None)``: returns a context manager."""
    forward_batch = kwargs.get("forward_batch", args[1] if len(args) > 1 else None)
    mode = getattr(forward_batch, "forward_mode", None) if forward_batch is not None else None
    return _phase_context(original(*args, **kwargs), mode, forward_batch)


@contextlib.contextmanager
def _phase_context(inner: Any, mode: Any, forward_batch: Any) -> Iterator[Any]:
    _note_phase_hook()
    with forward_mode(mode), padding.batch_rows(forward_batch, mode), recording.forward(forward_batch, mode), \
            metrics.forward(forward_batch, mode), inner as value:
        yield value


def _model_runner_forward_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ModelRunner.forward(self, forward_batch, ...)`` (versions whose forward_context lacks the batch)."""
    forward_batch = kwargs.get("forward_batch", args[1] if len(args) > 1 else None)
    with model_runner_phase(forward_batch):
        return original(*args, **kwargs)


@contextlib.contextmanager
def model_runner_phase(forward_batch: Any) -> Iterator[None]:
    """What the ``ModelRunner.forward`` hook holds around one forward of ``forward_batch``: its mode (a batch
    without ``forward_mode`` warns once and keeps SGLang's routing), row frame and recording."""
    _note_phase_hook()
    mode = getattr(forward_batch, "forward_mode", _NO_MODE)
    if mode is _NO_MODE:
        warn_once("mode-unknown", f"{targets.MODEL_RUNNER_FORWARD_TARGET} got no batch with a forward_mode "
                                  f"(sglang {targets.engine_version()}; supported: {targets.SUPPORTED_VERSIONS}); "
                                  "such forwards keep SGLang's routing")
        mode = None
    with forward_mode(mode), padding.batch_rows(forward_batch, mode), recording.forward(forward_batch, mode), \
            metrics.forward(forward_batch, mode):
        yield


def _graph_capture_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND a graph runner's capture of one batch size (``targets.graph_capture_targets``; versions whose
    ``forward_context`` lacks the batch): the runner's ``capture_forward_mode`` is the captured graph's mode."""
    runner = args[0] if args else None
    _note_phase_hook()
    with forward_mode(getattr(runner, "capture_forward_mode", None)), padding.capture_rows(runner, args[1:], kwargs):
        return original(*args, **kwargs)


def _note_phase_hook() -> None:
    """On the first forward of the process: say loudly when the rewrite hook did not get installed, and
    (once, with the workaround) when the CUDA-graph replay hook did not."""
    if not STATE.phase_hook_seen:
        STATE.phase_hook_seen = True
        missing = [t for t in (targets.POST_PROCESS_TARGET,) if not target_hooked(t)]
        if missing:
            log.error("oea: OEA_K0 is set but the routing hook is not installed on %s; serving WITHOUT OEA "
                      "(supported SGLang versions: %s; run `oea doctor sglang`)", missing,
                      targets.SUPPORTED_VERSIONS)
        padding.check_replay_hooks(target_hooked)


def decode_detection(phase_via_forward_context: bool | None = None) -> list[tuple[str, Callable[..., Any]]]:
    """(target, AROUND hook) that tell decode forwards apart on this SGLang, chosen by signature:
    ``forward_context`` where it takes ``forward_batch``, else ``ModelRunner.forward`` and the graph captures."""
    if phase_via_forward_context is None:
        phase_via_forward_context = targets.forward_context_takes_batch()
    if phase_via_forward_context:
        return [(targets.FORWARD_CONTEXT_TARGET, _forward_context_around)]
    return [(targets.MODEL_RUNNER_FORWARD_TARGET, _model_runner_forward_around),
            *((target, _graph_capture_around) for target in targets.graph_capture_targets())]


def hook_plan(phase_via_forward_context: bool | None = None) -> list[tuple[str, Callable[..., Any], str]]:
    """(target, hook, HookType name) for this SGLang version, in registration order."""
    plan = [(target, hook, "AROUND") for target, hook in decode_detection(phase_via_forward_context)]
    plan.append((targets.SELECT_EXPERTS_TARGET, select_experts_before, "BEFORE"))
    plan.append((targets.POST_PROCESS_TARGET, post_process_before, "BEFORE"))
    plan.extend(padding.replay_plan())  # only the hook points this SGLang has (padding.replay_targets)
    return plan


def _phase_hooks() -> dict[str, Callable[..., Any]]:
    """Each decode-detection target's own hook, whichever path the plan picks."""
    return {targets.FORWARD_CONTEXT_TARGET: _forward_context_around,
            targets.MODEL_RUNNER_FORWARD_TARGET: _model_runner_forward_around,
            targets.DECODE_GRAPH_CAPTURE_TARGET: _graph_capture_around,
            targets.GRAPH_CAPTURE_TARGET: _graph_capture_around,
            targets.CPU_GRAPH_CAPTURE_TARGET: _graph_capture_around}


def resolve(dotted: str) -> Any:
    """The object a dotted name refers to (module attribute or class attribute)."""
    return pkgutil.resolve_name(dotted)


def has_hook(fn: Any, hook: Callable[..., Any]) -> bool:
    """True when ``hook`` is somewhere in the wrapper chain of ``fn`` (HookRegistry or ``_patch``)."""
    seen = 0
    while fn is not None and seen < 32:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def target_hooked(target: str) -> bool:
    """Whether the OEA hook planned for ``target`` is installed in this process."""
    hooks = {t: h for t, h, _ in hook_plan()} | _phase_hooks() | {targets.SELECT_EXPERTS_TARGET: select_experts_before}
    hook = hooks.get(target)
    if hook is None:
        return False
    try:
        current = resolve(target)
    except (ImportError, AttributeError):
        return False
    if target == targets.SELECT_EXPERTS_TARGET and has_hook(current, select_experts_around_legacy):
        return True
    return has_hook(current, hook)


def hooks_status() -> dict[str, bool]:
    """``{target: installed}`` for every routing target this process registered (or planned); the replay
    hooks (CUDA-graph padding, ``padding_targets``) are reported apart, by ``padding.check_replay_hooks``."""
    planned = STATE.installed_targets or tuple(t for t, _, _ in hook_plan())
    return {target: target_hooked(target) for target in planned if target not in padding_targets()}


def padding_targets() -> set[str]:
    """Every replay hook point the plugin knows (hooked on the versions that have it)."""
    return {padding.DECODE_REPLAY_TARGET, padding.LEGACY_REPLAY_TARGET, padding.CPU_REPLAY_TARGET}
