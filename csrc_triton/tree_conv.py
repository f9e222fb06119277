"""Tree-aware causal depthwise conv1d and the conv-state commit of the accepted path (Triton).

A node's window is its own pre-conv input and those of its W-1 nearest ancestors; taps that
reach above the root come from the request's committed conv state (oldest first). With the
node at depth d, tap j (0..W-1, W-1 = the node itself) reads depth s = d - (W-1) + j: the
ancestor ``path[i, s]`` when s >= 0, else committed column ``s + W - 1``.
API and dispatch: ``vllm_bole.mamba.tree_conv``; plain-torch twin: its ``naive.py``; float64
reference: its ``reference.py``.
"""
import triton
import triton.language as tl


@triton.jit
def _window(x, conv_state, path, row_path, bos, slot, d, o_c, cmask, o_w, W: tl.constexpr, MAXD1,
            s_slot, s_c, s_w, C, SHIFT, NCOL: tl.constexpr):
    """[BC, BW] inputs at depths d - SHIFT + o_w (o_w < W), from the path or, above the root,
    from the committed state's column depth + NCOL (NCOL = W_conv - 1 columns, oldest first)."""
    s = d - SHIFT + o_w
    wm = o_w < W
    from_tree = (s >= 0) & wm
    node = tl.load(path + row_path * MAXD1 + tl.where(from_tree, s, 0), mask=from_tree, other=0)
    xv = tl.load(x + (bos + node.to(tl.int64))[None, :] * C + o_c[:, None], mask=cmask[:, None] & from_tree[None, :], other=0.0)
    from_state = (s < 0) & wm
    sv = tl.load(conv_state + slot * s_slot + o_c[:, None] * s_c + tl.where(from_state, s + NCOL, 0)[None, :] * s_w,
                 mask=cmask[:, None] & from_state[None, :], other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def tree_conv_kernel(x, weight, bias, y, conv_state, state_idx, req_index, cu_nodes, depth, path,
                     s_slot, s_c, s_w, C, MAXD1,
                     W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Program (node i, channel block): y[i] = act(sum_j weight[:, j] * window[:, j] + bias)."""
    i = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = o_c < C
    o_w = tl.arange(0, BW)
    b = tl.load(req_index + i)
    bos = tl.load(cu_nodes + b)
    slot = tl.load(state_idx + b).to(tl.int64)
    d = tl.load(depth + i)
    win = _window(x, conv_state, path, i, bos, slot, d, o_c, cm, o_w, W, MAXD1, s_slot, s_c, s_w, C, W - 1, W - 1)
    w = tl.load(weight + o_c[:, None] * W + o_w[None, :], mask=cm[:, None] & (o_w < W)[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(win * w, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=cm, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i * C + o_c, acc.to(y.dtype.element_ty), mask=cm)


@triton.jit
def conv_commit_kernel(x, conv_state, state_idx, cu_nodes, depth, path, last_node,
                       s_slot, s_c, s_w, C, MAXD1,
                       W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    """Program (request b, channel block): conv state <- last W-1 inputs ending at last_node[b]
    (local index; -1 leaves the slot untouched). Reads complete before the in-place write."""
    b = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = o_c < C
    e = tl.load(last_node + b)
    if e >= 0:
        o_w = tl.arange(0, BW)
        bos = tl.load(cu_nodes + b)
        slot = tl.load(state_idx + b).to(tl.int64)
        row = (bos + e).to(tl.int64)
        d = tl.load(depth + row)
        win = _window(x, conv_state, path, row, bos, slot, d, o_c, cm, o_w, W - 1, MAXD1, s_slot, s_c, s_w, C, W - 2, W - 1)
        tl.debug_barrier()
        tl.store(conv_state + slot * s_slot + o_c[:, None] * s_c + o_w[None, :] * s_w,
                 win.to(conv_state.dtype.element_ty), mask=cm[:, None] & (o_w < W - 1)[None, :])


def tree_conv(x, weight, bias, conv_state, state_idx, tree, silu, block_c=128):
    import torch

    x, weight = x.contiguous(), weight.contiguous()  # dense rows assumed (no copy if they are)
    T, C = x.shape
    W = weight.shape[-1]
    y = torch.empty_like(x)
    tree_conv_kernel[(T, triton.cdiv(C, block_c))](
        x, weight, bias if bias is not None else x, y, conv_state, state_idx, tree.request_index, tree.cu_nodes,
        tree.depth, tree.path, *conv_state.stride(), C, tree.path.shape[1],
        W=W, BW=triton.next_power_of_2(W), BC=block_c, HAS_BIAS=bias is not None, SILU=silu,
    )
    return y


def commit_conv_state(conv_state, state_idx, tree, last_node, x, block_c=128):
    x = x.contiguous()
    C = x.shape[1]
    W = conv_state.shape[2] + 1
    conv_commit_kernel[(state_idx.numel(), triton.cdiv(C, block_c))](
        x, conv_state, state_idx, tree.cu_nodes, tree.depth, tree.path, last_node,
        *conv_state.stride(), C, tree.path.shape[1],
        W=W, BW=triton.next_power_of_2(W - 1), BC=block_c,
    )
