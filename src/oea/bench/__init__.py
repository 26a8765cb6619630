"""Benchmarks, one subpackage per job; each has a ``cli`` module that registers its ``oea bench`` subcommand.

* ``oea.bench.routing``: the routing microbenchmark (``run``: stock top-k, vanilla, OEA, the fast
  kernels, a naive yardstick).
* ``oea.bench.layer``: MoE-layer latency A/B against the number of active experts (``run``, ``inputs``,
  ``timing``, ``fit``, ``output``; ``moe``: the layer itself).
* ``oea.bench.decode``: the whole decode step in transformers (``run``; ``step``: the timed step).
* ``oea.bench.serve``: the serving A/B client (``client``: requests and metrics; ``prompts``; ``ab``:
  arms and restarted servers; ``summary``: intervals, table, plot).
"""
