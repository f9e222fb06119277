"""The recurrent tree kernels at the boundaries of the advertised envelope (issue 14).

``TreeBatch`` accepts 1..256 nodes per request and depth 1..64; the kernels switch from one
on-chip block to a blocked forward substitution past 64 nodes (32 at K = 256 or d_state = 256),
and pending paths longer than 32 tokens commit in chunks. Each case: fresh random inputs, outputs
poisoned (NaN) before the call, one unused state slot holding NaN (it must stay NaN), verify
against the float64 sequential oracle, then stash each request's deepest path and commit it
(``depth + 1`` tokens, up to 65), against the oracle's state at that node. Both implementations:
the torch twin and the Triton kernels (interpreter on CPU, fp32 exact there: bound 1e-4). Head
counts stay small so each case takes a few seconds in the interpreter.
"""
import pytest
import torch

from vllm_bole.mamba import gdn_tree, ssd_tree
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.testing.oracles import gdn_tree_reference, random_tree, ssd_tree_reference
from vllm_bole.testing.stats import rel_err

IMPLS = ["torch", "triton"]
TOL = 1e-4


def _tree(name: str) -> TreeBatch:
    gen = torch.Generator().manual_seed(len(name))
    rnd = lambda n, d=16: random_tree(n, max_depth=d, generator=gen)  # noqa: E731
    chain = lambda n: list(range(-1, n - 1))  # noqa: E731
    parents = {
        "N64": [rnd(64)], "N65": [rnd(65)], "N128": [rnd(128, 40)], "N129": [rnd(129)], "N256": [rnd(256, 64)],
        "chain63": [chain(64)], "chain64": [chain(65)],
        "ragged": [[-1], rnd(129, 24), [-1], chain(40), rnd(7)],  # root-only requests, three block counts
    }[name]
    return TreeBatch.from_parents(parents)


BOUNDARY = ["N64", "N65", "N128", "N129", "N256", "chain63", "chain64", "ragged"]


def _deepest(tree):
    """accepted [B, D + 1] root-first, -1 padded; flat index of each request's deepest node."""
    cu = tree.cu_nodes.tolist()
    last = [int(torch.argmax(tree.depth[s:e])) for s, e in zip(cu[:-1], cu[1:])]
    acc = torch.full((tree.num_requests, tree.max_depth + 1), -1, dtype=torch.int64)
    for r, node in enumerate(last):
        path = tree.root_path(r, node)
        acc[r, : len(path)] = torch.tensor(path)
    return acc, torch.tensor([c + node for c, node in zip(cu[:-1], last)])


def _slots(B, gen):
    slots = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    return slots, [s for s in range(B + 1) if s not in slots.tolist()]


# --------------------------------------------------------------------------------------- GDN
def _gdn_case(tree, impl, Hk=1, Hv=1, K=64, V=64, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, B = tree.num_nodes, tree.num_requests
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(T, Hk, K).to(dtype), r(T, Hk, K).to(dtype), r(T, Hv, V).to(dtype)
    g, beta = -torch.rand(T, Hv, generator=gen) * 0.3, torch.rand(T, Hv, generator=gen)
    state = (r(B + 1, Hv, K, V) * 0.3).to(state_dtype)
    slots, unused = _slots(B, gen)
    state[unused] = float("nan")
    o_ref, st = gdn_tree_reference(tree, q, k, v, g, beta, state[slots.long()])
    out = torch.full((T, Hv, V), float("nan"), dtype=dtype)
    o = gdn_tree_step_(q, k, v, g, beta, tree, state, slots, out, impl)
    assert o.data_ptr() == out.data_ptr() and torch.isfinite(o).all()
    acc, last = _deepest(tree)
    pending = gdn_tree.PendingPath.empty(B + 1, tree.max_depth + 1, Hk, Hv, K, V, dtype=dtype)
    gdn_tree.stash_accepted_path(pending, slots, tree, acc, k, v, g, beta, impl=impl)
    gdn_tree.gdn_commit_pending(state, slots, pending, impl=impl)
    assert torch.isnan(state[unused]).all(), "an unused slot was written"
    assert state.dtype == state_dtype
    return rel_err(o, o_ref), rel_err(state[slots.long()], st[last])


def gdn_tree_step_(q, k, v, g, beta, tree, state, slots, out, impl):
    return gdn_tree.gdn_tree_step(q, k, v, g, beta, tree, state, slots, out=out, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", BOUNDARY)
def test_gdn_boundary_trees(impl, name):
    e_out, e_state = _gdn_case(_tree(name), impl, seed=len(name))
    assert e_out < TOL and e_state < TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,K,V", [("N64", 64, 96), ("N65", 64, 80), ("N129", 32, 96), ("chain64", 256, 256)])
def test_gdn_head_dims(impl, name, K, V):
    """V a multiple of 16 but not of 64 (every column written), K = 256 (its own block sizes), GQA."""
    e_out, e_state = _gdn_case(_tree(name), impl, Hk=1, Hv=2 if K < 256 else 1, K=K, V=V, seed=K + V)
    assert e_out < TOL and e_state < TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn_bf16_state(impl):
    """vLLM 0.33 keeps the Qwen3-Next state in the model dtype: fp32 inputs, bf16 state (computed in
    fp32, stored as bf16); the oracle starts from the same bf16 values."""
    e_out, e_state = _gdn_case(_tree("N65"), impl, state_dtype=torch.bfloat16, seed=5)
    assert e_out < TOL and e_state < 1e-2


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn_bf16_inputs_and_state(impl):
    """bf16 inputs (bf16 operands, emulated exactly in the interpreter) with a bf16 state, blocked tree."""
    e_out, e_state = _gdn_case(_tree("N129"), impl, dtype=torch.bfloat16, state_dtype=torch.bfloat16, seed=6)
    assert e_out < 2e-2 and e_state < 1e-2


def test_gdn_refuses_unsupported_dims():
    tree = _tree("N64")
    T = tree.num_nodes
    for K, V, field in ((96, 64, "K=96"), (64, 72, "V=72"), (512, 64, "K=512")):
        q, v = torch.zeros(T, 1, K), torch.zeros(T, 1, V)
        with pytest.raises(ValueError, match=field) as e:
            gdn_tree.gdn_tree_step(q, q, v, torch.zeros(T, 1), torch.zeros(T, 1), tree, torch.zeros(1, 1, K, V),
                                   torch.zeros(1, dtype=torch.int32), impl="torch")
        assert "\n" not in str(e.value) and ("16, 32, 64, 128, 256" in str(e.value) or "multiple of 16" in str(e.value))


# --------------------------------------------------------------------------------------- SSD
def _ssd_case(tree, impl, H=2, G=1, P=32, N=16, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, B = tree.num_nodes, tree.num_requests
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, dt = r(T, H, P).to(dtype), r(T, H).to(dtype)
    Bm, Cm = (r(T, G, N) * 0.3).to(dtype), (r(T, G, N) * 0.3).to(dtype)
    A = -(torch.rand(H, generator=gen) + 0.1)
    kw = dict(D=r(H), dt_bias=r(H) * 0.3, dt_limit=(0.0, 2.0))
    state = (r(B + 1, H, P, N) * 0.3).to(state_dtype)
    slots, unused = _slots(B, gen)
    state[unused] = float("nan")
    y_ref, st = ssd_tree_reference(tree, x, dt, A, Bm, Cm, state[slots.long()], **kw)
    out = torch.full((T, H, P), float("nan"), dtype=dtype)
    y = ssd_tree.ssd_tree_step(x, dt, A, Bm, Cm, tree, state, slots, out=out, impl=impl, **kw)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    acc, last = _deepest(tree)
    pending = ssd_tree.PendingPath.empty(B + 1, tree.max_depth + 1, H, G, P, N, dtype=dtype)
    ssd_tree.stash_accepted_path(pending, slots, tree, acc, x, dt, Bm, impl=impl)
    ssd_tree.ssd_commit_pending(state, slots, pending, A, dt_bias=kw["dt_bias"], dt_limit=kw["dt_limit"], impl=impl)
    assert torch.isnan(state[unused]).all(), "an unused slot was written"
    return rel_err(y, y_ref), rel_err(state[slots.long()], st[last])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", BOUNDARY)
def test_ssd_boundary_trees(impl, name):
    e_out, e_state = _ssd_case(_tree(name), impl, seed=len(name))
    assert e_out < TOL and e_state < TOL


SSD_DIMS = [(P, N) for P in (32, 64, 128) for N in (16, 64, 128, 256)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("P,N", SSD_DIMS)
def test_ssd_head_dims(impl, P, N):
    """head_dim x d_state of the shipped models, n_groups 1, 2 or 8 in turn, on a ragged two-block tree."""
    G = (2, 8, 1)[SSD_DIMS.index((P, N)) % 3]
    tree = TreeBatch.from_parents([random_tree(65, max_depth=16, generator=torch.Generator().manual_seed(P + N)), [-1]])
    e_out, e_state = _ssd_case(tree, impl, H=8 if G == 8 else 2, G=G, P=P, N=N, seed=P * N)
    assert e_out < TOL and e_state < TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_ssd_bf16_state(impl):
    e_out, e_state = _ssd_case(_tree("N129"), impl, state_dtype=torch.bfloat16, seed=7)
    assert e_out < TOL and e_state < 1e-2


def test_ssd_refuses_unsupported_dims():
    tree = _tree("N64")
    T = tree.num_nodes
    for H, G, P, N, field in ((2, 1, 300, 16, "head_dim=300"), (2, 1, 32, 512, "d_state=512"), (4, 3, 32, 16, "n_groups=3")):
        with pytest.raises(ValueError, match=field) as e:
            ssd_tree.ssd_tree_step(torch.zeros(T, H, P), torch.zeros(T, H), -torch.ones(H), torch.zeros(T, G, N),
                                   torch.zeros(T, G, N), tree, torch.zeros(1, H, P, N), torch.zeros(1, dtype=torch.int32),
                                   impl="torch")
        assert "\n" not in str(e.value)
