"""Content checks of a routing trace: every malformed row is an error naming the file, field and row.

Shape legend: T = recorded tokens, L = MoE layers, N = routed experts, k = top-k.

Run on every trace that is built or loaded (``Trace(...)``, ``read_trace_file``, ``oea traces import``),
so ``oea simulate``, ``oea calibrate``, ``oea compare`` and the report never replay a bad row. A row is
one token at one layer; errors give the first offending row in token-major order as
``(token t, layer l)``.

* ``logits`` [T, L, N]: no NaN, and in every row at least one logit above -inf (-inf marks an expert the
  router cannot choose; a row without any choosable expert routes nowhere).
* ``ids`` [T, L, k]: integers, each in ``0..N-1``, k distinct experts per row.
* ``scores`` [T, L, k]: router probabilities: finite, in ``[0, 1]``, and not increasing along k (ids
  are best first). Where a per-layer ``correction_bias`` exists the router ranks by biased scores, so
  the order of the unbiased scores says nothing and is not checked.
* ``request_ids`` / ``positions`` / ``step_ids`` [T]: integers; positions and step ids ``>= 0``.
* ``correction_bias`` [L, N]: finite.

Without scores the best-first order of id-only rows cannot be checked (``ordering_status``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from oea.routing import RouterSpec


class TraceTensors(Protocol):
    """What the checks read of a trace (``oea.traces.format.Trace`` has it; this module does not import it)."""

    spec: RouterSpec
    logits: torch.Tensor | None
    ids: torch.Tensor | None
    scores: torch.Tensor | None
    request_ids: torch.Tensor | None
    positions: torch.Tensor | None
    step_ids: torch.Tensor | None
    correction_bias: torch.Tensor | None

# float16 storage rounds a probability of 1.0 up by at most one ulp (~1e-3)
SCORE_MAX = 1.0 + 1e-3


def _fail(where: str, field_name: str, message: str) -> None:
    raise ValueError(f"{where}: field {field_name!r}: {message}")


def first_row(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True entry of ``mask`` in row-major order (e.g. ``(token, layer)``)."""
    flat = int(torch.nonzero(mask.reshape(-1))[0, 0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


def _row(index: tuple[int, ...]) -> str:
    return f"token {index[0]}" if len(index) == 1 else f"row (token {index[0]}, layer {index[1]})"


def check_integer(tensor: torch.Tensor, where: str, field_name: str) -> None:
    """Raise ``ValueError`` when ``tensor`` is not an integer tensor, naming the first non-integer row.

    ``tensor`` is [T, L, k] (ids) or [T] (request ids, positions).
    """
    if not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool:
        return
    if tensor.dtype == torch.bool:
        _fail(where, field_name, "must hold integers, got bool")
    values = tensor.double()
    fractional = ~torch.isfinite(values) | (values != values.round())
    if tensor.dim() > 2:
        fractional = fractional.any(-1)
    if bool(fractional.any()):
        index = first_row(fractional)
        _fail(where, field_name, f"must hold integers, got {_dtype(tensor)} with the non-integer value(s) "
              f"{_show(tensor[index])} at {_row(index)}")
    _fail(where, field_name, f"must be an integer tensor, got {_dtype(tensor)} (whole numbers stored as floats; "
          f"convert them, e.g. numpy's arr.astype('int64'))")


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _show(values: torch.Tensor) -> str:
    items = values.tolist()
    if isinstance(items, list):
        return "[" + ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in items) + "]"
    return f"{items:g}" if isinstance(items, float) else str(items)


def check_ids(ids: torch.Tensor, num_experts: int, where: str) -> None:
    """[T, L, k] integer ids: every id in ``0..N-1`` and no id twice in a row."""
    out_of_range = ((ids < 0) | (ids >= num_experts)).any(-1)
    if bool(out_of_range.any()):
        index = first_row(out_of_range)
        _fail(where, "ids", f"ids must lie in 0..{num_experts - 1} (num_experts={num_experts}), "
              f"{_row(index)} holds {_show(ids[index])}")
    if ids.shape[-1] > 1:
        ordered = ids.sort(dim=-1).values
        duplicated = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
        if bool(duplicated.any()):
            index = first_row(duplicated)
            row = ids[index]
            repeated = sorted({int(v) for v in row.tolist() if int((row == v).sum()) > 1})
            _fail(where, "ids", f"each row must list {ids.shape[-1]} distinct experts, {_row(index)} holds "
                  f"{_show(row)} (expert {', '.join(map(str, repeated))} twice)")


def _share(mask: torch.Tensor) -> str:
    return f"{int(mask.sum())} of {mask.numel()} rows"


def check_logits(logits: torch.Tensor, where: str) -> None:
    """[T, L, N] router logits: no NaN, and every row with a logit above -inf."""
    nan = torch.isnan(logits)
    if bool(nan.any()):
        rows = nan.any(-1)
        index = first_row(rows)
        _fail(where, "logits", f"router logits must not be NaN (-inf marks an expert the router cannot choose), "
              f"{_row(index)} holds {int(nan[index].sum())} NaN of {logits.shape[-1]} ({_share(rows)} hold NaN)")
    empty = ~(logits > float("-inf")).any(-1)
    if bool(empty.any()):
        index = first_row(empty)
        _fail(where, "logits", f"every row needs a logit above -inf (an expert the router can choose), "
              f"{_row(index)} holds only -inf ({_share(empty)})")


def check_scores(scores: torch.Tensor, where: str, check_order: bool = True) -> None:
    """[T, L, k] router probabilities: finite, in [0, 1] and, when ``check_order``, best first."""
    bad = ~torch.isfinite(scores)
    if bool(bad.any(-1).any()):
        index = first_row(bad.any(-1))
        _fail(where, "scores", f"scores must be finite router probabilities, {_row(index)} holds "
              f"{_show(scores[index])}")
    for mask, what in ((scores < 0, "negative"), (scores > SCORE_MAX, "above 1")):
        if bool(mask.any()):
            index = first_row(mask.any(-1))
            _fail(where, "scores", f"scores must be router probabilities in [0, 1], {_row(index)} holds "
                  f"{what} values {_show(scores[index])}")
    if check_order and scores.shape[-1] > 1:
        rising = (scores[..., 1:] > scores[..., :-1]).any(-1)
        if bool(rising.any()):
            index = first_row(rising)
            _fail(where, "scores", f"rows must be best first (scores not increasing along k), {_row(index)} "
                  f"holds {_show(scores[index])}; sort each row by descending score "
                  f"(`oea traces import --sort-by-scores`)")


def check_positions(positions: torch.Tensor, where: str, field_name: str = "positions") -> None:
    """[T] decode positions (or step ids) must be >= 0."""
    negative = positions < 0
    if bool(negative.any()):
        index = first_row(negative)
        _fail(where, field_name, f"{field_name} must be >= 0, {_row(index)} has {int(positions[index])}")


def check_contents(trace: TraceTensors, where: str) -> None:
    """Every content check above on a trace whose shapes are already validated."""
    if trace.logits is not None:
        check_logits(trace.logits, where)
    if trace.ids is not None:
        check_integer(trace.ids, where, "ids")
        check_ids(trace.ids, trace.spec.num_experts, where)
    if trace.scores is not None:
        check_scores(trace.scores, where, check_order=trace.correction_bias is None)
    for name in ("request_ids", "positions", "step_ids"):
        tensor = getattr(trace, name)
        if tensor is not None:
            check_integer(tensor, where, name)
    for name in ("positions", "step_ids"):
        tensor = getattr(trace, name)
        if tensor is not None:
            check_positions(tensor, where, name)
    bias = trace.correction_bias
    if bias is not None and not bool(torch.isfinite(bias).all()):
        index = first_row(~torch.isfinite(bias))
        _fail(where, "correction_bias", f"must hold finite values, layer {index[0]} expert {index[1]} holds "
              f"{_show(bias[index])}")


SIDECAR_STRINGS: tuple[str, ...] = ("name", "source", "licence", "model", "kind")


def check_sidecar(meta: dict, where: str) -> None:
    """The documented optional sidecar fields: ``name``/``source``/``licence``/``model``/``kind`` strings,
    ``model_preset`` one of oea's model preset names or null, ``notes`` a list of strings (other keys are free-form)."""
    for name in SIDECAR_STRINGS:
        if name in meta and not isinstance(meta[name], str):
            _fail(where, name, f"must be a string, got {meta[name]!r}")
    if meta.get("model_preset") is not None and not isinstance(meta["model_preset"], str):
        _fail(where, "model_preset", f"must be a preset name (string) or null, got {meta['model_preset']!r}")
    if isinstance(meta.get("model_preset"), str):
        from oea.presets import MODEL_PRESETS  # the latency model looks the name up: an unknown one is refused here

        if meta["model_preset"] not in MODEL_PRESETS:
            _fail(where, "model_preset", f"must be one of oea's model presets {list(MODEL_PRESETS)} or null, got "
                                         f"{meta['model_preset']!r}")
    notes = meta.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
        _fail(where, "notes", f"must be a list of strings, got {notes!r}")


def ordering_status(trace: TraceTensors) -> str:
    """How far the best-first order of the recorded ids is known to hold (shown by ``oea traces``)."""
    if trace.ids is None:
        return "full logits: the router's ranking is recomputed, no order to check"
    if trace.scores is None:
        return ("unchecked: ids only, no scores, so best-first order within a row cannot be verified; "
                "the simulator takes the recorded order as the router's ranking")
    if trace.correction_bias is not None:
        return "unchecked: the router ranks by bias-corrected scores, the recorded scores are unbiased"
    return "checked: scores do not increase along each row"
