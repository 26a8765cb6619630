"""The routing-trace format: one ``.safetensors`` file of tensors plus a ``.json`` sidecar of metadata.

Shape legend: T = recorded tokens, L = MoE layers, N = routed experts, k = the model's top-k.

The tensors and the sidecar's fields are listed with the format's names in ``oea.trace_schema`` (shared
with the engines' recorder); ``docs/traces.md`` lists every field and its allowed values. Here: the
``Trace`` object, saving and loading.

Every trace built or loaded is checked row by row (``oea.traces.checks``): duplicate or out-of-range
ids, float ids, non-finite, negative or unordered scores are errors naming the file, field and row.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from oea.routing import RouterSpec
from oea.trace_schema import (
    FORMAT_KEYS,
    FORMAT_NAME,
    FORMAT_VERSION,
    INTEGER_NAMES,
    MAX_EXPERTS,
    PAD_PREFIX,
    SPEC_FIELDS,
    TENSOR_NAMES,
    sidecar,
    sidecar_path,
)
from oea.traces.checks import check_contents, check_integer, check_sidecar


@dataclass
class Trace:
    """Recorded routing of one model: per token and MoE layer, full logits or the top-k ids.

    Attributes:
        spec: the model's router (without per-layer bias; see ``layer_spec``).
        logits: [T, L, N] float32 router logits, or ``None`` for id-only traces.
        ids: [T, L, k] int64 top-k ids (best first), or ``None`` when only logits were recorded.
        scores: [T, L, k] float32 scores of ``ids`` (e.g. softmax probabilities), or ``None``.
        request_ids: [T] int64 request of each token, or ``None`` when unknown.
        positions: [T] int64 decode step of each token within its request, or ``None``.
        step_ids: [T] int64 engine step that decoded each token (same id = same batch), or ``None``.
        correction_bias: [L, N] float32 per-layer selection bias (sigmoid routers), or ``None``.
        meta: provenance and notes: ``name``, ``source``, ``licence``, ``model``, ``notes``, ...
    """

    spec: RouterSpec
    logits: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    request_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    step_ids: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in TENSOR_NAMES:  # numpy arrays and nested lists are welcome
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                setattr(self, name, torch.as_tensor(value))
        validate(self, where="Trace")
        for name in INTEGER_NAMES:  # int64: what torch indexing ops need
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.long())

    @property
    def num_tokens(self) -> int:
        """T, recorded tokens."""
        return int(self._main.shape[0])

    @property
    def num_layers(self) -> int:
        """L, recorded MoE layers."""
        return int(self._main.shape[1])

    @property
    def name(self) -> str:
        """The trace's name (``meta['name']``, or ``"unnamed"``)."""
        return str(self.meta.get("name", "unnamed"))

    @property
    def has_logits(self) -> bool:
        """True when full router logits were recorded (OEA can piggyback from the full ranking)."""
        return self.logits is not None

    @property
    def _main(self) -> torch.Tensor:
        main = self.logits if self.logits is not None else self.ids
        assert main is not None
        return main

    def layer_spec(self, layer: int) -> RouterSpec:
        """The router of MoE layer ``layer`` (the spec with that layer's correction bias)."""
        if self.correction_bias is None:
            return self.spec
        return replace(self.spec, correction_bias=self.correction_bias[layer].float())


def make_trace(where: str, spec: RouterSpec, meta: dict[str, Any] | None = None,
               **tensors: torch.Tensor | None) -> Trace:
    """A ``Trace`` validated with errors naming ``where`` (the file it comes from) instead of ``"Trace"``.

    ``tensors`` are the ``Trace`` tensor fields (``logits``, ``ids``, ...), already torch tensors.
    """
    unknown = sorted(set(tensors) - set(TENSOR_NAMES))
    if unknown:
        raise TypeError(f"unknown trace tensors {unknown}; allowed: {list(TENSOR_NAMES)}")
    trace = Trace.__new__(Trace)
    trace.spec, trace.meta = spec, dict(meta or {})
    for name in TENSOR_NAMES:
        setattr(trace, name, tensors.get(name))
    validate(trace, where=where)
    for name in INTEGER_NAMES:
        value = getattr(trace, name)
        if value is not None:
            setattr(trace, name, value.long())
    return trace


def _fail(where: str, field_name: str, message: str) -> None:
    raise ValueError(f"{where}: field {field_name!r}: {message}")


def validate(trace: Trace, where: str) -> None:
    """Check every tensor's shape and dtype against the spec, then every row (``oea.traces.checks``);
    raises ``ValueError`` naming ``where`` (a file or ``"Trace"``), the field and the first bad row."""
    if trace.logits is None and trace.ids is None:
        _fail(where, "logits/ids", "a trace needs full logits or top-k ids, got neither")
    spec = trace.spec
    if spec.num_experts > MAX_EXPERTS:
        _fail(where, "spec.num_experts", f"must be in 1..{MAX_EXPERTS} (expert ids are stored as int16), got "
              f"{spec.num_experts}")
    main = trace.logits if trace.logits is not None else trace.ids
    assert main is not None
    if main.dim() != 3:
        _fail(where, "logits" if trace.logits is not None else "ids",
              f"must have shape [tokens, layers, experts-or-k], got {tuple(main.shape)}")
    t, layers = int(main.shape[0]), int(main.shape[1])
    if t < 1 or layers < 1:
        _fail(where, "num_tokens",
              f"a trace needs at least one token and one layer, got shape {tuple(main.shape)}")
    if trace.logits is not None:
        if tuple(trace.logits.shape) != (t, layers, spec.num_experts):
            _fail(where, "logits", f"expected shape [T={t}, L={layers}, N={spec.num_experts}], "
                  f"got {tuple(trace.logits.shape)}")
        if not trace.logits.is_floating_point():
            _fail(where, "logits", f"must be floating point, got {trace.logits.dtype}")
    for name in ("ids", "scores"):
        tensor = getattr(trace, name)
        if tensor is None:
            continue
        if tuple(tensor.shape) != (t, layers, spec.top_k):
            _fail(where, name,
                  f"expected shape [T={t}, L={layers}, k={spec.top_k}], got {tuple(tensor.shape)}")
    if trace.scores is not None and trace.ids is None:
        _fail(where, "scores", "scores need the ids they belong to")
    for name in ("request_ids", "positions", "step_ids"):
        tensor = getattr(trace, name)
        if tensor is not None and tuple(tensor.shape) != (t,):
            _fail(where, name, f"expected shape [T={t}], got {tuple(tensor.shape)}")
    if trace.correction_bias is not None and tuple(trace.correction_bias.shape) != (layers, spec.num_experts):
        _fail(where, "correction_bias", f"expected shape [L={layers}, N={spec.num_experts}], "
              f"got {tuple(trace.correction_bias.shape)}")
    check_contents(trace, where)


def spec_from_json(raw: Any, where: str) -> RouterSpec:
    """A ``RouterSpec`` from its JSON form; raises ``ValueError`` naming ``where`` and the field."""
    if not isinstance(raw, dict):
        _fail(where, "spec", f"must be an object with {list(SPEC_FIELDS)}, got {raw!r}")
    unknown = sorted(set(raw) - set(SPEC_FIELDS))
    if unknown:
        _fail(where, "spec", f"unknown keys {unknown}; allowed: {list(SPEC_FIELDS)}")
    for name in ("num_experts", "top_k"):
        if name not in raw:
            _fail(where, f"spec.{name}", "missing")
    try:
        return RouterSpec(**raw)
    except ValueError as err:
        raise ValueError(f"{where}: field 'spec': {err}") from err


def save_trace(trace: Trace, path: str | pathlib.Path) -> pathlib.Path:
    """Write ``trace`` to ``path`` (``.safetensors``, else ``ValueError``) and its ``.json`` sidecar; returns the
    tensor file.

    Ids are stored as uint8 when N <= 256 (int16 otherwise), logits and scores as float16 when they
    are float16 already, else float32; request ids and positions as int32.
    """
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"path must name a .safetensors file (its .json sidecar goes next to it), got {str(path)!r}")
    if path.exists() and not path.is_file():
        raise ValueError(f"path {str(path)!r} is not a regular file (a folder, device or pipe); give a file path")
    validate(trace, where=str(path))
    tensors: dict[str, torch.Tensor] = {}
    if trace.logits is not None:
        dtype = torch.float16 if trace.logits.dtype == torch.float16 else torch.float32
        tensors["logits"] = trace.logits.to(dtype)
    if trace.ids is not None:
        tensors["ids"] = trace.ids.to(torch.uint8 if trace.spec.num_experts <= 256 else torch.int16)
    if trace.scores is not None:
        dtype = torch.float16 if trace.scores.dtype == torch.float16 else torch.float32
        tensors["scores"] = trace.scores.to(dtype)
    for name in ("request_ids", "positions", "step_ids"):
        tensor = getattr(trace, name)
        if tensor is not None:
            tensors[name] = tensor.to(torch.int32)
    if trace.correction_bias is not None:
        tensors["correction_bias"] = trace.correction_bias.float()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    path.chmod(0o644)
    meta = sidecar(trace.meta, trace.spec, trace.num_tokens, trace.num_layers, list(tensors))
    sidecar_path(path).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return path


def read_trace_file(path: str | pathlib.Path) -> Trace:
    """Load a trace from its ``.safetensors`` file (or its ``.json`` sidecar, or the common stem).

    Raises ``FileNotFoundError`` when a file is missing and ``ValueError`` naming the file and the
    field when the metadata and the tensors disagree.
    """
    from safetensors import SafetensorError, safe_open

    path = pathlib.Path(path)
    if path.suffix in (".json", ""):
        path = path.with_suffix(".safetensors")
    meta_path = sidecar_path(path)
    if path.is_dir():
        raise ValueError(f"trace file {path} is a directory; give a .safetensors trace file")
    if not path.is_file():
        raise FileNotFoundError(f"trace file does not exist: {path}")
    if not meta_path.is_file():
        raise FileNotFoundError(f"trace sidecar does not exist: {meta_path} (every {path.name} needs its JSON "
                                f"sidecar; `oea traces import` writes both)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path}: not valid JSON ({err})") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{meta_path}: field 'format' must be {FORMAT_NAME!r}, got "
                         f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: field 'version' must be {FORMAT_VERSION}, got {meta.get('version')!r}"
        )
    spec = spec_from_json(meta.get("spec"), str(meta_path))
    check_sidecar(meta, str(meta_path))
    try:  # a recording's checkpoint pads its growing tensors with "_pad<i>" bytes: never read
        with safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys() if not name.startswith(PAD_PREFIX)}  # noqa: SIM118
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from err
    unknown = sorted(set(tensors) - set(TENSOR_NAMES))
    if unknown:
        raise ValueError(f"{path}: unknown tensors {unknown}; allowed: {list(TENSOR_NAMES)}")
    listed = meta.get("tensors")
    if listed is not None and sorted(listed) != sorted(tensors):
        raise ValueError(f"{meta_path}: field 'tensors' lists {sorted(listed)} but {path.name} holds "
                         f"{sorted(tensors)}")

    def as_float(name: str) -> torch.Tensor | None:
        return tensors[name].float() if name in tensors else None

    def as_long(name: str) -> torch.Tensor | None:
        return tensors[name].long() if name in tensors else None

    for name in INTEGER_NAMES:  # before the int64 conversion below would truncate float ids
        if name in tensors:
            check_integer(tensors[name], str(path), name)
    trace_meta = {k: v for k, v in meta.items() if k not in FORMAT_KEYS}
    trace_meta.setdefault("name", path.stem)
    trace_meta["path"] = str(path)
    trace = make_trace(
        str(path), spec, logits=as_float("logits"), ids=as_long("ids"), scores=as_float("scores"),
        request_ids=as_long("request_ids"), positions=as_long("positions"), step_ids=as_long("step_ids"),
        correction_bias=as_float("correction_bias"), meta=trace_meta,
    )
    for name, actual in (("num_tokens", trace.num_tokens), ("num_layers", trace.num_layers)):
        if meta.get(name) != actual:
            raise ValueError(f"{meta_path}: field {name!r} is {meta.get(name)!r} but the tensors in "
                             f"{path.name} hold {actual}")
    return trace
