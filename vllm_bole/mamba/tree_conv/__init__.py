"""Tree-aware short causal conv1d (depthwise, width W <= 4 in the models) and its state commit:
the public API. Shared by the GDN and the Mamba2 mixers.

One operation, three implementations side by side:
  csrc_triton/tree_conv.py                  the Triton kernels (conv, conv-state commit)
  vllm_bole/mamba/tree_conv/naive.py        their plain-torch twin (the CPU path)
  vllm_bole/mamba/tree_conv/reference.py    the float64 sequential reference (the tests' oracle)

Layouts: x [T, C] pre-conv features of the tree nodes (flat, TreeBatch order); weight [C, W]
(vLLM keeps [C, 1, W]: pass ``.squeeze(1)``); bias [C] or None; conv_state [S, C, W-1] fp32
or the model dtype, oldest input first, any strides (vLLM's dim-first layout as is, its
[S, W-1, C] layout as ``.transpose(-1, -2)``); state_idx [B] slot of each request.

The window of node i is its own input and those of its W-1 nearest ancestors; where the path
is shorter than W-1, the rest comes from the committed conv state. After acceptance, the conv
state holds the last W-1 inputs of the accepted path (shifted in from the old state when the
path is shorter than W-1): ``commit_conv_state`` writes that in place from the accepted path's
last node. ``kernels`` as everywhere (``vllm_bole.dispatch``).
"""
from __future__ import annotations

from vllm_bole.dispatch import use_triton
from vllm_bole.mamba.tree_conv import naive
from vllm_bole.spec_decode.tree import TreeBatch

ACTIVATIONS = ("silu", None)


def tree_conv(x, weight, conv_state, state_idx, tree: TreeBatch, *, bias=None, activation="silu", kernels="auto"):
    """y [T, C] (x's dtype) = act(depthwise conv over each node's ancestor window + bias)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not one of 'silu', None")
    if use_triton(kernels, x):
        from csrc_triton.tree_conv import tree_conv as launch

        return launch(x.contiguous(), weight.contiguous(), bias, conv_state, state_idx, tree, activation == "silu")
    return naive.tree_conv(x, weight, conv_state, state_idx, tree, bias, activation)


def commit_conv_state(conv_state, state_idx, tree: TreeBatch, last_node, x, *, kernels="auto"):
    """In place: conv_state[slot] <- last W-1 inputs ending at the accepted path's last node.

    last_node: [B] local index of each request's last accepted node (-1: leave the slot as is).
    Slots of other requests are untouched.
    """
    if use_triton(kernels, x):
        from csrc_triton.tree_conv import commit_conv_state as launch

        return launch(conv_state, state_idx, tree, last_node.contiguous(), x.contiguous())
    naive.commit_conv_state(conv_state, state_idx, tree, last_node, x)
