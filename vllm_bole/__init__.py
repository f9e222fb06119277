"""vllm-bole: lossless tree speculative decoding for hybrid-attention LLMs.

Layout:
  vllm_bole.spec_decode  tree structures, builders, lossless verification (engine-agnostic)
  vllm_bole.mamba        recurrent-layer tree verification and commit: GDN, Mamba2/SSD, conv
  vllm_bole.testing      float64 sequential oracles and tiny model fixtures
  vllm_bole.plugin       the vLLM adapter's entry point (the only place that imports vllm)
  csrc_triton            the Triton kernels (each with a plain-torch twin in vllm_bole)

Importing this package needs torch only; vllm is imported lazily by the plugin.
"""
__version__ = "0.1.0"
