"""Drafters that give per-depth candidates (token, probability) to the best-first tree builder,
and the step that turns them into per-request draft trees; used by the vLLM model runner
(``vllm_bole.adapter.runner``). Engine-agnostic (torch; the draft model runs through transformers).

A drafter sees each request's token history (prompt + accepted output; its last token is the
tree's root, the bonus token the target has not processed yet) and returns, per depth
``d = 0 .. D-1``, candidate tokens for the draft node at depth ``d + 1`` with their probabilities
(:class:`Candidates`). :func:`build_draft_trees` merges the requests' candidates into one compact
vocabulary (the union of all candidates: never a dense ``[B, D, vocab]`` tensor), runs
:func:`vllm_bole.spec_decode.builders.build_best_first` (exact best-first under the node budget)
and returns per-request ``(parents, tokens)`` of the draft nodes in topological order (local
indices, root = 0, the root itself excluded from the lists).

* :class:`vllm_bole.spec_decode.ngram.NgramDrafter` (prompt lookup): earlier occurrences of the
  history's suffix vote, weighted by match length, for what followed them, depth by depth (the
  same drafter the offline acceptance benchmark measures).
* :class:`HFDraftModel`: a small causal LM with the target's tokenizer; greedy chain of ``D``
  tokens (one forward over the history, then cached single-token steps; the cache is dropped after
  each draft, so nothing needs rolling back; attention-only drafts run all requests as one padded
  batch, :meth:`HFDraftModel.candidates_batch`), the top-``k`` of the
  draft distribution at every depth are the candidates. In a best-first tree the first child of
  every node is its most probable one, so the first-child chain from the root is the draft's greedy
  chain; when the draft model is the target itself, greedy verification accepts all of it.
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch

from vllm_bole.spec_decode.builders import build_best_first
from vllm_bole.spec_decode.candidates import EMPTY, Candidates

__all__ = ["HFDraftModel", "build_draft_trees"]


class HFDraftModel:
    """A transformers causal LM used as the drafter (CPU reference: no cache reuse across steps)."""

    def __init__(self, path: str, dtype: str = "auto", top_k: int = 8, device="cpu"):
        if str(device) == "cpu" and "fla" not in sys.modules:
            # transformers picks flash-linear-attention's Triton kernels whenever it can import them
            # (Qwen3-Next, ...); on CPU they need Triton's interpreter and its workarounds: use the torch path.
            sys.modules["fla"] = None  # type: ignore[assignment]
        import transformers

        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
        self.top_k = top_k
        self.device = device
        self._cached: bool | None = None  # None: not tried yet; False: the model's cache API is not supported
        self._batched: bool | None = None  # None: not tried yet; False: no padded batching (recurrent cache)

    @torch.inference_mode()
    def candidates(self, history: Sequence[int], depth: int) -> Candidates:
        if depth <= 0:
            return EMPTY
        if self._cached is not False:
            try:
                c = self._candidates_cached(history, depth)
                self._cached = True
                return c
            except Exception:  # noqa: BLE001 - a model whose cache API differs: recompute instead
                if self._cached:
                    raise
                self._cached = False
        return self._candidates_full(history, depth)

    @torch.inference_mode()
    def candidates_batch(self, histories: Sequence[Sequence[int]], depths: Sequence[int]) -> list[Candidates]:
        """:meth:`candidates` for many requests at once. A draft with a plain attention cache
        (transformers' ``DynamicCache``) runs them together: one forward over the left-padded
        histories (padding masked, positions counted from each history's start), then single-token
        steps for all; a draft with a recurrent cache (Mamba2, GDN) goes request by request."""
        out = [EMPTY] * len(histories)
        live = [i for i, d in enumerate(depths) if d > 0 and len(histories[i]) > 0]
        if not live:
            return out
        if self._batched is not False:
            got = self._candidates_padded([histories[i] for i in live], max(depths[i] for i in live))
            self._batched = got is not None
            if got is not None:
                for j, i in enumerate(live):
                    out[i] = Candidates(got[j].tokens[: depths[i]], got[j].probs[: depths[i]])
                return out
        for i in live:
            out[i] = self.candidates(histories[i], depths[i])
        return out

    def _candidates_padded(self, histories, depth) -> list[Candidates] | None:
        """None when the model's cache is not plain attention in every layer (transformers'
        ``DynamicCache`` of ``DynamicLayer``\ s): padding would enter a recurrent state."""
        B, L = len(histories), max(len(h) for h in histories)
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.long)
        for j, h in enumerate(histories):
            ids[j, L - len(h):] = torch.as_tensor(list(h), dtype=torch.long)
            mask[j, L - len(h):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache = getattr(out, "past_key_values", None)
        layers = getattr(cache, "layers", None)
        if type(cache).__name__ != "DynamicCache" or not layers or any(
                type(layer).__name__ != "DynamicLayer" for layer in layers):
            return None
        toks, probs = [[] for _ in range(B)], [[] for _ in range(B)]
        for d in range(depth):
            p = out.logits[:, -1].float().softmax(-1)
            v, t = p.topk(min(self.top_k, p.shape[-1]), dim=-1)
            v, t_cpu = v.cpu(), t.cpu()
            for j in range(B):
                toks[j].append(t_cpu[j])
                probs[j].append(v[j])
            if d + 1 == depth:
                break
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=t[:, :1], attention_mask=mask, position_ids=pos,
                             past_key_values=out.past_key_values, use_cache=True)
        return [Candidates(toks[j], probs[j]) for j in range(B)]

    def _candidates_full(self, history, depth):
        seq = list(history)
        toks, probs = [], []
        for _ in range(depth):  # one full forward per depth
            ids = torch.tensor([seq], dtype=torch.long, device=self.device)
            p = self.model(input_ids=ids).logits[0, -1].float().softmax(-1)
            v, t = p.topk(min(self.top_k, p.numel()))
            toks.append(t.cpu())
            probs.append(v.cpu())
            seq.append(int(t[0]))
        return Candidates(toks, probs)

    def _candidates_cached(self, history, depth):
        """One forward over the history, then single-token steps on a fresh cache (``past_key_values``,
        or Mamba2's ``cache_params``); the cache is dropped afterwards (nothing to roll back)."""
        ids = torch.tensor([list(history)], dtype=torch.long, device=self.device)
        n = ids.shape[1]
        out = self.model(input_ids=ids, use_cache=True)
        toks, probs = [], []
        for d in range(depth):
            p = out.logits[0, -1].float().softmax(-1)
            v, t = p.topk(min(self.top_k, p.numel()))
            toks.append(t.cpu())
            probs.append(v.cpu())
            if d + 1 == depth:
                break
            nxt = t[:1].view(1, 1)
            pkv = getattr(out, "past_key_values", None)
            if pkv is not None:
                out = self.model(input_ids=nxt, past_key_values=pkv, use_cache=True)
            else:
                pos = torch.tensor([n + d], device=self.device)
                out = self.model(input_ids=nxt, cache_params=out.cache_params, cache_position=pos, use_cache=True)
        return Candidates(toks, probs)


def build_draft_trees(
    roots: Sequence[int], cands: Sequence[Candidates], budget, *, max_depth: int, top_k: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """Best-first trees from per-depth candidates. Returns per request ``(parents, tokens)`` of
    the draft nodes (local indices, root = 0 excluded, topological order); empty lists when the
    request has no candidates. ``budget``: draft nodes per request (int or per-request list)."""
    B = len(roots)
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in range(B)]
    budgets = [int(budget)] * B if isinstance(budget, int) else [int(b) for b in budget]
    live = [r for r in range(B) if cands[r].depth > 0 and budgets[r] > 0]
    if not live:
        return out
    D = min(max_depth, max(cands[r].depth for r in live))
    vocab = torch.unique(torch.cat([t for r in live for t in cands[r].tokens[:D]]))
    U = vocab.numel()
    marg = torch.zeros(len(live), D, U, dtype=torch.float32)
    for i, r in enumerate(live):
        for d, (t, p) in enumerate(zip(cands[r].tokens[:D], cands[r].probs[:D])):
            marg[i, d, torch.searchsorted(vocab, t)] = p.float()
    root_local = torch.zeros(len(live), dtype=torch.long)  # the root's token plays no part in the build
    dt = build_best_first(root_local, marg, torch.tensor([budgets[r] for r in live]), max_depth=D, top_k=top_k)
    cu = dt.tree.cu_nodes.tolist()
    par = dt.tree.parent.tolist()
    tok = vocab[dt.tree.token_ids.clamp(max=U - 1)].tolist()
    for i, r in enumerate(live):
        s, e = cu[i], cu[i + 1]
        out[r] = (par[s + 1 : e], tok[s + 1 : e])
    return out
