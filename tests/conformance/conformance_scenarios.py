"""The adapter conformance table: one list of scenarios every engine adapter runs through its real routing
entry point, and what each must give (``oea.route`` with the config the table names, or the same words).

Engine-free (torch and oea only): the pytest side and the child process of each engine import it. A child
gets the scenarios as JSON (``as_json``), builds its engine's router of each scenario's family (``FAMILIES``:
the ``RouterSpec`` it must translate to, with a fixed correction bias), routes ``logits(scenario)`` in a
decode step at every MoE layer, and prints what came out (``Outcome`` per layer).

Outcomes: ``routed`` (the adapter's ids and weights, compared with ``oea.route(logits, spec, expect)``;
``expect=None``: the engine's own routing, compared with vanilla routing), ``error`` (start-up stopped, with
the message), ``stock`` (the adapter kept the engine's routing and warned; the warning is the message).
A setting that cannot fit the model (``fits=False``) stops start-up where the adapter sees the model first
(``STOPS_AT_START``) and is a warning plus the engine's routing elsewhere; in both cases the words are the
table's ``message``. A scenario's ``adapters`` names where it applies (padding rows exist in the engines
only; the alias/``OEA_POLICY`` rows everywhere).

Routing replay: each layer's outcome also holds ``replay``, the ids the engine's routed-experts capture took (vLLM's
and SGLang's own capturers; transformers, which has none, the ids its experts ran). In every ``routed`` and
``stock`` outcome they must follow ``oea.integrations.replay``'s rule: a slot that repeats an earlier id of its
row is a filler, every other slot is the adapter's own id there with a non-zero weight, and the row's distinct
ids are exactly the experts ``oea.route`` gives a non-zero weight; where OEA changes nothing, the engine's ids
exactly (slot order included).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from oea.routing import AdaptiveK0Config, OEAConfig, RouterSpec
from oea.routing.layered import EP_IGNORES_MAX_EXPERTS

NUM_EXPERTS, TOP_K, LAYERS, ROWS = 16, 4, 2, 12
ADAPTERS = ("vllm", "sglang", "transformers")
STOPS_AT_START = frozenset({"vllm", "transformers"})  # adapters that see the model before serving


def bias(seed: int = 3) -> torch.Tensor:
    """The correction bias of the grouped sigmoid family: [N] float32, fixed."""
    return torch.rand(NUM_EXPERTS, generator=torch.Generator().manual_seed(seed)) * 0.5


def family_spec(family: str) -> RouterSpec:
    """The ``RouterSpec`` an adapter must translate its router of ``family`` to."""
    if family == "softmax-renorm":  # Qwen3-MoE, Mixtral
        return RouterSpec(NUM_EXPERTS, TOP_K, "softmax", renormalize=True)
    if family == "softmax":  # OLMoE: softmax top-k without renormalising
        return RouterSpec(NUM_EXPERTS, TOP_K, "softmax", renormalize=False)
    if family == "sigmoid-grouped":  # DeepSeek-V3: sigmoid + bias, 4 groups, best 2 kept, scale 2.5 folded in
        return RouterSpec(NUM_EXPERTS, TOP_K, "sigmoid", renormalize=True, correction_bias=bias(), n_group=4,
                          topk_group=2, routed_scaling_factor=2.5)
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ("softmax-renorm", "softmax", "sigmoid-grouped")


def logits(rows: int, layer: int, seed: int = 0) -> torch.Tensor:
    """[rows, N] router logits of one layer's call, tie-free, the same in every process."""
    gen = torch.Generator().manual_seed(1000 * seed + layer)
    return torch.stack([torch.randperm(NUM_EXPERTS, generator=gen) for _ in range(rows)]).float() / 4 - 1


@dataclass(frozen=True)
class Scenario:
    """One row of the table.

    Attributes:
        name: the test id's last part.
        env: the ``OEA_*`` variables (``OEA_LAYER_K0_FILE`` is filled in by the harness from ``layer_file``).
        family: the router family of every layer (``FAMILIES``).
        rows, padding: the decode step's rows; the last ``padding`` of them are padding rows.
        layer_file: ``LayerK0Schedule`` fields written to the file ``OEA_LAYER_K0_FILE`` names, or None.
        expect: per layer, the config ``oea.route`` must reproduce (None: the engine's own routing).
        message: for ``error`` / ``fits=False`` rows: the words every adapter reports.
        fits: False when the settings cannot fit the model (see the module docstring).
        adapters: where the scenario applies.
        warning: for ``routed`` rows: words the adapter must have warned with (None: nothing asked).
    """

    name: str
    env: dict[str, str]
    family: str = "softmax-renorm"
    rows: int = ROWS
    padding: int = 0
    layer_file: dict[str, Any] | None = None
    expect: tuple[Any, ...] = ()
    message: str | None = None
    fits: bool = True
    adapters: tuple[str, ...] = ADAPTERS
    tags: tuple[str, ...] = field(default=())
    warning: str | None = None

    def outcome(self, adapter: str) -> str:
        """What ``adapter`` must do: ``routed``, ``error`` or ``stock``."""
        if self.message is None:
            return "routed"
        if self.fits:
            return "error"  # a malformed setting: every adapter stops start-up
        return "error" if adapter in STOPS_AT_START else "stock"


FILE = {"num_experts": NUM_EXPERTS, "top_k": TOP_K, "num_layers": LAYERS, "k0": [1, 3], "min_batch": 3}
HIGH_MIN_BATCH = {**FILE, "min_batch": ROWS + 1}  # the file's min_batch above the step's rows
BATCH_FILE = {**FILE, "k0": [4, 4], "batch_k0": [{"max_batch": 4, "k0": [4, 4]}, {"max_batch": 64, "k0": [1, 2]}]}


def _oea(k0: int, **kw: Any) -> OEAConfig:
    return OEAConfig(k0, **kw)


SCENARIOS: tuple[Scenario, ...] = (
    *(Scenario(f"k0-{family}", {"OEA_K0": "2"}, family, expect=(_oea(2), _oea(2))) for family in FAMILIES),
    Scenario("k0-alias", {"SGLANG_OEA_K0": "2"}, expect=(_oea(2), _oea(2))),
    Scenario("k0-equals-top-k", {"OEA_K0": str(TOP_K)}, expect=(None, None)),
    Scenario("min-batch-not-reached", {"OEA_K0": "1", "OEA_MIN_BATCH": str(ROWS + 1)}, expect=(None, None)),
    Scenario("min-batch-reached", {"OEA_K0": "1", "OEA_MIN_BATCH": str(ROWS)},
             expect=(_oea(1, min_batch=ROWS), _oea(1, min_batch=ROWS))),
    Scenario("max-experts", {"OEA_K0": "1", "OEA_MAX_EXPERTS": "2"},
             expect=(_oea(1, max_experts=2), _oea(1, max_experts=2))),
    Scenario("group-fill-cross", {"OEA_K0": "1", "OEA_GROUP_FILL": "cross"}, "sigmoid-grouped",
             expect=(_oea(1, group_fill="cross"), _oea(1, group_fill="cross"))),
    Scenario("layer-file", {"OEA_K0": "2"}, layer_file=FILE, expect=(_oea(1, min_batch=3), _oea(3, min_batch=3))),
    Scenario("layer-file-min-batch", {"OEA_K0": "2"}, layer_file=HIGH_MIN_BATCH, expect=(None, None)),
    Scenario("layer-file-min-batch-env", {"OEA_K0": "2", "OEA_MIN_BATCH": "2"}, layer_file=HIGH_MIN_BATCH,
             expect=(_oea(1), _oea(3))),
    Scenario("layer-file-batch-k0", {"OEA_K0": "2"}, layer_file=BATCH_FILE,
             expect=(_oea(1, min_batch=3), _oea(2, min_batch=3))),
    Scenario("layer-file-batch-k0-small-batch", {"OEA_K0": "2"}, rows=4, layer_file=BATCH_FILE, expect=(None, None)),
    Scenario("padding-rows", {"OEA_K0": "1"}, padding=4, expect=(_oea(1), _oea(1)), adapters=("vllm", "sglang")),
    # routing replay: 3 rows at k0 = 1 hold at most 3 experts, fewer than top_k = 4, so every row has fillers
    # (SGLang's native MoE then renames them to experts nobody routes to: fillers.py); what the engine's
    # routed-experts capture returns must follow oea.integrations.replay's rule (checked in every routed scenario)
    Scenario("routed_experts-fillers", {"OEA_K0": "1"}, rows=3, expect=(_oea(1), _oea(1))),
    Scenario("routed_experts-fillers-padding", {"OEA_K0": "1"}, rows=5, padding=2, expect=(_oea(1), _oea(1)),
             adapters=("vllm", "sglang")),
    Scenario("routed_experts-k0-equals-top-k", {"OEA_K0": str(TOP_K)}, rows=3, expect=(None, None)),
    Scenario("policy-ep-without-expert-parallelism", {"OEA_K0": "2", "OEA_POLICY": "ep"}, expect=(_oea(2), _oea(2))),
    # EP with a layer file: each layer's k0 on the layer's base config (here plain OEA: the children run without
    # expert parallelism; tests/unit/test_ep_layer_file_adapters.py composes it on a placement in both engines)
    Scenario("policy-ep-with-a-layer-file", {"OEA_K0": "2", "OEA_POLICY": "ep"}, layer_file=FILE,
             expect=(_oea(1, min_batch=3), _oea(3, min_batch=3))),
    Scenario("policy-ep-max-experts", {"OEA_K0": "1", "OEA_MAX_EXPERTS": "2", "OEA_POLICY": "ep"},
             expect=(_oea(1, max_experts=2), _oea(1, max_experts=2)), warning=EP_IGNORES_MAX_EXPERTS,
             adapters=("vllm", "sglang")),
    Scenario("bad-k0", {"OEA_K0": "two"}, message="OEA_K0 must be an integer >= 1, got 'two'"),
    Scenario("bad-min-batch", {"OEA_K0": "2", "OEA_MIN_BATCH": "-1"},
             message="OEA_MIN_BATCH must be an integer in 0..2147483647, got -1"),
    Scenario("bad-group-fill", {"OEA_K0": "2", "OEA_GROUP_FILL": "all"},
             message="OEA_GROUP_FILL must be one of ('in', 'cross'), got 'all'"),
    Scenario("bad-policy", {"OEA_K0": "2", "OEA_POLICY": "both"},
             message="OEA_POLICY must be one of ('oea', 'ep'), got 'both'"),
    Scenario("alias-conflict", {"OEA_K0": "2", "SGLANG_OEA_K0": "3"},
             message="OEA_K0=2 and SGLANG_OEA_K0=3 disagree (SGLANG_OEA_K0 is an alias of OEA_K0): unset one, or set "
                     "both to the same value"),
    Scenario("layer-file-without-k0", {}, layer_file=FILE,
             message="OEA_LAYER_K0_FILE='{file}' is set but OEA_K0 is not: OEA is off without OEA_K0; set OEA_K0 to "
                     "turn it on (the file then sets each layer's k0), or unset the file"),
    Scenario("k0-above-top-k", {"OEA_K0": "5"}, message="OEA_K0 must be in 1..4 (the model's top_k), got 5",
             fits=False),
    Scenario("alias-above-top-k", {"SGLANG_OEA_K0": "5"},
             message="SGLANG_OEA_K0 must be in 1..4 (the model's top_k), got 5", fits=False),
    Scenario("max-experts-above-top-k", {"OEA_K0": "2", "OEA_MAX_EXPERTS": "5"},
             message="OEA_MAX_EXPERTS must be in 2..4 (the model's top_k), got 5", fits=False),
    Scenario("layer-file-another-model", {"OEA_K0": "2"}, layer_file={**FILE, "num_experts": 32},
             message="OEA_LAYER_K0_FILE='{file}': per-layer k0 file was calibrated for another model (num_experts: "
                     "file has 32, model has 16)", fits=False),
    Scenario("layer-file-missing-layer", {"OEA_K0": "2"}, layer_file={**FILE, "layer_ids": [5, 9]},
             message="OEA_LAYER_K0_FILE='{file}': MoE layer 0 is not in the file (its layer_ids are [5, 9])",
             fits=False),
)


def expected(scenario: Scenario, layer: int) -> Any:
    """The config layer ``layer`` must route with (None: the engine's own routing)."""
    return scenario.expect[layer] if scenario.expect else None


def as_json(scenarios: tuple[Scenario, ...], files: dict[str, str]) -> str:
    """What a child process reads: name, env (with the layer file's path), family, rows, padding."""
    rows = []
    for s in scenarios:
        env = dict(s.env)
        if s.name in files:
            env["OEA_LAYER_K0_FILE"] = files[s.name]
        rows.append({"name": s.name, "env": env, "family": s.family, "rows": s.rows, "padding": s.padding})
    return json.dumps(rows)


@dataclass
class Outcome:
    """What one adapter did in one scenario (one entry per MoE layer for ``routed``)."""

    kind: str  # routed | error | stock
    message: str | None = None
    warnings: list[str] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)  # {"ids", "weights", "spec"} per layer

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def spec_fields(spec: RouterSpec | None) -> dict[str, Any] | None:
    """A ``RouterSpec`` as JSON (the bias as a list), for comparing an adapter's translation with the table's."""
    if spec is None:
        return None
    data = {name: getattr(spec, name) for name in ("num_experts", "top_k", "scoring", "renormalize", "n_group",
                                                   "topk_group", "routed_scaling_factor")}
    bias_values = spec.correction_bias
    data["correction_bias"] = None if bias_values is None else [round(float(b), 6) for b in bias_values]
    return data


__all__ = ["ADAPTERS", "FAMILIES", "SCENARIOS", "AdaptiveK0Config", "Outcome", "Scenario", "as_json", "expected",
           "family_spec", "logits", "spec_fields"]
