"""``oea traces import``: third-party routing arrays (npz, npy, JSON lines, CSV) -> a validated ``oea-trace``.

Shape legend: T = recorded tokens, L = MoE layers, N = routed experts, k = top-k.

Input layouts (``docs/traces.md`` shows each one):

* ``.npz``: arrays ``ids`` [T, L, k] (best first) and optionally ``scores`` [T, L, k], ``logits``
  [T, L, N], ``request_ids`` [T], ``positions`` [T], ``step_ids`` [T]. ``ids`` / ``scores`` / ``logits`` may
  drop the layer axis ([T, k], [T, N]) for a single layer.
* ``.npy``: one array, the ``ids``.
* ``.jsonl`` / ``.ndjson``: one JSON object per token, in order: ``{"ids": [[...k] per layer],
  "scores": [[...]], "request_id": 3, "position": 17, "step_id": 5}``; only ``ids`` is required, and a key present in
  one line must be present in every line.
* ``.csv``: a header and one row per (token, layer): ``token``, ``layer``, ``id_0`` .. ``id_{k-1}``, and
  optionally ``score_0`` .. ``score_{k-1}``, ``request_id``, ``position``, ``step_id``; every (token, layer)
  pair exactly once, tokens numbered 0..T-1, layers 0..L-1.

When ``request_ids`` are given without ``positions``, each token's position is its decode step within
its request (0, 1, 2, ... in file order), and the trace's notes say so.
"""

from __future__ import annotations

import csv
import json
import pathlib
import zipfile
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from oea.routing import RouterSpec
from oea.trace_schema import MAX_EXPERTS
from oea.traces.checks import ordering_status
from oea.traces.format import Trace, make_trace

ARRAY_KEYS: tuple[str, ...] = ("ids", "scores", "logits", "request_ids", "positions", "step_ids")
SUFFIXES: tuple[str, ...] = (".npz", ".npy", ".jsonl", ".ndjson", ".csv")
_PER_LAYER = ("ids", "scores", "logits")
_JSONL_KEYS = {"ids": "ids", "scores": "scores", "logits": "logits", "request_id": "request_ids",
               "position": "positions", "step_id": "step_ids"}


def read_arrays(path: str | pathlib.Path, top_k: int) -> dict[str, np.ndarray]:
    """The arrays of an input file by field name (``ARRAY_KEYS``), per-layer fields as [T, L, ·].

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file, the field
    and the line or row for a malformed one.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"input file {path} is a directory; give a file")
    if not path.is_file():
        raise FileNotFoundError(f"input file does not exist: {path}")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        arrays = _read_npz(path)
    elif suffix == ".npy":
        arrays = {"ids": _load_numpy(path)}
    elif suffix in (".jsonl", ".ndjson"):
        arrays = _read_jsonl(path)
    elif suffix == ".csv":
        arrays = _read_csv(path, top_k)
    else:
        raise ValueError(f"{path}: input format must be one of {list(SUFFIXES)} (by file suffix), got "
                         f"{path.suffix or 'no suffix'!r}")
    if "ids" not in arrays and "logits" not in arrays:
        raise ValueError(f"{path}: field 'ids': missing; an input needs 'ids' [tokens, layers, k] (or 'logits')")
    for name in _PER_LAYER:
        if name in arrays:
            arrays[name] = _with_layer_axis(arrays[name], path, name)
    for name in ("request_ids", "positions", "step_ids"):
        if name in arrays and arrays[name].ndim != 1:
            raise ValueError(f"{path}: field {name!r}: must have shape [tokens], got {arrays[name].shape}")
    return arrays


# How each numpy format begins: a file that does not is named as not being one (np.load would try it as a
# pickle and speak of "pickled data", which says nothing about a text file given the wrong suffix).
_MAGIC = {".npz": (b"PK\x03\x04", b"PK\x05\x06"), ".npy": (b"\x93NUMPY",)}
# A cut or corrupt archive: zipfile's, zlib's and numpy's own errors while reading it.
_UNREADABLE = (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error)


def _load_numpy(path: pathlib.Path) -> Any:
    suffix = path.suffix.lower()
    with open(path, "rb") as handle:
        start = handle.read(8)
    if not start.startswith(_MAGIC[suffix]):
        kind = "an .npz archive (a zip file)" if suffix == ".npz" else "a .npy file"
        raise ValueError(f"{path}: not {kind}: it does not begin as one (is it another format with a {suffix} "
                         "suffix?)")
    try:
        return np.load(path, allow_pickle=False)
    except _UNREADABLE as err:
        raise ValueError(f"{path}: unreadable {suffix} file, cut short or corrupt ({type(err).__name__}: {err}); "
                         "numpy arrays without pickled objects are read") from None


def _read_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
    archive = _load_numpy(path)
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: not an .npz archive")
    with archive:
        unknown = sorted(set(archive.files) - set(ARRAY_KEYS))
        if unknown:
            raise ValueError(f"{path}: unknown arrays {unknown}; allowed: {list(ARRAY_KEYS)}")
        try:
            return {name: archive[name] for name in archive.files}
        except _UNREADABLE as err:
            raise ValueError(f"{path}: unreadable .npz archive, cut short, corrupt or holding pickled objects "
                             f"({type(err).__name__}: {err})") from None


def _with_layer_axis(array: np.ndarray, path: pathlib.Path, name: str) -> np.ndarray:
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{path}: field {name!r}: must hold numbers, got dtype {array.dtype}")
    if array.ndim == 2:
        return array[:, None, :]
    if array.ndim != 3:
        what = "N" if name == "logits" else "k"
        raise ValueError(f"{path}: field {name!r}: must have shape [tokens, layers, {what}] (or [tokens, {what}] "
                         f"for one layer), got {array.shape}")
    return array


def _read_jsonl(path: pathlib.Path) -> dict[str, np.ndarray]:
    columns: dict[str, list[Any]] = {}
    keys: set[str] | None = None
    shapes: dict[str, tuple[int, ...]] = {}
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: must be a JSON object with keys {sorted(_JSONL_KEYS)}")
            unknown = sorted(set(record) - set(_JSONL_KEYS))
            if unknown:
                raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(_JSONL_KEYS)}")
            if keys is None:
                keys = set(record)
            elif set(record) != keys:
                raise ValueError(f"{where}: has keys {sorted(record)} but the first line has {sorted(keys)}; "
                                 f"every line must carry the same keys")
            for key, value in record.items():
                field = _JSONL_KEYS[key]
                if field in _PER_LAYER:
                    value = _nested(value, where, key)
                    shape = np.shape(value)
                    if shapes.setdefault(key, shape) != shape:
                        raise ValueError(f"{where}: field {key!r}: shape {shape} differs from the first line's "
                                         f"{shapes[key]}")
                elif not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ValueError(f"{where}: field {key!r}: must be a number, got {value!r}")
                columns.setdefault(field, []).append(value)
    if not columns:
        raise ValueError(f"{path}: no records (one JSON object per line expected)")
    return {field: np.asarray(values) for field, values in columns.items()}


def _nested(value: Any, where: str, key: str) -> Any:
    """A list of numbers or a list of equally long lists of numbers (else a ValueError naming ``key``)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field {key!r}: must be a non-empty list (per layer: a list of lists)")
    rows = value if isinstance(value[0], list) else [value]
    for row in rows:
        if not isinstance(row, list) or len(row) != len(rows[0]) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in row
        ):
            raise ValueError(f"{where}: field {key!r}: must be a list of numbers per layer, all of the same "
                             f"length, got {value!r}")
    return value


def _read_csv(path: pathlib.Path, top_k: int) -> dict[str, np.ndarray]:
    id_columns = [f"id_{j}" for j in range(top_k)]
    score_columns = [f"score_{j}" for j in range(top_k)]
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = [name.strip() for name in (reader.fieldnames or [])]
        missing = [name for name in ("token", "layer", *id_columns) if name not in header]
        if missing:
            raise ValueError(f"{path}: header lacks columns {missing} (with --top-k {top_k} the required columns "
                             f"are token, layer, {', '.join(id_columns)})")
        optional = [*score_columns, "request_id", "position", "step_id"]
        unknown = [name for name in header if name not in ("token", "layer", *id_columns, *optional)]
        if unknown:
            raise ValueError(f"{path}: unknown columns {unknown}; allowed: token, layer, id_0..id_{top_k - 1}, "
                             f"score_0..score_{top_k - 1}, request_id, position, step_id")
        has_scores = any(name in header for name in score_columns)
        if has_scores and not all(name in header for name in score_columns):
            raise ValueError(f"{path}: scores need all of {score_columns}")
        rows = []
        for number, raw in enumerate(reader, start=2):
            row = {key.strip(): (value or "").strip() for key, value in raw.items() if key is not None}
            rows.append((number, row))
    if not rows:
        raise ValueError(f"{path}: no data rows after the header")

    def number(line: int, row: dict[str, str], column: str, kind: type) -> Any:
        text = row.get(column, "")
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{path}: line {line}: column {column!r} must be {what}, got {text!r}") from None

    cells = {}
    for line, row in rows:
        key = (number(line, row, "token", int), number(line, row, "layer", int))
        if key[0] < 0 or key[1] < 0:
            raise ValueError(f"{path}: line {line}: token and layer must be >= 0, got {key}")
        if key in cells:
            raise ValueError(f"{path}: line {line}: (token {key[0]}, layer {key[1]}) appears twice "
                             f"(first on line {cells[key][0]})")
        cells[key] = (line, row)
    tokens = 1 + max(t for t, _ in cells)
    layers = 1 + max(layer for _, layer in cells)
    for t in range(tokens):
        for layer in range(layers):
            if (t, layer) not in cells:
                raise ValueError(f"{path}: (token {t}, layer {layer}) is missing; every token needs a row for "
                                 f"each of layers 0..{layers - 1}")
    arrays: dict[str, np.ndarray] = {"ids": np.zeros((tokens, layers, top_k), dtype=np.int64)}
    if has_scores:
        arrays["scores"] = np.zeros((tokens, layers, top_k), dtype=np.float64)
    per_token = [name for name in ("request_id", "position", "step_id") if name in header]
    for name in per_token:
        arrays[name + "s"] = np.zeros(tokens, dtype=np.int64)
    for (t, layer), (line, row) in cells.items():
        arrays["ids"][t, layer] = [number(line, row, c, int) for c in id_columns]
        if has_scores:
            arrays["scores"][t, layer] = [number(line, row, c, float) for c in score_columns]
        for name in per_token:
            value = number(line, row, name, int)
            if layer == 0:
                arrays[name + "s"][t] = value
    for name in per_token:  # a token's request and position must agree across its layers
        for (t, layer), (line, row) in cells.items():
            if number(line, row, name, int) != arrays[name + "s"][t]:
                raise ValueError(f"{path}: line {line}: column {name!r} of token {t} is {row[name]} at layer "
                                 f"{layer} but {arrays[name + 's'][t]} at layer 0")
    return arrays


def decode_steps(request_ids: torch.Tensor) -> torch.Tensor:
    """[T] request ids -> [T] int64: each token's step within its request (0, 1, ... in order)."""
    steps = torch.empty_like(request_ids, dtype=torch.int64)
    seen: dict[int, int] = {}
    for index, request in enumerate(request_ids.tolist()):
        steps[index] = seen.get(request, 0)
        seen[request] = steps[index].item() + 1
    return steps


def import_trace(
    path: str | pathlib.Path,
    num_experts: int,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    name: str | None = None,
    sort_by_scores: bool = False,
    meta: dict[str, Any] | None = None,
) -> Trace:
    """Read ``path`` (see the module docstring for the layouts) into a validated ``Trace``.

    Args:
        num_experts / top_k / scoring / renormalize: the model's router (``RouterSpec``).
        name: the trace's name (default: the input file's stem).
        sort_by_scores: reorder each row by descending score first (inputs not stored best first).
        meta: extra sidecar fields (``model``, ``model_preset``, ``source``, ``licence``, ...).

    Raises ``ValueError`` naming the input file, the field and the first offending row.
    """
    path = pathlib.Path(path)
    for flag, value, low in (("--num-experts", num_experts, 1), ("--top-k", top_k, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"--num-experts must be in 1..{MAX_EXPERTS} (a trace stores expert ids as int16), got "
                         f"{num_experts}")
    if name is not None and not name.strip():
        raise ValueError(f"--name must be a non-empty trace name, got {name!r} (omit it for the input file's stem)")
    if top_k > num_experts:
        raise ValueError(f"--top-k must be in 1..--num-experts={num_experts}, got {top_k}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"--scoring must be one of ['softmax', 'sigmoid'], got {scoring!r}")
    arrays = read_arrays(path, top_k)
    if sort_by_scores and "scores" not in arrays:
        raise ValueError(f"--sort-by-scores reorders each row by its scores, but {path} has no 'scores' (it holds "
                         f"{sorted(arrays)}); without scores the recorded order is kept: drop the flag")
    for field in ("ids", "scores"):
        if field in arrays and arrays[field].shape[-1] != top_k:
            raise ValueError(f"{path}: field {field!r}: has {arrays[field].shape[-1]} experts per row "
                             f"(shape {arrays[field].shape}) but --top-k is {top_k}")
    tensors = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in arrays.items()}
    for field in ("scores", "logits"):
        if field in tensors:
            tensors[field] = tensors[field].float()
    notes: list[str] = []
    if sort_by_scores and "scores" in tensors and "ids" in tensors:
        order = tensors["scores"].argsort(dim=-1, descending=True, stable=True)
        tensors["scores"] = tensors["scores"].gather(-1, order)
        tensors["ids"] = tensors["ids"].gather(-1, order)
        notes.append("rows were sorted by descending score on import (--sort-by-scores)")
    if "request_ids" in tensors and "positions" not in tensors and not tensors["request_ids"].is_floating_point():
        tensors["positions"] = decode_steps(tensors["request_ids"])
        notes.append("positions derived on import: each token's decode step within its request, in file order")
    trace_meta = {"name": name or path.stem, "source": f"imported by `oea traces import` from {path.name}",
                  "licence": "unknown (not stated on import)", **(meta or {})}
    spec = RouterSpec(num_experts, top_k, scoring=scoring, renormalize=renormalize)  # type: ignore[arg-type]
    trace = make_trace(str(path), spec, meta=trace_meta, **tensors)
    trace.meta["notes"] = [*trace.meta.get("notes", []), *notes, f"best-first order: {ordering_status(trace)}"]
    return trace


def summary(trace: Trace, written: Sequence[pathlib.Path]) -> dict[str, Any]:
    """The ``--json`` record of an import."""
    return {
        "out": str(written[0]), "sidecar": str(written[1]), "name": trace.name, "num_tokens": trace.num_tokens,
        "num_layers": trace.num_layers, "num_experts": trace.spec.num_experts, "top_k": trace.spec.top_k,
        "scoring": trace.spec.scoring,
        "tensors": [n for n in ("logits", "ids", "scores", "request_ids", "positions", "step_ids")
                    if getattr(trace, n) is not None],
        "order": ordering_status(trace), "notes": trace.meta["notes"],
    }
