"""The recurrent tree kernels (GDN, Mamba2/SSD, Mamba1) at the boundaries of the advertised envelope (issue 14).

``TreeBatch`` accepts 1..256 nodes per request and depth 1..64; the kernels switch from one
on-chip block to a blocked forward substitution past 64 nodes (32 at K = 256 or d_state = 256),
and pending paths longer than 32 tokens commit in chunks. Each case: fresh random inputs, outputs
poisoned (NaN) before the call, one unused state slot holding NaN (it must stay NaN), verify
against the float64 sequential oracle, then stash each request's deepest path and commit it
(``depth + 1`` tokens, up to 65; the paths in pending-buffer rows other than the state slots, read
through ``pending_idx``), against the oracle's state at that node. Both implementations:
the torch twin and the Triton kernels (interpreter on CPU, fp32 exact there: bound 1e-4). Head
counts stay small so each case takes a few seconds in the interpreter.
"""
import pytest
import torch

from vllm_bole import gdn
from vllm_bole.mamba import mamba1_tree, ssd_tree
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.testing.oracles import (deepest_accepted_paths, gdn_tree_reference, mamba1_tree_reference, random_tree,
                                      ssd_tree_reference)
from vllm_bole.testing.stats import rel_err

KERNELS = ["torch", "triton"]
TOL = 1e-4


def _parents(name: str) -> list[list[int]]:
    """The named boundary batch's parent lists, one per request."""
    gen = torch.Generator().manual_seed(len(name))
    rnd = lambda n, d=16, kind="random": random_tree(n, max_depth=d, kind=kind, generator=gen)  # noqa: E731
    chain = lambda n: list(range(-1, n - 1))  # noqa: E731
    parents = {
        "N64": [rnd(64)], "N65": [rnd(65)], "N128": [rnd(128, 40)], "N129": [rnd(129)], "N256": [rnd(256, 64, "deep")],
        "chain63": [chain(64)], "chain64": [chain(65)],
        "ragged": [[-1], rnd(129, 24), [-1], chain(40), rnd(7)],  # root-only requests, three block counts
    }[name]
    return parents


def _tree(name: str) -> TreeBatch:
    return TreeBatch.from_parents(_parents(name))


BOUNDARY = ["N64", "N65", "N128", "N129", "N256", "chain63", "chain64", "ragged"]


def _slot_cache(B, row, dtype, gen):
    """A random state cache [B + 1, *row] whose unused slot holds NaN, the requests' slots, that slot."""
    cache = (torch.randn(B + 1, *row, generator=gen) * 0.3).to(dtype)
    slots = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    unused = [s for s in range(B + 1) if s not in slots.tolist()]
    cache[unused] = float("nan")
    return cache, slots, unused


def _pending_rows(B, gen):
    """Each request's row of its pending-path buffer ([B + 1] rows), drawn apart from its state slot: the
    kernels must read a path through ``pending_idx``, not the state slot."""
    return torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)


def _errors(out, out_ref, state, slots, unused, states_ref, last):
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    assert torch.isnan(state[unused]).all(), "an unused slot was written"
    return rel_err(out, out_ref), rel_err(state[slots.long()], states_ref[last])


def _verify_and_commit(tree, out, verify, commit, ref, state, slots, unused):
    """``verify(out)`` (it must write and return the poisoned ``out``), then ``commit(acc)`` of each
    request's deepest path; the ``_errors`` against the oracle's ``ref`` (outputs, states)."""
    o = verify(out)
    assert o.data_ptr() == out.data_ptr()
    acc, last = deepest_accepted_paths(tree)
    commit(acc)
    return _errors(o, ref[0], state, slots, unused, ref[1], last)


# --------------------------------------------------------------------------------------- GDN
def _gdn_case(tree, kernels, Hk=1, Hv=1, K=64, V=64, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, B = tree.num_nodes, tree.num_requests
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(T, Hk, K).to(dtype), r(T, Hk, K).to(dtype), r(T, Hv, V).to(dtype)
    g, beta = -torch.rand(T, Hv, generator=gen) * 0.3, torch.rand(T, Hv, generator=gen)
    state, slots, unused = _slot_cache(B, (Hv, K, V), state_dtype, gen)
    ref = gdn_tree_reference(tree, q, k, v, g, beta, state[slots.long()])
    pending, rows = gdn.PendingPath.empty(B + 1, tree.max_depth + 1, Hk, Hv, K, V, dtype=dtype), _pending_rows(B, gen)

    def commit(acc):
        gdn.stash_accepted_path(pending, rows, tree, acc, k, v, g, beta, kernels=kernels)
        gdn.gdn_commit_pending(state, slots, pending, kernels=kernels, pending_idx=rows)

    errs = _verify_and_commit(
        tree, torch.full((T, Hv, V), float("nan"), dtype=dtype),
        lambda out: gdn.gdn_tree_step(q, k, v, g, beta, tree, state, slots, out=out, kernels=kernels),
        commit, ref, state, slots, unused)
    assert state.dtype == state_dtype
    return errs


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", BOUNDARY)
def test_gdn_boundary_trees(kernels, name):
    e_out, e_state = _gdn_case(_tree(name), kernels, seed=len(name))
    assert e_out < TOL and e_state < TOL


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name,K,V", [("N64", 64, 96), ("N65", 64, 80), ("N129", 32, 96), ("chain64", 256, 256)])
def test_gdn_head_dims(kernels, name, K, V):
    """V a multiple of 16 but not of 64 (every column written), K = 256 (its own block sizes), GQA."""
    e_out, e_state = _gdn_case(_tree(name), kernels, Hk=1, Hv=2 if K < 256 else 1, K=K, V=V, seed=K + V)
    assert e_out < TOL and e_state < TOL


@pytest.mark.parametrize("kernels", KERNELS)
def test_gdn_bf16_state(kernels):
    """vLLM 0.33 keeps the Qwen3-Next state in the model dtype: fp32 inputs, bf16 state (computed in
    fp32, stored as bf16); the oracle starts from the same bf16 values."""
    e_out, e_state = _gdn_case(_tree("N65"), kernels, state_dtype=torch.bfloat16, seed=5)
    assert e_out < TOL and e_state < 1e-2


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", ["N64", "N129"])
def test_gdn_bf16_inputs_and_state(kernels, name):
    """bf16 inputs with a bf16 state: 64 nodes as one 64-row block with fp32 operands (``default_lowp``; a 64-row
    block with bf16 operands faulted on the H100), 129 as blocks of 32 with bf16 operands (emulated exactly in the
    interpreter)."""
    e_out, e_state = _gdn_case(_tree(name), kernels, dtype=torch.bfloat16, state_dtype=torch.bfloat16, seed=6)
    assert e_out < 2e-2 and e_state < 1e-2


@pytest.mark.parametrize("v_split,launches", [(1, 1), (3, 1), (1, 2)])
def test_gdn_step_commits_then_verifies(v_split, launches):
    """The Triton step with a pending path AND a tree, in one launch or two (the default for blocked trees):
    the ragged batch's deepest paths (up to 41 tokens: two commit chunks) committed, then a blocked tree
    verified from the committed states, V = 96 in three tiles of 32 columns, one program per tile (v_split
    3) or per (request, head) (v_split 1); against the oracle, the unused slot untouched. A v_split that
    does not divide the tiles is refused."""
    from csrc_triton.gdn_tree import gdn_step

    gen = torch.Generator().manual_seed(v_split)
    first = _tree("ragged")
    second = TreeBatch.from_parents([p for n in ("N129", "N65", "N64", "chain63", "N128") for p in _parents(n)])
    B, Hv, K, V = first.num_requests, 2, 64, 96
    r = lambda T, H, D: torch.randn(T, H, D, generator=gen)  # noqa: E731
    inputs = lambda T: (r(T, 1, K), r(T, 1, K), r(T, Hv, V), -torch.rand(T, Hv, generator=gen) * 0.3,  # noqa: E731
                        torch.rand(T, Hv, generator=gen))
    x1, x2 = inputs(first.num_nodes), inputs(second.num_nodes)
    state, slots, unused = _slot_cache(B, (Hv, K, V), torch.float32, gen)
    _, states1 = gdn_tree_reference(first, *x1, state[slots.long()])
    acc, last = deepest_accepted_paths(first)
    o_ref, _ = gdn_tree_reference(second, *x2, states1[last])
    pending, rows = gdn.PendingPath.empty(B + 1, first.max_depth + 1, 1, Hv, K, V, dtype=torch.float32), _pending_rows(B, gen)
    gdn.stash_accepted_path(pending, rows, first, acc, *x1[1:], kernels="torch")
    out = torch.full((second.num_nodes, Hv, V), float("nan"))
    gdn_step(*x2, second, state, slots, K**-0.5, True, pending, rows, out, v_split=v_split, launches=launches)
    assert torch.isfinite(out).all() and torch.isnan(state[unused]).all()
    assert rel_err(out, o_ref) < TOL and rel_err(state[slots.long()], states1[last]) < TOL
    with pytest.raises(ValueError, match="v_split=2"):
        gdn_step(*x2, second, state, slots, K**-0.5, True, None, None, out, v_split=2)


def test_gdn_refuses_unsupported_dims():
    tree = _tree("N64")
    T = tree.num_nodes
    for K, V, field in ((96, 64, "K=96"), (64, 72, "V=72"), (512, 64, "K=512")):
        q, v = torch.zeros(T, 1, K), torch.zeros(T, 1, V)
        with pytest.raises(ValueError, match=field) as e:
            gdn.gdn_tree_step(q, q, v, torch.zeros(T, 1), torch.zeros(T, 1), tree, torch.zeros(1, 1, K, V),
                                   torch.zeros(1, dtype=torch.int32), kernels="torch")
        assert "\n" not in str(e.value) and ("16, 32, 64, 128, 256" in str(e.value) or "multiple of 16" in str(e.value))


# --------------------------------------------------------------------------------------- SSD
def _ssd_case(tree, kernels, H=2, G=1, P=32, N=16, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, B = tree.num_nodes, tree.num_requests
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, dt = r(T, H, P).to(dtype), r(T, H).to(dtype)
    Bm, Cm = (r(T, G, N) * 0.3).to(dtype), (r(T, G, N) * 0.3).to(dtype)
    A = -(torch.rand(H, generator=gen) + 0.1)
    kw = dict(D=r(H), dt_bias=r(H) * 0.3, dt_limit=(0.0, 2.0))
    state, slots, unused = _slot_cache(B, (H, P, N), state_dtype, gen)
    ref = ssd_tree_reference(tree, x, dt, A, Bm, Cm, state[slots.long()], **kw)
    pending, rows = ssd_tree.PendingPath.empty(B + 1, tree.max_depth + 1, H, G, P, N, dtype=dtype), _pending_rows(B, gen)

    def commit(acc):
        ssd_tree.stash_accepted_path(pending, rows, tree, acc, x, dt, Bm, kernels=kernels)
        ssd_tree.ssd_commit_pending(state, slots, pending, A, dt_bias=kw["dt_bias"], dt_limit=kw["dt_limit"],
                                    kernels=kernels, pending_idx=rows)

    return _verify_and_commit(
        tree, torch.full((T, H, P), float("nan"), dtype=dtype),
        lambda out: ssd_tree.ssd_tree_step(x, dt, A, Bm, Cm, tree, state, slots, out=out, kernels=kernels, **kw),
        commit, ref, state, slots, unused)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", BOUNDARY)
def test_ssd_boundary_trees(kernels, name):
    e_out, e_state = _ssd_case(_tree(name), kernels, seed=len(name))
    assert e_out < TOL and e_state < TOL


SSD_DIMS = [(P, N) for P in (32, 64, 128) for N in (16, 64, 128, 256)]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("P,N", SSD_DIMS)
def test_ssd_head_dims(kernels, P, N):
    """head_dim x d_state of the shipped models, n_groups 1, 2 or 8 in turn, on a ragged two-block tree."""
    G = (2, 8, 1)[SSD_DIMS.index((P, N)) % 3]
    tree = TreeBatch.from_parents([random_tree(65, max_depth=16, generator=torch.Generator().manual_seed(P + N)), [-1]])
    e_out, e_state = _ssd_case(tree, kernels, H=8 if G == 8 else 2, G=G, P=P, N=N, seed=P * N)
    assert e_out < TOL and e_state < TOL


@pytest.mark.parametrize("kernels", KERNELS)
def test_ssd_bf16_state(kernels):
    e_out, e_state = _ssd_case(_tree("N129"), kernels, state_dtype=torch.bfloat16, seed=7)
    assert e_out < TOL and e_state < 1e-2


@pytest.mark.parametrize("name,dtype", [("N64", torch.float32), ("ragged", torch.float32), ("N129", torch.bfloat16),
                                        ("N20", torch.bfloat16)])
def test_ssd_shared_cb_tiles(name, dtype):
    """The group's C B^T tiles from ``ssd_cb_kernel`` (the default for blocked trees over more than a wave of
    programs: on CPU every blocked tree) give the outputs of each head's own products: blocked and one-block
    trees, the ragged batch (root-only requests), fp32 and bf16 operands, a group shared by four heads; both
    against the oracle."""
    from csrc_triton.ssd_tree import ssd_tree_step as launch

    one_block = [random_tree(20, generator=torch.Generator().manual_seed(3))]
    tree = _tree(name) if name != "N20" else TreeBatch.from_parents(one_block)
    gen = torch.Generator().manual_seed(len(name))
    T, B, H, G, P, N = tree.num_nodes, tree.num_requests, 8, 2, 32, 64
    x, dt = torch.randn(T, H, P, generator=gen).to(dtype), torch.randn(T, H, generator=gen).to(dtype)
    Bm, Cm = ((torch.randn(T, G, N, generator=gen) * 0.3).to(dtype) for _ in range(2))
    A, D, bias = -(torch.rand(H, generator=gen) + 0.1), torch.randn(H, generator=gen), torch.randn(H, generator=gen) * 0.3
    state, slots, unused = _slot_cache(B, (H, P, N), torch.float32, gen)
    y_ref, _ = ssd_tree_reference(tree, x, dt, A, Bm, Cm, state[slots.long()], D=D, dt_bias=bias, dt_limit=(0.0, 2.0))
    ys = [launch(x, dt, A, Bm, Cm, tree, state, slots, None, D, bias, True, (0.0, 2.0), shared_cb=shared)
          for shared in (True, False)]
    assert rel_err(ys[0], ys[1]) < 1e-6 and torch.isnan(state[unused]).all()
    assert rel_err(ys[0], y_ref) < (TOL if dtype == torch.float32 else 2e-2)


def test_ssd_refuses_unsupported_dims():
    tree = _tree("N64")
    T = tree.num_nodes
    for H, G, P, N, field in ((2, 1, 300, 16, "head_dim=300"), (2, 1, 32, 512, "d_state=512"), (4, 3, 32, 16, "n_groups=3")):
        with pytest.raises(ValueError, match=field) as e:
            ssd_tree.ssd_tree_step(torch.zeros(T, H, P), torch.zeros(T, H), -torch.ones(H), torch.zeros(T, G, N),
                                   torch.zeros(T, G, N), tree, torch.zeros(1, H, P, N), torch.zeros(1, dtype=torch.int32),
                                   kernels="torch")
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------- Mamba1
def _mamba1_case(tree, kernels, Dn=24, N=16, dtype=torch.float32, state_dtype=torch.float32, gate=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, B = tree.num_nodes, tree.num_requests
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, dt = r(T, Dn).to(dtype), r(T, Dn).to(dtype)
    Bm, Cm = (r(T, N) * 0.3).to(dtype), (r(T, N) * 0.3).to(dtype)
    A = -(torch.rand(Dn, N, generator=gen) * 2 + 0.05)
    kw = dict(D=r(Dn), dt_bias=r(Dn) * 0.3, z=r(T, Dn).to(dtype) if gate else None)
    state, slots, unused = _slot_cache(B, (Dn, N), state_dtype, gen)
    ref = mamba1_tree_reference(tree, x, dt, A, Bm, Cm, state[slots.long()], **kw)
    pending, rows = mamba1_tree.PendingPath.empty(B + 1, tree.max_depth + 1, Dn, N, dtype=dtype), _pending_rows(B, gen)

    def commit(acc):
        mamba1_tree.stash_accepted_path(pending, rows, tree, acc, x, dt, Bm, kernels=kernels)
        mamba1_tree.mamba1_commit_pending(state, slots, pending, A, dt_bias=kw["dt_bias"], kernels=kernels,
                                          pending_idx=rows)

    return _verify_and_commit(
        tree, torch.full((T, Dn), float("nan"), dtype=dtype),
        lambda out: mamba1_tree.mamba1_tree_step(x, dt, A, Bm, Cm, tree, state, slots, out=out, kernels=kernels, **kw),
        commit, ref, state, slots, unused)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", ["N65", "N256", "chain64", "ragged"])
def test_mamba1_boundary_trees(kernels, name):
    """The Mamba1 kernel walks every root-to-leaf path (leaves found in the parent vector of the
    largest tree): the largest tree, the deepest chain, a ragged batch with root-only requests."""
    e_out, e_state = _mamba1_case(_tree(name), kernels, seed=len(name))
    assert e_out < TOL and e_state < TOL


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("Dn,N", [(8, 16), (80, 16), (48, 64), (16, 256), (5, 1)])
def test_mamba1_dims(kernels, Dn, N):
    """Channel counts that are not a tile multiple, the shipped d_state 16, larger states (their own
    channel tiles), no gate; a ragged tree with a root-only request."""
    tree = TreeBatch.from_parents([random_tree(40, max_depth=12, generator=torch.Generator().manual_seed(Dn + N)), [-1]])
    e_out, e_state = _mamba1_case(tree, kernels, Dn=Dn, N=N, gate=N != 64, seed=Dn * N)
    assert e_out < TOL and e_state < TOL


@pytest.mark.parametrize("kernels", KERNELS)
def test_mamba1_bf16_inputs_and_state(kernels):
    """bf16 inputs and state (computed in fp32, stored as bf16; the oracle starts from the same bf16 values)."""
    e_out, e_state = _mamba1_case(_tree("N65"), kernels, dtype=torch.bfloat16, state_dtype=torch.bfloat16, seed=9)
    assert e_out < 1e-2 and e_state < 1e-2


def test_mamba1_step_commits_then_verifies():
    """One call: the slot's pending path is applied, written in place, and the new tree verified from
    the committed state (as the next engine step runs it), both implementations."""
    gen = torch.Generator().manual_seed(11)
    first, second = _tree("ragged"), TreeBatch.from_parents([random_tree(9, generator=gen) for _ in range(5)])
    Dn, N = 16, 16
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    A = -(torch.rand(Dn, N, generator=gen) + 0.1)
    inputs = [(r(t.num_nodes, Dn), r(t.num_nodes, Dn), r(t.num_nodes, N) * 0.3, r(t.num_nodes, N) * 0.3)
              for t in (first, second)]
    state0, slots, _ = _slot_cache(5, (Dn, N), torch.float32, gen)
    acc, last = deepest_accepted_paths(first)
    _, states = mamba1_tree_reference(first, *inputs[0][:2], A, *inputs[0][2:], state0[slots.long()])
    want, _ = mamba1_tree_reference(second, *inputs[1][:2], A, *inputs[1][2:], states[last])
    for kernels in KERNELS:
        state = state0.clone()
        pending = mamba1_tree.PendingPath.empty(6, first.max_depth + 1, Dn, N, dtype=torch.float32)
        mamba1_tree.stash_accepted_path(pending, slots, first, acc, inputs[0][0], inputs[0][1], inputs[0][2],
                                        kernels=kernels)
        y = mamba1_tree.mamba1_tree_step(*inputs[1][:2], A, *inputs[1][2:], second, state, slots, pending, kernels=kernels)
        assert rel_err(y, want) < TOL and int(pending.length[slots.long()].sum()) == 0


def test_mamba1_path_groups_equal_one_program_per_request():
    """The kernel's leaves split over G programs per request (small batches): the same outputs and
    committed states bit for bit, the pending commit first in its own launch."""
    from csrc_triton.mamba1_tree import mamba1_tree_step as launch

    gen = torch.Generator().manual_seed(12)
    first, second = _tree("ragged"), _tree("ragged")
    Dn, N = 24, 16
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    A, D, bias = -(torch.rand(Dn, N, generator=gen) + 0.1), r(Dn), r(Dn) * 0.3
    x0, dt0, B0 = r(first.num_nodes, Dn), r(first.num_nodes, Dn), r(first.num_nodes, N) * 0.3
    x, dt, Bm, Cm, z = r(second.num_nodes, Dn), r(second.num_nodes, Dn), r(second.num_nodes, N) * 0.3, \
        r(second.num_nodes, N) * 0.3, r(second.num_nodes, Dn)
    state0, slots, _ = _slot_cache(second.num_requests, (Dn, N), torch.float32, gen)
    acc, _ = deepest_accepted_paths(first)
    results = []
    for G in (1, 2, 3, 8):
        state = state0.clone()
        pending = mamba1_tree.PendingPath.empty(state.shape[0], first.max_depth + 1, Dn, N, dtype=torch.float32)
        mamba1_tree.stash_accepted_path(pending, slots, first, acc, x0, dt0, B0, kernels="torch")
        y = launch(x, dt, A, Bm, Cm, second, state, slots, pending, D, z, bias, True, path_groups=G)
        results.append((y, state))
    for y, state in results[1:]:  # (the unused slot stays poisoned: NaN in all)
        torch.testing.assert_close(y, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(state, results[0][1], rtol=0, atol=0, equal_nan=True)


def test_mamba1_auto_path_groups_follow_the_h200_sweep():
    from csrc_triton.mamba1_tree import auto_path_groups

    # (requests, channel tiles) -> the sweep's best G: Jamba shapes 128 tiles, their TP-2 shard 64
    assert [auto_path_groups(B, t) for B, t in ((1, 128), (8, 128), (1, 64), (8, 64), (32, 64), (1, 1))] == \
        [8, 1, 16, 2, 1, 16]


def test_mamba1_refuses_unsupported_dims():
    tree = _tree("N64")
    T = tree.num_nodes
    with pytest.raises(ValueError, match="d_state=512") as e:
        mamba1_tree.mamba1_tree_step(torch.zeros(T, 4), torch.zeros(T, 4), -torch.ones(4, 512), torch.zeros(T, 512),
                                     torch.zeros(T, 512), tree, torch.zeros(1, 4, 512), torch.zeros(1, dtype=torch.int32),
                                     kernels="torch")
    assert "\n" not in str(e.value)
