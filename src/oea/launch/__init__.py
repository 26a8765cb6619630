"""Serving engines with OEA: starting, health-checking and stopping their servers.

Every module (none imports an engine at module level, none needs the ``oea[lab]`` extra):

* ``oea.launch.cli``: ``oea serve``, ``oea serve vllm`` and ``oea serve sglang``, the one serve command line for
  both engines.
* ``oea.launch.server_process``: the engine-free lifecycle of a local server process (own session, /health,
  SIGTERM then SIGKILL to its group).
* ``oea.launch.vllm``: vLLM's OpenAI server with OEA settings (environment, CPU memory defaults).
* ``oea.launch.sglang_server``: ``python -m sglang.launch_server`` with OEA settings (CPU engine flags, the
  ``sgl_kernel`` stand-in of a source checkout on request).
* ``oea.launch.sglang``: ``python -m oea.launch.sglang <sglang.launch_server args>`` installs the OEA hooks in
  every SGLang process on versions without a plugin system (SGLang < 0.5.12).
* ``oea.launch.priority``: scheduling priority (nice and autogroup) for benchmarks on a shared machine.

Test support (the tiny checkpoints, the ``sgl_kernel`` stand-in) lives in the source tree's ``tests/support/``.
"""
