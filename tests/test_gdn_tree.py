"""GDN tree verification and accepted-path commit against the float64 sequential oracle.

Both implementations (torch twin; Triton kernel, through the interpreter on CPU) run on every
standard tree family, with GQA, fresh random inputs per case, and poisoned outputs/states.
fp32 tolerance: 1e-4 relative (interpreter dots are exact fp32; the torch twin solves exactly).
"""
import pytest
import torch

from vllm_bole.gdn import PendingPath, gdn_commit_pending, gdn_gating, gdn_tree_step, stash_accepted_path
from vllm_bole.gdn.reference import gdn_gating as gating_reference
from vllm_bole.testing.oracles import random_accepted_paths, gdn_tree_reference, make_tree_shape, random_tree_batch, strided, tree_shapes
from vllm_bole.testing.stats import rel_err

KERNELS = ["torch", "triton"]
Hk, Hv, K, V = 2, 4, 16, 32


def _inputs(T, gen, dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(T, Hk, K), r(T, Hk, K), r(T, Hv, V)
    g = -torch.rand(T, Hv, generator=gen, dtype=torch.float64) * 0.5  # log decay in (-0.5, 0]
    beta = torch.rand(T, Hv, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def _state_cache(num_slots, gen, layout):
    """A poisoned-free random fp32 cache; 'vk' is vLLM's [S, Hv, V, K] viewed as [S, Hv, K, V]."""
    s = torch.randn(num_slots, Hv, K, V, generator=gen)
    if layout == "vk":
        return s.transpose(-1, -2).contiguous().transpose(-1, -2)
    return s


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("shape", tree_shapes())
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_verify_matches_oracle(kernels, shape, layout):
    gen = torch.Generator().manual_seed(hash((kernels, shape, layout)) % 2**31)
    tree = make_tree_shape(shape, seed=int(torch.randint(1000, (1,), generator=gen)))
    B, T = tree.num_requests, tree.num_nodes
    q, k, v, g, beta = _inputs(T, gen)
    cache = _state_cache(B + 3, gen, layout)
    slots = torch.randperm(B + 3, generator=gen)[:B].to(torch.int32)
    before = cache.clone()
    o_ref, _ = gdn_tree_reference(tree, q, k, v, g, beta, cache[slots.long()])
    if layout == "vk":  # and inputs as non-contiguous slices, as vLLM's fused projections give them
        q, k, v, g, beta = (strided(x) for x in (q, k, v, g, beta))
    o = gdn_tree_step(q, k, v, g, beta, tree, cache, slots, kernels=kernels)
    assert o.shape == (T, Hv, V) and torch.isfinite(o).all()
    assert rel_err(o, o_ref) < 1e-4
    assert torch.equal(cache, before), "verification alone must not write the state"


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("shape,reset", [("chains_batch", True), ("deep16", True), ("ragged", False), ("random", False)])
def test_step_commits_previous_path_then_verifies(kernels, shape, reset):
    """Two steps: verify tree 1, accept a random root-to-node path per request, then one step
    commits it and verifies tree 2 (Triton: two launches); compare
    outputs and the final states with the oracle. ``reset=False`` (the engine's call: its stash
    sets the lengths next) leaves the pending lengths as they were; those cases also keep the paths in
    rows of their own (``pending_idx``) instead of at the state slots."""
    gen = torch.Generator().manual_seed(hash((kernels, shape, "step")) % 2**31)
    tree1 = make_tree_shape(shape, seed=int(torch.randint(1000, (1,), generator=gen)))
    B = tree1.num_requests
    S_total = B + 2
    cache = _state_cache(S_total, gen, "kv")
    slots = torch.randperm(S_total, generator=gen)[:B].to(torch.int32)
    untouched = [s for s in range(S_total) if s not in slots.tolist()]
    q, k, v, g, beta = _inputs(tree1.num_nodes, gen)
    rows = slots if reset else torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    pending = PendingPath.empty(S_total if reset else B + 1, 17, Hk, Hv, K, V, dtype=torch.float32)
    pending.k.fill_(float("nan"))  # rows past each path's length must never be read
    S0 = cache[slots.long()].clone()
    _, st_ref = gdn_tree_reference(tree1, q, k, v, g, beta, S0)
    gdn_tree_step(q, k, v, g, beta, tree1, cache, slots, pending, kernels=kernels, pending_idx=rows)
    accepted, last = random_accepted_paths(tree1, 17, gen)
    stash_accepted_path(pending, rows, tree1, accepted, k, v, g, beta, kernels=kernels)
    assert pending.length[rows.long()].tolist() == (accepted >= 0).sum(1).tolist()
    S1 = st_ref[last]
    # step 2 on a new tree: commit + verify in one call
    tree2 = random_tree_batch([int(torch.randint(1, 20, (1,), generator=gen)) for _ in range(B)], generator=gen)
    q2, k2, v2, g2, beta2 = _inputs(tree2.num_nodes, gen)
    before_untouched = cache[untouched].clone()
    lengths = pending.length.clone()
    o2 = gdn_tree_step(q2, k2, v2, g2, beta2, tree2, cache, slots, pending, kernels=kernels, reset_pending=reset,
                       pending_idx=rows)
    o2_ref, _ = gdn_tree_reference(tree2, q2, k2, v2, g2, beta2, S1)
    assert rel_err(cache[slots.long()], S1) < 1e-4
    assert rel_err(o2, o2_ref) < 1e-4
    assert torch.equal(cache[untouched], before_untouched), "slots of other requests must stay bit-identical"
    assert torch.equal(pending.length, lengths.index_fill(0, rows.long(), 0) if reset else lengths)


@pytest.mark.parametrize("kernels", KERNELS)
def test_commit_alone_and_zero_length_paths(kernels):
    gen = torch.Generator().manual_seed(7)
    S_total, P = 5, 8
    cache = _state_cache(S_total, gen, "vk")
    pending = PendingPath.empty(S_total, P, Hk, Hv, K, V, dtype=torch.float32)
    lengths = [0, 1, 8, 3]
    slots = torch.tensor([4, 0, 2, 1], dtype=torch.int32)
    q, k, v, g, beta = _inputs(P, gen)
    expect = cache.clone()
    for s, m in zip(slots.tolist(), lengths):
        pending.k[s, :m], pending.v[s, :m], pending.g[s, :m], pending.beta[s, :m] = k[:m], v[:m], g[:m], beta[:m]
        pending.length[s] = m
        if m:
            chain = random_tree_batch([m], kind="chain")
            _, st = gdn_tree_reference(chain, k[:m], k[:m], v[:m], g[:m], beta[:m], cache[s : s + 1])
            expect[s] = st[-1]
    before = cache.clone()
    gdn_commit_pending(cache, slots, pending, kernels=kernels)
    assert rel_err(cache, expect) < 1e-4
    assert torch.equal(cache[4], before[4]) and torch.equal(cache[3], before[3]), "length-0 / unused slots untouched"
    assert (pending.length == 0).all()


def test_torch_closed_form_is_exact_in_float64():
    """The closed form itself (not a tolerance artefact): float64 twin vs oracle at 1e-10."""
    gen = torch.Generator().manual_seed(3)
    tree = make_tree_shape("ragged", seed=5)
    q, k, v, g, beta = _inputs(tree.num_nodes, gen, torch.float64)
    cache = torch.randn(tree.num_requests, Hv, K, V, generator=gen, dtype=torch.float64)
    o = gdn_tree_step(q, k, v, g, beta, tree, cache, torch.arange(tree.num_requests), kernels="torch")
    o_ref, _ = gdn_tree_reference(tree, q, k, v, g, beta, cache)
    assert rel_err(o, o_ref) < 1e-10


@pytest.mark.parametrize("nodes,K,sixteen_bit,expected", [(32, 128, True, True), (33, 128, True, False),
                                                          (64, 128, True, False), (65, 128, True, True),
                                                          (48, 256, True, True), (48, 128, False, False)])
def test_default_operands(nodes, K, sixteen_bit, expected):
    """bf16 operands for 16-bit inputs but fp32 ones in one 64-row block for 33-64-node trees at K <= 128."""
    from csrc_triton.gdn_tree import block_rows, default_lowp
    assert default_lowp(nodes, K, sixteen_bit) is expected
    assert block_rows(nodes, K, expected)[1] is (nodes > 64 or (nodes > 32 and K > 128))


def test_bad_kernels_is_rejected():
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of"):
        gdn_tree_step(None, None, None, None, None, None, torch.zeros(1, 1, 1, 1), torch.zeros(1), kernels="cuda")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype,T,H", [(torch.float32, 7, 4), (torch.bfloat16, 33, 12), (torch.float32, 0, 4),
                                       (torch.float32, 1, 64)])
def test_gating_matches_oracle(kernels, dtype, T, H):
    """g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b): both implementations against the
    float64 oracle, a and b as strided column halves of one [T, 2H] tensor (the CPU layer's
    ``ba.chunk``), values past softplus's linear threshold included."""
    gen = torch.Generator().manual_seed(T * 100 + H)
    ba = (torch.randn(T, 2 * H, generator=gen) * 12).to(dtype)  # |a + dt_bias| beyond 20 in places
    b, a = ba.chunk(2, dim=-1)
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H, generator=gen)
    g, beta = gdn_gating(a, b, A_log, dt_bias, kernels=kernels)
    g_ref, beta_ref = gating_reference(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (T, H)
    assert rel_err(g, g_ref) < 1e-5 and rel_err(beta, beta_ref) < 1e-5
