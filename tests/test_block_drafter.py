"""The one-pass block drafter (``vllm_bole.spec_decode.block_drafter``): heads, checkpoints, candidates."""
from __future__ import annotations

import pytest
import torch

from vllm_bole.spec_decode.block_drafter import BlockDrafter, BlockHead, check_block_dir
from vllm_bole.spec_decode.best_first import best_first_tree

H, V, D = 16, 50, 4


def _lm_head(seed=0):
    w = torch.randn(V, H, generator=torch.Generator().manual_seed(seed))
    return lambda z: z @ w.T


def _head(seed=1):
    head = BlockHead(H, D)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(D, H, H, generator=g) * 0.3)
        head.bias.copy_(torch.randn(D, H, generator=g) * 0.1)
    return head


def test_head_matches_its_formula_and_round_trips(tmp_path):
    head = _head()
    h = torch.randn(3, H)
    z = head(h)
    for d in range(D):
        ref = h + torch.nn.functional.silu(h @ head.weight[d].T + head.bias[d])
        torch.testing.assert_close(z[:, d], ref)
    head.save(str(tmp_path))
    back = BlockHead.load(str(tmp_path))
    torch.testing.assert_close(back(h), z)
    assert check_block_dir(str(tmp_path), H) == {"hidden_size": H, "depth": D}


def test_zero_head_gives_every_depth_the_targets_next_token_distribution():
    lm = _lm_head()
    drafter = BlockDrafter(BlockHead(H, D), lm, top_k=5)
    h = torch.randn(2, H)
    drafter.condition(h)
    c = drafter.propose([[1], [2]], [D, D]).validate()
    p, t = lm(h).softmax(-1).topk(5)
    for d in range(D):
        torch.testing.assert_close(c.probs[:, d], p)
        assert torch.equal(c.tokens[:, d], t)


def test_candidates_stop_at_each_requests_depth_and_at_the_heads_depth():
    drafter = BlockDrafter(_head(), _lm_head(), top_k=3)
    drafter.condition(torch.randn(3, H))
    c = drafter.propose([[1], [2], [3]], [0, 2, D + 5]).validate()
    assert c.depth == D  # capped at what the head was trained for
    assert c.depths.tolist() == [0, 2, D]
    tree = best_first_tree([1, 2, 3], c, 6)
    assert tree.cu_nodes.diff().tolist() == [1, 7, 7]  # the root alone, then roots with 6 draft nodes
    assert int(tree.depth.max()) <= D


def test_propose_needs_the_hidden_states_of_this_batch():
    drafter = BlockDrafter(_head(), _lm_head(), top_k=3)
    with pytest.raises(RuntimeError, match="condition"):
        drafter.propose([[1]], [2])
    drafter.condition(torch.randn(2, H))
    with pytest.raises(RuntimeError, match="2"):
        drafter.propose([[1]], [2])


def test_checkpoint_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="^model: .* is not a block-drafter checkpoint"):
        check_block_dir(str(tmp_path))
    _head().save(str(tmp_path))
    with pytest.raises(ValueError, match="^model: .*hidden size 16, the target's is 32"):
        check_block_dir(str(tmp_path), 32)
