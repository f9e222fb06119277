"""Tree steps of tree requests alone, replayed from CUDA graphs (issue 13 item 3).

A step whose batch holds only tree requests (no prefill or plain decode beside them: decoding's
steady state) runs its target forward, every layer's tree override included, as ONE replay of a
graph captured at engine start, instead of vLLM's piecewise graphs with the overrides' Python and
Triton launches between them in every layer (the host-bound part of the step on the H200).

Buckets: (``B`` requests, ``T`` tokens), ``B`` a power of two up to ``max_num_seqs``, ``T`` one of
vLLM's capture sizes or of ``LARGE`` (up to 4352) with ``B < T <= B * nodes`` (``nodes`` = budget +
1). A step of ``b`` requests and ``t`` tokens takes the smallest bucket that holds it with at least
one padding request (:func:`pick`); it is padded into the bucket's static tensors in ONE
host-to-device copy (:class:`StaticStep`): the real trees first, then ``B - b`` padding requests,
stars of at most ``nodes`` nodes holding the ``T - t`` remaining tokens, each on the null KV block
and state slot 0 with no prefix; their K/V writes are skipped (slot mapping -1) and their outputs
discarded. What a launcher sizes from the host is the bucket's bound: ``nodes`` per tree, the configured depth,
``max_model_len`` keys (upper bounds: each program stops at its own request's sizes).

The commit after verification (K/V compaction of every attention group, conv states rolled, accepted
paths stashed, in every layer) is a second graph of the bucket, over the forward graph's saved inputs
and a static verification result: the real accepted paths, padding rows with nothing accepted (their
slots left as they are).

Decision: off unless ``VLLM_BOLE_TREE_GRAPHS=1``. On the H200 (198194b) it was identical to AR on the
fp32 tiny NemotronH (every tree step from a graph) and cut the target forward of the pair's tree steps
from 3-11 ms to 0.65-1.0 ms; it stays opt-in until the GDN, Mamba1 and GQA-conv hybrids ran with it
there. On CPU the same path runs with every "graph" replayed eagerly (the padded static step through
the model, no capture) after the capture's eager runs, so the CPU tests check everything but the
recording itself
(``tests/test_tree_graphs.py``: the kernels on a padded step equal them on the step itself; inside
vLLM greedy streams identical with every tree step padded).
"""
from __future__ import annotations

import functools

import logging
import os

import numpy as np
import torch

from vllm_bole.adapter.tree_step import TreeStep
from vllm_bole.spec_decode.step import commit
from vllm_bole.spec_decode.tree import MAX_NODES, TreeBatch, path_words
from vllm_bole.spec_decode.verification import VerificationResult
from vllm_bole.transfer import pack, unpack

logger = logging.getLogger("vllm_bole")
GRAPHS_ENV = "VLLM_BOLE_TREE_GRAPHS"
# "0": a split step's prompt rows run eagerly, not from vLLM's piecewise graphs (the runner's
# ``_bole_plain_graph``; a switch while that path has not run on the H200)
SPLIT_PIECEWISE_ENV = "VLLM_BOLE_SPLIT_PIECEWISE"
SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # without vLLM's capture sizes (CPU)
# token buckets beyond vLLM's largest capture size (512 by default): trees of many requests (128 x 33 nodes;
# on the H200 at 198194b the steps of 128 x 17 nodes, past the former 2048, ran piecewise: 38 ms a forward
# against 1.0 ms from a graph)
LARGE = (640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 3072, 3584, 4096, 4352)
WORDS = (MAX_NODES + 31) // 32


def enabled() -> bool:
    return os.environ.get(GRAPHS_ENV, "0") == "1"


def split_piecewise() -> bool:
    return os.environ.get(SPLIT_PIECEWISE_ENV, "1") != "0"


def plan(max_requests: int, nodes: int, capture_sizes) -> list[tuple[int, int]]:
    """The buckets (requests, tokens), smallest token count first: requests powers of two up to the first
    above ``max_requests`` (a full batch still needs a padding request)."""
    batches = [1 << i for i in range(17) if (1 << i) // 2 <= max_requests]
    return sorted(((b, t) for b in batches for t in capture_sizes if b < t <= b * nodes), key=lambda bt: (bt[1], bt[0]))


def pick(buckets, requests: int, tokens: int, nodes: int) -> tuple[int, int] | None:
    """The first bucket (``plan``'s order) holding ``requests`` trees of ``tokens`` nodes in all with at
    least one padding request, the padding at most ``nodes`` per padding request; None if none does."""
    for b, t in buckets:
        pad_r, pad_t = b - requests, t - tokens
        if pad_r >= 1 and pad_r <= pad_t <= pad_r * nodes:
            return b, t
    return None


@functools.lru_cache(maxsize=4096)
def padding_trees(requests: int, tokens: int, nodes: int) -> dict[str, np.ndarray]:
    """``requests`` star trees of at most ``nodes`` nodes, ``tokens`` in all (each >= 1): parent, depth
    [tokens], sizes and cu (their ends) [requests], path [tokens, 2], anc_mask [tokens, WORDS] (int32).
    Cached (a step's padding repeats from step to step): read-only."""
    # the first ones filled up to ``nodes``
    sizes = 1 + np.clip(tokens - requests - np.arange(requests) * (nodes - 1), 0, nodes - 1)
    local = np.arange(tokens) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    path = np.stack([np.zeros(tokens, np.int32), np.where(local > 0, local, -1).astype(np.int32)], 1)
    pad = dict(parent=np.where(local == 0, -1, 0).astype(np.int32), depth=(local > 0).astype(np.int32),
               sizes=sizes, path=path, anc_mask=path_words(path), cu=np.cumsum(sizes).astype(np.int32))
    for a in pad.values():
        a.flags.writeable = False
    return pad


class StaticStep:
    """A bucket's :class:`TreeStep` in fixed tensors (views of one device buffer, filled from one pinned
    host buffer): ``B`` requests, ``T`` tokens, trees of at most ``nodes`` nodes and ``depth`` deep."""

    def __init__(self, B: int, T: int, nodes: int, depth: int, max_model_len: int, table_widths: dict,
                 slot_groups, kernels: str, device):
        self.B, self.T, self.nodes, self.depth = B, T, nodes, depth
        i32, i64 = torch.int32, torch.int64
        like = dict(token=torch.zeros(T, dtype=i64), parent=torch.zeros(T, dtype=i32), depth=torch.zeros(T, dtype=i32),
                    cu=torch.zeros(B + 1, dtype=i32), path=torch.zeros(T, depth + 1, dtype=i32),
                    anc=torch.zeros(T, WORDS, dtype=i32), prefix=torch.zeros(B, dtype=i64),
                    **{f"table{g}": torch.zeros(B, w, dtype=i32) for g, w in table_widths.items()},
                    **{f"slots{g}": torch.zeros(B, dtype=i64) for g in slot_groups}, prow=torch.zeros(B, dtype=i64))
        self.names = list(like)
        self.host_buf, spans = pack(list(like.values()), pin=torch.device(device).type == "cuda")
        self.dev_buf = torch.zeros_like(self.host_buf, device=device)
        self.host = {n: t.numpy() for n, t in zip(self.names, unpack(self.host_buf, like.values(), spans))}
        self.dev = dict(zip(self.names, unpack(self.dev_buf, like.values(), spans)))
        self.slot_groups, self.tables = list(slot_groups), list(table_widths)
        self.max_model_len, self.kernels = max_model_len, kernels
        # the verification result the commit graph reads: accepted local nodes [B, depth + 1], last flat node [B]
        self.accepted = torch.full((B, depth + 1), -1, dtype=i64, device=device)
        self.last = torch.zeros(B, dtype=i64, device=device)

    def new_step(self) -> TreeStep:
        """A :class:`TreeStep` over the static tensors. A new one each time: a tree caches what it derives
        (``request_index``, ``starts``, ...), which must be derived from the current contents, inside the
        capture on CUDA (so every replay derives it again), at every eager run on CPU."""
        d = self.dev
        tree = TreeBatch(token_ids=d["token"], parent=d["parent"], depth=d["depth"], cu_nodes=d["cu"], path=d["path"],
                         anc_mask=d["anc"], max_nodes=self.nodes)
        return TreeStep(num_plain=0, tok_start=0, tree=tree, host_tree=tree, prefix_len=d["prefix"], req_ids=[],
                        rows=[], block_tables={g: d[f"table{g}"] for g in self.tables},
                        state_slots={g: d[f"slots{g}"] for g in self.slot_groups},
                        fresh=torch.zeros(self.B, dtype=torch.bool), chain_len=[], max_kv_len=self.max_model_len,
                        kernels=self.kernels, pending_rows=d["prow"])

    def new_result(self) -> VerificationResult:
        """The static verification result (a new object each time, as :meth:`new_step`)."""
        return VerificationResult(output_token_ids=self.accepted, num_emitted=self.last, accepted_nodes=self.accepted,
                                  last_node=self.last)

    def fill_result(self, result: VerificationResult) -> None:
        """The real result in the static one; padding rows accept nothing (last node before their root)."""
        b, w = result.accepted_nodes.shape
        self.accepted.fill_(-1)
        self.accepted[:b, :w].copy_(result.accepted_nodes)
        self.last[:b].copy_(result.last_node)
        torch.sub(self.dev["cu"][b:-1].long(), 1, out=self.last[b:])

    def fill(self, tree: TreeBatch | None, prefix=(), tables=None, slots=None, rows=()) -> None:
        """The real step (host tree; prefix [b]; tables / slots by group, [b, width] / [b] host arrays; pending
        rows [b]; None: padding alone) padded into the bucket (padding requests: block, slot and pending
        row 0), then ONE copy to the device."""
        h = self.host  # numpy views of the pinned host buffer
        b, t = (tree.num_requests, tree.num_nodes) if tree is not None else (0, 0)
        pad = padding_trees(self.B - b, self.T - t, self.nodes)
        h["path"].fill(-1)
        for name in ("prefix", "prow", *(n for n in self.names if n.startswith(("table", "slots")))):
            h[name].fill(0)
        h["cu"][0] = 0
        if tree is not None:
            h["parent"][:t], h["depth"][:t] = tree.parent.numpy(), tree.depth.numpy()
            h["cu"][: b + 1] = tree.cu_nodes.numpy()
            h["path"][:t, : tree.path.shape[1]], h["anc"][:t] = tree.path.numpy(), tree.anc_mask.numpy()
            h["prefix"][:b] = prefix
            for g, tab in tables.items():
                h[f"table{g}"][:b, : tab.shape[1]] = tab
            for g, sl in slots.items():
                h[f"slots{g}"][:b] = sl
            h["prow"][: len(rows)] = rows
        h["parent"][t:], h["depth"][t:], h["cu"][b + 1:] = pad["parent"], pad["depth"], t + pad["cu"]
        h["path"][t:, :2], h["anc"][t:] = pad["path"], pad["anc_mask"]
        self.dev_buf.copy_(self.host_buf, non_blocking=True)


class TreeGraphs:
    """Every bucket's :class:`StaticStep` and CUDA graph of the target forward (on the runner, after its
    warm-up), and their replay for a real step."""

    def __init__(self, runner):
        cfg = runner.bole_config
        self.nodes = cfg.num_speculative_tokens + 1
        sizes = sorted({s for s in (*(getattr(runner, "cudagraph_batch_sizes", None) or SIZES), *LARGE)
                        if s <= runner.max_num_tokens})
        self.buckets = plan(runner.scheduler_config.max_num_seqs, self.nodes, sizes)
        widths = {g.group: runner.input_batch.block_table[g.group].block_table.cpu.shape[1]
                  for g in runner._bole_attention}
        self.static = {bt: StaticStep(*bt, self.nodes, cfg.depth, runner.max_model_len, widths,
                                      list(runner._bole_recurrent), cfg.kernels, runner.device) for bt in self.buckets}
        # per bucket: the forward context's buffers, and on CUDA the forward graph, its output and the commit
        # graph (one pool: a bucket's graphs run back to back, forward then commit, never interleaved with
        # another bucket's; the forward's saved inputs stay alive while the commit is captured)
        self.ctx: dict[tuple[int, int], dict] = {}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, object, torch.cuda.CUDAGraph]] = {}
        self.cuda = torch.device(runner.device).type == "cuda"
        self.pool = None
        self.bucket: tuple[int, int] | None = None  # the bucket of the step replayed last, until its commit
        self.saved: dict | None = None  # CPU: that step's saved layer inputs
        self.saved_bytes: dict[tuple[int, int], int] = {}  # per bucket: the layers' inputs held for the commit

    @staticmethod
    def _forward(runner, T: int, ctx: dict):
        """The target forward over the first ``T`` tokens of vLLM's persistent input buffers, tree overrides
        on; ``ctx``: the forward context's slot mappings and padding mask (vLLM's persistent buffers too,
        prepared outside any capture)."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import set_forward_context

        with set_forward_context(None, runner.vllm_config, num_tokens=T, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 **ctx):
            return runner.model(input_ids=runner.input_ids.gpu[:T], positions=runner.positions[:T])

    def capture(self, runner) -> None:
        """One graph per bucket, each on a synthetic step of padding trees on the null block (their K/V
        writes skipped: slot mapping -1), after an eager run of the same (allocations, lazy set-up). On CPU
        the eager runs alone (so the tests run what a capture runs), and the buckets replay eagerly."""
        for (B, T), st in self.static.items():
            _, slots = runner._get_slot_mappings(num_tokens_padded=T, num_reqs_padded=B, num_tokens_unpadded=T)
            ctx = self.ctx[(B, T)] = dict(slot_mapping=slots, is_padding=runner._prepare_padding_mask(T, T))
            st.fill(None)
            self._no_kv_writes(runner, 0, T)
            try:
                runner._bole_active.step = st.new_step()
                self._forward(runner, T, ctx)
                if self.cuda:
                    torch.cuda.synchronize(runner.device)
                    if self.pool is None:
                        self.pool = torch.cuda.graph_pool_handle()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        runner._bole_active.step = st.new_step()
                        out = self._forward(runner, T, ctx)
            finally:
                runner._bole_active.step = None
            saved = {layer: layer._saved for layer in runner._bole_recurrent_layers()}
            self.saved_bytes[(B, T)] = sum(layer.saved_bytes() for layer in saved)
            commit_graph = self._capture_commit(runner, st, saved)
            if self.cuda:
                self.graphs[(B, T)] = (graph, out, commit_graph)
        logger.info("vllm-bole: %d tree-step CUDA graphs captured%s", len(self.static),
                    "" if self.cuda else " (CPU: replayed eagerly)")

    def _commit(self, runner, st: StaticStep, saved: dict) -> None:
        """The commit of the bucket's padded step (what its graph holds), from the forward's saved inputs."""
        step = st.new_step()
        for g in runner._bole_attention:
            g.begin(step)
        for layer, s in saved.items():
            layer._saved = s
        commit(runner._bole_attention + runner._bole_recurrent_layers(), step.tree, st.new_result())

    def _capture_commit(self, runner, st: StaticStep, saved: dict):
        """The bucket's commit graph (None on CPU), after an eager run of it."""
        st.accepted.fill_(-1)  # nothing accepted: the warm run leaves every slot as it is
        torch.sub(st.dev["cu"][:-1].long(), 1, out=st.last)
        self._commit(runner, st, saved)
        if not self.cuda:
            return None
        torch.cuda.synchronize(runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._commit(runner, st, saved)
        return graph

    @staticmethod
    def _no_kv_writes(runner, start: int, end: int) -> None:
        for g in runner._bole_attention:
            runner.input_batch.block_table[g.group].slot_mapping.gpu[start:end].fill_(-1)

    def bucket_of(self, step: TreeStep) -> tuple[int, int] | None:
        """The captured bucket that holds ``step``'s trees, or None."""
        bt = pick(self.buckets, step.tree.num_requests, step.num_tokens, self.nodes)
        return bt if bt in self.ctx else None

    def replay(self, runner, step: TreeStep):
        """The target's hidden states ``[T_bucket, ...]`` of ``step``'s trees (their tokens first in vLLM's
        persistent buffers) from its bucket's graph, or None when no bucket holds them; then :meth:`commit`
        commits them."""
        bt = self.bucket_of(step)
        if bt is None:
            return None
        st = self.static[bt]
        st.fill(step.host_tree, step.host["prefix"], step.host["tables"], step.state_slots_host, step.pending_rows_host)
        t = step.num_tokens
        self._no_kv_writes(runner, t, bt[1])
        runner.input_ids.gpu[t: bt[1]].clamp_(min=0)
        if bool(step.fresh.any()):  # the eager path zeroes fresh slots' states inside the conv; here before
            for layer in runner._bole_recurrent_layers():
                layer.zero_states(step, step.state_slots[layer.group])
        if self.cuda:
            graph, out, _ = self.graphs[bt]
            graph.replay()
            self.saved = None
        else:  # the same padded step through the model, eagerly
            runner._bole_active.step = st.new_step()
            try:
                out = self._forward(runner, bt[1], self.ctx[bt])
            finally:
                runner._bole_active.step = step
            self.saved = {layer: layer._saved for layer in runner._bole_recurrent_layers()}
            self.saved_bytes[bt] = sum(layer.saved_bytes() for layer in self.saved)
        for layer in runner._bole_recurrent_layers():
            layer._saved = None  # the commit is the bucket's (:meth:`commit`), not the layers' own
        self.bucket = bt
        return out

    def commit(self, runner, result: VerificationResult) -> None:
        """The commit of the step :meth:`replay` ran (``result``: its verification, real requests only): the
        bucket's commit graph over the static result (on CPU the same commit, eagerly)."""
        bt, self.bucket = self.bucket, None
        st = self.static[bt]
        st.fill_result(result)
        if self.cuda:
            self.graphs[bt][2].replay()
        else:
            self._commit(runner, st, self.saved)
        for g in runner._bole_attention:
            g._step = None
