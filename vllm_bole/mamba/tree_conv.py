"""Tree-aware short causal conv1d (depthwise, width W <= 4 in the models) and its state commit.

Layouts: x [T, C] pre-conv features of the tree nodes (flat, TreeBatch order); weight [C, W]
(vLLM keeps [C, 1, W]: pass ``.squeeze(1)``); bias [C] or None; conv_state [S, C, W-1] fp32
or the model dtype, oldest input first, any strides (vLLM's dim-first layout as is, its
[S, W-1, C] layout as ``.transpose(-1, -2)``); state_idx [B] slot of each request.

The window of node i is its own input and those of its W-1 nearest ancestors; where the path
is shorter than W-1, the rest comes from the committed conv state. After acceptance, the conv
state holds the last W-1 inputs of the accepted path (shifted in from the old state when the
path is shorter than W-1): ``commit_conv_state`` writes that in place from the accepted path's
last node. Shared by the GDN and the Mamba2 mixers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_bole.dispatch import use_triton
from vllm_bole.spec_decode.tree import TreeBatch


def _gather_window(x, conv_state, state_idx, tree: TreeBatch, nodes, width, shift):
    """[n, C, width] inputs at depths depth(node) - shift + j along each node's path."""
    req = tree.request_index[nodes]
    d = tree.depth[nodes].long()[:, None] + torch.arange(width, device=x.device)[None, :] - shift  # [n, width]
    from_tree = d >= 0
    local = tree.path[nodes][torch.arange(nodes.numel(), device=x.device)[:, None], d.clamp(min=0)].long()
    rows = (tree.cu_nodes[req].long()[:, None] + local.clamp(min=0))
    xv = x[rows].transpose(1, 2)  # [n, C, width]
    col = (d + conv_state.shape[2]).clamp(min=0, max=conv_state.shape[2] - 1)
    sv = conv_state[state_idx.long()[req]]  # [n, C, W-1]
    sv = sv.gather(2, col[:, None, :].expand(-1, sv.shape[1], -1))
    return torch.where(from_tree[:, None, :], xv.to(torch.float32), sv.to(torch.float32))


def tree_conv(x, weight, conv_state, state_idx, tree: TreeBatch, *, bias=None, activation="silu", impl="auto"):
    """y [T, C] (x's dtype) = act(depthwise conv over each node's ancestor window + bias)."""
    if activation not in ("silu", None):
        raise ValueError(f"activation: {activation!r} is not one of 'silu', None")
    if use_triton(impl, x):
        from csrc_triton.tree_conv import tree_conv as launch

        return launch(x.contiguous(), weight.contiguous(), bias, conv_state, state_idx, tree, activation == "silu")
    W = weight.shape[-1]
    nodes = torch.arange(tree.num_nodes, device=x.device)
    win = _gather_window(x, conv_state, state_idx, tree, nodes, W, W - 1)
    y = (win * weight.float()[None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)


def commit_conv_state(conv_state, state_idx, tree: TreeBatch, last_node, x, *, impl="auto"):
    """In place: conv_state[slot] <- last W-1 inputs ending at the accepted path's last node.

    last_node: [B] local index of each request's last accepted node (-1: leave the slot as is).
    Slots of other requests are untouched.
    """
    if use_triton(impl, x):
        from csrc_triton.tree_conv import commit_conv_state as launch

        return launch(conv_state, state_idx, tree, last_node.contiguous(), x.contiguous())
    live = last_node >= 0
    nodes = (tree.cu_nodes[:-1].long() + last_node.long())[live]
    Wm1 = conv_state.shape[2]
    win = _gather_window(x, conv_state, state_idx, tree, nodes, Wm1, Wm1 - 1)
    conv_state[state_idx.long()[live]] = win.to(conv_state.dtype)
