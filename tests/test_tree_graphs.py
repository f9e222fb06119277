"""Tree steps padded into a CUDA-graph bucket (``vllm_bole.adapter.tree_graphs``): the buckets, the padding
trees, the static step, and the kernels on a padded step equal to them on the step itself (what the
captured graph replays; the capture itself needs a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_tree_attention import make_case
from vllm_bole.adapter.tree_graphs import StaticStep, padding_trees, pick, plan
from vllm_bole.attention.tree_attention import tree_attention
from vllm_bole.mamba.ssd_tree import ssd_tree_step
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.testing.oracles import random_tree_batch

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
NODES = 9


def test_every_step_that_fits_finds_the_first_bucket_with_room():
    buckets = plan(8, NODES, SIZES)
    assert all(b < t <= b * NODES for b, t in buckets) and max(b for b, _ in buckets) == 16  # 8 requests + padding
    for b in range(1, 9):
        for t in range(b, b * NODES + 1):
            got = pick(buckets, b, t, NODES)
            ok = [bt for bt in buckets if 1 <= bt[0] - b <= bt[1] - t <= (bt[0] - b) * NODES]
            assert got == (ok[0] if ok else None)
            assert got is not None or t > 128 - 1  # only steps beyond the largest capture size miss


@pytest.mark.parametrize("requests,tokens", [(1, 1), (1, 9), (3, 3), (3, 20), (5, 45)])
def test_padding_trees_are_stars(requests, tokens):
    pad = padding_trees(requests, tokens, NODES)
    assert pad["sizes"].sum() == tokens and (pad["sizes"] >= 1).all() and (pad["sizes"] <= NODES).all()
    ref = TreeBatch.from_parents([[-1] + [0] * (int(n) - 1) for n in pad["sizes"]],
                                 [[0] * int(n) for n in pad["sizes"]])
    assert torch.equal(torch.tensor(pad["parent"]), ref.parent)
    assert torch.equal(torch.tensor(pad["depth"]), ref.depth)
    assert torch.equal(torch.tensor(pad["anc_mask"]), ref.anc_mask)
    w = ref.path.shape[1]
    assert torch.equal(torch.tensor(pad["path"])[:, :w], ref.path)


def _padded(tree, bucket, prefix, tables, slots, depth=8, max_len=4096):
    st = StaticStep(*bucket, NODES, depth, max_len, {g: t.shape[1] for g, t in tables.items()}, list(slots), "torch",
                    "cpu")
    st.fill(tree, prefix, tables, slots)
    return st


def test_static_step_holds_the_step_then_padding_requests():
    gen = torch.Generator().manual_seed(0)
    tree = random_tree_batch([4, 1, 9], generator=gen)
    bucket = pick(plan(8, NODES, SIZES), tree.num_requests, tree.num_nodes, NODES)
    tables = {0: np.arange(6, dtype=np.int32).reshape(3, 2) + 1}
    st = _padded(tree, bucket, np.array([5, 0, 7]), tables, {1: np.array([3, 4, 5])})
    s, T, t = st.new_step(), bucket[1], tree.num_nodes
    pad = padding_trees(bucket[0] - 3, T - t, NODES)
    assert s.tree.num_nodes == T and s.tree.num_requests == bucket[0]
    assert torch.equal(s.tree.parent[:t], tree.parent) and torch.equal(s.tree.anc_mask[:t], tree.anc_mask)
    assert torch.equal(s.tree.cu_nodes[:4], tree.cu_nodes)
    assert torch.equal(s.tree.nodes_per_request[3:].long(), torch.tensor(pad["sizes"]))
    assert s.prefix_len.tolist() == [5, 0, 7] + [0] * (bucket[0] - 3)
    assert s.block_tables[0][:3].tolist() == tables[0].tolist() and not s.block_tables[0][3:].any()
    assert s.state_slots[1].tolist() == [3, 4, 5] + [0] * (bucket[0] - 3)
    assert (s.tree.path[:t, : tree.path.shape[1]] == tree.path).all() and (s.tree.path[:t, tree.path.shape[1]:] == -1).all()
    index = s.tree.request_index.clone()
    st.fill(random_tree_batch([2, 2], generator=gen), np.array([1, 1]), {0: tables[0][:2]}, {1: np.array([9, 8])})
    s = st.new_step()  # a new tree: what a tree derives follows the new contents
    assert s.state_slots[1].tolist()[:3] == [9, 8, 0] and not s.block_tables[0][2:].any()  # nothing left over
    assert not torch.equal(s.tree.request_index, index) and s.tree.request_index[:4].tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_tree_attention_on_the_padded_step_equals_the_step(kernels):
    gen = torch.Generator().manual_seed(1)
    tree = random_tree_batch([6, 1, 9, 3], generator=gen)
    case = make_case(tree, seed=3)
    bucket = pick(plan(8, NODES, SIZES), tree.num_requests, tree.num_nodes, NODES)
    st = _padded(tree, bucket, case["P"].numpy(), {0: case["bt"].numpy()}, {})
    t = tree.num_nodes
    q = torch.cat([case["q"], torch.randn(bucket[1] - t, *case["q"].shape[1:], generator=gen)])
    want = tree_attention(case["q"], case["kcs"][0], case["vcs"][0], case["bt"], case["P"], case["tree"], kernels=kernels)
    s = st.new_step()
    got = tree_attention(q, case["kcs"][0], case["vcs"][0], s.block_tables[0], s.prefix_len, s.tree, kernels=kernels,
                         max_nodes=NODES, max_kv_len=int(case["P"].max()) + 64)
    torch.testing.assert_close(got[:t], want, rtol=1e-5, atol=1e-5)


def _recurrent_case(sizes, seed):
    """A step of trees of ``sizes`` nodes on state slots 1.. (slot 0 is the padding's) and its padded bucket."""
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree_batch(sizes, generator=gen)
    bucket = pick(plan(8, NODES, SIZES), tree.num_requests, tree.num_nodes, NODES)
    slots = np.random.default_rng(seed).permutation(len(sizes)) + 1
    st = _padded(tree, bucket, np.full(len(sizes), 4), {}, {0: slots})
    return gen, tree, torch.from_numpy(slots), st, bucket[1], tree.num_nodes


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_ssd_step_on_the_padded_step_equals_the_step(kernels):
    H, G, P, N = 4, 2, 16, 8
    gen, tree, slots, st, T, t = _recurrent_case([5, 1, 9], 2)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, dt, Bm, Cm = r(T, H, P), r(T, H), r(T, G, N) * 0.5, r(T, G, N) * 0.5
    A = -(torch.rand(H, generator=gen) + 0.1)
    state = r(4, H, P, N)
    ref_state = state.clone()
    want = ssd_tree_step(x[:t], dt[:t], A, Bm[:t], Cm[:t], tree, ref_state, slots, kernels=kernels, dt_softplus=True)
    s = st.new_step()
    got = ssd_tree_step(x, dt, A, Bm, Cm, s.tree, state, s.state_slots[0], kernels=kernels,
                        dt_softplus=True)
    torch.testing.assert_close(got[:t], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1:], ref_state[1:])  # the real requests' slots; slot 0 is the padding's


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_gdn_step_on_the_padded_step_equals_the_step(kernels):
    from vllm_bole.gdn import gdn_tree_step

    Hk, Hv, K, V = 1, 2, 16, 16
    gen, tree, slots, st, T, t = _recurrent_case([7, 2, 1], 4)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(T, Hk, K), r(T, Hk, K), r(T, Hv, V)
    g, beta = -torch.rand(T, Hv, generator=gen) * 0.5, torch.rand(T, Hv, generator=gen)
    state = r(4, Hv, K, V) * 0.1
    ref_state = state.clone()
    want = gdn_tree_step(q[:t], k[:t], v[:t], g[:t], beta[:t], tree, ref_state, slots, kernels=kernels)
    s = st.new_step()
    got = gdn_tree_step(q, k, v, g, beta, s.tree, state, s.state_slots[0], kernels=kernels)
    torch.testing.assert_close(got[:t], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1:], ref_state[1:])


def test_split_steps_ask_vllm_for_piecewise_graphs_unless_switched_off(monkeypatch):
    """A split step's prompt rows (``TreeRunnerMixin._bole_plain_graph``): vLLM's dispatcher decides, full graphs
    excluded; ``VLLM_BOLE_SPLIT_PIECEWISE=0`` runs them eagerly, unpadded."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from vllm_bole.adapter.runner import TreeRunnerMixin

    asked = []
    runner = SimpleNamespace(cudagraph_dispatcher=SimpleNamespace(dispatch=lambda **kw: asked.append(kw) or "vllm's"))
    assert TreeRunnerMixin._bole_plain_graph(runner, 37) == "vllm's"
    assert asked == [dict(num_tokens=37, uniform_decode=False, invalid_modes={CUDAGraphMode.FULL})]
    monkeypatch.setenv("VLLM_BOLE_SPLIT_PIECEWISE", "0")
    mode, desc = TreeRunnerMixin._bole_plain_graph(runner, 37)
    assert mode == CUDAGraphMode.NONE and desc.num_tokens == 37 and len(asked) == 1
