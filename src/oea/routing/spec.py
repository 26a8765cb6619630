"""Router description and routing-policy configurations: frozen dataclasses validated at construction.

A ``RouterSpec`` describes a model's own router (the "family"): how logits become selection scores
and mixture weights. A policy config (``OEAConfig``, ``PrunedConfig``, ...) describes how a decode
batch is rerouted. ``route(logits, spec, cfg)`` combines the two; ``cfg=None`` is the model's own
(vanilla) routing.

Everything here is plain Python on Python values and tensor shapes, so it is free to run at trace time
inside ``torch.compile`` or CUDA-graph capture. The one tensor value read is the correction bias's (it must
be finite), and only where a read is allowed: not while ``torch.compile`` traces, during CUDA-graph capture
or on the meta device. ``oea.kernels`` checks a bias that skipped this check again before its first call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import torch

Scoring = Literal["softmax", "sigmoid"]
GroupFill = Literal["in", "cross"]

SCORINGS: tuple[str, ...] = ("softmax", "sigmoid")
GROUP_FILLS: tuple[str, ...] = ("in", "cross")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def require_tensor(name: str, value: object, shape: str) -> None:
    """``TypeError`` naming the argument unless ``value`` is a ``torch.Tensor`` (numpy arrays and lists are
    not converted: the routing functions keep the caller's device and dtype, which only a tensor has)."""
    if not isinstance(value, torch.Tensor):
        kind = type(value)
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {kind.__module__}.{kind.__qualname__}; "
                        f"convert it first, e.g. torch.as_tensor(x) or torch.from_numpy(array)")


def _readable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values may be read on the host here (not traced, captured or meta)."""
    if torch.compiler.is_compiling() or tensor.device.type == "meta":
        return False
    return not (tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def check_expert_ids(ids: torch.Tensor, used: torch.Tensor, num_experts: int | None) -> None:
    """``ValueError`` naming ``ids`` when a used slot (``used`` [M, k] bool) holds an id below 0 or, with
    ``num_experts``, at or above it: such an id is no expert, and counting it would be silently wrong. Reads
    values only where ``_readable`` allows (not while compiling or capturing)."""
    if not _readable(ids):
        return
    bad = used & ((ids < 0) if num_experts is None else ((ids < 0) | (ids >= num_experts)))
    if bool(bad.any()):
        allowed = "ids >= 0" if num_experts is None else f"ids in 0..{num_experts - 1} (num_experts={num_experts})"
        values = sorted(set(ids[bad].tolist()))
        shown = ", ".join(map(str, values[:8])) + (", ..." if len(values) > 8 else "")
        raise ValueError(f"ids must hold expert {allowed} in every slot with non-zero weight, got {shown} in "
                         f"{int(bad.sum())} slots")


def _check_finite_bias(bias: torch.Tensor) -> None:
    """A NaN or infinite correction bias makes every biased score non-finite: refuse it, naming the experts."""
    if not _readable(bias):
        return
    bad = ~torch.isfinite(bias)
    if bool(bad.any()):
        experts = torch.nonzero(bad).flatten().tolist()
        shown = ", ".join(map(str, experts[:8])) + (", ..." if len(experts) > 8 else "")
        values = sorted({str(v) for v in bias[bad].tolist()})
        raise ValueError(f"correction_bias must hold finite values (it is added to the sigmoid scores to rank the "
                         f"experts), got {'/'.join(values)} at {len(experts)} of {bias.numel()} experts ({shown})")


# The largest min_batch: a batch never holds more rows than this, and the kernels count a call's valid rows
# in int32 (numba's and Triton's parameters are int64/int32), so a larger value would overflow there while
# meaning nothing more ("never reroute") than this one does. Chosen here once: OEAConfig, the OEA_MIN_BATCH
# variable (the engines' settings and ``oea doctor``) and the kernels all take this bound.
MAX_MIN_BATCH = 2**31 - 1


def as_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` as a Python int, accepting integer-valued numpy scalars and 0-d integer torch tensors
    (``np.int64(3)``, ``torch.tensor(3)``) as well as ints; ``ValueError`` naming ``name`` otherwise (bools,
    floats, out of ``minimum``..``maximum``)."""
    number: int | None = None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_floating_point() and not value.is_complex() \
                and value.dtype != torch.bool and value.device.type != "meta":
            number = int(value.item())
    elif not isinstance(value, (bool, float)) and type(value).__name__ != "bool_":
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            number = None
    allowed = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    _require(number is not None and number >= minimum and (maximum is None or number <= maximum),
             f"{name} must be an integer {allowed}, got {value!r}")
    assert number is not None
    return number


def _require_int(name: str, value: object, minimum: int) -> None:
    as_int(name, value, minimum)


def _set_ints(config: object, bounds: dict[str, tuple[int, int | None]]) -> None:
    """Check each integer field of a frozen dataclass (``None`` fields are skipped) and store it as an int."""
    for name, (minimum, maximum) in bounds.items():
        value = getattr(config, name)
        if value is not None:
            object.__setattr__(config, name, as_int(name, value, minimum, maximum))


@dataclass(frozen=True, eq=False)
class RouterSpec:
    """A model's own router.

    Attributes:
        num_experts: N, routed experts (shared experts are not routed and not counted).
        top_k: k, experts per token in the model's own routing.
        scoring: ``"softmax"`` (Qwen3-MoE, OLMoE, Mixtral, GPT-OSS) or ``"sigmoid"``
            (DeepSeek-V3, GLM-4.5/4.6/4.7, GLM-5).
        renormalize: divide the chosen experts' weights by their sum (``norm_topk_prob``).
        correction_bias: [N] tensor of finite values added to the sigmoid scores for *selection only*
            (``e_score_correction_bias``); sigmoid scoring only.
        n_group / topk_group: group-limited routing: experts are split into ``n_group`` equal
            groups, a group's score is the sum of its top-2 biased scores, and each token keeps
            only its best ``topk_group`` groups. Both or neither: ``None`` means no group limit
            (as does ``topk_group == n_group``).
        routed_scaling_factor: multiplies the final weights (only where the engine folds the
            factor into the top-k weights; pass 1.0 otherwise).
    """

    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = True
    correction_bias: torch.Tensor | None = None
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        _set_ints(self, {"num_experts": (1, None), "top_k": (1, None), "n_group": (1, None),
                         "topk_group": (1, None)})
        _require(
            self.top_k <= self.num_experts,
            f"top_k must be <= num_experts, got top_k={self.top_k} and num_experts={self.num_experts}",
        )
        _require(self.scoring in SCORINGS, f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        _require(isinstance(self.renormalize, bool), f"renormalize must be a bool, got {self.renormalize!r}")
        _require(
            isinstance(self.routed_scaling_factor, (int, float))
            and self.routed_scaling_factor > 0
            and self.routed_scaling_factor != float("inf"),
            f"routed_scaling_factor must be a finite number > 0, got {self.routed_scaling_factor!r}",
        )
        if self.correction_bias is not None:
            _require(
                self.scoring == "sigmoid",
                f"correction_bias is only used with scoring='sigmoid', got scoring={self.scoring!r}",
            )
            require_tensor("correction_bias", self.correction_bias, f"of shape [num_experts]=[{self.num_experts}]")
            _require(
                tuple(self.correction_bias.shape) == (self.num_experts,),
                f"correction_bias must be a tensor of shape [num_experts]=[{self.num_experts}], "
                f"got {tuple(self.correction_bias.shape)}",
            )
            _check_finite_bias(self.correction_bias)
        if self.n_group is None:
            _require(
                self.topk_group is None,
                f"topk_group needs n_group, got n_group=None and topk_group={self.topk_group}",
            )
            return
        _require_int("n_group", self.n_group, 1)
        _require(
            self.num_experts % self.n_group == 0,
            f"num_experts must be divisible by n_group, got num_experts={self.num_experts} "
            f"and n_group={self.n_group}",
        )
        _require(
            self.topk_group is not None,
            f"n_group needs topk_group (how many of the n_group={self.n_group} groups each token may use; "
            f"topk_group=n_group for no group limit), got topk_group=None",
        )
        topk_group = self.topk_group
        _require_int("topk_group", topk_group, 1)
        _require(
            topk_group <= self.n_group,
            f"topk_group must be <= n_group, got topk_group={topk_group} and n_group={self.n_group}",
        )
        _require(
            self.num_experts // self.n_group >= 2 or self.n_group == 1,
            f"each group needs >= 2 experts (group score = sum of top-2), got num_experts="
            f"{self.num_experts} and n_group={self.n_group}",
        )
        _require(
            topk_group * (self.num_experts // self.n_group) >= self.top_k,
            f"topk_group groups must hold at least top_k experts, got topk_group={topk_group}, "
            f"{self.num_experts // self.n_group} experts per group and top_k={self.top_k}",
        )

    @property
    def grouped(self) -> bool:
        """True when a group limit actually removes experts (some groups are dropped)."""
        return self.n_group is not None and self.n_group > 1 and (self.topk_group or self.n_group) < self.n_group


@dataclass(frozen=True)
class OEAConfig:
    """Opportunistic Expert Activation (paper Algorithms 1 and 2).

    Attributes:
        k0: baseline experts each token keeps (1 <= k0 <= top_k).
        max_experts: k_max, cap on experts per token after piggybacking (default: top_k;
            k0 <= max_experts <= top_k).
        p: cumulative router-mass threshold of general OEA; a token's baseline is
            min(k0, smallest t whose top-t mass >= p). 1.0 = simplified OEA.
        max_rank: deepest rank of a token's own ranking that may be piggybacked (the paper's
            maxP; k0 <= max_rank <= N; default: N, i.e. the full ranking).
        min_batch: below this many valid rows the whole batch gets vanilla routing
            (the reference deployment's ``SGLANG_OEA_MIN_BATCH``); 0..``MAX_MIN_BATCH``.
        group_fill: grouped sigmoid families only: ``"in"`` piggybacks only from the token's
            own allowed groups (conservative default), ``"cross"`` from any group.
    """

    k0: int
    max_experts: int | None = None
    p: float = 1.0
    max_rank: int | None = None
    min_batch: int = 2
    group_fill: GroupFill = "in"

    def __post_init__(self) -> None:
        _set_ints(self, {"k0": (1, None), "max_experts": (1, None), "max_rank": (1, None),
                         "min_batch": (0, MAX_MIN_BATCH)})
        if self.max_experts is not None:
            _require(
                self.max_experts >= self.k0,
                f"max_experts must be >= k0, got max_experts={self.max_experts} and k0={self.k0}",
            )
        _require(
            isinstance(self.p, (int, float)) and 0.0 < self.p <= 1.0,
            f"p must be in (0, 1], got p={self.p!r}",
        )
        if self.max_rank is not None:
            _require(
                self.max_rank >= self.k0,
                f"max_rank must be >= k0 (a token always keeps its own top-k0 and piggybacks only experts it "
                f"ranks within max_rank), got max_rank={self.max_rank} and k0={self.k0}",
            )
        _require(
            self.group_fill in GROUP_FILLS,
            f"group_fill must be one of {GROUP_FILLS}, got {self.group_fill!r}",
        )

    def check(self, spec: RouterSpec) -> None:
        """Validate against a router: raises ``ValueError`` naming the field and both values."""
        _require(
            self.k0 <= spec.top_k,
            f"k0 must be in 1..top_k, got k0={self.k0} and top_k={spec.top_k}",
        )
        _require(
            self.max_experts is None or self.max_experts <= spec.top_k,
            f"max_experts must be <= top_k, got max_experts={self.max_experts} and top_k={spec.top_k}",
        )
        _require(
            self.max_rank is None or self.max_rank <= spec.num_experts,
            f"max_rank must be <= num_experts, got max_rank={self.max_rank} "
            f"and num_experts={spec.num_experts}",
        )

    @property
    def is_simplified(self) -> bool:
        """Algorithm 1 (k0 only) rather than the general Algorithm 2."""
        return self.p == 1.0 and self.max_rank is None and self.max_experts is None


@dataclass(frozen=True)
class PrunedConfig:
    """The paper's comparator: every token keeps only its own top-k0 (batch-independent).

    Weights are the family's weights over the k0 experts, renormalised when the router
    renormalises (``renormalize=None``) or as forced by ``renormalize``. Unused slots are
    zero-weight copies of the token's first expert, as in OEA.
    """

    k0: int
    renormalize: bool | None = None

    def __post_init__(self) -> None:
        _set_ints(self, {"k0": (1, None)})
        _require(
            self.renormalize is None or isinstance(self.renormalize, bool),
            f"renormalize must be None or a bool, got {self.renormalize!r}",
        )

    def check(self, spec: RouterSpec) -> None:
        """Validate against a router: raises ``ValueError`` naming the field and both values."""
        _require(
            self.k0 <= spec.top_k,
            f"k0 must be in 1..top_k, got k0={self.k0} and top_k={spec.top_k}",
        )
