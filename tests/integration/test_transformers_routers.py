"""Agreement of ``oea.route`` with transformers' own router modules (core issue requirement).

Every router class ``oea.integrations.transformers`` claims to support is instantiated from a
minimal config, given random weights (and a non-zero random ``e_score_correction_bias``), and called
directly on random hidden states. At k0 = k, ``oea.route`` on the router's logits, and the attach
hook's own recomputation from the router input, must reproduce the router's ids (as sets) and
weights.
"""

from __future__ import annotations

import importlib
import pathlib
import types
from functools import cache

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oea.integrations.transformers import (  # noqa: E402
    GROUPED_SIGMOID_ROUTERS,
    SOFTMAX_NORM_TOPK_ROUTERS,
    SOFTMAX_RENORM_ROUTERS,
    SUPPORTED_ROUTERS,
    MoELayer,
    find_moe_layers,
    spec_from_router,
)
from oea.integrations.transformers.routing import _HandleState, _LayerHook  # noqa: E402
from oea.routing import OEAConfig, route  # noqa: E402

torch.set_num_threads(1)

HIDDEN = 64
ROWS = 32


@cache
def _router_modules() -> dict[str, str]:
    """Router class name -> the transformers module that defines it (found by reading the sources)."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    found: dict[str, str] = {}
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        for name in SUPPORTED_ROUTERS:
            if name not in found and f"class {name}(" in text:
                found[name] = f"transformers.models.{path.parent.name}.{path.stem}"
    return found


def _router_class(name: str) -> type:
    module = _router_modules().get(name)
    if module is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return getattr(importlib.import_module(module), name)


def _make_router(name: str, *, num_experts: int = 16, top_k: int = 4, norm: bool = True, n_group: int = 4,
                 topk_group: int = 2, scale: float = 2.5, dtype: torch.dtype = torch.float32, seed: int = 0):
    config = types.SimpleNamespace(
        hidden_size=HIDDEN, num_experts=num_experts, num_local_experts=num_experts,
        n_routed_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm,
        routed_scaling_factor=scale, n_group=n_group, topk_group=topk_group,
    )
    router = _router_class(name)(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * 0.3)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.1)
    return router.to(dtype) if name not in GROUPED_SIGMOID_ROUTERS else router


def _assert_same_routing(own_ids, own_weights, ids, weights, atol: float) -> None:
    assert ids.dtype == torch.int64 and ids.shape == own_ids.shape
    own_sorted, own_order = own_ids.sort(dim=-1)
    new_sorted, new_order = ids.sort(dim=-1)
    assert torch.equal(own_sorted, new_sorted), "expert sets differ"
    torch.testing.assert_close(
        weights.gather(1, new_order).float(), own_weights.gather(1, own_order).float(), atol=atol, rtol=atol
    )


def _hidden(dtype: torch.dtype, seed: int = 1, shape: tuple[int, ...] = (ROWS, HIDDEN)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_every_supported_router_class_exists_in_this_transformers() -> None:
    present = set(_router_modules())
    core = {"Qwen3MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter", "DeepseekV3TopkRouter",
            "Glm4MoeTopkRouter"}
    assert core <= present, f"missing: {sorted(core - present)}"


@pytest.mark.parametrize("name", sorted(SOFTMAX_NORM_TOPK_ROUTERS | SOFTMAX_RENORM_ROUTERS))
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_routers_agree_at_k0_equals_k(name: str, norm: bool, dtype: torch.dtype) -> None:
    router = _make_router(name, norm=norm, dtype=dtype)
    spec = spec_from_router(router)
    assert spec.scoring == "softmax"
    assert spec.renormalize is (norm or name in SOFTMAX_RENORM_ROUTERS)
    x = _hidden(dtype)
    with torch.no_grad():
        logits, own_weights, own_ids = router(x)[:3]
        atol = 1e-6 if dtype == torch.float32 else 1e-2
        for cfg in (None, OEAConfig(k0=spec.top_k, min_batch=0)):
            ids, weights = route(logits, spec, cfg)
            _assert_same_routing(own_ids, own_weights, ids, weights, atol)


@pytest.mark.parametrize("name", sorted(GROUPED_SIGMOID_ROUTERS))
@pytest.mark.parametrize(
    ("num_experts", "top_k", "n_group", "topk_group", "norm"),
    [(16, 4, 4, 2, True), (16, 4, 1, 1, True), (32, 8, 8, 4, True), (16, 4, 4, 2, False)],
)
def test_grouped_sigmoid_routers_agree_at_k0_equals_k(
    name: str, num_experts: int, top_k: int, n_group: int, topk_group: int, norm: bool
) -> None:
    router = _make_router(name, num_experts=num_experts, top_k=top_k, norm=norm, n_group=n_group,
                          topk_group=topk_group)
    spec = spec_from_router(router)
    assert (spec.scoring, spec.n_group, spec.topk_group, spec.renormalize) == ("sigmoid", n_group, topk_group, norm)
    assert spec.routed_scaling_factor == 2.5
    assert spec.correction_bias is not None and bool(spec.correction_bias.abs().sum() > 0)
    x = _hidden(torch.float32)
    with torch.no_grad():
        logits, own_weights, own_ids = router(x)[:3]
        for cfg in (None, OEAConfig(k0=top_k, min_batch=0)):
            ids, weights = route(logits, spec, cfg)
            _assert_same_routing(own_ids, own_weights, ids, weights, 1e-6)


def test_bias_changes_the_selection_so_agreement_is_not_trivial() -> None:
    """Dropping the correction bias must change some picks, or the agreement above proves little."""
    router = _make_router("DeepseekV3TopkRouter")
    with torch.no_grad():
        router.e_score_correction_bias.mul_(10)
        logits, _, own_ids = router(_hidden(torch.float32))[:3]
    spec = spec_from_router(router)
    unbiased = type(spec)(spec.num_experts, spec.top_k, "sigmoid", True, None, spec.n_group, spec.topk_group, 2.5)
    ids, _ = route(logits, unbiased)
    assert not torch.equal(ids.sort(-1).values, own_ids.sort(-1).values)


@pytest.mark.parametrize("name", ["Qwen3MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter",
                                  "DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "GlmMoeDsaTopkRouter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attach_hook_recomputation_reproduces_the_router(name: str, dtype: torch.dtype) -> None:
    """The hook recomputes logits from the router *input*; at k0 = k it must return the router's routing."""
    router = _make_router(name, norm=name != "OlmoeTopKRouter", dtype=dtype)
    block = torch.nn.Module()
    block.gate, block.experts = router, torch.nn.Identity()
    layer = MoELayer(0, "block", block, router, "gate", spec_from_router(router, block))
    hook = _LayerHook(layer, OEAConfig(k0=layer.spec.top_k), _HandleState(decode_only=True))
    assert hook.validate() is None
    hook.validated = True
    hook.keeps_own = False  # exercise the recomputation (at k0 = k attach hands the router's output back)
    x = _hidden(dtype, shape=(ROWS // 4, 4, HIDDEN))  # the [B, S, H] input DeepSeek-style gates receive
    with torch.no_grad():
        own = router(x)
        hook.decode = True
        rewritten = hook.router_hook(router, (x,), {}, own)
    assert rewritten[0] is own[0], "router logits must pass through untouched"
    assert rewritten[1].dtype == own[1].dtype and rewritten[2].dtype == torch.int64
    _assert_same_routing(own[2], own[1], rewritten[2], rewritten[1], 1e-6 if dtype == torch.float32 else 1e-2)


def test_unsupported_router_class_is_named() -> None:
    class GptLikeRouter(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="GptLikeRouter"):
        spec_from_router(GptLikeRouter())


@pytest.mark.parametrize("name", sorted(GROUPED_SIGMOID_ROUTERS))
def test_groups_without_topk_group_are_named_at_load(name: str) -> None:
    """A config with n_group but no topk_group: a clear error naming the field, or no limit for one group."""
    router = _make_router(name, n_group=4, topk_group=None)
    with pytest.raises(ValueError, match=f"router {name} has n_group=4 but topk_group=None"):
        spec_from_router(router)
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.gate, model.mlp.experts = router, torch.nn.Module()
    with pytest.raises(ValueError, match=r"MoE block 'mlp': .*topk_group"):
        find_moe_layers(model)
    spec = spec_from_router(_make_router(name, n_group=1, topk_group=None))
    assert spec.n_group is None and spec.topk_group is None and not spec.grouped

