"""Drafters on the target's own last hidden state (engine-agnostic: torch only): the one-pass block
drafter and the MTP drafter. Both draft from what the target just computed, with the target's LM head.

After a step, request ``b``'s new root ``t_0`` is the token the target just emitted from its final
hidden state ``h`` [H] (of the last accepted node, or the last prompt token). Depths ``d = 1 .. D``
(the ``d``-th token after the root):

* **block** (:class:`BlockHead`, BASTION / Medusa family): every depth from ``h`` alone, in one call,
  ``z_d = h + SiLU(W_d h + b_d)`` (``W`` [D, H, H], ``b`` [D, H]);
* **mtp** (:class:`MTPHead`, multi-token prediction applied recurrently): one block, step by step,
  ``s_0 = h``, ``s_d = s_{d-1} + SiLU(W [s_{d-1}; E t_{d-1}] + b)`` with ``t_{d-1}`` the previous
  depth's top token (the root at ``d = 1``; ``E`` [V, Ht] its own small token embedding), so each
  depth knows the chain before it; ``D`` small calls.

``p_d = softmax(lm_head(z_d))`` with the TARGET's LM head (``logits_fn``: the engine's own, so
vocabulary sharding and soft-capping are the target's); its top-``K`` per depth are
:class:`~vllm_bole.spec_decode.candidates.Candidates` (per-depth marginals: depth ``d``'s candidates
continue any node of depth ``d - 1``), which the best-first builder turns into a tree.

Decisions. Residual heads rather than DFlash's attention block or vLLM's MTP decoder layer: nothing
kept per request (no KV or recurrent state of the drafter to roll back, evict or flush), a block step
costs one matmul and one LM-head call whatever the tree's width (BASTION's point: a wide tree costs
what a chain costs to draft), and both train in a minute on the frozen target
(``benchmarks/train_pair.py --model block --model mtp``), self-distilled: the labels are the target's
own greedy tokens. ``W = 0, b = 0`` gives every depth of a block head the target's own next-token
distribution (tests).

Checkpoint: a directory with ``block_drafter.json`` (``kind`` block or mtp, ``hidden_size``,
``depth``; mtp: ``vocab_size``, ``token_dim``) and ``block_drafter.safetensors``.
"""
from __future__ import annotations

import abc
import contextlib
import json
import os
from typing import Callable, Sequence

import torch

from vllm_bole.spec_decode.best_first import (PACKED_FIELDS, SEARCH_WIDTH, Slots, best_first_slots, budgets,
                                              level_search_packed, root_only_packed, unpack_slots)
from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES
from vllm_bole.spec_decode.step_graphs import GraphedStep, bucket, capture_graph
from vllm_bole.spec_decode.vocab_topk import vocab_topk
from vllm_bole.transfer import SideStream, download_async, pack, unpack, upload, upload_many

CONFIG = "block_drafter.json"
WEIGHTS = "block_drafter.safetensors"

__all__ = ["BlockHead", "HeadDrafter", "MTPHead", "check_head_dir", "load_head"]

Logits = Callable[[torch.Tensor], torch.Tensor]  # [N, H] -> [N, V]: the target's LM head


class _Head(torch.nn.Module, abc.ABC):
    """What a drafter's head is: :class:`BlockHead` and :class:`MTPHead` implement it."""

    kind: str
    needs_roots = False  # whether ``logits`` reads the roots

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @abc.abstractmethod
    def config(self) -> dict:
        """The sizes the checkpoint records (``block_drafter.json`` beside ``kind``)."""

    @abc.abstractmethod
    def logits(self, h: torch.Tensor, roots: torch.Tensor | None, depth: int, lm: Logits) -> torch.Tensor:
        """``[B, depth, V]`` logits of depths ``1 .. depth`` after roots ``[B]`` from hidden states ``[B, H]``."""

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG), "w") as f:
            json.dump(dict(kind=self.kind, **self.config()), f)
        save_file({k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()},
                  os.path.join(path, WEIGHTS))


class BlockHead(_Head):
    """``D`` residual blocks on a hidden state: ``[N, H] -> [N, D, H]``, every depth at once."""

    kind = "block"

    def __init__(self, hidden_size: int, depth: int):
        super().__init__()
        self.hidden_size, self.depth = int(hidden_size), int(depth)
        self.weight = torch.nn.Parameter(torch.zeros(self.depth, self.hidden_size, self.hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(self.depth, self.hidden_size))

    def config(self) -> dict:
        return dict(hidden_size=self.hidden_size, depth=self.depth)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, None, :] + torch.nn.functional.silu(torch.einsum("nh,dkh->ndk", h, self.weight) + self.bias)

    def logits(self, h, roots, depth, lm):
        B = h.shape[0]
        return lm(self(h)[:, :depth].reshape(B * depth, -1)).view(B, depth, -1)


class MTPHead(_Head):
    """One residual block over (state, token) applied recurrently: ``s_d = s_{d-1} + SiLU(W [s_{d-1};
    E t_{d-1}] + b)``; trained for ``depth`` steps."""

    kind = "mtp"
    needs_roots = True

    def __init__(self, hidden_size: int, depth: int, vocab_size: int, token_dim: int = 128):
        super().__init__()
        self.hidden_size, self.depth = int(hidden_size), int(depth)
        self.vocab_size, self.token_dim = int(vocab_size), int(token_dim)
        self.embed = torch.nn.Embedding(self.vocab_size, self.token_dim)
        self.proj = torch.nn.Linear(self.hidden_size + self.token_dim, self.hidden_size)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def config(self) -> dict:
        return dict(hidden_size=self.hidden_size, depth=self.depth, vocab_size=self.vocab_size,
                    token_dim=self.token_dim)

    def forward(self, s: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One step: states ``[N, H]`` and the previous depth's tokens ``[N]`` -> the next states."""
        x = torch.cat([s, self.embed(tokens).to(s.dtype)], -1)
        return s + torch.nn.functional.silu(self.proj(x))

    def logits(self, h, roots, depth, lm):
        out, s, t = [], h, roots
        for _ in range(depth):
            s = self(s, t)
            out.append(lm(s))
            t = out[-1].argmax(-1)
        return torch.stack(out, 1)


HEADS = {"block": BlockHead, "mtp": MTPHead}


def check_head_dir(path: str, kind: str, hidden_size: int | None = None) -> dict:
    """The head's config; a one-line error naming ``model`` when ``path`` is not a checkpoint of drafter
    ``kind``, or was trained for another hidden size than the target's ``hidden_size``."""
    try:
        with open(os.path.join(path, CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {path!r} is not a {kind} drafter checkpoint ({CONFIG}: {e}); drafter '{kind}' needs "
                         f"a directory its head's save wrote (benchmarks/train_pair.py --model {kind})") from None
    if cfg.get("kind") != kind:
        raise ValueError(f"model: {path!r} holds a {cfg.get('kind')!r} drafter, not {kind!r}")
    if not os.path.isfile(os.path.join(path, WEIGHTS)):
        raise ValueError(f"model: {path!r} has {CONFIG} but no {WEIGHTS}")
    if hidden_size is not None and cfg.get("hidden_size") != hidden_size:
        raise ValueError(f"model: the {kind} drafter {path!r} was trained for hidden size {cfg.get('hidden_size')}, "
                         f"the target's is {hidden_size}")
    return cfg


def load_head(path: str, kind: str, device="cpu", dtype=torch.float32) -> _Head:
    from safetensors.torch import load_file

    cfg = check_head_dir(path, kind)
    head = HEADS[kind](**{k: v for k, v in cfg.items() if k != "kind"})
    head.load_state_dict(load_file(os.path.join(path, WEIGHTS)))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


class HeadDrafter(GraphedStep):
    """A :class:`~vllm_bole.spec_decode.candidates.Drafter` over the target's hidden states: the runner
    hands it each request's last hidden state (:meth:`condition`) before every ``propose`` or
    :meth:`grow_trees_async`.

    Its trees are searched on the device (:meth:`grow_trees_async`: the heads, the top-k of their
    marginals and :func:`~vllm_bole.spec_decode.best_first.level_search_packed` queued behind the step,
    only the packed trees copied to the host; on CUDA one graph replay per batch bucket), equal to the host
    search over :meth:`propose`'s candidates. Decision (H100, 516ffa5, ``e2e_throughput_heads.json``): the
    host path (candidates to the host, a synchronisation, the best-first search in numpy) made a heads' tree
    step at c = 1 ~1.7 ms longer than the paged draft model's, whose search already ran on the device; the
    search launched op by op still took 1.15-1.9 ms at every batch (``heads_draft_4b5e8fe.json``, ``heads_draft.json``),
    one graph replay 0.49-1.66 ms.
    ``depth``: the depth the runner drafts (capped at the head's), the graphs' fixed depth. The graphs' pool
    holds the largest captured bucket's logits, ``[B, depth, V]`` in the head's dtype (the eager search
    allocates them too)."""

    graphs_of = "the heads' searches"

    def __init__(self, head: _Head, logits_fn: Logits, top_k: int, max_budget: int = MAX_NODES - 1,
                 depth: int | None = None, kernels: str = "auto", cuda_graphs: bool = True):
        if not 0 <= int(max_budget) < MAX_NODES:
            raise ValueError(f"max_budget: {max_budget}, need 0 <= max_budget < {MAX_NODES}")
        self.head, self.logits_fn, self.top_k, self.kernels = head, logits_fn, int(top_k), kernels
        self.depth = min(head.depth, head.depth if depth is None else int(depth))
        self.slots = int(max_budget) + 1  # the device search's slots per request (the root and the drafts)
        self._hidden: torch.Tensor | None = None
        self.device = next(head.parameters()).device
        self._side = SideStream(self.device)
        self._init_graphs(self.device, cuda_graphs)

    @property
    def runtime(self) -> str:
        """How it drafts (the engine's start-up line)."""
        return (f"{self.head.kind} heads on the target's hidden state, depth {self.head.depth}, search on the device "
                f"({self.graphs_runtime})")

    def condition(self, hidden: torch.Tensor) -> None:
        """``hidden`` [B, H]: row ``b`` is the final hidden state that emitted request ``b``'s root."""
        self._hidden = hidden

    def after(self, tensors) -> contextlib.AbstractContextManager:
        """Where a launch reading the device ``tensors`` (pending tokens) and the conditioned hidden states
        runs (:class:`~vllm_bole.transfer.SideStream`)."""
        return self._side.after([*tensors, *(() if self._hidden is None else (self._hidden,))])

    def _take_hidden(self, B: int, D: int) -> torch.Tensor | None:
        """The conditioned hidden states ``[B, H]`` in the head's dtype (None when nothing is drafted, ``D`` 0),
        forgotten here: each drafting call needs its own."""
        h, self._hidden = self._hidden, None
        if D == 0:
            return None
        if h is None or h.shape[0] != B:
            raise RuntimeError(f"{self.head.kind} drafter: condition() must give {B} hidden states before drafting "
                               f"(got {None if h is None else tuple(h.shape)})")
        return h.to(self.head.dtype)

    def _marginals(self, h, root, dep, D: int):
        """(probabilities fp32, tokens int64) ``[B, D, top_k]``: the heads' top-k of depths ``1 .. D`` from hidden
        states ``h`` [B, H] after roots ``root`` [B] (read by the MTP head), a request's depths beyond ``dep`` [B]
        cut (0, -1). Device tensors only, no host synchronisation (a graph's body)."""
        B = h.shape[0]
        logits = self.head.logits(h, root, D, self.logits_fn)
        k = min(self.top_k, logits.shape[-1])
        probs, tokens = (x.view(B, D, k) for x in vocab_topk(logits.reshape(B * D, -1), k, self.kernels))
        cut = (torch.arange(D, device=h.device)[None, :] >= dep[:, None])[..., None]
        return probs.masked_fill(cut, 0.0), tokens.masked_fill(cut, -1)

    def _search(self, h, root, dep, caps, cal, D: int, k: int) -> torch.Tensor:
        """:meth:`_marginals`' best-first trees ``[B, slots, PACKED_FIELDS]`` float64 over their first ``k``
        candidates, ``caps`` [B] draft nodes, ``cal`` [MAX_DEPTH + 1, 3] factors; no host synchronisation."""
        probs, tokens = self._marginals(h, root, dep, D)
        return level_search_packed(root, probs[..., :k], tokens[..., :k], caps, self.slots, cal, kernels=self.kernels)

    @torch.inference_mode()
    def propose(self, histories: Sequence, depths: Sequence[int], keys=None) -> Candidates:
        """Candidates ``[B, min(max(depths), head depth), top_k]`` on the CPU after each history's last
        token (the root)."""
        B = len(histories)
        dep = [max(min(int(d), self.head.depth), 0) for d in depths]
        h = self._take_hidden(B, max(dep, default=0))
        if h is None:
            return Candidates.empty(B, 0, self.top_k)
        roots = torch.tensor([int(x[-1]) if len(x) else 0 for x in histories])
        root, dep_d = upload_many([roots, torch.tensor(dep)], h.device)
        probs, tokens = self._marginals(h, root, dep_d, max(dep))
        return Candidates(tokens.cpu(), probs.cpu())

    @torch.inference_mode()
    def grow_trees_async(self, roots, histories: Sequence, depths: Sequence[int], budget, *, keys=None,
                         max_depth: int, top_k: int | None = None, calibration: torch.Tensor | None = None,
                         pending=None) -> Callable[[], Slots]:
        """The best-first trees of ``budget`` draft nodes (int or [B]) per request over the heads'
        marginals, as the search's :class:`Slots` (CPU), returned by the callable this returns: searched
        on the device now (on CUDA a graph replay when ``max_depth`` caps at the drafter's ``depth`` and
        ``top_k`` its own), read when it is called. Equal to
        :func:`~vllm_bole.spec_decode.best_first.best_first_slots` of :meth:`propose` (same arguments). A
        budget over ``max_budget`` or a search wider than ``SEARCH_WIDTH`` is searched on the host instead
        (at once). ``pending`` (tokens ``[B, W]``, -1 padded, counts ``[B]``, on the device): each
        request's tokens after its history that the host has not read yet; the roots are then the last
        of them, taken on the device (``roots`` are not read)."""
        B = len(histories)
        caps = budgets(budget, B, "cpu")
        k = min(int(top_k or self.top_k), self.top_k)
        if (B and int(caps.max()) >= self.slots) or self.slots * (1 + k) > SEARCH_WIDTH:
            if pending is not None:  # a host search needs the roots on the host
                tok, cnt = (t.cpu() for t in pending)
                roots = tok.gather(1, (cnt - 1)[:, None]).squeeze(1).tolist()
                histories = [[r] for r in roots]  # propose reads each history's last token only
            found = best_first_slots(roots, self.propose(histories, depths), caps, max_depth=max_depth, top_k=top_k,
                                     calibration=calibration)
            return lambda: found
        cap = min(self.head.depth, int(max_depth))
        dep = [max(min(int(d), cap), 0) for d in depths]
        h = self._take_hidden(B, max(dep, default=0))
        if pending is not None:
            tok, cnt = pending
            root = tok.gather(1, (cnt - 1)[:, None]).squeeze(1).long()
        else:
            root = upload(torch.as_tensor(list(roots), dtype=torch.long).reshape(B), self.device)
        cal = torch.ones(MAX_DEPTH + 1, 3) if calibration is None else calibration.float()
        tree = None
        if h is None:
            tree = root_only_packed(root, self.slots)
        elif self.cuda_graphs and cap == self.depth and k == self.top_k and B <= self.buckets[-1]:
            try:
                tree = self._replay(h, root, dep, caps, cal)
            except RuntimeError as e:
                self._graphs_failed(e)
        if tree is None:
            dep_d, caps_d, cal_d = upload_many([torch.tensor(dep), caps, cal], self.device)
            tree = self._search(h, root, dep_d, caps_d, cal_d, max(dep), k)
        read = download_async(tree)
        return lambda: unpack_slots(read())

    def _step_graph(self, B: int):
        """(graph, static buffers) of :meth:`_search` at the drafter's ``depth`` for a batch bucket of ``B`` rows:
        the buffers hold every tensor the graph reads; ``inputs`` packs ``root``, ``dep``, ``caps`` and ``cal``
        (one copy a call)."""
        if B not in self._graphs:
            like = [torch.empty(B, dtype=torch.long)] * 3 + [torch.empty(MAX_DEPTH + 1, 3)]
            host, spans = pack(like)
            packed = torch.zeros_like(host, device=self.device)
            bufs = dict(zip(("root", "dep", "caps", "cal"), unpack(packed, like, spans)), inputs=packed,
                        h=torch.zeros(B, self.head.hidden_size, dtype=self.head.dtype, device=self.device),
                        tree=torch.zeros(B, self.slots, len(PACKED_FIELDS), dtype=torch.float64, device=self.device))
            bufs["cal"].fill_(1.0)

            def run():
                bufs["tree"].copy_(self._search(bufs["h"], bufs["root"], bufs["dep"], bufs["caps"], bufs["cal"],
                                                self.depth, self.top_k))

            self._graphs[B] = (capture_graph(run, self.device, self._graph_pool()), bufs)
        return self._graphs[B]

    def _replay(self, h, root, dep: list, caps: torch.Tensor, cal: torch.Tensor) -> torch.Tensor:
        """:meth:`_search`'s trees ``[n, slots, PACKED_FIELDS]`` (a view of the bucket's buffer) through the
        graph of the bucket holding the ``n`` rows of ``h``; padding rows draft nothing."""
        n = h.shape[0]
        graph, bufs = self._step_graph(bucket(n, self.buckets))
        B = bufs["h"].shape[0]
        pad = lambda x: torch.cat([x, x.new_zeros(B - n)])  # noqa: E731
        host, _ = pack([torch.zeros(B, dtype=torch.long), pad(torch.tensor(dep)), pad(caps), cal],
                       pin=self.device.type == "cuda")
        bufs["inputs"].copy_(host, non_blocking=True)
        bufs["root"][:n].copy_(root)
        bufs["h"][:n].copy_(h)
        graph.replay()
        return bufs["tree"][:n]
