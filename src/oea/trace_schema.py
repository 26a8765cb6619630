"""The ``oea-trace`` format's names, in one place: what ``oea.traces`` reads and writes and what the engines'
recorder (``oea.integrations.recording.trace_file``) writes while serving.

Shape legend: T = recorded tokens, L = MoE layers, N = routed experts, k = the model's top-k.

A trace is one ``.safetensors`` file of tensors (every one optional except that ``logits`` or ``ids`` must be
present) plus a ``.json`` sidecar of metadata (``sidecar_path``):

* ``logits``          [T, L, N] float16/float32: full router logits.
* ``ids``             [T, L, k] integer: the model's own top-k expert ids, best first.
* ``scores``          [T, L, k] float: the router score of each recorded id (e.g. softmax probability).
* ``request_ids``     [T] integer: which request / sequence the token belongs to.
* ``positions``       [T] integer: the token's decode step (or position) within its request.
* ``step_ids``        [T] integer: the engine step (forward pass) that decoded the token; tokens with the
  same step id were batched together (recorded by the engine plugins, ``OEA_TRACE_FILE``).
* ``correction_bias`` [L, N] float: per-layer selection bias of sigmoid routers.

Tensors named ``_pad<i>`` (``PAD_PREFIX``) are padding bytes of a recording's checkpoint; readers skip them.

The JSON sidecar holds ``format`` (``FORMAT_NAME``), ``version`` (``FORMAT_VERSION``), ``num_tokens``,
``num_layers``, the router ``spec`` (``SPEC_FIELDS``), ``tensors`` (the names in the file), and the
provenance: ``source``, ``licence``, ``model``, ``notes`` (and any other keys); ``docs/traces.md`` lists
every field and its allowed values.

This module imports nothing of the project, so the tools (``oea.traces``) and the adapters (the recorder,
which runs inside the engines and may not import a tool) share it.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oea.routing import RouterSpec

FORMAT_NAME = "oea-trace"
FORMAT_VERSION = 1
MAX_EXPERTS = 32768  # ids are stored as int16 (uint8 up to 256 experts): 0..32767
SPEC_FIELDS: tuple[str, ...] = ("num_experts", "top_k", "scoring", "renormalize", "n_group", "topk_group",
                                "routed_scaling_factor")
TENSOR_NAMES: tuple[str, ...] = ("logits", "ids", "scores", "request_ids", "positions", "step_ids",
                                 "correction_bias")
INTEGER_NAMES: tuple[str, ...] = ("ids", "request_ids", "positions", "step_ids")
PAD_PREFIX = "_pad"
# The sidecar keys the format writes itself (every other key is the trace's provenance, ``Trace.meta``).
FORMAT_KEYS: tuple[str, ...] = ("format", "version", "num_tokens", "num_layers", "spec", "tensors")


def sidecar_path(path: pathlib.Path) -> pathlib.Path:
    """``x.safetensors`` -> ``x.json``."""
    return path.with_suffix(".json")


def spec_to_json(spec: RouterSpec) -> dict[str, Any]:
    """The JSON form of a router spec (the correction bias travels as a tensor, not here)."""
    return {name: getattr(spec, name) for name in SPEC_FIELDS}


def routes_alike(spec: RouterSpec, first: RouterSpec) -> bool:
    """Whether a layer routes as the trace's first layer: the same sidecar ``spec`` (a trace holds one router
    for all its layers; the correction bias is per layer and travels as a tensor)."""
    return spec_to_json(spec) == spec_to_json(first)


def sidecar(meta: dict[str, Any], spec: RouterSpec, num_tokens: int, num_layers: int,
            tensors: list[str]) -> dict[str, Any]:
    """The sidecar of a trace: the provenance ``meta`` and the format's own keys (``FORMAT_KEYS``)."""
    return {**meta, "format": FORMAT_NAME, "version": FORMAT_VERSION, "num_tokens": num_tokens,
            "num_layers": num_layers, "spec": spec_to_json(spec), "tensors": sorted(tensors)}
