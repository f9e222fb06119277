"""Sampling helpers shared by verification and the offline tree builders (engine-agnostic).

* Target distribution with vLLM ``SamplingParams`` semantics, per row: ``temperature`` (``<
  SAMPLING_EPS`` means greedy: one-hot on the argmax of the raw logits, so greedy rows can share a
  stochastic batch), then min-p (vLLM's ``MinPLogitsProcessor``: drop tokens whose probability is
  below ``min_p`` times the largest), then top-k (keep logits ``>=`` the k-th largest; ``k <= 0``
  or ``>= V`` disables), then top-p over the ascending-sorted probabilities of what top-k kept
  (drop the prefix whose cumulative mass is ``<= 1 - top_p``, always keeping the largest), as
  vLLM's ``apply_top_k_top_p``.
* Draws by inverse CDF: one uniform per token (:func:`sample_rows`; from raw logits at a temperature in one
  Triton launch, :func:`sample_logits`), and sequences of draws
  without replacement (:func:`sample_rows_without_replacement`, removed intervals skipped by
  shifting the uniform), so no ``[R, V]`` random tensors are needed.
"""
from __future__ import annotations

import torch

from vllm_bole.dispatch import use_triton

__all__ = [
    "SAMPLING_EPS",
    "apply_min_p",
    "apply_top_k_top_p",
    "per_row",
    "sample_logits",
    "sample_rows",
    "sample_rows_without_replacement",
    "target_probs",
    "uniforms",
]

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it mean greedy


# ------------------------------------------------------------------------- target distribution
def per_row(x, n: int, dtype, device) -> torch.Tensor | None:
    """A sampling parameter (None, a scalar or ``[n]``) as an ``[n]`` tensor (None stays None)."""
    if x is None:
        return None
    t = torch.as_tensor(x, dtype=dtype, device=device)
    if t.dim() == 0:
        return t.expand(n)
    if t.shape != (n,):
        raise ValueError(f"sampling parameter: expected a scalar or [{n}] tensor, got {tuple(t.shape)}")
    return t


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's top-k then top-p masking (``-inf``) of ``[N, V]`` logits (already temperature
    scaled). ``top_k`` ``[N]`` int (``<= 0`` or ``>= V``: disabled), ``top_p`` ``[N]`` float."""
    if top_k is None and top_p is None:
        return logits
    N, V = logits.shape
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)
        thresh = logits_sort.gather(1, (V - k).clamp(min=0)[:, None])
        logits_sort = logits_sort.masked_fill(logits_sort < thresh, -float("inf"))
    if top_p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = probs_sum <= 1 - top_p.to(probs_sum.dtype)[:, None]
        mask[:, -1] = False
        logits_sort = logits_sort.masked_fill(mask, -float("inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's min-p masking (``-inf``) of ``[N, V]`` temperature-scaled logits: tokens whose
    probability is below ``min_p [N]`` times the row's largest (``0``: disabled)."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    thresh = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype)[:, None]
    return logits.masked_fill(probs < thresh, -float("inf"))


def target_probs(logits: torch.Tensor, temperature, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """``[N, V]`` float32 target distribution per row (temperature, min-p, top-k, top-p).
    Rows with ``temperature < SAMPLING_EPS`` are one-hot on the argmax of the raw logits;
    ``temperature=None`` means 1."""
    N, V = logits.shape
    dev = logits.device
    x = logits.float()
    temp = per_row(1.0 if temperature is None else temperature, N, torch.float32, dev)
    greedy = temp < SAMPLING_EPS
    x = x / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    x = apply_min_p(x, per_row(min_p, N, torch.float32, dev))
    x = apply_top_k_top_p(x, per_row(top_k, N, torch.long, dev), per_row(top_p, N, torch.float32, dev))
    probs = x.softmax(-1)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


# ------------------------------------------------------------------------------------- draws
def uniforms(shape, generator: torch.Generator | None, device, dtype=torch.float32) -> torch.Tensor:
    """Uniforms in [0, 1) from ``generator`` (None: the global RNG), moved to ``device``."""
    if generator is None:
        return torch.rand(shape, device=device, dtype=dtype)
    return torch.rand(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


def _last_positive(probs: torch.Tensor) -> torch.Tensor:
    V = probs.shape[-1]
    return V - 1 - (probs > 0).flip(-1).int().argmax(-1)


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: ``probs`` ``[R, V]`` (unnormalised ok), ``u`` ``[R]`` or ``[R, n]``
    uniforms in [0, 1); returns int64 tokens of ``u``'s shape. Zero-probability tokens are never
    returned (clamped to the row's last positive token)."""
    squeeze = u.dim() == 1
    u2 = u[:, None] if squeeze else u
    p = probs.float()
    cdf = p.cumsum(-1)
    y = u2.float() * cdf[:, -1:]
    t = torch.searchsorted(cdf, y.to(cdf.dtype).contiguous(), right=True)
    t = torch.minimum(t, _last_positive(p)[:, None])
    return t[:, 0] if squeeze else t


SAMPLE_ROW_ELEMENTS = 1 << 24  # logits elements whose distributions the torch form builds at once (64 MB fp32)


def sample_logits(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, top_k=None, top_p=None,
                  min_p=None, *, kernels: str = "auto") -> torch.Tensor:
    """One token per row of ``logits`` ``[N, V]`` (any float dtype, rows strided) at ``temperature`` ``[N]``
    (greedy below ``SAMPLING_EPS``) and the optional per-row ``top_k`` / ``top_p`` / ``min_p`` ``[N]``, from the
    uniforms ``u`` ``[N]``: ``sample_rows(target_probs(...), u)``. Triton (none of top-k, top-p, min-p): one
    launch reading each row twice (``csrc_triton.sample_tokens``), no ``[N, V]`` intermediate; otherwise that
    torch form (the kernel's twin), ``SAMPLE_ROW_ELEMENTS // V`` rows at a time (no ``[N, V]`` sort at once).
    Returns ``[N]`` int64."""
    if top_k is None and top_p is None and min_p is None and use_triton(kernels, logits):
        from csrc_triton.sample_tokens import sample_logits as launch

        return launch(logits, temperature, u, SAMPLING_EPS)
    N, V = logits.shape
    n = max(1, SAMPLE_ROW_ELEMENTS // max(V, 1))
    part = lambda x, s: None if x is None else x[s : s + n]  # noqa: E731
    return torch.cat([sample_rows(target_probs(logits[s : s + n], temperature[s : s + n], part(top_k, s),
                                               part(top_p, s), part(min_p, s)), u[s : s + n])
                      for s in range(0, N, n)] or [torch.empty(0, dtype=torch.long, device=logits.device)])


def sample_rows_without_replacement(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs`` ``[R, V]``, ``u`` ``[R, E, k]``: for every ``(r, e)`` an independent sequence of
    ``k`` draws without replacement from row ``r`` (draw ``j`` ~ ``probs`` with the earlier draws
    removed, renormalised). Returns tokens ``[R, E, k]`` and ``ok`` (False when the row's
    positive mass is exhausted, or a float corner case would repeat a token)."""
    R, E, k = u.shape
    p = probs.float()
    cdf = p.cumsum(-1)  # [R, V]
    total = cdf[:, -1]  # [R]
    last = _last_positive(p)  # [R]
    tok = torch.zeros(R, E, k, dtype=torch.long, device=p.device)
    ok = torch.ones(R, E, k, dtype=torch.bool, device=p.device)
    starts = torch.zeros(R, E, 0, dtype=p.dtype, device=p.device)
    masses = torch.zeros(R, E, 0, dtype=p.dtype, device=p.device)
    rows = torch.arange(R, device=p.device)[:, None].expand(R, E)
    for j in range(k):
        remaining = total[:, None] - masses.sum(-1)  # [R, E]
        y = u[:, :, j].to(p.dtype) * remaining
        if j:
            s_sorted, order = starts.sort(-1)
            m_sorted = masses.gather(-1, order)
            for i in range(j):  # skip removed intervals in increasing position
                y = y + torch.where(s_sorted[:, :, i] <= y, m_sorted[:, :, i], torch.zeros_like(y))
        t = torch.searchsorted(cdf, y.reshape(R, E).contiguous(), right=True)
        t = torch.minimum(t, last[:, None])
        q_t = p[rows, t]
        good = (remaining > 0) & (q_t > 0)
        if j:
            good &= (tok[:, :, :j] != t[:, :, None]).all(-1)
        tok[:, :, j] = t
        ok[:, :, j] = good
        mass = torch.where(good, q_t, torch.zeros_like(q_t))
        starts = torch.cat([starts, (cdf[rows, t] - q_t)[:, :, None]], -1)
        masses = torch.cat([masses, mass[:, :, None]], -1)
    ok = ok.int().cumprod(-1).bool()  # after a failed draw the sequence stops
    return tok, ok
