"""``OEA_TRACE_FILE``: the engine-free trace recorder the vLLM and SGLang plugins share (each engine's
``recording.py`` is the thin part: where a step's rows, request ids and positions come from).

One job per file:

* ``recorder.py``: sampling, the staging buffer the routing calls fill, the bounded queue and the writer
  thread (``StepStaging``, ``TraceRecorder``, ``open_recorder``);
* ``trace_file.py``: an ``oea-trace`` file written row by row while the engine serves (``TraceFileWriter``);
  the format's names come from ``oea.trace_schema``;
* ``common.py``: what the engines' ``recording.py`` share around the recorder: whether this rank's file can be
  written at start-up, and the sidecar's description of a recording.

Modules import each other by full module path; importing this package imports nothing.
"""
