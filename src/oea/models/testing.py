"""The tiny test models of ``oea.testing`` under the import path user code has for them (``oea.models.testing``).

The models live in ``oea.testing``, on the foundation floor, so that the adapters' doctors build one
without importing the ``oea.models`` tool. The project itself imports ``oea.testing``.
"""

from oea.testing import TINY_FAMILIES, tiny_moe, tiny_moe_config, tiny_qwen3_moe

__all__ = ["TINY_FAMILIES", "tiny_moe", "tiny_moe_config", "tiny_qwen3_moe"]
