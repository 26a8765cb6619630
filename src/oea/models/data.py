"""Training/held-out data for the embedded model: the Python standard library's own ``.py`` files.

The split is a pure function of each file's path relative to the stdlib root (a SHA-256 hash), so
every machine with the same Python minor version reproduces it without shipping any text.
"""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
from dataclasses import dataclass
from typing import Any

import numpy as np

# Directories skipped anywhere in the relative path: machine-specific build config, the
# near-duplicate codec tables, and test suites (large, repetitive, and partly not Python).
EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"encodings", "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
HELDOUT_BUCKETS = 10  # one bucket in ten is held out (~10%)


@dataclass(frozen=True)
class StdlibFile:
    """One standard-library source file: ``name`` is its POSIX path relative to the stdlib root."""

    name: str
    path: pathlib.Path


def stdlib_root() -> pathlib.Path:
    """The running interpreter's standard-library directory."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def is_heldout(name: str) -> bool:
    """True iff the relative file ``name`` falls in the held-out bucket of the hash split."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_BUCKETS == 0


def _excluded(relative: pathlib.PurePosixPath) -> bool:
    dirs = relative.parts[:-1]
    return any(part in EXCLUDED_DIRS or part.startswith("config-") for part in dirs)


def stdlib_files(root: pathlib.Path | None = None) -> list[StdlibFile]:
    """All eligible ``.py`` files under ``root`` (default: this interpreter's stdlib), sorted by name."""
    root = stdlib_root() if root is None else root
    if not root.is_dir():
        raise FileNotFoundError(f"standard-library directory not found: {root}")
    found = []
    for path in root.rglob("*.py"):
        relative = pathlib.PurePosixPath(path.relative_to(root).as_posix())
        if not _excluded(relative) and path.is_file():
            found.append(StdlibFile(str(relative), path))
    return sorted(found, key=lambda f: f.name)


def split_files(files: list[StdlibFile]) -> tuple[list[StdlibFile], list[StdlibFile]]:
    """(train, held-out) by the deterministic name hash; both keep the input order."""
    train = [f for f in files if not is_heldout(f.name)]
    heldout = [f for f in files if is_heldout(f.name)]
    return train, heldout


def read_text(path: pathlib.Path) -> str:
    """A source file's text (UTF-8; undecodable bytes replaced, as a few stdlib files carry latin-1)."""
    return path.read_bytes().decode("utf-8", errors="replace")


def sha256_text(text: str) -> str:
    """Hex SHA-256 of ``text`` encoded as UTF-8 (recorded so a changed stdlib file can be detected)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def token_stream(tokenizer: Any, texts: list[str]) -> np.ndarray:
    """All ``texts`` as one int32 stream [total]; each document is preceded by the EOS/BOS separator."""
    sep = tokenizer.eos_token_id
    parts = [np.asarray([sep, *ids], dtype=np.int32)
             for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return np.concatenate(parts)


def sample_windows(stream: np.ndarray, step: int, seed: int, batch: int, length: int) -> np.ndarray:
    """``[batch, length]`` int64 windows at random offsets of ``stream``, a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)
