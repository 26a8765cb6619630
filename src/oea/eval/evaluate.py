"""``oea.eval.evaluate``: cross-entropy, active experts and generation agreement per policy, k0 and B.

For each batch size B, B windows of different held-out documents are decoded in lock step (see
``oea.eval.decode``) once per policy, with ``oea.attach`` rewriting every decode step's routing.
Cross-entropy is averaged per document first; the row reports the mean over documents with its
interval, and the paired t-test on per-document differences to vanilla decides the verdict
(``oea.eval.summary``, statistics from ``oea.stats``).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

from oea.eval.decode import DecodeCounts, greedy_generate, lockstep_cross_entropy
from oea.eval.sequences import document_windows, make_batches
from oea.eval.summary import quality_fields, routing_fields

POLICIES: tuple[str, ...] = ("vanilla", "pruned", "oea")
PREFILL_TOKENS = 8  # window tokens given as a prefill before the lock-step decode starts
PROMPT_TOKENS = 32  # prompt length of the generation-agreement check
DOCUMENTS_PER_SIZE = 16  # default num_batches covers at least this many windows per batch size


def _resolve_model(model: Any, tokenizer: Any) -> tuple[Any, Any, pathlib.Path | None]:
    from oea.models import embedded_model_dir, load_model

    if model is None or isinstance(model, (str, pathlib.Path)):
        path = None if model is None else pathlib.Path(model)
        loaded, tok = load_model(path)
        return loaded, tokenizer or tok, embedded_model_dir() if path is None else path
    if tokenizer is None:
        from transformers import AutoTokenizer

        name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
        if not name or not pathlib.Path(name).is_dir():
            raise ValueError("a loaded model needs tokenizer=... (its name_or_path is not a local directory)")
        tokenizer = AutoTokenizer.from_pretrained(name)
    name = getattr(model, "name_or_path", None) or ""
    return model, tokenizer, pathlib.Path(name) if name and pathlib.Path(name).is_dir() else None


def _documents(model_dir: pathlib.Path | None) -> list[tuple[str, str]]:
    """Held-out stdlib documents: the model's own list when it ships one, else the embedded model's."""
    from oea.models import HELDOUT_FILE, heldout_documents

    if model_dir is not None and (model_dir / HELDOUT_FILE).is_file():
        return heldout_documents(model_dir)
    return heldout_documents()


def _check_arguments(policies: Sequence[str], k0s: Sequence[int], top_k: int, batch_sizes: Sequence[int]) -> None:
    from oea.routing import policy_names

    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"policies must be among {list(POLICIES)} (registered: {policy_names()}), got {name!r}")
    for k0 in k0s:
        if not isinstance(k0, int) or not 1 <= k0 <= top_k:
            raise ValueError(f"k0 must be an integer in 1..{top_k} (the model's top_k), got {k0!r}")
    for b in batch_sizes:
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"batch sizes must be integers >= 1, got {b!r}")


def _check_draft_tokens(draft_tokens: int, positions: int) -> None:
    """Verify-shaped decoding needs 1 + d below the prefill's length and dividing ``positions``."""
    most = PREFILL_TOKENS - 2
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 0 <= draft_tokens <= most:
        raise ValueError(f"draft_tokens (--draft-tokens) must be an integer in 0..{most}, got {draft_tokens!r}")
    if positions % (1 + draft_tokens):
        raise ValueError(f"positions ({positions}, --positions) must be a multiple of 1 + draft_tokens "
                         f"({1 + draft_tokens}): each verify-shaped decode step scores 1 + d positions per window")


def _num_batches(batch_size: int, num_batches: int | None) -> int:
    """Batches at one batch size: ``num_batches`` or enough for ``DOCUMENTS_PER_SIZE`` windows; an
    interval over documents needs at least two of them."""
    count = num_batches if num_batches is not None else math.ceil(DOCUMENTS_PER_SIZE / batch_size)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"num_batches must be an integer >= 1, got {count!r}")
    if batch_size * count < 2:
        raise ValueError(f"B={batch_size} with num_batches={count} decodes a single document; an interval needs "
                         f"at least 2 (use num_batches >= 2, or leave it unset)")
    return count


def _run_policy(model: Any, cfg: object | None, batches: list, generate_tokens: int, step_tokens: int = 1
                ) -> dict[str, Any]:
    """Decode every batch under ``cfg`` (None = vanilla), ``step_tokens`` positions per window and decode step;
    per-row CE, counts and generated tokens."""
    import oea

    counts = DecodeCounts()
    losses = []
    handle = oea.attach(model, cfg, decode_only=True, decode_tokens=step_tokens)
    try:
        for batch in batches:
            losses.append(lockstep_cross_entropy(model, batch.ids, PREFILL_TOKENS, handle, counts, step_tokens))
        generated = None
        if generate_tokens:
            generated = greedy_generate(model, batches[0].ids[:, :PROMPT_TOKENS], generate_tokens)
    finally:
        handle.remove()
    return {"losses": losses, "counts": counts, "generated": generated}


def _per_document_ce(losses: list[torch.Tensor], batches: list) -> dict[int, float]:
    sums: dict[int, float] = {}
    tokens: dict[int, int] = {}
    for loss, batch in zip(losses, batches, strict=True):
        for row, doc in enumerate(batch.documents):
            sums[doc] = sums.get(doc, 0.0) + float(loss[row].double().sum())
            tokens[doc] = tokens.get(doc, 0) + loss.shape[1]
    return {doc: sums[doc] / tokens[doc] for doc in sums}


def evaluate(
    model: Any = None,
    *,
    batch_sizes: Sequence[int] = (1, 4, 16, 64),
    k0s: Sequence[int] = (3, 5),
    policies: Sequence[str] = POLICIES,
    num_batches: int | None = None,
    positions: int = 32,
    seed: int = 0,
    generate_tokens: int = 16,
    tokenizer: Any = None,
    progress: Any = None,
    extra_policies: Sequence[tuple[str, object]] = (),
    draft_tokens: int = 0,
) -> list[dict[str, Any]]:
    """Evaluate routing policies on held-out text by teacher-forced lock-step batched decoding.

    Args:
        model: None (the embedded model), a checkpoint directory, or a loaded HF MoE model (then
            pass ``tokenizer`` unless ``model.name_or_path`` is a local directory).
        batch_sizes: decode batch sizes B; each batch holds windows of different documents.
        k0s: k0 values for the "pruned" and "oea" policies (1..top_k).
        policies: among "vanilla", "pruned", "oea" (built with ``oea.routing.make_policy``);
            vanilla is always evaluated as the reference.
        num_batches: batches per B; default ``ceil(16 / B)``.
        positions: decode steps per window (CE is measured on these ``positions`` predictions;
            each window also has ``PREFILL_TOKENS`` prefill tokens).
        seed: shuffles the document order.
        generate_tokens: greedy tokens generated per row with ``model.generate`` for the
            agreement check on the first batch (0 disables it; the first token comes from the
            prefill, so agreement counts the other ``generate_tokens - 1``).
        progress: optional callable ``progress(description: str)`` called before each run.
        extra_policies: ``(label, config)`` pairs evaluated after the named policies at every B, for
            configs ``make_policy`` cannot build from a k0 alone (budget, subtractive, adaptive,
            per-layer ...); their rows carry ``policy=label`` and ``k0`` = the config's k0 or None.
        draft_tokens: d > 0 makes every decode step verify-shaped: each window feeds its next 1 + d tokens
            and the B (1 + d) rows are routed together, as in a speculative verify step whose d drafts are all
            accepted; ``positions`` must be a multiple of 1 + d. 0: plain decode (one token per window).
            Generation agreement still comes from plain greedy decoding.

    Returns:
        One dict per (B, policy, k0): ``policy``, ``k0`` (None for vanilla), ``batch_size``,
        ``cross_entropy`` with ``cross_entropy_ci`` and ``stderr`` (mean of per-document CE, its 95%
        t interval and standard error, nats); ``delta_ce`` with ``delta_ce_ci``, ``delta_stderr`` and
        ``delta_p_value`` (mean per-document difference to vanilla, paired); ``verdict`` ("worse" /
        "better" / "no significant difference" by the paired t-test, "reference" for vanilla;
        ``verdict_rule`` states it) and ``paper_verdict`` (the paper's overlapping-SE rule, for
        comparison); ``mean_active_experts`` (distinct experts per layer per decode step),
        ``active_vs_vanilla`` (its ratio to vanilla's, interval paired by decode step),
        ``mean_experts_per_token``, ``generation_agreement`` (share of generated tokens equal to
        vanilla's; None when not measured), each with a ``*_ci`` ``[low, high]`` (None where it rests
        on one item); ``documents``, ``tokens``, ``decode_steps``, ``num_batches``, ``positions``,
        ``draft_tokens`` and ``rows_per_step`` (B (1 + d): the rows each decode step routes together).
        See ``oea.eval.summary`` for the statistics.

    Raises:
        ValueError: a model without MoE blocks or with an unsupported router (from ``oea.attach``),
            k0 outside 1..top_k, an unknown policy, too few held-out windows, or fewer than two
            documents at a batch size (no interval).
        FileNotFoundError: a missing checkpoint or held-out file.
    """
    from oea.integrations.transformers import find_moe_layers
    from oea.routing import make_policy

    if positions < 1:
        raise ValueError(f"positions must be >= 1, got {positions}")
    if generate_tokens < 0:
        raise ValueError(f"generate_tokens must be >= 0, got {generate_tokens}")
    _check_draft_tokens(draft_tokens, positions)
    step_tokens = 1 + draft_tokens
    model, tokenizer, model_dir = _resolve_model(model, tokenizer)
    top_k = min(layer.spec.top_k for layer in find_moe_layers(model))
    _check_arguments(policies, k0s, top_k, batch_sizes)
    texts = [text for _, text in _documents(model_dir)]
    windows = document_windows(tokenizer, texts, PREFILL_TOKENS + positions + 1)
    runs: list[tuple[str, int | None, object | None]] = [("vanilla", None, None)]
    runs += [(name, k0, make_policy(name, k0)) for k0 in k0s for name in policies if name != "vanilla"]
    runs += [(label, getattr(cfg, "k0", None), cfg) for label, cfg in extra_policies]

    rows: list[dict[str, Any]] = []
    counts_by_size = {b: _num_batches(b, num_batches) for b in batch_sizes}
    for batch_size, count in counts_by_size.items():
        batches = make_batches(windows, batch_size, count, seed)
        reference: dict[str, Any] | None = None
        for name, k0, cfg in runs:
            if progress is not None:
                progress(f"B={batch_size} {name}" + ("" if k0 is None else f" k0={k0}"))
            result = _run_policy(model, cfg, batches, generate_tokens, step_tokens)
            per_doc = _per_document_ce(result["losses"], batches)
            counts: DecodeCounts = result["counts"]
            is_reference = reference is None  # the first run is vanilla
            if reference is None:
                reference = {"docs": per_doc, "steps": counts.step_active, "generated": result["generated"]}
            agreement, agreement_ci = _agreement(result["generated"], reference["generated"])
            rows.append({
                "policy": name,
                "k0": k0,
                "batch_size": batch_size,
                **quality_fields(per_doc, None if is_reference else reference["docs"]),
                **routing_fields(counts.step_active, counts.step_experts_per_token, reference["steps"], seed),
                "generation_agreement": agreement,
                "generation_agreement_ci": agreement_ci,
                "documents": len(per_doc),
                "tokens": sum(int(loss.numel()) for loss in result["losses"]),
                "decode_steps": len(counts.step_active),
                "num_batches": count,
                "positions": positions,
                "draft_tokens": draft_tokens,
                "rows_per_step": batch_size * step_tokens,
            })
    return rows


def _agreement(generated: torch.Tensor | None, vanilla: torch.Tensor | None) -> tuple[float | None, list | None]:
    """Share of decode-step generated tokens (all but the prefill's first) equal to vanilla's, and its Wilson
    interval with the rows as trials (``None`` for a single row).

    Rows, not tokens, are the independent trials: once a row's greedy continuation differs from vanilla's,
    its later tokens follow from that one difference. A mean of per-row shares has at most the variance of a
    proportion, so the interval (``oea.stats.proportion_interval``) is conservative and stays in [0, 1].
    """
    from oea.stats import proportion_interval

    if generated is None or vanilla is None or generated.shape[1] < 2:
        return None, None
    per_row = (generated[:, 1:] == vanilla[:, 1:]).double().mean(dim=1).tolist()
    share = min(1.0, max(0.0, sum(per_row) / len(per_row)))
    return share, proportion_interval(share, len(per_row)).as_list() if len(per_row) >= 2 else None
