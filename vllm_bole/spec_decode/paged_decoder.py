"""The forward of a Llama-family transformers causal LM over a paged KV cache, in few kernels.

The paged draft (:mod:`~vllm_bole.spec_decode.paged_draft`) runs a small model many times per engine
step (one forward per tree depth), so its cost is kernel launches, not flops: transformers' modules
take about 40 launches per decoder layer (RMSNorm in six elementwise ops, three projections, RoPE as
slices, negations and concatenations, K/V written by advanced indexing). :class:`PagedDecoder` runs the
same weights in about 16 torch launches, and on CUDA about 9 (:mod:`~vllm_bole.spec_decode.decoder_ops`:
the residual add with its RMSNorm, RoPE with the K/V page writes, and SiLU times the up projection, one
Triton launch each): one QKV and one gate-up matmul (the checkpoint's weights re-pointed as views of the
fused tensors: no second copy), RoPE on Q and K together as ``x * cos + roll(x) * sin'`` with the
positions' rows of a cos / sin table the checkpoint's rotary module filled at start (its scaling
included; length-dependent rope types, ``dynamic`` and ``longrope``, are refused), K/V written into the
pages at the tokens' slots. Embeddings, the final norm and the LM
head are the checkpoint's own. Numerics equal transformers' in fp32 up to rounding (tests compare the
drafts' candidates); in 16-bit the norms round once instead of twice.

Supported: decoder layers of ``q_proj, k_proj, v_proj, o_proj`` (optional bias; optional per-head
``q_norm``/``k_norm`` as in Qwen3), ``mlp.gate_proj/up_proj/down_proj`` with a pointwise activation,
RMSNorm ``input_layernorm``/``post_attention_layernorm``, full-width RoPE: what
:func:`decoder_support` checks (Llama, Mistral, Qwen2, Qwen3 checkpoints).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from vllm_bole.spec_decode.decoder_ops import add_rms_norm, rope_write, silu_mul

__all__ = ["PagedDecoder", "decoder_support"]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def decoder_support(model) -> str | None:
    """Why the loaded causal LM's decoder layers do not fit :class:`PagedDecoder`; None when they do."""
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(inner, name, None) is None:
            return f"{type(model).__name__} has no model.{name}"
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or getattr(attn, "layer_idx", None) != i:
            return f"decoder layer {i} has no self-attention with layer_idx (recurrent or other mixer)"
        if any(getattr(attn, n, None) is None for n in _ATTN) or mlp is None or \
                any(getattr(mlp, n, None) is None for n in _MLP + ("act_fn",)):
            return f"decoder layer {i}: not q/k/v/o projections and a gate/up/down MLP"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if getattr(getattr(layer, norm, None), "variance_epsilon", None) is None:
                return f"decoder layer {i}: {norm} is not an RMSNorm"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope"):
        return f"rope_type {rope!r} (its frequencies depend on the sequence length)"
    head = inner.layers[0].self_attn.head_dim if len(inner.layers) else 0
    cos, _ = inner.rotary_emb(inner.embed_tokens.weight[:1], torch.zeros(1, 1, dtype=torch.long,
                                                                         device=inner.embed_tokens.weight.device))
    if cos.shape[-1] != head:
        return f"partial rotary embedding ({cos.shape[-1]} of head_dim {head})"
    return None


def _fuse(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias: zeros where a part has none) for ``linears`` side by side; each part's
    parameters become views of it."""
    w = torch.cat([m.weight.data for m in linears])
    has_bias = any(m.bias is not None for m in linears)
    b = torch.cat([m.bias.data if m.bias is not None else w.new_zeros(m.out_features) for m in linears]) \
        if has_bias else None
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = w[at : at + n]
        if m.bias is not None:
            m.bias.data = b[at : at + n]
        at += n
    return w, b


class _Layer:
    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_w, self.qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_w, self.gate_up_b = _fuse([mlp.gate_proj, mlp.up_proj])
        self.o, self.down, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        probe = torch.linspace(-8, 8, 97, dtype=self.qkv_w.dtype, device=self.qkv_w.device)
        self.silu = torch.equal(mlp.act_fn(probe), F.silu(probe))  # SiLU: one launch with the up projection
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.head_dim, self.scale, self.inter = attn.head_dim, attn.scaling, mlp.gate_proj.out_features


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


class PagedDecoder:
    """``model``'s forward (a transformers causal LM that :func:`decoder_support` accepts) with K/V in
    paged caches, positions below ``max_positions``. :meth:`__call__` -> logits."""

    def __init__(self, model, max_positions: int, kernels: str = "auto"):
        why = decoder_support(model)
        if why is not None:
            raise NotImplementedError(why)
        self.model, self.kernels = model, kernels
        self.layers = [_Layer(layer) for layer in model.model.layers]
        inner = model.model
        w = inner.embed_tokens.weight
        cos, sin = inner.rotary_emb(w[:1][None], torch.arange(int(max_positions), device=w.device)[None])
        self.half = cos.shape[-1] // 2
        self.cos = cos[0].contiguous()  # [P, D]
        self.sin = torch.cat([-sin[0, :, : self.half], sin[0, :, self.half :]], -1)  # rotate_half's signs folded in

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, caches: list,
                 attend: Callable, keep: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions (RoPE), slots (flat page slot of each token's K/V) [T]; ``caches`` per
        layer (K, V) [pages, page_size, Hkv, D]; ``attend(q [T, H, D], k_cache, v_cache, scale)`` ->
        [T, H, D] (the tokens' K/V are already in the caches). Logits [T or len(keep), V] at ``keep``."""
        inner, kn = self.model.model, self.kernels
        h = inner.embed_tokens(tokens)
        res = None
        for L, (kc, vc) in zip(self.layers, caches):
            res, x = add_rms_norm(res, h, L.norm1.weight, L.norm1.variance_epsilon, kn)
            qkv = F.linear(x, L.qkv_w, L.qkv_b).view(-1, L.heads + 2 * L.kv_heads, L.head_dim)
            q, k, v = qkv.split([L.heads, L.kv_heads, L.kv_heads], 1)
            qk = torch.cat([_rms(L.q_norm, q), _rms(L.k_norm, k)], 1) if L.q_norm is not None \
                else qkv[:, : L.heads + L.kv_heads]
            q = rope_write(qk, v, self.cos, self.sin, positions, slots, kc, vc, L.heads, kn)
            o = attend(q, kc, vc, L.scale)
            res, x = add_rms_norm(res, L.o(o.reshape(o.shape[0], -1)), L.norm2.weight, L.norm2.variance_epsilon, kn)
            g, u = F.linear(x, L.gate_up_w, L.gate_up_b).split(L.inter, -1)
            h = L.down(silu_mul(g, u, kn) if L.silu else L.act(g) * u)
        _, x = add_rms_norm(res, h, inner.norm.weight, inner.norm.variance_epsilon, kn)
        return self.model.lm_head(x if keep is None else x[keep])
