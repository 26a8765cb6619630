"""``oea bench decode``: the whole decode step in transformers, OEA off against OEA policies.

Modules: ``run`` (prompts, rounds, statistics), ``step`` (the timed step: static cache, CUDA graph),
``cli`` (the parser, the handler, table and plot).
"""
