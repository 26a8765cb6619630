"""``oea traces`` (list, show, import traces) and ``oea capture`` (record a trace from a model)."""

from __future__ import annotations

import argparse
import json

from oea.console import add_batch_sizes_argument, check_output_file, int_at_least, non_empty_text, seed_value

IMPORT_OPTIONS = ("out", "num_experts", "top_k", "scoring", "trace_name", "model", "model_preset", "source",
                  "licence")


def _traces(args: argparse.Namespace) -> int:
    from oea.traces import bundled_trace_names, load_trace
    from oea.traces.checks import ordering_status

    if args.name == "import":
        return _import(args)
    given = [name for name in IMPORT_OPTIONS if getattr(args, name) is not None]
    if given or args.file is not None or args.sort_by_scores or args.no_renormalize:
        flags = ", ".join("--" + ("name" if n == "trace_name" else n.replace("_", "-")) for n in given)
        raise ValueError(f"{flags or 'a second positional argument'} only applies to `oea traces import FILE ...`; "
                         f"`oea traces [NAME]` lists or shows traces")
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
            "notes": trace.meta.get("notes"), "order": ordering_status(trace),
        })
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    from oea.console import wide_console

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
        console.print(f"best-first order: {rows[0]['order']}")
        for note in rows[0]["notes"] or []:
            console.print(f"- {note}")
    return 0


def _import(args: argparse.Namespace) -> int:
    import pathlib

    from oea.traces.format import save_trace
    from oea.traces.importer import import_trace, summary

    for flag, value in (("FILE (the input, after `import`)", args.file), ("--out", args.out),
                        ("--num-experts", args.num_experts), ("--top-k", args.top_k)):
        if value is None:
            raise ValueError(f"`oea traces import` needs {flag}: oea traces import FILE --out OUT.safetensors "
                             f"--num-experts N --top-k K")
    out = pathlib.Path(args.out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out must name a .safetensors file (its .json sidecar is written beside it), got {out}")
    check_output_file(out, "--out", create_folders=True)
    meta = {key: getattr(args, key) for key in ("model", "model_preset", "source", "licence")
            if getattr(args, key) is not None}
    if args.model_preset is not None:
        from oea.presets import get_model_preset

        get_model_preset(args.model_preset)
    trace = import_trace(args.file, args.num_experts, args.top_k, scoring=args.scoring or "softmax",
                         renormalize=not args.no_renormalize, name=args.trace_name,
                         sort_by_scores=args.sort_by_scores, meta=meta)
    try:
        written = save_trace(trace, out)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot write ({err})") from None
    from oea.trace_schema import sidecar_path
    from oea.traces.format import read_trace_file

    read_trace_file(written)  # the file as every other command will load it
    record = summary(trace, [written, sidecar_path(written)])
    if args.json:
        print(json.dumps(record, indent=1))
        return 0
    print(f"wrote {record['out']} and {record['sidecar']}: {record['num_tokens']} tokens × {record['num_layers']} "
          f"layers, {record['num_experts']} experts, top-{record['top_k']}, tensors {record['tensors']}")
    for note in record["notes"]:
        print(f"- {note}")
    return 0


def _capture(args: argparse.Namespace) -> int:
    from oea.traces.capture import main

    return main(args)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "traces", help="list the bundled routing traces, show one, or import your own (`oea traces import`)",
        usage="oea traces [NAME] [--json]\n       oea traces import FILE --out OUT.safetensors --num-experts N "
              "--top-k K [--scoring softmax|sigmoid] [--name NAME] [--json] ...",
        description="List the bundled traces, show one (NAME: bundled name or trace file), or import routing "
                    "arrays (.npz, .npy, .jsonl, .csv; layouts in docs/traces.md) into a validated oea-trace.",
    )
    p.add_argument("name", nargs="?", default=None, help="a bundled trace name or trace file, or `import`")
    p.add_argument("file", nargs="?", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print JSON")
    g = p.add_argument_group("oea traces import FILE", "convert FILE (.npz, .npy, .jsonl, .csv) to an oea-trace")
    g.add_argument("--out", default=None, help="trace file to write (.safetensors; the .json sidecar goes beside it)")
    g.add_argument("--num-experts", type=int, default=None, metavar="N", help="routed experts per MoE layer")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="experts per token (ids per row)")
    g.add_argument("--scoring", choices=["softmax", "sigmoid"], default=None,
                   help="router family stored in the spec (default: softmax)")
    g.add_argument("--no-renormalize", action="store_true",
                   help="the router does not renormalise the top-k weights (spec.renormalize = false)")
    g.add_argument("--name", dest="trace_name", type=non_empty_text, default=None, metavar="NAME",
                   help="trace name (default: FILE's stem)")
    g.add_argument("--sort-by-scores", action="store_true",
                   help="reorder each row by descending score (inputs not stored best first)")
    g.add_argument("--model", default=None, help="model name stored in the sidecar")
    g.add_argument("--model-preset", default=None, metavar="NAME",
                   help="built-in model preset for latency (see `oea presets`)")
    g.add_argument("--source", default=None, help="where the data comes from (sidecar 'source')")
    g.add_argument("--licence", default=None, help="licence of the data (sidecar 'licence')")
    p.set_defaults(handler=_traces)

    c = commands.add_parser("capture", help="record a routing trace (full router logits) during real decode")
    c.add_argument("--model", default=None, metavar="PATH",
                   help="HF checkpoint directory with its tokenizer (default: the embedded model)")
    c.add_argument("--out", default="embedded-trace.safetensors", metavar="FILE_OR_FOLDER",
                   help="trace file to write (.safetensors + .json sidecar); a folder (existing, or ending in /: "
                        "created) gets embedded-trace.safetensors inside it")
    add_batch_sizes_argument(c, [16], "sequences (from different documents) decoded together in lock-step "
                             "(one batch size)", single=True, legacy_alias=True)
    c.add_argument("--prompt-tokens", type=int_at_least(1), default=32, help="tokens of each document used as prompt")
    c.add_argument("--new-tokens", type=int_at_least(1), default=32, help="decode steps recorded per sequence")
    c.add_argument("--name", type=non_empty_text, default=None,
                   help="trace name stored in the metadata (default: embedded or the path)")
    c.add_argument("--seed", type=seed_value, default=0, help="seeds which documents are used")
    c.add_argument("--threads", type=int_at_least(1), default=1, help="torch.set_num_threads")
    c.add_argument("--json", action="store_true", help="print what was written as JSON")
    c.set_defaults(handler=_capture)
