"""SGLang integration: OEA as an ``sglang.srt.plugins`` entry-point plugin (``oea.integrations.sglang:register``).

Enable with ``OEA_K0=<k0>`` (alias ``SGLANG_OEA_K0``) in the environment of the SGLang server;
everything else is automatic: SGLang's ``load_plugins()`` runs ``register`` in every process and applies
the hooks through its ``HookRegistry``. Without ``OEA_K0`` (and without ``OEA_TRACE_FILE`` / ``OEA_METRICS_FILE``,
which only observe SGLang's routing) the plugin installs nothing and SGLang is untouched. A malformed ``OEA_*``
variable stops start-up (``register`` raises ``SystemExit`` naming it); inside a forward pass nothing raises:
unsupported routings pass through with one warning per reason.
SGLang 0.5.12-0.5.23; older versions: ``python -m oea.launch.sglang`` (see docs/sglang.md).

One job per file:

* ``plugin.py``: ``register``, ``install`` (HookRegistry) and ``install_without_registry`` (direct patches);
* ``hooks.py``: the hooks SGLang calls around each forward (decode detection: ``forward_context`` where it
  carries the batch, else ``ModelRunner.forward`` and the graph captures), the plan of which hook goes on
  which target for the installed version, and whether each is in place;
* ``routing.py``: the hot path, run in every routing call (``post_process_before`` -> ``rewrite_topk``) in
  numbered steps, each layer's config from ``oea.routing.LayerConfigs``;
* ``router_state.py``: one ``RouterState`` per MoE layer (spec, layer-file entry, EP-aware base config, kernel,
  filler mask, trace slot, failed flag) and ``RouterCall``, one call's steps;
* ``fillers.py``: the zero-weight filler slots of a rewritten row made distinct ids SGLang's native MoE can run;
* ``padding.py``: which rows of a CUDA/CPU graph's padded batch are real;
* ``placement.py``: ``OEA_POLICY=ep``, each layer's expert placement from SGLang's EP layout;
* ``recording.py``: ``OEA_TRACE_FILE``, the SGLang side of ``oea.integrations.recording.recorder``;
* ``metrics.py``: ``OEA_METRICS_FILE`` (and ``OEA_TIMING``), the SGLang side of ``oea.integrations.metrics``: one
  row per forward, as vLLM's, with why a decode or verify forward kept SGLang's routing;
* ``prometheus.py``: the ``oea_*`` series on SGLang's own ``/metrics`` (``--enable-metrics``, OEA on), fed by the
  same records as the metrics file;
* ``specs.py``: SGLang's ``TopKConfig`` -> ``RouterSpec`` (or why not);
* ``state.py``: per-process state and the per-thread forward-mode stack;
* ``targets.py``: supported versions, entry point, hooked functions and the parameters they must have;
* ``doctor.py``: ``oea doctor sglang``.

SGLang is imported inside functions only; importing this package needs torch alone.
"""

from oea.integrations.sglang.doctor import doctor_checks
from oea.integrations.sglang.hooks import hook_plan, hooks_status, target_hooked
from oea.integrations.sglang.plugin import install, install_without_registry, register, rewrite_count
from oea.integrations.sglang.routing import rewrite_topk
from oea.integrations.sglang.specs import UnsupportedRouting, router_spec_from_topk_config, shared_topk_slots
from oea.integrations.sglang.state import current_forward_mode, decode_active, forward_mode
from oea.integrations.sglang.targets import (
    CPU_GRAPH_CAPTURE_TARGET,
    DECODE_GRAPH_CAPTURE_TARGET,
    ENTRY_POINT_GROUP,
    ENTRY_POINT_VALUE,
    EXPECTED_PARAMETERS,
    FORWARD_CONTEXT_TARGET,
    GRAPH_CAPTURE_TARGET,
    MODEL_RUNNER_FORWARD_TARGET,
    POST_PROCESS_TARGET,
    SELECT_EXPERTS_TARGET,
    SUPPORTED_VERSIONS,
    TESTED_VERSION,
    TOPK_MODULE,
    engine_version,
    module_exists,
)

__all__ = [
    "CPU_GRAPH_CAPTURE_TARGET",
    "DECODE_GRAPH_CAPTURE_TARGET",
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_VALUE",
    "EXPECTED_PARAMETERS",
    "FORWARD_CONTEXT_TARGET",
    "GRAPH_CAPTURE_TARGET",
    "MODEL_RUNNER_FORWARD_TARGET",
    "POST_PROCESS_TARGET",
    "SELECT_EXPERTS_TARGET",
    "SUPPORTED_VERSIONS",
    "TESTED_VERSION",
    "TOPK_MODULE",
    "UnsupportedRouting",
    "current_forward_mode",
    "decode_active",
    "doctor_checks",
    "engine_version",
    "forward_mode",
    "hook_plan",
    "hooks_status",
    "install",
    "install_without_registry",
    "module_exists",
    "register",
    "rewrite_count",
    "rewrite_topk",
    "router_spec_from_topk_config",
    "shared_topk_slots",
    "target_hooked",
]
