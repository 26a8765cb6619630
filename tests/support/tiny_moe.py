"""A tiny random Qwen3-MoE checkpoint with its own byte-level BPE tokenizer, built locally (no hub).

Fallback model for the vLLM engine tests and the serving A/B when the embedded model
(``oea.models.embedded_model_dir()``) is absent. Hidden 256, 4 layers, 64 experts, top-8,
``norm_topk_prob=True``; router gates x20 and expert ``down_proj`` x5 after init so that routing
visibly changes the output (a freshly initialised router is nearly uniform and experts barely differ,
so rerouting would not show in the tokens). About 28M parameters, 56 MB in bf16.

Run with the interpreter that will serve it (its transformers writes the checkpoint format)::

    python tests/support/tiny_moe.py OUT_DIR
"""

from __future__ import annotations

import glob
import os
import sys
import sysconfig

VOCAB = 4096
ARCH = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 64,
        "num_experts_per_tok": 8}


def build(out: str, seed: int = 0) -> str:
    """Write tokenizer + bf16 safetensors checkpoint to ``out``; returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(out, exist_ok=True)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train(files, trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                         special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=2048)
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id, **ARCH)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(20.0)
            elif ".experts." in name and "down_proj" in name:
                param.mul_(5.0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/support/tiny_moe.py OUT_DIR")
    print(build(sys.argv[1]))
