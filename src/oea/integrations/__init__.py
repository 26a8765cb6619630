"""Engine adapters, one package each. Each imports its engine lazily, so importing this package is free.

* ``oea.integrations.transformers``: ``attach`` / ``maybe_attach`` for Hugging Face transformers 5.x.
* ``oea.integrations.vllm``: the vLLM general plugin (entry point ``oea.integrations.vllm:register``).
* ``oea.integrations.sglang``: the SGLang plugin (entry point ``oea.integrations.sglang:register``).
* ``oea.integrations.doctor``: ``oea doctor``, engine-independent (``run``: runs the checks and prints the
  report; ``cli``: its command; ``common``: the check helpers every engine's doctor uses; ``env``: the check of
  the ``OEA_*`` environment; ``oea doctor gpu`` is ``oea.kernels.doctor_gpu``, beside the kernels it checks).

Engine-free modules every adapter uses, so that no rule is written twice:

* ``runtime``: warn-once, graph-capture detection, the process rank, method wrapping;
* ``deterministic``: the engines' deterministic / batch-invariant modes keep the engine's routing (OEA off, one
  warning naming both settings) and the doctor's ``deterministic mode`` check;
* ``bypass``: a substituted router class (a platform's subclass overriding the method OEA's hook runs through)
  named at start-up (one warning per class) and by the doctor's ``router bypass`` check;
* ``replay``: routing replay: the rule by which a trainer tells OEA's fillers in the routed-experts ids an engine
  returns (``filler_slots``) and ``ReplayIds``, which hands an engine's capture OEA's ids where its kernel runs others;
* ``placement``: expert placements read from an engine (``OEA_POLICY=ep``), refreshed after a rebalance;
* ``metrics``: the ``OEA_METRICS_FILE`` rows (``StepRecord``, ``MetricsWriter``);
* ``prometheus``: the ``oea_*`` Prometheus series, fed by the metrics writer with the same records
  (``Exporter``; ``OEA_PROMETHEUS_PORT``: ``serve_port``);
* ``oea.integrations.recording``: ``OEA_TRACE_FILE``'s recorder (``recorder``), the file it writes
  (``trace_file``; the format's names: ``oea.trace_schema``) and what the engines' recording modules share
  around it (``common``);
* ``served``: what a server's ``OEA_METRICS_FILE`` says (``oea doctor --metrics-file``);
* ``hook_targets``: how each plugin declares the engine names it relies on (``vllm/targets.py``,
  ``sglang/targets.py``), checked against the released wheels.
"""
