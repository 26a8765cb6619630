#!/usr/bin/env python3
"""Convert the third-party routing traces (the raw public sets, not shipped) into oea's bundled trace format.

    .venv/bin/python scripts/convert_traces.py --data DIR [--out DIR]

Sources (attribution and licences travel in each trace's JSON sidecar and in ``SOURCES.md``):

* ``qwen3-30b-a3b-vllm-sharegpt-prefill``: Qwen3-30B-A3B top-8 ids from vLLM (ShareGPT prefill),
  by GitHub user soryxie / "songrun", Apache-2.0 (repository licence) -> ``qwen3-30b-a3b``.
* ``flame-moe-290m-top6-batches``: FLAME-MoE-290M top-6 probabilities (CMU-FLAME, Apache-2.0,
  reformatted by DynaNDE-Simulator) -> ``flame-moe-290m`` (natural 64-sequence decode batches,
  10 positions) and ``flame-moe-290m-chunk`` (2,048 consecutive tokens).
* ``nvmoe-llamacpp-decode-traces``: llama.cpp greedy decode ids of OLMoE-1B-7B, DeepSeek-V2-Lite
  and GPT-OSS-120B (nvmoe, MIT, Copyright (c) 2026 Christopher Ayers) -> ``olmoe-1b-7b-decode``,
  ``deepseek-v2-lite-decode``, ``gpt-oss-120b-decode``.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import pathlib
import re
import shutil
import sys

import numpy as np
import torch

from oea.routing import RouterSpec
from oea.traces import Trace, save_trace
from oea.traces.bundled import bundled_trace_dir

FLAME_POSITIONS = ("1st", "2nd", "3rd", "4th", "5th", "6th", "7th", "8th", "9th", "10th")
FLAME_LAYERS = tuple(range(2, 10))


def convert_qwen3(folder: pathlib.Path) -> Trace:
    """The two >1,000-token prefill passes: 4,130 tokens x 48 layers x top-8 ids (no scores)."""
    passes = []
    for name in ("token_distri_8.jsonl.gz", "token_distri_16.jsonl.gz"):
        with gzip.open(folder / name, "rt") as fh:
            rows = [json.loads(line) for line in fh]
        big = [r for r in rows if r["topk_weights"][0] > 1000]  # "topk_weights" holds the shape
        if len(big) != 48:
            raise ValueError(
                f"{folder / name}: expected one 48-layer pass with > 1000 tokens, got {len(big)} lines"
            )
        passes.append(np.array([r["topk_ids"] for r in big]).transpose(1, 0, 2))  # [T, 48, 8]
    ids = np.concatenate(passes)
    return Trace(
        spec=RouterSpec(128, 8, scoring="softmax", renormalize=True),
        ids=torch.from_numpy(ids.astype(np.int64)),
        meta={
            "name": "qwen3-30b-a3b",
            "model": "Qwen/Qwen3-30B-A3B-Instruct-2507",
            "model_preset": "qwen3-30b-a3b",
            "kind": "prefill (ShareGPT prompts), ids only",
            "source": "https://github.com/soryxie/vllm branch songrun/profile_moe commit "
            "0c9d1f469c2895f3d9f634b8ec39053804bd20a5, profile_json/token_distri_{8,16}.jsonl "
            "(captured by GitHub user soryxie / 'songrun' with a logging patch in vLLM 0.10)",
            "licence": "Apache-2.0 (the repository's licence; the data files carry none of their own)",
            "notes": [
                "Prefill tokens of about 4 ShareGPT prompts (prompt boundaries not recorded; adjacent-token "
                "overlap drops at positions 1024 and 2048 of each pass), so no request ids or positions.",
                "Ids only: OEA replay can piggyback only within each token's recorded top-8.",
                "Order within a row is vLLM's top-k kernel order, presumably descending score (unverified).",
                "Only the two large passes (2,050 + 2,080 tokens) are real data; warm-up and DP dummy "
                "passes are dropped.",
            ],
        },
    )


def _flame_csv(path: pathlib.Path) -> np.ndarray:
    with gzip.open(path, "rt") as fh:
        reader = csv.reader(fh)
        next(reader)
        return np.array([[float(x) for x in row[2:]] for row in reader])


def _flame_txt_indices(path: pathlib.Path) -> np.ndarray:
    with gzip.open(path, "rt") as fh:
        text = fh.read()
    block = text.split("-indices-")[1]
    block = block[block.index("tensor(") + len("tensor(") : block.index(")", block.index("tensor("))]
    return np.array(json.loads(re.sub(r"\s+", "", block)))


def _single(folder: pathlib.Path, pattern: str) -> pathlib.Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise ValueError(f"{folder}: expected exactly one {pattern}, found {len(found)}")
    return found[0]


FLAME_META = {
    "model": "FLAME-MoE-290M (run 31066, iteration 5473)",
    "model_preset": None,
    "source": "Hugging Face dataset CMU-FLAME/FLAME-MoE-Traces (FLAME-MoE, Kang, Yu, Xiong, "
    "arXiv:2505.20225), "
    "reformatted by https://github.com/Akash-N-Pai/DynaNDE-Simulator commit "
    "f274466b9095e0b417f701a3ef3a14a6639b6aed, folder 'Sample routing traces/'",
    "licence": "Apache-2.0 (upstream CMU-FLAME/FLAME-MoE-Traces); the redistributing DynaNDE-Simulator "
    "repository has no licence file of its own",
    "layer_indices": list(FLAME_LAYERS),
}


def convert_flame(folder: pathlib.Path) -> tuple[Trace, Trace]:
    """Decoder batches (64 sequences x 10 positions x layers 2-9) and the 2,048-token encoder chunk."""
    spec = RouterSpec(64, 6, scoring="softmax", renormalize=False)
    ids = np.zeros((len(FLAME_POSITIONS), 64, len(FLAME_LAYERS), 6), dtype=np.int64)
    scores = np.zeros(ids.shape, dtype=np.float32)
    for p, position in enumerate(FLAME_POSITIONS):
        for j, layer in enumerate(FLAME_LAYERS):
            layer_dir = folder / "Decoder_Batch_0-64" / position / f"Layer_{layer}"
            probs = _flame_csv(_single(layer_dir, "*.csv.gz"))  # [64, 64]
            top = _flame_txt_indices(_single(layer_dir, "*.txt.gz"))  # [64, 6], descending score
            if probs.shape != (64, 64) or top.shape != (64, 6):
                raise ValueError(f"{layer_dir}: unexpected shapes {probs.shape} / {top.shape}")
            if not (np.sort(top, 1) == np.sort(np.argsort(-probs, 1, kind="stable")[:, :6], 1)).all():
                raise ValueError(f"{layer_dir}: CSV top-6 sets differ from the TXT indices")
            ids[p, :, j] = top
            scores[p, :, j] = np.take_along_axis(probs, top, 1)
    decode = Trace(
        spec=spec,
        ids=torch.from_numpy(ids.reshape(-1, len(FLAME_LAYERS), 6)),
        scores=torch.from_numpy(scores.reshape(-1, len(FLAME_LAYERS), 6)).half(),
        request_ids=torch.arange(64).repeat(len(FLAME_POSITIONS)),
        positions=torch.arange(len(FLAME_POSITIONS)).repeat_interleave(64),
        meta={
            **FLAME_META,
            "name": "flame-moe-290m",
            "kind": "natural batches: 64 sequences at the same position, positions 1..10; "
            "ids + probabilities",
            "notes": [
                "Teacher-forced DCLM-style pretraining text, not chat decode; the 64 'sequences' are "
                "512-token chunks of one packed stream (request_ids = chunk index, positions = token "
                "position 0..9).",
                "Scores are un-renormalised softmax probabilities over 64 experts (top-6 only); ranks from "
                "the TXT 'indices', values from the CSV (6 decimals), stored as float16.",
                "Only MoE layers 2-9 (the upstream Layer_10..26 folders are copies and were not used); the "
                "2 shared experts are not logged.",
            ],
        },
    )
    chunk_ids = np.zeros((2048, len(FLAME_LAYERS), 6), dtype=np.int64)
    chunk_scores = np.zeros(chunk_ids.shape, dtype=np.float32)
    for j, layer in enumerate(FLAME_LAYERS):
        layer_dir = folder / "Encoder_Batch_0-32" / f"Layer_{layer}"
        probs = _flame_csv(_single(layer_dir, "*.csv.gz"))  # [2048, 64]
        top = np.argsort(-probs, 1, kind="stable")[:, :6]
        chunk_ids[:, j] = top
        chunk_scores[:, j] = np.take_along_axis(probs, top, 1)
    chunk = Trace(
        spec=spec,
        ids=torch.from_numpy(chunk_ids),
        scores=torch.from_numpy(chunk_scores).half(),
        request_ids=torch.zeros(2048, dtype=torch.int64),
        positions=torch.arange(2048),
        meta={
            **FLAME_META,
            "name": "flame-moe-290m-chunk",
            "kind": "2,048 consecutive tokens of one packed stream; ids + probabilities",
            "notes": [
                "Consecutive teacher-forced tokens of shard 0-0 (one request id); ranks from a stable "
                "argsort of the CSV probabilities (ties at 6 decimals are possible).",
                "Only MoE layers 2-9; the 2 shared experts are not logged.",
            ],
        },
    )
    return decode, chunk


NVMOE = {
    # file stem: (trace name, model, preset, N, k, renormalize, workload lengths, note)
    "olmoe-all": ("olmoe-1b-7b-decode", "allenai/OLMoE-1B-7B (GGUF Q4_0)", "olmoe-1b-7b", 64, 8, False,
                  (299, 299, 299), "workloads: chat, code, story"),
    "dsv2lite-all": ("deepseek-v2-lite-decode", "deepseek-ai/DeepSeek-V2-Lite (GGUF)", None, 64, 6, False,
                     (399, 399, 399, 199), "workloads: chat, code, story, summarize; layer 0 is dense; "
                     "the 2 shared experts are not logged"),
    "gptoss-all": ("gpt-oss-120b-decode", "openai/gpt-oss-120b (MXFP4)", "gpt-oss-120b", 128, 4, True,
                   (399, 399, 399, 199), "workloads: chat, code, story, summarize; chat and story routing is "
                   "extremely concentrated (possibly repetitive generations)"),
}


def convert_nvmoe(folder: pathlib.Path, stem: str) -> Trace:
    """One llama.cpp decode trace: per token, ``[layer, expert]`` pairs, k per layer in layer order."""
    name, model, preset, n, k, renormalize, lengths, note = NVMOE[stem]
    with gzip.open(folder / f"{stem}.tokens.jsonl.gz", "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if len(rows) != sum(lengths):
        raise ValueError(f"{folder / stem}: expected {sum(lengths)} tokens, got {len(rows)}")
    pairs = np.array(rows)  # [T, L*k, 2]
    layers = pairs[0, ::k, 0]
    if not (pairs[:, :, 0] == np.repeat(layers, k)[None, :]).all():
        raise ValueError(f"{folder / stem}: layer order differs between tokens")
    ids = pairs[:, :, 1].reshape(len(rows), len(layers), k)
    request_ids = np.concatenate([np.full(length, i) for i, length in enumerate(lengths)])
    positions = np.concatenate([np.arange(length) for length in lengths])
    return Trace(
        spec=RouterSpec(n, k, scoring="softmax", renormalize=renormalize),
        ids=torch.from_numpy(ids.astype(np.int64)),
        request_ids=torch.from_numpy(request_ids),
        positions=torch.from_numpy(positions),
        meta={
            "name": name,
            "model": model,
            "model_preset": preset,
            "kind": "real greedy decode, batch size 1 (one stream per workload), ids only",
            "source": "https://github.com/BrianBoitano/nvmoe commit "
            "f895ad371f7ca403e43bf12c338fbb68cb020b72, "
            f"traces/{stem}.tokens.jsonl (llama.cpp eval callback on ffn_moe_topk)",
            "licence": "MIT, Copyright (c) 2026 Christopher Ayers "
            "(see LICENSE.nvmoe-MIT.txt beside this file)",
            "layer_indices": [int(x) for x in layers],
            "notes": [
                note,
                "Ids only, in descending router-probability order; OEA replay can piggyback only within the "
                "recorded top-k.",
                "Only 3-4 independent prompts: request_ids = workload, positions = decode step; lock-step "
                "batches are limited to B <= number of workloads.",
            ],
        },
    )


SOURCES_MD = """# Bundled routing traces: sources and licences

Converted by `scripts/convert_traces.py` from third-party data; nobody on the oea project generated them.
Each trace's `.json` sidecar repeats its source, licence and caveats.

- `qwen3-30b-a3b`: Qwen3-30B-A3B-Instruct-2507 (128 experts, top-8, 48 layers); 4,130 prefill tokens,
  top-8 ids. Source: github.com/soryxie/vllm @ 0c9d1f46 (`profile_json/`), by soryxie / "songrun".
  Licence: Apache-2.0 (the repository's licence).
- `flame-moe-290m`: FLAME-MoE-290M (64 experts, top-6, layers 2-9); 64 sequences x 10 positions, ids +
  probabilities. `flame-moe-290m-chunk`: 2,048 consecutive tokens of the same model. Source:
  CMU-FLAME/FLAME-MoE-Traces (Kang, Yu, Xiong, arXiv:2505.20225) via
  github.com/Akash-N-Pai/DynaNDE-Simulator @ f274466b. Licence: Apache-2.0 upstream; the
  redistributing repository has no licence file.
- `olmoe-1b-7b-decode` (OLMoE-1B-7B, 64 experts, top-8, 16 layers; 897 decode tokens),
  `deepseek-v2-lite-decode` (DeepSeek-V2-Lite, 64 routed, top-6, 26 layers; 1,396 tokens),
  `gpt-oss-120b-decode` (GPT-OSS-120B, 128, top-4, 36 layers; 1,396 tokens): ids from llama.cpp
  greedy decode. Source: github.com/BrianBoitano/nvmoe @ f895ad37. Licence: MIT,
  Copyright (c) 2026 Christopher Ayers; the licence text is in `LICENSE.nvmoe-MIT.txt`.
- `embedded`: the project's embedded model (trained on the Python standard library, PSF License), captured
  by this project with `oea capture --out packages/oea-lab-data/src/oea_lab_data/traces/embedded.safetensors
  --name embedded --batch-size 16 --prompt-tokens 32 --new-tokens 64` (its JSON records the checkpoint's SHA-256).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=pathlib.Path, required=True,
                        help="folder holding the raw sets (the upstream repositories named in SOURCES.md)")
    parser.add_argument("--out", type=pathlib.Path, default=bundled_trace_dir(),
                        help="where the bundled traces go (oea-lab-data's traces/ folder)")
    parser.add_argument("--skip-nvmoe", action="store_true",
                        help="do not convert the llama.cpp decode traces")
    args = parser.parse_args(argv)
    traces = [convert_qwen3(args.data / "qwen3-30b-a3b-vllm-sharegpt-prefill")]
    traces.extend(convert_flame(args.data / "flame-moe-290m-top6-batches"))
    nvmoe = args.data / "nvmoe-llamacpp-decode-traces"
    if not args.skip_nvmoe:
        traces.extend(convert_nvmoe(nvmoe, stem) for stem in NVMOE)
        shutil.copyfile(nvmoe / "LICENSE.nvmoe-MIT.txt", args.out / "LICENSE.nvmoe-MIT.txt")
    args.out.mkdir(parents=True, exist_ok=True)
    for trace in traces:
        path = save_trace(trace, args.out / f"{trace.name}.safetensors")
        print(f"{path}: {trace.num_tokens} tokens x {trace.num_layers} layers, "
              f"N={trace.spec.num_experts} k={trace.spec.top_k}, {path.stat().st_size / 1e6:.2f} MB")
    (args.out / "SOURCES.md").write_text(SOURCES_MD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
