"""``oea traces`` (list / show bundled traces) and ``oea capture`` (record a trace from a model)."""

from __future__ import annotations

import argparse
import json


def _traces(args: argparse.Namespace) -> int:
    from oea.traces import bundled_trace_names, load_trace

    names = [args.name] if args.name else bundled_trace_names()
    rows = []
    for name in names:
        trace = load_trace(name)
        content = "logits" if trace.has_logits else ("ids+scores" if trace.scores is not None else "ids")
        rows.append({
            "name": trace.name, "tokens": trace.num_tokens, "layers": trace.num_layers,
            "num_experts": trace.spec.num_experts, "top_k": trace.spec.top_k,
            "content": content,
            "request_ids": trace.request_ids is not None, "model": trace.meta.get("model"),
            "licence": trace.meta.get("licence"), "source": trace.meta.get("source"),
            "notes": trace.meta.get("notes"),
        })
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    from oea.sim.cli import wide_console

    table = Table(title="routing traces")
    for column in ("name", "tokens", "layers", "N", "k", "content", "request ids"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], str(row["tokens"]), str(row["layers"]), str(row["num_experts"]),
                      str(row["top_k"]), row["content"], "yes" if row["request_ids"] else "no")
    console = wide_console()
    console.print(table)
    if not args.name:
        console.print("`oea traces NAME` shows a trace's model, source, licence and caveats.")
    else:
        console.print(f"model: {rows[0]['model']}")
        console.print(f"source: {rows[0]['source']}")
        console.print(f"licence: {rows[0]['licence']}")
        for note in rows[0]["notes"] or []:
            console.print(f"- {note}")
    return 0


def _capture(args: argparse.Namespace) -> int:
    from oea.traces.capture import main

    return main(args)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = commands.add_parser("traces", help="list the bundled routing traces (or show one)")
    p.add_argument("name", nargs="?", default=None, help="a bundled trace name or trace file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_traces)

    c = commands.add_parser("capture", help="record a routing trace (full router logits) during real decode")
    c.add_argument("--model", default=None, help="transformers model path (default: the embedded model)")
    c.add_argument("--out", default="embedded-trace.safetensors", help="trace file to write")
    c.add_argument("--batch-size", type=int, default=16,
                   help="sequences (from different documents) decoded together in lock-step")
    c.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each document used as prompt")
    c.add_argument("--new-tokens", type=int, default=32, help="decode steps recorded per sequence")
    c.add_argument("--name", default=None, help="trace name stored in the metadata")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    c.set_defaults(handler=_capture)
