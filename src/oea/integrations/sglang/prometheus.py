"""The ``oea_*`` Prometheus series on SGLang's own ``/metrics`` (``--enable-metrics``; ``oea.integrations.prometheus``).

SGLang serves ``/metrics`` from its HTTP server with prometheus_client's ``MultiProcessCollector`` over
``PROMETHEUS_MULTIPROC_DIR`` (``sglang.srt.utils.common.add_prometheus_middleware``), which
``set_prometheus_multiproc_dir`` puts in the environment with ``--enable-metrics`` before the scheduler processes
start. A directory the user set is read as it is (SGLang makes a temporary subfolder in it but the collector reads
the variable's directory), so the scheduler's exporter writes into the variable's directory itself.

Only with ``OEA_K0`` set, ``OEA_PROMETHEUS`` not 0 and ``PROMETHEUS_MULTIPROC_DIR`` in the environment: a server
with OEA off, with ``OEA_PROMETHEUS=0``, or without ``--enable-metrics``, exports no ``oea_*`` series. The exporter
is made at a scheduler's first forward (``metrics.forward``), so the HTTP and detokenizer processes, which load the
plugin too, write nothing.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import oea.integrations.sglang.recording as recording
from oea.config import EnvSettings
from oea.integrations.prometheus import Exporter, doctor_off_line, make_exporter
from oea.integrations.runtime import process_rank
from oea.integrations.sglang.state import log, warn_once

DIRECTORY_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # set by SGLang with --enable-metrics (or by the user)


def export_directory(settings: EnvSettings | None) -> str | None:
    """The directory SGLang's ``/metrics`` aggregates, when the series are exported (None: export off: OEA off,
    ``OEA_PROMETHEUS=0``, or no ``--enable-metrics``)."""
    if settings is None or settings.oea is None or not settings.prometheus:
        return None
    return os.environ.get(DIRECTORY_VARIABLE) or None


def served_model_name() -> str:
    """SGLang's served model name (its own metrics' ``model_name``), "" when this SGLang does not say."""
    try:
        context = importlib.import_module("sglang.srt.runtime_context")
        return str(context.get_serving().served_model_name or "")
    except Exception as err:  # older SGLang: the name is in its global server args
        try:
            server_args = importlib.import_module("sglang.srt.server_args")
            return str(server_args.get_global_server_args().served_model_name or "")
        except Exception as again:
            warn_once("prometheus-model-name", f"SGLang's served model name cannot be read ({type(err).__name__}: "
                                               f"{err}; {type(again).__name__}: {again}); the oea_* series carry "
                                               'model_name=""')
            return ""


def start_export(settings: EnvSettings | None) -> Exporter | None:
    """At a scheduler's first forward with export on: its ``Exporter`` (labels ``engine="sglang"``, the served
    model name, the rank) with ``oea_enabled`` set; None when export is off or cannot start (one warning)."""
    directory = export_directory(settings)
    if directory is None:
        return None
    assert settings is not None and settings.oea is not None
    exporter = make_exporter("sglang", served_model_name(), directory, log, recorder=lambda: recording.TRACE.recorder)
    if exporter is None:
        return None
    exporter.set_enabled(process_rank(), settings.oea.k0, settings.oea.min_batch)
    log.info("oea: Prometheus series oea_* written to %s, served on SGLang's /metrics (--enable-metrics)", directory)
    return exporter


def doctor_line(env: dict[str, str] | None = None) -> tuple[bool, str]:
    """``oea doctor sglang``'s ``prometheus export`` line: (ok, whether the series reach SGLang's ``/metrics``)."""
    env = dict(os.environ) if env is None else env
    off = doctor_off_line(env)
    if off is not None:
        return off
    if env.get(DIRECTORY_VARIABLE):
        return True, (f"on SGLang's /metrics with --enable-metrics (the schedulers write into "
                      f"{DIRECTORY_VARIABLE}={env[DIRECTORY_VARIABLE]})")
    return True, ("on SGLang's /metrics once the server runs with --enable-metrics (it sets "
                  f"{DIRECTORY_VARIABLE} for its schedulers); without it no oea_* series are exported")


def layers_known(exporter: Exporter | None, layers: Any) -> None:
    """The MoE layers of the first forward that routed: their per-layer series at 0 (``Exporter.set_layers``)."""
    if exporter is not None:
        exporter.set_layers(process_rank(), sorted(int(layer) for layer in layers))
