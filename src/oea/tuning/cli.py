"""``oea calibrate``: batch-size-adaptive and per-layer k0 from a routing trace."""

from __future__ import annotations

import argparse
import json


def _calibrate(args: argparse.Namespace) -> int:
    from oea.traces import load_trace
    from oea.tuning.calibrate import adaptive_schedule, layer_schedule, measure_proxy, proxy_name

    trace = load_trace(args.trace)
    top_k = trace.spec.top_k
    k0s = args.k0 or list(range(1, top_k + 1))
    bad = [k for k in k0s if not 1 <= k <= top_k]
    if bad:
        raise ValueError(f"--k0 values must be in 1..{top_k} (the trace's top_k), got {bad}")
    if args.what == "adaptive":
        points = measure_proxy(trace, args.batch_sizes, k0s, num_batches=args.num_batches, seed=args.seed)
        cfg = adaptive_schedule(points, args.tolerance, top_k)
        result = {"trace": trace.name, "proxy": proxy_name(trace), "tolerance": args.tolerance,
                  "schedule": [list(entry) for entry in cfg.schedule]}
    else:
        points = measure_proxy(trace, [args.batch_size], k0s, num_batches=args.num_batches, seed=args.seed)
        schedule = layer_schedule(trace, points, args.tolerance, args.batch_size)
        result = {"trace": trace.name, "proxy": proxy_name(trace), "tolerance": args.tolerance,
                  "k0": list(schedule.k0)}
        if args.out:
            schedule.save(args.out)
            result["written"] = args.out
    if args.out and args.what == "adaptive":
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        result["written"] = args.out
    print(json.dumps(result, indent=2) if args.json else _summary(result))
    return 0


def _summary(result: dict) -> str:
    lines = [f"trace {result['trace']} · proxy {result['proxy']} · tolerance {result['tolerance']}"]
    if "schedule" in result:
        lines += [f"  batch size <= {b:>4}: k0 = {k0}" for b, k0 in result["schedule"]]
    else:
        lines += [f"  per-layer k0: {result['k0']}"]
    if "written" in result:
        lines.append(f"written to {result['written']}")
    return "\n".join(lines)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = commands.add_parser("calibrate", help="calibrate batch-size-adaptive or per-layer k0 from a trace")
    p.add_argument("what", choices=["adaptive", "layers"], help="adaptive: k0(B); layers: one k0 per layer")
    p.add_argument("--trace", default="embedded", help="bundled trace name or path (default: embedded)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="for 'adaptive'")
    p.add_argument("--batch-size", type=int, default=16, help="for 'layers'")
    p.add_argument("--k0", type=int, nargs="+", help="candidate k0 values (default 1..top_k)")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest mean proxy loss (1 - kept mass)")
    p.add_argument("--num-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the schedule (JSON; for 'layers' the OEA_LAYER_K0_FILE format)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_calibrate)
