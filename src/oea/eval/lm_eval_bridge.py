"""Run lm-evaluation-harness tasks on an HF MoE model with OEA attached.

The model is loaded once, ``oea.attach`` hooks its routers, and the already-loaded model is handed
to lm-eval's ``HFLM`` wrapper and ``simple_evaluate``. Install with ``pip install -e '.[eval]'``.

OEA is a decode-time policy: with ``decode_only=True`` (the default) it rewrites routing only in
decode steps, i.e. inside ``model.generate`` — lm-eval's ``generate_until`` tasks. Log-likelihood
tasks (``loglikelihood``, ``multiple_choice``) score whole sequences in one prefill forward, which
OEA leaves untouched; pass ``decode_only=False`` to reroute those forwards too (then the expert
union is taken over every token of the forward, a harsher setting than decoding).
"""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES: tuple[str, ...] = ("vanilla", "pruned", "oea")


def resolve_policy(policy: str | None, k0: int | None) -> str:
    """The policy to run: ``policy``, or ``"oea"`` when only ``k0`` is given and ``"vanilla"`` when neither.

    Raises ``ValueError`` for an unknown policy, pruned / oea without a k0 (which would silently run
    vanilla routing), or vanilla with a k0 (which it would ignore).
    """
    if policy is None:
        return "vanilla" if k0 is None else "oea"
    if policy not in POLICIES:
        raise ValueError(f"--policy must be one of {list(POLICIES)}, got {policy!r}")
    if policy != "vanilla" and k0 is None:
        raise ValueError(f"--policy {policy} needs --k0 (an integer in 1..top_k)")
    if policy == "vanilla" and k0 is not None:
        raise ValueError(f"--k0 {k0} has no effect with --policy vanilla; drop one of them")
    return policy


def check_lm_eval_arguments(policy: str | None, k0: int | None, include_path: str | pathlib.Path | None) -> None:
    """What can be checked before loading a model: the policy / k0 pair and the task directory."""
    resolve_policy(policy, k0)
    if include_path is not None and not pathlib.Path(include_path).is_dir():
        raise FileNotFoundError(f"--include-path {include_path}: no such directory (it should hold task YAMLs)")


@dataclass
class StepSamples:
    """Per decode step, means over the MoE layers: active experts (``active``), the router's own picks
    (``vanilla``) and non-zero-weight slots per token (``per_token``): the samples behind the intervals."""

    active: list[float] = field(default_factory=list)
    vanilla: list[float] = field(default_factory=list)
    per_token: list[float] = field(default_factory=list)

    def fields(self, seed: int = 0) -> dict[str, Any]:
        """Routing means with their 95% intervals (``*_ci``, None below two decode steps)."""
        from oea.eval.summary import ci_or_none, routing_fields

        mean = sum(self.vanilla) / len(self.vanilla) if self.vanilla else 0.0
        return {**routing_fields(self.active, self.per_token, self.vanilla, seed),
                "mean_active_experts_vanilla": mean, "mean_active_experts_vanilla_ci": ci_or_none(self.vanilla)}


def _handle_totals(handle: Any) -> dict[int, tuple[int, int, float, float, float]]:
    """``{layer: (decode steps, rows, active, vanilla active, used slots)}`` summed since attach."""
    return {index: (s["steps"], s["tokens"], s["mean_active_experts"] * s["steps"],
                    s["mean_active_experts_vanilla"] * s["steps"], s["mean_experts_per_token"] * s["tokens"])
            for index, s in handle.stats().items()}


@contextlib.contextmanager
def step_samples(model: Any, handle: Any) -> Iterator[StepSamples]:
    """Collect ``StepSamples`` of every forward of ``model`` that ran a decode step under ``handle``
    (a forward hook diffs the handle's counters; forwards without a decode step add nothing)."""
    samples = StepSamples()
    last = _handle_totals(handle)

    def after_forward(*_: Any) -> None:
        nonlocal last
        now = _handle_totals(handle)
        steps, rows, active, vanilla, slots = (sum(n[i] - last[layer][i] for layer, n in now.items())
                                               for i in range(5))
        last = now
        if steps:
            samples.active.append(active / steps)
            samples.vanilla.append(vanilla / steps)
            samples.per_token.append(slots / rows if rows else 0.0)

    hook = model.register_forward_hook(after_forward)
    try:
        yield samples
    finally:
        hook.remove()


@contextlib.contextmanager
def _quiet_git_hash() -> Iterator[None]:
    """lm-eval records ``git describe`` of the working directory and lets git print "fatal: not a git
    repository" outside one; run that one call with git's stderr discarded."""
    import lm_eval.evaluator as evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    original = evaluator.get_git_commit_hash

    def quiet() -> str | None:
        try:
            out = subprocess.run(["git", "describe", "--always"], capture_output=True, check=True, text=True)
            return out.stdout.strip()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(pathlib.Path.cwd())

    evaluator.get_git_commit_hash = quiet
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def run_lm_eval(
    model: Any,
    tasks: Sequence[str],
    *,
    k0: int | None = None,
    policy: str | None = None,
    batch_size: int = 16,
    limit: float | None = None,
    num_fewshot: int | None = None,
    include_path: str | pathlib.Path | None = None,
    decode_only: bool = True,
    tokenizer: Any = None,
    seed: int = 0,
    builtin_tasks: bool = True,
    bootstrap_iters: int = 1000,
) -> dict[str, Any]:
    """Evaluate ``tasks`` with lm-eval on ``model`` under routing ``policy`` at ``k0``.

    Args:
        model: None (the embedded model), a checkpoint directory, or a loaded HF model (then
            pass ``tokenizer``).
        tasks: lm-eval task names (registered ones, or ones defined in ``include_path``).
        k0: the policy's k0 in 1..top_k (required by "oea" and "pruned").
        policy: "vanilla", "pruned" or "oea" (``oea.routing.make_policy`` names); default "oea" when
            ``k0`` is given, else "vanilla" (``resolve_policy``).
        batch_size: lm-eval's batch size, i.e. the decode batch that OEA routes together.
        limit, num_fewshot: passed to ``lm_eval.simple_evaluate``.
        include_path: a directory of extra task YAMLs (e.g. a local task over a jsonl file).
        decode_only: see the module docstring.
        builtin_tasks: index lm-eval's built-in tasks too (False: only ``include_path``; faster).
        bootstrap_iters: bootstrap resamples for lm-eval's metric standard errors.

    Returns:
        ``{"results": lm-eval's per-task metrics, "oea": {"policy", "k0", "decode_only",
        "decode_steps", "tokens", "mean_active_experts", "mean_active_experts_vanilla",
        "mean_experts_per_token", "active_vs_vanilla"}}``: routing means over decode steps (each step's
        mean over the MoE layers), each with its 95% interval in a ``*_ci`` field (``[low, high]``; t
        interval, a paired bootstrap for the ratio ``active_vs_vanilla``; None below two decode steps).

    Raises:
        ImportError: lm-eval is not installed (names the extra to install).
        ValueError: k0 outside 1..top_k, an unknown policy, pruned / oea without k0, vanilla with k0,
            or a model without supported MoE blocks.
        FileNotFoundError: ``include_path`` is not a directory.
    """
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ImportError("run_lm_eval needs lm-eval: pip install -e '.[eval]' (or pip install lm-eval)") from err

    import oea
    from oea.eval.evaluate import _resolve_model
    from oea.integrations.transformers import find_moe_layers
    from oea.routing import make_policy

    check_lm_eval_arguments(policy, k0, include_path)
    policy = resolve_policy(policy, k0)
    model, tokenizer, _ = _resolve_model(model, tokenizer)
    top_k = min(layer.spec.top_k for layer in find_moe_layers(model))
    cfg = None
    if policy != "vanilla":
        if not isinstance(k0, int) or not 1 <= k0 <= top_k:
            raise ValueError(f"k0 must be an integer in 1..{top_k} (the model's top_k), got {k0!r}")
        cfg = make_policy(policy, k0)
    handle = oea.attach(model, cfg, decode_only=decode_only)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
        manager = TaskManager(
            include_path=None if include_path is None else str(include_path), include_defaults=builtin_tasks
        )
        with _quiet_git_hash(), step_samples(model, handle) as samples:
            output = simple_evaluate(
                model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                log_samples=False, bootstrap_iters=bootstrap_iters,
            )
        stats = handle.stats()
    finally:
        handle.remove()
    steps = sum(s["steps"] for s in stats.values())
    tokens = sum(s["tokens"] for s in stats.values())
    return {
        "results": output["results"] if output is not None else {},
        "oea": {
            "policy": "vanilla" if cfg is None else policy,
            "k0": None if cfg is None else k0,
            "decode_only": decode_only,
            "decode_steps": steps // max(1, len(stats)),
            "tokens": tokens // max(1, len(stats)),
            **samples.fields(seed),
        },
    }
