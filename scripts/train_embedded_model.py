#!/usr/bin/env python
"""Train the embedded Qwen3-MoE (128 experts, top-8) on the Python standard library, on CPU.

Stages (each resumable; state lives in ``--cache-dir``, default ``.train-cache/``, git-ignored):

1. tokenizer: byte-level BPE (vocab 4096) trained on the train split only;
2. training: AdamW, warmup + cosine, load-balancing aux loss on; checkpoint + optimizer state every
   ``--checkpoint-every`` steps, so re-running the same command continues a killed run (``--no-resume``
   starts over);
3. export (``--export-only`` runs just this stage): bf16 safetensors with per-expert keys,
   tokenizer, config, held-out file list and a model card with measured figures, into ``--out``.

Budget: ``--steps`` (default 2000) with a wall-clock cap ``--minutes`` (default 70, counted across resumes);
the cosine LR schedule follows whichever budget is further along. Use ``--threads 1`` on a shared machine:
on the 2-core CPU shared with other jobs, 2 threads measured 3x slower than 1. A step of 16 x 256 tokens
took 1.2 s with 1 thread when the machine was quiet and 2-7 s when it was busy.

The shipped model (``packages/oea-lab-data/src/oea_lab_data/embedded``, the data of ``oea[lab]``) came from::

    nohup .venv/bin/python scripts/train_embedded_model.py --steps 2000 --minutes 70 --threads 1 \
        > /tmp/train.log 2>&1 &

interrupted once at step 200 (started with ``--minutes 60``) and resumed with the command above: 2000 steps,
50.4 minutes of training, then the export (about 2 minutes). Re-export the cached checkpoint with::

    .venv/bin/python scripts/train_embedded_model.py --export-only
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=REPO / "packages/oea-lab-data/src/oea_lab_data/embedded")
    p.add_argument("--cache-dir", type=pathlib.Path, default=REPO / ".train-cache")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (the schedule's length)")
    p.add_argument("--minutes", type=float, default=70.0,
                   help="wall-clock training budget in total (across resumes); the LR schedule ends at "
                        "whichever of --steps / --minutes comes first")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--aux-coef", type=float, default=0.005, help="router_aux_loss_coef")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 measured 3x faster than 2 on a shared, busy 2-core machine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--export-only", action="store_true", help="only export the cached checkpoint")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- tokenizer + data


def train_tokenizer(texts: list[str], out_dir: pathlib.Path):
    """Byte-level BPE trained on ``texts``; saved so ``AutoTokenizer.from_pretrained(out_dir)`` works."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
    )
    fast.save_pretrained(out_dir)
    return fast


def load_or_train_tokenizer(cache: pathlib.Path, train_texts: list[str]):
    from transformers import AutoTokenizer

    tok_dir = cache / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(tok_dir)
    print(f"training tokenizer on {len(train_texts)} files ...", flush=True)
    return train_tokenizer(train_texts, tok_dir)


def sample_batch(stream: np.ndarray, step: int, seed: int, batch: int, seq_len: int) -> torch.Tensor:
    """Deterministic random windows ``[batch, seq_len + 1]`` for ``step`` (resume-safe)."""
    from oea.models.data import sample_windows

    return torch.from_numpy(sample_windows(stream, step, seed, batch, seq_len + 1))


# --------------------------------------------------------------------------- model


def build_config(tokenizer, aux_coef: float):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,  # unused: every layer is sparse
        moe_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        tie_word_embeddings=True,  # trained tied; the export stores the head as its own copy (untie_output_head)
        output_router_logits=True,
        router_aux_loss_coef=aux_coef,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def lr_at(step: int, elapsed_s: float, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine to 10% over whichever budget (steps or minutes) runs out first."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    by_steps = (step - args.warmup) / max(1, args.steps - args.warmup)
    progress = min(1.0, max(by_steps, elapsed_s / (args.minutes * 60)))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def quick_eval(model, heldout_stream: np.ndarray, heldout_docs: list[np.ndarray], seq_len: int) -> dict:
    """Held-out CE on 8 fixed windows, and the B=16 top-8 union (16 tokens from 16 files)."""
    model.eval()
    batch = sample_batch(heldout_stream, 0, 1234, 8, seq_len)
    out = model(batch[:, :-1], labels=batch[:, :-1].clone(), output_router_logits=False)
    ce = float(out.loss)
    rows = [doc[:64] for doc in heldout_docs[:16]]
    ids = torch.from_numpy(np.stack(rows).astype(np.int64))
    logits = model(ids, output_router_logits=True).router_logits  # per layer [16*64, E]
    unions = []
    for layer in logits:
        top = layer.view(16, 64, -1).topk(8, dim=-1).indices  # [16, 64, 8]
        for t in range(1, 64):
            unions.append(int(top[:, t].unique().numel()))
    model.train()
    return {"heldout_ce": ce, "union_b16": float(np.mean(unions))}


def save_checkpoint(path: pathlib.Path, model, optimizer, step: int, elapsed: float, log: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
         "elapsed": elapsed, "log": log},
        tmp,
    )
    tmp.replace(path)


def train(args: argparse.Namespace) -> None:
    from tqdm import tqdm
    from transformers import Qwen3MoeForCausalLM

    from oea.models.data import read_text, split_files, stdlib_files, token_stream

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.cache_dir.mkdir(parents=True, exist_ok=True)

    train_files, heldout_files = split_files(stdlib_files())
    train_texts = [read_text(f.path) for f in train_files]
    heldout_texts = [read_text(f.path) for f in heldout_files]
    tokenizer = load_or_train_tokenizer(args.cache_dir, train_texts)
    stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, heldout_texts)
    heldout_docs = [s for s in (np.asarray(tokenizer(t)["input_ids"]) for t in heldout_texts) if len(s) >= 64]
    print(f"train: {len(train_files)} files, {len(stream):,} tokens; held out: {len(heldout_files)} files, "
          f"{len(heldout_stream):,} tokens", flush=True)

    config = build_config(tokenizer, args.aux_coef)
    config.save_pretrained(args.cache_dir)  # export reads the architecture from here
    (args.cache_dir / "train_args.json").write_text(
        json.dumps({k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}, indent=1)
    )
    model = Qwen3MoeForCausalLM._from_config(config, experts_implementation="grouped_mm")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt_path = args.cache_dir / "checkpoint.pt"
    step, elapsed_before, log = 0, 0.0, []
    if ckpt_path.exists() and not args.no_resume:
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed_before, log = state["step"], state["elapsed"], state["log"]
        print(f"resumed at step {step} ({elapsed_before / 60:.1f} min trained before)", flush=True)
    model.train()

    start = time.monotonic()
    deadline = start + args.minutes * 60 - elapsed_before
    bar = tqdm(total=args.steps, initial=step, desc="train", mininterval=10, file=sys.stdout)
    while step < args.steps and time.monotonic() < deadline:
        batch = sample_batch(stream, step, args.seed, args.batch_size, args.seq_len)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, elapsed_before + time.monotonic() - start, args)
        out = model(batch[:, :-1], labels=batch[:, :-1].clone())
        # transformers shifts labels inside the loss; feeding the window minus its last token
        # keeps every position supervised except the first.
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        ce = float(out.loss.detach() - args.aux_coef * out.aux_loss.detach())
        bar.update(1)
        bar.set_postfix(ce=f"{ce:.3f}", aux=f"{float(out.aux_loss):.2f}")
        entry = {"step": step, "train_ce": ce, "aux": float(out.aux_loss),
                 "minutes": (elapsed_before + time.monotonic() - start) / 60}
        if step % args.eval_every == 0 or step == args.steps:
            entry.update(quick_eval(model, heldout_stream, heldout_docs, args.seq_len))
            print(f"\nstep {step}: {json.dumps(entry)}", flush=True)
        log.append(entry)
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_checkpoint(ckpt_path, model, optimizer, step, elapsed_before + time.monotonic() - start, log)
    bar.close()
    save_checkpoint(ckpt_path, model, optimizer, step, elapsed_before + time.monotonic() - start, log)
    print(f"stopped at step {step}/{args.steps} after {(elapsed_before + time.monotonic() - start) / 60:.1f} "
          "min of training", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.export_only:
        train(args)
    from embedded_export import export_embedded  # scripts/, beside this script (sys.path[0])

    export_embedded(args.cache_dir, args.out, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
