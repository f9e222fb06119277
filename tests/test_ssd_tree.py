"""Mamba2/SSD tree verification and accepted-path commit against the float64 sequential oracle.

Both implementations (torch twin; Triton kernel, through the interpreter on CPU) run on every
standard tree family with n_groups > 1, fresh random inputs per case, and poisoned outputs,
pending rows and unused state slots. The dt options (dt_bias, softplus on/off, clamping), the D
skip and the group count rotate over the families (``VARIANTS``), so each option meets several
tree shapes with both implementations. P = 24 and N = 20 are not powers of two (masked tiles).
fp32 tolerance: 1e-4 relative (interpreter dots are exact fp32).
"""
import zlib

import pytest
import torch

from csrc_triton.ssd_tree import ssd_tree_step as triton_launch
from vllm_bole.mamba.ssd_tree import PendingPath, ssd_commit_pending, ssd_tree_step, stash_accepted_path
from vllm_bole.testing.oracles import random_accepted_paths, make_tree_shape, random_tree_batch, ssd_tree_reference, strided, tree_shapes
from vllm_bole.testing.stats import rel_err

KERNELS = ["torch", "triton"]
H, P, N = 4, 24, 20
INF = float("inf")
# name -> (groups, use D, use dt_bias, dt_softplus, dt_limit)
VARIANTS = {
    "default": (2, True, True, True, (0.0, INF)),
    "clamped_noD": (2, False, True, True, (0.15, 0.8)),
    "no_softplus": (2, True, False, False, (0.0, INF)),  # raw dt < 0 clamps to 0
    "group_per_head": (4, True, True, True, (0.05, 1.5)),
}
SHAPES = tree_shapes()


def _seed(*parts):
    """A per-case seed that does not change between runs (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode()) % 2**31


def _variant(shape):
    return list(VARIANTS)[SHAPES.index(shape) % len(VARIANTS)] if shape in SHAPES else "default"


def _inputs(T, G, gen, variant, dtype=torch.float32):
    _, use_d, use_bias, softplus, limit = VARIANTS[variant]
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, Bm, Cm = r(T, H, P), r(T, G, N) * 0.5, r(T, G, N) * 0.5
    dt = r(T, H) if softplus else r(T, H) * 0.3 + 0.2
    A = -(torch.rand(H, generator=gen, dtype=torch.float64) * 1.5 + 0.1)
    kw = dict(D=r(H) if use_d else None, dt_bias=r(H) * 0.5 if use_bias else None, dt_softplus=softplus, dt_limit=limit)
    return [t.to(dtype) for t in (x, dt, A, Bm, Cm)], kw


def _state_cache(num_slots, gen, layout):
    """A random fp32 cache [S, H, P, N]: vLLM's contiguous layout ('pn') or an N-major view ('np')."""
    s = torch.randn(num_slots, H, P, N, generator=gen)
    if layout == "np":
        return s.transpose(-1, -2).contiguous().transpose(-1, -2)
    return s


def _poisoned(*shape):
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_verify_matches_oracle(kernels, shape):
    variant = _variant(shape)
    G = VARIANTS[variant][0]
    layout = ["pn", "np"][SHAPES.index(shape) // len(VARIANTS) % 2]  # each variant meets both layouts
    gen = torch.Generator().manual_seed(_seed(kernels, shape))
    tree = make_tree_shape(shape, seed=int(torch.randint(1000, (1,), generator=gen)))
    B, T = tree.num_requests, tree.num_nodes
    (x, dt, A, Bm, Cm), kw = _inputs(T, G, gen, variant)
    cache = _state_cache(B + 3, gen, layout)
    slots = torch.randperm(B + 3, generator=gen)[:B].to(torch.int32)
    unused = [s for s in range(B + 3) if s not in slots.tolist()]
    cache[unused] = float("nan")  # never read
    before = cache.clone()
    y_ref, _ = ssd_tree_reference(tree, x, dt, A, Bm, Cm, cache[slots.long()], **kw)
    if layout == "np":  # and inputs as non-contiguous slices, as vLLM's fused projections give them
        x, dt, Bm, Cm = (strided(t) for t in (x, dt, Bm, Cm))
    out = _poisoned(T, H, P)
    y = ssd_tree_step(x, dt, A, Bm, Cm, tree, cache, slots, out=out, kernels=kernels, **kw)
    assert y.data_ptr() == out.data_ptr() and y.shape == (T, H, P) and torch.isfinite(y).all()
    assert rel_err(y, y_ref) < 1e-4, variant
    assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0)), "verification alone must not write the state"


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("shape", ["chains_batch", "deep16", "ragged", "random"])
def test_step_commits_previous_path_then_verifies(kernels, shape):
    """Two steps: verify tree 1, accept a random root-to-node path per request, then the fused
    step commits it and verifies tree 2; compare outputs and the final states with the oracle. The
    ragged and random shapes keep the paths in rows of their own (``pending_idx``), the others at the
    state slots."""
    variant = _variant(shape)
    G = VARIANTS[variant][0]
    gen = torch.Generator().manual_seed(_seed(kernels, shape, "step"))
    tree1 = make_tree_shape(shape, seed=int(torch.randint(1000, (1,), generator=gen)))
    B = tree1.num_requests
    S_total = B + 2
    cache = _state_cache(S_total, gen, "pn")
    slots = torch.randperm(S_total, generator=gen)[:B].to(torch.int32)
    untouched = [s for s in range(S_total) if s not in slots.tolist()]
    (x, dt, A, Bm, Cm), kw = _inputs(tree1.num_nodes, G, gen, variant)
    own = shape in ("ragged", "random")
    rows = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32) if own else slots
    pending = PendingPath.empty(B + 1 if own else S_total, 17, H, G, P, N, dtype=torch.float32)
    for buf in pending.fields.values():
        buf.fill_(float("nan"))  # rows past each path's length must never be read
    S0 = cache[slots.long()].clone()
    _, st_ref = ssd_tree_reference(tree1, x, dt, A, Bm, Cm, S0, **kw)
    ssd_tree_step(x, dt, A, Bm, Cm, tree1, cache, slots, pending, kernels=kernels, pending_idx=rows, **kw)
    accepted, last = random_accepted_paths(tree1, 17, gen)
    stash_accepted_path(pending, rows, tree1, accepted, x, dt, Bm, kernels=kernels)
    assert pending.length[rows.long()].tolist() == (accepted >= 0).sum(1).tolist()
    S1 = st_ref[last]
    # step 2 on a new tree (root-only requests likely among them): commit + verify in one call
    tree2 = random_tree_batch([int(torch.randint(1, 20, (1,), generator=gen)) for _ in range(B)], generator=gen)
    (x2, dt2, _, B2, C2), _ = _inputs(tree2.num_nodes, G, gen, variant)
    before_untouched = cache[untouched].clone()
    y2 = ssd_tree_step(x2, dt2, A, B2, C2, tree2, cache, slots, pending, out=_poisoned(tree2.num_nodes, H, P),
                       kernels=kernels, pending_idx=rows, **kw)
    y2_ref, _ = ssd_tree_reference(tree2, x2, dt2, A, B2, C2, S1, **kw)
    assert rel_err(cache[slots.long()], S1) < 1e-4
    assert rel_err(y2, y2_ref) < 1e-4
    assert torch.equal(cache[untouched], before_untouched), "slots of other requests must stay bit-identical"
    assert (pending.length[rows.long()] == 0).all()


@pytest.mark.parametrize("kernels", KERNELS)
def test_commit_alone_and_zero_length_paths(kernels):
    gen = torch.Generator().manual_seed(7)
    S_total, L, G = 5, 8, 2
    variant = "clamped_noD"
    cache = _state_cache(S_total, gen, "np")
    pending = PendingPath.empty(S_total, L, H, G, P, N, dtype=torch.float32)
    lengths = [0, 1, 8, 3]
    slots = torch.tensor([4, 0, 2, 1], dtype=torch.int32)
    (x, dt, A, Bm, Cm), kw = _inputs(L, G, gen, variant)
    expect = cache.clone()
    for s, m in zip(slots.tolist(), lengths):
        pending.x[s, :m], pending.dt[s, :m], pending.B[s, :m] = x[:m], dt[:m], Bm[:m]
        pending.length[s] = m
        if m:
            chain = random_tree_batch([m], kind="chain")
            _, st = ssd_tree_reference(chain, x[:m], dt[:m], A, Bm[:m], Cm[:m], cache[s : s + 1], **kw)
            expect[s] = st[-1]
    before = cache.clone()
    ssd_commit_pending(cache, slots, pending, A, dt_bias=kw["dt_bias"], dt_softplus=True, dt_limit=kw["dt_limit"], kernels=kernels)
    assert rel_err(cache, expect) < 1e-4
    assert torch.equal(cache[4], before[4]) and torch.equal(cache[3], before[3]), "length-0 / unused slots untouched"
    assert (pending.length == 0).all()


@pytest.mark.parametrize("Pw,Nw", [(40, 20), (32, 16)])
def test_triton_p_tiles(Pw, Nw):
    """The launcher's P tiling (tiles of 16: the last one masked at P = 40; the unmasked EVEN
    path at P = 32, N = 16), verification and a pending commit, against the oracle."""
    gen = torch.Generator().manual_seed(11)
    tree = make_tree_shape("ragged", seed=3)
    T, Bq = tree.num_nodes, tree.num_requests
    x = torch.randn(T, H, Pw, generator=gen)
    dt, A = torch.randn(T, H, generator=gen), -torch.rand(H, generator=gen) - 0.1
    Bm, Cm = torch.randn(T, 2, Nw, generator=gen) * 0.5, torch.randn(T, 2, Nw, generator=gen) * 0.5
    D = torch.randn(H, generator=gen)
    state = torch.randn(Bq, H, Pw, Nw, generator=gen)
    slots = torch.arange(Bq, dtype=torch.int32)
    y_ref, st_ref = ssd_tree_reference(tree, x, dt, A, Bm, Cm, state, D=D)
    y = triton_launch(x, dt, A, Bm, Cm, tree, state, slots, None, D, None, True, (0.0, INF), block_p=16)
    assert rel_err(y, y_ref) < 1e-4
    pending = PendingPath.empty(Bq, 17, H, 2, Pw, Nw, dtype=torch.float32)
    last = (tree.nodes_per_request - 1).long()
    accepted = torch.full((Bq, 17), -1, dtype=torch.int64)
    for r in range(Bq):
        path = tree.root_path(r, int(last[r]))
        accepted[r, : len(path)] = torch.tensor(path)
    stash_accepted_path(pending, slots, tree, accepted, x, dt, Bm, kernels="triton")
    triton_launch(None, None, A, None, None, None, state, slots, pending, D, None, True, (0.0, INF), block_p=16)
    assert rel_err(state, st_ref[tree.cu_nodes[:-1].long() + last]) < 1e-4


@pytest.mark.parametrize("kernels", KERNELS)
def test_bf16_inputs_step(kernels):
    """16-bit inputs (x, dt, B, C and the pending buffer in bf16, fp32 state): the kernel's
    bf16-operand path (emulated exactly under the interpreter, see csrc_triton.tiles.mm)
    with a pending commit folded in. Oracle fed the same bf16 values; y is rounded to bf16."""
    gen = torch.Generator().manual_seed(13)
    G = 2
    tree1 = make_tree_shape("ragged", seed=4)
    B = tree1.num_requests
    (x, dt, A, Bm, Cm), kw = _inputs(tree1.num_nodes, G, gen, "default", torch.bfloat16)
    A = A.float()
    cache = _state_cache(B, gen, "pn")
    slots = torch.arange(B, dtype=torch.int32).flip(0)
    pending = PendingPath.empty(B, 8, H, G, P, N, dtype=torch.bfloat16)
    _, st_ref = ssd_tree_reference(tree1, x, dt, A, Bm, Cm, cache[slots.long()], **kw)
    accepted = torch.full((B, 8), -1, dtype=torch.int64)
    for r in range(B):
        path = tree1.root_path(r, int(tree1.nodes_per_request[r]) - 1)[:8]
        accepted[r, : len(path)] = torch.tensor(path)
    stash_accepted_path(pending, slots, tree1, accepted, x, dt, Bm, kernels=kernels)
    last = torch.tensor([int(accepted[r][accepted[r] >= 0][-1]) for r in range(B)])
    S1 = st_ref[tree1.cu_nodes[:-1].long() + last]
    tree2 = random_tree_batch([24, 1, 9, 2, 30], generator=gen)
    (x2, dt2, _, B2, C2), _ = _inputs(tree2.num_nodes, G, gen, "default", torch.bfloat16)
    y2 = ssd_tree_step(x2, dt2, A, B2, C2, tree2, cache, slots, pending, kernels=kernels, **kw)
    y2_ref, _ = ssd_tree_reference(tree2, x2, dt2, A, B2, C2, S1, **kw)
    assert y2.dtype == torch.bfloat16
    assert rel_err(cache[slots.long()], S1) < 1e-5
    assert rel_err(y2, y2_ref) < 1e-2


def test_dt_options_matter():
    """The variants are not vacuous: the clamp bites on both sides, and dt_bias, softplus and D
    each change the outputs."""
    gen = torch.Generator().manual_seed(5)
    tree = make_tree_shape("random", seed=2)
    (x, dt, A, Bm, Cm), kw = _inputs(tree.num_nodes, 2, gen, "default")
    state = torch.randn(tree.num_requests, H, P, N, generator=gen)
    slots = torch.arange(tree.num_requests)
    base = ssd_tree_step(x, dt, A, Bm, Cm, tree, state, slots, kernels="torch", **kw)
    sp = torch.nn.functional.softplus(dt + kw["dt_bias"])
    lo, hi = VARIANTS["clamped_noD"][4]
    assert (sp < lo).any() and (sp > hi).any()
    for change in (dict(dt_limit=(lo, hi)), dict(dt_bias=None), dict(dt_softplus=False), dict(D=None)):
        y = ssd_tree_step(x, dt, A, Bm, Cm, tree, state, slots, kernels="torch", **{**kw, **change})
        assert rel_err(y, base) > 1e-3, change


def test_torch_closed_form_is_exact_in_float64():
    """The closed form itself (not a tolerance artefact): float64 twin vs oracle at 1e-10."""
    gen = torch.Generator().manual_seed(3)
    tree = make_tree_shape("ragged", seed=5)
    (x, dt, A, Bm, Cm), kw = _inputs(tree.num_nodes, 2, gen, "clamped_noD", torch.float64)
    cache = torch.randn(tree.num_requests, H, P, N, generator=gen, dtype=torch.float64)
    y = ssd_tree_step(x, dt, A, Bm, Cm, tree, cache, torch.arange(tree.num_requests), kernels="torch", **kw)
    y_ref, _ = ssd_tree_reference(tree, x, dt, A, Bm, Cm, cache, **kw)
    assert rel_err(y, y_ref) < 1e-10


def test_stash_checks_fields_and_length():
    tree = make_tree_shape("chain")
    pending = PendingPath.empty(2, 4, H, 2, P, N, dtype=torch.float32)
    acc = torch.arange(9)[None]
    x, dt, Bm = torch.zeros(9, H, P), torch.zeros(9, H), torch.zeros(9, 2, N)
    with pytest.raises(ValueError, match="paths of up to 9 nodes, pending buffer holds 4"):
        stash_accepted_path(pending, torch.tensor([1]), tree, acc, x, dt, Bm, kernels="torch")
    from vllm_bole import pending as pending_paths

    with pytest.raises(ValueError, match="fields"):
        pending_paths.stash_accepted_path(pending, torch.tensor([1]), tree, acc[:, :4], dict(x=x, dt=dt), kernels="torch")


def test_bad_kernels_is_rejected():
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of"):
        ssd_tree_step(None, None, None, None, None, None, torch.zeros(1, 1, 1, 1), torch.zeros(1), kernels="cuda")
