"""Data of oea's evidence tools, as package data: ``embedded/`` (the embedded model) and ``traces/`` (the bundled
routing traces). No code: oea finds both folders through ``importlib.resources``
(``oea.models.embedded_model_dir()``, ``oea.traces.bundled_trace_dir()``)."""
