"""Mamba-style recurrent layers under tree verification: Mamba2/SSD (``ssd_tree``) and the short
causal conv shared by the Mamba2 and GDN mixers (``tree_conv``). Gated DeltaNet is
``vllm_bole.gdn``."""
