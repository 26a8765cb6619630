"""The embedded model's data split, token stream and loaders (``oea.models``)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from oea.models import heldout_documents, load_model
from oea.models.data import (
    EXCLUDED_DIRS,
    is_heldout,
    sample_windows,
    split_files,
    stdlib_files,
    stdlib_root,
    token_stream,
)


def test_split_is_deterministic_disjoint_and_about_ten_percent() -> None:
    files = stdlib_files()
    train, heldout = split_files(files)
    assert {f.name for f in train}.isdisjoint({f.name for f in heldout})
    assert len(train) + len(heldout) == len(files)
    assert 0.05 < len(heldout) / len(files) < 0.15
    assert [f.name for f in split_files(stdlib_files())[1]] == [f.name for f in heldout]
    assert all(is_heldout(f.name) for f in heldout) and not any(is_heldout(f.name) for f in train)


def test_stdlib_files_skip_excluded_directories() -> None:
    files = stdlib_files()
    assert any(f.name == "json/decoder.py" for f in files)
    for f in files:
        assert not set(pathlib.PurePosixPath(f.name).parts[:-1]) & EXCLUDED_DIRS, f.name
        assert f.path == stdlib_root() / f.name


def test_stdlib_files_rejects_a_missing_root(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        stdlib_files(tmp_path / "nowhere")


def test_split_depends_only_on_the_name(tmp_path: pathlib.Path) -> None:
    names = [f"pkg{i}/mod{i}.py" for i in range(200)]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_x.py").write_text("pass\n")
    files = stdlib_files(tmp_path)
    assert [f.name for f in files] == sorted(names)  # test/ excluded
    _, heldout = split_files(files)
    assert {f.name for f in heldout} == {n for n in names if is_heldout(n)}


class _CharTokenizer:
    eos_token_id = 0

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_token_stream_separates_documents() -> None:
    stream = token_stream(_CharTokenizer(), ["ab", "c"])
    assert stream.tolist() == [0, 97, 98, 0, 99]


def test_sample_windows_is_a_function_of_seed_and_step() -> None:
    stream = np.arange(1000, dtype=np.int32)
    a = sample_windows(stream, 3, 0, 4, 16)
    assert a.shape == (4, 16) and a.dtype == np.int64
    assert np.array_equal(a, sample_windows(stream, 3, 0, 4, 16))
    assert not np.array_equal(a, sample_windows(stream, 4, 0, 4, 16))
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous windows


def test_load_model_missing_path_names_it(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing)
    missing.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(missing)


def test_heldout_documents_fail_clearly_on_a_missing_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"heldout_files\.json"):
        heldout_documents(tmp_path)
    listing = {"python": "3.x", "files": [{"name": "json/decoder.py", "sha256": ""},
                                          {"name": "no_such_module_xyz.py", "sha256": ""}]}
    (tmp_path / "heldout_files.json").write_text(json.dumps(listing))
    with pytest.raises(FileNotFoundError, match=r"no_such_module_xyz\.py"):
        heldout_documents(tmp_path)
    listing["files"] = listing["files"][:1]
    (tmp_path / "heldout_files.json").write_text(json.dumps(listing))
    [(name, text)] = heldout_documents(tmp_path)
    assert name == "json/decoder.py" and "JSONDecoder" in text
