"""A small causal LM (transformers) as the tree runner's drafter.

Greedy chain of ``D`` tokens per request: one forward over the history, then cached single-token
steps; the top-``k`` of the draft distribution at every depth are that depth's candidates
(:class:`~vllm_bole.spec_decode.candidates.Candidates`). In a best-first tree the first child of
every node is its most probable one, so the first-child chain from the root is the draft's greedy
chain; when the draft model is the target itself, greedy verification accepts all of it. The
cache is dropped after each draft, so nothing needs rolling back.

How the draft steps depend on the model's cache, found once at construction from a one-token
forward (:attr:`HFDraftModel.cache_kind`, an explicit check, no fallback on errors):

* ``"attention"``: transformers' ``DynamicCache`` whose layers are all plain ``DynamicLayer``
  (attention only): all requests run as ONE left-padded batch (padding masked, positions counted
  from each history's start), equal to one request at a time (tested);
* ``"past_key_values"``: any other cache returned as ``past_key_values`` (hybrid models' caches
  hold recurrent layers, which padding would enter): one unpadded batch per history length;
* ``"cache_params"``: Mamba-style ``cache_params`` (stepped with ``cache_position``): one unpadded
  batch per history length;
* ``"none"``: no cache: one full forward per depth, per history length.

Every form equals drafting one request at a time (tested).

On CPU, transformers would pick flash-linear-attention's Triton kernels whenever it can import
them (Qwen3-Next, ...), which on CPU need Triton's interpreter. FLA is hidden only while
transformers loads the model (transformers binds those kernels when it imports the model's module)
and restored afterwards, so the rest of the process keeps FLA. A model whose module was already
imported in the process with FLA importable keeps FLA's kernels (then run under
``TRITON_INTERPRET=1`` on CPU).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Sequence

import torch

from vllm_bole.spec_decode.candidates import Candidates

__all__ = ["HFDraftModel"]

CACHE_KINDS = ("attention", "past_key_values", "cache_params", "none")


@contextlib.contextmanager
def hidden_fla(enabled: bool = True):
    """Make ``import fla`` (and its submodules) fail inside the block; restore ``sys.modules`` after."""
    if not enabled:
        yield
        return
    saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k == "fla" or k.startswith("fla.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def cache_kind(out) -> str:
    """Which of :data:`CACHE_KINDS` a transformers model output's cache is (module docstring)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    pkv = getattr(out, "past_key_values", None)
    if pkv is not None:
        layers = getattr(pkv, "layers", None)
        plain = type(pkv) is DynamicCache and layers and all(type(layer) is DynamicLayer for layer in layers)
        return "attention" if plain else "past_key_values"
    return "cache_params" if getattr(out, "cache_params", None) is not None else "none"


class HFDraftModel:
    """A transformers causal LM used as the drafter (a :class:`~vllm_bole.spec_decode.candidates.Drafter`)."""

    runtime = "transformers (every step re-reads the histories)"

    def __init__(self, path: str, dtype: str = "auto", top_k: int = 8, device="cpu"):
        with hidden_fla(str(device) == "cpu"):
            import transformers

            torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
        self.device = device
        with torch.inference_mode():
            probe = self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True)
        self.cache_kind = cache_kind(probe)
        self.top_k = min(int(top_k), probe.logits.shape[-1])

    @torch.inference_mode()
    def propose(self, histories: Sequence[Sequence[int]], depths: Sequence[int], keys=None) -> Candidates:
        """Candidates ``[B, max(depths), top_k]`` (CPU): the draft's greedy chain after each
        history and its top-``k`` at every depth; empty histories and depth 0 get no draft."""
        dep = [max(int(d), 0) for d in depths]
        out = Candidates.empty(len(histories), max(dep, default=0), self.top_k)
        live = [i for i, d in enumerate(dep) if d > 0 and len(histories[i]) > 0]
        if not live:
            return out
        if self.cache_kind == "attention":  # one left-padded batch
            self._fill(out, live, dep, *self._propose_padded([histories[i] for i in live], max(dep[i] for i in live)))
            return out
        by_len: dict[int, list[int]] = {}  # recurrent caches take no padding: one batch per history length
        for i in live:
            by_len.setdefault(len(histories[i]), []).append(i)
        for rows in by_len.values():
            self._fill(out, rows, dep, *self._propose_group([histories[i] for i in rows], max(dep[i] for i in rows)))
        return out

    @staticmethod
    def _fill(out: Candidates, rows: list[int], dep: list[int], tok: torch.Tensor, prob: torch.Tensor) -> None:
        """Write ``[n, depth, K]`` proposals of ``rows`` into ``out``, each cut at its own depth."""
        idx = torch.tensor(rows)
        cut = torch.arange(tok.shape[1])[None, :] >= torch.tensor([dep[i] for i in rows])[:, None]
        out.tokens[idx, : tok.shape[1]] = tok.masked_fill(cut[..., None], -1)
        out.probs[idx, : tok.shape[1]] = prob.masked_fill(cut[..., None], 0.0)

    def _chain(self, out, depth, step) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-``k`` of the last position's draft distribution at each of ``depth`` depths from
        ``out``; ``step(out, nxt, d)`` feeds the top-1 ``nxt`` [n, 1] after depth ``d`` and returns the
        next output. ``[n, depth, K]`` tokens and probabilities."""
        toks, probs = [], []
        for d in range(depth):
            v, t = out.logits[:, -1].float().softmax(-1).topk(self.top_k, dim=-1)
            toks.append(t)
            probs.append(v)
            if d + 1 < depth:
                out = step(out, t[:, :1], d)
        return torch.stack(toks, 1).cpu(), torch.stack(probs, 1).cpu()

    def _propose_padded(self, histories, depth) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache_kind == "attention"``: every request in one left-padded batch; ``[n, depth, K]``."""
        B, L = len(histories), max(len(h) for h in histories)
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.long)
        for j, h in enumerate(histories):
            ids[j, L - len(h):] = torch.as_tensor(list(h), dtype=torch.long)
            mask[j, L - len(h):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)

        def step(out, nxt, d):
            return self.model(input_ids=nxt, attention_mask=torch.cat([mask, mask.new_ones(B, d + 1)], dim=1),
                              position_ids=pos[:, -1:] + d + 1, past_key_values=out.past_key_values, use_cache=True)

        return self._chain(self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True), depth, step)

    def _propose_group(self, histories, depth) -> tuple[torch.Tensor, torch.Tensor]:
        """Histories of one length in one unpadded batch, stepped as the cache kind allows; ``[n, depth, K]``."""
        seq = torch.tensor([list(h) for h in histories], dtype=torch.long, device=self.device)
        L, kind = seq.shape[1], self.cache_kind

        def step(out, nxt, d):
            nonlocal seq
            if kind in ("attention", "past_key_values"):
                return self.model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            if kind == "cache_params":
                pos = torch.tensor([L + d], device=self.device)
                return self.model(input_ids=nxt, cache_params=out.cache_params, cache_position=pos, use_cache=True)
            seq = torch.cat([seq, nxt], dim=1)  # no cache: recompute the whole sequence
            return self.model(input_ids=seq)

        return self._chain(self.model(input_ids=seq, use_cache=kind != "none"), depth, step)
