"""Noise silenced at its source: no "Loading weights" bar per model load, no too-long-sequence warning when
whole documents are tokenised for windows, no tokenizer-less checkpoint loaded as an empty tokenizer."""

from __future__ import annotations

import pathlib
import shutil

import pytest

pytest.importorskip("transformers")

from oea.eval.sequences import document_windows
from oea.models import embedded_model_dir, load_model


def test_loading_a_checkpoint_prints_no_progress_bar_and_restores_the_setting(capfd: pytest.CaptureFixture[str]):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    model, tokenizer = load_model()
    err = capfd.readouterr().err
    assert "Loading weights" not in err
    assert hf_logging.is_progress_bar_enabled()  # only our load was quiet
    long_text = "def f(x):\n    return x\n" * 2000  # far beyond model_max_length
    windows = document_windows(tokenizer, [long_text], 41)
    assert len(windows[0]) > 10
    assert "Token indices sequence length" not in capfd.readouterr().err
    # transformers records the warning as given (its handler may write past pytest's capture)
    assert not tokenizer.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum")
    del model


def test_a_checkpoint_without_tokenizer_is_named(tmp_path: pathlib.Path) -> None:
    shutil.copy(embedded_model_dir() / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer \(none of tokenizer.json"):
        load_model(tmp_path)


def test_lm_eval_records_no_git_hash_noise_outside_a_repository(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("lm_eval")
    import lm_eval.evaluator as evaluator

    from oea.eval.lm_eval_bridge import _quiet_git_hash

    monkeypatch.chdir(tmp_path)  # not a git repository: plain `git describe` prints "fatal: ..."
    original = evaluator.get_git_commit_hash
    with _quiet_git_hash():
        assert evaluator.get_git_commit_hash() is None
    assert evaluator.get_git_commit_hash is original
    assert "fatal" not in capfd.readouterr().err
