"""Bundled traces (``oea/traces/data/<name>.safetensors`` + ``<name>.json``) and ``load_trace``."""

from __future__ import annotations

import pathlib

from oea.traces.format import Trace, read_trace_file

DATA_DIR = pathlib.Path(__file__).parent / "data"


def bundled_trace_names() -> list[str]:
    """Names of the traces shipped with the package (e.g. ``qwen3-30b-a3b``, ``flame-moe-290m``)."""
    return sorted(p.stem for p in DATA_DIR.glob("*.safetensors") if p.with_suffix(".json").is_file())


def bundled_trace_path(name: str) -> pathlib.Path:
    """Path of the bundled trace ``name``; raises ``ValueError`` listing the bundled names."""
    path = DATA_DIR / f"{name}.safetensors"
    if name not in bundled_trace_names():
        raise ValueError(f"trace must be one of the bundled traces {bundled_trace_names()} or a path to a "
                         f".safetensors trace file, got {name!r}")
    return path


def load_trace(name_or_path: str | pathlib.Path) -> Trace:
    """Load a bundled trace by name, or a trace file by path (``.safetensors``, its ``.json``, or stem).

    Raises ``FileNotFoundError`` when a path (a name with a directory or a ``.safetensors`` / ``.json``
    suffix) does not exist, ``ValueError`` listing the bundled names when a bare name is not bundled,
    and ``ValueError`` naming the file, field and row when a file is malformed (``oea.traces.checks``).
    """
    text = str(name_or_path)
    if isinstance(name_or_path, str) and text in bundled_trace_names():
        return read_trace_file(DATA_DIR / f"{text}.safetensors")
    path = pathlib.Path(name_or_path)
    candidates = (path, path.with_suffix(".safetensors")) if path.suffix != ".safetensors" else (path,)
    if any(c.is_file() for c in candidates):
        return read_trace_file(path)
    if path.is_dir():
        raise ValueError(f"trace {text} is a directory; give a .safetensors trace file or a bundled trace name "
                         f"{bundled_trace_names()}")
    if path.suffix in (".safetensors", ".json") or len(path.parts) > 1:
        raise FileNotFoundError(f"trace file does not exist: {text} (bundled traces: {bundled_trace_names()})")
    raise ValueError(f"trace must be one of the bundled traces {bundled_trace_names()} or a path to a "
                     f".safetensors trace file, got {text!r}")
