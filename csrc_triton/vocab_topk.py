"""The draft's top-k over the vocabulary with its softmax probabilities, in two launches (Triton).

Per row of logits ``[T, V]``: the ``K`` largest logits (ties: the lower token id first), and their
probabilities ``exp(logit - logsumexp(row))`` in fp32. In torch the same is a top-k, two casts, a
log-sum-exp (itself several reductions), a subtraction and an exponential: ~8 launches per draft forward,
one forward per tree depth inside the draft's step graph, which the H200 showed bound by its kernel
count (the vocabulary's log-sum-exp alone 81 us of a 1.05 ms step at B = 1).

* ``vocab_topk_chunk_kernel``, program (row, chunk of ``CHUNK`` ids): the chunk's max, its sum of
  ``exp(x - max)`` and its top ``K`` (values and ids, by ``K`` rounds of max-and-mask, one reduction each,
  the first of equal values taken, so the lower id);
* ``vocab_topk_merge_kernel``, program (row): the row's log-sum-exp from the chunks' (max, sum), and
  the top ``K`` of the chunks' ``NC * K`` candidates (chunk-major: among equal values the lower chunk,
  so again the lower id).

API and dispatch: :func:`vllm_bole.spec_decode.vocab_topk.vocab_topk`; plain-torch twin and float64
reference beside it (``vocab_topk_torch``, ``vocab_topk_reference``).
"""
import triton
import triton.language as tl


@triton.jit
def vocab_topk_chunk_kernel(logits, cval, cidx, cmax, csum, V, s_row, NC, K: tl.constexpr, K_P: tl.constexpr,
                            CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    o = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits + row * s_row + o, mask=o < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(o < V, tl.exp(x - m), 0.0), 0)
    at = (row * NC + c)
    tl.store(cmax + at, m)
    tl.store(csum + at, s)
    k = tl.arange(0, K_P)
    vals = tl.full([K_P], float("-inf"), tl.float32)
    ids = tl.zeros([K_P], tl.int64)
    for i in tl.static_range(K):
        v, j = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        vals = tl.where(k == i, v, vals)
        ids = tl.where(k == i, c * CHUNK + j, ids)
        x = tl.where(tl.arange(0, CHUNK) == j, float("-inf"), x)
    tl.store(cval + at * K + k, vals, mask=k < K)
    tl.store(cidx + at * K + k, ids, mask=k < K)


@triton.jit
def vocab_topk_merge_kernel(cval, cidx, cmax, csum, probs, tokens, NC, K: tl.constexpr, K_P: tl.constexpr,
                            NC_P: tl.constexpr, M_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ci = tl.arange(0, NC_P)
    mc = tl.load(cmax + row * NC + ci, mask=ci < NC, other=float("-inf"))
    sc = tl.load(csum + row * NC + ci, mask=ci < NC, other=0.0)
    big = tl.max(mc, 0)
    lse = big + tl.log(tl.sum(tl.where(ci < NC, sc * tl.exp(mc - big), 0.0), 0))
    r = tl.arange(0, M_P)
    x = tl.load(cval + row * NC * K + r, mask=r < NC * K, other=float("-inf"))
    ids = tl.load(cidx + row * NC * K + r, mask=r < NC * K, other=0)
    k = tl.arange(0, K_P)
    out_v = tl.zeros([K_P], tl.float32)
    out_i = tl.zeros([K_P], tl.int64)
    for i in tl.static_range(K):
        v, j = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        t = tl.sum(tl.where(r == j, ids, 0), 0)
        out_v = tl.where(k == i, v, out_v)
        out_i = tl.where(k == i, t, out_i)
        x = tl.where(r == j, float("-inf"), x)
    tl.store(probs + row * K + k, tl.exp(out_v - lse), mask=k < K)
    tl.store(tokens + row * K + k, out_i, mask=k < K)


CHUNK = 4096


def vocab_topk_triton(logits, k: int):
    """Launch both kernels; arguments and results as :func:`vllm_bole.spec_decode.vocab_topk.vocab_topk`."""
    import torch

    T, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunk = min(CHUNK, triton.next_power_of_2(V))
    nc = triton.cdiv(V, chunk)
    dev = logits.device
    cval = torch.empty(T, nc, k, dtype=torch.float32, device=dev)
    cidx = torch.empty(T, nc, k, dtype=torch.int64, device=dev)
    cmax = torch.empty(T, nc, dtype=torch.float32, device=dev)
    csum = torch.empty(T, nc, dtype=torch.float32, device=dev)
    probs = torch.empty(T, k, dtype=torch.float32, device=dev)
    tokens = torch.empty(T, k, dtype=torch.int64, device=dev)
    if T:
        k_p = triton.next_power_of_2(k)
        vocab_topk_chunk_kernel[(T, nc)](logits, cval, cidx, cmax, csum, V, logits.stride(0), nc, K=k, K_P=k_p,
                                         CHUNK=chunk, num_warps=8)
        vocab_topk_merge_kernel[(T,)](cval, cidx, cmax, csum, probs, tokens, nc, K=k, K_P=k_p,
                                      NC_P=triton.next_power_of_2(nc), M_P=triton.next_power_of_2(nc * k))
    return probs, tokens
