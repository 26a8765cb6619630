"""lm-evaluation-harness tasks for ``oea eval serve``, through lm-eval's own model for OpenAI-compatible servers.

A ``generate_until`` task from ``--include-path`` (the user's YAML with local data files; lm-eval's bundled tasks
are not scanned, so nothing is downloaded) runs with lm-eval's ``local-completions`` model against each arm's
``/v1/completions``: ``num_concurrent`` = the cell's max concurrency, no tokenizer (prompts go as text), greedy
(``temperature`` 0 unless the task sets its own generation arguments, which then hold for every arm alike). Each
document's answer and its scores (the task's metrics, per sample: ``log_samples``) become the item rows; a
failure of lm-eval's requests (after its retries) marks every item of the cell as an error, counted, never hidden.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

from oea.eval.serve_run import ItemRunner

API_PACKAGES: tuple[str, ...] = ("lm_eval", "tenacity", "aiohttp")  # what local-completions imports (lm-eval[api])


def _manager(include_path: str) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=False)


def check_task(task: str, include_path: str | None) -> None:
    """Before any server: ``ValueError`` naming ``--include-path`` or ``--task`` unless ``task`` is a
    ``generate_until`` task of the YAML files under ``include_path``."""
    from oea.eval.serve_tasks import BUNDLED_TASK

    if include_path is None:
        raise ValueError(f"--task {task}: an lm-eval task needs --include-path DIR (its YAML and local data; "
                         f"nothing is downloaded), or use the bundled --task {BUNDLED_TASK}")
    if not pathlib.Path(include_path).is_dir():
        raise ValueError(f"--include-path {include_path}: no such directory (it should hold task YAMLs)")
    missing = [name for name in API_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"--task {task}: lm-eval's local-completions model needs lm-eval's api extra (missing: "
                         f"{', '.join(missing)}): pip install 'lm-eval[api]'")
    manager = _manager(include_path)
    if task not in manager.all_tasks:
        known = ", ".join(sorted(manager.all_tasks)[:10]) or "none"
        raise ValueError(f"--task {task}: not a task under --include-path {include_path} (tasks there: {known})")
    kinds = {getattr(t, "OUTPUT_TYPE", None) for t in manager.load([task])["tasks"].values()}
    if kinds != {"generate_until"}:
        raise ValueError(f"--task {task}: oea eval serve runs generate_until tasks; this one is "
                         f"{sorted(map(str, kinds))}")


def lm_eval_runner(task: str, include_path: str | None, limit: int, timeout: float) -> ItemRunner:
    """``run_items`` for an lm-eval task (module docstring); the task is checked at once (``check_task``)."""
    check_task(task, include_path)

    def run_items(base_url: str, model: str, concurrency: int) -> list[dict[str, Any]]:
        try:
            samples = _evaluate(task, include_path or "", base_url, model, concurrency, limit, timeout)
        except Exception as err:  # lm-eval raises plain Exceptions when its requests fail: recorded per item
            return [{"item": f"{task}:all", "output": "", "tokens": None, "scores": {},
                     "error": f"lm-eval failed: {type(err).__name__}: {err}"[:300]}]
        return [_item(task, sample) for sample in samples]

    return run_items


def _evaluate(task: str, include_path: str, base_url: str, model: str, concurrency: int, limit: int,
              timeout: float) -> list[dict[str, Any]]:
    from lm_eval import simple_evaluate

    model_args = {"base_url": base_url.rstrip("/") + "/v1/completions", "model": model, "tokenizer_backend": "none",
                  "tokenized_requests": False, "num_concurrent": concurrency, "max_retries": 1,
                  "timeout": int(timeout)}
    results = simple_evaluate(model="local-completions", model_args=model_args, tasks=[task], limit=limit,
                              task_manager=_manager(include_path), log_samples=True, batch_size=1,
                              gen_kwargs="temperature=0", random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                              fewshot_random_seed=0)
    return [sample for rows in (results or {}).get("samples", {}).values() for sample in rows]


def _item(task: str, sample: dict[str, Any]) -> dict[str, Any]:
    """An item row's fields from one lm-eval sample (its answer and its numeric per-sample metrics)."""
    resps = sample.get("filtered_resps") or sample.get("resps") or [""]
    output = resps[0]
    while isinstance(output, list):
        output = output[0] if output else ""
    skip = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics", "doc_hash",
            "prompt_hash", "target_hash"}
    scores = {k: float(v) for k, v in sample.items() if k not in skip and isinstance(v, (int, float))}
    return {"item": f"{task}:{sample.get('doc_id')}", "output": str(output), "tokens": None, "scores": scores,
            "error": ""}
