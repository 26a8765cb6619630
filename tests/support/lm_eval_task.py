"""A local lm-eval ``generate_until`` task for ``oea eval serve --task`` tests: held-out lines of the bundled task
(``oea.eval.serve_tasks.line_items``) as a JSON-lines data file and the YAML that names it, so lm-eval loads
everything from disk (no hub). Used by the stand-in server test (tests/unit) and the live-server tests
(tests/engines)."""

from __future__ import annotations

import json
from pathlib import Path

TASK = "oea_lines"

TASK_YAML = """task: oea_lines
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 32
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path, count: int, seed: int = 1) -> Path:
    """Write ``count`` held-out lines and the task's YAML into ``folder`` (created); return ``folder``, the
    ``--include-path``."""
    from oea.eval.serve_tasks import line_items

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "lines.jsonl"
    data.write_text("".join(json.dumps({"prompt": i.prompt, "target": i.target}) + "\n"
                            for i in line_items(count, seed)))
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(data=data))
    return folder
