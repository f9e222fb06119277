"""The paged in-engine draft model (``spec_decode/paged_draft.py``) against the transformers drafter
(its reference): the same candidates over several steps of growing histories (accepted chain prefixes
and bonus tokens), catch-ups longer than one chunk, a pool small enough to evict, temporary keys;
the chain mask against the tree data model; the page pool's bookkeeping; refusal of recurrent drafts."""
import numpy as np
import pytest
import torch

from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.draft_model import HFDraftModel
from vllm_bole.spec_decode.paged_draft import CHUNK, PagedDraftModel, PagePool, chain_mask
from vllm_bole.spec_decode.step import draft_trees
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.testing.tiny_models import build_tiny_model

TOL = 1e-5  # fp32: the two attention paths differ by rounding only


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    return {a: build_tiny_model(a, root) for a in ("llama", "mamba2")}


def assert_same_candidates(got, want, depths):
    """Equal tokens and probabilities per depth; where an exact tie (within TOL) swaps two candidates,
    the chains may part there and nothing deeper is compared."""
    for b, d in enumerate(depths):
        for k in range(d):
            gt, wt = got.tokens[b, k], want.tokens[b, k]
            assert torch.allclose(got.probs[b, k], want.probs[b, k], atol=TOL), (b, k)
            if not torch.equal(gt, wt):
                ties = (want.probs[b, k][:-1] - want.probs[b, k][1:]).abs() < TOL
                assert ties.any(), (b, k, gt, wt)
                break
        assert (got.tokens[b, d:] == -1).all() and (got.probs[b, d:] == 0).all()


def test_chain_mask_is_the_chain_trees():
    sizes = [1, 5, 33, 64, 2]
    tree = TreeBatch.from_parents([[-1] + list(range(n - 1)) for n in sizes])
    m = chain_mask(sizes, "cpu")
    assert torch.equal(m.cu_nodes, tree.cu_nodes) and torch.equal(m.anc_mask, tree.anc_mask) and m.max_nodes == 64
    long = chain_mask([CHUNK], "cpu").anc_mask  # beyond the tree model's depth limit: bits 0..j of node j
    bits = ((long[:, :, None].long() >> torch.arange(32)) & 1).reshape(CHUNK, -1)
    assert torch.equal(bits.bool(), torch.ones(CHUNK, CHUNK).tril().bool())


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_paged_equals_transformers(tiny, kernels):
    """Four steps of a batch (ragged histories, one longer than a catch-up chunk, an empty one, a
    zero depth); after each step every request accepts a random prefix of its chain plus a bonus."""
    path = str(tiny["llama"])
    ref = HFDraftModel(path, top_k=3)
    long = CHUNK + 44 if kernels == "torch" else 40  # the interpreter is slow
    pd = PagedDraftModel(path, top_k=3, max_len=512, depth=5, max_requests=6, kernels=kernels, page_size=16)
    g = torch.Generator().manual_seed(3)
    hists = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in (5, 17, 1, long, 30, 0)]
    depths, keys = [4, 2, 3, 5, 0, 5], list("abcdef")
    for step in range(4):
        got = pd.propose([np.array(h, dtype=np.int32) for h in hists], depths, keys=keys).validate()
        assert_same_candidates(got, ref.propose(hists, depths), [d if h else 0 for h, d in zip(hists, depths)])
        for b, h in enumerate(hists):
            if h:
                k = int(torch.randint(0, depths[b] + 1, (1,), generator=g))
                h += [t for t in got.tokens[b, :k, 0].tolist() if t >= 0] + [int(torch.randint(3, 1000, (1,), generator=g))]
        if step == 1:
            pd.release(["a"])  # a finished request comes back under the same key: caught up from scratch


def assert_same_slots(got, want, atol: float = 0.0):
    """Equal search states on every kept slot (widths may differ: the step searches ``max_budget`` slots);
    scores within ``atol``."""
    S = want.valid.shape[1]
    assert torch.equal(got.valid[:, :S], want.valid) and not got.valid[:, S:].any()
    for f in ("token", "parent", "depth", "logrho", "qprob", "kind"):
        a, b = getattr(got, f)[:, :S][want.valid], getattr(want, f)[want.valid]
        assert torch.equal(a, b) if f not in ("logrho", "qprob") else torch.allclose(a, b, rtol=0, atol=atol), f


@pytest.mark.parametrize("graphs", [False, True])
def test_trees_searched_in_the_step_equal_the_host_search(tiny, graphs, monkeypatch):
    """``grow_trees`` (the best-first search inside the draft's step, in its graph on CUDA) equals
    ``best_first_slots`` over ``propose``'s candidates on a second drafter: ragged and zero budgets, the
    ``max_budget`` edge, calibration factors, a shallower ``max_depth``, a zero depth, an empty
    history, four steps of growing histories; a budget over ``max_budget`` and a smaller ``top_k`` take
    the host search. ``graphs``: the step through the graph path's static buffers and batch buckets
    (replayed eagerly, as in ``test_graph_replay_path_on_cpu``)."""
    from vllm_bole.spec_decode.best_first import best_first_slots

    pd, ref = _drafter_pair(str(tiny["llama"]), graphs, monkeypatch)
    g = torch.Generator().manual_seed(8)
    hists = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in (5, 17, 1, 40, 30, 0)]
    depths, keys = [4, 2, 5, 5, 0, 5], list("abcdef")
    for step, (budget, max_depth) in enumerate([([3, 12, 0, 7, 5, 2], 5), (12, 4), ([1, 2, 3, 4, 5, 6], 5), (9, 5)]):
        cal = torch.rand(65, 3, generator=g) * 2 if step % 2 else None
        roots = [h[-1] if h else 0 for h in hists]
        got = pd.grow_trees(roots, hists, depths, budget, keys=keys, max_depth=max_depth, calibration=cal)
        want = best_first_slots(roots, ref.propose(hists, depths, keys=keys), budget, max_depth=max_depth,
                                calibration=cal)
        assert_same_slots(got, want)
        for b, h in enumerate(hists):
            if h:
                h += [int(torch.randint(3, 1000, (1,), generator=g)) for _ in range(1 + step)]
    for budget, top_k in ((13, None), (5, 2)):  # outside what the step searches: the host search
        got = pd.grow_trees(roots, hists, depths, budget, keys=keys, max_depth=5, top_k=top_k)
        assert_same_slots(got, best_first_slots(roots, ref.propose(hists, depths, keys=keys), budget, max_depth=5,
                                                top_k=top_k))
    wide, wide_ref = (PagedDraftModel(str(tiny["llama"]), top_k=16, max_len=256, depth=5, max_requests=6, kernels="torch",
                                      max_budget=255) for _ in range(2))
    assert not wide.device_search  # 256 slots x 17 candidates > SEARCH_WIDTH: the host searches, same trees
    assert_same_slots(wide.grow_trees(roots, hists, depths, 30, keys=keys, max_depth=5),
                      best_first_slots(roots, wide_ref.propose(hists, depths, keys=keys), 30, max_depth=5))
    assert not graphs or sorted(pd._graphs) == [4]  # four live rows (a zero depth, an empty history)


@pytest.mark.parametrize("graphs,beam", [(False, 0), (True, 0), (True, 2)])
def test_pending_tokens_on_the_device_equal_host_histories(tiny, peaked, graphs, beam, monkeypatch):
    """``grow_trees_async(..., pending=...)`` (the runner's launch behind the target's step: each
    request's accepted tokens and bonus still on the device, -1 padded) equals ``grow_trees`` over the
    histories with those tokens appended, step after step (the pool's bookkeeping extended when the
    trees are read): ragged counts from 1 to ``depth + 1``, a request joining late (its whole history
    prefilled first), one evicted and caught up, a zero depth; then the host search's fallback (a budget
    over ``max_budget``) reads the pending tokens first. (Histories are never empty here: a pending
    token follows a root.) ``beam``: the trees drafted node by node by the peaked draft (0: over the chain's
    candidates)."""
    pd, ref = _drafter_pair(peaked if beam else str(tiny["llama"]), graphs, monkeypatch, beam)
    tol = PEAKED_TOL if beam else TOL
    g = torch.Generator().manual_seed(5)
    hists = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in (5, 17, 9, 40, 30, 1)]
    depths, keys = [4, 2, 5, 5, 0, 5], list("abcdef")
    roots = [h[-1] for h in hists]
    pd.grow_trees(roots, hists, depths, 8, keys=keys, max_depth=5)  # the prompts (no pending tokens)
    ref.grow_trees(roots, hists, depths, 8, keys=keys, max_depth=5)
    for step in range(4):
        counts = [1 + int(torch.randint(0, 6, (1,), generator=g)) for _ in hists]
        W = max(counts)
        new = torch.full((len(hists), W), -1, dtype=torch.long)
        for b, n in enumerate(counts):
            new[b, :n] = torch.randint(3, 1000, (n,), generator=g)
        if step == 1:
            keys[2] = "g"  # a request the drafter never saw: its whole history is prefilled first
        if step == 2:
            pd.release(["b"]), ref.release(["b"])  # evicted: caught up from scratch
        got = pd.grow_trees_async(None, [np.array(h, dtype=np.int64) for h in hists], depths, [8, 3, 12, 5, 4, 8],
                                  keys=keys, max_depth=5, pending=(new, torch.tensor(counts)))()
        for b, n in enumerate(counts):
            hists[b] += new[b, :n].tolist()
        roots = [h[-1] for h in hists]
        want = ref.grow_trees(roots, hists, depths, [8, 3, 12, 5, 4, 8], keys=keys, max_depth=5)
        # rounding apart: a catch-up computes K/V in another forward than the reference's (its last
        # tokens in the step there, in the prefill here), a graph bucket pads the batch
        assert_same_slots(got, want, atol=tol)
        assert {k: (e.length, e.tail.tolist()) for k, e in pd.pool.entries.items()} == \
            {k: (e.length, e.tail.tolist()) for k, e in ref.pool.entries.items()}
    new = torch.tensor([[7, -1]] * len(hists))
    got = pd.grow_trees_async(None, hists, depths, 13, keys=keys, max_depth=5, pending=(new, torch.ones(6).long()))()
    hists = [h + [7] for h in hists]
    assert_same_slots(got, ref.grow_trees([7] * 6, hists, depths, 13, keys=keys, max_depth=5), atol=tol)


def _drafter_pair(path: str, graphs: bool, monkeypatch, beam: int = 0):
    """Two paged drafters of the Llama at ``path`` (budget 12, top 4, depth 5; ``beam``: drafting trees node by
    node): the one under test, through the graph path's static buffers and batch buckets when ``graphs``
    (replayed eagerly), and a reference."""
    from vllm_bole.spec_decode.paged_tree_draft import PagedTreeDraftModel

    if graphs:
        monkeypatch.setattr(PagedDraftModel, "buckets", (1, 2, 4, 8))
        monkeypatch.setattr(PagedDraftModel, "_step_graph", _eager_graph)
    cls, more = (PagedTreeDraftModel, dict(beam=beam)) if beam else (PagedDraftModel, {})
    pd, ref = (cls(path, top_k=4, max_len=256, depth=5, max_requests=6, kernels="torch", max_budget=12,
                   **more) for _ in range(2))
    pd.cuda_graphs = graphs
    return pd, ref


def _eager_graph(self, B):
    """``_step_graph`` without a GPU: the same body on the same static buffers, replayed eagerly."""
    class EagerGraph:
        def __init__(self, run):
            self.replay = run

    if B not in self._graphs:
        bufs = self._buffers(B, self.depth - 1, search=self.device_search)
        self._graphs[B] = (EagerGraph(lambda: self._step(bufs, self.depth - 1, self.width * self.pool.page_size)), bufs)
    return self._graphs[B]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3_gqa"])
def test_decoder_variants_equal_transformers(tmp_path, arch):
    """The few-kernel forward (``paged_decoder.py``) on the other shapes of the family: Qwen2's QKV
    biases, Qwen3's per-head q/k norms, Llama-3 RoPE scaling with grouped K/V heads and an MLP bias;
    two steps of candidates equal the transformers drafter's."""
    import transformers

    small = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    cfg = {"qwen2": lambda: transformers.Qwen2Config(**small),
           "qwen3": lambda: transformers.Qwen3Config(**small, head_dim=32),
           "llama3_gqa": lambda: transformers.LlamaConfig(**small, mlp_bias=True, rope_scaling=dict(
               rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64))}[arch]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    for p in model.parameters():  # biases and norms away from their init, so a dropped term shows
        p.data.normal_(0, 0.3 if p.dim() == 1 else 0.1)
    model.save_pretrained(tmp_path)
    ref = HFDraftModel(str(tmp_path), top_k=3)
    pd = PagedDraftModel(str(tmp_path), top_k=3, max_len=128, depth=4, max_requests=3, kernels="torch")
    hists = [[5, 9, 200, 7], list(range(3, 70)), [11]]
    for _ in range(2):
        got = pd.propose(hists, [4, 3, 4], keys="abc").validate()
        assert_same_candidates(got, ref.propose(hists, [4, 3, 4]), [4, 3, 4])
        hists = [h + got.tokens[b, :2, 0].tolist() + [17] for b, h in enumerate(hists)]


def test_graph_replay_path_on_cpu(tiny, monkeypatch):
    """The CUDA-graph path's bookkeeping without a GPU: ``_step_graph`` replaced by an eager replay of
    the same body on the same static buffers, batch buckets of at most 4 rows (5 requests: a bucket
    of 4, then one of 1 with no padding; 3 requests: one padded bucket of 4), cap-length keys; the
    candidates stay the transformers drafter's over four steps."""

    monkeypatch.setattr(PagedDraftModel, "buckets", (1, 2, 4))
    monkeypatch.setattr(PagedDraftModel, "_step_graph", _eager_graph)
    path = str(tiny["llama"])
    ref = HFDraftModel(path, top_k=3)
    pd = PagedDraftModel(path, top_k=3, max_len=256, depth=4, max_requests=6, kernels="torch")
    pd.cuda_graphs = True
    assert pd.capture_graphs(3) == 3 and sorted(pd._graphs) == [1, 2, 4]  # at engine start: every bucket to 3 rows
    g = torch.Generator().manual_seed(11)
    hists = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in (9, 3, 40, 1, 22)]
    for live in (range(5), range(5), (0, 2, 4), range(5)):  # the last step reads what padding rows must not touch
        keys, hs, depths = [str(i) for i in live], [hists[i] for i in live], [4, 2, 3, 4, 1][: len(live)]
        got = pd.propose(hs, depths, keys=keys).validate()
        assert_same_candidates(got, ref.propose(hs, depths), depths)
        for b, i in enumerate(live):
            k = int(torch.randint(0, depths[b] + 1, (1,), generator=g))
            hists[i] += got.tokens[b, :k, 0].tolist() + [int(torch.randint(3, 1000, (1,), generator=g))]
    assert pd.cuda_graphs and sorted(pd._graphs) == [1, 2, 4]

    def refused(self, B):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(PagedDraftModel, "_step_graph", refused)  # a refused capture: eager from then on
    pd._graphs.clear()
    assert pd.capture_graphs(3) == 0 and not pd.cuda_graphs
    assert pd.runtime.endswith("eager: RuntimeError: operation not permitted when stream is capturing)")
    assert_same_candidates(pd.propose(hists[:2], [3, 3], keys=["0", "1"]), ref.propose(hists[:2], [3, 3]), [3, 3])


def test_eviction_and_refusal(tiny):
    """A pool of 6 pages (16 tokens each) beside requests of 2-3 pages: the least recently drafted
    request outside the batch is evicted and caught up from scratch when it returns; a request that
    cannot fit even then gets no draft; everything drafted stays exact."""
    path = str(tiny["llama"])
    ref = HFDraftModel(path, top_k=2)
    bpt = PagedDraftModel.bytes_per_token(ref.model.config, torch.float32)
    pd = PagedDraftModel(path, top_k=2, max_len=128, depth=3, kv_bytes=7 * 16 * bpt, kernels="torch")
    assert pd.pool.num_pages == 7  # the trash page and 6
    g = torch.Generator().manual_seed(5)
    h = {k: torch.randint(3, 1000, (n,), generator=g).tolist() for k, n in dict(a=30, b=20, c=40, d=100).items()}

    def step(keys, depths=None):
        depths = depths or [3] * len(keys)
        got = pd.propose([h[k] for k in keys], depths, keys=keys)
        return got, ref.propose([h[k] for k in keys], depths)

    got, want = step(["a", "b"])  # 3 + 2 pages
    assert_same_candidates(got, want, [3, 3])
    got, want = step(["c"])  # 3 pages: evicts a (least recent)
    assert_same_candidates(got, want, [3]) and pd.pool.evictions == 1 and "a" not in pd.pool.entries
    h["a"] += [7, 8]
    got, want = step(["a", "c"])  # a again, from scratch (evicts b)
    assert_same_candidates(got, want, [3, 3]) and pd.pool.evictions == 2
    got, want = step(["d", "a"])  # d needs 7 pages: never fits, no draft; a stays exact
    assert int(got.depths[0]) == 0 and (got.tokens[0] == -1).all()
    assert_same_candidates(Candidates(got.tokens[1:], got.probs[1:]), Candidates(want.tokens[1:], want.probs[1:]), [3])


def test_temporary_keys_keep_nothing(tiny):
    pd = PagedDraftModel(str(tiny["llama"]), top_k=2, max_len=64, depth=3, max_requests=2, kernels="torch")
    free = len(pd.pool.free)
    pd.propose([[5, 6, 7], [8]], [3, 2])
    assert len(pd.pool.free) == free and not pd.pool.entries


def test_warm_up_keeps_nothing_and_changes_no_draft(tiny):
    """The prefill warm-up (engine start) runs histories up to what the page tables reach, under temporary
    keys: the pool is as before and a request's drafts equal a fresh drafter's."""
    kw = dict(top_k=2, max_len=400, depth=3, max_requests=2, kernels="torch")
    pd, fresh = PagedDraftModel(str(tiny["llama"]), **kw), PagedDraftModel(str(tiny["llama"]), **kw)
    free = len(pd.pool.free)
    assert pd.warm_up() == 2 * 5  # S + 2, S + 17, S + 32, 300, and 1100 / 2100 cut to the tables (412)
    assert len(pd.pool.free) == free and not pd.pool.entries
    hist = [np.arange(3, 60) % 50]
    a, b = pd.propose(hist, [3], keys=["r"]), fresh.propose(hist, [3], keys=["r"])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)


def test_page_pool():
    pool = PagePool(7, 4)  # pages 1..6
    assert pool.reserve(["a", "b"], [8, 8]) == [True, True]  # 2 pages each
    pool.set_tokens("a", np.array([1, 2, 3]))
    assert pool.cached("a", np.array([1, 2, 3, 4])) == 3 and pool.cached("a", np.array([1, 9])) == 1
    assert pool.cached("zz", np.array([1])) == 0
    long = np.arange(200)
    pool.set_tokens("a", long)  # compared over the last TAIL cached tokens only
    assert pool.cached("a", np.concatenate([long, [7]])) == 200 and pool.cached("a", long[:150]) == 150
    assert pool.cached("a", np.where(long == 190, -5, long)) == 190
    assert pool.cached("a", long[:100]) == 0  # ends before the compared tokens: from scratch
    pool.reserve(["b"], [8])  # b drafted again: a is the least recently used
    assert pool.reserve(["c"], [12]) == [True] and "a" not in pool.entries and "b" in pool.entries  # 3 pages
    t = pool.table(["b", None, "c"], 4)
    assert t.shape == (3, 4) and (t[1] == 0).all() and (t[0, 2:] == 0).all() and len(set(t[2, :3])) == 3
    assert pool.reserve(["e", "f"], [16, 16]) == [True, False]  # e evicts b and c; f does not fit
    pool.release("e")
    assert sorted(pool.free) == list(range(1, 7))
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(1, 4)


def test_recurrent_draft_refused(tiny):
    with pytest.raises(NotImplementedError, match="cannot run paged"):
        PagedDraftModel(str(tiny["mamba2"]), max_len=64, depth=2)


def test_length_dependent_rope_refused(tmp_path):
    """A checkpoint the config check admits but the loaded modules do not (its RoPE frequencies depend
    on the sequence length, so no table at start can hold them): refused with the reason."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, rope_scaling=dict(rope_type="dynamic", factor=2.0))
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="cannot run paged: rope_type 'dynamic'"):
        PagedDraftModel(str(tmp_path), max_len=64, depth=2)


# ------------------------------------------------------------------------------ node by node
# the peaked draft's scores: logits 6x larger round 6x coarser (measured: <= 6e-5 in logrho, 1e-5 in q)
PEAKED_TOL = 2e-4


@pytest.fixture(scope="module")
def peaked(tiny, tmp_path_factory):
    """The tiny Llama with its LM head scaled 6x: peaked draft distributions, so that best-first trees go
    deep (to depth 4, main paths and branches) instead of wide (the random model's flat ones)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny["llama"]))
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    out = tmp_path_factory.mktemp("peaked")
    model.save_pretrained(out)
    return str(out)


def hf_tree_reference(hf, roots, hists, depths, budget, *, max_depth, beam, top_k, calibration=None):
    """The same search with every frontier node's children from a full transformers forward over
    its history and path (the reference of the paged tree drafter)."""
    from vllm_bole.spec_decode.best_first import budgets, grow

    def expand(fb, fs, d, s):
        probs, toks = torch.zeros(fb.numel(), top_k), torch.zeros(fb.numel(), top_k, dtype=torch.long)
        for n, (b, slot) in enumerate(zip(fb.tolist(), fs.tolist())):
            if d >= depths[b]:
                continue
            path, x = [], slot
            while x > 0:
                path.append(int(s.token[b, x]))
                x = int(s.parent[b, x])
            with torch.no_grad():
                logits = hf.model(input_ids=torch.tensor([list(hists[b]) + path[::-1]])).logits[0, -1]
            probs[n], toks[n] = logits.float().softmax(-1).topk(top_k)
        return probs, toks, None

    caps = budgets(budget, len(hists), "cpu").clone()
    caps[[b for b, (h, d) in enumerate(zip(hists, depths)) if not h or d == 0]] = 0
    return grow(torch.tensor(roots), expand, caps, max_depth, beam=beam, calibration=calibration)


@pytest.mark.parametrize("kernels,path", [("torch", "step"), ("torch", "graphs"), ("torch", "host"),
                                          ("triton", "graphs"), ("triton", "host")])
def test_tree_drafting_equals_transformers(peaked, kernels, path, monkeypatch):
    """Trees drafted node by node (one forward per depth over the frontier, tree attention over the
    request's earlier nodes) equal the same search with full transformers forwards per node, over
    three steps of growing histories (incremental catch-up), ragged budgets and depths, a zero
    depth, an empty history, calibration factors; the chosen budgets cut the same trees. ``path``:
    the search inside the draft's step (``step``: eagerly; ``graphs``: through the graph path's static
    buffers and batch buckets, replayed eagerly: fixed shapes, ``beam`` lanes per request and level) or
    on the host (``host``: budgets over ``max_budget``, one forward of the frontier nodes per level). The
    draft is peaked (trees to depth 4, so the beam binds and ancestor bits span levels)."""
    from vllm_bole.spec_decode.paged_tree_draft import PagedTreeDraftModel

    if path == "graphs":
        monkeypatch.setattr(PagedDraftModel, "buckets", (1, 2, 4, 8))
        monkeypatch.setattr(PagedDraftModel, "_step_graph", _eager_graph)
    ref = HFDraftModel(peaked, top_k=3)
    pd = PagedTreeDraftModel(peaked, top_k=3, max_len=256, depth=4, beam=2, max_requests=5, kernels=kernels,
                             max_budget=4 if path == "host" else 8)
    pd.cuda_graphs = path == "graphs"
    g = torch.Generator().manual_seed(11)
    hists = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in (6, 1, 20, 0, 9)]
    depths, budget, keys = [4, 2, 3, 4, 0], torch.tensor([6, 3, 8, 5, 4]), list("abcde")
    f = torch.rand(65, 3, generator=g) + 0.5
    for step in range(3):
        roots = [h[-1] if h else 0 for h in hists]
        got = pd.grow_trees(roots, hists, depths, budget, keys=keys, max_depth=4, calibration=f if step else None)
        want = hf_tree_reference(ref, roots, hists, depths, budget, max_depth=4, beam=2, top_k=3,
                                 calibration=f if step else None)
        assert_same_slots(got, want, atol=PEAKED_TOL)
        a, b = got.tree(), want.tree()
        via, _ = draft_trees(pd, roots, hists, depths, budget, max_depth=4, calibration=f if step else None)
        assert torch.equal(via.token_ids, a.token_ids) and torch.equal(via.parent, a.parent)  # the runner's entry
        cut = torch.tensor([2, 1, 3, 0, 0])
        assert torch.equal(got.tree(cut).token_ids, want.tree(cut).token_ids)
        for r, h in enumerate(hists):  # accept the first child chain's first node (when any) and a bonus
            if h:
                kids = [i for i, p in enumerate(a.request(r)[0]) if p == 0]
                h += ([a.request(r)[1][kids[0]]] if kids else []) + [int(torch.randint(3, 1000, (1,), generator=g))]
    assert path != "graphs" or sorted(pd._graphs) == [4]  # four live rows (a zero depth, an empty history)


def test_tree_step_builds_no_tensor_from_host_data(peaked):
    """The node-by-node step runs inside a CUDA graph capture, which refuses host-to-device copies: its
    body (``_step`` with the search's buffers: the first forward, the levels, the search) must not build
    a tensor from Python data (``lift_fresh``; the CPU tests cannot see the capture itself)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_bole.spec_decode.paged_tree_draft import PagedTreeDraftModel

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.__name__)
            return func(*args, **(kwargs or {}))

    pd = PagedTreeDraftModel(peaked, top_k=3, max_len=64, depth=4, beam=2, max_requests=2, kernels="torch")
    seen, step = Seen(), pd._step

    def watched(bufs, steps, max_kv_len):
        with seen:
            step(bufs, steps, max_kv_len)

    pd._step = watched
    got = pd.grow_trees([5, 9], [[3, 4, 5], [7, 8, 9]], [4, 4], 6, keys="ab", max_depth=4)
    assert int(got.depth.max()) >= 3 and "topk" in " ".join(seen.ops)  # the levels ran
    assert not {op for op in seen.ops if op.startswith("lift_fresh")}, seen.ops


@pytest.mark.parametrize("beam,depth,budget", [(7, 33, 60), (4, 64, 120), (1, 64, 63)])
def test_tree_step_equals_the_host_search_over_the_envelope(peaked, beam, depth, budget):
    """The search inside the step against the host's (the one tested against transformers above) at the
    edges the config accepts: ``draft_beam * (max_depth - 1)`` up to 252 expansion rows (ancestor bits in
    every word, the sign bit included), depth 64, a beam of 1; ragged budgets and depths, a one-token
    history, two steps."""
    from vllm_bole.spec_decode.paged_tree_draft import PagedTreeDraftModel

    common = dict(top_k=3, max_len=128, depth=depth, beam=beam, max_requests=3, kernels="torch")
    pd, ref = (PagedTreeDraftModel(peaked, max_budget=m, **common) for m in (budget, 2))
    g = torch.Generator().manual_seed(depth + beam)
    hists = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in (1, 30, 7)]
    depths, caps = [depth, depth - 5, 9], torch.tensor([budget, budget // 2, 12])
    for _ in range(2):
        roots = [h[-1] for h in hists]
        got = pd.grow_trees(roots, hists, depths, caps, keys="abc", max_depth=depth)
        assert_same_slots(got, ref.grow_trees(roots, hists, depths, caps, keys="abc", max_depth=depth), atol=PEAKED_TOL)
        hists = [h + [int(got.token[b, 1]), 11] for b, h in enumerate(hists)]
    assert int(got.depth.max()) >= 20  # deep trees: the levels' rows span several words
