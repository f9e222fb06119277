"""Drafters on the target's hidden state (``vllm_bole.spec_decode.block_drafter``): heads, checkpoints,
candidates."""
from __future__ import annotations

import pytest
import torch

from vllm_bole.spec_decode.best_first import best_first_tree
from vllm_bole.spec_decode.block_drafter import BlockHead, HeadDrafter, MTPHead, check_head_dir, load_head

H, V, D = 16, 50, 4


def _lm_head(seed=0):
    w = torch.randn(V, H, generator=torch.Generator().manual_seed(seed))
    return lambda z: z @ w.T


def _randomize(head, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return head


def _block():
    return _randomize(BlockHead(H, D))


def _mtp():
    return _randomize(MTPHead(H, D, V, token_dim=8))


def test_block_head_matches_its_formula():
    head = _block()
    h = torch.randn(3, H)
    z = head(h)
    for d in range(D):
        torch.testing.assert_close(z[:, d], h + torch.nn.functional.silu(h @ head.weight[d].T + head.bias[d]))


def test_mtp_head_steps_on_the_previous_depths_top_token():
    head, lm = _mtp(), _lm_head()
    h, roots = torch.randn(3, H), torch.tensor([1, 7, 49])
    logits = head.logits(h, roots, D, lm)
    s, t = h, roots
    for d in range(D):
        s = s + torch.nn.functional.silu(torch.cat([s, head.embed.weight[t]], -1) @ head.proj.weight.T + head.proj.bias)
        torch.testing.assert_close(logits[:, d], lm(s))
        t = lm(s).argmax(-1)


@pytest.mark.parametrize("make", [_block, _mtp], ids=["block", "mtp"])
def test_checkpoint_round_trip(tmp_path, make):
    head = make()
    head.save(str(tmp_path))
    back = load_head(str(tmp_path), head.kind)
    h, roots = torch.randn(3, H), torch.tensor([0, 5, 9])
    torch.testing.assert_close(back.logits(h, roots, D, _lm_head()), head.logits(h, roots, D, _lm_head()))
    assert check_head_dir(str(tmp_path), head.kind, H)["depth"] == D


def test_zero_block_head_gives_every_depth_the_targets_next_token_distribution():
    lm = _lm_head()
    drafter = HeadDrafter(BlockHead(H, D), lm, top_k=5)
    h = torch.randn(2, H)
    drafter.condition(h)
    c = drafter.propose([[1], [2]], [D, D]).validate()
    p, t = lm(h).softmax(-1).topk(5)
    for d in range(D):
        torch.testing.assert_close(c.probs[:, d], p)
        assert torch.equal(c.tokens[:, d], t)


@pytest.mark.parametrize("make", [_block, _mtp], ids=["block", "mtp"])
def test_candidates_stop_at_each_requests_depth_and_at_the_heads_depth(make):
    drafter = HeadDrafter(make(), _lm_head(), top_k=3)
    drafter.condition(torch.randn(3, H))
    c = drafter.propose([[1], [2], [3]], [0, 2, D + 5]).validate()
    assert c.depth == D  # capped at what the head was trained for
    assert c.depths.tolist() == [0, 2, D]
    tree = best_first_tree([1, 2, 3], c, 6)
    assert tree.cu_nodes.diff().tolist() == [1, 7, 7]  # the root alone, then roots with 6 draft nodes
    assert int(tree.depth.max()) <= D


def test_mtp_drafter_starts_from_each_histories_root():
    head, lm = _mtp(), _lm_head()
    drafter = HeadDrafter(head, lm, top_k=2)
    h = torch.randn(2, H)
    drafter.condition(h)
    c = drafter.propose([[4, 11], [3]], [D, D])
    p, t = head.logits(h, torch.tensor([11, 3]), D, lm).softmax(-1).topk(2)
    torch.testing.assert_close(c.probs, p)
    assert torch.equal(c.tokens, t)


def test_propose_needs_the_hidden_states_of_this_batch():
    drafter = HeadDrafter(_block(), _lm_head(), top_k=3)
    with pytest.raises(RuntimeError, match="condition"):
        drafter.propose([[1]], [2])
    drafter.condition(torch.randn(2, H))
    with pytest.raises(RuntimeError, match="2"):
        drafter.propose([[1]], [2])


def test_checkpoint_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="^model: .* is not a block drafter checkpoint"):
        check_head_dir(str(tmp_path), "block")
    _block().save(str(tmp_path))
    with pytest.raises(ValueError, match="^model: .*hidden size 16, the target's is 32"):
        check_head_dir(str(tmp_path), "block", 32)
    with pytest.raises(ValueError, match="^model: .* holds a 'block' drafter, not 'mtp'"):
        check_head_dir(str(tmp_path), "mtp")


def test_mtp_training_steps_on_the_texts_tokens():
    """``train_pair._head_logits``: the MTP head's depth-d logits at position t are its recurrence from h[t] over
    the text's tokens x[t + 1 .. t + d] (what the label's context holds: the target's greedy token at t + d
    given the text), position by position by hand; the block head's are its depth-d block on h[t]."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from train_pair import _head_logits

    g = torch.Generator().manual_seed(0)
    b, S, H, V, D = 2, 6, 8, 20, 3
    mtp = MTPHead(H, D, V, token_dim=4)
    for p in mtp.parameters():
        torch.nn.init.normal_(p, generator=g)
    lm = torch.nn.Linear(H, V, bias=False)
    h, x = torch.randn(b, S, H, generator=g), torch.randint(0, V, (b, S + 1), generator=g)
    with torch.no_grad():
        got = _head_logits(mtp, lm, h, x)
        for d in range(1, D + 1):
            assert got[d - 1].shape == (b, S - d, V)
            for t in range(S - d):
                s = h[:, t]
                for k in range(1, d + 1):
                    s = mtp(s, x[:, t + k])
                torch.testing.assert_close(got[d - 1][:, t], lm(s))
        block = BlockHead(H, D)
        torch.nn.init.normal_(block.weight, generator=g)
        got = _head_logits(block, lm, h, x)
        for d in range(1, D + 1):
            torch.testing.assert_close(got[d - 1], lm(block(h.reshape(-1, H)).view(b, S, D, H)[:, : S - d, d - 1]))


@pytest.mark.parametrize("make,kernels", [(_block, "torch"), (_mtp, "torch"), (_block, "triton")],
                         ids=["block-torch", "mtp-torch", "block-triton"])  # the kernels: test_builders, test_vocab_topk
def test_trees_searched_on_the_device_equal_the_host_search(make, kernels):
    """``grow_trees_async`` (the heads' marginals and the best-first search queued on the heads' device,
    the packed trees read at the end) equals ``best_first_slots`` over ``propose``'s candidates: ragged and
    zero budgets, the ``max_budget`` edge, calibration factors, a shallower ``max_depth``, zero depths, a
    smaller ``top_k``; the roots from pending tokens on the device (-1 padded, the last of each row's
    count); a budget over ``max_budget`` takes the host search, with pending tokens too."""
    from test_paged_draft import assert_same_slots

    from vllm_bole.spec_decode.best_first import best_first_slots

    head, lm = make(), _lm_head()
    drafter, ref = HeadDrafter(head, lm, 4, max_budget=12, kernels=kernels), HeadDrafter(head, lm, 4, kernels=kernels)
    g = torch.Generator().manual_seed(3)
    B = 6
    hists = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (5, 1, 9, 3, 2, 7)]
    roots = [h[-1] for h in hists]
    cases = [([3, 12, 0, 7, 5, 1], [D, 2, D, 0, D + 3, 1], D, None), (12, [D] * B, 3, 2), (0, [D] * B, D, None),
             ([1, 2, 3, 4, 5, 6], [0] * B, D, None), (13, [D] * B, D, None)]
    for i, (budget, depths, max_depth, top_k) in enumerate(cases):
        h = torch.randn(B, H, generator=g)
        cal = torch.rand(65, 3, generator=g) * 2 if i % 2 else None
        for pending in (None, "device"):
            if pending:  # each row's new tokens after its history, the root the last of them
                cnt = torch.randint(1, 4, (B,), generator=g)
                tok = torch.randint(0, V, (B, 3), generator=g).masked_fill(torch.arange(3) >= cnt[:, None], -1)
                pending, want_roots = (tok, cnt), tok.gather(1, (cnt - 1)[:, None]).squeeze(1).tolist()
            else:
                want_roots = roots
            drafter.condition(h)
            got = drafter.grow_trees_async(roots, hists, depths, budget, max_depth=max_depth, top_k=top_k,
                                           calibration=cal, pending=pending)()
            ref.condition(h)
            want = best_first_slots(want_roots, ref.propose([[r] for r in want_roots], depths), budget,
                                    max_depth=max_depth, top_k=top_k, calibration=cal)
            assert_same_slots(got, want, atol=1e-12)  # scores: float64 sums in another order


class _EagerGraph:
    """A captured graph's stand-in without a GPU: replay runs the body again on the same static buffers."""

    def __init__(self, run, device, pool):
        self.replay = run


def test_graph_path_on_cpu(monkeypatch):
    """The CUDA-graph path's bookkeeping without a GPU (``capture_graph`` replaced by an eager replay of the
    same body on the same static buffers, buckets of at most 4 rows): the trees equal the eager search's over
    batches of 3, 1 and 4 rows (padding rows of the bucket, stale hidden states in them), pending roots, a
    ``max_depth`` below the drafter's depth (eager); engine-start capture of every bucket to 3 rows; a refused
    capture falls back to eager searches, said in ``runtime``."""
    from test_paged_draft import assert_same_slots

    from vllm_bole.spec_decode import block_drafter

    monkeypatch.setattr(HeadDrafter, "buckets", (1, 2, 4))
    monkeypatch.setattr(block_drafter, "capture_graph", _EagerGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    head, lm = _mtp(), _lm_head()
    graphs, eager = HeadDrafter(head, lm, 4, max_budget=10, depth=3), HeadDrafter(head, lm, 4, max_budget=10, depth=3)
    graphs.cuda_graphs = True
    assert graphs.capture_graphs(3) == 3 and sorted(graphs._graphs) == [1, 2, 4]
    g = torch.Generator().manual_seed(5)
    for B, max_depth, pend in ((3, 3, False), (1, 3, True), (4, 3, False), (3, 2, True)):
        h, depths = torch.randn(B, H, generator=g), torch.randint(0, 5, (B,), generator=g).tolist()
        roots, budget = torch.randint(0, V, (B,), generator=g).tolist(), torch.randint(0, 11, (B,), generator=g)
        pending = (torch.tensor(roots)[:, None], torch.ones(B, dtype=torch.long)) if pend else None
        got = []
        for d in (graphs, eager):
            d.condition(h)
            got.append(d.grow_trees_async(roots, [[r] for r in roots], depths, budget, max_depth=max_depth,
                                          pending=pending)())
        assert_same_slots(*got, atol=1e-5)  # a padded bucket's matmuls round otherwise (~1e-6)
    assert graphs.cuda_graphs and sorted(graphs._graphs) == [1, 2, 4]

    def refused(run, device, pool):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(block_drafter, "capture_graph", refused)
    graphs._graphs.clear()
    graphs.condition(h)
    got = graphs.grow_trees_async(roots, [[r] for r in roots], [3] * B, 6, max_depth=3)()
    eager.condition(h)
    assert_same_slots(got, eager.grow_trees_async(roots, [[r] for r in roots], [3] * B, 6, max_depth=3)(), atol=1e-5)
    assert not graphs.cuda_graphs and graphs.runtime.endswith("(eager: RuntimeError: operation not permitted when "
                                                              "stream is capturing)")
