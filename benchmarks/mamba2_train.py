"""A training forward for transformers' Mamba2 mixers (NemotronH and kin) built from batched matmuls.

On the H200 machine transformers (5.17) has no ``mamba_ssm`` and its torch fallback broadcasts
``C[:, :, :, None] * B[:, :, None]`` to ``[b, chunks, l, l, heads, state]`` before summing: 1.4-3.1 s and
68 GB per 32k-token step of the pair's 70M target (``train_pair.py``), so a 10-minute run gave it only
120 steps. ``use_fast_mamba2(model)`` replaces every Mamba2 mixer's forward (training only: no cache)
by the same computation with the state contraction as an ``einsum`` (the SSD paper's minimal chunked form):
in projection, causal depthwise conv + activation, ``dt = softplus(dt + dt_bias)`` clamped below at
``time_step_limit[0]``, chunked SSD with ``A = -exp(A_log)``, ``+ D x``, gated RMSNorm, out projection.
Checked against transformers' own forward and gradients in ``tests/test_mamba2_train.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``[..., T] -> [..., T, T]``: ``out[i, j] = sum(a[j+1 .. i])`` for ``j <= i``, ``-inf`` above."""
    t = a.shape[-1]
    x = a[..., None].expand(*a.shape, t).masked_fill(~torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1), 0)
    return torch.cumsum(x, dim=-2).masked_fill(~torch.ones(t, t, dtype=torch.bool, device=a.device).tril(), -torch.inf)


def chunked_ssd(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk: int) -> torch.Tensor:
    """``h_t = exp(a_t) h_{t-1} + x_t b_t^T``, ``y_t = h_t c_t`` from a zero state, in float32.

    x ``[B, T, H, P]`` (already times dt), a ``[B, T, H]`` (log decay, ``A dt``), b, c ``[B, T, H, N]``;
    returns y ``[B, T, H, P]``. ``T`` is padded to a multiple of ``chunk``."""
    bsz, t, h, p = x.shape
    pad = -t % chunk
    x, b, c = (F.pad(v.float(), (0, 0, 0, 0, 0, pad)) for v in (x, b, c))
    a = F.pad(a.float(), (0, 0, 0, pad))
    x, b, c = (v.reshape(bsz, -1, chunk, h, v.shape[-1]) for v in (x, b, c))
    a = a.reshape(bsz, -1, chunk, h).permute(0, 3, 1, 2)  # [B, H, nc, l]
    a_cum = torch.cumsum(a, dim=-1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", torch.einsum("bclhn,bcshn->bclsh", c, b)
                          * torch.exp(_segsum(a)).permute(0, 2, 3, 4, 1), x)
    decay_states = torch.exp(a_cum[..., -1:] - a_cum)  # [B, H, nc, l]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_states, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [B, H, nc + 1, nc + 1]
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(a_cum))
    return (y_diag + y_off).reshape(bsz, -1, h, p)[:, :t]


def _forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs) -> torch.Tensor:
    """The mixer's training forward (``[B, T, hidden] -> [B, T, hidden]``); no cache, no padding mask."""
    if cache_params is not None or (attention_mask is not None and not bool(attention_mask.all())):
        raise ValueError("use_fast_mamba2: training only (cache_params None, no padded positions)")
    bsz, t, _ = hidden_states.shape
    heads, hd, groups, n = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    gate, xbc, dt = self.in_proj(hidden_states).split([self.intermediate_size, self.conv_dim, heads], dim=-1)
    xbc = self.act(self.conv1d(xbc.transpose(1, 2))[..., :t].transpose(1, 2))
    x, b, c = xbc.split([self.intermediate_size, groups * n, groups * n], dim=-1)
    dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.time_step_limit[0], max=self.time_step_limit[1])
    x = x.reshape(bsz, t, heads, hd)
    b, c = (v.reshape(bsz, t, groups, n).repeat_interleave(heads // groups, dim=2) for v in (b, c))
    with torch.autocast(hidden_states.device.type, enabled=False):  # the scan in float32 under bf16 autocast too
        y = chunked_ssd(x.float() * dt[..., None], -torch.exp(self.A_log.float()) * dt, b, c, self.chunk_size)
    y = y + self.D.float()[:, None] * x.float()
    return self.out_proj(self.norm(y.reshape(bsz, t, -1), gate).to(hidden_states.dtype))


def use_fast_mamba2(model: torch.nn.Module) -> int:
    """Replace the forward of every Mamba2 mixer of ``model`` (modules with ``A_log``, ``dt_bias``,
    ``conv1d``, ``chunk_size``, ``ssm_state_size``, ...) by ``_forward``; returns how many were replaced."""
    n = 0
    for m in model.modules():
        if all(hasattr(m, k) for k in ("A_log", "dt_bias", "D", "conv1d", "chunk_size", "in_proj", "norm",
                                        "ssm_state_size", "n_groups", "time_step_limit")):
            m.forward = _forward.__get__(m)
            n += 1
    return n
