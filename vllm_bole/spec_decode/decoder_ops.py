"""The paged draft's decoder layer glue (:class:`~vllm_bole.spec_decode.paged_decoder.PagedDecoder`): the
residual add with its RMSNorm, RoPE with the K/V page writes, and SiLU times the up projection.

Each has its API and dispatch (``kernels``: ``vllm_bole.dispatch``; on CUDA one Triton launch each,
``csrc_triton/decoder_ops.py``, instead of 2, ~7 and 2 torch launches), its plain-torch twin (``*_torch``:
what the decoder ran before, the same roundings) and its float64 reference (``*_reference``). Shapes:
``T`` tokens, ``N`` hidden, ``H`` query heads, ``Hkv`` key/value heads, ``D`` head dim, ``P`` positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_bole.dispatch import use_triton

__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rms_norm_torch", "rope_write", "rope_write_reference",
           "rope_write_torch", "silu_mul", "silu_mul_reference", "silu_mul_torch"]


def add_rms_norm(res: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``res`` (None: none yet) and ``h`` [T, N] -> (``res + h``, its RMSNorm with ``weight`` [N]), both [T, N]
    in ``h``'s dtype."""
    if use_triton(kernels, h) and h.stride(-1) == 1 and (res is None or res.stride(-1) == 1):
        from csrc_triton.decoder_ops import add_rms_norm as launch

        return launch(res, h, weight, eps)
    return add_rms_norm_torch(res, h, weight, eps)


def add_rms_norm_torch(res, h, weight, eps):
    res = h if res is None else res + h
    return res, F.rms_norm(res, weight.shape, weight, eps)


def add_rms_norm_reference(res, h, weight, eps):
    x = (h.double() if res is None else res.double() + h.double())
    return x, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rope_write(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
               kernels: str = "auto") -> torch.Tensor:
    """``qk`` [T, H + Hkv, D] (query heads, then key heads), ``v`` [T, Hkv, D]; ``cos`` / ``sin`` [P, D] tables
    (``sin``: rotate-half's signs folded in, its first half negated), ``positions`` / ``slots`` [T]: RoPE
    ``x * cos[p] + roll(x, D / 2) * sin[p]`` on the query and key heads; the keys and values written into
    ``k_cache`` / ``v_cache`` [pages, page_size, Hkv, D] at each token's flat slot. Returns the queries
    [T, H, D]."""
    D = qk.shape[-1]
    if use_triton(kernels, qk) and D & (D - 1) == 0 and qk.stride(-1) == 1 and v.stride(-1) == 1 and \
            k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous():
        from csrc_triton.decoder_ops import rope_write as launch

        return launch(qk, v, cos, sin, positions, slots, k_cache, v_cache, heads)
    return rope_write_torch(qk, v, cos, sin, positions, slots, k_cache, v_cache, heads)


def rope_write_torch(qk, v, cos, sin, positions, slots, k_cache, v_cache, heads):
    D = qk.shape[-1]
    qk = torch.addcmul(qk * cos[positions][:, None], qk.roll(D // 2, -1), sin[positions][:, None])
    q, k = qk[:, :heads], qk[:, heads:]
    kv = k.shape[1]
    k_cache.view(-1, kv, D).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kv, D).index_copy_(0, slots, v.to(v_cache.dtype))
    return q


def rope_write_reference(qk, v, cos, sin, positions, slots, k_cache, v_cache, heads):
    """float64: returns (queries [T, H, D], the caches as written: float64 copies)."""
    D = qk.shape[-1]
    x = qk.double()
    x = x * cos.double()[positions][:, None] + x.roll(D // 2, -1) * sin.double()[positions][:, None]
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    kv = x.shape[1] - heads
    kc.view(-1, kv, D)[slots] = x[:, heads:]
    vc.view(-1, kv, D)[slots] = v.double()
    return x[:, :heads], kc, vc


def silu_mul(g: torch.Tensor, u: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """``silu(g) * u`` [T, N]."""
    if use_triton(kernels, g) and g.stride(-1) == 1 and u.stride(-1) == 1:
        from csrc_triton.decoder_ops import silu_mul as launch

        return launch(g, u)
    return silu_mul_torch(g, u)


def silu_mul_torch(g, u):
    return F.silu(g) * u


def silu_mul_reference(g, u):
    return F.silu(g.double()) * u.double()
