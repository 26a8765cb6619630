"""Routing traces: a compact on-disk format, the bundled real traces, and ``oea capture``.

    trace = oea.traces.load_trace("qwen3-30b-a3b")     # or a path
    trace.ids.shape                                     # [T, L, k]
    oea.traces.save_trace(trace, "my-trace.safetensors")
"""

from oea.traces.bundled import bundled_trace_dir, bundled_trace_names, load_trace
from oea.traces.format import Trace, read_trace_file, save_trace

__all__ = ["Trace", "bundled_trace_dir", "bundled_trace_names", "load_trace", "read_trace_file", "save_trace"]
