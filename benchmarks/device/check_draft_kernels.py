"""The paged draft's Triton kernels on the H200 against their torch twins, each timed inside a CUDA graph
(as the draft's step graph runs them), at the pair's draft shapes (hidden 256, 4 heads of 64, MLP 768,
49152-token vocabulary, top-8) and batch 1..256:

* ``vocab_topk`` (two launches): tokens equal to the float64 reference (ties to the lower id),
  probabilities within 2e-6 relative (bf16 and fp32 logits);
* ``decoder_ops`` (``add_rms_norm``, ``rope_write``, ``silu_mul``; one launch each): in bf16 the fraction of
  outputs bitwise equal to the twin's and the largest difference in units of the last place at the
  outputs' largest magnitude (the GPU
  rounds to nearest even, as torch: expected equal, up to the reduction order of the norm; the CPU
  interpreter truncates instead, so its tests bound two units).

Writes ``draft_kernels.json``: ``equal`` (vocab_topk equal everywhere, decoder ops within 1 ulp) and
``rows`` (``op, batch, dtype, twin_us, kernel_us, speedup``, and ``equal`` or ``same_frac``, ``max_ulps``).

    python3 benchmarks/device/check_draft_kernels.py
    TRITON_INTERPRET=1 python3 benchmarks/device/check_draft_kernels.py   # CPU: a dry run, no times
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import bench_graph_ms, write_results  # noqa: E402

from vllm_bole.spec_decode import decoder_ops  # noqa: E402
from vllm_bole.spec_decode.vocab_topk import vocab_topk, vocab_topk_reference  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, MLP, VOCAB, TOP_K = 256, 4, 64, 768, 49152, 8


def timed(row: dict, fn) -> dict:
    """``row`` with the twin's and the kernel's graph-replay times (CUDA only)."""
    if torch.cuda.is_available():
        ms = {k: bench_graph_ms(lambda k=k: fn(k)) for k in ("torch", "triton")}
        row.update(twin_us=round(ms["torch"] * 1e3, 1), kernel_us=round(ms["triton"] * 1e3, 1),
                   speedup=round(ms["torch"] / ms["triton"], 2))
    return row


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Bitwise-equal fraction of ``b`` against ``a`` and the largest difference in bf16 units of last place at
    the largest magnitude of ``a`` (not of each element: RoPE's sums cancel, and an element near zero would
    count a last-place difference of its operands as hundreds of its own)."""
    a, b = a.float(), b.float()
    ulp = torch.finfo(torch.bfloat16).eps * a.abs().max().clamp(min=torch.finfo(torch.bfloat16).tiny)
    return dict(same_frac=round(float((a == b).float().mean()), 5), max_ulps=round(float((a - b).abs().max() / ulp), 2))


def ops_cases(B: int, dev: str, g: torch.Generator) -> dict:
    """op -> fn(kernels) returning its outputs, on the draft's shapes for ``B`` tokens (bf16)."""
    bf = dict(dtype=torch.bfloat16, device=dev)
    r = lambda *s: torch.randn(*s, generator=g).to(**bf)  # noqa: E731
    res, h, w = r(B, HIDDEN), r(B, HIDDEN), r(HIDDEN)
    qkv = r(B, 3 * HEADS, HEAD_DIM)
    P, pages, page = 1024, B + 4, 16
    ang = torch.arange(P)[:, None] / (10000 ** (torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)))[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(**bf)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to(**bf)
    pos = torch.randint(0, P, (B,), generator=g).to(dev)
    slots = (torch.randperm(pages * page, generator=g)[:B]).to(dev)
    kc, vc = (torch.zeros(pages, page, HEADS, HEAD_DIM, **bf) for _ in range(2))
    gu = r(B, 2 * MLP)

    def rope(k):
        q = decoder_ops.rope_write(qkv[:, : 2 * HEADS], qkv[:, 2 * HEADS:], cos, sin, pos, slots, kc, vc, HEADS, k)
        return torch.cat([q.reshape(B, -1), kc.view(-1, HEADS * HEAD_DIM)[slots]], 1)

    return dict(add_rms_norm=lambda k: torch.cat(decoder_ops.add_rms_norm(res, h, w, 1e-5, k), 1), rope_write=rope,
                silu_mul=lambda k: decoder_ops.silu_mul(gu[:, :MLP], gu[:, MLP:], k))


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    batches = (1, 8, 32, 128, 256) if dev == "cuda" else (1, 3)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for B in batches:
            x = (torch.randn(B, VOCAB, generator=g) * 3).to(dtype).to(dev)
            p, t = vocab_topk(x, TOP_K, kernels="triton")
            rp, rt = vocab_topk_reference(x.cpu(), TOP_K)
            same = bool(torch.equal(t.cpu(), rt)) and bool(torch.allclose(p.cpu().double(), rp, rtol=2e-6, atol=1e-9))
            rows.append(timed(dict(op="vocab_topk", batch=B, dtype=str(dtype).split(".")[-1], equal=same),
                              lambda k: vocab_topk(x, TOP_K, kernels=k)))
            print(rows[-1], flush=True)
    for B in batches:
        for op, fn in ops_cases(B, dev, g).items():
            rows.append(timed(dict(op=op, batch=B, dtype="bfloat16", **agreement(fn("torch"), fn("triton"))), fn))
            print(rows[-1], flush=True)
    ok = all(r["equal"] for r in rows if "equal" in r) and all(r["max_ulps"] <= 1.0 for r in rows if "max_ulps" in r)
    write_results("draft_kernels.json", rows, dict(equal=ok))


if __name__ == "__main__":
    main()
