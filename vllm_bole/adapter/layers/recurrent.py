"""What the recurrent layer kinds (Mamba2, Gated DeltaNet) share: the conv and recurrent state slots
of vLLM's cache (one slot per request), the tree conv over ancestor windows, and the per-slot
pending accepted paths.

After verification, :meth:`RecurrentLayer.commit` rolls the conv state along the accepted path in
place and stashes the accepted path's own recurrent inputs (at most ``depth + 1`` tokens) into
``pending``, at the request's row (``TreeStep.pending_rows``: the runner's rows, one per request in
flight, so the buffer does not grow with the KV cache; without them the state slot); the request's
next tree step folds them into its state (one state read + one write per step). The tree steps leave the pending lengths alone (``reset_pending=False``): the stash
that follows every tree step sets the length of each of its slots (the root is always accepted).
Before any other forward could read a state that still has a pending path (the request is not
verified as a tree this step, finishes, or is preempted), the runner calls :meth:`flush`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_bole.adapter.tree_step import ActiveStep, TreeStep
from vllm_bole.mamba.tree_conv import commit_conv_state, tree_conv
from vllm_bole.transfer import upload


def conv_state_view(cache: torch.Tensor) -> torch.Tensor:
    """The conv state cache as ``[S, C, W-1]`` (oldest first), whatever vLLM's layout."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return cache if is_conv_state_dim_first() else cache.transpose(-1, -2)


def owned(x: torch.Tensor) -> torch.Tensor:
    """A dense copy of ``x`` (a slice of a tensor vLLM handed the layer) that the layer owns until its commit.

    Under vLLM's piecewise CUDA graphs the inputs of a splitting op (GDN's core, Mamba2's conv + SSM) are
    outputs of the graph piece before it, which vLLM keeps only as weak references in a memory pool that
    the next pieces overwrite: a view of them held until the commit (after the whole forward) reads
    whatever ran later. ``.contiguous()`` is a view whenever the slice is already dense (Qwen3-Next's
    ``mixed_qkv`` is a fresh ``torch.cat``; any single-token step), so the copy is explicit."""
    return x.clone(memory_format=torch.contiguous_format)


@dataclass
class Saved:
    """A recurrent layer's tree inputs of one step, for its commit."""

    step: TreeStep
    slots: torch.Tensor  # [Bt] int64 state slots
    rows: torch.Tensor  # [Bt] int64 pending-path rows
    conv_in: torch.Tensor  # [T, C] pre-conv inputs, owned (:func:`owned`)
    inputs: dict  # the kind's recurrent inputs by name, [T, ...] each


class RecurrentLayer:
    """Base of :class:`~.mamba2.Mamba2Layer` and :class:`~.gdn.GDNLayer`; subclasses give the state
    view, the pending buffer and the stash / commit of their kind."""

    vllm_class: str  # the vLLM module class (anywhere in the module's MRO) this kind replaces

    @classmethod
    def matches(cls, module) -> bool:
        return cls.vllm_class in {c.__name__ for c in type(module).__mro__}

    def __init__(self, name: str, module, group: int, active: ActiveStep, max_path: int, num_rows: int | None = None):
        self.name, self.module, self.group, self.active = name, module, group, active
        self.max_path = max_path  # depth + 1: the longest accepted path (root included)
        self.num_rows = num_rows  # rows of the pending-path buffer (None: one per state slot)
        self.pending = None  # allocated on first use (the caches exist by then)
        self._saved: Saved | None = None
        self._dims()
        self._install()

    @classmethod
    def buffer_bytes(cls, module, max_path: int) -> tuple[int, int]:
        """(bytes of one row of the pending-path buffer, bytes a tree step holds per tree token until
        its commit) of ``module``, from its dimensions alone (nothing installed, no cache needed, nothing
        allocated). The second is an upper bound: the token's pending fields plus its conv input, which
        is at most as large as those fields (Mamba2: x, B, C against x, dt, B; GDN: q, k, v against k, v,
        g, beta; Mamba1: x against x, dt, B)."""
        probe = cls.__new__(cls)
        probe.module, probe.max_path = module, max_path
        probe._dims()
        p = probe._new_pending(1, "meta")
        fields = sum(t.numel() * t.element_size() for t in p.fields.values())
        return fields + p.length.numel() * p.length.element_size(), 2 * fields // max_path

    # --- subclass hooks
    def _dims(self) -> None:
        """The layer's dimensions (this TP rank's) from the module, checked against the kernels' envelope."""
        raise NotImplementedError

    def _install(self) -> None:
        raise NotImplementedError

    def state_view(self) -> torch.Tensor:
        raise NotImplementedError

    def _new_pending(self, num_rows: int, device):
        raise NotImplementedError

    def _stash(self, saved: Saved, tree, accepted: torch.Tensor) -> None:
        raise NotImplementedError

    def _commit_pending(self, slots: torch.Tensor, rows: torch.Tensor, kernels: str) -> None:
        raise NotImplementedError

    # --- shared
    def pending_dtype(self) -> torch.dtype:
        """The pending paths' dtype: the model's (its conv weights'), fp32 for other dtypes."""
        dt = self.module.conv1d.weight.dtype
        return dt if dt in (torch.float32, torch.bfloat16, torch.float16) else torch.float32

    def pending_path(self):
        if self.pending is None:
            rows = self.num_rows if self.num_rows is not None else self.module.kv_cache[1].shape[0]
            self.pending = self._new_pending(rows, self.module.kv_cache[1].device)
        return self.pending

    @staticmethod
    def rows_of(step: TreeStep, slots: torch.Tensor) -> torch.Tensor:
        """The step's pending-path rows: the runner's, else the state slots."""
        return step.pending_rows if step.pending_rows is not None else slots

    def conv(self, step: TreeStep, conv_in: torch.Tensor, weight, bias, activation) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree conv of the step's tree tokens (``conv_in`` [T, C]); zeroes the fresh slots' states
        first. Returns (conv_out [T, C], slots [Bt])."""
        slots = step.state_slots[self.group]
        conv_state = conv_state_view(self.module.kv_cache[0])
        if bool(step.fresh.any()):  # a host tensor: no device sync
            self.zero_states(step, slots)
        out = tree_conv(conv_in, weight, conv_state, slots, step.tree, bias=bias, activation=activation,
                        kernels=step.kernels)
        return out, slots

    def zero_states(self, step: TreeStep, slots: torch.Tensor) -> None:
        """Zero the conv and recurrent states of the step's fresh requests (no committed state yet);
        ``slots`` [Bt] the step's state slots of this layer's group."""
        self.zero_slots(slots[upload(step.fresh, slots.device)])

    def zero_slots(self, slots) -> None:
        """Zero the conv and recurrent states of ``slots`` (an index or index tensor)."""
        conv_state_view(self.module.kv_cache[0])[slots] = 0
        self.state_view()[slots] = 0

    def save(self, step: TreeStep, slots, conv_in, **inputs) -> None:
        self._saved = Saved(step, slots, self.rows_of(step, slots), conv_in, inputs)

    def saved_bytes(self) -> int:
        """Bytes this layer holds from the tree forward to its commit (the tree tokens' inputs)."""
        s = self._saved
        if s is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (s.conv_in, *s.inputs.values()) if isinstance(t, torch.Tensor))

    def commit(self, tree, result) -> None:
        saved, self._saved = self._saved, None
        step = saved.step
        last_local = result.last_node - tree.starts
        commit_conv_state(conv_state_view(self.module.kv_cache[0]), saved.slots, tree, last_local, saved.conv_in,
                          kernels=step.kernels)
        accepted = result.accepted_i32[:, : self.max_path]
        self._stash(saved, tree, accepted)

    def flush(self, slots: torch.Tensor, kernels: str, rows: torch.Tensor | None = None) -> None:
        """Commit the pending paths (at ``rows``; default: the slots) of the states ``slots`` (nothing verified)."""
        self._commit_pending(slots, slots if rows is None else rows, kernels)

    def drop(self, row: int) -> None:
        """Forget a finished request's pending path (its row is free)."""
        if self.pending is not None:
            self.pending.length[row] = 0
