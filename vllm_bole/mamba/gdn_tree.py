"""Moved: Gated DeltaNet lives in ``vllm_bole.gdn`` (it is not a Mamba layer).

Transitional alias until the vLLM adapter and ``vllm_bole.testing.engine_run`` import
``vllm_bole.gdn``: ``vllm_bole.mamba.gdn_tree`` IS the module object ``vllm_bole.gdn``, so a
name patched on either (``gdn_tree.stash_accepted_path``) is patched on both. Delete this file then.
"""
import sys

from vllm_bole import gdn as _gdn

sys.modules[__name__] = _gdn
