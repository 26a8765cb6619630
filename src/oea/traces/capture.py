"""``oea capture``: record full router logits of a transformers MoE model during real lock-step decode.

B sequences from B different documents are prefilled with the same number of prompt tokens and
then decoded greedily together, one token per step (a real decode batch, no padding). A read-only
forward hook on every MoE router records its logits at each decode step; the prefill is not
recorded. The result is a ``Trace`` with logits [T = B·steps, L, N], request ids (the document) and
positions (the decode step).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import random
from collections.abc import Sequence
from typing import Any

import torch

from oea.routing import RouterSpec
from oea.trace_schema import routes_alike
from oea.traces.format import Trace, save_trace


def _moe_routers(model: Any) -> list[tuple[str, torch.nn.Module, RouterSpec]]:
    """(name, router module, spec) of every MoE layer, via ``oea.integrations.transformers`` when present."""
    try:
        from oea.integrations.transformers import find_moe_layers
    except ImportError:
        find_moe_layers = None
    if find_moe_layers is not None:
        return [(layer.name, layer.router, layer.spec) for layer in find_moe_layers(model)]
    # Fallback for softmax top-k routers (Qwen3-MoE, OLMoE, Mixtral): the TopKRouter modules.
    config = getattr(model, "config", None)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if num_experts is None or top_k is None:
        raise ValueError("cannot find the model's MoE routers: oea.integrations.transformers is not available "
                         "and the config has no num_experts / num_experts_per_tok")
    spec = RouterSpec(int(num_experts), int(top_k), scoring="softmax",
                      renormalize=bool(getattr(config, "norm_topk_prob", True)))
    routers = [(name, module, spec) for name, module in model.named_modules()
               if type(module).__name__.endswith("TopKRouter")]
    if not routers:
        raise ValueError(f"no *TopKRouter modules found in {type(model).__name__}")
    return routers


def _router_logits(output: Any) -> torch.Tensor:
    """The logits in a router's output: the tensor itself, or the first element of a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


@torch.no_grad()
def capture_decode(
    model: Any,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    request_names: Sequence[str] | None = None,
) -> Trace:
    """Decode all ``prompts`` together (greedy, KV cache) and record every router's logits per step.

    Args:
        model: a transformers causal-LM MoE model (eval mode is set here).
        prompts: B token-id lists of equal length (one per request / document).
        new_tokens: decode steps to record.
        request_names: optional names of the B requests (stored in the metadata).

    Returns:
        A ``Trace`` with logits [B·new_tokens, L, N] (token index = step·B + request), request ids
        [T] and positions [T] (the decode step).
    """
    if not prompts:
        raise ValueError("capture needs at least one prompt")
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"prompts must be non-empty and of equal length (lock-step decode), got lengths "
                         f"{sorted(lengths)}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    routers = _moe_routers(model)
    spec = dataclasses.replace(routers[0][2], correction_bias=None)
    biases = [router_spec.correction_bias for _, _, router_spec in routers]
    for name, _, router_spec in routers:
        if not routes_alike(router_spec, spec):
            raise ValueError(f"router {name} has spec {router_spec}, unlike the first router's {spec}; "
                             f"a trace holds one router spec")
    recorded: list[list[torch.Tensor]] = [[] for _ in routers]
    recording = {"on": False}

    def make_hook(index: int):
        def hook(_module, _inputs, output):
            if recording["on"]:
                recorded[index].append(_router_logits(output).detach().float().reshape(-1, spec.num_experts))

        return hook

    handles = [module.register_forward_hook(make_hook(i)) for i, (_, module, _) in enumerate(routers)]
    model.eval()
    try:
        input_ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
        out = model(input_ids=input_ids, use_cache=True)
        # transformers >= 5.2x names the KV cache ``cache``; earlier versions ``past_key_values``
        cache_key = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        recording["on"] = True
        for _ in range(new_tokens):
            out = model(input_ids=next_ids, use_cache=True, **{cache_key: getattr(out, cache_key)})
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    finally:
        for handle in handles:
            handle.remove()
    batch = len(prompts)
    for name_index, steps in enumerate(recorded):
        if len(steps) != new_tokens or any(s.shape[0] != batch for s in steps):
            raise ValueError(f"router {routers[name_index][0]} was called {len(steps)} times with shapes "
                             f"{[tuple(s.shape) for s in steps[:3]]}; expected {new_tokens} calls of [{batch}, N]")
    logits = torch.stack([torch.cat(steps) for steps in recorded], dim=1)  # [steps·B, L, N]
    correction_bias = None
    if any(b is not None for b in biases):
        correction_bias = torch.stack([
            b.detach().float() if b is not None else torch.zeros(spec.num_experts) for b in biases
        ])
    return Trace(
        spec=spec,
        logits=logits.half(),
        correction_bias=correction_bias,
        request_ids=torch.arange(batch).repeat(new_tokens),
        positions=torch.arange(new_tokens).repeat_interleave(batch),
        meta={
            "layer_names": [name for name, _, _ in routers],
            "request_names": list(request_names) if request_names is not None else None,
            "prompt_tokens": len(prompts[0]),
            "kind": f"lock-step greedy decode of {batch} requests x {new_tokens} steps, full router logits",
        },
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` from a ``tokenizers.Tokenizer`` or a transformers tokenizer."""
    encoded = tokenizer.encode(text)
    return list(encoded.ids) if hasattr(encoded, "ids") else list(encoded)


def document_prompts(
    tokenizer: Any, documents: Sequence[tuple[str, str]], batch_size: int, prompt_tokens: int, seed: int
) -> tuple[list[list[int]], list[str]]:
    """``batch_size`` prompts of ``prompt_tokens`` tokens, each from a different document (seeded choice)."""
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    prompts, names = [], []
    for index in order:
        name, text = documents[index]
        ids = encode(tokenizer, text[: 64 * prompt_tokens])  # a prefix is enough; whole files are slow
        if len(ids) < prompt_tokens:
            ids = encode(tokenizer, text)
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
            names.append(name)
        if len(prompts) == batch_size:
            return prompts, names
    raise ValueError(f"only {len(prompts)} documents have >= {prompt_tokens} tokens; need batch size "
                     f"{batch_size} (lower --batch-sizes or --prompt-tokens)")


def capture_embedded(
    batch_size: int = 16, prompt_tokens: int = 32, new_tokens: int = 32, seed: int = 0, model_path: str | None = None
) -> Trace:
    """Capture from ``oea.models`` (the embedded model by default) on its held-out documents."""
    try:
        from oea.models import heldout_documents, load_model
    except ImportError as err:
        raise ValueError(f"oea capture needs oea.models (load_model, heldout_documents), which is not "
                         f"available: {err}") from err
    model, tokenizer = load_model(model_path)
    prompts, names = document_prompts(tokenizer, heldout_documents(), batch_size, prompt_tokens, seed)
    trace = capture_decode(model, prompts, new_tokens, names)
    trace.meta.update(checkpoint_sha256=_checkpoint_digest(model_path), seed=seed)
    trace.meta.update(
        name="embedded" if model_path is None else str(model_path),
        model="oea embedded model" if model_path is None else str(model_path),
        model_preset="embedded" if model_path is None else None,
        source="captured by `oea capture` from the project's embedded model on its held-out documents"
        if model_path is None else f"captured by `oea capture` from {model_path}",
        licence="the oea project's licence; the model was trained on the Python standard library "
        "(PSF License)" if model_path is None else "as the captured model's",
        notes=["Real lock-step greedy decode: request_ids = document, positions = decode step; "
               "full router logits (float16)."],
    )
    return trace


def _checkpoint_digest(model_path: str | None) -> str | None:
    """SHA-256 of the checkpoint's ``model.safetensors`` (which weights produced the trace)."""
    import hashlib

    from oea.models import embedded_model_dir

    weights = (embedded_model_dir() if model_path is None else pathlib.Path(model_path)) / "model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None


DEFAULT_FILE = "embedded-trace.safetensors"


def output_path(out: str) -> pathlib.Path:
    """Where ``oea capture --out OUT`` writes: OUT, or ``OUT/embedded-trace.safetensors`` when OUT is a
    folder (existing, or written with a trailing ``/``: a new folder, created when the trace is saved).
    Checked before the capture runs: OUT names a .safetensors file, OUT's folder must exist unless OUT ends in
    ``/``, and accept files."""
    import os

    from oea.console import check_output_file

    path = pathlib.Path(out)
    folder = out.endswith(("/", os.sep)) or path.is_dir()
    if folder:
        path = path / DEFAULT_FILE
    return check_output_file(path, "--out", create_folders=folder, suffixes=(".safetensors",))


def main(args: argparse.Namespace) -> int:
    import json

    path = output_path(args.out)
    [batch_size] = args.batch_sizes
    torch.set_num_threads(args.threads)
    trace = capture_embedded(batch_size, args.prompt_tokens, args.new_tokens, args.seed, args.model)
    if args.name is not None:
        trace.meta["name"] = args.name
    path = save_trace(trace, path)
    if args.json:
        print(json.dumps({"written": str(path), "name": trace.name, "tokens": trace.num_tokens,
                          "layers": trace.num_layers, "num_experts": trace.spec.num_experts,
                          "top_k": trace.spec.top_k, "batch_size": batch_size, "new_tokens": args.new_tokens}))
        return 0
    print(f"wrote {path}: {trace.num_tokens} tokens x {trace.num_layers} layers x {trace.spec.num_experts} "
          f"experts (lock-step B={batch_size}, {args.new_tokens} steps)")
    return 0
