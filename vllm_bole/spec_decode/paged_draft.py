"""The draft model inside the engine: an attention-only transformers causal LM run incrementally over
its own paged KV cache, every request of a step in one batch, each step one CUDA graph replay.

Per request (``key``: the engine's request id) the drafter keeps the tokens whose K/V its pages hold
(the longest prefix of the request's history it has processed). One :meth:`PagedDraftModel.propose`:

1. **prefill** (eager, rare): a request with more than ``S = depth + 1`` uncached tokens (its prompt,
   or a catch-up after an eviction) runs all but its last ``S`` through packed forwards, each request
   a causal chain over its cached prefix (tree attention with a chain mask, at most :data:`CHUNK`
   tokens per request per forward);
2. **step** (:meth:`PagedDraftModel._step`): every request's last uncached tokens (the accepted
   tokens and the root: at most ``S`` in steady state) in ONE forward of ``S`` slots per request
   (junk after the real tokens, at chain positions), the depth-1 top-``k`` at the last real one;
   then ``D - 1`` forwards of one token per request (the previous depth's top-1, at position
   ``len + d - 1``), each giving the next depth's top-``k``; for :meth:`PagedDraftModel.grow_trees`
   then the best-first search over those candidates on the device
   (:func:`~vllm_bole.spec_decode.best_first.level_search_packed`, one Triton launch on CUDA; on the
   host it cost 0.6 ms at one request and ~6 ms at 128 on the H200's host), so only the trees cross
   to the host. On CUDA the
   whole step replays one CUDA graph, captured per batch bucket (:data:`~vllm_bole.spec_decode.step_graphs.BUCKETS`) in the engine's
   warm-up (on the H200 a catch-up through transformers' eager modules took ~6 ms of host time per
   step).

The chain's own K/V (positions ``>= len(history)``) is scratch: only the history counts as cached,
so tokens accepted from the chain are recomputed by the next catch-up (at most ``D + 1`` tokens).
Candidates equal :class:`~vllm_bole.spec_decode.draft_model.HFDraftModel`'s (the transformers
reference; tested): the draft's greedy chain and its top-``k`` per depth, per-depth marginals of
the one-pass view (:mod:`~vllm_bole.spec_decode.candidates`).

The forward is :class:`~vllm_bole.spec_decode.paged_decoder.PagedDecoder` (the checkpoint's weights,
few kernels per layer: the draft's cost is launches) with
:func:`~vllm_bole.attention.tree_attention.tree_attention` over the pages. Supported: the
transformers model types of :data:`PAGED_MODEL_TYPES` whose decoder layers that forward accepts,
checked on the config before any weight is loaded (:func:`paged_support`) and on the loaded
modules after (:func:`~vllm_bole.spec_decode.paged_decoder.decoder_support`); anything else
(recurrent and hybrid drafts) runs through transformers.

Pages (:class:`PagePool`): ``num_pages`` pages of ``page_size`` tokens per layer; page 0 is a trash
page that padding rows and table tails point at. A request holds pages for its history and its
chain; when the pool is full, the least recently drafted requests outside the batch are evicted
(they catch up from scratch when they come back); a request that still does not fit gets no draft
that step (its tree is its root alone: nothing lost but speed).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import logging

import numpy as np
import torch

from vllm_bole.attention.tree_attention import tree_attention
from vllm_bole.spec_decode.best_first import (PACKED_FIELDS, SEARCH_WIDTH, Slots, best_first_slots, budgets,
                                              level_search_packed, root_only_packed, unpack_slots)
from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.draft_model import hidden_fla
from vllm_bole.spec_decode.paged_decoder import PagedDecoder
from vllm_bole.spec_decode.step_graphs import GraphedStep, bucket, capture_graph
from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES
from vllm_bole.spec_decode.vocab_topk import vocab_topk
from vllm_bole.transfer import SideStream, download_async, pack, unpack, upload

__all__ = ["PagePool", "PagedDraftModel", "chain_mask", "paged_support", "with_pending"]
logger = logging.getLogger("vllm_bole")

PAGED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
CHUNK = MAX_NODES  # catch-up tokens per request and forward (the tree-attention kernel's limit)
NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32}  # the step inputs' dtypes
WORDS = (MAX_NODES + 31) // 32
TOKEN = PACKED_FIELDS.index("token")  # the packed trees' token field
# history lengths of the prefill warm-up (:meth:`PagedDraftModel.warm_up`), beside a few just over the step's
WARMUP_LENGTHS = (300, 1100, 2100)


@dataclass
class ChainMask:
    """The tree-attention kernel's view of a batch of causal chains (only ``cu_nodes``,
    ``anc_mask`` and ``max_nodes`` are read): request ``b``'s node ``j`` attends to the cached
    prefix and its nodes ``0 .. j``."""

    cu_nodes: torch.Tensor  # [B + 1] int32
    anc_mask: torch.Tensor  # [T, WORDS] int32
    max_nodes: int


def chain_mask(sizes: Sequence[int], device) -> ChainMask:
    """:class:`ChainMask` of chains of ``sizes`` nodes (each 1..``MAX_NODES``)."""
    n = torch.as_tensor(list(sizes), dtype=torch.long)
    cu = torch.zeros(n.numel() + 1, dtype=torch.long)
    cu[1:] = n.cumsum(0)
    local = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], n)
    bits = (local[:, None] + 1 - 32 * torch.arange(WORDS)[None, :]).clamp(0, 32)
    words = torch.where(bits == 32, torch.full_like(bits, -1), (1 << bits) - 1).to(torch.int32)
    return ChainMask(upload(cu, device, torch.int32), upload(words, device), int(n.max()) if n.numel() else 0)


def with_pending(histories: Sequence, pending) -> tuple[list[int], list[np.ndarray]]:
    """(roots, histories) with the ``pending`` tokens (device ``[B, W]``, counts ``[B]``) read and appended:
    the drafters' path when a search needs every token on the host."""
    tok, cnt = (t.cpu().numpy() for t in pending)
    hists = [np.concatenate([np.asarray(h, dtype=np.int64), tok[i, : cnt[i]]]) for i, h in enumerate(histories)]
    return [int(h[-1]) for h in hists], hists


TAIL = 64  # the last cached tokens a request's new history is checked against (PagePool.cached)


@dataclass
class _Entry:
    pages: list[int]
    length: int  # tokens whose K/V the pages hold (positions 0 .. length - 1)
    tail: np.ndarray  # int64: the last <= TAIL of them
    used: int  # clock of the last propose that drafted the request


class PagePool:
    """Pages of the draft's KV cache, per request key (module docstring). Host-side bookkeeping only."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages: {num_pages}, need at least 2 (page 0 is the trash page)")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.free = list(range(self.num_pages - 1, 0, -1))
        self.entries: dict = {}
        self.clock = 0
        self.evictions = 0

    def cached(self, key, hist: np.ndarray) -> int:
        """Length of the common prefix of ``hist`` and the tokens cached for ``key``, compared over the
        cached tokens' last :data:`TAIL` positions (a request's history only grows, so the tokens
        before them are not compared again every step; were they ever to differ, the drafts would
        be worse, never the output: the target verifies every draft). 0 when ``hist`` ends before
        those positions."""
        e = self.entries.get(key)
        if e is None:
            return 0
        n, lo = min(e.length, len(hist)), e.length - len(e.tail)
        if n < lo:
            return 0
        diff = np.flatnonzero(e.tail[: n - lo] != hist[lo:n])
        return lo + int(diff[0]) if diff.size else n

    def reserve(self, keys: Sequence, tokens: Sequence[int]) -> list[bool]:
        """Pages for ``tokens[i]`` positions of ``keys[i]``, evicting the least recently used
        requests outside ``keys``; whether each request got them (in order)."""
        self.clock += 1
        protect = set(keys)
        victims = sorted((e.used, i, k) for i, (k, e) in enumerate(self.entries.items()) if k not in protect)
        ok = []
        for key, n in zip(keys, tokens):
            e = self.entries.setdefault(key, _Entry([], 0, np.zeros(0, dtype=np.int64), self.clock))
            e.used = self.clock
            need = -(-int(n) // self.page_size) - len(e.pages)
            while need > len(self.free) and victims:
                self.release(victims.pop(0)[2])
                self.evictions += 1
            if need > len(self.free):
                ok.append(False)
                continue
            for _ in range(max(need, 0)):
                e.pages.append(self.free.pop())
            ok.append(True)
        return ok

    def set_tokens(self, key, hist: np.ndarray) -> None:
        """``hist`` is what the pages of ``key`` now hold (its last :data:`TAIL` tokens are kept, copied)."""
        e = self.entries[key]
        e.length, e.tail = len(hist), np.array(hist[-TAIL:], dtype=np.int64)

    def extend(self, key, tokens: np.ndarray) -> None:
        """``tokens`` followed what the pages of ``key`` held (a step's pending tokens, read after it)."""
        e = self.entries.get(key)
        if e is not None:
            e.length, e.tail = e.length + len(tokens), np.concatenate([e.tail, tokens]).astype(np.int64)[-TAIL:]

    def release(self, key) -> None:
        e = self.entries.pop(key, None)
        if e is not None:
            self.free.extend(reversed(e.pages))

    def table(self, keys: Sequence, width: int) -> np.ndarray:
        """[B, width] int32 page table of ``keys`` (``None``: a padding row), trash page 0 after
        each request's pages."""
        out = np.zeros((len(keys), width), dtype=np.int32)
        for i, k in enumerate(keys):
            if k is not None:
                p = self.entries[k].pages[:width]
                out[i, : len(p)] = p
        return out


def paged_support(cfg) -> str | None:
    """Why a transformers causal LM's config rules out the paged runtime, before any weight is loaded
    (the loaded modules are checked by :class:`PagedDecoder`); None when it does not."""
    if cfg.model_type not in PAGED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} (paged: {', '.join(PAGED_MODEL_TYPES)})"
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer_types {sorted(types)}: only full attention layers are supported"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    return None


class PagedDraftModel(GraphedStep):
    """A :class:`~vllm_bole.spec_decode.candidates.Drafter` with per-request state (``keys``).

    ``max_len``: the longest history the engine can hand over (sizes the page tables); ``depth``:
    the deepest chain asked for (the CUDA graphs run that many steps; a call may ask for less);
    ``max_requests``: requests the pool holds at full length (fewer when ``kv_bytes`` caps it;
    :class:`PagePool` evicts then); ``cuda_graphs``: capture the step (CUDA only). On CUDA a
    failed capture is logged once and the steps run eagerly (``runtime`` says so)."""

    def __init__(self, path: str, dtype: str = "auto", top_k: int = 8, device="cpu", *, max_len: int,
                 depth: int, max_requests: int = 1, kv_bytes: int | None = None, page_size: int = 16,
                 kernels: str = "auto", cuda_graphs: bool = True, max_budget: int = 16):
        with hidden_fla(str(device) == "cpu"):
            import transformers

            why = paged_support(transformers.AutoConfig.from_pretrained(path))
            if why is not None:
                raise NotImplementedError(f"the draft {path} cannot run paged: {why}")
            torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype).to(device).eval()
        cfg = self.model.config
        self.device = torch.device(device)
        self.top_k = min(int(top_k), int(cfg.vocab_size))
        self.depth, self.kernels = int(depth), kernels
        if not 0 <= int(max_budget) < MAX_NODES:
            raise ValueError(f"max_budget: {max_budget}, need 0 <= max_budget < {MAX_NODES}")
        self.slots = int(max_budget) + 1  # the tree search's slots per request (the root and the drafts)
        # the search's candidates per request and level; wider searches stay on the host (device memory)
        self.device_search = self.slots * (1 + self.top_k) <= SEARCH_WIDTH
        self._root_only = root_only_packed(torch.zeros(1, dtype=torch.long), self.slots).numpy()  # [1, slots, F]
        self.width = -(-(int(max_len) + self._scratch()) // page_size)  # page-table entries per request
        try:  # checks the loaded modules
            self.decoder = PagedDecoder(self.model, self.width * page_size, kernels)
        except NotImplementedError as e:
            raise NotImplementedError(f"the draft {path} cannot run paged: {e}") from None
        dt = next(self.model.parameters()).dtype
        num_pages = 1 + max(int(max_requests), 1) * self.width
        if kv_bytes is not None:
            num_pages = max(min(num_pages, int(kv_bytes) // (page_size * self.bytes_per_token(cfg, dt))), 2)
        self.pool = PagePool(num_pages, page_size)
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        shape = (num_pages, page_size, kv_heads, head)
        self.caches = [(torch.zeros(shape, dtype=dt, device=self.device), torch.zeros(shape, dtype=dt, device=self.device))
                       for _ in range(cfg.num_hidden_layers)]
        self._init_graphs(self.device, cuda_graphs)
        self._side = SideStream(self.device)  # the launches behind the current stream's work (:meth:`after`)

    @property
    def runtime(self) -> str:
        return f"paged ({self.pool.num_pages} pages of {self.pool.page_size}, steps {self.graphs_runtime})"

    @staticmethod
    def bytes_per_token(config, dtype: torch.dtype) -> int:
        """KV bytes one token takes in the pages."""
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * config.num_hidden_layers * kv_heads * head * torch.empty(0, dtype=dtype).element_size()

    def _scratch(self) -> int:
        """Positions after a history that a step writes at most (its last tokens' slots, then the chain)."""
        return self.depth + 1

    def _extra(self, D: int, W: int) -> int:
        """Positions a request reserves after its host history for a step of depth ``D`` with ``W`` pending
        tokens (its junk beyond them lands on the trash page)."""
        return D + W

    # ------------------------------------------------------------------ forward
    def _slots(self, table, kv_pos, req=None) -> torch.Tensor:
        """Flat page slots of positions ``kv_pos`` (any shape; rows of ``table`` by ``req``, default: the
        first axis of ``kv_pos``, one row each)."""
        ps = self.pool.page_size
        if req is None:
            req = torch.arange(kv_pos.shape[0], device=kv_pos.device).view(-1, *([1] * (kv_pos.dim() - 1)))
        return table[req, kv_pos // ps].long() * ps + kv_pos % ps

    def _forward(self, tokens, positions, prefix, table, mask, max_kv_len, keep=None, kv_pos=None,
                 num_keys=None, slots=None) -> torch.Tensor:
        """One packed forward: tokens/positions [T] (RoPE positions), each request's tokens attending
        to its ``prefix`` cached tokens and, by ``mask``, to each other (``num_keys``: to that many
        tree keys, tree_attention's); K/V written at ``kv_pos`` (default: the positions), or at
        ``slots`` [T] when given. Logits [T or len(keep), V] at ``keep`` (default: every token)."""
        if slots is None:
            kv_pos = positions if kv_pos is None else kv_pos
            req = torch.arange(mask.cu_nodes.numel() - 1, device=tokens.device)
            if req.numel() != tokens.numel():  # not one token per request (the chain steps): the tokens' requests
                req = torch.repeat_interleave(req, (mask.cu_nodes[1:] - mask.cu_nodes[:-1]).long(),
                                              output_size=tokens.numel())
            slots = self._slots(table, kv_pos, req)

        def attend(q, kc, vc, scale):
            return tree_attention(q, kc, vc, table, prefix, mask, scale=scale, max_nodes=mask.max_nodes,
                                  max_kv_len=max_kv_len, kernels=self.kernels, num_keys=num_keys)

        return self.decoder(tokens, positions, slots, self.caches, attend, keep)

    def _topk(self, logits):
        """(probabilities, tokens) [T, top_k] of the softmax of ``logits`` [T, V] (:func:`vocab_topk`, with the
        decoder's kernel choice: its glue and this are the draft forward's own ops)."""
        return vocab_topk(logits, self.top_k, self.decoder.kernels)

    def _chain(self, tok, pos, table, mask, steps: int, max_kv_len: int, out_t, out_p) -> None:
        """``steps`` one-token forwards from ``tok``/``pos`` [B] (``mask``: B one-node chains), top-k
        into ``out_t`` / ``out_p`` [B, steps, K]. Graph-safe: no host syncs, fixed shapes (every step's K/V
        slots computed at once: the step graph is bound by its kernel count on the H200)."""
        slots = self._slots(table, pos[:, None] + torch.arange(steps, device=pos.device)).T
        for d in range(steps):
            p, t = self._topk(self._forward(tok, pos, pos, table, mask, max_kv_len, slots=slots[d]))
            out_t[:, d] = t
            out_p[:, d] = p
            tok, pos = t[:, 0], pos + 1

    def _first(self, bufs: dict, max_kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's first forward: every row's last ``count`` uncached tokens (``tok`` [B, S], junk after
        them: its K/V lands at scratch positions that later forwards overwrite before reading) from
        position ``start``; (probabilities, tokens) [B, top_k] after the last one. Graph-safe."""
        B, S = bufs["tok"].shape
        dev = bufs["tok"].device
        pos = bufs["start"][:, None] + torch.arange(S, device=dev)
        keep = torch.arange(B, device=dev) * S + bufs["count"] - 1
        logits = self._forward(bufs["tok"].flatten(), pos.flatten(), bufs["start"], bufs["table"], bufs["mask"],
                               max_kv_len, keep=keep)
        return self._topk(logits)

    def _step(self, bufs: dict, steps: int, max_kv_len: int) -> None:
        """The graph body: :meth:`_first`'s top-k into ``out_t`` / ``out_p`` [:, 0]; then ``steps`` chain
        steps into [:, 1:]; with the search's buffers then each row's best-first tree
        (:func:`~vllm_bole.spec_decode.best_first.level_search_packed`: ``root``, ``caps`` draft nodes, depths
        to ``dep``, ``cal`` factors) into ``tree`` [B, slots, PACKED_FIELDS]. Graph-safe: no host syncs,
        fixed shapes."""
        dev = bufs["tok"].device
        p, t = self._first(bufs, max_kv_len)
        bufs["out_t"][:, 0], bufs["out_p"][:, 0] = t, p
        if steps:
            self._chain(t[:, 0], bufs["start"] + bufs["count"], bufs["table"], bufs["mask1"], steps, max_kv_len,
                        bufs["out_t"][:, 1:], bufs["out_p"][:, 1:])
        if "tree" in bufs:  # the best-first trees over the candidates, each row to its own depth
            cut = torch.arange(steps + 1, device=dev)[None, :, None] >= bufs["dep"][:, None, None]
            bufs["tree"].copy_(level_search_packed(bufs["root"], bufs["out_p"].masked_fill(cut, 0.0), bufs["out_t"],
                                                   bufs["caps"], self.slots, bufs["cal"], kernels=self.kernels))

    def _inputs(self, B: int, search: bool) -> list[tuple[str, tuple, torch.dtype]]:
        """The step's per-call inputs for ``B`` rows (name, shape, dtype), in the order they are packed: one
        buffer crosses to the device per step (:meth:`_fill`)."""
        S = self.depth + 1
        out = [("tok", (B, S), torch.long), ("start", (B,), torch.long), ("count", (B,), torch.long),
               ("table", (B, self.width), torch.int32)]
        if search:
            out += [("root", (B,), torch.long), ("dep", (B,), torch.long), ("caps", (B,), torch.long),
                    ("cal", (MAX_DEPTH + 1, 3), torch.float32)]
        return out

    def _buffers(self, B: int, steps: int, search: bool) -> dict:
        """Inputs and outputs of :meth:`_step` for ``B`` rows; with ``search`` those of the tree search too.
        The inputs are views of one device buffer (``"inputs"``) that :meth:`_fill` overwrites with one copy."""
        dev, S = self.device, self.depth + 1
        like = [torch.empty(shape, dtype=dtype) for _, shape, dtype in self._inputs(B, search)]
        host, spans = pack(like)
        packed = torch.zeros_like(host, device=dev)
        bufs = dict(zip((name for name, _, _ in self._inputs(B, search)), unpack(packed, like, spans)))
        bufs.update(inputs=packed, mask=chain_mask([S] * B, dev), **self._outputs(B, steps, search))
        bufs["count"].fill_(1)  # every row padding until the first fill (the graph's warm-up runs)
        if search:
            bufs["cal"].fill_(1.0)
        return bufs

    def _outputs(self, B: int, steps: int, search: bool) -> dict:
        """:meth:`_step`'s outputs for ``B`` rows (and the chain steps' one-token mask): the top-k per depth
        ``out_t`` / ``out_p`` [B, steps + 1, K]; with ``search`` the trees ``tree`` [B, slots, PACKED_FIELDS]."""
        dev, K = self.device, self.top_k
        out = dict(out_t=torch.zeros(B, steps + 1, K, dtype=torch.long, device=dev),
                   out_p=torch.zeros(B, steps + 1, K, dtype=torch.float32, device=dev), mask1=chain_mask([1] * B, dev))
        if search:
            out["tree"] = torch.zeros(B, self.slots, len(PACKED_FIELDS), dtype=torch.float64, device=dev)
        return out

    def _step_graph(self, B: int):
        """(graph, static buffers) of :meth:`_step` with ``depth - 1`` chain steps for a batch bucket of
        ``B`` rows. The buffers hold EVERY tensor the graph reads (the masks too): a tensor only the
        capture saw would go back to the allocator and be overwritten while the graph still reads
        its address (seen on the H200: a chain mask reused, a device-side assert)."""
        if B not in self._graphs:
            dev, steps = self.device, self.depth - 1
            bufs = self._buffers(B, steps, search=self.device_search)

            graph = capture_graph(lambda: self._step(bufs, steps, self.width * self.pool.page_size), dev,
                                  self._graph_pool())
            self._graphs[B] = (graph, bufs)
        return self._graphs[B]

    def warm_up(self) -> int:
        """Run the eager prefill path (a prompt's or a catch-up's packed forwards, outside the step
        graphs) over :data:`WARMUP_LENGTHS` histories (up to what the page tables reach), one and three
        requests each, under temporary keys (nothing kept): at engine start instead of inside the first
        requests, its Triton kernels compile once per variant they take (tree attention's key tile below
        and from 256 keys, split-K for long prefixes at small batches, and Triton's specialisations of
        token counts of 1, of multiples of 16 and of others). Returns the proposals run."""
        S, cap = self.depth + 1, self.width * self.pool.page_size - self.depth - 1
        lengths = sorted({min(n, cap) for n in (S + 2, S + 17, S + 32) + WARMUP_LENGTHS if min(n, cap) > S})
        vocab = int(self.model.config.vocab_size)
        for n in lengths:
            for b in (1, 3):
                self.propose([np.arange(n, dtype=np.int64) % vocab] * b, [self.depth] * b)
        return 2 * len(lengths)

    def after(self, tensors) -> contextlib.AbstractContextManager:
        """Where a launch reading the device ``tensors`` (pending tokens) runs (:class:`SideStream`)."""
        return self._side.after(tensors)

    # ------------------------------------------------------------------ the drafter
    def release(self, keys: Sequence) -> None:
        """Forget finished requests (their pages go back to the pool)."""
        for k in keys:
            self.pool.release(k)

    def _admit(self, histories, depths, keys, extra: int):
        """The requests that get drafts: (keys, temporary?, depth per request, live rows, their
        histories as arrays); pages reserved for each live history plus ``extra`` tokens."""
        B = len(histories)
        dep = [max(min(int(d), self.depth), 0) for d in depths]
        temp = keys is None
        keys = [("tmp", i) for i in range(B)] if temp else list(keys)
        cap = self.width * self.pool.page_size  # positions a page table reaches
        live = [i for i in range(B) if dep[i] > 0 and 0 < len(histories[i]) <= cap - extra]
        hists = {i: np.asarray(histories[i]) for i in live}  # views: read during this call only
        got = self.pool.reserve([keys[i] for i in live], [len(hists[i]) + extra for i in live])
        return keys, temp, dep, [i for i, ok in zip(live, got) if ok], hists

    @torch.inference_mode()
    def propose(self, histories: Sequence, depths: Sequence[int], keys: Sequence | None = None) -> Candidates:
        """Candidates ``[B, max(depths), top_k]`` (CPU): the draft's greedy chain after each history
        and its top-``k`` per depth. ``keys`` identify the requests across calls (None: nothing is
        kept after the call)."""
        D = max((max(min(int(d), self.depth), 0) for d in depths), default=0)
        out = Candidates.empty(len(histories), D, self.top_k)
        keys, temp, dep, live, hists = self._admit(histories, depths, keys, D)
        if live:
            toks, probs = self._live(live, hists, [keys[i] for i in live], D)()
            cut = torch.arange(D)[None, :] >= torch.tensor([dep[i] for i in live])[:, None]
            idx = torch.tensor(live)
            out.tokens[idx] = toks.masked_fill(cut[..., None], -1)
            out.probs[idx] = probs.masked_fill(cut[..., None], 0.0)
        if temp:
            self.release(keys)
        return out

    def grow_trees(self, roots, histories: Sequence, depths: Sequence[int], budget, **options) -> Slots:
        """:meth:`grow_trees_async`, waited for."""
        return self.grow_trees_async(roots, histories, depths, budget, **options)()

    @torch.inference_mode()
    def grow_trees_async(self, roots, histories: Sequence, depths: Sequence[int], budget, *,
                         keys: Sequence | None = None, max_depth: int, top_k: int | None = None,
                         calibration: torch.Tensor | None = None, pending=None) -> Callable[[], Slots]:
        """The best-first trees of ``budget`` draft nodes (int or [B]) per request over the draft's
        per-depth candidates, as the search's :class:`Slots` (CPU), returned by the callable this
        returns: the step is launched now and read when it is called (on CUDA the host does other
        work while the step runs; the runner calls it when vLLM asks for the drafts). Equal to
        :func:`~vllm_bole.spec_decode.best_first.best_first_slots` of :meth:`propose`, but searched on
        the device inside the step (inside its CUDA graph on CUDA), so only the trees cross to the
        host. A budget over ``max_budget``, a ``top_k`` under the drafter's, or a search wider than
        :data:`SEARCH_WIDTH` is searched on the host instead (at once). Requests with depth 0, an
        empty history or no room in the pool get their root alone.

        ``pending`` (tokens ``[B, W]`` int64, -1 padded, counts ``[B]``, on the device): each request's
        tokens after its history that the host has not read yet (a verification's accepted tokens and
        bonus): the step takes them from the device, so it is launched behind the target's step
        without waiting for it; ``roots`` are then not read (each root is the last pending token)."""
        B = len(histories)
        caps = budgets(budget, B, "cpu")
        if not self.device_search or min(int(top_k or self.top_k), self.top_k) != self.top_k \
                or int(caps.max()) >= self.slots:
            if pending is not None:  # read now (a host search needs every token on the host)
                roots, histories = with_pending(histories, pending)
            found = self._host_trees(roots, histories, depths, caps, keys=keys, max_depth=max_depth, top_k=top_k,
                                     calibration=calibration)
            return lambda: found
        W = 0 if pending is None else int(pending[0].shape[1])
        if W > self.depth + 1:
            raise ValueError(f"pending: {W} tokens per request, at most depth + 1 = {self.depth + 1}")
        D = max(min(max((int(d) for d in depths), default=0), int(max_depth), self.depth), 0)
        keys, temp, dep, live, hists = self._admit(histories, [min(int(d), D) for d in depths], keys, self._extra(D, W))
        root = np.zeros(B, dtype=np.int64) if pending is not None else np.asarray(roots, dtype=np.int64).reshape(-1)
        tree = self._root_only.repeat(B, 0)  # root-only trees, then the live rows' searches
        tree[:, 0, TOKEN] = root
        fetch = None
        live_pending = None
        if pending is not None:
            at = upload(torch.tensor(live, dtype=torch.long), self.device)
            live_pending = (pending[0][at], pending[1][at])
            read_pending = download_async(torch.cat([pending[1][:, None], pending[0]], 1))
        if live:
            search = dict(root=root[live], dep=np.array([dep[i] for i in live]), caps=caps.numpy()[live],
                          cal=calibration)
            fetch = self._live(live, hists, [keys[i] for i in live], D, search, live_pending)

        def finish() -> Slots:
            if fetch is not None:
                tree[live] = fetch()
            if pending is not None:
                got = read_pending().numpy()
                cnt, tok = got[:, 0], got[:, 1:]
                tree[:, 0, TOKEN] = tok[np.arange(B), cnt - 1]
                for i in live:
                    self.pool.extend(keys[i], tok[i, : cnt[i]])
            if temp:  # the pages go back once the step that used them is read
                self.release(keys)
            return unpack_slots(torch.from_numpy(tree))

        return finish

    def _host_trees(self, roots, histories: Sequence, depths: Sequence[int], caps: torch.Tensor, *, keys,
                    max_depth: int, top_k: int | None, calibration: torch.Tensor | None) -> Slots:
        """:meth:`grow_trees`' trees searched on the host (what the step cannot search): over :meth:`propose`'s
        candidates."""
        return best_first_slots(roots, self.propose(histories, depths, keys), caps, max_depth=max_depth, top_k=top_k,
                                calibration=calibration)

    def _prefill(self, live, hists, keys, keep: int):
        """Every live request's uncached tokens but its last ``keep`` (at least one, the root, while
        ``keep`` > 0) through the draft eagerly (chunks of CHUNK per request and forward: prompts,
        catch-ups after an eviction); returns (history lengths [n], first tokens left for :meth:`_step`
        [n], page table [n, W] int32 numpy)."""
        dev = self.device
        L = np.array([len(hists[i]) for i in live], dtype=np.int64)
        start = np.array([min(self.pool.cached(k, hists[i]), len(hists[i]) - (keep > 0)) for k, i in zip(keys, live)])
        host = self.pool.table(keys, self.width)
        table = None  # on the device once a prefill forward needs it
        while True:
            rows = np.flatnonzero(L - start > keep)
            if rows.size == 0:
                break
            table = upload(torch.from_numpy(host), dev) if table is None else table
            size = np.minimum(L[rows] - start[rows] - keep, CHUNK)
            toks = np.concatenate([hists[live[r]][start[r] : start[r] + s] for r, s in zip(rows, size)])
            toks = toks.astype(np.int64)
            pos = np.concatenate([np.arange(start[r], start[r] + s) for r, s in zip(rows, size)])
            self._forward(upload(torch.from_numpy(toks), dev), upload(torch.from_numpy(pos), dev),
                          upload(torch.from_numpy(start[rows]), dev), table[upload(torch.from_numpy(rows), dev)],
                          chain_mask(size.tolist(), dev), int((start[rows] + size).max()),
                          keep=torch.zeros(0, dtype=torch.long, device=dev))
            start[rows] += size
        for k, i in zip(keys, live):
            self.pool.set_tokens(k, hists[i])
        return L, start, host

    def _fill(self, bufs: dict, live, hists, L, start, table, search: dict | None = None, pending=None) -> None:
        """The live rows' last tokens, start, count and page-table row (and the search's root, depth, caps and
        calibration) in the first rows of ``bufs``, the rest padding (one token at position 0, every page
        the trash page, no draft nodes): built on the host, one host-to-device copy into ``bufs["inputs"]``
        (was ~15 launches a step: fills, copies and uploads per field); with ``pending`` (the live rows'
        device tokens [n, W] and counts [n], their histories all cached) the tokens, counts and roots then
        from those, on the device."""
        n, S, B = len(live), self.depth + 1, bufs["tok"].shape[0]
        arrays = {name: np.zeros(shape, dtype=NUMPY_DTYPES[dtype])
                  for name, shape, dtype in self._inputs(B, "root" in bufs)}  # the buffers' layout
        for r, i in enumerate(live):
            arrays["tok"][r, : L[r] - start[r]] = hists[i][start[r] :]
        arrays["start"][:n], arrays["count"][:n], arrays["count"][n:] = start, L - start, 1
        arrays["table"][:n] = table
        if "cal" in arrays:  # a search's buffers (without ``search``: no draft nodes, root-only trees)
            arrays["cal"][:] = 1.0
        if search:
            arrays["root"][:n], arrays["dep"][:n], arrays["caps"][:n] = search["root"], search["dep"], search["caps"]
            if search["cal"] is not None:
                arrays["cal"][:] = search["cal"].float().numpy()
        host, _ = pack([torch.from_numpy(a) for a in arrays.values()], pin=self.device.type == "cuda")
        bufs["inputs"].copy_(host, non_blocking=True)
        if pending is not None:
            tok, cnt = pending
            bufs["tok"][:n, : tok.shape[1]] = tok.clamp(min=0)  # -1 padding: junk at scratch positions
            bufs["count"][:n] = cnt
            if search:
                bufs["root"][:n] = tok.gather(1, (cnt - 1)[:, None]).squeeze(1)

    def _eager_step(self, live, hists, L, start, table, steps: int, search: dict | None = None, pending=None) -> dict:
        """:meth:`_step` of the live rows without a graph (keys up to the longest history, its pending
        tokens and the step's scratch positions); returns its buffers."""
        bufs = self._buffers(len(live), steps, search is not None)
        self._fill(bufs, live, hists, L, start, table, search, pending)
        W = 0 if pending is None else pending[0].shape[1]
        self._step(bufs, steps, int(L.max()) + W + self._scratch())
        return bufs

    def _catch_up(self, live, hists, keys):
        """Every live request's tokens after its cached prefix through the draft; returns (history
        lengths [n] np, page table [n, W] and the depth-1 top-k tokens / probabilities [n, K] on the
        device)."""
        L, start, table = self._prefill(live, hists, keys, self.depth + 1)
        bufs = self._eager_step(live, hists, L, start, table, 0)
        return L, bufs["table"], bufs["out_t"][:, 0], bufs["out_p"][:, 0]

    def _live(self, live, hists, keys, D, search: dict | None = None, pending=None) -> Callable:
        """Launch the live rows' step: the eager prefill, then the last catch-up forward (with ``pending``:
        every host token prefilled, the step's tokens the pending ones), the chain steps and the search,
        on CUDA one graph replay per batch bucket. Returns the callable that reads its results: [n, D, K]
        tokens and probabilities (CPU), or with ``search`` the trees ``[n, slots, PACKED_FIELDS]`` (numpy)."""
        L, start, table = self._prefill(live, hists, keys, 0 if pending is not None else self.depth + 1)
        if self.cuda_graphs and self._graphs_answer(search):
            try:
                return self._replay(live, hists, L, start, table, D, search, pending)
            except RuntimeError as e:
                self._graphs_failed(e)
        bufs = self._eager_step(live, hists, L, start, table, D - 1, search, pending)
        got = self._read(bufs, len(live), D, search)()
        return lambda: got

    def _graphs_answer(self, search: dict | None) -> bool:
        """Whether the step graphs answer a call with (``search``) or without a search (they run both)."""
        return True

    @staticmethod
    def _read(bufs: dict, n: int, D: int, search: dict | None) -> Callable:
        """The first ``n`` rows' results, copied to the host behind the step (on CUDA into pinned memory
        without waiting: the callable returned waits for the copy, the step's one synchronisation)."""
        if search:
            get = download_async(bufs["tree"][:n])  # the bucket's buffers are overwritten by its next replay
            return lambda: get().numpy()
        toks, probs = (bufs[k][:n, :D].to("cpu", copy=True) for k in ("out_t", "out_p"))
        return lambda: (toks, probs)

    def _replay(self, live, hists, L, start, table, D, search: dict | None = None, pending=None) -> Callable:
        """The step through the captured graphs (buckets of at most the largest one), results as
        :meth:`_live`'s."""
        out = []
        for s in range(0, len(live), self.buckets[-1]):
            e = min(len(live), s + self.buckets[-1])
            graph, bufs = self._step_graph(bucket(e - s, self.buckets))
            part = search and {k: v if k == "cal" else v[s:e] for k, v in search.items()}
            self._fill(bufs, live[s:e], hists, L[s:e], start[s:e], table[s:e], part,
                       pending and (pending[0][s:e], pending[1][s:e]))
            graph.replay()
            out.append(self._read(bufs, e - s, D, search))
        if search:
            return lambda: np.concatenate([get() for get in out])
        return lambda: tuple(torch.cat(x) for x in zip(*(get() for get in out)))
