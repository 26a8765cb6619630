"""The simulator's view of a vLLM server's speculative verify steps: ``oea simulate --mode lockstep`` on the
verify steps of a trace recorded with ``OEA_TRACE_FILE`` and ``OEA_APPLY_TO_VERIFY=1``, beside what the server's
metrics file says those steps routed.

A verify step holds 1 + (drafts proposed) rows per request, so step sizes vary; lockstep draws B rows out of any
step of at least B rows. For each of the ``--sizes`` most frequent verify sizes the trace is cut to the verify
steps of exactly that size (each step then is one lockstep batch, so the simulator's vanilla T is vLLM's own
routing of those steps) and replayed through vanilla and OEA at each ``--k0``. Printed (and written with
``--json``) per size: steps, the simulated T per policy with its interval, and the server's mean active experts
per layer (``active``: the routing that ran; ``active_stock``: vLLM's own routing of the same logits).

    python scripts/speculative_lockstep.py --trace verify.safetensors --metrics engine.jsonl [--k0 3 5] \\
        [--sizes 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from oea.traces import load_trace, save_trace

CUT_FIELDS = ("logits", "ids", "scores", "request_ids", "positions", "step_ids")
SIM_FIELDS = ("policy", "k0", "mean_active_experts", "mean_active_experts_ci", "active_ratio_vs_vanilla",
              "active_ratio_vs_vanilla_ci", "num_batches", "distinct_batches")


def verify_sizes(rows: list[dict], trace_steps: set[int]) -> list[tuple[int, int]]:
    """``[(rows per step, steps)]`` of the rewritten verify steps the trace holds, most frequent first."""
    sizes = Counter(r["rows"] for r in rows if r.get("verify") and r.get("oea") and r["step"] in trace_steps)
    return sorted(sizes.items(), key=lambda item: (-item[1], -item[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, type=Path, help="OEA_TRACE_FILE of the server")
    parser.add_argument("--metrics", required=True, type=Path, help="OEA_METRICS_FILE of the same server")
    parser.add_argument("--k0", type=int, nargs="+", default=[3])
    parser.add_argument("--sizes", type=int, default=3, help="how many of the most frequent verify sizes")
    parser.add_argument("--min-steps", type=int, default=2, help="skip sizes with fewer steps (lockstep needs 2)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    layers = trace.num_layers
    steps_in_trace = set(trace.step_ids.unique().tolist())
    sizes = [(size, n) for size, n in verify_sizes(rows, steps_in_trace) if n >= args.min_steps][: args.sizes]
    if not sizes:
        raise SystemExit(f"{args.trace}: no rewritten verify step size occurs {args.min_steps} times "
                         "(was the server run with OEA_APPLY_TO_VERIFY=1 and speculation on?)")
    verify = [r for r in rows if r.get("verify")]
    out: dict[str, object] = {"trace": str(args.trace), "metrics": str(args.metrics), "k0": args.k0,
                              "verify_steps": len(verify), "verify_rewritten": sum(r["oea"] for r in verify),
                              "other_rewritten": sum(r["oea"] for r in rows if not r.get("verify")),
                              "mean_tokens_per_request": (sum(sum(r["tokens_per_request"]) for r in verify)
                                                          / max(sum(len(r["tokens_per_request"]) for r in verify), 1)),
                              "sizes": []}
    with tempfile.TemporaryDirectory(prefix="oea-spec-lockstep-") as tmp:
        for size, count in sizes:
            chosen = [r for r in verify if r["oea"] and r["rows"] == size and r["step"] in steps_in_trace]
            keep = torch.isin(trace.step_ids, torch.tensor([r["step"] for r in chosen]))
            cut = dataclasses.replace(trace, **{name: getattr(trace, name)[keep] for name in CUT_FIELDS
                                                if getattr(trace, name) is not None})
            path = save_trace(cut, Path(tmp) / f"verify-{size}.safetensors")
            proc = subprocess.run([sys.executable, "-m", "oea", "simulate", "--trace", str(path), "--mode", "lockstep",
                                   "--policies", "vanilla", "oea", "--k0", *map(str, args.k0), "--batch-sizes",
                                   str(size), "--json"], capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"oea simulate failed on {size}-row steps:\n{proc.stderr[-2000:]}")
            simulated = json.loads(proc.stdout)
            entry = {"rows": size, "steps": count,
                     "requests": sorted(Counter(len(r["tokens_per_request"]) for r in chosen).items()),
                     "server_active": sum(sum(r["active"]) for r in chosen) / (layers * count),
                     "server_active_stock": sum(sum(r["active_stock"]) for r in chosen) / (layers * count),
                     "simulated": [{k: s.get(k) for k in SIM_FIELDS} for s in simulated]}
            out["sizes"].append(entry)  # type: ignore[union-attr]
            for s in entry["simulated"]:
                ci = s["mean_active_experts_ci"]
                interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
                print(f"{size} rows ({count} steps): {s['policy']}{'' if s['k0'] is None else ' k0=' + str(s['k0'])} "
                      f"T {s['mean_active_experts']:.2f}{interval}")
            print(f"{size} rows: server active {entry['server_active']:.2f} (OEA k0={args.k0[0]} ran), vLLM's own "
                  f"routing {entry['server_active_stock']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
