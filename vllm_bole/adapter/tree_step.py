"""What one forward with trees looks like to the layer overrides (:class:`TreeStep`), and the shared
slot through which the runner hands it to them (:class:`ActiveStep`).

The persistent batch is ordered plain requests first (prefills, decodes without drafts: vLLM's own
order), tree requests last. vLLM's attention metadata is built for the plain requests only, so every
original layer path processes exactly the leading ``tok_start`` tokens and never sees a tree. The
tree requests' tokens (``tok_start .. tok_start + T``) are the flat nodes of ``tree`` (node ``j``
of a request = its ``j``-th scheduled token, KV slot ``prefix_len + j``, RoPE position
``prefix_len + depth``); the overrides compute them from the request's committed state (one state
slot per request).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_bole.spec_decode.tree import TreeBatch

# engine steps the runner times apart: trees alone, trees beside prompt or plain rows, no trees, and trees alone
# right after a step without trees (the draft catching up on the tokens it has not seen: a prompt, plain decoding)
STEP_KINDS = ("trees", "mixed", "plain", "catchup")
# the parts of a step the runner times (seconds), each also per step kind: ``by_kind_{kind}_{phase}``, beside
# ``by_kind_{kind}_steps`` (every step of that kind, idle or not: the per-step mean's denominator). Two sets:
# * the parts of our own and vLLM's work that matter to the tree step: input preparation (``prepare_vllm_s``:
#   vLLM's share of it), drafting (launch and read), the target forward (device time, CUDA events), verification
#   and commit, finishing, the async settle;
# * HOST_PHASES: the host's timeline of an engine step cut at the runner's entry points, which tile the step's
#   wall time (from one input preparation to the next): ``prepare_s``; ``forward_host_s`` (input preparation's
#   end to ``execute_model``'s: the forward's launches or graph replay, vLLM's work around it, any wait for the
#   device there); ``between_s`` (``execute_model``'s end to ``sample_tokens``: the engine between them);
#   ``sample_s`` (``sample_tokens``: vLLM's sampler and bookkeeping, our verification, commit, finishing and the
#   next drafts' launch, any wait for the device there); ``engine_s`` (``sample_tokens``' end to the next
#   ``execute_model`` with inputs, any without inputs between them included: the engine core's output processing
#   and scheduling, and in a synchronous engine the drafts' read); ``update_s`` (``execute_model``'s entry to its input preparation: vLLM's request
#   bookkeeping, the async settle). Decided so because the first set does not tile the step (the forward is
#   device time, the engine's own work is in none of them): at ff6ad01 (H100, c = 128) a step with prompts beside
#   trees took 41 ms of which the first set accounted for ~19.
PHASES = ("prepare_s", "prepare_vllm_s", "draft_s", "forward_s", "verify_commit_s", "finish_s", "settle_s",
          "forward_host_s", "between_s", "sample_s", "engine_s", "update_s")
HOST_PHASES = ("prepare_s", "forward_host_s", "between_s", "sample_s", "engine_s", "update_s")


def by_kind_keys() -> tuple[str, ...]:
    """The runner's per-kind counters (:data:`STEP_KINDS` x (steps, :data:`PHASES`))."""
    return tuple(f"by_kind_{k}_{p}" for k in STEP_KINDS for p in ("steps",) + PHASES)


@dataclass
class TreeStep:
    """One forward's trees. Tensors live on the model's device."""

    num_plain: int  # plain requests (persistent-batch rows 0 .. num_plain-1)
    tok_start: int  # first tree token (= tokens of the plain requests)
    tree: TreeBatch  # the tree requests, rows num_plain .. num_reqs-1
    host_tree: TreeBatch  # the same trees on the host (bookkeeping without device syncs)
    prefix_len: torch.Tensor  # [Bt] int64 committed tokens before each root
    req_ids: list[str]  # [Bt]
    rows: list[int]  # [Bt] persistent-batch rows
    block_tables: dict[int, torch.Tensor]  # KV-cache group -> [Bt, max_blocks] int32 (attention groups)
    state_slots: dict[int, torch.Tensor]  # KV-cache group -> [Bt] int64 (recurrent groups)
    fresh: torch.Tensor  # [Bt] bool, on the host (no device sync to test it): no committed state yet
    chain_len: list[int]  # [Bt] depth of each tree's first-child chain (the drafter's greedy chain)
    max_kv_len: int  # host: the longest prefix + tree (tree attention sizes its grid from it, no device sync)
    kernels: str = "auto"  # core kernels: auto (Triton on CUDA, torch on CPU), torch, triton
    state_slots_host: dict[int, list[int]] = field(default_factory=dict)  # state_slots on the host (bookkeeping)
    # [Bt] int64: each request's row of the recurrent layers' pending-path buffers (None: its state slot)
    pending_rows: torch.Tensor | None = None
    pending_rows_host: list[int] = field(default_factory=list)  # pending_rows on the host
    host: dict = field(default_factory=dict)  # with tree graphs: "prefix" [Bt], "tables" {group: [Bt, width]} (host)
    kv_tokens: int = 0  # host: prefix_len's sum (the budget controller's context tokens, no device sync)

    @property
    def num_tokens(self) -> int:
        return self.tree.num_nodes


class ActiveStep:
    """The step the layer overrides see: set by the runner around the forward, None otherwise (then
    every override runs vLLM's own path unchanged)."""

    step: TreeStep | None = None
