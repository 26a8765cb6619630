"""The verdicts of ``oea doctor --metrics-file`` and ``--metrics-url``, written once: did OEA engage in the decode
forwards it should have, how many experts they used against the engine's own routing, padding rows.

Each source reads its own way (``oea.integrations.served``: a metrics file's lines; ``doctor.live``: the
``oea_*`` series of a server's ``/metrics``) into one ``Served`` and gets its checks from ``served_verdicts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oea.integrations.doctor.common import Check, check


@dataclass
class Served:
    """What a served source counted. ``eligible``: decode forwards OEA should have rewritten (>= ``min_batch``
    real rows); ``engaged``: those it did; ``active`` / ``stock``: the mean experts per layer and
    forward as shown (``-`` when none), ``ratio`` their quotient; ``reasons``: the forwards that kept the engine's
    routing, by reason (None: the source does not say)."""

    source: str  # the first check's subject: "FILE: 12 forwards" / "URL: 12 forwards"
    forwards: int
    decode: int
    ranks: list[int]
    eligible: int
    engaged: int
    min_batch: int
    active: str = "-"
    stock: str = "-"
    ratio: float | None = None
    padded: int = 0
    padding: str = "-"
    reasons: dict[str, int] | None = field(default=None)


def served_verdicts(found: Served, what: str = "metrics file") -> list[Check]:
    """The checks of one served source: ``what`` (the source read), ``OEA engaged``, ``active experts``,
    ``padding rows``, and ``passthrough reasons`` where the source counts them. A failed one fails the doctor."""
    decode, eligible, engaged = found.decode, found.eligible, found.engaged
    enough = f">= {found.min_batch} real rows"
    checks = [
        check(
            what,
            decode > 0,
            f"{found.source}, {decode} decode on rank(s) {found.ranks}"
            if decode
            else f"{found.source}, none of them decode: send traffic that generates tokens",
        )
    ]
    if not decode:
        return checks
    if not eligible:
        checks.append(
            check(
                "OEA engaged",
                False,
                f"no decode forward had {enough} (min_batch): nothing to engage "
                f"on; serve at a concurrency >= {found.min_batch}",
            )
        )
    elif not engaged:
        checks.append(
            check(
                "OEA engaged",
                False,
                f"OEA engaged in 0 of {eligible} decode forwards with "
                f"{enough}: the routing hook never rewrote a decode "
                "step (OEA_K0 unset on the server, or its decode detection never "
                "fired): run `oea doctor` in the server's environment",
            )
        )
    else:
        rest = (
            ""
            if engaged == eligible
            else (
                f"; the other {eligible - engaged} kept the engine's routing in at "
                "least one layer (see the server log's `oea:` warnings)"
            )
        )
        checks.append(
            check(
                "OEA engaged",
                True,
                f"OEA engaged in {engaged} of {eligible} decode forwards with "
                f"{enough} ({100 * engaged / eligible:.0f}%){rest}",
            )
        )
    if eligible:
        ratio = f" = {found.ratio:.2f}x" if found.ratio is not None else ""
        checks.append(
            check(
                "active experts",
                True,
                f"per layer and decode forward{'' if engaged else ' (not rewritten)'}: "
                f"{found.active} vs the engine's own routing of the same logits {found.stock}{ratio}",
            )
        )
    if found.padded:
        checks.append(
            check(
                "padding rows",
                True,
                f"{found.padded} of {decode} decode forwards carried CUDA-graph padding rows "
                f"(mean {found.padding}); they keep the engine's own routing, and a MoE "
                "kernel that runs every row loads their experts although no real token needs them (not "
                "counted in `active`); capturing every decode batch size your traffic reaches avoids "
                "them (docs/sglang.md, 'Why the reference deployment measured ~0%')",
            )
        )
    if found.reasons:
        said = ", ".join(f"{reason} {count}" for reason, count in sorted(found.reasons.items()))
        failed = found.reasons.get("layer_failed", 0)
        checks.append(
            check(
                "passthrough reasons",
                not failed,
                f"decode and verify forwards that kept the engine's routing: {said}"
                + (" (a layer's OEA routing raised: see the server log's `oea:` warning)" if failed else ""),
            )
        )
    return checks
