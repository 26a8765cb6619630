"""``oea.attach`` on tiny random transformers MoE models of every supported family (CPU, no download)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import oea  # noqa: E402
from oea.integrations.transformers import OEAHandle, attach, find_moe_layers  # noqa: E402
from oea.routing import OEAConfig, PrunedConfig  # noqa: E402
from oea.testing import TINY_FAMILIES, tiny_moe  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*attention mask.*")

TOP_K = 4
BATCH, PROMPT, NEW = 6, 8, 6
FAMILIES = [f for f in TINY_FAMILIES if f != "glm_moe_dsa" or hasattr(transformers, "GlmMoeDsaConfig")]


@dataclass
class Tiny:
    family: str
    model: torch.nn.Module
    prompt: torch.Tensor  # [BATCH, PROMPT]
    tokens: torch.Tensor  # [BATCH, PROMPT + NEW] greedy tokens without OEA
    prefill_logits: torch.Tensor  # [BATCH, PROMPT, vocab]


def _generate(model: torch.nn.Module, prompt: torch.Tensor, new: int = NEW) -> torch.Tensor:
    mask = torch.ones_like(prompt)
    return model.generate(prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest) -> Tiny:
    model = tiny_moe(request.param, top_k=TOP_K)
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(prompt).logits
    return Tiny(request.param, model, prompt, _generate(model, prompt), logits)


def _hook_counts(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class _RouterRecorder:
    """Records every router output (after OEA's hook: it is registered later) during decode steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.own_top1: list[torch.Tensor] = []  # per call: [rows] the router's own first choice
        self.handles = [layer.router.register_forward_hook(self._make(layer.name, layer.spec))
                        for layer in find_moe_layers(model)]

    def _make(self, name: str, spec: oea.RouterSpec):
        def hook(module, args, output):
            if args[0].dim() == 3 and args[0].shape[1] != 1:  # DeepSeek-style gates see [B, S, H]
                return
            if args[0].dim() == 2 and args[0].shape[0] != BATCH:  # flattening gates see [B*S, H]
                return
            self.calls.append((name, output[2].detach().clone(), output[1].detach().float().clone()))
            with torch.no_grad():  # the model's own router on the same input (.forward skips every hook)
                logits, _, own_ids = module.forward(*args)
                score = logits.reshape(own_ids.shape[0], -1).float()  # selection score: logits or biased sigmoid
                if spec.scoring == "sigmoid":
                    score = score.sigmoid() + (0 if spec.correction_bias is None else spec.correction_bias.float())
                best = score.gather(1, own_ids).argmax(dim=1, keepdim=True)  # some routers return top-k unsorted
                self.own_top1.append(own_ids.gather(1, best).squeeze(1))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def test_every_family_has_moe_layers_with_the_right_spec(tiny: Tiny) -> None:
    layers = find_moe_layers(tiny.model)
    assert [layer.index for layer in layers] == [0, 1]
    for layer in layers:
        assert layer.spec.top_k == TOP_K and layer.spec.num_experts == 16
        assert layer.spec.renormalize is (tiny.family != "olmoe")
        if tiny.family in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
            assert layer.spec.scoring == "sigmoid" and layer.spec.routed_scaling_factor == 2.5
            assert bool(layer.spec.correction_bias.abs().sum() > 0)
        if tiny.family == "deepseek_v3":
            assert (layer.spec.n_group, layer.spec.topk_group) == (4, 2)


def test_k0_equals_k_is_identical(tiny: Tiny) -> None:
    """Same greedy tokens, and the same router outputs (as sets, weights within tolerance) in every decode call."""
    recorder = _RouterRecorder(tiny.model)
    try:
        baseline = _generate(tiny.model, tiny.prompt)
        vanilla_calls, recorder.calls = recorder.calls, []
        with attach(tiny.model, OEAConfig(k0=TOP_K)) as handle:
            assert handle.rerouted_layers == [0, 1]
            # the recorder was registered first, so re-register it after OEA's hooks to see their output
            recorder.remove()
            recorder = _RouterRecorder(tiny.model)
            tokens = _generate(tiny.model, tiny.prompt)
        oea_calls = recorder.calls
    finally:
        recorder.remove()
    assert torch.equal(baseline, tiny.tokens)
    assert torch.equal(tokens, tiny.tokens)
    assert len(oea_calls) == len(vanilla_calls) == 2 * (NEW - 1)
    for (name_a, ids_a, w_a), (name_b, ids_b, w_b) in zip(vanilla_calls, oea_calls, strict=True):
        assert name_a == name_b
        sorted_a, order_a = ids_a.sort(-1)
        sorted_b, order_b = ids_b.sort(-1)
        assert torch.equal(sorted_a, sorted_b)
        torch.testing.assert_close(w_a.gather(1, order_a), w_b.gather(1, order_b), atol=1e-6, rtol=1e-5)
    stats = handle.stats()
    for index in (0, 1):
        assert stats[index]["steps"] == NEW - 1
        assert stats[index]["mean_active_experts"] == stats[index]["mean_active_experts_vanilla"]
        assert stats[index]["mean_experts_per_token"] == TOP_K


def test_k0_below_k_reduces_active_experts_in_every_layer_and_leaves_prefill_alone(tiny: Tiny) -> None:
    with attach(tiny.model, OEAConfig(k0=1)) as handle:
        with torch.no_grad():
            prefill = tiny.model(tiny.prompt).logits
            decode_step = tiny.model(tiny.prompt[:, :1]).logits  # S = 1: a decode-shaped forward
        assert handle.stats()[0]["steps"] == 1
        handle.reset_stats()
        recorder = _RouterRecorder(tiny.model)  # registered after OEA's hooks: sees the rewritten routing
        try:
            tokens = _generate(tiny.model, tiny.prompt)
        finally:
            recorder.remove()
        stats = handle.stats()
        last = handle.last_active_experts()
    assert len(recorder.calls) == 2 * (NEW - 1)
    for (_, ids, weights), own_top1 in zip(recorder.calls, recorder.own_top1, strict=True):
        assert ids.dtype == torch.int64 and ids.shape == (BATCH, TOP_K)
        assert bool(((ids >= 0) & (ids < 16)).all()), "filler must never be an out-of-range id"
        real = weights != 0
        assert torch.equal(ids[:, 0], own_top1) and bool(real[:, 0].all()), "each row keeps its own top-1"
        for row_ids, row_real in zip(ids, real, strict=True):  # non-zero-weight experts are distinct
            assert len(set(row_ids[row_real].tolist())) == int(row_real.sum())
            assert set(row_ids[~row_real].tolist()) <= set(row_ids[row_real].tolist())  # zero-weight copies
    assert torch.equal(prefill, tiny.prefill_logits), "prefill must be untouched"
    assert torch.equal(tokens[:, : PROMPT + 1], tiny.tokens[:, : PROMPT + 1]), "first token comes from prefill"
    with torch.no_grad():
        vanilla_step = tiny.model(tiny.prompt[:, :1]).logits
    assert not torch.equal(decode_step, vanilla_step), "a decode step must be rerouted"
    assert sorted(stats) == [0, 1]
    for index, layer in stats.items():
        assert layer["rerouted"] and layer["k0"] == 1 and layer["k"] == TOP_K
        assert layer["steps"] == NEW - 1 and layer["tokens"] == BATCH * (NEW - 1)
        assert layer["mean_active_experts"] < layer["mean_active_experts_vanilla"]
        assert layer["mean_active_experts"] <= BATCH  # at most one baseline expert per row
        assert 1 <= layer["mean_experts_per_token"] <= TOP_K
        assert 1 <= last[index] <= BATCH


def test_remove_restores_the_model_exactly(tiny: Tiny) -> None:
    hooks_before = _hook_counts(tiny.model)
    state_before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    handle = attach(tiny.model, OEAConfig(k0=1))
    assert _hook_counts(tiny.model) > hooks_before
    handle.remove()
    handle.remove()  # idempotent
    assert _hook_counts(tiny.model) == hooks_before
    state_after = tiny.model.state_dict()
    assert state_after.keys() == state_before.keys()
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())
    assert torch.equal(_generate(tiny.model, tiny.prompt), tiny.tokens)


def test_disabled_handle_passes_through_and_still_counts(tiny: Tiny) -> None:
    with attach(tiny.model, OEAConfig(k0=1)) as handle:
        handle.enabled = False
        tokens = _generate(tiny.model, tiny.prompt)
        stats = handle.stats()
    assert torch.equal(tokens, tiny.tokens)
    assert stats[0]["steps"] == NEW - 1
    assert stats[0]["mean_active_experts"] == stats[0]["mean_active_experts_vanilla"]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_layer_configs_override_per_layer(family: str) -> None:
    model = tiny_moe(family, top_k=TOP_K)
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))
    with attach(model, OEAConfig(k0=1), layer_configs={1: None}) as handle:
        assert handle.rerouted_layers == [0]
        _generate(model, prompt)
        stats = handle.stats()
    assert stats[0]["rerouted"] and stats[0]["mean_active_experts"] < stats[0]["mean_active_experts_vanilla"]
    assert not stats[1]["rerouted"] and stats[1]["k0"] is None
    assert stats[1]["mean_active_experts"] == stats[1]["mean_active_experts_vanilla"]
    with attach(model, None, layer_configs={0: OEAConfig(k0=2), 1: PrunedConfig(k0=1)}) as handle:
        _generate(model, prompt)
        stats = handle.stats()
    assert stats[0]["k0"] == 2 and stats[1]["k0"] == 1
    assert (stats[0]["policy"], stats[1]["policy"]) == ("OEAConfig", "PrunedConfig")
    assert stats[1]["mean_experts_per_token"] == 1.0  # pruned: one real expert per token


def test_vanilla_config_counts_decode_steps_only() -> None:
    model = tiny_moe("mixtral", top_k=2)
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(4))
    with attach(model, None) as handle:
        assert handle.rerouted_layers == []
        with torch.no_grad():
            model(prompt)
        assert handle.stats()[0]["steps"] == 0
        _generate(model, prompt, new=4)
        stats = handle.stats()
    assert stats[0]["steps"] == 3 and stats[0]["mean_experts_per_token"] == 2
    assert stats[0]["mean_active_experts"] == stats[0]["mean_active_experts_vanilla"] > 2


def test_min_batch_keeps_small_batches_vanilla() -> None:
    model = tiny_moe("qwen3_moe", top_k=TOP_K)
    prompt = torch.randint(1, 256, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    baseline = _generate(model, prompt)
    with attach(model, OEAConfig(k0=1, min_batch=2)) as handle:
        assert torch.equal(_generate(model, prompt), baseline)
        stats = handle.stats()
    assert stats[0]["mean_experts_per_token"] == TOP_K


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_below_min_batch_decode_steps_are_the_models_own_bit_for_bit(family: str) -> None:
    """Rows below min_batch keep the router's own output, not a recomputation with other weight rounding: the
    per-token losses of oea eval's lock-step decode equal vanilla's exactly (its "identical" verdict)."""
    from oea.eval.decode import DecodeCounts, lockstep_cross_entropy

    model = tiny_moe(family, top_k=TOP_K)
    ids = torch.randint(1, 256, (1, PROMPT + NEW), generator=torch.Generator().manual_seed(7))
    with attach(model, None) as vanilla:
        want = lockstep_cross_entropy(model, ids, PROMPT, vanilla, DecodeCounts())
    counts = DecodeCounts()
    with attach(model, OEAConfig(k0=1, min_batch=2)) as handle:
        got = lockstep_cross_entropy(model, ids, PROMPT, handle, counts)
    assert torch.equal(got, want)
    assert counts.mean_experts_per_token == TOP_K and counts.layer_steps > 0


def test_decode_only_false_reroutes_prefill_too() -> None:
    model = tiny_moe("qwen3_moe", top_k=TOP_K)
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        baseline = model(prompt).logits
        with attach(model, OEAConfig(k0=1), decode_only=False) as handle:
            changed = model(prompt).logits
    assert not torch.equal(baseline, changed)
    assert handle.stats()[0]["steps"] == 0  # stats are over decode steps only


def test_a_layer_that_fails_validation_is_left_alone_with_a_warning() -> None:
    model = tiny_moe("qwen3_moe", top_k=TOP_K)
    router = model.model.layers[1].mlp.gate
    original = router.forward

    def scaled(hidden_states):  # a router whose weights OEA's recomputation cannot reproduce
        logits, weights, ids = original(hidden_states)
        return logits, weights * 0.5, ids

    router.forward = scaled
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(8))
    with pytest.warns(RuntimeWarning, match=r"layer 1 \(model\.layers\.1\.mlp"):
        handle = attach(model, OEAConfig(k0=1))
    with handle:
        assert handle.rerouted_layers == [0]
        _generate(model, prompt)
        stats = handle.stats()
    assert not stats[1]["rerouted"] and stats[1]["steps"] == NEW - 1
    assert stats[1]["mean_active_experts"] == stats[1]["mean_active_experts_vanilla"]
    del router.forward


def test_errors_are_clear() -> None:
    model = tiny_moe("qwen3_moe", top_k=TOP_K)
    with pytest.raises(ValueError, match=r"no MoE blocks found.*'gate' or 'router'.*'experts'"):
        attach(torch.nn.Sequential(torch.nn.Linear(4, 4)), OEAConfig(k0=1))
    with pytest.raises(ValueError, match=r"MoE layer 0 .*k0 must be in 1..top_k"):
        attach(model, OEAConfig(k0=TOP_K + 1))
    with pytest.raises(ValueError, match=r"layer_configs has unknown MoE layer indices \[7\]"):
        attach(model, OEAConfig(k0=1), layer_configs={7: OEAConfig(k0=1)})
    with pytest.raises(ValueError, match="cfg must be None or one of"):
        attach(model, "oea")  # type: ignore[arg-type]
    assert _hook_counts(model) == 0
    with pytest.raises(ValueError, match="decode_only must be a bool"):
        attach(model, OEAConfig(k0=1), decode_only="yes")  # type: ignore[arg-type]
    with attach(model, OEAConfig(k0=1)) as handle:
        with pytest.raises(ValueError, match="already attached"):
            attach(model, OEAConfig(k0=2))
        with pytest.raises(ValueError, match="enabled must be a bool"):
            handle.enabled = 1  # type: ignore[assignment]
    attach(model, OEAConfig(k0=2)).remove()  # fine again once removed


def test_unsupported_router_in_a_model_is_named() -> None:
    class OddRouter(torch.nn.Module):
        def forward(self, x):
            return x

    block = torch.nn.Module()
    block.gate, block.experts = OddRouter(), torch.nn.Identity()
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([block])})
    with pytest.raises(ValueError, match=r"MoE block 'layers.0': unsupported router class OddRouter"):
        attach(model, OEAConfig(k0=1))


def test_lazy_export_from_oea_package() -> None:
    assert oea.attach is attach
    assert callable(oea.maybe_attach)
    assert isinstance(attach(tiny_moe("olmoe"), None), OEAHandle)


# -- transformers 5.0-5.10 DeepSeek/GLM blocks: the gate returns logits, the block routes ---------------


class DeepseekV3TopkRouter(torch.nn.Module):
    """The 5.0-5.10 gate: logits only; routing attributes live on the block."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("e_score_correction_bias", 0.1 * torch.randn(experts))

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, self.weight.shape[1])
        return torch.nn.functional.linear(x.float(), self.weight.float())


class _Experts(torch.nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden**0.5)

    def forward(self, x, ids, weights):
        return torch.einsum("mk,mkho,mh->mo", weights, self.proj[ids], x)


class LegacyDeepseekV3MoE(torch.nn.Module):
    def __init__(self, hidden: int = 32, experts: int = 16) -> None:
        super().__init__()
        self.gate, self.experts = DeepseekV3TopkRouter(hidden, experts), _Experts(hidden, experts)
        self.top_k, self.n_routed_experts, self.n_group, self.topk_group = 4, experts, 4, 2
        self.norm_topk_prob, self.routed_scaling_factor = True, 2.5

    def route_tokens_to_experts(self, router_logits):
        scores = router_logits.sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        groups = choice.view(-1, self.n_group, self.n_routed_experts // self.n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(self.topk_group, dim=-1)[1], 1)
        mask = keep.unsqueeze(-1).expand(-1, self.n_group, self.n_routed_experts // self.n_group).reshape(
            -1, self.n_routed_experts)
        ids = choice.masked_fill(~mask.bool(), float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        return ids, weights

    def forward(self, hidden_states):
        shape = hidden_states.shape
        ids, weights = self.route_tokens_to_experts(self.gate(hidden_states))
        return self.experts(hidden_states.reshape(-1, shape[-1]), ids, weights).view(shape)


def test_legacy_route_tokens_to_experts_blocks_are_hooked_and_restored() -> None:
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([LegacyDeepseekV3MoE(), LegacyDeepseekV3MoE()])})
    (layer, _) = find_moe_layers(model)
    assert layer.legacy and layer.spec.n_group == 4 and layer.spec.routed_scaling_factor == 2.5
    x = torch.randn(8, 1, 32, generator=torch.Generator().manual_seed(1))
    prefill = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    block = model["layers"][0]
    with torch.no_grad():
        base, base_prefill = block(x), block(prefill)
        with attach(model, OEAConfig(k0=4)) as handle:
            assert handle.rerouted_layers == [0, 1]
            torch.testing.assert_close(block(x), base)
        with attach(model, OEAConfig(k0=1)) as handle:
            assert torch.equal(block(prefill), base_prefill)
            assert not torch.allclose(block(x), base)
            stats = handle.stats()[0]
    assert stats["steps"] == 1 and stats["mean_active_experts"] < stats["mean_active_experts_vanilla"]
    assert "route_tokens_to_experts" not in block.__dict__
    assert torch.equal(block(x), base)


def test_model_cast_after_attach_follows_the_bias_buffer() -> None:
    """``model.to(dtype)`` replaces the correction-bias buffer; the hook must use the live one."""
    model = tiny_moe("deepseek_v3", top_k=TOP_K)
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(9))
    cfg = OEAConfig(k0=TOP_K - 1)  # k0 = top_k would hand the router's own routing back without rerouting
    with attach(model, cfg) as handle:
        model.to(torch.bfloat16)
        tokens = _generate(model, prompt)
        spec = handle._hooks[0].spec
        assert spec.correction_bias is model.model.layers[0].mlp.gate.e_score_correction_bias
        assert spec.correction_bias.dtype == torch.bfloat16
    with attach(model, cfg):  # attached after the cast: built from the bf16 buffer from the start
        assert torch.equal(tokens, _generate(model, prompt))


def test_an_error_during_attach_leaves_no_hooks_behind() -> None:
    model = tiny_moe("qwen3_moe", top_k=TOP_K)
    router = model.model.layers[1].mlp.gate

    def broken(hidden_states):
        raise RuntimeError("router exploded")

    router.forward = broken
    with pytest.raises(RuntimeError, match="router exploded"):
        attach(model, OEAConfig(k0=1))
    del router.forward
    assert _hook_counts(model) == 0
    attach(model, OEAConfig(k0=1)).remove()  # and the model is not marked as attached


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_every_experts_implementation_takes_the_rerouted_ids(implementation: str) -> None:
    """Zero-weight fillers are valid ids for every kernel (``batched_mm`` raises on a sentinel id)."""
    model = tiny_moe("qwen3_moe", top_k=TOP_K, experts_implementation=implementation)
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(10))
    baseline = _generate(model, prompt)
    with attach(model, OEAConfig(k0=TOP_K)):
        assert torch.equal(_generate(model, prompt), baseline)
    with attach(model, OEAConfig(k0=1)) as handle:
        tokens = _generate(model, prompt)
        stats = handle.stats()[0]
    assert torch.equal(tokens[:, : PROMPT + 1], baseline[:, : PROMPT + 1])
    assert stats["mean_active_experts"] < stats["mean_active_experts_vanilla"]


def test_a_dropped_model_with_hooks_still_attached_is_garbage_collected() -> None:
    import gc
    import weakref

    model = tiny_moe("olmoe")
    handle = attach(model, OEAConfig(k0=1))
    model_ref, handle_ref = weakref.ref(model), weakref.ref(handle)
    del model, handle
    gc.collect()
    assert model_ref() is None and handle_ref() is None
