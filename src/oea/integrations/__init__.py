"""Engine adapters. Each submodule imports its engine lazily, so importing this package is free.

* ``oea.integrations.transformers``: ``attach`` / ``maybe_attach`` for Hugging Face transformers 5.x.
"""
