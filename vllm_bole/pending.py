"""Accepted paths awaiting commit, shared by the recurrent tree layers (GDN, Mamba2/SSD).

* ``PendingPath``: accepted paths awaiting commit, one row per request. A buffer of named per-token
  fields (each ``[R, L, *row]``: row, path position, one token's inputs of the layer) plus
  ``length [R]`` int32 (0 = nothing pending). The tree steps read a request's row through
  ``pending_idx`` (default: the request's state slot, one row per slot). Each layer kind subclasses it with its fields and
  an ``empty`` constructor (``vllm_bole.gdn.PendingPath``: k, v, g, beta;
  ``vllm_bole.mamba.ssd_tree.PendingPath``: x, dt, B). Fields read as attributes
  (``pending.k``).
* ``stash_accepted_path``: after sampling, copy the accepted nodes' rows of each field into
  the requests' slots: one Triton launch for all fields (``csrc_triton.pending_stash``) or its
  torch twin, below.
* ``live_pending`` / ``pending_rows``: the padded view of the live pending paths, for the
  layers' torch twins.
* ``dispatch_step``: what the recurrent tree steps' APIs share around their kernel or twin.
"""
from __future__ import annotations

import torch

from vllm_bole.dispatch import use_triton
from vllm_bole.spec_decode.tree import TreeBatch

MAX_FIELDS = 4  # fields one stash launch copies (GDN has 4, SSD and Mamba1 3)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the Triton tree steps take


def dispatch_step(triton: bool, launch, twin, *, tensors, out, pending, pending_idx, reset_pending: bool = True):
    """A recurrent tree step (commit of the pending paths, then verification): ``launch()`` (Triton;
    every tensor of ``tensors`` in :data:`KERNEL_DTYPES`, else a one-line error naming the dtype) or
    ``twin()`` (torch; its output copied into ``out`` when given); then, with ``reset_pending``, the
    pending lengths of the touched rows ``pending_idx`` are reset (one more launch; a caller whose next
    operation on those rows is a stash, which sets their lengths, passes False). Returns the step's
    output (None: commit only)."""
    if triton:
        for t in tensors:
            if t is not None and t.dtype not in KERNEL_DTYPES:
                raise ValueError(f"dtype {t.dtype} runs on the torch kernels only: Triton takes float32, bfloat16, float16")
        y = launch()
    else:
        y = twin()
        if out is not None and y is not None:
            y = out.copy_(y)
    if pending is not None and reset_pending:
        pending.length.index_fill_(0, pending_idx.long(), 0)
    return y


class PendingPath:
    """Per-slot accepted paths awaiting commit: the tokens' own layer inputs, by field name."""

    def __init__(self, length: torch.Tensor, **fields: torch.Tensor):
        if not 0 < len(fields) <= MAX_FIELDS:
            raise ValueError(f"fields: {len(fields)} given, 1 to {MAX_FIELDS} supported")
        shapes = {tuple(t.shape[:2]) for t in fields.values()}
        if len(shapes) != 1 or length.shape != (next(iter(shapes))[0],):
            raise ValueError(f"fields must all be [S, L, ...] with length [S]; got {[tuple(t.shape) for t in fields.values()]}")
        self.length = length
        self.fields = dict(fields)

    def __getattr__(self, name):
        fields = self.__dict__.get("fields")
        if fields is not None and name in fields:
            return fields[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __repr__(self):
        rows = ", ".join(f"{n}={tuple(t.shape)}:{str(t.dtype).split('.')[-1]}" for n, t in self.fields.items())
        return f"{type(self).__name__}({rows})"

    @property
    def max_len(self) -> int:
        return next(iter(self.fields.values())).shape[1]

    @classmethod
    def allocate(cls, num_slots: int, max_len: int, rows: dict, device="cpu"):
        """rows: name -> (row shape, dtype); buffers zeroed, lengths 0."""
        bufs = {n: torch.zeros(num_slots, max_len, *shape, dtype=dt, device=device) for n, (shape, dt) in rows.items()}
        return cls(torch.zeros(num_slots, dtype=torch.int32, device=device), **bufs)


def stash_accepted_path(pending: PendingPath, state_idx, tree: TreeBatch, accepted, inputs: dict, *, kernels="auto"):
    """Copy the accepted nodes' inputs into ``pending`` at the requests' slots.

    accepted: [B, L] local node indices of each request's accepted path, root first, padded
    with -1 (verification's output). inputs: field name -> the step's tree input [T, ...]
    (one per field of ``pending``, cast to the field's dtype). Sets ``pending.length`` of the
    slots to the path lengths. Rows past a path's length keep stale values: every reader masks
    them by ``pending.length``.
    """
    B, L = accepted.shape
    if set(inputs) != set(pending.fields):
        raise ValueError(f"inputs: fields {sorted(inputs)} given, the buffer holds {sorted(pending.fields)}")
    if L > pending.max_len:
        raise ValueError(f"accepted: paths of up to {L} nodes, pending buffer holds {pending.max_len}")
    pairs = [(inputs[n].to(buf.dtype).contiguous(), buf) for n, buf in pending.fields.items()]
    if use_triton(kernels, pending.length):
        from csrc_triton.pending_stash import stash_rows

        return stash_rows(pairs, pending.length, state_idx, tree.cu_nodes, accepted.contiguous(), pending.max_len)
    # torch twin
    valid = accepted >= 0
    flat = torch.where(valid, accepted.long() + tree.cu_nodes[:-1, None].long(), 0)
    slot_rows = state_idx.long()[:, None].expand(B, L)[valid]
    pos = torch.arange(L, device=accepted.device)[None, :].expand(B, L)[valid]
    for x, buf in pairs:
        buf[slot_rows, pos] = x[flat[valid]]
    pending.length[state_idx.long()] = valid.sum(1).to(torch.int32)


# ------------------------------------------------------------ views for the torch twins
def live_pending(pending: PendingPath, slots, rows):
    """(sl [b] state slots of the requests with a pending path, pr [b] their pending rows, m [b] their
    lengths, valid [b, L] bool) or None; ``rows`` [B]: each request's pending row."""
    rows = rows.long()
    m = pending.length[rows].long()
    live = m > 0
    if not bool(live.any()):
        return None
    pos = torch.arange(pending.max_len, device=m.device)
    return slots[live], rows[live], m[live], pos[None, :] < m[live, None]


def pending_rows(x, valid, dtype):
    """[b, L, H, X] -> [b, H, L, X] (or [b, L, H] -> [b, H, L]) in ``dtype``, stale rows zeroed."""
    return torch.where(valid.view(*valid.shape, *([1] * (x.dim() - 2))), x.to(dtype), 0).transpose(1, 2)
