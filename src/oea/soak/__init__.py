"""``oea soak``: hold a real vLLM or SGLang server under sustained, messy traffic and check what must hold.

* ``mix.py``: the seeded request mix (well-formed, aborted by the client, refused by the engine) and the
  concurrency schedule (ramp 1 -> max, bursts);
* ``client.py``: sending the requests (httpx, async) and judging each answer;
* ``monitor.py``: which engine answers, health over time, the server's process-group memory;
* ``runner.py``: one arm's soak (warm-up, exactness probe, the mix);
* ``checks.py``: what must hold across arms and in the engine's own metrics and trace;
* ``servers.py``: starting an arm's server (``oea.launch``) and stopping it by its process group;
* ``cli.py``: the command.
"""
