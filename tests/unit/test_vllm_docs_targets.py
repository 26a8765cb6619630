"""docs/vllm.md states how many vLLM names the plugin depends on; that count is `targets.TARGETS`' length, so a
name added to the plugin's contract with vLLM (and to the CUDA-release check) cannot leave the docs behind."""

from __future__ import annotations

import pathlib
import re

from oea.integrations.vllm import targets

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def test_docs_count_of_declared_vllm_names_is_the_targets_count() -> None:
    counts = re.findall(r"every vLLM name the plugin wraps, calls or reads \((\d+), declared", DOC.read_text())
    assert counts == [str(len(targets.TARGETS))]
