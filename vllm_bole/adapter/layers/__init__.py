"""vLLM's layers with tree overrides, one class per layer kind; adding a kind is one file here plus
its kernel. Every object installs its override on construction (idempotent: the original is kept
on the vLLM module), runs vLLM's own path unchanged while no tree step is active
(:class:`~vllm_bole.adapter.tree_step.ActiveStep`), and commits the accepted path afterwards:

* :class:`.attention.AttentionLayer` (grouped per KV-cache group in :class:`.attention.AttentionGroup`,
  one K/V compaction per group);
* :class:`.mamba2.Mamba2Layer`, :class:`.mamba1.Mamba1Layer`, :class:`.gdn.GDNLayer`
  (:class:`.recurrent.RecurrentLayer`: conv commit, stash of the accepted path, flush of pending paths).
"""
from __future__ import annotations

from vllm_bole.adapter.layers.attention import AttentionGroup, AttentionLayer
from vllm_bole.adapter.layers.gdn import GDNLayer
from vllm_bole.adapter.layers.mamba1 import Mamba1Layer
from vllm_bole.adapter.layers.mamba2 import Mamba2Layer
from vllm_bole.adapter.layers.recurrent import RecurrentLayer

RECURRENT_KINDS = (Mamba2Layer, Mamba1Layer, GDNLayer)

__all__ = ["RECURRENT_KINDS", "AttentionGroup", "AttentionLayer", "GDNLayer", "Mamba1Layer", "Mamba2Layer",
           "RecurrentLayer"]
