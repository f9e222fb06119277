"""Triton tile helpers shared by the recurrent tree kernels (``gdn_tree``, ``ssd_tree``).

* ``mm``: a @ b with fp32 accumulation, bf16 operands when LOWP. Under Triton's CPU
  interpreter (whose bf16 ``tl.dot`` returns garbage in Triton 3.9) the operands are rounded to
  bf16 and multiplied in fp32 instead (``BF16_EMUL``, set by the launchers from
  ``INTERPRET``): the same products, exact in fp32, so CPU tests cover the 16-bit path's logic.
* ``anc_tile``: a block of the ancestor-or-self mask of one request's tree (rows x columns of
  local nodes) from ``TreeBatch.anc_mask`` bit words.
* ``unit_lower_inverse`` / ``squarings``: (I + A)^{-1} of a strictly lower nilpotent tile.
* ``program_head``: the (request, head, shared head, state slot) of a program of the
  (request x head) grid axis.
* ``num_sms`` (host): the device's streaming multiprocessors, the launchers' measure of a grid that fills it.
"""
import functools
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def num_sms(device) -> int:
    """Streaming multiprocessors of ``device`` (a ``torch.device``; 1 off CUDA)."""
    if device.type != "cuda":
        return 1
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def mm(a, b, LOWP: tl.constexpr, BF16_EMUL: tl.constexpr):
    """a @ b with fp32 accumulation: bf16 operands when LOWP (emulated under the interpreter),
    else fp32 operands (tf32 tensor-core products on the GPU, exact fp32 in the interpreter)."""
    if LOWP:
        if BF16_EMUL:
            return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32))
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton.jit
def anc_tile(anc_mask, rows, row_ok, cols, col_ok, MW: tl.constexpr):
    """M[i, j] = local node ``cols[j]`` is an ancestor-or-self of the node at flat row ``rows[i]``
    (False where ``~row_ok[i]`` or ``~col_ok[j]``)."""
    ok = row_ok[:, None] & col_ok[None, :]
    word = tl.load(anc_mask + rows[:, None] * MW + (cols // 32)[None, :], mask=ok, other=0)
    return (((word >> (cols % 32)[None, :]) & 1) != 0) & ok


@triton.jit
def unit_lower_inverse(A, BT: tl.constexpr, steps, LOWP: tl.constexpr, BF16_EMUL: tl.constexpr):
    """(I + A)^{-1} for a strictly lower nilpotent A [BT, BT] with A^(2^(steps+1)) = 0: the
    Neumann series as (I - A)(I + A^2)(I + A^4)..."""
    o = tl.arange(0, BT)
    T = (o[:, None] == o[None, :]).to(tl.float32) - A
    P = A
    for _ in range(steps):
        P = mm(P, P, LOWP, BF16_EMUL)
        T = T + mm(T, P, LOWP, BF16_EMUL)
    return T


def squarings(max_path_len: int) -> int:
    """Squarings for ``unit_lower_inverse`` so that the product covers A^0 .. A^(max_path_len - 1)."""
    return max(int(max_path_len - 1).bit_length() - 1, 0)


@triton.jit
def program_head(state_idx, H: tl.constexpr, G: tl.constexpr):
    """(request b, head h, its shared head h // (H // G) — GDN's key head, SSD's group — and b's
    state slot as int64) of this program; grid axis 0 is b * H + h."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    return b, h, h // (H // G), tl.load(state_idx + b).to(tl.int64)
