"""Lossless verification: greedy equality with plain greedy decoding, chi-square tests of every
stochastic scheme (1e5 draws, first token and first two tokens jointly), negative controls that
the chi-square test catches, sampling-parameter semantics, reproducibility, output format."""
import math

import pytest
import torch

import vllm_bole.spec_decode.sampling as sampling
import vllm_bole.spec_decode.verification as ver
from vllm_bole.spec_decode.offline import (
    DraftTree,
    StaticTree,
    build_best_first,
    build_best_first_autoregressive,
    build_sampled,
    build_static,
    verify,
)
from vllm_bole.spec_decode.sampling import target_probs
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.spec_decode.verification import (
    verify_deterministic,
    verify_greedy,
    verify_rejection,
)
from vllm_bole.testing.oracles import random_tree, random_tree_batch
from vllm_bole.testing.stats import chi2_pvalue

MOD = 2147483647


# ----------------------------------------------------------------------------------- helpers
def test_chi2_helper_against_known_values():
    # chi-square survival function: df=1, x=3.841 -> 0.05 ; df=10, x=23.209 -> 0.01
    for df, x, p in [(1, 3.841458820694124, 0.05), (10, 23.209251158954356, 0.01)]:
        got = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2)))
        assert got == pytest.approx(p, rel=1e-6)


def _ext(h, tok):
    return (h * 1000003 + tok + 1) % MOD


class HashTarget:
    """A fixed random 'target model': logits = table[hash(whole token sequence)]."""

    def __init__(self, V, seed=0, scale=2.0, P=10007):
        g = torch.Generator().manual_seed(seed)
        self.V, self.P = V, P
        self.table = torch.randn(P, V, generator=g, dtype=torch.float64).float() * scale

    @staticmethod
    def seq_hash(seq):
        h = 0
        for t in seq:
            h = _ext(h, int(t))
        return h

    def seq_logits(self, seq):
        return self.table[self.seq_hash(seq) % self.P]

    def tree_logits(self, tree: TreeBatch, prefix_hash: torch.Tensor) -> torch.Tensor:
        """Row i = logits after (context before the root) + path root..i."""
        path = tree.path_flat
        tok = tree.token_ids
        h = prefix_hash.long()[tree.request_index]
        for k in range(path.shape[1]):
            col = path[:, k]
            h = torch.where(col >= 0, _ext(h, tok[col.clamp(min=0)]), h)
        return self.table[h % self.P]

    def greedy(self, seq, n):
        seq = list(seq)
        out = []
        for _ in range(n):
            t = int(self.seq_logits(seq + out).argmax())
            out.append(t)
        return out


def ref_probs(logits_row, temperature, top_k, top_p):
    """Independent per-row reference of vLLM's sampling semantics (float64)."""
    x = logits_row.double()
    V = x.numel()
    if temperature < ver.SAMPLING_EPS:
        p = torch.zeros(V, dtype=torch.float64)
        p[int(logits_row.argmax())] = 1
        return p
    x = x / temperature
    keep = torch.ones(V, dtype=torch.bool)
    if top_k is not None and 0 < top_k < V:
        kth = torch.sort(x, descending=True).values[top_k - 1]
        keep &= x >= kth
    if top_p is not None:
        pk = torch.where(keep, x, torch.tensor(-math.inf, dtype=torch.float64)).softmax(0)
        order = torch.argsort(pk)  # ascending
        cum = 0.0
        for j, t in enumerate(order.tolist()):
            cum += float(pk[t])
            if cum <= 1 - top_p and j < V - 1:
                keep[t] = False
    return torch.where(keep, x, torch.tensor(-math.inf, dtype=torch.float64)).softmax(0)


def tree_walk_reference(dt: DraftTree, r: int, continuation):
    """Longest tree path (first matching sibling at each level) that is a prefix of
    ``continuation``: the number of accepted draft tokens greedy decoding must give."""
    s, e = int(dt.tree.cu_nodes[r]), int(dt.tree.cu_nodes[r + 1])
    par = dt.tree.parent[s:e].tolist()
    tok = dt.tree.token_ids[s:e].tolist()
    node, m = 0, 0
    while True:
        nxt = [i for i in range(e - s) if par[i] == node and tok[i] == continuation[m]]
        if not nxt:
            return m
        node, m = nxt[0], m + 1


def check_format(res, tree: TreeBatch):
    B, W = res.output_token_ids.shape
    assert W == tree.max_depth + 1 and res.accepted_nodes.shape == (B, W)
    for r in range(B):
        n = int(res.num_emitted[r])
        assert 1 <= n <= W
        assert (res.output_token_ids[r, n:] == -1).all() and (res.output_token_ids[r, :n] >= 0).all()
        acc = res.accepted_nodes[r].tolist()
        assert acc[0] == 0 and all(a == -1 for a in acc[n:])
        s = int(tree.cu_nodes[r])
        for j in range(1, n):
            assert int(tree.parent[s + acc[j]]) == acc[j - 1]
            assert int(tree.token_ids[s + acc[j]]) == int(res.output_token_ids[r, j - 1])
        assert int(res.last_node[r]) == s + acc[n - 1]


def noisy_drafter(target: HashTarget, prefix_hash: torch.Tensor, noise: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    extra = torch.randn(target.P, target.V, generator=g) * noise

    def step(fr):
        h = prefix_hash[fr.request].long()
        for k in range(fr.path_tokens.shape[1]):
            h = _ext(h, fr.path_tokens[:, k])
        return (target.table[h % target.P] + extra[h % target.P]).softmax(-1)

    return step


# ------------------------------------------------------------------------------ sampling params
def test_target_probs_matches_vllm_semantics():
    g = torch.Generator().manual_seed(0)
    N, V = 60, 11
    logits = torch.randn(N, V, generator=g) * 2
    logits[5, 3] = logits[5, 7] = logits[5].max() + 1  # a tie at the top
    logits[6, :4] = 0.5  # ties at the top-k threshold
    logits[6, 4:] = -1.0
    temp = torch.rand(N, generator=g) * 1.5 + 0.2
    temp[::7] = 0.0
    top_k = torch.randint(-1, V + 3, (N,), generator=g)
    top_k[6] = 2
    top_p = torch.rand(N, generator=g) * 0.9 + 0.1
    top_p[::5] = 1.0
    got = target_probs(logits, temp, top_k, top_p)
    for i in range(N):
        ref = ref_probs(logits[i], float(temp[i]), int(top_k[i]), float(top_p[i]))
        assert torch.allclose(got[i].double(), ref, atol=1e-6), i
    assert (got[6, :4] > 0).all() and (got[6, 4:] == 0).all()  # every tied token at the threshold kept
    # no top-k / top-p given: plain tempered softmax
    assert torch.allclose(target_probs(logits, 0.7), (logits / 0.7).softmax(-1))


def test_target_probs_min_p_before_top_k_top_p():
    """min-p on the tempered distribution, then top-k / top-p on what it kept (vLLM's order)."""
    g = torch.Generator().manual_seed(1)
    N, V = 40, 13
    logits = torch.randn(N, V, generator=g) * 2
    temp = torch.rand(N, generator=g) + 0.3
    min_p = torch.rand(N, generator=g) * 0.5
    min_p[::4] = 0.0
    top_k = torch.randint(0, V, (N,), generator=g)
    top_p = torch.rand(N, generator=g) * 0.8 + 0.2
    got = target_probs(logits, temp, top_k, top_p, min_p)
    for i in range(N):
        p = (logits[i].double() / float(temp[i])).softmax(-1)
        kept = torch.where(p >= float(min_p[i]) * p.max(), logits[i].double(), -float("inf"))
        ref = ref_probs(kept, float(temp[i]), int(top_k[i]), float(top_p[i]))
        assert torch.allclose(got[i].double(), ref, atol=1e-6), i
    assert (got[1:][min_p[1:] > 0.3].count_nonzero(-1) < V).all()  # min-p removed tokens


# ------------------------------------------------------------------------------------ greedy
def _greedy_case(builder, seed, B=6, V=16, D=4):
    target = HashTarget(V, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    ctx = [torch.randint(0, V, (5,), generator=g).tolist() for _ in range(B)]
    roots = torch.tensor([c[-1] for c in ctx])
    prefix = torch.tensor([HashTarget.seq_hash(c[:-1]) for c in ctx])
    cont = [target.greedy(c, D + 1) for c in ctx]
    dt = builder(target, roots, prefix, cont, g)
    logits = target.tree_logits(dt.tree, prefix)
    res = verify_greedy(dt.tree, logits)
    check_format(res, dt.tree)
    for r in range(B):
        n = int(res.num_emitted[r])
        assert res.tokens(r) == cont[r][:n]
        assert n - 1 == tree_walk_reference(dt, r, cont[r])
    return dt, res, cont


def _oracle_marginals(cont, V, D, p_right=0.9):
    B = len(cont)
    m = torch.full((B, D, V), (1 - p_right) / (V - 1))
    for b in range(B):
        for k in range(D):
            m[b, k, cont[b][k]] = p_right
    return m


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_plain_greedy_random_drafters(seed):
    V, D = 16, 4

    def best_first(target, roots, prefix, cont, g):
        m = (torch.randn(len(roots), D, V, generator=g) * 2).softmax(-1)
        return build_best_first(roots, m, 12)

    def static(target, roots, prefix, cont, g):
        m = (torch.randn(len(roots), D, V, generator=g) * 2).softmax(-1)
        return build_static(StaticTree.full([3, 2, 1, 1]), roots, marginals=m)

    def sampled(target, roots, prefix, cont, g):
        m = (torch.randn(len(roots), D, V, generator=g)).softmax(-1)
        return build_sampled(StaticTree.full([4, 2, 1]), roots, marginals=m, replacement=True, generator=g)

    def autoregressive(target, roots, prefix, cont, g):
        return build_best_first_autoregressive(roots, noisy_drafter(target, prefix, 2.0, seed), 10, max_depth=D)

    for builder in (best_first, static, sampled, autoregressive):
        _greedy_case(builder, seed)


def test_greedy_oracle_drafter_accepts_everything_and_garbage_nothing():
    V, D = 16, 4

    def oracle(target, roots, prefix, cont, g):
        return build_best_first(roots, _oracle_marginals(cont, V, D), 8)

    _, res, _ = _greedy_case(oracle, 7)
    assert (res.num_emitted == D + 1).all()

    def oracle_chain(target, roots, prefix, cont, g):
        return build_static(StaticTree.chain(D), roots, marginals=_oracle_marginals(cont, V, D, 0.3))

    _, res, _ = _greedy_case(oracle_chain, 8)
    assert (res.num_emitted == D + 1).all()

    def garbage(target, roots, prefix, cont, g):
        m = _oracle_marginals(cont, V, D, 0.0)  # zero mass on the right tokens
        return build_best_first(roots, m, 12)

    _, res, _ = _greedy_case(garbage, 9)
    assert (res.num_emitted == 1).all()

    def half(target, roots, prefix, cont, g):  # right for two levels, then wrong
        m = _oracle_marginals(cont, V, D, 0.9)
        m[:, 2:] = _oracle_marginals(cont, V, D, 0.0)[:, 2:]
        return build_best_first(roots, m, 6)

    _, res, _ = _greedy_case(half, 10)
    assert (res.num_emitted == 3).all()


def test_greedy_decoding_loop_equals_autoregressive_greedy():
    V, D, B, steps = 12, 3, 4, 12
    target = HashTarget(V, seed=21)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, V, (3,), generator=g).tolist() for _ in range(B)]
    want = [s + target.greedy(s, 40) for s in seqs]
    for step in range(steps):
        roots = torch.tensor([s[-1] for s in seqs])
        prefix = torch.tensor([HashTarget.seq_hash(s[:-1]) for s in seqs])
        kind = step % 4
        if kind == 0:  # partially right one-pass drafter
            cont = [target.greedy(s, D) for s in seqs]
            m = 0.5 * _oracle_marginals(cont, V, D, 0.6) + 0.5 * torch.rand(B, D, V, generator=g).softmax(-1)
            dt = build_best_first(roots, m, 7)
        elif kind == 1:
            dt = build_best_first_autoregressive(roots, noisy_drafter(target, prefix, 1.0, step), 6, max_depth=D,
                                                 top_k=2, beam=2)
        elif kind == 2:
            dt = build_sampled(StaticTree.full([2, 2]), roots, marginals=torch.rand(B, 2, V, generator=g).softmax(-1),
                               replacement=False, generator=g)
        else:
            dt = build_static(StaticTree.chain(D), roots, step_fn=noisy_drafter(target, prefix, 0.5, step))
        logits = target.tree_logits(dt.tree, prefix)
        res = verify(dt, logits)  # greedy
        for r in range(B):
            seqs[r] = seqs[r] + res.tokens(r)
    for r in range(B):
        assert seqs[r] == want[r][: len(seqs[r])]
        assert len(seqs[r]) > 3 + steps  # some drafts were accepted


def test_stochastic_modes_at_temperature_zero_equal_greedy():
    V = 10
    target = HashTarget(V, seed=3, scale=1.0)
    g = torch.Generator().manual_seed(0)
    B = 32
    roots = torch.randint(0, V, (B,), generator=g)
    prefix = torch.randint(0, 1000, (B,), generator=g)
    m = torch.rand(B, 3, V, generator=g).softmax(-1)
    for dt in (
        build_best_first(roots, m, 9),
        build_sampled(StaticTree.full([3, 2, 1]), roots, marginals=m, replacement=True, generator=g),
        build_sampled(StaticTree.full([3, 2, 1]), roots, marginals=m, replacement=False, generator=g),
    ):
        logits = target.tree_logits(dt.tree, prefix)
        ref = verify_greedy(dt.tree, logits)
        outs = [verify_deterministic(dt.tree, logits, temperature=0.0, top_k=3, top_p=0.5, generator=1)]
        if dt.children != "deterministic":
            outs.append(verify(dt, logits, temperature=torch.zeros(B), generator=2))
        for res in outs:
            check_format(res, dt.tree)
            assert torch.equal(res.output_token_ids, ref.output_token_ids)
            assert torch.equal(res.accepted_nodes, ref.accepted_nodes)
            assert torch.equal(res.last_node, ref.last_node)
        # mixed batch: greedy requests stay greedy next to sampled ones
        temp = torch.where(torch.arange(B) % 2 == 0, 0.0, 1.0)
        res = verify(dt, logits, temperature=temp, top_p=0.9, generator=5)
        check_format(res, dt.tree)
        even = torch.arange(0, B, 2)
        assert torch.equal(res.output_token_ids[even], ref.output_token_ids[even])


def _walk_oracle(tree, logits, temp, top_k, top_p, seeds):
    """verify_deterministic's definition, one request and one level at a time: at the current node sample
    ``x ~ p`` with the node's own uniform (``_node_uniforms``' second column), descend into the first child
    carrying ``x``, else emit ``x`` and stop."""
    u = ver._node_uniforms(tree, seeds, 2, logits.device)[:, 1]
    cu, par, tok = tree.cu_nodes.tolist(), tree.parent_flat.tolist(), tree.token_ids.tolist()
    out = []
    for r in range(tree.num_requests):
        cur, emitted = cu[r], []
        while True:
            p = target_probs(logits[cur : cur + 1], temp[r : r + 1], *(None if x is None else x[r : r + 1]
                                                                      for x in (top_k, top_p)))
            x = int(sampling.sample_rows(p, u[cur : cur + 1])[0])
            emitted.append(x)
            kids = [i for i in range(cu[r], cu[r + 1]) if par[i] == cur and tok[i] == x]
            if not kids:
                break
            cur = kids[0]
        out.append((emitted, cur))
    return out


@pytest.mark.parametrize("chunk_rows, kernels, filtered", [(None, "torch", True), (3, "torch", True),
                                                           (None, "triton", True), (3, "torch", False),
                                                           (None, "triton", False)])
def test_deterministic_verification_equals_the_level_walk(monkeypatch, chunk_rows, kernels, filtered):
    """Every node's sample drawn up front, then greedy's walk over the samples (no level loop): the same
    tokens, accepted nodes and last node as the walk level by level, on ragged random trees (root-only
    requests, a 64-deep chain, repeated sibling tokens) with per-request temperatures (greedy among them),
    top-k, top-p and seeds; the distributions built 3 rows at a time or all at once; the walk by the torch
    twin or the Triton kernel (greedy's); without top-k / top-p the samples from ``sample_logits`` (one Triton
    launch, or its twin in chunks). Accepted paths reach depth 20+."""
    V = 6
    if chunk_rows:
        monkeypatch.setattr(sampling, "SAMPLE_ROW_ELEMENTS", chunk_rows * V)
    g = torch.Generator().manual_seed(4)
    kinds = [(1, "chain"), (30, "random"), (65, "chain"), (1, "chain"), (12, "star"), (40, "wide")]
    parents = [random_tree(n, kind=k, generator=g) for n, k in kinds]
    tokens = [torch.randint(V, (len(par),), generator=g).tolist() for par in parents]
    tokens[4][2] = tokens[4][1]  # repeated sibling tokens (star): the first such child is the one taken
    tree = TreeBatch.from_parents(parents, tokens)
    logits = 2.5 * torch.randn(tree.num_nodes, V, generator=g)
    flat_par, flat_tok = tree.parent_flat.tolist(), tree.token_ids.tolist()
    for i in range(tree.num_nodes - 1, 0, -1):  # the target mostly agrees with a child: paths run deep
        logits[flat_par[i], flat_tok[i]] += 12.0
    B = tree.num_requests
    temp = torch.tensor([1.0, 0.0, 0.7, 1.5, 1.0, 0.3])
    top_k = torch.tensor([0, 0, 3, 0, 2, 0]) if filtered else None
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 1.0]) if filtered else None
    deepest = 0
    for seed in range(4):
        seeds = [100 * seed + r for r in range(B)]
        res = verify_deterministic(tree, logits, temperature=temp, top_k=top_k, top_p=top_p, generator=seeds,
                                   kernels=kernels)
        check_format(res, tree)
        want = _walk_oracle(tree, logits, temp, top_k, top_p, seeds)
        for r, (emitted, last) in enumerate(want):
            n = int(res.num_emitted[r])
            assert res.output_token_ids[r, :n].tolist() == emitted and int(res.last_node[r]) == last
        deepest = max(deepest, int(res.num_emitted.max()))
    assert deepest > 20


def test_root_only_trees():
    tree = TreeBatch.from_parents([[-1], [-1]], [[3], [4]])
    logits = torch.randn(2, 7)
    res = verify_greedy(tree, logits)
    assert res.num_emitted.tolist() == [1, 1]
    assert res.output_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    res = verify_deterministic(tree, logits, temperature=1.0, generator=0)
    assert res.num_emitted.tolist() == [1, 1]


# ---------------------------------------------------------------------------- chi-square tests
N_DRAWS = 100_000
V_SMALL = 6
CTX = [3, 1]  # context; the root is its last token
PARAMS = dict(temperature=0.9, top_k=5, top_p=0.97)


def _small_target():
    return HashTarget(V_SMALL, seed=5, scale=1.2, P=101)


def _drafter_marginals(B, D=2):
    # the drafter prefers tokens the target does not: residuals matter
    # (target at the root ~ [.66, .05, .05, .20, .04, 0]; after token 0 ~ [0, 0, .57, 0, .33, .10])
    q = torch.tensor([[0.35, 0.10, 0.05, 0.35, 0.05, 0.10], [0.15, 0.05, 0.35, 0.05, 0.30, 0.10]])
    return q[:D][None].expand(B, D, V_SMALL)


def _run_two_tokens(build, method, n=N_DRAWS, seed=0, params=PARAMS, per_request_params=True):
    """Decode two tokens for ``n`` identical requests (a second speculative step for those that
    emitted one token); returns (first tokens, second tokens)."""
    target = _small_target()
    g = torch.Generator().manual_seed(seed)

    def sp(B):
        if not per_request_params:
            return params
        return {k: torch.full((B,), v, dtype=torch.float32 if isinstance(v, float) else torch.long)
                for k, v in params.items()}

    roots = torch.full((n,), CTX[-1])
    prefix = torch.full((n,), HashTarget.seq_hash(CTX[:-1]))
    dt = build(roots, g)
    res = verify(dt, target.tree_logits(dt.tree, prefix), method=method, generator=seed + 1, **sp(n))
    x1 = res.output_token_ids[:, 0]
    x2 = torch.where(res.num_emitted >= 2, res.output_token_ids[:, 1], torch.full_like(x1, -1))
    need = (res.num_emitted == 1).nonzero().flatten()
    if need.numel():
        k = need.numel()
        dt2 = build(x1[need], g)
        prefix2 = torch.full((k,), HashTarget.seq_hash(CTX))
        res2 = verify(dt2, target.tree_logits(dt2.tree, prefix2), method=method, generator=seed + 2, **sp(k))
        x2[need] = res2.output_token_ids[:, 0]
    return x1, x2, res


def _expected(params=PARAMS):
    target = _small_target()
    t, k, p = params["temperature"], params.get("top_k"), params.get("top_p")
    p1 = ref_probs(target.seq_logits(CTX), t, k, p)
    joint = torch.stack([p1[a] * ref_probs(target.seq_logits(CTX + [a]), t, k, p) for a in range(V_SMALL)])
    return p1, joint


def _pvalues(x1, x2, params=PARAMS):
    p1, joint = _expected(params)
    c1 = torch.bincount(x1, minlength=V_SMALL)
    c12 = torch.bincount(x1 * V_SMALL + x2, minlength=V_SMALL * V_SMALL)
    return chi2_pvalue(c1, p1), chi2_pvalue(c12, joint)


def _build_static_topk(roots, g):
    return build_static(StaticTree.full([2, 2]), roots, marginals=_drafter_marginals(roots.numel()))


def _build_with(roots, g):
    return build_sampled(StaticTree.full([3, 2]), roots, marginals=_drafter_marginals(roots.numel()), replacement=True,
                         generator=g)


def _build_without(roots, g):
    return build_sampled(StaticTree.full([3, 2]), roots, marginals=_drafter_marginals(roots.numel()), replacement=False,
                         generator=g)


def test_expected_distribution_is_nontrivial():
    p1, joint = _expected()
    assert (p1 == 0).sum() >= 1 and (joint == 0).sum() >= 6  # top-k/top-p remove something
    assert (p1 > 0.04).sum() >= 4
    assert joint.sum().item() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize(
    "build,method",
    [(_build_static_topk, "deterministic"), (_build_with, "specinfer"), (_build_without, "sequoia")],
    ids=["deterministic", "specinfer", "sequoia"],
)
def test_chi_square_first_and_joint_tokens(build, method):
    x1, x2, res = _run_two_tokens(build, method)
    pv1, pv12 = _pvalues(x1, x2)
    assert pv1 > 1e-4 and pv12 > 1e-4, (pv1, pv12)
    # the trees were actually used: many drafts accepted, and deeper than one level sometimes
    assert (res.num_emitted >= 2).float().mean() > 0.3
    assert (res.num_emitted == 3).any()


def test_chi_square_plain_temperature_rejection():
    params = dict(temperature=1.0)
    x1, x2, _ = _run_two_tokens(_build_without, "sequoia", seed=3, params=params, per_request_params=False)
    assert min(_pvalues(x1, x2, params)) > 1e-4


# --------------------------------------------------------------------------- negative controls
def test_chi_square_catches_a_sampler_that_ignores_the_residual(monkeypatch):
    monkeypatch.setattr(ver, "_residual", lambda p, q: p)
    x1, x2, _ = _run_two_tokens(_build_with, "specinfer", n=N_DRAWS // 5)
    assert min(_pvalues(x1, x2)) < 1e-6


def test_chi_square_catches_the_wrong_draft_distribution_without_replacement():
    # children drawn without replacement but verified as if i.i.d. (q instead of q minus the
    # rejected draws). With q on two tokens the second child is forced: its true q_2 is one-hot.
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0], [0.15, 0.05, 0.35, 0.05, 0.30, 0.10]])

    def build(roots, g):
        return build_sampled(StaticTree.full([2, 1]), roots, marginals=q[None].expand(roots.numel(), 2, V_SMALL),
                             replacement=False, generator=g)

    x1, x2, _ = _run_two_tokens(build, "sequoia", n=N_DRAWS // 5)
    assert min(_pvalues(x1, x2)) > 1e-4  # the right rule passes on this drafter
    x1, x2, _ = _run_two_tokens(build, "specinfer", n=N_DRAWS // 5)
    assert min(_pvalues(x1, x2)) < 1e-6


def test_chi_square_catches_rejection_sampling_of_deterministic_children():
    # top-k children are not draws from q: rejection sampling over them is lossy
    def build(roots, g):
        dt = _build_static_topk(roots, g)
        return DraftTree(dt.tree, dt.draft_probs, dt.scores, "with_replacement", dt.child_dist_table,
                         dt.child_dist_index)

    x1, x2, _ = _run_two_tokens(build, "specinfer", n=N_DRAWS // 5)
    assert min(_pvalues(x1, x2)) < 1e-6


def test_chi_square_catches_ignored_top_k_top_p(monkeypatch):
    monkeypatch.setattr(sampling, "apply_top_k_top_p", lambda logits, k, p: logits)
    x1, x2, _ = _run_two_tokens(_build_static_topk, "deterministic", n=N_DRAWS // 5)
    assert min(_pvalues(x1, x2)) < 1e-6


# --------------------------------------------------------------------------------- randomness
def _fixed_sampled_batch():
    parents = [[-1, 0, 0, 1], [-1, 0, 0, 0, 1, 2], [-1, 0]]
    tokens = [[0, 1, 2, 3], [1, 0, 2, 3, 4, 5], [2, 4]]
    tree = TreeBatch.from_parents(parents, tokens)
    g = torch.Generator().manual_seed(0)
    V = 6
    table = torch.rand(tree.num_nodes, V, generator=g).softmax(-1)
    dt = DraftTree(tree, torch.ones(tree.num_nodes), torch.ones(tree.num_nodes, dtype=torch.float64),
                   "with_replacement", table, torch.arange(tree.num_nodes))
    logits = torch.randn(tree.num_nodes, V, generator=g)
    return parents, tokens, dt, logits


def test_seeded_verification_is_reproducible():
    _, _, dt, logits = _fixed_sampled_batch()
    for method in ("deterministic", "specinfer", "sequoia"):
        a = verify(dt, logits, method=method, temperature=1.0, generator=123)
        b = verify(dt, logits, method=method, temperature=1.0, generator=torch.Generator().manual_seed(123))
        assert torch.equal(a.output_token_ids, b.output_token_ids)
    outs = {tuple(verify(dt, logits, method="specinfer", temperature=1.0, generator=s).output_token_ids.flatten()
                  .tolist()) for s in range(20)}
    assert len(outs) > 1  # the seed matters


def test_per_request_generators_do_not_depend_on_the_batch():
    parents, tokens, dt, logits = _fixed_sampled_batch()
    # request 1 alone, with its own generator, gives the same result as inside the batch
    s, e = int(dt.tree.cu_nodes[1]), int(dt.tree.cu_nodes[2])
    solo_tree = TreeBatch.from_parents([parents[1]], [tokens[1]])
    solo = DraftTree(solo_tree, torch.ones(e - s), torch.ones(e - s, dtype=torch.float64), "with_replacement",
                     dt.child_dist_table[s:e], torch.arange(e - s))
    for method in ("deterministic", "specinfer"):
        for seed in range(10):
            full = verify(dt, logits, method=method, temperature=1.0, top_p=0.9, generator=[None, seed, 7])
            one = verify(solo, logits[s:e], method=method, temperature=1.0, top_p=0.9, generator=[seed])
            n = int(one.num_emitted[0])
            assert full.tokens(1) == one.tokens(0) and int(full.num_emitted[1]) == n


def test_argument_errors():
    _, _, dt, logits = _fixed_sampled_batch()
    with pytest.raises(ValueError):
        verify_greedy(dt.tree, logits[:-1])
    with pytest.raises(ValueError):
        verify(dt.tree, logits, method="specinfer", temperature=1.0)
    with pytest.raises(ValueError):
        verify(dt, logits, method="sequoia")  # needs a temperature
    with pytest.raises(ValueError):
        verify_rejection(dt.tree, logits, dt.child_dist_table, torch.full((dt.tree.num_nodes,), -1),
                         replacement=True, temperature=1.0)
    with pytest.raises(ValueError):
        verify(dt, logits, temperature=torch.ones(5))


# ------------------------------------------------------------------------- the runtime tree path
def test_runtime_path_draft_select_verify_equals_the_list_path():
    """The runner's step with one tree object: propose -> best_first_tree -> draft_token_ids (to the
    scheduler, which may cut drafts) -> select (reordered rows, truncation, a placeholder) ->
    verify_greedy; the same as rebuilding the trees from Python lists, and plain greedy decoding."""
    from vllm_bole.spec_decode import best_first_tree
    from vllm_bole.spec_decode.ngram import NgramDrafter

    V, B, D = 5, 6, 4
    target = HashTarget(V, seed=11)
    g = torch.Generator().manual_seed(2)
    hists = [torch.randint(0, V, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
             for _ in range(B)]
    drafter = NgramDrafter(1, 3, top_k=3)
    roots = [h[-1] for h in hists]
    tree = best_first_tree(roots, drafter.propose(hists, [D] * B), 9, max_depth=D)
    drafts = tree.draft_token_ids()
    assert any(drafts)
    rows = [3, 1, 0, -1, 5, 2, 4]  # the scheduler's order; -1: drafts no tree stands for
    keep = [min(len(drafts[r]), 1 + i % 4) if r >= 0 else 2 for i, r in enumerate(rows)]
    sel = tree.select(rows, [k + 1 for k in keep], root_tokens=[roots[r] if r >= 0 else 0 for r in rows])
    par, tok = [], []
    for r, k in zip(rows, keep):
        if r >= 0:
            p, t = tree.request(r)
            par.append(p[: k + 1])
            tok.append(t[: k + 1])
        else:
            par.append([-1] + [0] * k)
            tok.append([0] + [-1] * k)
    ref = TreeBatch.from_parents(par, tok)
    for f in ("token_ids", "parent", "depth", "cu_nodes", "path", "anc_mask"):
        assert torch.equal(getattr(sel, f), getattr(ref, f)), f
    prefix = torch.tensor([HashTarget.seq_hash(hists[r][:-1]) if r >= 0 else 0 for r in rows])
    logits = target.tree_logits(sel, prefix)
    res, want = verify_greedy(sel, logits), verify_greedy(ref, logits)
    assert torch.equal(res.output_token_ids, want.output_token_ids) and torch.equal(res.last_node, want.last_node)
    for i, r in enumerate(rows):
        if r >= 0:
            assert res.tokens(i) == target.greedy(hists[r], int(res.num_emitted[i]))
    assert int(res.num_accepted[3]) == 0  # a placeholder is never accepted


# ------------------------------------------------------------------ greedy walk kernel (Triton)
def _choices_down_the_tree(tree: TreeBatch, vocab: int, g: torch.Generator, follow=0.85) -> torch.Tensor:
    """Per node: with probability ``follow`` the token of a random child (deep accepted paths), else random."""
    choice = torch.randint(0, vocab, (tree.num_nodes,), generator=g)
    pf = tree.parent_flat.tolist()
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(pf):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    for p, ks in kids.items():
        if float(torch.rand((), generator=g)) < follow:
            choice[p] = tree.token_ids[ks[int(torch.randint(0, len(ks), (), generator=g))]]
    return choice


def test_greedy_walk_kernel_equals_twin_over_the_envelope():
    """One Triton launch (interpreter) against the vectorised torch twin: 256-node trees, 64-deep
    chains, stars, ragged batches with root-only requests, and siblings sharing a token (the FIRST
    matching child is taken)."""
    from csrc_triton.greedy_walk import greedy_walk

    g = torch.Generator().manual_seed(0)
    trees = [random_tree_batch(sizes, kind=kind, generator=g, token_vocab=300)
             for sizes, kind in [([256], "random"), ([65], "chain"), ([256], "star"), ([1, 1, 1], "random"),
                                 ([40, 1, 200, 65], ["deep", "random", "wide", "chain"])]]
    dup = random_tree_batch([60, 30, 1], kind="wide", generator=g)
    trees.append(TreeBatch.from_parents([dup.request(r)[0] for r in range(3)],
                                        [torch.randint(0, 3, (n,), generator=g).tolist() for n in (60, 30, 1)]))
    for tree in trees:
        for follow in (0.85, 1.0, 0.0):  # 1.0: every path accepted to its leaf (the 64-deep chain whole)
            choice = _choices_down_the_tree(tree, 300, g, follow)
            want = ver._descend_by_choice(tree, choice)
            got = ver.VerificationResult(*greedy_walk(tree, choice))
            for f in ("output_token_ids", "num_emitted", "accepted_nodes", "last_node"):
                assert torch.equal(getattr(got, f), getattr(want, f)), f
    logits = torch.randn(trees[-1].num_nodes, 7, generator=g)
    a, b = verify_greedy(trees[-1], logits, kernels="triton"), verify_greedy(trees[-1], logits, kernels="torch")
    assert torch.equal(a.output_token_ids, b.output_token_ids) and torch.equal(a.accepted_nodes, b.accepted_nodes)
