"""The draft's per-depth candidates from its logits: the top ``k`` tokens of each row and their softmax
probabilities, without a softmax over the vocabulary.

* :func:`vocab_topk`: API and dispatch (``kernels``: ``vllm_bole.dispatch``); on CUDA two Triton launches
  (``csrc_triton/vocab_topk.py``) instead of ~8 (the draft's step graph is bound by its kernel count);
* :func:`vocab_topk_torch`: the plain-torch twin: the top-k of the logits in their own dtype (16-bit keys:
  half the radix passes of fp32), probabilities ``exp(logit - logsumexp)`` in fp32;
* :func:`vocab_topk_reference`: float64, ties to the lower token id (the kernel's order; torch's top-k
  leaves the order of equal values unspecified).
"""
from __future__ import annotations

import torch

from vllm_bole.dispatch import use_triton

__all__ = ["vocab_topk", "vocab_topk_reference", "vocab_topk_torch"]


def vocab_topk(logits: torch.Tensor, k: int, kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [T, V] (any float dtype) -> (probabilities [T, k] fp32, tokens [T, k] int64), each row's
    ``k`` largest logits in descending order."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [T, V], got shape {tuple(logits.shape)}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k: must lie in [1, V = {logits.shape[1]}] (got {k})")
    if use_triton(kernels, logits):
        from csrc_triton.vocab_topk import vocab_topk_triton

        return vocab_topk_triton(logits, k)
    return vocab_topk_torch(logits, k)


def vocab_topk_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of :func:`vocab_topk` (measured on the H200 at 4bcef6f: a two-stage top-k, per chunk of 256
    then over the winners, was 2x slower than this at 32 rows)."""
    v, tok = logits.topk(k, dim=-1)
    return (v.float() - logits.float().logsumexp(-1, keepdim=True)).exp(), tok


def vocab_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: the ``k`` largest of each row, equal values by ascending token id; their softmax probabilities."""
    x = logits.double()
    order = torch.sort(-x, dim=-1, stable=True).indices[:, :k]
    return (x.gather(1, order) - x.logsumexp(-1, keepdim=True)).exp(), order
