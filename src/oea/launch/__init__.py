"""Launch helpers for serving engines with OEA.

* ``oea.launch.sglang``: ``python -m oea.launch.sglang <sglang.launch_server args>`` installs the OEA
  hooks in every SGLang process on versions without a plugin system (SGLang < 0.5.12).
* ``oea.launch.vllm`` / ``oea.launch.vllm_cli`` / ``oea.launch.tiny_moe``: the vLLM server helpers.
"""
