"""Exactness sweep of the routing kernels against ``oea.route``: N generated cases per kernel, mismatches counted.

    .venv/bin/python scripts/kernel_sweep.py --impl numba --cases 10000
    TRITON_INTERPRET=1 .venv/bin/python scripts/kernel_sweep.py --impl triton --cases 10000   # CPU interpreter
    .venv/bin/python scripts/kernel_sweep.py --impl triton --device cuda --cases 10000         # on a GPU

Each case (``random_case``, also the generator of the hypothesis tests in ``tests/unit/test_kernels*.py``)
draws a router family (softmax ± renormalise; sigmoid with or without correction bias, groups, routed
scaling), N (powers of two and not), k, M, a logits style (normal, tied grids, bf16, fp16, NaN/±inf rows),
a config (vanilla, pruned, OEA with min_batch / max_experts / max_rank / group_fill, adaptive k0) and
padding rows. The boundary cases (``boundary_cases``: min_batch edges, k0 = 1 / k, every row padding, the
smallest groups, ties) run first. A case matches when the ids are equal slot by slot, weights are within the
dispatcher's stated tolerance and zero exactly where the core's are zero. Prints one JSON line; exit 1 on any
mismatch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

import oea
from oea.kernels import WEIGHT_ATOL, WEIGHT_RTOL, route_fast
from oea.routing import AdaptiveK0Config

Case = tuple[torch.Tensor, oea.RouterSpec, object | None, torch.Tensor | None]
SIZES = (4, 8, 12, 16, 24, 32, 64, 96, 128, 160, 256)
STYLES = ("normal", "ties", "bf16", "fp16", "specials", "signed-zeros")


def _logits(rng: random.Random, gen: torch.Generator, m: int, n: int, style: str) -> torch.Tensor:
    scale = rng.choice([0.5, 2.0, 6.0])
    x = torch.randn(m, n, generator=gen) * scale
    if style == "ties":
        x = torch.randint(-rng.randint(1, 4), rng.randint(1, 4) + 1, (m, n), generator=gen).float() / 4
    elif style == "bf16":
        return x.bfloat16()
    elif style == "fp16":
        return x.half()
    elif style == "specials":
        picks = torch.rand(m, n, generator=gen)
        x = torch.where(picks < 0.05, float("nan"), x)
        x = torch.where((picks >= 0.05) & (picks < 0.08), float("inf"), x)
        x = torch.where((picks >= 0.08) & (picks < 0.15), float("-inf"), x)
        if m > 1:
            x[rng.randrange(m)] = rng.choice([float("-inf"), float("nan")])
    elif style == "signed-zeros":
        x = torch.where(torch.rand(m, n, generator=gen) < 0.5, 0.0, -0.0) + (x > 2).float()
    return x


def random_case(seed: int, max_rows: int = 64, sizes: tuple[int, ...] = SIZES,
                top_ks: tuple[int, ...] | None = None) -> Case:
    """One generated routing call: (logits [M, N], spec, cfg, valid [M] or None); ``top_ks`` fixes the k
    drawn from (fewer shapes: fewer Triton compilations on a GPU)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n = rng.choice(sizes)
    k = rng.randint(1, min(n, rng.choice([2, 4, 8, 8, 8, 16]))) if top_ks is None else min(n, rng.choice(top_ks))
    m = rng.randint(1, max_rows)
    kwargs: dict = {"renormalize": rng.random() < 0.7}
    if rng.random() < 0.5:
        kwargs["scoring"] = "sigmoid"
        if rng.random() < 0.7:
            bias = torch.randn(n, generator=gen) * 0.1
            kwargs["correction_bias"] = torch.round(bias * 16) / 16 if rng.random() < 0.3 else bias
        groups = [g for g in (1, 2, 4, 8) if n % g == 0 and n // g >= 2]
        n_group = rng.choice(groups)
        feasible = [t for t in range(1, n_group + 1) if t * (n // n_group) >= k]
        if n_group > 1 or rng.random() < 0.3:
            kwargs.update(n_group=n_group, topk_group=rng.choice(feasible))
        kwargs["routed_scaling_factor"] = rng.choice([1.0, 1.0, 2.5])
    spec = oea.RouterSpec(n, k, **kwargs)
    k0 = rng.randint(1, k)
    choice = rng.random()
    cfg: object | None
    if choice < 0.15:
        cfg = None
    elif choice < 0.3:
        cfg = oea.PrunedConfig(k0, renormalize=rng.choice([None, True, False]))
    elif choice < 0.4:
        cfg = AdaptiveK0Config(((4, k), (max(5, m + rng.randint(-2, 2)), k0)), min_batch=rng.randint(0, 3))
    else:
        options: dict = {"min_batch": rng.randint(0, 4), "group_fill": rng.choice(["in", "cross"])}
        if rng.random() < 0.4:
            options["max_experts"] = rng.randint(k0, k)
        if rng.random() < 0.3:
            options["max_rank"] = rng.randint(k0, n)
        cfg = oea.OEAConfig(k0, **options)
    valid = None
    if rng.random() < 0.5:
        valid = torch.rand(m, generator=gen) < rng.choice([0.3, 0.8, 1.0])
    return _logits(rng, gen, m, n, rng.choice(STYLES)), spec, cfg, valid


def _permuted(m: int, n: int, seed: int) -> torch.Tensor:
    """[m, n] logits without ties: a random permutation of 0..n-1 per row, scaled."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=gen) for _ in range(m)]).float() / 4


def boundary_cases() -> list[tuple[str, Case]]:
    """The boundaries written out (the explicit ``@example``s of the property tests, also swept first):
    min_batch - 1 / exactly / + 1 real rows with and without padding rows, k0 = 1 and k0 = k, every row
    padding, the smallest groups a grouped router may have (two experts each: one expert per group is
    refused by ``RouterSpec``) and a single group, and ties (equal logits, a tied grid)."""
    softmax = oea.RouterSpec(16, 4)
    cases: list[tuple[str, Case]] = []
    for real in (3, 4, 5):  # min_batch = 4
        valid = torch.tensor([True, False] * real + [False] * 2)  # real rows between padding rows
        cfg = oea.OEAConfig(2, min_batch=4)
        cases.append((f"{real} real rows, min_batch 4, padded", (_permuted(len(valid), 16, real), softmax, cfg, valid)))
        cases.append((f"{real} rows, min_batch 4", (_permuted(real, 16, 10 + real), softmax, cfg, None)))
    cases.append(("k0 = 1", (_permuted(6, 16, 20), softmax, oea.OEAConfig(1, min_batch=0), None)))
    cases.append(("k0 = k", (_permuted(6, 16, 21), softmax, oea.OEAConfig(4), None)))
    cases.append(("pruned k0 = 1", (_permuted(6, 16, 22), softmax, oea.PrunedConfig(1), None)))
    nothing_real = torch.zeros(5, dtype=torch.bool)
    for min_batch in (0, 2):
        cfg = oea.OEAConfig(2, min_batch=min_batch)
        cases.append((f"every row padding, min_batch {min_batch}", (_permuted(5, 16, 23), softmax, cfg, nothing_real)))
    bias = torch.arange(16).float().flip(0) / 64
    for fill in ("in", "cross"):
        pairs = oea.RouterSpec(16, 4, "sigmoid", correction_bias=bias, n_group=8, topk_group=2,
                               routed_scaling_factor=2.5)
        cases.append((f"two experts per group, group_fill {fill}",
                      (_permuted(7, 16, 24), pairs, oea.OEAConfig(1, group_fill=fill), None)))
    single = oea.RouterSpec(16, 4, "sigmoid", n_group=1, topk_group=1)
    cases.append(("a single group", (_permuted(7, 16, 25), single, oea.OEAConfig(2), None)))
    grid = torch.randint(-2, 3, (8, 16), generator=torch.Generator().manual_seed(26)).float() / 4
    for spec in (softmax, oea.RouterSpec(16, 4, "sigmoid", renormalize=True)):
        cases.append((f"equal logits, {spec.scoring}", (torch.zeros(6, 16), spec, oea.OEAConfig(2, min_batch=0), None)))
        cases.append((f"tied grid, {spec.scoring}", (grid, spec, oea.OEAConfig(2, min_batch=0), None)))
    return cases


def mismatch(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """How a kernel's (ids, weights) differ from ``oea.route``'s, or None when they match as promised."""
    ids, weights = got[0].cpu(), got[1].cpu()
    want_ids, want_weights = want[0].cpu(), want[1].cpu()
    if ids.dtype != torch.int64 or weights.dtype != torch.float32 or ids.shape != want_ids.shape:
        return f"dtype/shape {ids.dtype} {weights.dtype} {tuple(ids.shape)} vs {tuple(want_ids.shape)}"
    rows = (ids != want_ids).any(dim=1).nonzero().flatten().tolist()
    if rows:
        r = rows[0]
        return f"ids differ in {len(rows)} rows, first row {r}: {ids[r].tolist()} != {want_ids[r].tolist()}"
    if not torch.equal(weights == 0, want_weights == 0):
        return "zero weights differ"
    excess = (weights - want_weights).abs() - (WEIGHT_RTOL * want_weights.abs() + WEIGHT_ATOL)
    if bool((excess > 0).any()):
        worst = int(excess.flatten().argmax())
        return (f"weight {float(weights.flatten()[worst])!r} vs {float(want_weights.flatten()[worst])!r} "
                f"beyond rtol {WEIGHT_RTOL} + atol {WEIGHT_ATOL}")
    return None


def sweep(impl: str, cases: int, device: str, first_seed: int = 0, max_rows: int = 64) -> dict:
    """Run the boundary cases, then ``cases`` generated ones, through ``route_fast(impl=...)`` and ``oea.route``;
    count mismatches (a boundary case's is named by its ``boundary`` instead of a ``seed``)."""
    mismatches: list[dict] = []
    start = time.perf_counter()
    boundaries = boundary_cases()
    labelled = [({"boundary": name}, case) for name, case in boundaries]
    labelled += [({"seed": seed}, random_case(seed, max_rows)) for seed in range(first_seed, first_seed + cases)]
    for label, (logits, spec, cfg, valid) in labelled:
        if spec.correction_bias is not None:
            spec = oea.RouterSpec(spec.num_experts, spec.top_k, spec.scoring, spec.renormalize,
                                  spec.correction_bias.to(device), spec.n_group, spec.topk_group,
                                  spec.routed_scaling_factor)
        logits = logits.to(device)
        valid = None if valid is None else valid.to(device)
        want = oea.route(logits, spec, cfg, valid)
        got = route_fast(logits, spec, cfg, valid, impl=impl)
        why = mismatch(got, want)
        if why is not None:
            mismatches.append({**label, "why": why})
    return {"impl": impl, "device": device, "cases": cases, "boundary_cases": len(boundaries),
            "first_seed": first_seed, "max_rows": max_rows,
            "mismatches": len(mismatches), "examples": mismatches[:5],
            "weight_rtol": WEIGHT_RTOL, "weight_atol": WEIGHT_ATOL, "torch": torch.__version__,
            "wall_s": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["numba", "triton"], required=True, help="the kernel to check")
    parser.add_argument("--cases", type=int, default=10000, help="generated cases (seeds first-seed..)")
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first case")
    parser.add_argument("--max-rows", type=int, default=64, help="largest M drawn")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors live")
    args = parser.parse_args(argv)
    if args.cases < 1 or args.max_rows < 1:
        parser.error("--cases and --max-rows must be >= 1")
    torch.set_num_threads(1)
    result = sweep(args.impl, args.cases, args.device, args.first_seed, args.max_rows)
    print(json.dumps(result))
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
