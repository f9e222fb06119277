"""Float64 sequential reference of the tree conv (the oracle of ``vllm_bole.mamba.tree_conv``).

Conventions (kernels must match them): ``conv_state [C, W-1]`` holds the last ``W-1`` pre-conv
inputs, oldest first (vLLM); ``y_t = act(sum_w weight[:, w] * window[:, w] + bias)`` with
``window = [conv_state, x_t]``, the same as a causal ``F.conv1d`` (cross-correlation, no kernel
flip). transformers keeps ``W`` columns in its cache, the oldest of which is never read: ours is
its ``[..., 1:]``. Nodes are walked depth level by depth level, each window from its parent's.
Siblings: ``csrc_triton/tree_conv.py`` (kernels), ``vllm_bole/mamba/tree_conv/naive.py`` (torch twin).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_bole.tree_views import depth_levels, start_state

_F64 = torch.float64


def conv_tree_reference(tree, x, weight, conv_state0, *, bias=None, activation="silu"):
    """Depthwise causal conv1d of width W over a tree batch.

    x: [T, C] pre-conv inputs; weight: [C, W]; bias: [C] or None; conv_state0: [B, C, W-1] (the
    last W-1 committed inputs of each request, oldest first, vLLM's conv_state layout).
    The window of node i is its own input and those of its W-1 nearest ancestors, topped up from
    conv_state0 where the path is shorter. activation: "silu" or None.
    Returns (y [T, C], conv_states [T, C, W-1]) float64; conv_states[i] = last W-1 inputs up to i.
    """
    T, Cdim = x.shape
    W = weight.shape[-1]
    weight = weight.reshape(Cdim, W)
    assert conv_state0.shape == (tree.num_requests, Cdim, W - 1), (
        f"conv_state0 must be [B, C, W-1] = {(tree.num_requests, Cdim, W - 1)}, got {tuple(conv_state0.shape)}"
    )
    assert activation in ("silu", None), f"activation {activation!r} not in ('silu', None)"
    assert tree.num_nodes == T, "tree and inputs disagree on T"
    dev = x.device
    x, weight, conv_state0 = x.to(_F64), weight.to(_F64), conv_state0.to(_F64)
    y = torch.zeros(T, Cdim, dtype=_F64, device=dev)
    conv_states = torch.zeros(T, Cdim, W - 1, dtype=_F64, device=dev)
    for idx, par, req in depth_levels(tree, dev):
        window = torch.cat([start_state(conv_states, conv_state0, par, req), x[idx][..., None]], dim=-1)  # [n, C, W]
        conv_states[idx] = window[..., 1:]
        y[idx] = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias.to(_F64)
    if activation == "silu":
        y = F.silu(y)
    return y, conv_states
