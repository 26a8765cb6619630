"""``oea.eval.lm_eval_bridge.run_lm_eval`` on the embedded model with a tiny local generation task."""

from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from oea.eval.lm_eval_bridge import run_lm_eval  # noqa: E402
from oea.models import heldout_documents  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.slow

TASK = "oea_stdlib_next_line"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A local lm-eval task: given the first lines of a held-out stdlib file, generate the next line."""
    directory = tmp_path_factory.mktemp("lm_eval_tasks")
    rows = []
    for _, text in heldout_documents()[:8]:
        lines = text.splitlines(keepends=True)
        rows.append({"prompt": "".join(lines[:6]), "target": lines[6].rstrip("\n")})
    data = directory / "next_line.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\n'
        'doc_to_target: "{{target}}"\n'
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return directory


def _run(embedded, task_dir, **kwargs):
    model, tokenizer = embedded
    return run_lm_eval(model, [TASK], tokenizer=tokenizer, include_path=task_dir, batch_size=8,
                       builtin_tasks=False, bootstrap_iters=0, **kwargs)


def test_oea_attached_through_lm_eval(embedded, task_dir, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    vanilla = _run(embedded, task_dir)
    same = _run(embedded, task_dir, k0=8)
    reduced = _run(embedded, task_dir, k0=1)
    metric = vanilla["results"][TASK]["exact_match,none"]
    assert 0.0 <= metric <= 1.0
    assert vanilla["oea"]["policy"] == "vanilla" and vanilla["oea"]["decode_steps"] > 0
    assert vanilla["oea"]["mean_experts_per_token"] == 8.0
    # k0 = top_k reproduces vanilla routing exactly, so the task result and expert counts match
    assert same["results"][TASK]["exact_match,none"] == metric
    assert same["oea"]["mean_active_experts"] == vanilla["oea"]["mean_active_experts"]
    assert same["oea"]["k0"] == 8
    # k0 = 1 really reroutes the decode steps lm-eval's generate() runs
    assert reduced["oea"]["mean_active_experts"] < vanilla["oea"]["mean_active_experts"]
    assert reduced["oea"]["decode_steps"] > 0
    # every routing mean carries its interval over decode steps
    for key in ("mean_active_experts", "mean_active_experts_vanilla", "active_vs_vanilla", "mean_experts_per_token"):
        low, high = reduced["oea"][f"{key}_ci"]
        assert low <= reduced["oea"][key] <= high, key
    assert reduced["oea"]["active_vs_vanilla_ci"][1] < 1.0
    assert same["oea"]["mean_active_experts_ci"] == vanilla["oea"]["mean_active_experts_ci"]


def test_bad_k0_is_named(embedded, task_dir) -> None:
    with pytest.raises(ValueError, match=r"1\.\.8"):
        _run(embedded, task_dir, k0=0)
