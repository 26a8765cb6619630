"""vLLM general plugin: OEA routing inside vLLM's MoE routers (entry point ``oea.integrations.vllm:register``).

Loaded by vLLM in every process (API server, EngineCore, Worker) through the ``vllm.general_plugins``
entry point. What it does depends on the environment (parsed by ``oea.config.settings_from_env``):

* nothing set: inert, no patch is applied;
* ``OEA_K0`` set: OEA rewrites routing in decode steps (mode ``oea``);
* ``OEA_K0`` unset but ``OEA_METRICS_FILE`` or ``OEA_TIMING=1`` set: routing is stock vLLM's, only
  observed (mode ``observe``): the baseline arm of an A/B.

Extra variables read here: ``OEA_TIMING=1`` (time each routing call in the worker) and
``OEA_METRICS_FLUSH_S`` (seconds between metrics flushes, default 0.5). See docs/vllm.md.

One job per file:

* ``plugin.py``: ``register`` and the hooks it installs in vLLM's classes; model load (router numbering,
  the settings checked against each router, the decode flag);
* ``steps.py``: decode or not, decided once per engine step from the ``SchedulerOutput``, and the step's
  ``OEA_METRICS_FILE`` record (``oea.integrations.metrics``);
* ``routing.py``: the hot path, run in every routing call (the CPU custom op ``oea::cpu_route`` and the
  graph-safe wrapper of the other routers);
* ``layers.py``: each router's config per batch size (``oea.routing.LayerConfigs``: ``OEA_K0``,
  ``OEA_LAYER_K0_FILE``);
* ``placement.py``: ``OEA_POLICY=ep``, each layer's expert placement from vLLM's EP layout;
* ``parallel.py``: data-parallel ranks whose router logits vLLM gathers (those layers stay stock);
* ``recording.py``: ``OEA_TRACE_FILE``, the vLLM side of ``oea.integrations.recording.recorder``;
* ``speculative.py``: speculative verify steps (``OEA_APPLY_TO_VERIFY``): the drafts each request carried;
* ``targets.py``: the vLLM names and parameters the plugin relies on (checked against the released wheels);
* ``router_state.py``: one ``RouterState`` per numbered router, on the router (spec, layer-file entry, EP-aware
  config, kernel and buffers, trace slot, failed flag), and ``RouterCall``, one routing call's steps;
* ``prometheus.py``: the ``oea_*`` Prometheus series (``oea.integrations.prometheus``) on vLLM's own
  ``/metrics``, or from the rank-0 worker on ``OEA_PROMETHEUS_PORT``;
* ``state.py``: the per-process state the others share;
* ``doctor.py``: ``oea doctor vllm``.

vLLM is imported inside functions only; importing this package needs torch alone.
"""

from oea.integrations.vllm.doctor import (
    ENTRY_POINT_GROUP,
    ENTRY_POINT_VALUE,
    SUPPORTED_VERSIONS,
    doctor_checks,
    engine_version,
)
from oea.integrations.vllm.plugin import ROUTER_CLASSES, install_hooks, register, router_spec
from oea.integrations.vllm.routing import OP_NAME, oea_route_for
from oea.integrations.vllm.steps import is_decode_step

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_VALUE",
    "OP_NAME",
    "ROUTER_CLASSES",
    "SUPPORTED_VERSIONS",
    "doctor_checks",
    "engine_version",
    "install_hooks",
    "is_decode_step",
    "oea_route_for",
    "register",
    "router_spec",
]
