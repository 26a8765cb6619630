"""``oea bench serve``: serving A/B against OpenAI-compatible servers.

Modules: ``client`` (requests, streamed metrics, rounds), ``prompts`` (random or held-out text),
``ab`` (arms from the command line, restarted servers, engine metrics), ``summary`` (medians with
intervals, ratios, table, plot), ``cli`` (the parser).
"""
