"""Bundled traces (``traces/<name>.safetensors`` + ``<name>.json`` of the ``oea_lab_data`` package, which
``pip install 'oea[lab]'`` installs) and ``load_trace``.

A trace file given by path loads without that package; a bundled name, or an error listing the bundled names, needs
it (``ModuleNotFoundError`` naming the install, ``oea.models.lab_data``).
"""

from __future__ import annotations

import pathlib

from oea.models.lab_data import LAB_DATA_MODULE, LAB_INSTALL, lab_data_dir
from oea.traces.format import Trace, read_trace_file

# A name with a directory or one of these suffixes is a path, never a bundled trace's name.
TRACE_SUFFIXES = (".safetensors", ".json")


def bundled_trace_dir() -> pathlib.Path:
    """Folder of the bundled traces (``traces/`` of the installed ``oea_lab_data`` package) and their attribution
    (``SOURCES.md``, licence texts)."""
    return lab_data_dir("traces")


def bundled_trace_names() -> list[str]:
    """Names of the bundled traces (e.g. ``qwen3-30b-a3b``, ``flame-moe-290m``)."""
    folder = bundled_trace_dir()
    return sorted(p.stem for p in folder.glob("*.safetensors") if p.with_suffix(".json").is_file())


def bundled_trace_path(name: str) -> pathlib.Path:
    """Path of the bundled trace ``name``; raises ``ValueError`` listing the bundled names."""
    path = bundled_trace_dir() / f"{name}.safetensors"
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
    path = pathlib.Path(name_or_path)
    bare = isinstance(name_or_path, str) and len(path.parts) == 1 and path.suffix not in TRACE_SUFFIXES
    if bare and text in (_installed_names() or ()):
        return read_trace_file(bundled_trace_dir() / f"{text}.safetensors")
    candidates = (path, path.with_suffix(".safetensors")) if path.suffix != ".safetensors" else (path,)
    if any(c.is_file() for c in candidates):
        return read_trace_file(path)
    if path.is_dir():
        raise ValueError(f"trace {text} is a directory; give a .safetensors trace file or a bundled trace name "
                         f"{_listing()}")
    if path.suffix in TRACE_SUFFIXES or len(path.parts) > 1:
        raise FileNotFoundError(f"trace file does not exist: {text} (bundled traces: {_listing()})")
    raise ValueError(f"trace must be one of the bundled traces {_listing()} or a path to a "
                     f".safetensors trace file, got {text!r}")


def _installed_names() -> list[str] | None:
    """``bundled_trace_names()``, or None without the data package: a trace file given by path needs no data."""
    try:
        return bundled_trace_names()
    except ModuleNotFoundError as err:
        if err.name != LAB_DATA_MODULE:
            raise
        return None


def _listing() -> str:
    """The bundled names for an error message, or what to install to have them."""
    names = _installed_names()
    return str(names) if names is not None else f"(none installed: {LAB_INSTALL})"
