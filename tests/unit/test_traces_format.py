"""Trace format: round trip, bundled traces, and errors that name the file and field."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from oea.routing import RouterSpec
from oea.traces import Trace, bundled_trace_dir, bundled_trace_names, load_trace, save_trace

torch.set_num_threads(1)


def _trace(tokens: int = 6, layers: int = 3, n: int = 16, k: int = 4, logits: bool = True) -> Trace:
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(tokens, layers, n, generator=g)
    ids = raw.topk(k, dim=-1).indices
    return Trace(
        spec=RouterSpec(n, k),
        logits=raw if logits else None,
        ids=None if logits else ids,
        scores=None if logits else raw.softmax(-1).gather(-1, ids),
        request_ids=torch.arange(tokens) % 2,
        positions=torch.arange(tokens) // 2,
        step_ids=torch.arange(tokens) // 2 + 7,
        meta={"name": "unit", "source": "test", "licence": "none", "notes": ["n"]},
    )


@pytest.mark.parametrize(("logits", "n"), [(True, 16), (False, 16), (False, 320)])  # 320: ids above 255
def test_round_trip_keeps_every_tensor_and_the_metadata(tmp_path: pathlib.Path, logits: bool, n: int) -> None:
    trace = _trace(logits=logits, n=n)
    path = save_trace(trace, tmp_path / "t.safetensors")
    back = load_trace(str(path))
    assert back.num_tokens == 6 and back.num_layers == 3
    assert back.spec.num_experts == n and back.spec.top_k == 4
    for name in ("logits", "ids", "scores", "request_ids", "positions", "step_ids"):
        a, b = getattr(trace, name), getattr(back, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b.to(a.dtype), a, msg=name)
    assert back.meta["source"] == "test" and back.meta["notes"] == ["n"]


def test_correction_bias_round_trips_per_layer(tmp_path: pathlib.Path) -> None:
    trace = _trace()
    trace.spec = RouterSpec(16, 4, scoring="sigmoid")
    trace.correction_bias = torch.randn(3, 16)
    back = load_trace(str(save_trace(trace, tmp_path / "b.safetensors")))
    torch.testing.assert_close(back.layer_spec(2).correction_bias, trace.correction_bias[2])


def test_metadata_disagreeing_with_the_tensors_names_file_and_field(tmp_path: pathlib.Path) -> None:
    path = save_trace(_trace(), tmp_path / "bad.safetensors")
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta["num_tokens"] = 7
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"bad\.json.*'num_tokens'"):
        load_trace(str(path))
    meta["num_tokens"] = 6
    meta["spec"]["num_experts"] = 32
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*'logits'.*N=32"):
        load_trace(str(path))


def test_ids_shape_disagreeing_with_top_k_names_the_field(tmp_path: pathlib.Path) -> None:
    path = save_trace(_trace(logits=False), tmp_path / "ids.safetensors")
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta["spec"]["top_k"] = 5
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"ids\.safetensors.*'ids'.*k=5"):
        load_trace(str(path))


def test_unknown_trace_name_lists_the_bundled_names() -> None:
    with pytest.raises(ValueError, match=r"qwen3-30b-a3b.*got 'no-such-trace'"):
        load_trace("no-such-trace")


def test_missing_sidecar_is_reported(tmp_path: pathlib.Path) -> None:
    path = save_trace(_trace(), tmp_path / "x.safetensors")
    path.with_suffix(".json").unlink()
    with pytest.raises(FileNotFoundError, match=r"x\.json"):
        load_trace(str(path))


def test_bundled_traces_load_with_attribution() -> None:
    names = bundled_trace_names()
    assert {"qwen3-30b-a3b", "flame-moe-290m"} <= set(names)
    for name in names:
        trace = load_trace(name)
        assert trace.meta["source"] and trace.meta["licence"], name
        assert trace.ids is not None or trace.logits is not None
    total = sum(p.stat().st_size for p in bundled_trace_dir().iterdir())
    assert total < 8e6, f"bundled data is {total / 1e6:.1f} MB"


def test_bundled_qwen3_trace_shape_and_rows() -> None:
    trace = load_trace("qwen3-30b-a3b")
    assert trace.ids is not None and tuple(trace.ids.shape) == (4130, 48, 8)
    ids = trace.ids.numpy()
    assert ids.min() >= 0 and ids.max() <= 127
    distinct = np.sort(ids, axis=-1)
    assert (np.diff(distinct, axis=-1) > 0).all(), "every row holds 8 distinct experts"
    assert trace.request_ids is None and trace.scores is None


def test_bundled_flame_trace_has_descending_scores_and_lockstep_structure() -> None:
    trace = load_trace("flame-moe-290m")
    assert trace.scores is not None and trace.request_ids is not None and trace.positions is not None
    assert (trace.scores[..., :-1] >= trace.scores[..., 1:]).all()
    assert tuple(trace.ids.shape) == (640, 8, 6)
    for position in range(10):
        assert sorted(trace.request_ids[trace.positions == position].tolist()) == list(range(64))


_RAW = "data/qwen3-30b-a3b-vllm-sharegpt-prefill"
# shared/ lies beside the repository (CI's layout) or at /work/shared (developers' machines)
RAW_QWEN3 = next((p for p in (pathlib.Path(__file__).resolve().parents[3] / "shared" / _RAW,
                              pathlib.Path("/work/shared") / _RAW) if p.is_dir()), pathlib.Path(_RAW))


@pytest.mark.skipif(not RAW_QWEN3.is_dir(), reason="raw Qwen3 trace data not on this machine")
def test_bundled_qwen3_equals_a_fresh_conversion_of_the_raw_files() -> None:
    import gzip

    passes = []
    for name in ("token_distri_8.jsonl.gz", "token_distri_16.jsonl.gz"):
        with gzip.open(RAW_QWEN3 / name, "rt") as fh:
            rows = [json.loads(line) for line in fh]
        big = [r["topk_ids"] for r in rows if r["topk_weights"][0] > 1000]
        passes.append(np.array(big).transpose(1, 0, 2))
    raw = np.concatenate(passes)
    assert (load_trace("qwen3-30b-a3b").ids.numpy() == raw).all()


def test_bundled_embedded_trace_is_a_lockstep_decode_with_full_logits() -> None:
    if "embedded" not in bundled_trace_names():
        pytest.skip("the embedded trace has not been captured into the package yet")
    trace = load_trace("embedded")
    assert trace.logits is not None and trace.spec.num_experts == 128 and trace.spec.top_k == 8
    assert trace.request_ids is not None and trace.positions is not None
    requests = int(trace.request_ids.max()) + 1
    for position in torch.unique(trace.positions):
        assert sorted(trace.request_ids[trace.positions == position].tolist()) == list(range(requests))
    assert trace.meta["checkpoint_sha256"]
