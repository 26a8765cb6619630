"""OEA hooks under ``torch.compile(fullgraph=True)`` decode with a static cache (design/cpu-recipes.md §1.4).

``generate`` compiles the decode forward when the cache is static and the compile config allows the
device. The hooks must trace into one graph (no graph break, no recompile per step from Python state),
give the same tokens as eager OEA, and keep counting in their device tensors.

The backend is ``aot_eager``: Dynamo's full-graph capture plus AOT functionalisation of the in-place
counter updates, without inductor's C++ compile time (inductor gives the same result, ~70 s here).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch._dynamo.utils import counters  # noqa: E402

from oea.integrations.transformers import attach  # noqa: E402
from oea.routing import OEAConfig  # noqa: E402
from oea.testing import tiny_moe  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*attention mask.*")

BATCH, PROMPT, NEW = 6, 8, 8


def _generate(model: torch.nn.Module, prompt: torch.Tensor, compile_config=None) -> torch.Tensor:
    return model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
        pad_token_id=0, cache_implementation="static", compile_config=compile_config,
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fullgraph_compiled_decode_is_one_graph_with_eager_oea_tokens(family: str) -> None:
    model = tiny_moe(family, top_k=4)
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(11))
    config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # compile on CPU too (a testing switch of transformers' generate)
    with attach(model, OEAConfig(k0=1)) as handle:
        eager = _generate(model, prompt)
        eager_stats = handle.stats()
        handle.reset_stats()
        torch._dynamo.reset()
        counters.clear()
        compiled = _generate(model, prompt, config)
        compiled_stats = handle.stats()
        compiled_again = _generate(model, prompt, config)
        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
    assert graphs == 1, f"expected one decode graph, got {graphs}"
    assert breaks == 0
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled_again, eager)
    for index in (0, 1):
        assert compiled_stats[index]["steps"] == eager_stats[index]["steps"] == NEW - 1
        assert compiled_stats[index]["mean_active_experts"] == eager_stats[index]["mean_active_experts"]
        assert compiled_stats[index]["mean_active_experts"] < compiled_stats[index]["mean_active_experts_vanilla"]
    torch._dynamo.reset()
