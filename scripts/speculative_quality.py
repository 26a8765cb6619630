"""OEA under speculative decoding, quality: acceptance rate and greedy-text agreement with OEA on verify steps or
not, against OEA off, in vLLM's offline engine (no API server, no client: batching depends only on the arm).

One process per (arm, concurrency): vLLM's ``LLM`` with n-gram speculation and
``per_request_spec_decode_metrics="summary"`` generates every prompt greedily (``ignore_eos``, fixed length),
``max_num_seqs`` = the concurrency (1: one request per step). Per request it keeps the token ids and vLLM's own
acceptance counts. Printed per arm and concurrency, each with its 95% interval (``oea.stats``):

* acceptance rate (accepted / proposed draft tokens, per request, mean over requests) and its paired change
  against OEA off on the same prompts (paired t interval);
* mean accepted length (1 + accepted drafts per verify step, the bonus token included);
* greedy-text agreement with OEA off: share of requests whose tokens are all equal, and the mean share of
  tokens before the first difference, each with its Wilson score interval (``oea.stats.proportion_interval``;
  for the mean share the interval is conservative).

    python scripts/speculative_quality.py --python .venv-vllm/bin/python [--prompts 64] [--output-len 64] \
        [--concurrency 1 16] [--dataset text] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from oea.bench.serve.prompts import make_prompts
from oea.models import embedded_model_dir
from oea.stats import mean_interval, paired_difference, proportion_interval

ARMS: dict[str, dict[str, str]] = {
    "off": {},
    "k3": {"OEA_K0": "3"},
    "k3-verify": {"OEA_K0": "3", "OEA_APPLY_TO_VERIFY": "1"},
    "k5": {"OEA_K0": "5"},
    "k5-verify": {"OEA_K0": "5", "OEA_APPLY_TO_VERIFY": "1"},
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}

CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model, prompts_file, output_len, rows, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prompts = json.load(open(prompts_file))
llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, max_num_seqs=rows, seed=0,
          speculative_config=json.loads(spec), per_request_spec_decode_metrics="summary")
batch = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
out = llm.generate(batch, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0), use_tqdm=False)
rows = []
for o in out:
    c = o.outputs[0]
    m = c.spec_decode_metrics.to_dict() if c.spec_decode_metrics is not None else {}
    rows.append({"tokens": list(c.token_ids), "accepted": m.get("num_accepted_draft_tokens", 0),
                 "drafted": m.get("num_draft_tokens", 0), "steps": m.get("num_spec_steps", 0)})
print("OEA-RESULT " + json.dumps(rows))
"""


def _run(python: str, model: str, prompts_file: Path, env: dict[str, str], output_len: int, rows: int,
         work: Path, name: str, timeout: float) -> tuple[list[dict], dict[str, int]]:
    """One arm in one vLLM process: (per-request rows, step counts from the plugin's metrics file)."""
    metrics = work / f"metrics-{name}.jsonl"
    full = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "OEA_METRICS_FILE": str(metrics),
            **env}
    for var in ("OEA_K0", "OEA_APPLY_TO_VERIFY"):
        if var not in env:
            full.pop(var, None)
    proc = subprocess.run([python, "-c", CHILD, model, str(prompts_file), str(output_len), str(rows),
                           json.dumps(NGRAM)], env=full, capture_output=True, text=True, timeout=timeout, cwd=work)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("OEA-RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{name}: vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(line[len("OEA-RESULT "):])
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    verify = [s for s in steps if s.get("verify")]
    counts = {"steps": len(steps), "verify_steps": len(verify), "verify_rewritten": sum(s["oea"] for s in verify),
              "other_rewritten": sum(s["oea"] for s in steps if not s.get("verify"))}
    print(f"  {name}: {counts['verify_steps']} verify steps, {counts['verify_rewritten']} rewritten; "
          f"{counts['other_rewritten']} other steps rewritten", file=sys.stderr)
    return result, counts


def _prefix_share(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return same / max(len(a), 1)


def _interval(values: list[float]) -> list[float] | None:
    return mean_interval(values).as_list() if len(values) >= 2 else None


def _share(values: list[float]) -> tuple[float, list[float]]:
    """Mean of per-request shares in [0, 1] with its Wilson interval (a t interval would leave [0, 1] at 1.0)."""
    share = min(1.0, max(0.0, sum(values) / len(values)))
    return share, proportion_interval(share, len(values)).as_list()


def summarise(results: dict[str, list[dict]], baseline: str = "off") -> dict[str, dict]:
    """Per arm: acceptance (mean over requests with drafts, interval), its paired change to ``baseline``,
    mean accepted length, text agreement with ``baseline``."""
    base = results[baseline]
    out = {}
    for arm, rows in results.items():
        rate = [r["accepted"] / r["drafted"] if r["drafted"] else float("nan") for r in rows]
        length = [1 + r["accepted"] / r["steps"] if r["steps"] else float("nan") for r in rows]
        both = [i for i, r in enumerate(rows) if r["drafted"] and base[i]["drafted"]]
        same = [float(r["tokens"] == b["tokens"]) for r, b in zip(rows, base, strict=True)]
        prefix = [_prefix_share(r["tokens"], b["tokens"]) for r, b in zip(rows, base, strict=True)]
        if not both:
            raise RuntimeError(f"{arm}: no request had draft tokens in both this arm and {baseline!r}; "
                               "n-gram speculation never proposed (use --dataset text or longer outputs)")
        identical, identical_ci = _share(same)
        agreed, agreed_ci = _share(prefix)
        entry = {
            "requests": len(rows),
            "requests_with_drafts": len(both),
            "acceptance_rate": sum(rate[i] for i in both) / len(both),
            "acceptance_rate_ci": _interval([rate[i] for i in both]),
            "pooled_acceptance_rate": sum(r["accepted"] for r in rows) / max(sum(r["drafted"] for r in rows), 1),
            "mean_accepted_length": sum(length[i] for i in both) / len(both),
            "mean_accepted_length_ci": _interval([length[i] for i in both]),
            "identical_text": identical,
            "identical_text_ci": identical_ci,
            "agreed_prefix": agreed,
            "agreed_prefix_ci": agreed_ci,
        }
        if arm != baseline and len(both) >= 2:
            base_rate = [base[i]["accepted"] / base[i]["drafted"] for i in both]
            diff = paired_difference([rate[i] for i in both], base_rate)
            entry.update(acceptance_change=diff.mean, acceptance_change_ci=diff.ci.as_list(),
                         acceptance_change_p=diff.p_value, pairs=len(both))
        out[arm] = entry
    return out


def _shown(entry: dict, key: str, fmt: str) -> str:
    ci = entry.get(f"{key}_ci")
    interval = "" if ci is None else f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"
    return f"{entry[key]:{fmt}}{interval}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, type=lambda p: str(Path(p).absolute()),
                        help="interpreter with vLLM installed (.venv-vllm/bin/python)")
    parser.add_argument("--model", default=str(embedded_model_dir()))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dataset", choices=("text", "random"), default="text")
    parser.add_argument("--text-input-chars", type=int, default=400)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", help="write every figure and per-request row here")
    args = parser.parse_args()
    prompts = [p.prompt for p in make_prompts(args.dataset, args.prompts, args.seed, 64, args.output_len,
                                              input_chars=args.text_input_chars)]
    report: dict[str, object] = {"args": vars(args), "speculative_config": NGRAM, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="oea-spec-quality-") as tmp:
        work = Path(tmp)
        prompts_file = work / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        for concurrency in args.concurrency:
            results, steps = {}, {}
            for arm in args.arms:
                print(f"c={concurrency} {arm} ...", file=sys.stderr)
                results[arm], steps[arm] = _run(args.python, args.model, prompts_file, ARMS[arm], args.output_len,
                                                concurrency, work, f"{arm}-c{concurrency}", args.timeout)
            summary = summarise(results, baseline=args.arms[0])
            for arm, counts in steps.items():
                summary[arm]["engine_steps"] = counts
            report["runs"][str(concurrency)] = {"summary": summary, "requests": results,  # type: ignore[index]
                                                "loadavg": os.getloadavg()}
            for arm, e in summary.items():
                change = " (baseline)"
                if "acceptance_change" in e:
                    change = (f", change {_shown(e, 'acceptance_change', '+.4f')} (paired, p "
                              f"{e['acceptance_change_p']:.2g})")
                print(f"c={concurrency} {arm}: acceptance {_shown(e, 'acceptance_rate', '.4f')}{change}; accepted "
                      f"length {_shown(e, 'mean_accepted_length', '.3f')}; identical text "
                      f"{_shown(e, 'identical_text', '.3f')}, agreed prefix {_shown(e, 'agreed_prefix', '.3f')}")
            if args.json:  # after every concurrency: a later run that fails keeps the finished ones
                Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
