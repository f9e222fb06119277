"""Draft trees, tree builders and lossless verification (engine-agnostic: torch only)."""
from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES, TreeBatch, TreeError

__all__ = ["MAX_DEPTH", "MAX_NODES", "TreeBatch", "TreeError"]
