"""vllm-bole: lossless tree speculative decoding for hybrid-attention LLMs.

Layout (README "Architecture"):
  vllm_bole.spec_decode  trees, drafters, the best-first builder, verification, the decode step (engine-agnostic)
  vllm_bole.gdn          Gated DeltaNet tree verification and commit
  vllm_bole.mamba        Mamba2/SSD tree verification and commit, tree conv
  vllm_bole.attention    tree attention over a paged KV cache, accepted-K/V compaction
  vllm_bole.pending      per-slot accepted paths awaiting commit
  vllm_bole.config       the user-facing speculative config (``{"method": "bole_tree", ...}``, pydantic)
  vllm_bole.testing      tiny model fixtures, engine runners and lossless criteria for tests
  vllm_bole.plugin       the vLLM entry point (``vllm.general_plugins``): version check, then the adapter
  vllm_bole.adapter      everything that imports vllm: config hook, workers, model runner, layer objects, metrics
  csrc_triton            the Triton kernels (each with a torch twin and a float64 reference in its op's package)

Importing this package needs torch only; vllm is imported only by the plugin and the adapter.
"""
__version__ = "0.1.0"
