"""Evaluation of routing policies on a real MoE model: ``oea eval`` and ``oea.eval.evaluate``.

``evaluate`` runs teacher-forced lock-step batched decoding on held-out text with ``oea.attach``
applied; ``oea.eval.lm_eval_bridge`` runs lm-evaluation-harness tasks with OEA attached.
transformers (and lm-eval) are imported lazily.
"""

from oea.eval.evaluate import POLICIES, evaluate
from oea.eval.summary import PAPER_RULE, VERDICT_RULE, paper_verdict

__all__ = ["PAPER_RULE", "POLICIES", "VERDICT_RULE", "evaluate", "paper_verdict"]
