"""Plain-torch twin of the tree conv kernels (``csrc_triton/tree_conv.py``): the CPU path of
``vllm_bole.mamba.tree_conv``, in fp32. Each node's window is gathered along its path (``path``)
and topped up from the committed conv state. The float64 sequential reference beside it is
``vllm_bole.mamba.tree_conv.reference``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


def tree_conv(x, weight, conv_state, state_idx, tree: TreeBatch, bias, activation):
    W = weight.shape[-1]
    nodes = torch.arange(tree.num_nodes, device=x.device)
    win = _gather_window(x, conv_state, state_idx, tree, nodes, W, W - 1)
    y = (win * weight.float()[None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)


def commit_conv_state(conv_state, state_idx, tree: TreeBatch, last_node, x):
    live = last_node >= 0
    nodes = (tree.starts + last_node.long())[live]
    Wm1 = conv_state.shape[2]
    win = _gather_window(x, conv_state, state_idx, tree, nodes, Wm1, Wm1 - 1)
    conv_state[state_idx.long()[live]] = win.to(conv_state.dtype)
