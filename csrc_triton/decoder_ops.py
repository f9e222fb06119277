"""The paged draft's decoder layer glue in three launches (Triton): its step graph is bound by its kernel count
on the H200 (~60 launches per draft forward, one forward per tree depth, ~1.5 us each).

* ``add_rms_norm_kernel``, program (token): ``res + h`` (rounded to the activations' dtype, the new
  residual) and its RMSNorm ``x * rsqrt(mean(x^2) + eps) * w`` in fp32, rounded once (torch: an add and a
  norm);
* ``rope_write_kernel``, program (token, head): RoPE on a query or key head, ``x * cos + roll(x) * sin'``
  with the position's row of the cos / signed-sin tables (the product ``x * cos`` rounded to the
  activations' dtype first, as torch's ``addcmul(qk * cos, ...)``), the query heads to ``q``, the key
  heads (rotated) and value heads into the paged caches at the token's slot (torch: two gathers, a
  multiply, a roll, an addcmul and two ``index_copy_``);
* ``silu_mul_kernel``, program (token, block): ``silu(g)`` rounded, times ``u`` (torch: two launches).

API and dispatch: ``vllm_bole.spec_decode.decoder_ops``; plain-torch twins and float64 references beside it.
"""
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(res, h, w, res_out, x_out, N, s_res, s_h, eps, HAS_RES: tl.constexpr, BN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BN)
    m = o < N
    x = tl.load(h + t * s_h + o, mask=m, other=0.0)
    if HAS_RES:
        x = (tl.load(res + t * s_res + o, mask=m, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(res_out + t * N + o, x, mask=m)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    y = xf * r * tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(x_out + t * N + o, y.to(x.dtype), mask=m)


@triton.jit
def rope_write_kernel(qk, v, cos, sin, pos, slots, q_out, k_cache, v_cache, H, Hkv, s_qk_t, s_qk_h, s_v_t, s_v_h,
                      s_pos, s_slot, D: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1).to(tl.int64)  # 0 .. H + Hkv - 1: query heads, then key heads (each with its value head)
    d = tl.arange(0, D)
    p = tl.load(pos + t * s_pos).to(tl.int64)
    x = tl.load(qk + t * s_qk_t + hh * s_qk_h + d)
    xr = tl.load(qk + t * s_qk_t + hh * s_qk_h + (d + HALF) % D)
    c = tl.load(cos + p * D + d).to(tl.float32)
    s = tl.load(sin + p * D + d).to(tl.float32)
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    y = (a + xr.to(tl.float32) * s).to(x.dtype)
    if hh < H:
        tl.store(q_out + (t * H + hh) * D + d, y)
    else:
        kv = hh - H
        slot = tl.load(slots + t * s_slot).to(tl.int64)
        tl.store(k_cache + (slot * Hkv + kv) * D + d, y.to(k_cache.dtype.element_ty))
        val = tl.load(v + t * s_v_t + kv * s_v_h + d)
        tl.store(v_cache + (slot * Hkv + kv) * D + d, val.to(v_cache.dtype.element_ty))


@triton.jit
def silu_mul_kernel(g, u, out, N, s_g, s_u, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    a = tl.load(g + t * s_g + o, mask=m, other=0.0)
    b = tl.load(u + t * s_u + o, mask=m, other=0.0)
    af = a.to(tl.float32)
    act = (af / (1.0 + tl.exp(-af))).to(a.dtype)
    tl.store(out + t * N + o, (act.to(tl.float32) * b.to(tl.float32)).to(a.dtype), mask=m)


def add_rms_norm(res, h, weight, eps: float):
    """Launch ``add_rms_norm_kernel``; arguments and results as ``decoder_ops.add_rms_norm``."""
    import torch

    T, N = h.shape
    res_out, x_out = torch.empty_like(h), torch.empty_like(h)
    if T:
        add_rms_norm_kernel[(T,)](res if res is not None else h, h, weight, res_out, x_out, N,
                                  res.stride(0) if res is not None else 0, h.stride(0), float(eps),
                                  HAS_RES=res is not None, BN=triton.next_power_of_2(N))
    return res_out, x_out


def rope_write(qk, v, cos, sin, positions, slots, k_cache, v_cache, heads: int):
    """Launch ``rope_write_kernel``; arguments and results as ``decoder_ops.rope_write``."""
    import torch

    T, HK, D = qk.shape
    q = torch.empty(T, heads, D, dtype=qk.dtype, device=qk.device)
    if T:
        rope_write_kernel[(T, HK)](qk, v, cos, sin, positions, slots, q, k_cache, v_cache, heads, HK - heads,
                                   qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), positions.stride(0),
                                   slots.stride(0), D=D, HALF=D // 2)
    return q


def silu_mul(g, u):
    """Launch ``silu_mul_kernel``; arguments and results as ``decoder_ops.silu_mul``."""
    import torch

    T, N = g.shape
    out = torch.empty(T, N, dtype=g.dtype, device=g.device)
    block = min(1024, triton.next_power_of_2(N))
    if T:
        silu_mul_kernel[(T, triton.cdiv(N, block))](g, u, out, N, g.stride(0), u.stride(0), BLOCK=block)
    return out
