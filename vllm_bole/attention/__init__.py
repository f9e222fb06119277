"""Full-attention layers under tree verification: tree attention over vLLM's paged KV cache
(``tree_attention``) and accepted-path KV compaction (``kv_compaction``); plain torch on CPU,
Triton kernels on CUDA."""
from vllm_bole.attention.kv_compaction import compact_accepted_kv, compact_accepted_kv_torch
from vllm_bole.attention.tree_attention import (
    accepted_path,
    tree_attention,
    tree_attention_torch,
    tree_positions,
    tree_slot_mapping,
    write_tree_kv,
)

__all__ = [
    "accepted_path",
    "compact_accepted_kv",
    "compact_accepted_kv_torch",
    "tree_attention",
    "tree_attention_torch",
    "tree_positions",
    "tree_slot_mapping",
    "write_tree_kv",
]
