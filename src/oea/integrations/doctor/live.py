"""``oea doctor --metrics-url http://HOST:PORT/metrics``: the ``--metrics-file`` verdicts from a running server's
``oea_*`` Prometheus series (``oea.integrations.prometheus``), read over HTTP.

The endpoint's text exposition format is parsed here (the standard library only: prometheus_client is not a
dependency of ``oea``); the counts go to the same judge as a metrics file (``doctor.judge``). Eligible decode
forwards are the decode forwards less those below the server's own ``OEA_MIN_BATCH`` (the ``min_batch`` label
of ``oea_enabled``); the active experts are means over every decode and verify forward (the series are sums).
An unreachable URL, or one that serves no ``oea_*`` series, is one failed check saying which.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections import defaultdict

from oea.integrations.doctor.common import Check, check
from oea.integrations.doctor.judge import Served, served_verdicts

TIMEOUT_S = 10.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
Sample = tuple[str, dict[str, str], float]


def parse_exposition(text: str) -> list[Sample]:
    """The samples of Prometheus's text exposition format: (name, labels, value); comments skipped."""
    samples = []
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if line.startswith("#") or found is None:
            continue
        name, labels, value = found.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples.append((name, dict(_LABEL.findall(labels or "")), number))
    return samples


def fetch(url: str, timeout: float = TIMEOUT_S) -> str:
    """The endpoint's text; ``ValueError`` saying why it could not be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as err:
        raise ValueError(f"--metrics-url {url}: the server answered HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        why = getattr(err, "reason", err)
        raise ValueError(f"--metrics-url {url}: unreachable ({why})") from None


def _sum(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(v for n, have, v in samples if n == name and all(have.get(k) == w for k, w in labels.items()))


def _by(samples: list[Sample], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for n, have, value in samples:
        if n == name and label in have:
            out[have[label]] += value
    return out


def served_from_samples(samples: list[Sample], url: str, min_batch: int | None = None) -> Served:
    """The ``Served`` counts of an endpoint's ``oea_*`` samples (``min_batch``: the doctor's, when the series do
    not carry the server's)."""
    phases = _by(samples, "oea_forwards_total", "phase")
    forwards = int(sum(phases.values()))
    decode, verify = int(phases.get("decode", 0)), int(phases.get("verify", 0))
    reasons = {r: int(v) for r, v in _by(samples, "oea_passthrough_forwards_total", "reason").items() if v}
    below = reasons.get("below_min_batch", 0)
    enabled = [have for n, have, v in samples if n == "oea_enabled" and v == 1]
    server_min_batch = {int(have["min_batch"]) for have in enabled if have.get("min_batch", "").isdigit()}
    counted = decode + verify
    layers = len(_by(samples, "oea_active_experts_total", "layer")) or 1
    active, stock = _sum(samples, "oea_active_experts_total"), _sum(samples, "oea_stock_active_experts_total")
    padded = _sum(samples, "oea_padding_rows_total")
    ranks = sorted(
        {int(have["rank"]) for n, have, _ in samples if n == "oea_forwards_total" and have.get("rank", "").isdigit()}
    )
    return Served(
        source=f"{url}: {forwards} forwards",
        forwards=forwards,
        decode=decode,
        ranks=ranks,
        eligible=decode - below,
        engaged=int(_sum(samples, "oea_rewritten_forwards_total")),
        min_batch=min(server_min_batch) if server_min_batch else (2 if min_batch is None else min_batch),
        active=f"{active / (counted * layers):.1f} (n={counted})" if counted else "-",
        stock=f"{stock / (counted * layers):.1f} (n={counted})" if counted and stock else "-",
        ratio=active / stock if stock else None,
        padding=f"{padded:.0f} rows in all" if padded else "-",
        reasons=reasons,
    )


def live_checks(url: str, min_batch: int | None = None) -> list[Check]:
    """The doctor's ``served`` block for a server's ``/metrics``: one failed check when it cannot be read or has
    no ``oea_*`` series, else the verdicts of ``doctor.judge``."""
    try:
        text = fetch(url)
    except ValueError as err:
        return [check("metrics endpoint", False, str(err))]
    samples = [s for s in parse_exposition(text) if s[0].startswith("oea_")]
    if not samples:
        return [
            check(
                "metrics endpoint",
                False,
                f"--metrics-url {url}: no oea_* series there (OEA_K0 unset on the "
                "server, SGLang without --enable-metrics, the wrong port, or a "
                "server that has not routed yet): docs/observability.md",
            )
        ]
    return served_verdicts(served_from_samples(samples, url, min_batch), "metrics endpoint")
