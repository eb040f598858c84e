"""A tiny random-weight Qwen3-Next that transformers and vLLM's CPU engine both run.

vLLM's CPU kernels need ``linear_key_head_dim == linear_value_head_dim``,
a head size they have kernels for (64 here), ``linear_conv_kernel_dim=4``,
and (for ``Qwen3NextForCausalLM``) at least one MoE layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_CONFIG", "make_tiny_checkpoint", "token_sequences"]

#: ``Qwen3NextConfig`` keyword arguments of the tiny model.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
}


def make_tiny_checkpoint(directory: str | Path, *, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save a tiny Qwen3-Next (safetensors) to ``directory``; nothing is downloaded.

    The zero-centred norm weights are drawn from ``N(0, 0.1)`` instead of
    zeros, so that ``1 + w`` is not exactly one and the weight's rounding shows.
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**TINY_CONFIG)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                param.normal_(0.0, 0.1)
    path = Path(directory)
    model.save_pretrained(path)
    return path


def token_sequences(count: int, length: int, vocab: int, *, seed: int = 0) -> list[list[int]]:
    """``count`` random token-id sequences of ``length`` (ids 1 .. vocab-1)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (count, length), generator=generator)
    return ids.tolist()
