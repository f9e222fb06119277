"""The unmasked prefix half of tree attention from vLLM's own FlashAttention (issue 14 item 4).

A tree node attends to its request's whole prefix without a mask and to its ancestors in the tree with
one. The prefix is almost all of the work (8192 keys against at most 256 tree keys at the issue's
shape), and it is exactly the paged decode-with-context attention vLLM's FlashAttention backend runs
for a chunked prefill's context (``flash_attn_varlen_func`` with ``seqused_k`` and a block table,
returning the log-sum-exp): FA3's wgmma/TMA kernels on Hopper, where our Triton kernel reached 2.1x the
compute floor. :func:`flash_prefix_attention` is that call in the shape of
``vllm_bole.attention.tree_attention``'s ``prefix_attention``; the Triton kernel then reads only the
tree's keys and continues the softmax from FlashAttention's (output, lse).

Measured (H100, fbec640, ``tree_attention.json``): B = 32, N = 64, prefix 8192: 0.494 ms against 0.834 for
our kernel alone, 1.25x the compute floor (2.11x); B = 8: 1.45x (2.67x). Decision: the attention layer
takes it with ``VLLM_BOLE_FLASH_PREFIX=1`` (:func:`enabled`), off by default until the vLLM matrix has run
it inside the engine (identity and step time, under CUDA graphs and with the hybrids' block sizes); the
benchmark's paged cache was its own, not a vLLM layer's. Inside the engine (192c57d, H100, ``mixed``):
Qwen3-Next bf16 with it passed the noise criterion; NemotronH fp32 failed, FlashAttention refusing fp32, hence
:func:`supports`. Still to measure before it is the default: its step time in the matrix. Its CPU stand-in
(``tree_attention.naive.prefix_attention_torch``) is tested against the whole kernel; this call itself runs
on a GPU only.
"""
from __future__ import annotations

import functools
import os

ENV = "VLLM_BOLE_FLASH_PREFIX"


def enabled() -> bool:
    """``VLLM_BOLE_FLASH_PREFIX=1`` and vLLM's FlashAttention can run here."""
    return os.environ.get(ENV, "0") == "1" and available()


@functools.lru_cache(maxsize=1)
def _flash():
    """(vLLM's ``flash_attn_varlen_func`` for this platform, its FlashAttention version for this GPU), as
    vLLM's FlashAttention backend picks them (``fa_utils``)."""
    from vllm.v1.attention.backends import fa_utils

    return fa_utils.flash_attn_varlen_func, fa_utils.get_flash_attn_version()


def available() -> bool:
    """Whether vLLM's FlashAttention can run here (CUDA, its extension importable)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        from vllm.v1.attention.backends import fa_utils

        return fa_utils.is_flash_attn_varlen_func_available() and _flash()[1] is not None
    except (ImportError, AttributeError, RuntimeError, AssertionError):
        return False


def supports(q, key_cache) -> bool:
    """Whether FlashAttention takes these: fp16 or bf16 queries over a cache of the same dtype (it refuses fp32,
    "FlashAttention only supports fp16, bf16, and fp8_e4m3": an fp32 NemotronH failed so at 192c57d; an fp8
    cache would need its scales) and head size at most 256. The layer falls back to the Triton prefix
    otherwise."""
    import torch

    return q.dtype in (torch.float16, torch.bfloat16) and key_cache.dtype == q.dtype and q.shape[-1] <= 256


def flash_prefix_attention(q, key_cache, value_cache, block_table, prefix_len, cu_nodes, *, scale, max_nodes,
                           max_prefix_len, out):
    """Every node's attention over its request's prefix alone, into ``out`` [T, Hq, D]; returns the log-sum-exp
    [Hq, T] fp32 (+inf for a request without prefix). Arguments as ``tree_attention``'s (the caches
    ``[num_blocks, block_size, Hkv, D]``, block table and ``cu_nodes`` int32; ``max_nodes`` / ``max_prefix_len``
    host upper bounds)."""
    import torch

    fn, version = _flash()
    _, lse = fn(q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu_nodes, max_seqlen_q=max_nodes,
                seqused_k=prefix_len.to(torch.int32), max_seqlen_k=max_prefix_len, softmax_scale=scale, causal=False,
                block_table=block_table, return_softmax_lse=True, fa_version=version)
    return lse
