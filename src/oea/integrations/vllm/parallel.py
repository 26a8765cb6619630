"""Data parallelism in the vLLM plugin: which routing calls OEA may rewrite when several DP ranks run.

Each DP rank decides decode or not from its own ``SchedulerOutput``, and an idle rank runs dummy batches
outside ``execute_model`` (``steps.end_step`` clears the decode flag, so those keep vLLM's routing). That is
consistent as long as every rank routes only its own rows (vLLM's modular MoE kernels: routing before the
dispatch to the expert-parallel ranks; the union is then local to the rank).

When vLLM instead gathers every DP rank's router logits before routing (the naive dispatch/combine path,
``MoERunner._maybe_dispatch``), every rank routes the same gathered rows, some of them another rank's
prefill, padding or dummy rows, and the ranks' decode flags can differ: OEA on one rank and stock routing
on another would send a token to different experts on different ranks. Such calls keep vLLM's own routing
(``gathered_across_dp``), with one warning.
"""

from __future__ import annotations

from oea.integrations.vllm.state import STATE, warn_once


def gathered_across_dp(rows: int) -> bool:
    """True when this routing call holds every DP rank's rows (logits gathered before routing).

    Read from the forward context's ``dp_metadata`` (tokens per DP rank) once per step and row count.
    """
    key = (STATE.step, rows)
    cached = STATE.dp_gathered
    if cached is not None and cached[0] == key:
        return cached[1]
    gathered = _gathered(rows)
    STATE.dp_gathered = (key, gathered)
    if gathered:
        warn_once("dp-gathered", "vLLM gathers the router logits of every data-parallel rank before routing "
                                 "(naive DP dispatch); ranks can be in different phases, so these layers keep "
                                 "vLLM's routing (OEA needs per-rank routing before dispatch under DP)")
    return gathered


def _gathered(rows: int) -> bool:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return False
    dp_metadata = getattr(get_forward_context(), "dp_metadata", None)
    counts = getattr(dp_metadata, "num_tokens_across_dp_cpu", None)
    # A rank's own batch is at most the largest rank's token count; more rows hold other ranks' rows too.
    return counts is not None and counts.numel() > 1 and rows > int(counts.max())
