"""``oea bench layer``: MoE-layer decode latency against the number of active experts.

Modules: ``run`` (memory planning and the run), ``inputs`` (configuration, variants, routing batches),
``timing`` (the timed rounds), ``fit`` (the latency model), ``output`` (tables, plot), ``moe`` (the MoE
layer that computes only the active experts), ``cli`` (the parser and its handler).
"""
