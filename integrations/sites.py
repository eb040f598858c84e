"""Norm sites: where a Qwen3-Next model calls a norm, named the same on both sides.

A site is a norm module's qualified name (``model.layers.3.input_layernorm``);
its kind says which norm it is. transformers and vLLM name their modules
alike, so a site's name is the key that pairs one side's call with the other's.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["SITE_KINDS", "expected_site_counts", "site_kind"]

#: Site kinds, in the order the reports list them.
SITE_KINDS = ("input_norm", "post_attention_norm", "final_norm", "qk_norm", "gated_norm")

_PATTERNS = (
    (re.compile(r"(^|\.)layers\.\d+\.input_layernorm$"), "input_norm"),
    (re.compile(r"(^|\.)layers\.\d+\.post_attention_layernorm$"), "post_attention_norm"),
    (re.compile(r"(^|\.)self_attn\.[qk]_norm$"), "qk_norm"),
    (re.compile(r"(^|\.)linear_attn\.norm$"), "gated_norm"),
    (re.compile(r"(^|^model\.)norm$"), "final_norm"),
)


def site_kind(name: str) -> str | None:
    """The kind of the norm module named ``name``, or ``None`` if it is not a norm site."""
    for pattern, kind in _PATTERNS:
        if pattern.search(name):
            return kind
    return None


def expected_site_counts(config: Any) -> Mapping[str, int]:
    """How many sites of each kind a Qwen3-Next ``config`` implies."""
    layer_types = list(config.layer_types)[: config.num_hidden_layers]
    counts = Counter({kind: 0 for kind in SITE_KINDS})
    counts["input_norm"] = counts["post_attention_norm"] = len(layer_types)
    counts["final_norm"] = 1
    counts["qk_norm"] = 2 * layer_types.count("full_attention")
    counts["gated_norm"] = layer_types.count("linear_attention")
    return dict(counts)
