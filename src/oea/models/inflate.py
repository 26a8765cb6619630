"""Inflate a Qwen3-MoE-style model's experts to a realistic byte size without changing what it computes.

The embedded model's experts are tiny (hidden 128, intermediate 48: 37 KB each), so expert weights are
a negligible part of a decode step and fewer active experts cannot show up as a faster step. Inflation
widens every routed expert's intermediate dimension from I to I' (e.g. to Qwen3-30B-A3B's per-expert
byte size: ``--like qwen3-30b-a3b`` gives I' = 12288 at hidden 128, bf16), so that each active expert
costs what a real one costs to read, while the model stays the same function:

* channels 0..I-1 keep the base weights;
* channels I..I'-1 get **random, non-zero gate and up rows** (normal, std ``initializer_range``,
  seeded) and **exactly zero down-projection columns** (``down_proj.weight[:, I:] = 0``).

A padding channel's activation silu(g·x)·(u·x) is finite, so its contribution ``0 · activation`` is
exactly 0 and the expert's output is the base expert's output, up to the summation order of the down
GEMM (bf16 rounding). Why zero *down* columns rather than zero gate/up rows: zero gate/up rows make the
padding activations exactly 0, which an activation-sparsity kernel (or a fused act+down kernel testing
for zeros) could skip. Here the activations are dense and non-zero, the gate/up GEMMs have no zero
weight at all, and skipping the zero down columns would need a sparse weight format; the checkpoint
is dense, so every kernel reads and multiplies all of I' channels.

Two ways to use it:

* in memory (``inflate_model`` / ``load_inflated``): for a machine that has only the package;
* on disk (``write_inflated``): a Hugging Face checkpoint (per-expert keys, one safetensors shard per
  MoE layer) that vLLM and transformers load. ``oea inflate`` is its command line.

Sizes are checked before anything is allocated or written: memory (``MemAvailable``) for the in-memory
path, disk space and one shard's memory for the checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from oea.console import check_output_folder

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "InflationPlan",
    "inflate_model",
    "intermediate_size_like",
    "load_inflated",
    "plan_for_model",
    "plan_inflation",
    "write_inflated",
]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen3_moe", "qwen2_moe")
EXPERT_KEY = re.compile(r"(?P<layer_prefix>.*\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\."
                        r"(?P<proj>gate|up|down)_proj\.weight")
FUSED_EXPERT_KEY = re.compile(r".*\.mlp\.experts\.(gate_up_proj|down_proj)")
WEIGHT_FILES: tuple[str, ...] = ("model.safetensors", "model.safetensors.index.json")
INFLATION_FILE = "inflation.json"
# Share of MemAvailable / free disk the inflation may use (the rest stays for everything else).
MEMORY_HEADROOM = 0.85
DISK_HEADROOM = 0.95
_ELEMENT_BYTES: dict[str, int] = {"BF16": 2, "F16": 2, "F32": 4}
_LOOKED_FOR = (f"config.json model_type in {list(SUPPORTED_MODEL_TYPES)} with 'moe_intermediate_size', "
               "and per-expert weights '<...>.layers.L.mlp.experts.E.{gate,up,down}_proj.weight'")


@dataclass(frozen=True)
class InflationPlan:
    """What an inflation does and what it needs.

    Attributes:
        base_size / size: the experts' intermediate size before / after (I, I').
        hidden_size: H. num_experts: routed experts per MoE layer. num_moe_layers: layers with experts.
        bytes_per_weight: storage bytes of one expert weight (2 for bf16).
        like: the preset whose per-expert bytes were matched (None with an explicit size).
        seed: seed of the padding gate/up rows. init_std: their standard deviation.
    """

    base_size: int
    size: int
    hidden_size: int
    num_experts: int
    num_moe_layers: int
    bytes_per_weight: int
    like: str | None = None
    seed: int = 0
    init_std: float = 0.02

    @property
    def expert_bytes(self) -> int:
        """Bytes of one inflated expert: 3·H·I'·bytes."""
        return 3 * self.hidden_size * self.size * self.bytes_per_weight

    @property
    def expert_bytes_total(self) -> int:
        """Bytes of every inflated expert of the model."""
        return self.expert_bytes * self.num_experts * self.num_moe_layers

    @property
    def added_bytes(self) -> int:
        """Bytes inflation adds to the model (I' - I channels everywhere)."""
        return 3 * self.hidden_size * (self.size - self.base_size) * self.bytes_per_weight * \
            self.num_experts * self.num_moe_layers

    @property
    def layer_bytes(self) -> int:
        """Bytes of one MoE layer's inflated experts (one checkpoint shard)."""
        return self.expert_bytes * self.num_experts

    def summary(self) -> dict[str, Any]:
        """JSON-friendly description (written to ``inflation.json``)."""
        return {**asdict(self), "expert_bytes": self.expert_bytes, "expert_bytes_total": self.expert_bytes_total,
                "method": "padding channels: random gate/up rows, zero down_proj columns (dense)"}


def intermediate_size_like(preset: str, hidden_size: int, bytes_per_weight: int) -> int:
    """The intermediate size at which an expert of ``hidden_size`` (stored with ``bytes_per_weight``)
    has the per-expert bytes of model preset ``preset`` (``oea.presets``): round(bytes / (3·H·b)).

    Raises ``ValueError`` listing the preset names when ``preset`` is unknown.
    """
    from oea.presets import MODEL_PRESETS, model_preset_names

    found = MODEL_PRESETS.get(preset)
    if found is None:
        raise ValueError(f"--like must be one of {model_preset_names()}, got {preset!r}")
    return max(1, round(found.expert_bytes / (3 * hidden_size * bytes_per_weight)))


def plan_inflation(config: dict[str, Any], num_moe_layers: int, bytes_per_weight: int, *, like: str | None = None,
                   moe_intermediate_size: int | None = None, seed: int = 0) -> InflationPlan:
    """The plan for a base model described by its ``config.json`` dict.

    Exactly one of ``like`` (a model preset name) and ``moe_intermediate_size`` is given. Raises
    ``ValueError`` for an unsupported family (naming what was looked for), an unknown preset (listing
    the names) or a target smaller than the base expert size (naming both sizes).
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES or "moe_intermediate_size" not in config:
        raise ValueError(f"not a supported MoE family: looked for {_LOOKED_FOR}; got model_type {model_type!r}")
    if (like is None) == (moe_intermediate_size is None):
        raise ValueError("give exactly one of --like PRESET and --moe-intermediate-size N")
    hidden, base = int(config["hidden_size"]), int(config["moe_intermediate_size"])
    if like is not None:
        size, what = intermediate_size_like(like, hidden, bytes_per_weight), f"--like {like}"
    else:
        size, what = int(moe_intermediate_size), "--moe-intermediate-size"  # type: ignore[arg-type]
        if size < 1:
            raise ValueError(f"--moe-intermediate-size must be >= 1, got {size}")
    if size < base:
        raise ValueError(f"{what} asks for expert intermediate size {size}, smaller than the base model's {base}; "
                         "inflation only widens experts")
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    return InflationPlan(base_size=base, size=size, hidden_size=hidden, num_experts=num_experts,
                         num_moe_layers=num_moe_layers, bytes_per_weight=bytes_per_weight, like=like, seed=seed,
                         init_std=float(config.get("initializer_range", 0.02)))


# ---------------------------------------------------------------- padding values


def _layer_generator(seed: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + layer)


def _padding_rows(generator: torch.Generator, rows: int, hidden: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, hidden]`` random rows (float32 normal · std, cast to ``dtype``)."""
    return (torch.randn(rows, hidden, generator=generator) * std).to(dtype)


def padded_expert(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, plan: InflationPlan,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert's weights widened to ``plan.size``: gate, up ``[I, H]`` -> ``[I', H]`` (random rows appended),
    down ``[H, I]`` -> ``[H, I']`` (zero columns appended). Draws gate rows, then up rows, from ``generator``."""
    pad = plan.size - gate.shape[0]
    gate_pad = _padding_rows(generator, pad, gate.shape[1], plan.init_std, gate.dtype)
    up_pad = _padding_rows(generator, pad, up.shape[1], plan.init_std, up.dtype)
    zeros = torch.zeros(down.shape[0], pad, dtype=down.dtype)
    return torch.cat([gate, gate_pad]), torch.cat([up, up_pad]), torch.cat([down, zeros], dim=1)


# ---------------------------------------------------------------- memory and disk


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (bytes)."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("cannot read MemAvailable from /proc/meminfo")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_memory(needed: int, what: str, available: int | None = None) -> None:
    """``ValueError`` naming the size needed when ``needed`` bytes exceed the usable share of memory."""
    available = available_memory_bytes() if available is None else available
    if needed > MEMORY_HEADROOM * available:
        raise ValueError(f"not enough memory for {what}: needs {_gib(needed)}, {_gib(available)} available "
                         f"({MEMORY_HEADROOM:.0%} usable)")


def check_disk(needed: int, out_dir: pathlib.Path, free: int | None = None) -> None:
    """``ValueError`` naming the size needed when ``out_dir``'s file system has too little free space."""
    if free is None:
        probe = out_dir
        while not probe.exists():
            probe = probe.parent
        free = shutil.disk_usage(probe).free
    if needed > DISK_HEADROOM * free:
        raise ValueError(f"not enough disk space for the inflated checkpoint in {out_dir}: needs {_gib(needed)}, "
                         f"{_gib(free)} free")


# ---------------------------------------------------------------- in memory


def _expert_modules(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer number, experts module) for every module with 3-D ``gate_up_proj`` and ``down_proj``."""
    found = []
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
            match = re.search(r"layers\.(\d+)\.", name + ".")
            if match is None or getattr(module, "is_transposed", False):
                raise ValueError(f"experts module {name!r} has an unsupported layout; looked for {_LOOKED_FOR}")
            found.append((int(match.group(1)), module))
    return found


def plan_for_model(model: torch.nn.Module, *, like: str | None = None, moe_intermediate_size: int | None = None,
                   seed: int = 0) -> InflationPlan:
    """The inflation plan of a loaded transformers model (sizes in the model's current dtype)."""
    experts = _expert_modules(model)
    if not experts or not hasattr(model, "config"):
        raise ValueError(f"not a supported MoE family: looked for {_LOOKED_FOR}; {type(model).__name__} has no "
                         "experts module with 3-D gate_up_proj/down_proj")
    dtype = experts[0][1].gate_up_proj.dtype
    return plan_inflation(model.config.to_dict(), len(experts), torch.empty((), dtype=dtype).element_size(), like=like,
                          moe_intermediate_size=moe_intermediate_size, seed=seed)


@torch.no_grad()
def inflate_model(model: torch.nn.Module, *, like: str | None = None, moe_intermediate_size: int | None = None,
                  seed: int = 0, available_memory: int | None = None) -> torch.nn.Module:
    """Widen every routed expert of a transformers Qwen3-MoE-style model in place; returns the model.

    Experts are the fused ``gate_up_proj [N, 2I, H]`` / ``down_proj [N, H, I]`` parameters of
    transformers 5; the result has ``[N, 2I', H]`` / ``[N, H, I']`` and ``config.moe_intermediate_size =
    I'``. Padding values are those ``write_inflated`` writes (same seed, same order), so the in-memory
    and on-disk models are identical. Checks memory first (``available_memory`` overrides MemAvailable,
    for tests). Raises ``ValueError`` as ``plan_inflation`` does, or naming the memory needed.
    """
    plan = plan_for_model(model, like=like, moe_intermediate_size=moe_intermediate_size, seed=seed)
    check_memory(plan.added_bytes, f"inflating to moe_intermediate_size {plan.size}", available_memory)
    for layer, experts in _expert_modules(model):
        generator = _layer_generator(seed, layer)
        old_gate_up, old_down = experts.gate_up_proj, experts.down_proj
        n, two_i, hidden = old_gate_up.shape
        base = two_i // 2
        gate_up = torch.empty(n, 2 * plan.size, hidden, dtype=old_gate_up.dtype, device=old_gate_up.device)
        down = torch.empty(n, hidden, plan.size, dtype=old_down.dtype, device=old_down.device)
        for e in range(n):
            gate, up, dn = padded_expert(old_gate_up[e, :base].cpu(), old_gate_up[e, base:].cpu(),
                                         old_down[e].cpu(), plan, generator)
            gate_up[e, :plan.size].copy_(gate)
            gate_up[e, plan.size:].copy_(up)
            down[e].copy_(dn)
        experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
        experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
        if hasattr(experts, "intermediate_dim"):
            experts.intermediate_dim = plan.size
        del old_gate_up, old_down
    model.config.moe_intermediate_size = plan.size
    return model


def load_inflated(model_dir: str | pathlib.Path | None = None, *, like: str | None = None,
                  moe_intermediate_size: int | None = None, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                  experts_implementation: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the checkpoint in ``model_dir`` (default: the embedded model) loaded in
    ``dtype`` and inflated in memory (``inflate_model``)."""
    from oea.models import load_model

    model, tokenizer = load_model(model_dir, dtype=dtype, experts_implementation=experts_implementation)
    return inflate_model(model, like=like, moe_intermediate_size=moe_intermediate_size, seed=seed), tokenizer


# ---------------------------------------------------------------- on disk


def _weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no weights in {model_dir}: looked for {' or '.join(WEIGHT_FILES)}")


def _scan(model_dir: pathlib.Path) -> tuple[dict[str, Any], dict[str, pathlib.Path], dict[int, list[str]], int]:
    """(config, {key: file}, {layer: expert keys}, bytes per expert weight) of a base checkpoint."""
    from safetensors import safe_open

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model checkpoint not found: {model_dir / 'config.json'} does not exist")
    config = json.loads((model_dir / "config.json").read_text())
    where: dict[str, pathlib.Path] = {}
    layers: dict[int, list[str]] = {}
    element = 0
    for path in _weight_files(model_dir):
        with safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                where[key] = path
                if FUSED_EXPERT_KEY.fullmatch(key):
                    raise ValueError(f"not a supported MoE family: looked for {_LOOKED_FOR}; {path.name} holds fused "
                                     f"expert tensors ({key})")
                match = EXPERT_KEY.fullmatch(key)
                if match:
                    layers.setdefault(int(match.group("layer")), []).append(key)
                    element = element or _ELEMENT_BYTES.get(f.get_slice(key).get_dtype(), 0)
    if not layers:
        raise ValueError(f"not a supported MoE family: looked for {_LOOKED_FOR}; {model_dir} has no such weights")
    if not element:
        raise ValueError(f"expert weights in {model_dir} have an unsupported dtype (supported: "
                         f"{sorted(_ELEMENT_BYTES)})")
    return config, where, layers, element


def _expert_triples(keys: list[str]) -> Iterator[tuple[int, str, str, str]]:
    """(expert, gate key, up key, down key) in expert order."""
    by_expert: dict[int, dict[str, str]] = {}
    for key in keys:
        match = EXPERT_KEY.fullmatch(key)
        assert match is not None
        by_expert.setdefault(int(match.group("expert")), {})[match.group("proj")] = key
    for expert in sorted(by_expert):
        projections = by_expert[expert]
        if set(projections) != {"gate", "up", "down"}:
            raise ValueError(f"expert {expert}: expected gate, up and down weights, found {sorted(projections)}")
        yield expert, projections["gate"], projections["up"], projections["down"]


def write_inflated(out_dir: str | pathlib.Path, model_dir: str | pathlib.Path | None = None, *,
                   like: str | None = None, moe_intermediate_size: int | None = None, seed: int = 0,
                   free_disk: int | None = None, available_memory: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write the inflated checkpoint of ``model_dir`` (default: the embedded model) to ``out_dir``.

    Layout: one safetensors shard per MoE layer (its experts, per-expert keys) plus one for every other
    tensor, ``model.safetensors.index.json``, ``config.json`` with the new ``moe_intermediate_size``,
    the base directory's other files (tokenizer, generation config, held-out list, ...) and
    ``inflation.json`` (the plan). Disk space (the whole checkpoint) and memory (one shard, twice) are
    checked before ``out_dir`` is created; ``out_dir`` must not exist or be empty. ``free_disk`` /
    ``available_memory`` override the measured values (tests); ``progress(done, total)`` is called after each
    shard is written. Returns the plan summary with ``out_dir`` and ``bytes_written``.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from oea.models import embedded_model_dir

    base_dir = embedded_model_dir() if model_dir is None else pathlib.Path(model_dir)
    if not base_dir.is_dir():
        raise FileNotFoundError(f"model checkpoint not found: {base_dir} (expected a directory)")
    out = check_output_folder(out_dir, "--out", empty=True)  # before the disk check: an unwritable place has no space
    config, where, layers, element = _scan(base_dir)
    plan = plan_inflation(config, len(layers), element, like=like, moe_intermediate_size=moe_intermediate_size,
                          seed=seed)
    other_bytes = sum(p.stat().st_size for p in set(where.values()))
    check_disk(plan.expert_bytes_total + other_bytes, out, free_disk)
    check_memory(2 * plan.layer_bytes, f"writing one inflated layer ({plan.num_experts} experts)", available_memory)

    out.mkdir(parents=True, exist_ok=True)
    expert_keys = {key for keys in layers.values() for key in keys}
    shard_names = [f"model-{i + 1:05d}-of-{len(layers) + 1:05d}.safetensors" for i in range(len(layers) + 1)]
    weight_map: dict[str, str] = {}
    total = 0
    handles: dict[pathlib.Path, Any] = {}
    try:
        def tensor(key: str) -> torch.Tensor:
            path = where[key]
            if path not in handles:
                handles[path] = safe_open(path, "pt").__enter__()
            return handles[path].get_tensor(key)

        for done, (shard, layer) in enumerate(zip(shard_names, sorted(layers), strict=False), start=1):
            generator = _layer_generator(seed, layer)
            tensors: dict[str, torch.Tensor] = {}
            for _expert, gate_key, up_key, down_key in _expert_triples(layers[layer]):
                gate, up, down = padded_expert(tensor(gate_key), tensor(up_key), tensor(down_key), plan, generator)
                tensors.update({gate_key: gate, up_key: up, down_key: down})
            save_file(tensors, str(out / shard), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, shard))
            del tensors
            if progress is not None:
                progress(done, len(shard_names))
        rest = {key: tensor(key) for key in where if key not in expert_keys}
        save_file(rest, str(out / shard_names[-1]), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in rest.values())
        weight_map.update(dict.fromkeys(rest, shard_names[-1]))
        if progress is not None:
            progress(len(shard_names), len(shard_names))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1) + "\n")
    for item in base_dir.iterdir():
        if item.is_file() and item.name not in (*WEIGHT_FILES, "config.json", INFLATION_FILE) \
                and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    (out / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": plan.size}, indent=2) + "\n")
    summary = {**plan.summary(), "base_model": str(base_dir), "out_dir": str(out), "bytes_written": total}
    (out / INFLATION_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary

