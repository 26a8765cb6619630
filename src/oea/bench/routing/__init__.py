"""``oea bench routing``: routing overhead of vanilla, OEA, the fast kernels and a naive yardstick.

Modules: ``run`` (the measurement), ``cli`` (the parser and its handler).
"""
