"""vllm-bole: lossless tree speculative decoding for hybrid-attention LLMs.

Layout:
  vllm_bole.spec_decode  tree structures, builders, drafters, lossless verification (engine-agnostic)
  vllm_bole.mamba        recurrent-layer tree verification and commit: GDN, Mamba2/SSD, conv
  vllm_bole.config       the user-facing speculative config (``{"method": "bole_tree", ...}``, pydantic)
  vllm_bole.testing      float64 sequential oracles, tiny model fixtures, engine runners for tests
  vllm_bole.plugin       the vLLM entry point (``vllm.general_plugins``): version check, then the adapter
  vllm_bole.adapter      everything that imports vllm: config hook, worker, model runner, layer overrides
  csrc_triton            the Triton kernels (each with a plain-torch twin in vllm_bole)

Importing this package needs torch only; vllm is imported only by the plugin and the adapter.
"""
__version__ = "0.1.0"
