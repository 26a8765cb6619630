"""User-defined model presets (``--model-preset-file``): a small JSON or TOML file -> ``ModelPreset``.

Fields (``docs/presets.md`` shows an example):

==========================  ========  =============================================================
field                       required  allowed values
==========================  ========  =============================================================
``name``                    no        a string, not a built-in preset name (default: the file's stem)
``num_experts``             yes       integer in 1..32768 (``MAX_EXPERTS``): routed experts per MoE layer
``top_k``                   yes       integer in 1..num_experts
``hidden_size``             yes       integer >= 1 (d_model)
``moe_intermediate_size``   yes       integer >= 1: intermediate width of one routed expert
``num_moe_layers``          yes       integer >= 1: MoE layers (dense layers excluded)
``bytes_per_weight``        yes       a number > 0, or one of ``WEIGHT_FORMATS`` (``"bf16"``, ``"fp8"``, ...)
``scoring``                 no        ``"softmax"`` (default) or ``"sigmoid"``
``n_group`` / ``topk_group``  no      integers: group-limited routing (n_group divides num_experts,
                                      1 <= topk_group <= n_group); both or neither
``num_shared_experts``      no        integer >= 0 (always on, not routed; default 0)
``tp`` / ``ep``             no        integers >= 1: the deployment's tensor / expert parallel degree
                                      (default 1; not both > 1; ep divides num_experts); a ``--tp`` /
                                      ``--ep`` flag given on the command line wins
``source``                  no        a string: where the numbers come from
==========================  ========  =============================================================

Every error names the file, the field and the allowed values.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

from oea.presets import MODEL_PRESETS, MXFP4_BYTES, NVFP4_BYTES, ModelPreset, get_model_preset
from oea.trace_schema import MAX_EXPERTS

WEIGHT_FORMATS: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "nvfp4": NVFP4_BYTES, "mxfp4": MXFP4_BYTES,
}
REQUIRED: tuple[str, ...] = ("num_experts", "top_k", "hidden_size", "moe_intermediate_size", "num_moe_layers",
                             "bytes_per_weight")
OPTIONAL: tuple[str, ...] = ("name", "scoring", "n_group", "topk_group", "num_shared_experts", "tp", "ep", "source")
SUFFIXES: tuple[str, ...] = (".json", ".toml")


@dataclass(frozen=True)
class PresetFile:
    """A model preset read from a file, with the deployment's parallel degrees (``None`` = not given)."""

    model: ModelPreset
    tp: int | None = None
    ep: int | None = None
    path: str = ""


def _read(path: pathlib.Path) -> Any:
    if path.is_dir():
        raise ValueError(f"model preset file {path} is a directory; give a .json or .toml file")
    if not path.is_file():
        raise FileNotFoundError(f"model preset file does not exist: {path}")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{path}: model preset file must be JSON or TOML ({list(SUFFIXES)}), got "
                         f"{path.suffix or 'no suffix'!r}")
    text = path.read_text()
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML ({err})") from None


def _int(raw: dict, name: str, where: str, minimum: int, maximum: int | None = None,
         allowed: str | None = None) -> int:
    value = raw[name]
    limits = allowed or (f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (
        maximum is not None and value > maximum
    ):
        raise ValueError(f"{where}: field {name!r} must be {limits}, got {value!r}")
    return value


def load_model_preset_file(path: str | pathlib.Path) -> PresetFile:
    """Read and validate a user model preset (JSON or TOML; fields in the module docstring).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file, the field and
    the allowed values for anything else.
    """
    path = pathlib.Path(path)
    raw = _read(path)
    where = str(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must hold one table/object of preset fields, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; allowed: {list(REQUIRED) + list(OPTIONAL)}")
    missing = [name for name in REQUIRED if name not in raw]
    if missing:
        raise ValueError(f"{where}: missing required fields {missing} (required: {list(REQUIRED)})")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: field 'name' must be a non-empty string, got {name!r}")
    if name in MODEL_PRESETS:
        raise ValueError(f"{where}: field 'name' {name!r} is a built-in preset ({sorted(MODEL_PRESETS)}); choose "
                         f"another name, e.g. {name + '-custom'!r}")
    num_experts = _int(raw, "num_experts", where, 1, MAX_EXPERTS)  # the most a trace (int16 ids) can hold
    top_k = _int(raw, "top_k", where, 1, num_experts)
    dims = {key: _int(raw, key, where, 1) for key in ("hidden_size", "moe_intermediate_size", "num_moe_layers")}
    bytes_per_weight = _bytes(raw["bytes_per_weight"], where)
    scoring = raw.get("scoring", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"{where}: field 'scoring' must be one of ['softmax', 'sigmoid'], got {scoring!r}")
    n_group = topk_group = None
    if ("n_group" in raw) != ("topk_group" in raw):
        raise ValueError(f"{where}: fields 'n_group' and 'topk_group' go together (group-limited routing); "
                         f"give both or neither")
    if "n_group" in raw:
        n_group = _int(raw, "n_group", where, 1, allowed=f"an integer >= 1 dividing num_experts={num_experts}")
        if num_experts % n_group:
            raise ValueError(f"{where}: field 'n_group' must divide num_experts={num_experts}, got {n_group}")
        topk_group = _int(raw, "topk_group", where, 1, n_group)
    shared = _int(raw, "num_shared_experts", where, 0) if "num_shared_experts" in raw else 0
    tp = _int(raw, "tp", where, 1) if "tp" in raw else None
    ep = _int(raw, "ep", where, 1) if "ep" in raw else None
    if ep is not None and num_experts % ep:
        raise ValueError(f"{where}: field 'ep' must divide num_experts={num_experts}, got {ep}")
    if (tp or 1) > 1 and (ep or 1) > 1:
        raise ValueError(f"{where}: fields 'tp' and 'ep': the cost model combines either tensor or expert "
                         f"parallelism, not both; got tp={tp} ep={ep}")
    source = raw.get("source", f"user preset file {path}")
    if not isinstance(source, str):
        raise ValueError(f"{where}: field 'source' must be a string, got {source!r}")
    model = ModelPreset(name=name, num_experts=num_experts, top_k=top_k, bytes_per_weight=bytes_per_weight,
                        scoring=scoring, n_group=n_group, topk_group=topk_group, num_shared_experts=shared,
                        source=source, **dims)
    return PresetFile(model=model, tp=tp, ep=ep, path=where)


def _bytes(value: Any, where: str) -> float:
    if isinstance(value, str):
        if value.lower() in WEIGHT_FORMATS:
            return WEIGHT_FORMATS[value.lower()]
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"{where}: field 'bytes_per_weight' must be a number > 0 or one of {sorted(WEIGHT_FORMATS)}, "
                     f"got {value!r}")


def resolve_model_preset(name: str | None, file: str | None, name_flag: str = "--model-preset") -> PresetFile | None:
    """The preset a command asked for: a built-in ``name`` or a ``file`` (not both); ``None`` when neither."""
    if name is not None and file is not None:
        raise ValueError(f"give {name_flag} or --model-preset-file, not both (got {name!r} and {file!r})")
    if file is not None:
        return load_model_preset_file(file)
    if name is not None:
        return PresetFile(model=get_model_preset(name))
    return None


def add_model_preset_file_argument(parser: Any) -> None:
    """``--model-preset-file FILE`` on an ``argparse`` parser (shared by every command that predicts latency)."""
    parser.add_argument("--model-preset-file", default=None, metavar="FILE",
                        help="user model preset (JSON or TOML; fields in docs/presets.md) instead of a built-in "
                             "name; its tp/ep are used unless --tp/--ep are given")


def parallel_degrees(preset: PresetFile | None, tp: int | None, ep: int | None) -> tuple[int, int | None]:
    """``(tp, ep)``: a command-line flag wins, then the preset file's value; tp defaults to 1, ep to ``None``."""
    file_tp = preset.tp if preset is not None else None
    file_ep = preset.ep if preset is not None else None
    resolved_tp = tp if tp is not None else (file_tp or 1)
    resolved_ep = ep if ep is not None else file_ep
    return resolved_tp, resolved_ep


def parallel_names(preset: PresetFile | None, tp: int | None, ep: int | None) -> tuple[str, str]:
    """What set tp and ep (``parallel_degrees``), for an error message: the flag, else the preset file's field."""

    def name(flag: str, value: int | None, field: str) -> str:
        if value is not None or preset is None or getattr(preset, field) is None:
            return flag
        return f"{field} of --model-preset-file {preset.path}"

    return name("--tp", tp, "tp"), name("--ep", ep, "ep")
