"""The embedded MoE model shipped with oea, and loading helpers for any HF MoE checkpoint.

The embedded model is a stock ``Qwen3MoeForCausalLM`` (128 experts, top-8, ``norm_topk_prob=True``,
Qwen3-30B-A3B's routing) trained on the Python standard library; see ``embedded/MODEL_CARD.md`` of the
``oea_lab_data`` package (``packages/oea-lab-data``), which ``pip install 'oea[lab]'`` installs: the ``oea`` wheel
ships no model files (``oea.models.lab_data``). transformers is imported lazily, inside the functions.
"""

from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING, Any

from oea.models.data import read_text, sha256_text, stdlib_root
from oea.models.lab_data import lab_data_dir

if TYPE_CHECKING:
    import torch

__all__ = ["embedded_model_dir", "heldout_changed", "heldout_documents", "load_embedded", "load_model"]

HELDOUT_FILE = "heldout_files.json"
# Files any transformers tokenizer is loaded from; without one, AutoTokenizer quietly builds an empty one.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def embedded_model_dir() -> pathlib.Path:
    """Directory of the embedded checkpoint (``config.json``, ``model.safetensors``, tokenizer files): ``embedded/``
    of the installed ``oea_lab_data`` package. Raises ``ModuleNotFoundError`` naming ``pip install 'oea[lab]'``
    when that package is not installed (``oea.models.lab_data``)."""
    return lab_data_dir("embedded")


def load_model(
    path: str | pathlib.Path | None = None,
    *,
    dtype: torch.dtype | None = None,
    experts_implementation: str | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local HF checkpoint directory, in eval mode.

    ``path=None`` loads the embedded model. ``dtype`` defaults to float32 (CPU-friendly and
    exact for comparisons); ``experts_implementation`` is passed to transformers when given
    (``"eager"``, ``"grouped_mm"``, ...). Raises ``FileNotFoundError`` naming the path when it
    does not exist, holds no ``config.json`` or no tokenizer (``TOKENIZER_FILES``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory = embedded_model_dir() if path is None else pathlib.Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model checkpoint not found: {directory} (expected a directory)")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"model checkpoint not found: {directory / 'config.json'} does not exist")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"model checkpoint {directory} has no tokenizer (none of "
                                f"{', '.join(TOKENIZER_FILES)}); copy the model's tokenizer files next to config.json")
    kwargs: dict[str, Any] = {"dtype": torch.float32 if dtype is None else dtype}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a local checkpoint loads in a blink: no "Loading weights" bar per load
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


def load_embedded(
    dtype: torch.dtype | None = None, experts_implementation: str | None = None
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the embedded model in eval mode (float32 unless ``dtype`` is given)."""
    return load_model(None, dtype=dtype, experts_implementation=experts_implementation)


def heldout_documents(model_dir: str | pathlib.Path | None = None) -> list[tuple[str, str]]:
    """``[(file name, text), ...]``: the model's held-out stdlib files, read from the local stdlib.

    The list comes from ``heldout_files.json`` in ``model_dir`` (default: the embedded model).
    Raises ``FileNotFoundError`` naming the file when the list or a listed stdlib file is missing
    (e.g. on a different Python minor version than the one the model was trained with).
    """
    directory = embedded_model_dir() if model_dir is None else pathlib.Path(model_dir)
    listing = directory / HELDOUT_FILE
    if not listing.is_file():
        raise FileNotFoundError(f"held-out file list not found: {listing}")
    record = json.loads(listing.read_text())
    entries = record["files"]
    root = stdlib_root()
    documents = []
    for entry in entries:
        path = root / entry["name"]
        if not path.is_file():
            raise FileNotFoundError(
                f"held-out stdlib file {entry['name']!r} not found under {root} "
                f"(the list in {listing} was made with Python {record.get('python', '?')})"
            )
        documents.append((entry["name"], read_text(path)))
    return documents


def heldout_changed(model_dir: str | pathlib.Path | None = None) -> list[str]:
    """Names of held-out files whose local text differs from the text the model was evaluated on."""
    directory = embedded_model_dir() if model_dir is None else pathlib.Path(model_dir)
    recorded = {e["name"]: e["sha256"] for e in json.loads((directory / HELDOUT_FILE).read_text())["files"]}
    return [name for name, text in heldout_documents(directory) if sha256_text(text) != recorded[name]]
