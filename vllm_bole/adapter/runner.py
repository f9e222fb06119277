"""Tree speculation inside vLLM's V1 model runner (``GPUModelRunner``; ``CPUModelRunner``
subclasses it, so the CPU engine runs this same code).

One step, as vLLM drives it (``execute_model`` then ``sample_tokens``):

1. The scheduler gave each request with drafts ``1 + k`` tokens: the root (last sampled token)
   and the ``k`` flat draft nodes this runner proposed last step, and allocated ``k + 1`` KV slots
   (vLLM's own speculative bookkeeping; ``num_speculative_tokens`` = the node budget).
2. ``_may_reorder_batch``: tree requests move to the end of the persistent batch, after the plain
   ones (prefills, decodes without drafts) in vLLM's order (:func:`plain_first_swaps`).
3. ``_prepare_inputs``: vLLM's input prep, then the tree requests' positions become
   ``prefix_len + depth`` (plus the request's delta in every M-RoPE row; their KV slots stay
   ``prefix_len + j``: ``tree_slot_mapping``), logits
   are taken at every tree node, and a :class:`~vllm_bole.adapter.tree_step.TreeStep` describes the
   trees to the layer overrides. Pending accepted paths of requests not verified as trees this step
   are committed first, so vLLM's own kernels always read committed states.
4. ``_build_attention_metadata``: vLLM's metadata for the plain requests only.
5. ``_model_forward``: ONE forward; the layer overrides run the plain tokens through vLLM and the
   tree tokens through the core.
6. ``_sample``: vLLM's sampler for the plain requests; the sampling constraints per node
   (:mod:`vllm_bole.adapter.sampling`), ``verify_tree`` and ``commit`` of :mod:`vllm_bole.spec_decode.step`
   for the trees, over the layer objects (:mod:`vllm_bole.adapter.layers`): accepted K/V
   compacted into ``prefix_len .. prefix_len + m`` for every full-attention layer, conv states
   committed in place, the accepted path's recurrent inputs stashed in the request's pending-path row (folded into
   the next tree step of the request). Output: accepted tokens + bonus, ``-1`` padded, exactly
   what vLLM's rejection sampler returns, so vLLM's bookkeeping and the scheduler's rollback of
   ``num_computed_tokens`` stay right.
7. ``sample_tokens`` then launches the next trees' drafting (``draft_trees_async``: best-first from
   the drafter's per-depth candidates; the paged draft's step, search included, runs on the device
   while vLLM's scheduler processes this step's output) and ``take_draft_token_ids`` reads them and
   hands their flat tokens to the scheduler (the ``TreeBatch`` is kept and selected from at the
   next step).

With async scheduling (the tree config's ``async_scheduling``) vLLM's scheduler books step ``N + 1`` before
step ``N``'s output is known (``num_speculative_tokens`` placeholder drafts per request, all taken as
accepted) and never takes drafts: ``_sample`` returns the token grid on the device and leaves the host work
on its results to the next step; ``_update_states`` of step ``N + 1`` then settles step ``N``
(:meth:`TreeRunnerMixin._bole_settle`) before the inputs are laid out, cutting each request's booked drafts
to its drafted tree in the runner's copy of the scheduler output.

The model side (layers, KV cache specs, metadata builders) is built without vLLM's speculative
config (see :mod:`vllm_bole.adapter.worker`): one recurrent state slot per request, plain conv
state widths, no per-draft-token state copies.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from vllm_bole.adapter.budget import StepBudget
from vllm_bole.adapter.layers import RECURRENT_KINDS, AttentionGroup, AttentionLayer
from vllm_bole.adapter.metrics import WorkerMetrics, snapshot_path
from vllm_bole.adapter.sampling import constrain, emitted_logprobs, supports_tree, tree_sampling
from vllm_bole.adapter.tree_step import PHASES, STEP_KINDS, ActiveStep, TreeStep, by_kind_keys
from vllm_bole.attention.tree_attention import tree_slot_mapping
from vllm_bole.config import AUTO_ONLY, TreeSpecConfig
from vllm_bole.dispatch import triton_variants
from vllm_bole.spec_decode.calibration import BRANCH_COLUMNS, Calibration, branch_columns, kind_counts
from vllm_bole.spec_decode.block_drafter import HeadDrafter, load_head
from vllm_bole.spec_decode.draft_model import HFDraftModel
from vllm_bole.spec_decode.ngram import NgramDrafter
from vllm_bole.spec_decode.paged_draft import PagedDraftModel
from vllm_bole.spec_decode.paged_tree_draft import PagedTreeDraftModel
from vllm_bole.spec_decode.step import commit, draft_trees_async, verify_tree
from vllm_bole.transfer import host_array, upload

logger = logging.getLogger("vllm_bole")
NGRAM_WINDOW = 4096  # context tokens the n-gram drafter searches (the most recent)
MAX_TOP_K = 64  # candidates per depth a drafter proposes at most
DRAFT_KV_BYTES = {True: 4 << 30, False: 256 << 20}  # the paged draft's KV pool at most (CUDA, CPU)
# tree steps whose KV slots are checked against vLLM's slot mapping (a device sync each: the first ones
# check the engine's configuration; the mapping follows from the same block tables afterwards)
CHECKED_STEPS = 16
IDLE_GAP_S = 0.05  # from a step's sampled tokens to the next step's input preparation: longer, the engine idled
LOGS = {"accept_log": 100_000, "slow_steps": 1000, "step_log": 20_000}  # the counters' logs: records kept at most
SLOW_FORWARD_S = 0.02  # a tree step's forward over this is logged (``slow_steps``): 0.6-1.2 ms from a graph on the H200


def _first_rank() -> bool:
    """Whether this worker is tensor-parallel rank 0 of the last pipeline stage (it exports the metrics)."""
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tp_group().rank_in_group == 0 and ps.get_pp_group().is_last_rank
    except AssertionError:  # no distributed state (a runner built outside a worker)
        return True


def _resumed(scheduler_output):
    """The step's requests resumed after a preemption (vLLM versions without the field: none)."""
    return getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ()


def plain_first_swaps(is_tree: Sequence[bool]) -> list[tuple[int, int]]:
    """The row swaps that put a persistent batch's plain rows (``is_tree`` False) first, in their order, and its
    tree rows after them (in any order: nothing reads it): the k-th plain row, at j >= k, swaps with row k, which
    holds a tree row while j != k. At most one swap per plain row.

    Decision: until ffbdad9 the tree rows kept their order too, a permutation that moved nearly every row when a
    prompt arrived at the end of the batch (vLLM's ``swap_states`` ~15-40 us each): 3.2 ms more host time in a
    step with prompts beside trees than in one of trees alone at c = 128 on the H100 (tiny checkpoints,
    ``profile_step_tiny_b128.json``: ``update`` 3.90 against 0.67 ms, 4522 swaps in 252 steps)."""
    plain = [i for i, tree in enumerate(is_tree) if not tree]
    return [(k, j) for k, j in enumerate(plain) if j != k]


def _token_grid(P: int, plain, trees: torch.Tensor) -> torch.Tensor:
    """The step's sampled tokens as vLLM's rejection sampler lays them out, ``[P + B, W]`` int64 on ``trees``'
    device, ``-1`` padded: the ``P`` plain rows' tokens (the first ``P`` rows of vLLM's sampler output
    ``plain``), then the trees' emitted tokens ``trees`` ``[B, W]``."""
    grid = torch.full((P + trees.shape[0], trees.shape[1]), -1, dtype=torch.int64, device=trees.device)
    if P:
        grid[:P, 0] = plain.sampled_token_ids[:P, 0].to(trees.device)
    grid[P:] = trees
    return grid


class _ForwardTimer:
    """The target forward of a tree step: CUDA events (read once the step's results are on the host,
    so no extra sync), wall time elsewhere."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> "_ForwardTimer":
        if self.cuda:
            self.events[1].record()
        else:
            self.dt = time.perf_counter() - self.t0
        return self

    def seconds(self) -> float:
        return self.events[0].elapsed_time(self.events[1]) / 1000 if self.cuda else self.dt


class TreeRunnerMixin:
    """Mixed into vLLM's V1 model runner (see the module docstring)."""

    bole_config: TreeSpecConfig

    # ------------------------------------------------------------------ setup
    def _bole_setup(self, config: TreeSpecConfig) -> None:
        self._bole_async = bool(getattr(self, "use_async_scheduling", False))
        if self._bole_async and not config.async_scheduling:
            raise RuntimeError("vllm-bole: async scheduling is on but the tree config's async_scheduling is not (set "
                               "it there: the config hook turns vLLM's on)")
        logprobs_mode = getattr(self.model_config, "logprobs_mode", "raw_logprobs")
        if logprobs_mode not in ("raw_logprobs", "raw_logits"):
            raise NotImplementedError(
                f"vllm-bole tree speculation supports logprobs_mode raw_logprobs / raw_logits, not {logprobs_mode}"
            )
        if getattr(self.model_config, "logits_processors", None):
            raise NotImplementedError("vllm-bole tree speculation does not support custom logits processors")
        self._bole_logprobs_mode = logprobs_mode
        self._bole_auto: StepBudget | None = None  # kept across budget switches (its corrections with it)
        self._bole_set_config(config)
        self._bole_active = ActiveStep()
        self._bole_step: TreeStep | None = None
        self._bole_drafted = None  # (TreeBatch of the last drafts, {req id: row}, flat drafts per row)
        self._bole_drafts = None  # DraftTokenIds for the scheduler
        # (read the launched drafts, request ids, launch seconds, the StepBudget that launched them or None): read
        # when vLLM takes the drafts
        self._bole_pending_draft = None
        self._bole_launched = False  # this step's drafts were launched behind its verification (_sample)
        # async scheduling: the last step's sampled tokens on their way to the host (_bole_settle reads them) and
        # its tree step's host work that waits for its results (_bole_finish_step)
        self._bole_sampled = None  # (token grid on the host [rows, W], its copy event, {req id: row}, {req id: booked})
        self._bole_unsettled = None  # (fetch the verification results, TreeStep, plain rows, drafting launch seconds)
        self._bole_booked: dict[str, int] = {}  # this step's draft tokens the scheduler booked per request
        self._bole_graphs = None  # TreeGraphs: tree steps replayed from CUDA graphs (adapter.tree_graphs)
        self._bole_hidden_rows = None  # block / MTP drafter: [num_reqs] rows of the step's sample hidden states
        self._bole_sample_hidden = None  # the step's sample hidden states while sample_tokens runs (the heads)
        self._bole_async_hidden = None  # async, the heads: a step without trees' sample hidden states (the settle's)
        self._bole_num_trees = 0  # this step's tree rows (the last rows of the batch after _may_reorder_batch)
        self._bole_installed = False
        self._bole_pending_slots: dict[str, dict[int, int]] = {}  # req -> {group: slot} with a stashed path
        # the recurrent layers' pending-path rows: one per request of the step's trees (the others' paths are
        # flushed and their rows freed before the step's rows are handed out), row 0 for padding and warm-up
        self._bole_num_rows = self.scheduler_config.max_num_seqs + 1
        self._bole_reset_rows()
        self._bole_plain_mode_due = False  # a step without trees prepared: count the graph mode vLLM gives it
        self._bole_stats = dict(steps=0, tree_steps=0, graph_tree_steps=0, split_tree_steps=0, split_piecewise_steps=0,
                                plain_full_steps=0, plain_piecewise_steps=0, plain_eager_steps=0,
                                split_padding_rows=0, mixed_tree_steps=0,
                                prefill_mixed_tree_steps=0, placeholder_trees=0, resumed_requests=0, drafted_nodes=0,
                                chained_drafts=0, accepted=0, verified_requests=0, propose_s=0.0, choose_s=0.0,
                                plain_drafts=0, plain_draft_s=0.0,
                                settled_steps=0, **dict.fromkeys(PHASES, 0.0),
                                **{f"timed_{k}_steps{u}": z for k in STEP_KINDS for u, z in (("", 0), ("_s", 0.0))},
                                **{k: 0 if k.endswith("_steps") else 0.0 for k in by_kind_keys()})
        # the engine step under way: its kind (STEP_KINDS), when its input preparation began; when the last one's
        # sampling ended
        self._bole_step_kind: str | None = None
        self._bole_last_kind: str | None = None  # the kind of the step before it
        self._bole_step_t = self._bole_step_end = 0.0
        # the host timeline's marks (tree_step.HOST_PHASES): execute_model's entry, input preparation's end,
        # execute_model's end (0: not this step), where the engine's own work began (sample_tokens' end, or the end
        # of an execute_model without inputs, which is the engine's too)
        self._bole_exec_t = self._bole_prep_end = self._bole_exec_end = self._bole_engine_t = 0.0
        self._bole_busy = False  # this execute_model came within IDLE_GAP_S of the last step's sampled tokens
        self._bole_forward_timer: _ForwardTimer | None = None
        # the latest records, each log with its count of records ever appended (``{name}_total``): accept_log
        # (request, drafted first-child chain length, accepted draft nodes) per tree; slow_steps (below); step_log
        # per timed engine step [kind, requests, tree tokens, wall ms, then the ms of each of PHASES]
        self._bole_logs = {name: collections.deque(maxlen=n) for name, n in LOGS.items()}
        self._bole_stats.update({f"{name}_total": 0 for name in LOGS})
        self._bole_parts = dict.fromkeys(PHASES, 0.0)  # the step under way's timed parts
        self._bole_step_size = (0, 0)  # its requests and tree tokens
        # slow_steps: tree steps whose target forward took over SLOW_FORWARD_S: [tree step, requests, nodes, plain
        # rows beside them, replayed from a whole graph, forward ms, {Triton kernel: variants compiled since the
        # last check}]
        self._bole_variants: dict | None = None  # compiled Triton variants per kernel at the last check
        self._bole_calibration = Calibration()  # decaying: the builder's factors
        self._bole_kinds = torch.zeros_like(self._bole_calibration.counts)  # since start: the stats
        self._bole_metrics = WorkerMetrics(snapshot_path(self.vllm_config) if _first_rank() else None)
        top_k = min(config.top_k or config.num_speculative_tokens, MAX_TOP_K)
        self._bole_drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max, top_k=top_k,
                                          window=NGRAM_WINDOW) if config.drafter == "ngram" else None

    def _bole_set_config(self, config: TreeSpecConfig) -> None:
        self.bole_config = config
        self._bole_auto = self._bole_auto or (StepBudget(config) if config.fixed_budget is None else None)
        self._bole_budget = self._bole_auto if config.fixed_budget is None else None

    def bole_set_budget(self, budget) -> int | str:
        """Switch the node budget between steps: ``"auto"`` or an integer <= ``num_speculative_tokens``
        (validated as the config field; depth, drafter and KV slots unchanged). Benchmarks sweep budgets
        in one engine with it (``collective_rpc("bole_set_budget", args=(8,))``)."""
        fields = dict(self.bole_config.model_dump(), budget=budget)
        if budget != "auto":
            fields.update({k: TreeSpecConfig.model_fields[k].default for k in AUTO_ONLY})
        self._bole_set_config(TreeSpecConfig(**fields))
        return self.bole_config.budget

    def _bole_load_drafter(self) -> None:
        """The draft model, in the worker's process (before vLLM sizes its KV cache, so the draft's
        pages count as model memory): paged when it can (``draft_runtime``), else transformers; or the
        block or MTP drafter's heads, in the target's dtype, on the target's LM head."""
        cfg = self.bole_config
        if cfg.drafter == "ngram" or self._bole_drafter is not None:
            return
        top_k = min(cfg.top_k or cfg.num_speculative_tokens, MAX_TOP_K)
        if cfg.drafter in ("block", "mtp"):
            head = load_head(cfg.model, cfg.drafter, self.device, self.model_config.dtype)
            self._bole_drafter = HeadDrafter(head, self.model.compute_logits, top_k, depth=cfg.depth,
                                             max_budget=cfg.num_speculative_tokens, kernels=cfg.kernels)
            return
        if cfg.draft_runtime != "transformers":
            cls, beam = (PagedTreeDraftModel, dict(beam=cfg.draft_beam)) if cfg.draft_beam else (PagedDraftModel, {})
            try:
                self._bole_drafter = cls(
                    cfg.model, cfg.draft_dtype, top_k=top_k, device=self.device, max_len=self.max_model_len,
                    depth=cfg.depth, max_requests=self.scheduler_config.max_num_seqs,
                    max_budget=cfg.num_speculative_tokens,
                    kv_bytes=DRAFT_KV_BYTES[torch.device(self.device).type == "cuda"], kernels=cfg.kernels, **beam)
                return
            except NotImplementedError as e:
                if cfg.draft_beam:
                    raise NotImplementedError(f"draft_beam: {cfg.draft_beam} needs the paged runtime, which is not "
                                              f"possible: {e}; use draft_beam 0") from None
                if cfg.draft_runtime == "paged":
                    raise NotImplementedError(f"draft_runtime: 'paged' is not possible: {e}; use 'auto' or "
                                              "'transformers'") from None
                logger.info("vllm-bole: the draft model runs through transformers: %s", e)
        self._bole_drafter = HFDraftModel(cfg.model, cfg.draft_dtype, top_k=top_k, device=self.device)

    def _bole_install_layers(self, refresh: bool = False) -> None:
        """One layer object per attention / recurrent layer of the loaded model (once KV caches are
        bound), by KV-cache group. Installing is idempotent per vLLM layer."""
        if self._bole_installed and not refresh:
            return
        ctx = self.compilation_config.static_forward_context
        attn: dict[int, list[AttentionLayer]] = {}
        self._bole_recurrent: dict[int, list] = {}
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                module = ctx.get(name)
                if module is None:
                    continue
                if AttentionLayer.matches(module):
                    attn.setdefault(gid, []).append(AttentionLayer(name, module, gid, self._bole_active))
                    kc, _, _ = attn[gid][-1].kv_views()
                    if kc.shape[1] != self.input_batch.block_table[gid].block_size:
                        raise NotImplementedError(
                            f"vllm-bole: layer {name} has kernel block size {kc.shape[1]} but its block table uses "
                            f"{self.input_batch.block_table[gid].block_size}; hybrid kernel-block mapping is not "
                            "supported")
                    continue
                kind = next((k for k in RECURRENT_KINDS if k.matches(module)), None)
                if kind is None:  # every layer of a KV-cache group holds state a tree step must handle
                    raise NotImplementedError(
                        f"vllm-bole tree speculation: layer {name} ({type(module).__name__}) has no tree "
                        "override; supported: full attention, Mamba2 and Mamba1 mixers, Gated DeltaNet")
                layer = kind(name, module, gid, self._bole_active, self.bole_config.depth + 1, self._bole_num_rows)
                self._bole_recurrent.setdefault(gid, []).append(layer)
        self._bole_attention = [AttentionGroup(gid, layers) for gid, layers in attn.items()]
        self._bole_installed = True
        self._bole_log_start()

    def bole_tree_buffer_bytes(self) -> tuple[int, int]:
        """(bytes of every recurrent layer's pending-path buffer, ``_bole_num_rows`` rows each; bytes the
        largest tree step holds from its forward to its commit: the tree tokens' inputs of every recurrent
        layer), from the layers' dimensions, before the KV caches exist. The largest step: ``max_num_seqs``
        trees of ``num_speculative_tokens + 1`` nodes, at most the scheduler's token budget."""
        pending = per_token = 0
        for module in self.compilation_config.static_forward_context.values():
            kind = next((k for k in RECURRENT_KINDS if k.matches(module)), None)
            if kind is not None:
                p, t = kind.buffer_bytes(module, self.bole_config.depth + 1)
                pending, per_token = pending + p, per_token + t
        sc = self.scheduler_config
        tokens = min(sc.max_num_batched_tokens, sc.max_num_seqs * (self.bole_config.num_speculative_tokens + 1))
        return pending * self._bole_num_rows, per_token * tokens

    def _bole_recurrent_layers(self) -> list:
        """Every recurrent layer object, all KV-cache groups."""
        return [layer for layers in self._bole_recurrent.values() for layer in layers]

    def bole_capture_tree_graphs(self) -> int:
        """With ``VLLM_BOLE_TREE_GRAPHS=1``, CUDA graphs enabled (on CUDA) and a text-only model: capture
        :mod:`~vllm_bole.adapter.tree_graphs`' graphs (after the warm-up; the GPU worker calls it; on CPU
        the buckets replay eagerly, for tests). Returns the number of buckets."""
        from vllm_bole.adapter import tree_graphs

        mode = getattr(self.compilation_config, "cudagraph_mode", None)
        cuda = torch.device(self.device).type == "cuda"
        if not tree_graphs.enabled() or (cuda and (mode is None or mode.name == "NONE")):
            return 0
        if getattr(self, "uses_mrope", False) or getattr(self, "supports_mm_inputs", False) or \
                getattr(self, "use_aux_hidden_state_outputs", False):
            logger.info("vllm-bole: tree-step CUDA graphs are for text-only models without M-RoPE; not captured")
            return 0
        self._bole_install_layers()
        graphs = tree_graphs.TreeGraphs(self)
        graphs.capture(self)
        self._bole_graphs = graphs
        return len(graphs.buckets)

    def _bole_log_start(self) -> None:
        """The one INFO line that says tree speculation is on, and how."""
        cfg = self.bole_config
        mode = getattr(self.compilation_config, "cudagraph_mode", None)
        if mode is not None and mode.mixed_mode().name == "FULL":
            raise RuntimeError(f"vllm-bole: cudagraph_mode {mode.name} replays mixed batches as full graphs, which "
                               "skip the tree overrides; use FULL_AND_PIECEWISE, PIECEWISE or FULL_DECODE_ONLY")
        dev = torch.device(self.device).type
        kernels = cfg.kernels if cfg.kernels != "auto" else f"auto ({'triton' if dev == 'cuda' else 'torch'})"
        graphs = "off (eager)" if mode is None or mode.name == "NONE" else \
            f"{mode.name} (tree steps: {mode.mixed_mode().name})"
        logger.info("vllm-bole: method bole_tree active: drafter %s%s, node budget %s, max depth %d, kernels %s, "
                    "model runner %s (V1), CUDA graphs %s; tree overrides on %d attention and %d recurrent layers",
                    cfg.drafter, f" ({cfg.model}, {self._bole_drafter.runtime})" if cfg.model else "",
                    f"{cfg.budget} per request" if cfg.fixed_budget else
                    f"auto (controller, <= {cfg.num_speculative_tokens} per request, eps {cfg.eps})", cfg.depth,
                    kernels, type(self).__mro__[2].__name__, graphs,
                    sum(len(g.layers) for g in self._bole_attention), sum(map(len, self._bole_recurrent.values())))

    # ------------------------------------------------------------------ vLLM hooks
    def initialize_kv_cache(self, *args, **kwargs):
        out = super().initialize_kv_cache(*args, **kwargs)
        if kwargs.get("is_profiling"):  # vLLM's CUDA-graph memory profiling, on throw-away caches
            return out
        # at start-up: an unsupported layer fails here, before any request; maps follow the new KV config
        self._bole_install_layers(refresh=True)
        self._bole_pending_slots.clear()
        self._bole_reset_rows()
        return out

    def _update_states(self, scheduler_output):
        # preempted requests come back as resumed ones (recomputed from scratch; their pending path, if
        # any, was flushed into the freed slot at the step after the preemption, before any reuse of it
        # could read it: a reused slot starts without initial state)
        if not self._bole_async:  # drafts vLLM did not take (none expected): read before anything changes
            self._bole_finish_draft()
        self._bole_stats["resumed_requests"] += len(_resumed(scheduler_output))
        out = super()._update_states(scheduler_output)
        for rid in scheduler_output.finished_req_ids:
            self._bole_drop_pending(rid)
        if hasattr(self._bole_drafter, "release"):
            self._bole_drafter.release(scheduler_output.finished_req_ids)
        if self._bole_auto is not None:
            self._bole_auto.switch.forget(scheduler_output.finished_req_ids)
        if self._bole_async and self._bole_settle(scheduler_output):
            # vLLM ordered the batch (``_may_reorder_batch``, inside its ``_update_states``) by the booked drafts;
            # the settle cut some to none (no tree, or the switch chose plain decoding): the order again, its
            # moves applied to the sampling metadata and logits processors as vLLM applies its own
            self._may_reorder_batch(scheduler_output)
            self.input_batch.refresh_metadata()
        return out

    def _bole_trim_drafts(self, so) -> bool:
        """Async scheduling: this step's booked drafts (``so``: the runner's copy of the scheduler output, see
        :meth:`execute_model`) cut to each request's drafted tree (none: its root alone), in the scheduled
        tokens and the draft slots; the booked counts kept for the next settle (the scheduler rolls back the
        booked drafts; ``prev_num_draft_len`` counts its placeholders). Returns whether a request's booked
        drafts were all cut (the batch's order by drafts changed)."""
        spec = so.scheduled_spec_decode_tokens or {}
        self._bole_booked = {rid: len(d) for rid, d in spec.items()}
        drafted, index, _ = self._bole_drafted or (None, {}, None)
        sizes = drafted.nodes_per_request.tolist() if drafted is not None else []
        ib = self.input_batch
        emptied = False
        for rid, d in spec.items():
            keep = min(len(d), sizes[index[rid]] - 1) if rid in index else 0
            emptied |= keep == 0 < len(d)
            if keep < len(d):
                spec[rid] = d[:keep]
                so.num_scheduled_tokens[rid] -= len(d) - keep
                so.total_num_scheduled_tokens -= len(d) - keep
            state = self.requests.get(rid)
            if state is not None and rid in ib.req_id_to_index:
                ib.update_req_spec_token_ids(state, spec)  # after the settled tokens
                state.prev_num_draft_len = len(d)
        return emptied

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._bole_exec_t = t0 = time.perf_counter()
        self._bole_busy = busy = bool(self._bole_step_end) and t0 - self._bole_step_end <= IDLE_GAP_S
        if busy:  # the engine's work since sample_tokens
            self._bole_timed("engine_s", t0 - self._bole_engine_t)
        self._bole_prep_end = 0.0
        if self._bole_async and scheduler_output.scheduled_spec_decode_tokens:
            # a copy whose booked drafts _bole_trim_drafts cuts to the trees (the scheduler keeps its own, as vLLM
            # copies it for its GPU n-gram drafter)
            scheduler_output = dataclasses.replace(
                scheduler_output, num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
                scheduled_spec_decode_tokens=dict(scheduler_output.scheduled_spec_decode_tokens))
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            self._bole_exec_end = time.perf_counter()
            if self._bole_prep_end:  # a step with inputs
                self._bole_timed("forward_host_s", self._bole_exec_end - self._bole_prep_end)
            else:  # none (vLLM returns early: finished requests to drop, every request waiting): the engine's work
                if busy:
                    self._bole_timed("engine_s", self._bole_exec_end - t0)
                self._bole_engine_t = self._bole_exec_end

    def _bole_settle(self, scheduler_output) -> bool:
        """Async scheduling: the last step's results applied on the host before this step's inputs are laid
        out (vLLM's scheduler booked this step while the last one ran: ``1 + b`` tokens for a request with ``b``
        booked drafts, every draft taken as accepted, ``-1`` placeholders for its output tokens). Waits for the
        last step's token grid (the copy vLLM's async output queued), then per request still in the batch:
        its placeholders replaced by the tokens it emitted (output tokens, token rows, ``num_tokens_no_spec``),
        ``num_computed_tokens`` less the ``b + 1 - emitted`` the scheduler assumed (it corrects its own when it
        processes that output, after this step is launched); vLLM's device copy of the last tokens dropped
        (inputs come from the corrected host rows). Then the last tree step's host work
        (:meth:`_bole_finish_step`), this step's drafts (those launched behind the last verification read, else
        drafted now from the corrected histories) and its booked drafts cut to them (:meth:`_bole_trim_drafts`,
        whose answer it returns: some request left without drafts)."""
        t0 = time.perf_counter()
        sampled, self._bole_sampled = self._bole_sampled, None
        ib = self.input_batch
        rows = {}
        if sampled is not None:
            grid, event, rows, booked = sampled
            event.synchronize()
            grid = grid.tolist()
            for rid, r in rows.items():
                i, state = ib.req_id_to_index.get(rid), self.requests.get(rid)
                if i is None or state is None:  # left the batch (vLLM rebuilds its tokens when it comes back)
                    continue
                row = grid[r]
                emitted = row[: row.index(-1)] if -1 in row else row
                out = state.output_token_ids
                while out and out[-1] == -1:  # the step's placeholders (1 + booked, vLLM's own count)
                    out.pop()
                out.extend(emitted)
                end = int(ib.num_prompt_tokens[i]) + len(out)
                ib.token_ids_cpu[i, end - len(emitted): end] = emitted
                ib.num_tokens_no_spec[i] = end
                rejected = booked.get(rid, 0) + 1 - len(emitted)
                state.num_computed_tokens -= rejected
                ib.num_computed_tokens_cpu[i] -= rejected
            ib.prev_sampled_token_ids = None  # input ids from the host rows, not vLLM's device copy
            ib.sampled_token_ids_cpu = ib.async_copy_ready_event = None
            self._bole_stats["settled_steps"] += 1
        self._bole_finish_unsettled()
        hidden = self._bole_settle_hidden(rows)  # taken whatever follows: it is the last step's only
        if self._bole_pending_draft is None and ib.num_reqs:
            self._bole_propose(hidden)
        self._bole_finish_draft()
        emptied = self._bole_trim_drafts(scheduler_output)
        self._bole_timed("settle_s", time.perf_counter() - t0)
        return emptied

    def _bole_settle_hidden(self, rows: dict) -> torch.Tensor | None:
        """Async scheduling, the heads: the last step's sample hidden states (a step without trees: a row per request,
        :meth:`sample_tokens`) in this step's request order, ``rows`` {req id: its row in that step} (vLLM's
        ``prev_req_id_to_index``; a request without one drafts nothing: it is prefilling, row 0 stands in); None for
        the other drafters or without such a step."""
        hidden, self._bole_async_hidden = self._bole_async_hidden, None
        if hidden is None:
            return None
        ib = self.input_batch
        return hidden[upload(torch.tensor([rows.get(rid, 0) for rid in ib.req_ids[:ib.num_reqs]]), hidden.device)]

    def _bole_tree_rows(self, scheduler_output) -> list[bool]:
        """Per persistent-batch row: verified as a tree this step. The requests vLLM scheduled with drafts;
        with tree graphs also every other request decoding its next token (one token scheduled, its prompt
        done) whose sampling a tree reproduces, as a root-only tree: a step of such requests is then a step
        of trees alone, which a graph replays (else a request without drafts makes the step mixed)."""
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        ib = self.input_batch
        rows = [bool(spec.get(ib.req_ids[i])) for i in range(ib.num_reqs)]
        if self._bole_graphs is None or not any(rows):
            return rows
        sched = scheduler_output.num_scheduled_tokens
        for i, rid in enumerate(ib.req_ids[: ib.num_reqs]):
            state = self.requests.get(rid)
            rows[i] = rows[i] or (sched.get(rid) == 1 and state is not None and supports_tree(state.sampling_params)
                                  and int(ib.num_computed_tokens_cpu[i]) + 1 == int(ib.num_tokens_no_spec[i]))
        return rows

    def _may_reorder_batch(self, scheduler_output) -> None:
        super()._may_reorder_batch(scheduler_output)
        is_tree = self._bole_tree_rows(scheduler_output)
        self._bole_num_trees = sum(is_tree)
        for k, j in plain_first_swaps(is_tree):  # none without trees
            self.input_batch.swap_states(k, j)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        t0 = time.perf_counter()
        if self._bole_step_kind is not None:  # the last step's interval: the bookkeeping before this step's inputs
            self._bole_timed("update_s", t0 - self._bole_exec_t)
        self._bole_time_step(t0)
        try:
            return self._bole_prepare_inputs(scheduler_output, num_scheduled_tokens)
        finally:
            self._bole_prep_end = time.perf_counter()
            self._bole_timed("prepare_s", self._bole_prep_end - t0)

    def _bole_time_step(self, now: float) -> None:
        """The previous engine step's wall time, from its input preparation to this one's (the engine's
        scheduling and output processing between them included), into its kind's counters (``trees``:
        trees alone; ``mixed``: trees beside prompt or plain rows; ``plain``: no trees; ``catchup``: trees alone
        right after a plain step), unless the engine idled after it (over IDLE_GAP_S from its sampled tokens to
        this step's ``execute_model``: the settle of its results under async scheduling, our work between that
        entry and this input preparation, is not idling; measured here, a settle drafting through transformers on
        a loaded 2-core CI machine, 240 ms, left a whole run untimed)."""
        kind, t, self._bole_step_kind, self._bole_step_t = self._bole_step_kind, self._bole_step_t, None, now
        self._bole_last_kind = kind
        parts, self._bole_parts = self._bole_parts, dict.fromkeys(PHASES, 0.0)
        if kind is not None and self._bole_busy:
            self._bole_stats[f"timed_{kind}_steps"] += 1
            self._bole_stats[f"timed_{kind}_steps_s"] += now - t
            self._bole_log("step_log", [kind, *self._bole_step_size, round(1000 * (now - t), 3)]
                           + [round(1000 * parts[p], 3) for p in PHASES])

    def _bole_log(self, name: str, record) -> None:
        self._bole_logs[name].append(record)
        self._bole_stats[f"{name}_total"] += 1

    def _bole_timed(self, phase: str, seconds: float) -> None:
        """``seconds`` of ``phase`` (tree_step.PHASES) into its counter and into that of the kind of the engine
        step under way (set at its input preparation; a step's later parts, its results read at the next
        step's settle under async scheduling included, run before the next input preparation resets it)."""
        self._bole_stats[phase] += seconds
        self._bole_parts[phase] += seconds
        if self._bole_step_kind is not None:
            self._bole_stats[f"by_kind_{self._bole_step_kind}_{phase}"] += seconds

    def _bole_prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if self._bole_budget is not None:
            self._bole_budget.start()
        t0 = time.perf_counter()
        logits_indices, spec_md, max_sampled = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        vllm_s = time.perf_counter() - t0
        assert spec_md is None, "vllm-bole: the model-side config must not carry vLLM's speculative config"
        self._bole_install_layers()
        self._bole_stats["steps"] += 1
        ib = self.input_batch  # _may_reorder_batch put the step's tree requests last
        self._bole_flush_pending(exclude=set(ib.req_ids[ib.num_reqs - self._bole_num_trees: ib.num_reqs]))
        step, pos, tree_logits = self._bole_build_step(scheduler_output, num_scheduled_tokens)
        kind = "plain" if step is None else "trees" if step.num_plain == 0 else "mixed"
        self._bole_step_kind = "catchup" if kind == "trees" and self._bole_last_kind == "plain" else kind
        self._bole_stats[f"by_kind_{self._bole_step_kind}_steps"] += 1
        self._bole_step_size = (self.input_batch.num_reqs, 0 if step is None else step.num_tokens)
        self._bole_timed("prepare_vllm_s", vllm_s)
        self._bole_step = step
        plain = step.num_plain if step is not None else self.input_batch.num_reqs
        qsl = self.query_start_loc.np[: plain + 1]
        prefill = bool(plain) and int((qsl[1:] - qsl[:-1]).max()) > 1
        if self._bole_budget is not None:
            so = scheduler_output
            changed = bool(so.scheduled_new_reqs or so.finished_req_ids or _resumed(so))
            self._bole_budget.step_begun(self.input_batch.num_reqs, step is not None, prefill, changed)
        if step is None:
            self._bole_plain_mode_due = True  # the graph mode vLLM dispatches this step to, counted
            return logits_indices, spec_md, max_sampled
        s, T = step.tok_start, step.num_tokens
        self.positions[s : s + T] = pos
        if getattr(self, "uses_mrope", False):
            # M-RoPE (Qwen3.5, VL models): a decode token's position is the same in every row, the text
            # position plus the request's delta (vLLM's MRotaryEmbedding.get_next_input_positions_tensor)
            delta = torch.tensor([self.requests[rid].mrope_position_delta for rid in step.req_ids], dtype=torch.long)
            mrope = self.mrope_positions.gpu
            mrope[:, s : s + T] = (pos + upload(delta, pos.device)[step.tree.request_index]).to(mrope.device, mrope.dtype)
        # the trees' tokens (with async scheduling vLLM's rows hold placeholders for the drafts); placeholders
        # (-1: vLLM's padding of a new request's drafts) must not reach the embedding
        self.input_ids.gpu[s : s + T] = step.tree.token_ids.clamp(min=0)
        self._bole_stats["prefill_mixed_tree_steps"] += prefill
        if self._bole_stats["tree_steps"] < CHECKED_STEPS:
            self._bole_check_slots(step)
        for g in self._bole_attention:
            g.begin(step)
        return tree_logits, None, max_sampled

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        # A tree step is a mixed batch even when every tree is its root alone (one token per request,
        # which vLLM would take for a uniform decode and replay as a FULL graph, skipping the overrides).
        # So is a plain step with a request still in its prompt (a one-token prompt, a one-token last chunk):
        # :meth:`_bole_prefilling`.
        if self._bole_step is not None or (self._bole_plain_mode_due and kwargs.get("force_uniform_decode") is None
                                           and self._bole_prefilling()):
            kwargs["force_uniform_decode"] = False
        out = super()._determine_batch_execution_and_padding(*args, **kwargs)
        if self._bole_step is None and self._bole_plain_mode_due:
            # a step without trees: which of vLLM's graphs replays it (``plain_{full,piecewise,eager}_steps``; at
            # f428370 our plain steps' forward took 1.4-2.7 ms of host time where AR's whole step took 2.8-8.0)
            self._bole_plain_mode_due = False
            mode = out[0].name.lower()
            self._bole_stats[f"plain_{'eager' if mode == 'none' else mode}_steps"] += 1
        return out

    def _bole_prefilling(self) -> bool:
        """Whether a request of the persistent batch is still in its prompt (vLLM's ``is_prefilling``).

        Decision: such a step never replays a FULL decode graph. vLLM 0.33's V1 runner dispatches by shape
        alone: one token for every request is a uniform decode, FULL graph, even when one of them is a one-token
        prompt. Its recurrent builders (GDN, Mamba) then count that row as a prefill (no prior state: a zero
        initial state, not the slot's recycled one) and, with a prefill in the batch, leave the graph's staged
        decode state indices as the previous step left them: the graph's decode kernels read and write the wrong
        state slots for that row (a stale index, or the null block). vLLM's V2 runner excludes such batches from
        full decode graphs (``has_prefill``); the plugin forces V1 (README, "Model runner"), so it excludes them
        here: the step runs vLLM's mixed mode (piecewise graphs, the builders' prefill path). Suspected cause of
        Qwen3-Next's mixed-batch failure on the H100 at f428370 (a one-token prompt's first token parted) and
        not yet confirmed there; the cost is a piecewise step where a prompt ends in one token."""
        ib = self.input_batch
        n = ib.num_reqs
        return bool((ib.num_computed_tokens_cpu[:n] < ib.num_prompt_tokens[:n]).any())

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, *args, **kwargs):
        step = self._bole_step
        if step is None or kwargs.get("for_cudagraph_capture"):
            return super()._build_attention_metadata(num_tokens, num_reqs, max_query_len, *args, **kwargs)
        if step.num_plain == 0:
            names = [n for g in self.kv_cache_config.kv_cache_groups for n in g.layer_names]
            return {n: None for n in names}, None
        qsl = self.query_start_loc.cpu[: step.num_plain + 1]
        kwargs.update(num_tokens_padded=None, num_reqs_padded=None, ubatch_slices=None)
        return super()._build_attention_metadata(
            step.tok_start, step.num_plain, int((qsl[1:] - qsl[:-1]).max()), *args, **kwargs
        )

    def _model_forward(self, *args, **kwargs):
        step = self._bole_step
        self._bole_active.step = step
        timer = _ForwardTimer(self.device) if step is not None else None
        try:
            if self._bole_graphs is not None and step is not None:  # None: no bucket holds the step's trees
                out = (self._bole_graphs.replay(self, step) if step.num_plain == 0
                       else self._bole_split_forward(step, *args, **kwargs))
                if out is not None:
                    self._bole_stats["graph_tree_steps"] += 1
                    self._bole_stats["split_tree_steps"] += step.num_plain > 0
                    return out
            return super()._model_forward(*args, **kwargs)
        finally:
            self._bole_active.step = None
            self._bole_forward_timer = timer and timer.stop()

    def _bole_split_forward(self, step, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                            **model_kwargs):
        """A step with plain rows (prompt chunks, plain decodes) beside tree requests as two forwards: the plain
        rows through the model as vLLM runs them (no tree override; from vLLM's piecewise graphs where it
        captured a size that holds them, :meth:`_bole_plain_graph`, else eagerly), then the trees from their bucket's graph (:mod:`~vllm_bole.adapter.tree_graphs`), their tokens moved
        to the front of vLLM's persistent buffers as a step of trees alone has them. Returns the hidden
        states of the step's ``tok_start + num_tokens`` tokens in vLLM's layout, or None (no bucket holds the
        trees, or inputs the graphs do not take: the one forward with eager tree layers then runs).

        Decision: with requests refilled as they finish, a prompt lands beside running trees in 14-42% of the
        tree steps (the H200 at 95f1a40, the 70M pair, c = 8-128), and one forward of both ran vLLM's
        piecewise graphs with every tree layer eager between them: 7-11 ms against 0.6-1.0 ms from a
        graph, with 0.2-1.5 s stalls in some."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, set_forward_context

        graphs, fc = self._bole_graphs, get_forward_context()
        if (intermediate_tensors is not None or inputs_embeds is not None or model_kwargs or positions is None
                or positions.dim() != 1 or not isinstance(fc.slot_mapping, dict) or graphs.bucket_of(step) is None):
            return None
        s, T = step.tok_start, step.num_tokens
        mode, desc = self._bole_plain_graph(s)
        S = desc.num_tokens  # s, or padded to the piecewise graphs' size: the rows after s are not written
        self._bole_stats["split_piecewise_steps"] += mode != CUDAGraphMode.NONE
        self._bole_stats["split_padding_rows"] += S - s
        padded = {}  # KV slots of the padding rows: -1 (vLLM's padding), one tensor per KV-cache group
        for v in fc.slot_mapping.values():
            if id(v) not in padded:
                padded[id(v)] = v[:s] if S == s else torch.cat([v[:s], v.new_full((S - s,), -1)])
        self._bole_active.step = None
        try:
            with set_forward_context(fc.attn_metadata, self.vllm_config, num_tokens=S, cudagraph_runtime_mode=mode,
                                     batch_descriptor=desc,
                                     slot_mapping={k: padded[id(v)] for k, v in fc.slot_mapping.items()}):
                plain = self.model(input_ids=input_ids[:S], positions=positions[:S])
        finally:
            self._bole_active.step = step
        self.input_ids.gpu[:T] = self.input_ids.gpu[s: s + T].clone()
        self.positions[:T] = self.positions[s: s + T].clone()
        for gid in range(len(self.kv_cache_config.kv_cache_groups)):  # as vLLM's _get_slot_mappings reads them
            slots = self.input_batch.block_table[gid].slot_mapping.gpu
            slots[:T] = slots[s: s + T].clone()
        return torch.cat([plain[:s], graphs.replay(self, step)[:T]])

    def _bole_plain_graph(self, num_tokens: int):
        """vLLM's CUDA-graph mode and batch descriptor for a forward of a split step's ``num_tokens`` plain rows:
        its piecewise graphs where it captured a size that holds them (the descriptor's ``num_tokens``, padded),
        else eagerly (always with ``VLLM_BOLE_SPLIT_PIECEWISE=0``). Never a FULL graph (its attention metadata
        would have to be padded too).

        Decision: until the matrix at ebdbbaa the plain rows ran eagerly, ~10 ms a split step on the H200 for
        the 70M pair (the forward 1.8 / 4.3 / 6.2 ms a tree step at c = 8 / 32 / 128 with 12-45% of the steps
        split, against 0.5 ms at c = 1, where none is): launch-bound, where AR runs the same rows from these
        graphs. Padding rows are vLLM's own: KV slot -1, attention and recurrent metadata of the real rows."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        from vllm_bole.adapter.tree_graphs import split_piecewise

        if not split_piecewise():  # VLLM_BOLE_SPLIT_PIECEWISE=0
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens=num_tokens)
        return self.cudagraph_dispatcher.dispatch(num_tokens=num_tokens, uniform_decode=False,
                                                  invalid_modes={CUDAGraphMode.FULL})

    def _sample(self, logits, spec_decode_metadata):
        step = self._bole_step
        if step is None:
            return super()._sample(logits, spec_decode_metadata)
        self._bole_step = None
        from vllm.v1.outputs import SamplerOutput

        P, tree = step.num_plain, step.tree
        md = self.input_batch.sampling_metadata
        if md.max_num_logprobs == -1 or md.logprob_token_ids:
            raise NotImplementedError(
                "vllm-bole: full-vocabulary logprobs (-1) and logprob_token_ids are not supported in a batch that "
                "verifies draft trees"
            )
        tlogits = logits[P:]
        # vLLM's sampler runs over every request of the batch (its metadata has a row each); a tree row's
        # draw is discarded, so a batch of trees alone skips it
        plain = self.sampler(logits=torch.cat([logits[:P], tlogits[tree.starts]]),
                             sampling_metadata=md) if P else None
        t0 = time.perf_counter()
        params = [self.requests[rid].sampling_params for rid in step.req_ids]
        res = verify_tree(tree, constrain(self.input_batch, step, tlogits.float(), params),
                          tree_sampling(params, [self.input_batch.generators.get(r) for r in step.rows]),
                          kernels=step.kernels)
        if isinstance(self._bole_drafter, HeadDrafter):  # the rows that emitted each request's new root
            self._bole_hidden_rows = torch.cat([torch.arange(P, device=logits.device), P + res.last_node.long()])
        graphs = self._bole_graphs
        if graphs is not None and graphs.bucket is not None:  # the step replayed a graph
            transient = graphs.saved_bytes[graphs.bucket]
            graphs.commit(self, res)
        else:
            transient = sum(layer.saved_bytes() for layer in self._bole_recurrent_layers())
            commit(self._bole_attention + self._bole_recurrent_layers(), tree, res)
        for r, rid in enumerate(step.req_ids if step.state_slots else ()):  # host copies: no device sync
            self._bole_pending_slots[rid] = {gid: slots[r] for gid, slots in step.state_slots_host.items()}
        t1 = time.perf_counter()
        self._bole_timed("verify_commit_s", t1 - t0)
        self._bole_metrics.observe("vllm:bole_verify_commit_seconds", t1 - t0)
        self._bole_metrics.observe("vllm:bole_transient_recurrent_bytes", transient)
        fetch = res.to_host_async()  # the step's results, copied to the host behind its commit
        launch_s = 0.0  # drafting (draft_s), not this step's finish or its measured time
        if hasattr(self._bole_drafter, "grow_trees_async"):  # the next drafts behind it, from its tokens on the device
            self._bole_launched = True
            self._bole_stats["chained_drafts"] += 1
            tokens, counts = res.output_token_ids, res.num_emitted
            if P:  # the plain rows' sampled tokens first (a prompt chunk's row that samples nothing is not drafted)
                head = torch.full((P, tokens.shape[1]), -1, dtype=tokens.dtype, device=tokens.device)
                head[:, 0] = plain.sampled_token_ids[:P, 0]
                tokens, counts = torch.cat([head, tokens]), torch.cat([torch.ones_like(counts[:1]).expand(P), counts])
            self._bole_propose(self._bole_sample_hidden, pending=(tokens, counts), plain=P)
            launch_s = time.perf_counter() - t1
            t1 += launch_s
        if self._bole_async and md.max_num_logprobs is None:  # the host work that needs the results: next step
            self._bole_unsettled = (fetch, step, P, launch_s)
            self._bole_timed("finish_s", time.perf_counter() - t1)
            return SamplerOutput(sampled_token_ids=_token_grid(P, plain, res.output_token_ids).int(),
                                 logprobs_tensors=None)
        host = fetch()  # the forward has run
        logprobs = None
        if md.max_num_logprobs is not None:
            logprobs = emitted_logprobs(self.sampler, self._bole_logprobs_mode, logits, P, step.host_tree, host,
                                        _token_grid(P, plain, host.output_token_ids), md.max_num_logprobs)
        self._bole_finish_step(step, host, P, launch_s)
        self._bole_timed("finish_s", time.perf_counter() - t1)
        # the grid from the device's tokens, as vLLM's own sampler hands it over (not built on the host and uploaded
        # again: ~90 us of host ops and a copy a step, a helper's profile)
        return SamplerOutput(sampled_token_ids=_token_grid(P, plain, res.output_token_ids).int(),
                             logprobs_tensors=logprobs)

    def _bookkeeping_sync(self, scheduler_output, sampler_output, *args, **kwargs):
        # async scheduling: vLLM's bookkeeping takes a grid of several tokens a row only beside its own
        # speculation's device copy of the last tokens (prev_sampled_token_ids); a tree step's grid gets a
        # stand-in, which _bole_settle drops before the next inputs (they come from the host rows)
        ib = self.input_batch
        if self._bole_async and ib.prev_sampled_token_ids is None and sampler_output.sampled_token_ids.shape[-1] > 1:
            ib.prev_sampled_token_ids = sampler_output.sampled_token_ids[:, :1]
        return super()._bookkeeping_sync(scheduler_output, sampler_output, *args, **kwargs)

    def _bole_finish_unsettled(self) -> None:
        """Async scheduling: the last tree step's host work on its results, if still to do (at the next step's
        settle, or when the counters are read: the last step before the engine idles has no next one)."""
        unsettled, self._bole_unsettled = self._bole_unsettled, None
        if unsettled is not None:
            fetch, step, P, launch_s = unsettled
            self._bole_finish_step(step, fetch(), P, launch_s)

    def _bole_finish_step(self, step: TreeStep, host, P: int, launch_s: float) -> None:
        """A tree step's host work on its verification results ``host`` (on the host): the forward's time,
        counters, accept log, calibration, the controller's observations; ``P`` plain rows beside the trees,
        ``launch_s`` the next drafts' launch inside the step."""
        tree = step.tree
        if self._bole_forward_timer is not None:
            fwd, self._bole_forward_timer = self._bole_forward_timer.seconds(), None
            self._bole_timed("forward_s", fwd)
            grown = self._bole_compiled() if self._bole_variants is None or fwd > SLOW_FORWARD_S else None
            if fwd > SLOW_FORWARD_S:
                graphs = self._bole_graphs
                self._bole_log("slow_steps", [self._bole_stats["tree_steps"], tree.num_requests, tree.num_nodes, P,
                                            graphs is not None and graphs.bucket is not None, round(1000 * fwd, 1),
                                            grown])
        acc = host.num_accepted.tolist()
        st = self._bole_stats
        st["tree_steps"] += 1
        st["mixed_tree_steps"] += int(P > 0)
        st["verified_requests"] += tree.num_requests
        st["drafted_nodes"] += int((host_array(step.host_tree.token_ids) >= 0).sum()) - tree.num_requests
        st["accepted"] += sum(acc)
        for r, rid in enumerate(step.req_ids):
            self._bole_log("accept_log", (rid, step.chain_len[r], acc[r]))
        kinds = kind_counts(step.host_tree, host.accepted_nodes)
        self._bole_kinds += kinds
        self._bole_calibration.update(kinds)
        if self._bole_budget is not None:
            self._bole_budget.emitted(P + tree.num_requests + sum(acc), {r: 1 + a for r, a in zip(step.req_ids, acc)})
            times = self._bole_budget.observe(P + tree.num_requests, step.tok_start + step.num_tokens,
                                              float(step.kv_tokens), launch_s, mixed=P > 0)
            if times is not None:
                self._bole_metrics.observe("vllm:bole_step_predicted_seconds", times[0])
                self._bole_metrics.observe("vllm:bole_step_measured_seconds", times[1])

    def _bole_compiled(self) -> dict:
        """{Triton kernel: variants compiled since the last call} (CUDA; elsewhere nothing compiles)."""
        if torch.device(self.device).type != "cuda":
            return {}
        variants, last = triton_variants(), self._bole_variants or {}
        self._bole_variants = variants
        return {k: n - last.get(k, 0) for k, n in variants.items() if n > last.get(k, 0)}

    def sample_tokens(self, grammar_output):
        t0 = time.perf_counter()
        if self._bole_exec_end:
            self._bole_timed("between_s", t0 - self._bole_exec_end)
            self._bole_exec_end = 0.0
        state = getattr(self, "execute_model_state", None)
        # the heads draft from the step's hidden states in _sample, behind the verification (vLLM's sample_tokens
        # takes the state apart before it calls _sample)
        self._bole_sample_hidden = state.sample_hidden_states if state is not None else None
        out = super().sample_tokens(grammar_output)
        self._bole_sample_hidden = None
        if self._bole_async:  # drafted at the next step's settle, unless launched behind the verification
            if hasattr(out, "async_copy_ready_event"):  # vLLM's async output: the grid's copy to the host is queued
                self._bole_sampled = (out.sampled_token_ids_cpu, out.async_copy_ready_event,
                                      dict(self.input_batch.prev_req_id_to_index or {}), self._bole_booked)
            if isinstance(self._bole_drafter, HeadDrafter) and state is not None and not self._bole_launched:
                self._bole_async_hidden = state.sample_hidden_states  # its rows: the settle's (vLLM's mapping)
        elif state is not None and not self._bole_launched:
            self._bole_propose(state.sample_hidden_states)
        self._bole_launched = False
        self._bole_step_end = self._bole_engine_t = time.perf_counter()
        self._bole_timed("sample_s", self._bole_step_end - t0)
        return out

    def take_draft_token_ids(self):
        self._bole_finish_draft()
        drafts, self._bole_drafts = self._bole_drafts, None
        return drafts

    def bole_stats(self) -> dict:
        """Counters (steps, tree steps, ``graph_tree_steps`` those replayed from a whole CUDA graph
        (``split_tree_steps`` of them beside plain rows, which ran a forward of their own: ``split_piecewise_steps``
        from vLLM's piecewise graphs, padded by ``split_padding_rows`` rows in all), ``timed_{kind}_steps`` and
        ``timed_{kind}_steps_s`` (engine steps and their wall time by kind: ``_bole_time_step``), drafted
        nodes, accepted nodes, ``chained_drafts`` (drafts launched behind a tree step's verification, from
        its tokens on the device), ``plain_drafts`` / ``plain_draft_s`` (drafts made after a step without trees,
        the draft catching up on a prompt or on plain decoding: count and seconds); seconds: ``draft_s`` drafting
        per step (``propose_s`` of it the drafter's own, ``choose_s`` the budget controller's choice and the cut to
        it, the rest building trees), ``prepare_s`` input preparation per step (host; ``prepare_vllm_s`` of it
        vLLM's own), ``forward_s`` the target forward of tree steps (device time on CUDA),
        ``verify_commit_s`` per tree step (host, until the results are queued), ``finish_s`` the tree
        step's sampler output after that (results to the host, counters); the host's timeline of each step,
        ``tree_step.HOST_PHASES``, which tiles its wall time) and the per-step log of
        (request, drafted greedy-chain length, accepted draft nodes); ``step_log``: per timed engine step [kind,
        requests, tree tokens, wall ms, ms of each of ``tree_step.PHASES``]; each log's ``{name}_total``: its records
        ever appended (the latest :data:`LOGS` are kept); ``slow_steps``: the tree steps whose
        forward took over ``SLOW_FORWARD_S`` (tree step, requests, nodes, plain rows, from a whole graph, ms,
        Triton kernels compiled since the last check: ``dispatch.triton_variants``);
        ``branch_by_depth``: per depth
        1..max_depth, main-path and sibling nodes reached and accepted since the engine started;
        ``calibration``: per node kind (main, branch, off) and depth the recent acceptance rates and
        the builder's factors (``spec_decode.calibration``); with ``budget: "auto"`` the
        controller's counters (budget_steps, budget_nodes, budget_last: the latest per-request
        budgets, budget_buckets: choices per token bucket, controller_model: what it learnt (the forward's
        ratio to its prior per token bucket, drafting and rest as [ms, ms per draft node] per batch bucket),
        observed_steps, predicted_step_s / measured_step_s: sums over observed steps;
        plain_decode_steps: steps the speculation switch had decode plainly; switch_rates: per batch
        bucket its estimated tokens / s / request of tree steps and of plain decoding; switch_samples: the
        samples behind them, per mode {"tokens": per request of its latest decode steps, "seconds": of its
        latest steady steps}; switch_cost_ms: per batch bucket the measured cost of a round trip between the
        modes beyond their steady steps)."""
        self._bole_finish_unsettled()
        budget = {}
        if self._bole_auto is not None:
            switch = self._bole_auto.switch
            per_mode = lambda f: {b: {"trees" if m else "plain": v for m, v in f(b).items()}  # noqa: E731
                                  for b in sorted(switch.buckets)}
            budget = dict(self._bole_auto.stats, switch_rates=per_mode(switch.rates),
                          switch_samples=per_mode(switch.samples), controller_model=self._bole_auto.model(),
                          switch_cost_ms={b: round(1000 * switch.cost(b), 3) for b in sorted(switch.buckets)})
        depth = slice(1, self.bole_config.depth + 1)
        cols = branch_columns(self._bole_kinds)
        branch = {c: cols[depth, i].tolist() for i, c in enumerate(BRANCH_COLUMNS)}
        return dict(self._bole_stats, **budget, branch_by_depth=branch,
                    calibration=self._bole_calibration.rates(self.bole_config.depth),
                    **{name: list(log) for name, log in self._bole_logs.items()})

    # ------------------------------------------------------------------ tree step
    def _bole_build_step(self, scheduler_output, num_scheduled_tokens) -> tuple:
        """The trees of the requests vLLM scheduled with drafts: exactly the drafted trees (selected
        and truncated to the scheduled drafts), or placeholders where the drafts are not ours
        (vLLM's ``-1`` padding of a new request: never accepted). Returns (:class:`TreeStep`, the tree
        tokens' positions [T], the step's logits indices: the plain requests' last tokens and every
        tree node), all tensors on the device through one copy; ``(None, None, None)`` without trees."""
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        ib = self.input_batch
        n = ib.num_reqs
        if not self._bole_num_trees:
            return None, None, None
        P = n - self._bole_num_trees  # _may_reorder_batch put the tree requests last
        rows = list(range(P, n))
        drafted, index, flat = self._bole_drafted or (None, {}, [])
        if self._bole_async:  # the drafts of one step (the scheduler's are placeholders: nothing to match)
            self._bole_drafted = None
        pick, sizes, roots = [], [], []
        for i in rows:
            rid = ib.req_ids[i]
            drafts = list(spec.get(rid, ()))
            k = len(drafts)
            if int(num_scheduled_tokens[i]) != k + 1:
                raise RuntimeError(f"vllm-bole: request {rid} has {k} drafts but {int(num_scheduled_tokens[i])} tokens")
            row = index.get(rid, -1)
            if row < 0 or (not self._bole_async and flat[row][:k] != drafts):
                row = -1
                self._bole_stats["placeholder_trees"] += 1
            pick.append(row)
            sizes.append(k + 1)
            roots.append(int(ib.token_ids_cpu[i, int(ib.num_computed_tokens_cpu[i])]))
        tree = drafted.select(pick, sizes, root_tokens=roots) if drafted is not None else None
        if tree is None:  # nothing drafted by us (e.g. only vLLM's placeholders so far)
            from vllm_bole.spec_decode.tree import TreeBatch

            tree = TreeBatch.from_parents([[-1]], [[0]]).select([-1] * len(rows), sizes, root_tokens=roots)
        chain = tree.first_child_depth().tolist()
        prefix_np = ib.num_computed_tokens_cpu[rows].astype(np.int64)
        # positions prefix + depth, logits at the plain requests' last tokens and at every tree node
        qsl = self.query_start_loc.np
        T, start = tree.num_nodes, int(qsl[P])
        pos = prefix_np[np.repeat(np.arange(len(rows)), tree.nodes_per_request.numpy())] + tree.depth.numpy()
        logits = np.concatenate([qsl[1: P + 1] - 1, np.arange(start, start + T)]).astype(np.int64)
        # the step's trees and per-request tables in one host-to-device copy
        groups = [g.group for g in self._bole_attention]
        host_slots = [ib.block_table[gid].block_table.np[rows, 0] for gid in self._bole_recurrent]
        prow = [self._bole_row(ib.req_ids[i]) for i in rows] if self._bole_recurrent else []
        host_tree = tree
        tree, (pos, logits, prefix, *tables) = host_tree.upload_with(self.device, [
            torch.from_numpy(pos), torch.from_numpy(logits), torch.from_numpy(prefix_np)]
            + [ib.block_table[g].block_table.cpu[rows] for g in groups]
            + [torch.from_numpy(s.astype(np.int64)) for s in host_slots]
            + ([torch.tensor(prow, dtype=torch.int64)] if prow else []))
        block_tables = dict(zip(groups, tables))
        state_slots = dict(zip(self._bole_recurrent, tables[len(groups):]))
        step = TreeStep(num_plain=P, tok_start=start, tree=tree, host_tree=host_tree,
                        prefix_len=prefix,
                        req_ids=[ib.req_ids[i] for i in rows], rows=rows, block_tables=block_tables,
                        state_slots=state_slots, fresh=torch.from_numpy(prefix_np == 0), chain_len=chain,
                        max_kv_len=int(prefix_np.max()) + host_tree.max_nodes, kernels=self.bole_config.kernels,
                        state_slots_host={gid: s.tolist() for gid, s in zip(self._bole_recurrent, host_slots)},
                        pending_rows=tables[-1] if prow else None, pending_rows_host=prow, kv_tokens=int(prefix_np.sum()),
                        host=dict(prefix=prefix_np, tables={g: ib.block_table[g].block_table.np[rows] for g in groups})
                        if self._bole_graphs is not None else {})
        return step, pos, logits

    def _bole_check_slots(self, step: TreeStep) -> None:
        """The KV slots vLLM writes the tree tokens to are the core's tree slots."""
        s, T = step.tok_start, step.num_tokens
        for gid, bt in step.block_tables.items():
            table = self.input_batch.block_table[gid]
            want = tree_slot_mapping(step.tree, step.prefix_len, bt, table.block_size)
            got = table.slot_mapping.gpu[s : s + T]
            if not torch.equal(want.long(), got.long().to(want.device)):
                raise RuntimeError("vllm-bole: vLLM's slot mapping for the tree tokens is not the tree slot mapping")

    def _bole_reset_rows(self) -> None:
        """Every pending-path row free (row 0 is never handed out)."""
        self._bole_rows: dict[str, int] = {}  # req -> its row
        self._bole_free_rows = list(range(self._bole_num_rows - 1, 0, -1))

    def _bole_row(self, rid: str) -> int:
        """``rid``'s pending-path row: its own, or a free one from now on."""
        row = self._bole_rows.get(rid)
        if row is None:
            if not self._bole_free_rows:  # a step has at most max_num_seqs trees
                raise RuntimeError(f"vllm-bole: no free pending-path row of {self._bole_num_rows}")
            row = self._bole_rows[rid] = self._bole_free_rows.pop()
        return row

    def _bole_flush_pending(self, exclude: set) -> None:
        """Commit the stashed paths of requests that are not verified as trees this step; their rows go back."""
        todo = {rid: g for rid, g in self._bole_pending_slots.items() if rid not in exclude}
        for rid in exclude:
            self._bole_pending_slots.pop(rid, None)  # folded into this step's tree step
        for gid, layers in self._bole_recurrent.items() if todo else ():
            mine = [rid for rid, g in todo.items() if gid in g]
            if mine:
                slots = upload(torch.tensor([todo[rid][gid] for rid in mine], dtype=torch.long), self.device)
                rows = upload(torch.tensor([self._bole_rows[rid] for rid in mine], dtype=torch.long), self.device)
                for layer in layers:
                    layer.flush(slots, self.bole_config.kernels, rows)
        for rid in todo:
            self._bole_pending_slots.pop(rid, None)
        for rid in [r for r in self._bole_rows if r not in exclude]:
            self._bole_free_rows.append(self._bole_rows.pop(rid))

    def _bole_drop_pending(self, rid: str) -> None:
        """A finished request's stashed path forgotten, its row free."""
        self._bole_pending_slots.pop(rid, None)
        row = self._bole_rows.pop(rid, None)
        if row is not None:
            for layer in self._bole_recurrent_layers():
                layer.drop(row)
            self._bole_free_rows.append(row)

    # ------------------------------------------------------------------ drafting
    def _bole_propose(self, hidden: torch.Tensor | None, pending=None, plain: int = 0) -> None:
        """Launch the next trees' drafting (read by :meth:`_bole_finish_draft`); ``hidden``: the step's sample
        hidden states (rows as its logits). ``pending`` (the paged draft, from :meth:`_sample` before the host
        has read the verification): the step's output tokens ``[B, W]`` and counts ``[B]`` on the device
        (its first ``plain`` rows vLLM's sampled token each), which the draft appends to the histories there
        (on CUDA on a stream of its own, so that vLLM's reading of the sampled tokens does not wait for the
        draft); the histories are then what the step fed up to each root (a tree: its root; a plain row: its
        last scheduled token; a prompt chunk that samples nothing is not drafted), and depths are capped as
        if every request had accepted ``W`` tokens (only near ``max_model_len``)."""
        t0 = time.perf_counter()
        cfg = self.bole_config
        ib = self.input_batch
        n = ib.num_reqs
        rows, self._bole_hidden_rows = self._bole_hidden_rows, None
        if n == 0:
            self._bole_drafts = self._bole_drafted = self._bole_pending_draft = None
            return
        heads = isinstance(self._bole_drafter, HeadDrafter)
        if heads and hidden is not None:  # a step without trees: one logits row per request
            self._bole_drafter.condition(hidden[rows if rows is not None else slice(0, n)])
        req_ids = list(ib.req_ids[:n])
        budget = self._bole_budget
        # the heads without hidden states (async: the last step's were not kept) draft nothing
        speculate = not (heads and hidden is None) and (budget is None or not cfg.plain_fallback
                                                        or budget.speculate(req_ids))
        self._bole_metrics.set("vllm:bole_speculating", float(speculate))
        if not speculate:  # the next step decodes plainly (vLLM's own step): no drafts
            from vllm.v1.outputs import DraftTokenIds

            self._bole_drafts, self._bole_drafted = DraftTokenIds(req_ids, [[] for _ in req_ids]), None
            # async: decided for the next step (the settle drafts only where nothing was decided)
            self._bole_pending_draft = (lambda: (None, None), req_ids, 0.0, budget) if self._bole_async else None
            return
        W = 0 if pending is None else int(pending[0].shape[1])
        if self._bole_async and pending is None:  # at the settle, before this step's inputs: its decoding rows
            discard = ib.num_computed_tokens_cpu[:n] + 1 < ib.num_tokens_no_spec[:n]
        else:  # after the step: the rows whose sampled token it discards (a prompt chunk)
            discard = self.discard_request_mask.np[:n]
        qsl = self.query_start_loc.np
        roots, hists, depths = [], [], []
        for i, rid in enumerate(req_ids):
            state = self.requests.get(rid)
            if state is None or discard[i] or not supports_tree(state.sampling_params):
                roots.append(0)
                hists.append([])
                depths.append(0)
                continue
            num = int(ib.num_tokens_no_spec[i])
            if pending is not None:  # what the step fed up to the root: a tree's root, a plain row's last token
                num = int(ib.num_computed_tokens_cpu[i]) + (int(qsl[i + 1] - qsl[i]) if i < plain else 1)
            hist = ib.token_ids_cpu[i, :num]  # a view: drafters copy what they keep
            roots.append(int(hist[-1]))
            hists.append(hist)
            depths.append(max(min(cfg.depth, self.max_model_len - num - W - 1), 0))
        ctl, cap = budget and budget.controller(self), cfg.fixed_budget or cfg.num_speculative_tokens
        with self._bole_drafter.after(pending) if pending is not None else contextlib.nullcontext():
            finish = draft_trees_async(self._bole_drafter, roots, hists, depths,
                                       ctl.search_budget(cap) if ctl else cap, max_depth=cfg.depth, top_k=cfg.top_k,
                                       controller=ctl, kv_lens=[len(h) for h in hists], keys=req_ids,
                                       calibration=self._bole_calibration.factors() if cfg.calibrate else None,
                                       timings=self._bole_stats, pending=pending)
        self._bole_pending_draft = (finish, req_ids, time.perf_counter() - t0, budget)

    def _bole_finish_draft(self) -> None:
        """The drafts :meth:`_bole_propose` launched, read (the paged draft's step ran on the device
        while vLLM's scheduler processed the step's output) and handed over as vLLM's
        ``DraftTokenIds``; the step's drafting time (launch + read) into the counters, and the controller's
        choice into the controller that made it (under async scheduling a draft launched under ``"auto"`` is read
        at the next step's settle, after a ``bole_set_budget`` between them: H100, a44eb73, every async cell of the
        budget sweep failed on it)."""
        if self._bole_pending_draft is None:
            return
        (finish, req_ids, launch_s, budget), self._bole_pending_draft = self._bole_pending_draft, None
        t0 = time.perf_counter()
        tree, choice = finish()
        if tree is None:  # async: the switch chose plain decoding for the step (:meth:`_bole_propose`)
            self._bole_drafted = None
            return
        if choice is not None:
            budget.chosen(choice)
            self._bole_metrics.observe("vllm:bole_budget_nodes", choice.total)
        if self._bole_async:  # the scheduler takes no drafts (it booked placeholders): the trees alone
            self._bole_drafted = (tree, {rid: r for r, rid in enumerate(req_ids)}, None)
        else:
            from vllm.v1.outputs import DraftTokenIds

            flat = tree.draft_token_ids()
            self._bole_drafted = (tree, {rid: r for r, rid in enumerate(req_ids)}, flat)
            self._bole_drafts = DraftTokenIds(req_ids, flat)
        dt = launch_s + time.perf_counter() - t0
        self._bole_timed("draft_s", dt)
        if self._bole_step_kind == "plain":  # drafted after a step without trees: the draft catching up
            self._bole_stats["plain_drafts"] += 1
            self._bole_stats["plain_draft_s"] += dt
        self._bole_metrics.observe("vllm:bole_draft_seconds", dt)
        if budget is not None:  # after prompt rows or a plain step the drafting caught up on their tokens too
            budget.drafted(dt, catching_up=self._bole_step_kind not in ("trees", "catchup"))
        pool = getattr(self._bole_drafter, "pool", None)
        if pool is not None:
            self._bole_metrics.set("vllm:bole_draft_evictions", pool.evictions)
            self._bole_metrics.set("vllm:bole_draft_pages_used", pool.num_pages - 1 - len(pool.free))
