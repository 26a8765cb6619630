"""Engine adapters, one package each. Each imports its engine lazily, so importing this package is free.

* ``oea.integrations.transformers``: ``attach`` / ``maybe_attach`` for Hugging Face transformers 5.x.
* ``oea.integrations.vllm``: the vLLM general plugin (entry point ``oea.integrations.vllm:register``).
* ``oea.integrations.sglang``: the SGLang plugin (entry point ``oea.integrations.sglang:register``).
* ``oea.integrations.doctor``: ``oea doctor`` (its shared check helpers: ``doctor_common``).
"""
