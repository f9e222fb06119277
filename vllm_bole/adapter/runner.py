"""Tree speculation inside vLLM's V1 model runner (``GPUModelRunner``; ``CPUModelRunner``
subclasses it, so the CPU engine runs this same code).

One step, as vLLM drives it (``execute_model`` then ``sample_tokens``):

1. The scheduler gave each request with drafts ``1 + k`` tokens: the root (last sampled token)
   and the ``k`` flat draft nodes this runner proposed last step, and allocated ``k + 1`` KV slots
   (vLLM's own speculative bookkeeping; ``num_speculative_tokens`` = the node budget).
2. ``_may_reorder_batch``: tree requests move to the end of the persistent batch (stable), after
   the plain ones (prefills, decodes without drafts) in vLLM's order.
3. ``_prepare_inputs``: vLLM's input prep, then the tree requests' positions become
   ``prefix_len + depth`` (their KV slots stay ``prefix_len + j``: ``tree_slot_mapping``), logits
   are taken at every tree node, and a :class:`~vllm_bole.adapter.layers.TreeStep` describes the
   trees to the layer overrides. Pending accepted paths of requests that are not verified as trees
   this step are committed first, so vLLM's own kernels always read committed states.
4. ``_build_attention_metadata``: vLLM's metadata for the plain requests only.
5. ``_model_forward``: ONE forward; the layer overrides run the plain tokens through vLLM and the
   tree tokens through the core.
6. ``_sample``: vLLM's sampler for the plain requests; ``verify_greedy`` (or
   ``verify_deterministic`` for sampled requests) for the trees; then the commit: accepted K/V
   compacted into ``prefix_len .. prefix_len + m`` for every full-attention layer, conv states
   committed in place, the accepted path's recurrent inputs stashed per state slot (folded into
   the next tree step of the request). Output: accepted tokens + bonus, ``-1`` padded, exactly
   what vLLM's rejection sampler returns, so vLLM's bookkeeping and the scheduler's rollback of
   ``num_computed_tokens`` stay right.
7. ``sample_tokens`` then drafts the next trees (best-first from per-depth candidates) and
   ``take_draft_token_ids`` hands their flat tokens to the scheduler.

The model side (layers, KV cache specs, metadata builders) is built without vLLM's speculative
config (see :mod:`vllm_bole.adapter.worker`): one recurrent state slot per request, plain conv
state widths, no per-draft-token state copies.
"""
from __future__ import annotations

import collections
import logging
import time

import numpy as np
import torch

from vllm_bole.adapter import layers as L
from vllm_bole.attention.tree_attention import compact_accepted_kv, tree_slot_mapping
from vllm_bole.config import TreeSpecConfig
from vllm_bole.mamba.tree_conv import commit_conv_state
from vllm_bole.mamba import gdn_tree, ssd_tree
from vllm_bole.spec_decode.drafters import HFDraftModel, build_draft_trees
from vllm_bole.spec_decode.ngram import NgramDrafter
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.spec_decode.verification import SAMPLING_EPS, verify_deterministic, verify_greedy

logger = logging.getLogger("vllm_bole")
NGRAM_WINDOW = 4096  # context tokens the n-gram drafter searches (the most recent)


def _supports_tree(sp) -> bool:
    """Sampling parameters tree verification reproduces exactly (else: no drafts, vLLM's path).
    Penalties, logit bias, bad words, allowed tokens, min_tokens and min_p are applied per node
    (:meth:`TreeRunnerMixin._bole_constrain`); structured output is not."""
    if sp is None:
        return False
    return (
        getattr(sp, "structured_outputs", None) is None
        and not getattr(sp, "logprob_token_ids", None)
        and (sp.logprobs is None or sp.logprobs >= 0)
    )


class TreeRunnerMixin:
    """Mixed into vLLM's V1 model runner (see the module docstring)."""

    bole_config: TreeSpecConfig

    # ------------------------------------------------------------------ setup
    def _bole_setup(self, config: TreeSpecConfig) -> None:
        self.bole_config = config
        if getattr(self, "use_async_scheduling", False):
            raise RuntimeError("vllm-bole tree speculation needs async scheduling off (the config hook sets it)")
        if getattr(self, "uses_mrope", False):
            raise NotImplementedError("vllm-bole tree speculation does not support M-RoPE models")
        logprobs_mode = getattr(self.model_config, "logprobs_mode", "raw_logprobs")
        if logprobs_mode not in ("raw_logprobs", "raw_logits"):
            raise NotImplementedError(
                f"vllm-bole tree speculation supports logprobs_mode raw_logprobs / raw_logits, not {logprobs_mode}"
            )
        if getattr(self.model_config, "logits_processors", None):
            raise NotImplementedError("vllm-bole tree speculation does not support custom logits processors")
        self._bole_logprobs_mode = logprobs_mode
        self._bole_trees: dict[str, tuple[list[int], list[int]]] = {}
        self._bole_drafts = None
        self._bole_step: L.TreeStep | None = None
        self._bole_installed = False
        self._bole_pending: dict[str, object] = {}
        self._bole_pending_slots: dict[str, dict[int, int]] = {}  # req -> {group: slot} with a stashed path
        self._bole_stats = dict(steps=0, tree_steps=0, mixed_tree_steps=0, prefill_mixed_tree_steps=0,
                                placeholder_trees=0, resumed_requests=0, drafted_nodes=0, accepted=0, verified_requests=0, draft_s=0.0,
                                verify_commit_s=0.0)
        # (request, drafted first-child chain length, accepted draft nodes) of the latest trees
        self._bole_accept_log: collections.deque = collections.deque(maxlen=100_000)
        if config.drafter == "ngram":
            self._bole_drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max,
                                              top_k=min(config.top_k or config.num_speculative_tokens, 64),
                                              window=NGRAM_WINDOW)
        else:
            self._bole_drafter = None  # loaded in load_model (needs the worker's process)

    def _bole_load_drafter(self) -> None:
        cfg = self.bole_config
        if cfg.drafter == "draft_model" and self._bole_drafter is None:
            top_k = cfg.top_k or cfg.num_speculative_tokens
            self._bole_drafter = HFDraftModel(cfg.model, cfg.draft_dtype, top_k=min(top_k, 64), device=self.device)

    def _bole_install_layers(self, refresh: bool = False) -> None:
        """Wrap every attention / recurrent layer of the loaded model (once KV caches are bound) and
        map layers to their KV-cache groups. Wrapping is idempotent per layer."""
        if self._bole_installed and not refresh:
            return
        self._bole_pending = {}
        ctx = self.compilation_config.static_forward_context
        self._bole_layer_group: dict[str, int] = {}
        self._bole_attn_groups: dict[int, list[str]] = {}
        self._bole_state_groups: dict[int, list[str]] = {}
        self._bole_layer_kind: dict[str, str] = {}
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                layer = ctx.get(name)
                if layer is None:
                    continue
                kind = L.layer_kind(layer)
                self._bole_layer_group[name] = gid
                self._bole_layer_kind[name] = kind
                if kind == "attention":
                    L.install_attention(name, layer)
                    self._bole_attn_groups.setdefault(gid, []).append(name)
                    kc, _, _ = L.attention_kv_views(layer)
                    bt = self.input_batch.block_table[gid]
                    if kc.shape[1] != bt.block_size:
                        raise NotImplementedError(
                            f"vllm-bole: layer {name} has kernel block size {kc.shape[1]} but its block table uses "
                            f"{bt.block_size}; hybrid kernel-block mapping is not supported"
                        )
                elif kind == "mamba2":
                    L.install_mamba2(name, layer)
                    self._bole_state_groups.setdefault(gid, []).append(name)
                elif kind == "gdn":
                    L.install_gdn(name, layer)
                    self._bole_state_groups.setdefault(gid, []).append(name)
                else:
                    raise NotImplementedError(
                        f"vllm-bole tree speculation: layer {name} ({type(layer).__name__}) has no tree override; "
                        "supported: full attention, Mamba2 mixers, Gated DeltaNet"
                    )
        self._bole_installed = True
        self._bole_log_start()

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
        logger.info("vllm-bole: method bole_tree active: drafter %s%s, node budget %d, max depth %d, kernels %s, "
                    "model runner %s (V1), CUDA graphs %s; tree overrides on %d attention and %d recurrent layers",
                    cfg.drafter, f" ({cfg.model})" if cfg.model else "", cfg.num_speculative_tokens, cfg.depth,
                    kernels, type(self).__mro__[2].__name__, graphs, sum(map(len, self._bole_attn_groups.values())),
                    sum(map(len, self._bole_state_groups.values())))

    def _bole_pending_for(self, name: str):
        p = self._bole_pending.get(name)
        if p is None:
            layer = self.compilation_config.static_forward_context[name]
            num_slots = layer.kv_cache[1].shape[0]
            max_len = self.bole_config.depth + 1
            make = L.gdn_pending if self._bole_layer_kind[name] == "gdn" else L.mamba2_pending
            p = self._bole_pending[name] = make(layer, num_slots, max_len)
        return p

    # ------------------------------------------------------------------ vLLM hooks
    def initialize_kv_cache(self, *args, **kwargs):
        out = super().initialize_kv_cache(*args, **kwargs)
        if kwargs.get("is_profiling"):  # vLLM's CUDA-graph memory profiling, on throw-away caches
            return out
        # at start-up: an unsupported layer fails here, before any request; maps follow the new KV config
        self._bole_install_layers(refresh=True)
        return out

    def _update_states(self, scheduler_output):
        # preempted requests come back as resumed ones (recomputed from scratch; their pending path, if
        # any, was flushed into the freed slot at the step after the preemption, before any reuse of it
        # could read it: a reused slot starts without initial state)
        resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ()
        self._bole_stats["resumed_requests"] += len(resumed)
        out = super()._update_states(scheduler_output)
        for rid in scheduler_output.finished_req_ids:
            self._bole_trees.pop(rid, None)
            self._bole_drop_pending(rid)
        return out

    def _may_reorder_batch(self, scheduler_output) -> None:
        super()._may_reorder_batch(scheduler_output)
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            return
        ib = self.input_batch
        n = ib.num_reqs
        is_tree = [bool(spec.get(ib.req_ids[i])) for i in range(n)]
        order = [i for i in range(n) if not is_tree[i]] + [i for i in range(n) if is_tree[i]]
        if order == list(range(n)):
            return
        at = list(range(n))  # at[pos] = original index now at pos
        pos = list(range(n))  # pos[orig] = current position
        for k, orig in enumerate(order):
            j = pos[orig]
            if j != k:
                ib.swap_states(k, j)
                a, b = at[k], at[j]
                at[k], at[j] = b, a
                pos[a], pos[b] = j, k

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_md, max_sampled = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        assert spec_md is None, "vllm-bole: the model-side config must not carry vLLM's speculative config"
        self._bole_install_layers()
        self._bole_stats["steps"] += 1
        step = self._bole_build_step(scheduler_output, num_scheduled_tokens)
        self._bole_flush_pending(exclude=set(step.req_ids) if step is not None else set())
        self._bole_step = step
        if step is None:
            return logits_indices, spec_md, max_sampled
        s, T = step.tok_start, step.num_tokens
        dev = self.positions.device
        pos = step.prefix_len[step.tree.request_index] + step.tree.depth.long()
        self.positions[s : s + T] = pos.to(dev, self.positions.dtype)
        # placeholders (-1, scheduler padding) must not reach the embedding
        ids = self.input_ids.gpu[s : s + T]
        ids.clamp_(min=0)
        qsl = self.query_start_loc.cpu[: step.num_plain + 1].long()
        plain_last = qsl[1:] - 1
        if step.num_plain and int((qsl[1:] - qsl[:-1]).max()) > 1:
            self._bole_stats["prefill_mixed_tree_steps"] += 1
        logits_indices = torch.cat([plain_last, torch.arange(s, s + T)]).to(logits_indices.device)
        self._bole_check_slots(step)
        return logits_indices, None, max_sampled

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
        L.set_step(self._bole_step)
        try:
            return super()._model_forward(*args, **kwargs)
        finally:
            L.set_step(None)

    def _sample(self, logits, spec_decode_metadata):
        step = self._bole_step
        if step is None:
            return super()._sample(logits, spec_decode_metadata)
        self._bole_step = None
        from vllm.v1.outputs import SamplerOutput

        P, tree = step.num_plain, step.tree
        sampling_metadata = self.input_batch.sampling_metadata
        if sampling_metadata.max_num_logprobs == -1 or sampling_metadata.logprob_token_ids:
            raise NotImplementedError(
                "vllm-bole: full-vocabulary logprobs (-1) and logprob_token_ids are not supported in a batch that "
                "verifies draft trees"
            )
        tlogits = logits[P:]
        roots = tree.cu_nodes[:-1].long()
        plain = self.sampler(logits=torch.cat([logits[:P], tlogits[roots]]), sampling_metadata=sampling_metadata)
        t0 = time.perf_counter()
        res = self._bole_verify(step, tlogits)
        self._bole_commit(step, res)
        self._bole_stats["verify_commit_s"] += time.perf_counter() - t0
        Lw = res.output_token_ids.shape[1]
        num_reqs = P + tree.num_requests
        grid = torch.full((num_reqs, Lw), -1, dtype=torch.int64)
        grid[:P, 0] = plain.sampled_token_ids[:P, 0].long().cpu()
        grid[P:] = res.output_token_ids.cpu()
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._bole_logprobs(logits, P, step, res, grid, sampling_metadata.max_num_logprobs)
        acc = res.num_accepted.tolist()
        self._bole_stats["tree_steps"] += 1
        self._bole_stats["mixed_tree_steps"] += int(P > 0)
        self._bole_stats["verified_requests"] += tree.num_requests
        self._bole_stats["drafted_nodes"] += tree.num_nodes - tree.num_requests
        self._bole_stats["accepted"] += sum(acc)
        for r, rid in enumerate(step.req_ids):
            self._bole_accept_log.append((rid, step.chain_len[r], acc[r]))
        return SamplerOutput(sampled_token_ids=grid.to(torch.int32).to(logits.device), logprobs_tensors=logprobs)

    def sample_tokens(self, grammar_output):
        state = getattr(self, "execute_model_state", None)
        out = super().sample_tokens(grammar_output)
        if state is not None:
            t0 = time.perf_counter()
            self._bole_propose()
            self._bole_stats["draft_s"] += time.perf_counter() - t0
        return out

    def take_draft_token_ids(self):
        drafts, self._bole_drafts = self._bole_drafts, None
        return drafts

    def bole_stats(self) -> dict:
        """Counters (steps, tree steps, drafted nodes, accepted nodes) and the per-step log of
        (request, drafted greedy-chain length, accepted draft nodes)."""
        return dict(self._bole_stats, accept_log=list(self._bole_accept_log))

    # ------------------------------------------------------------------ tree step
    def _bole_build_step(self, scheduler_output, num_scheduled_tokens) -> L.TreeStep | None:
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            return None
        ib = self.input_batch
        n = ib.num_reqs
        rows = [i for i in range(n) if spec.get(ib.req_ids[i])]
        if not rows:
            return None
        P = rows[0]
        assert rows == list(range(P, n)), f"vllm-bole: tree requests must be last, got rows {rows} of {n}"
        parents, tokens, verify_tokens, chain = [], [], [], []
        for i in rows:
            rid = ib.req_ids[i]
            drafts = list(spec[rid])
            k = len(drafts)
            if int(num_scheduled_tokens[i]) != k + 1:
                raise RuntimeError(f"vllm-bole: request {rid} has {k} drafts but {int(num_scheduled_tokens[i])} tokens")
            start = int(ib.num_computed_tokens_cpu[i])
            root = int(ib.token_ids_cpu[i, start])
            stored = self._bole_trees.get(rid)
            if stored is not None and len(stored[0]) >= k and stored[1][:k] == drafts:
                par = [-1] + [int(p) for p in stored[0][:k]]
                vt = [root] + drafts
            else:  # scheduler padding (-1) or drafts we did not make: never accepted
                self._bole_stats["placeholder_trees"] += 1
                par = [-1] + [0] * k
                vt = [root] + [-1] * k
            parents.append(par)
            tokens.append([root] + [max(int(t), 0) for t in drafts])
            verify_tokens.append(vt)
            chain.append(_chain_len(par, vt))
        dev = self.device
        tree = TreeBatch.from_parents(parents, verify_tokens).to(dev)
        prefix = torch.from_numpy(ib.num_computed_tokens_cpu[rows].astype(np.int64)).to(dev)
        block_tables, state_slots = {}, {}
        for gid in self._bole_attn_groups:
            block_tables[gid] = ib.block_table[gid].block_table.cpu[rows].to(dev)
        for gid in self._bole_state_groups:
            state_slots[gid] = ib.block_table[gid].block_table.cpu[rows, 0].long().to(dev)
        pending = {name: self._bole_pending_for(name) for names in self._bole_state_groups.values() for name in names}
        step = L.TreeStep(
            num_plain=P,
            tok_start=int(self.query_start_loc.cpu[P]),
            tree=tree,
            prefix_len=prefix,
            req_ids=[ib.req_ids[i] for i in rows],
            layer_group=self._bole_layer_group,
            block_tables=block_tables,
            state_slots=state_slots,
            pending=pending,
            fresh=prefix == 0,
            rows=rows,
            chain_len=chain,
            impl=self.bole_config.kernels,
        )
        return step

    def _bole_check_slots(self, step: L.TreeStep) -> None:
        """The KV slots vLLM writes the tree tokens to are the core's tree slots."""
        s, T = step.tok_start, step.num_tokens
        for gid, bt in step.block_tables.items():
            table = self.input_batch.block_table[gid]
            want = tree_slot_mapping(step.tree, step.prefix_len, bt, table.block_size)
            got = table.slot_mapping.gpu[s : s + T]
            if not torch.equal(want.long(), got.long().to(want.device)):
                raise RuntimeError("vllm-bole: vLLM's slot mapping for the tree tokens is not the tree slot mapping")

    def _bole_verify(self, step: L.TreeStep, tlogits: torch.Tensor):
        tree = step.tree
        params = [self.requests[rid].sampling_params for rid in step.req_ids]
        temps, top_k, top_p, min_p, gens, greedy = [], [], [], [], [], True
        for r, sp in enumerate(params):
            t = float(sp.temperature) if sp is not None else 0.0
            temps.append(t)
            greedy &= t < SAMPLING_EPS
            top_k.append(max(int(sp.top_k or 0), 0) if sp is not None else 0)
            top_p.append(float(sp.top_p) if sp is not None and sp.top_p is not None else 1.0)
            min_p.append(float(getattr(sp, "min_p", 0.0) or 0.0) if sp is not None else 0.0)
            gens.append(self.input_batch.generators.get(step.rows[r]))
        logits = self._bole_constrain(step, tlogits.float(), params)
        if greedy:
            return verify_greedy(tree, logits)
        return verify_deterministic(tree, logits, temperature=torch.tensor(temps), top_k=torch.tensor(top_k),
                                    top_p=torch.tensor(top_p), min_p=torch.tensor(min_p) if any(min_p) else None,
                                    generator=gens)

    def _bole_constrain(self, step: L.TreeStep, logits: torch.Tensor, params: list) -> torch.Tensor:
        """vLLM's sampler constraints before temperature, per tree node, in vLLM's order: allowed
        tokens, bad words, min_tokens, logit bias, then repetition / frequency / presence penalties.
        Node ``i`` of request ``r`` sees the request's output tokens (its root last) followed by the
        draft tokens on its path (depth ``1 .. depth(i)``), exactly what non-speculative decoding
        would have seen there. ``logits`` ``[T, V]`` float32, modified in place and returned;
        ``params``: the tree requests' ``SamplingParams`` (tree requests always have them)."""
        md = self.input_batch.sampling_metadata
        tree = step.tree
        ib = self.input_batch
        req = tree.request_index.long().cpu()
        rows = torch.tensor(step.rows, dtype=torch.long)[req]  # persistent-batch row of every node
        min_tokens = any(p.min_tokens for p in params)
        need_ctx = bool(md.bad_words_token_ids) or not md.no_penalties or min_tokens
        ctx: list[list[int]] = []
        if need_ctx:
            outs = [ib.token_ids_cpu[i, int(ib.num_prompt_tokens[i]) : int(ib.num_tokens_no_spec[i])].tolist()
                    for i in step.rows]
            toks, path, depth = tree.token_ids.tolist(), tree.path.cpu(), tree.depth.tolist()
            cu = tree.cu_nodes.tolist()
            for i, r in enumerate(req.tolist()):
                ctx.append(outs[r] + [toks[cu[r] + int(j)] for j in path[i, 1 : depth[i] + 1]])
        if md.allowed_token_ids_mask is not None:
            logits.masked_fill_(md.allowed_token_ids_mask[rows.to(md.allowed_token_ids_mask.device)], -float("inf"))
        if md.bad_words_token_ids:
            from vllm.v1.sample.ops.bad_words import apply_bad_words

            words = {i: md.bad_words_token_ids[row] for i, row in enumerate(rows.tolist())
                     if row in md.bad_words_token_ids}
            apply_bad_words(logits, words, ctx)
        for i, r in enumerate(req.tolist() if min_tokens else ()):
            sp = params[r]
            if sp.min_tokens and len(ctx[i]) < sp.min_tokens and sp.all_stop_token_ids:
                logits[i, list(sp.all_stop_token_ids)] = -float("inf")
        for r, sp in enumerate(params):
            if sp.logit_bias:
                ids = torch.tensor([int(t) for t in sp.logit_bias], device=logits.device)
                bias = torch.tensor(list(sp.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                s, e = int(tree.cu_nodes[r]), int(tree.cu_nodes[r + 1])
                logits[s:e, ids] += bias
        if not md.no_penalties:
            from vllm.v1.sample.ops.penalties import apply_all_penalties

            dev_rows = rows.to(md.presence_penalties.device)
            logits = apply_all_penalties(logits, md.prompt_token_ids[dev_rows], md.presence_penalties[dev_rows],
                                         md.frequency_penalties[dev_rows], md.repetition_penalties[dev_rows], ctx)
        return logits

    def _bole_commit(self, step: L.TreeStep, res) -> None:
        tree = step.tree
        accepted = res.accepted_nodes.to(torch.int32)
        last_local = res.last_node.long() - tree.cu_nodes[:-1].long()
        ctx = self.compilation_config.static_forward_context
        for gid, names in self._bole_attn_groups.items():
            views = [L.attention_kv_views(ctx[n]) for n in names]
            backend = step.impl if all(ok for _, _, ok in views) else "torch"
            compact_accepted_kv([k for k, _, _ in views], [v for _, v, _ in views], step.block_tables[gid],
                                step.prefix_len, accepted, backend=backend)
        W = min(accepted.shape[1], self.bole_config.depth + 1)
        acc = accepted[:, :W]
        for gid, names in self._bole_state_groups.items():
            slots = step.state_slots[gid]
            for name in names:
                sv = step.saved[name]
                commit_conv_state(sv["conv_state"], slots, tree, last_local, sv["conv_in"], impl=step.impl)
                pending = step.pending[name]
                if sv["kind"] == "gdn":
                    gdn_tree.stash_accepted_path(pending, slots, tree, acc, sv["k"], sv["v"], sv["g"], sv["beta"],
                                                 impl=step.impl)
                else:
                    ssd_tree.stash_accepted_path(pending, slots, tree, acc, sv["x"], sv["dt"], sv["B"], impl=step.impl)
            for r, rid in enumerate(step.req_ids):
                self._bole_pending_slots.setdefault(rid, {})[gid] = int(slots[r])
        step.saved.clear()

    def _bole_flush_pending(self, exclude: set) -> None:
        """Commit the stashed paths of requests that are not verified as trees this step."""
        todo = {rid: g for rid, g in self._bole_pending_slots.items() if rid not in exclude}
        for rid in exclude:
            self._bole_pending_slots.pop(rid, None)  # folded into this step's tree step
        if not todo:
            return
        ctx = self.compilation_config.static_forward_context
        for gid, names in self._bole_state_groups.items():
            slots = torch.tensor([g[gid] for g in todo.values() if gid in g], dtype=torch.long, device=self.device)
            if slots.numel() == 0:
                continue
            for name in names:
                layer, pending = ctx[name], self._bole_pending[name]
                commit = L.gdn_commit_pending if self._bole_layer_kind[name] == "gdn" else L.mamba2_commit_pending
                commit(layer, slots, pending, self.bole_config.kernels)
        for rid in todo:
            self._bole_pending_slots.pop(rid, None)

    def _bole_drop_pending(self, rid: str) -> None:
        groups = self._bole_pending_slots.pop(rid, None)
        if not groups:
            return
        for gid, slot in groups.items():
            for name in self._bole_state_groups.get(gid, []):
                self._bole_pending[name].length[slot] = 0

    def _bole_logprobs(self, logits, P, step, res, grid, k):
        """Logprobs of every emitted token in vLLM's flattened ``[num_reqs * width]`` layout."""
        tree = step.tree
        num_reqs, Lw = grid.shape
        rows = torch.zeros(num_reqs, Lw, dtype=torch.long)
        rows[:P, :] = torch.arange(P)[:, None]
        acc = res.accepted_nodes.long().cpu()
        flat = torch.where(acc >= 0, acc + tree.cu_nodes[:-1, None].long().cpu(), torch.zeros_like(acc)) + P
        rows[P:] = flat
        sel = logits[rows.flatten().to(logits.device)]
        if self._bole_logprobs_mode == "raw_logprobs":
            lp = self.sampler.compute_logprobs(sel)
        else:
            lp = sel.float()
        toks = grid.clamp(min=0).flatten().to(logits.device)
        return self.sampler.gather_logprobs(lp, k, toks)

    # ------------------------------------------------------------------ drafting
    def _bole_propose(self) -> None:
        cfg = self.bole_config
        ib = self.input_batch
        n = ib.num_reqs
        req_ids = list(ib.req_ids[:n])
        if n == 0:
            self._bole_drafts = None
            return
        discard = self.discard_request_mask.np[:n]
        roots, hists, depths = [], [], []
        D = cfg.depth
        for i, rid in enumerate(req_ids):
            state = self.requests.get(rid)
            if state is None or discard[i] or not _supports_tree(state.sampling_params):
                roots.append(0)
                hists.append([])
                depths.append(0)
                continue
            num = int(ib.num_tokens_no_spec[i])
            hist = ib.token_ids_cpu[i, :num]
            roots.append(int(hist[-1]))
            hists.append(hist.tolist())
            depths.append(max(min(D, self.max_model_len - num - 1), 0))
        cands = self._bole_drafter.candidates_batch(hists, depths)
        trees = build_draft_trees(roots, cands, cfg.num_speculative_tokens, max_depth=D, top_k=cfg.top_k)
        drafts = []
        for rid, (par, tok) in zip(req_ids, trees):
            drafts.append(list(tok))
            if tok:
                self._bole_trees[rid] = (par, tok)
            else:
                self._bole_trees.pop(rid, None)
        from vllm.v1.outputs import DraftTokenIds

        self._bole_drafts = DraftTokenIds(req_ids, drafts)


def _chain_len(par: list[int], tok: list[int]) -> int:
    """Depth of the first-child chain from the root (the drafter's greedy chain in a best-first tree:
    the first child of every node is its most probable one)."""
    depth, node = 0, 0
    while True:
        kids = [j for j in range(node + 1, len(par)) if par[j] == node and tok[j] >= 0]
        if not kids:
            return depth
        node = kids[0]
        depth += 1
