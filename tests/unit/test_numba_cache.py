"""The numba kernel is compiled once per machine, not once per process: a second process loads numba's
on-disk cache (numba's own per-dispatcher statistics say so; no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

# One routing call of each kernel (float32 and bf16 logits), then numba's cache statistics of both.
PROBE = """
import json, torch, oea
from oea.kernels import numba_kernels, route_fast
logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
spec = oea.RouterSpec(64, 8)
ids = route_fast(logits, spec, oea.OEAConfig(2), impl="numba")[0]
assert torch.equal(ids, oea.route(logits, spec, oea.OEAConfig(2))[0])
route_fast(logits.bfloat16(), spec, oea.OEAConfig(2), impl="numba")
stats = {name: getattr(numba_kernels, name).stats for name in ("route_scores", "route_bf16")}
print(json.dumps({name: [sum(s.cache_hits.values()), sum(s.cache_misses.values())] for name, s in stats.items()}))
"""


def _probe(cache_dir: str) -> dict[str, list[int]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_kernels_from_numbas_cache(tmp_path) -> None:
    first = _probe(str(tmp_path))
    assert all(hits == 0 and misses >= 1 for hits, misses in first.values()), first  # an empty cache: compiled
    assert any(path.suffix == ".nbc" for path in tmp_path.rglob("*")), "numba wrote no cache file"
    second = _probe(str(tmp_path))
    assert all(hits >= 1 and misses == 0 for hits, misses in second.values()), second  # loaded, nothing compiled
