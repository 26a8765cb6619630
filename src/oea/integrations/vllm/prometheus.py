"""The ``oea_*`` Prometheus series on vLLM's own ``/metrics`` (``oea.integrations.prometheus``).

The series are made in the worker (engine core) process, where the steps run; vLLM's ``/metrics`` is served by
the API server process. How they meet:

* ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it itself with ``--api-server-count > 1``; a user may set it): the
  worker writes into that directory, which vLLM's registry (``get_prometheus_registry``) already aggregates;
* otherwise (one API server, vLLM's default): the process that loads the plugin first (the API server, before
  it starts the engine core) picks a directory of OEA's own, hands its name to the processes it starts through
  ``DIRECTORY_VARIABLE``, and registers prometheus_client's ``MultiProcessCollector`` for that directory on the
  default registry, which is the one vLLM's ``/metrics`` serves in that configuration.

A configuration where the API server is not the process that started the workers (``--headless`` engines, a
front end on another machine) cannot carry them: ``OEA_PROMETHEUS_PORT`` then serves them from the rank-0
worker (``serve_port``). ``oea doctor vllm``'s ``prometheus export`` line says which of the two is live.
Only with ``OEA_K0`` set and ``OEA_PROMETHEUS`` not 0: a server with OEA off or ``OEA_PROMETHEUS=0`` exports no
``oea_*`` series.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import uuid
from typing import Any

from oea.config import EnvSettings
from oea.integrations.prometheus import PORT_VARIABLE, Exporter, doctor_off_line, make_exporter, parse_port, serve_port
from oea.integrations.runtime import process_rank
from oea.integrations.vllm.state import STATE, log

DIRECTORY_VARIABLE = "PROMETHEUS_OEA_MULTIPROC_DIR"  # not OEA_*: set by the plugin, never by a user
VLLM_DIRECTORY_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


def prepare_api_server(settings: EnvSettings) -> None:
    """At ``register`` with OEA on and ``OEA_PROMETHEUS`` not 0: in the first process of a server without
    ``PROMETHEUS_MULTIPROC_DIR``, the directory the workers write into and its collector on the default registry
    (vLLM's ``/metrics``)."""
    if not settings.prometheus:
        return
    if os.environ.get(VLLM_DIRECTORY_VARIABLE) or os.environ.get(DIRECTORY_VARIABLE):
        return  # vLLM aggregates its own directory, or a parent process prepared OEA's
    if "prometheus_client" not in sys.modules:
        return  # not a vLLM front end (vLLM imports prometheus_client with its metrics): nothing serves a registry
    directory = os.path.join(tempfile.gettempdir(), f"oea-prometheus-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.multiprocess import MultiProcessCollector

        os.makedirs(directory)
        MultiProcessCollector(REGISTRY, path=directory)
    except (ImportError, OSError, ValueError) as err:
        log.warning(
            "oea: the oea_* series cannot reach vLLM's /metrics (%s: %s); set %s to serve them from the worker",
            type(err).__name__,
            err,
            PORT_VARIABLE,
        )
        return
    os.environ[DIRECTORY_VARIABLE] = directory  # the engine core and workers started from here write there
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


def export_directory() -> tuple[str, str]:
    """(directory the worker writes into, where its series are served)."""
    if os.environ.get(VLLM_DIRECTORY_VARIABLE):
        return os.environ[VLLM_DIRECTORY_VARIABLE], f"vLLM's /metrics ({VLLM_DIRECTORY_VARIABLE})"
    if os.environ.get(DIRECTORY_VARIABLE):
        return os.environ[DIRECTORY_VARIABLE], "vLLM's /metrics (the API server reads OEA's directory)"
    directory = os.path.join(tempfile.gettempdir(), f"oea-prometheus-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory, "nowhere: no API server in this process tree reads it"


def start_worker_export(model_config: Any) -> Exporter | None:
    """At model load with OEA on: the worker's ``Exporter`` (labels: ``engine="vllm"``, the served model name,
    the rank), ``oea_enabled`` set, and the ``OEA_PROMETHEUS_PORT`` endpoint from the rank-0 worker."""
    settings = STATE.settings
    if STATE.mode != "oea" or settings is None or settings.oea is None or not settings.prometheus:
        return None
    directory, where = export_directory()
    names = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", "")
    name = names[0] if isinstance(names, (list, tuple)) and names else str(names)
    exporter = make_exporter("vllm", name, directory, log, recorder=lambda: STATE.recorder)
    if exporter is None:
        return None
    rank = process_rank()
    exporter.set_enabled(rank, settings.oea.k0, settings.oea.min_batch)
    exporter.set_layers(rank, [i for i, spec in enumerate(STATE.specs) if spec is not None])
    raw = settings.prometheus_port
    if raw and rank == 0:
        served = serve_port(directory, raw, log)
        if served is not None:
            where = f"{where}; OEA_PROMETHEUS_PORT: http://{served[0]}/metrics"
    log.info("oea: Prometheus series oea_* written to %s, served on %s", directory, where)
    return exporter


def doctor_line(env: dict[str, str] | None = None) -> tuple[bool, str]:
    """``oea doctor vllm``'s ``prometheus export`` line: (ok, which endpoint is live) for this environment."""
    env = dict(os.environ) if env is None else env
    off = doctor_off_line(env)
    if off is not None:
        return off
    if env.get(VLLM_DIRECTORY_VARIABLE):
        live = f"on vLLM's /metrics (the workers write into {VLLM_DIRECTORY_VARIABLE}={env[VLLM_DIRECTORY_VARIABLE]})"
    else:
        live = (
            "on vLLM's /metrics with one API server started by `vllm serve` (it reads a directory of OEA's "
            "that its workers write into); a --headless engine's series reach no /metrics: set "
            f"{PORT_VARIABLE}"
        )
    raw = env.get(PORT_VARIABLE, "").strip()
    if not raw:
        return True, live
    try:
        host, port = parse_port(raw)
    except ValueError as err:
        return False, f"{live}; {err} (the server warns and serves without that endpoint)"
    return True, f"{live}; and from the rank-0 worker on http://{host}:{port}/metrics ({PORT_VARIABLE})"
