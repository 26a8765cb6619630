"""``oea.eval.evaluate``: cross-entropy, active experts and generation agreement per policy, k0 and B.

For each batch size B, B windows of different held-out documents are decoded in lock step (see
``oea.eval.decode``) once per policy, with ``oea.attach`` rewriting every decode step's routing.
Cross-entropy is averaged per document first; the row reports the mean over documents and its
standard error, and the paper's criterion decides the verdict (``verdict``).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

from oea.eval.decode import DecodeCounts, greedy_generate, lockstep_cross_entropy
from oea.eval.sequences import document_windows, make_batches

POLICIES: tuple[str, ...] = ("vanilla", "pruned", "oea")
PREFILL_TOKENS = 8  # window tokens given as a prefill before the lock-step decode starts
PROMPT_TOKENS = 32  # prompt length of the generation-agreement check
DOCUMENTS_PER_SIZE = 16  # default num_batches covers at least this many windows per batch size


def verdict(mean: float, stderr: float, vanilla_mean: float, vanilla_stderr: float) -> str:
    """The paper's standard-error criterion for a lower-is-better metric (cross-entropy).

    ``"worse"`` iff the intervals mean ± se do not overlap in the bad direction, i.e.
    ``mean - stderr > vanilla_mean + vanilla_stderr``; otherwise ``"no worse"``.
    """
    return "worse" if mean - stderr > vanilla_mean + vanilla_stderr else "no worse"


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std / sqrt(n); 0.0 for a single value)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_and_stderr needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


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


def _run_policy(model: Any, cfg: object | None, batches: list, generate_tokens: int) -> dict[str, Any]:
    """Decode every batch under ``cfg`` (None = vanilla); per-row CE, counts and generated tokens."""
    import oea

    counts = DecodeCounts()
    losses = []
    handle = oea.attach(model, cfg, decode_only=True)
    try:
        for batch in batches:
            losses.append(lockstep_cross_entropy(model, batch.ids, PREFILL_TOKENS, handle, counts))
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

    Returns:
        One dict per (B, policy, k0): ``policy``, ``k0`` (None for vanilla), ``batch_size``,
        ``cross_entropy`` and ``stderr`` (mean of per-document CE and its standard error, nats),
        ``delta_ce`` (vs vanilla), ``delta_stderr`` (paired standard error of the per-document
        difference), ``verdict`` ("worse" / "no worse", see ``verdict``), ``mean_active_experts``
        (distinct experts per layer per decode step), ``active_vs_vanilla`` (its ratio to vanilla's),
        ``mean_experts_per_token``, ``generation_agreement`` (share of generated tokens equal to
        vanilla's; None when not measured), ``documents``, ``tokens``, ``num_batches``, ``positions``.

    Raises:
        ValueError: a model without MoE blocks or with an unsupported router (from ``oea.attach``),
            k0 outside 1..top_k, an unknown policy, or too few held-out windows.
        FileNotFoundError: a missing checkpoint or held-out file.
    """
    from oea.integrations.transformers import find_moe_layers
    from oea.routing import make_policy

    if positions < 1:
        raise ValueError(f"positions must be >= 1, got {positions}")
    if generate_tokens < 0:
        raise ValueError(f"generate_tokens must be >= 0, got {generate_tokens}")
    model, tokenizer, model_dir = _resolve_model(model, tokenizer)
    top_k = min(layer.spec.top_k for layer in find_moe_layers(model))
    _check_arguments(policies, k0s, top_k, batch_sizes)
    texts = [text for _, text in _documents(model_dir)]
    windows = document_windows(tokenizer, texts, PREFILL_TOKENS + positions + 1)
    runs: list[tuple[str, int | None, object | None]] = [("vanilla", None, None)]
    runs += [(name, k0, make_policy(name, k0)) for k0 in k0s for name in policies if name != "vanilla"]
    runs += [(label, getattr(cfg, "k0", None), cfg) for label, cfg in extra_policies]

    rows: list[dict[str, Any]] = []
    for batch_size in batch_sizes:
        count = num_batches if num_batches is not None else math.ceil(DOCUMENTS_PER_SIZE / batch_size)
        batches = make_batches(windows, batch_size, count, seed)
        reference: dict[str, Any] | None = None
        reference_docs: dict[int, float] = {}
        for name, k0, cfg in runs:
            if progress is not None:
                progress(f"B={batch_size} {name}" + ("" if k0 is None else f" k0={k0}"))
            result = _run_policy(model, cfg, batches, generate_tokens)
            per_doc = _per_document_ce(result["losses"], batches)
            ce, se = mean_and_stderr(list(per_doc.values()))
            counts: DecodeCounts = result["counts"]
            row: dict[str, Any] = {
                "policy": name,
                "k0": k0,
                "batch_size": batch_size,
                "cross_entropy": ce,
                "stderr": se,
                "mean_active_experts": counts.mean_active_experts,
                "mean_experts_per_token": counts.mean_experts_per_token,
                "documents": len(per_doc),
                "tokens": sum(int(loss.numel()) for loss in result["losses"]),
                "num_batches": count,
                "positions": positions,
            }
            if reference is None:
                reference, reference_docs = {**row, "generated": result["generated"]}, per_doc
            diffs = [per_doc[d] - reference_docs[d] for d in per_doc]
            row["delta_ce"] = ce - reference["cross_entropy"]
            row["delta_stderr"] = mean_and_stderr(diffs)[1]
            row["verdict"] = verdict(ce, se, reference["cross_entropy"], reference["stderr"])
            row["active_vs_vanilla"] = (
                counts.mean_active_experts / reference["mean_active_experts"]
                if reference["mean_active_experts"] else None
            )
            row["generation_agreement"] = _agreement(result["generated"], reference["generated"])
            rows.append(row)
    return rows


def _agreement(generated: torch.Tensor | None, vanilla: torch.Tensor | None) -> float | None:
    """Share of decode-step generated tokens (all but the prefill's first) equal to vanilla's."""
    if generated is None or vanilla is None or generated.shape[1] < 2:
        return None
    return float((generated[:, 1:] == vanilla[:, 1:]).double().mean())
