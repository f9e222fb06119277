"""Main-path against sibling acceptance per depth (``vllm_bole.spec_decode.branch_stats``) against
a plain Python walk of each tree, over ragged random batches, chains and root-only requests."""
import pytest
import torch

from vllm_bole.spec_decode.branch_stats import branch_counts
from vllm_bole.spec_decode.tree import MAX_DEPTH
from vllm_bole.spec_decode.verification import VerificationResult
from vllm_bole.testing.oracles import random_accepted_paths, random_tree_batch


def walk(tree, accepted) -> torch.Tensor:
    out = torch.zeros(MAX_DEPTH + 1, 4, dtype=torch.long)
    for r in range(tree.num_requests):
        par, _ = tree.request(r)
        acc = {int(x) for x in accepted[r] if x >= 0}
        children = {}
        for i, p in enumerate(par):
            children.setdefault(p, []).append(i)
        main = {0}
        for i, p in enumerate(par):
            if p >= 0 and p in main and min(children[p]) == i:
                main.add(i)
        for i, p in enumerate(par):
            if p < 0 or p not in acc:
                continue
            d = len(tree.root_path(r, i)) - 1
            col = 0 if i in main else 2
            out[d, col] += 1
            out[d, col + 1] += i in acc
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["random", "deep", "wide", "chain"])
def test_branch_counts_equal_the_walk(seed, kind):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 17, 65 if kind == "chain" else 256, 64, 5][: 3 + seed % 4]
    tree = random_tree_batch(sizes, kind=kind, generator=g, max_depth=64)
    accepted, last = random_accepted_paths(tree, tree.max_depth + 1, generator=g)
    res = VerificationResult(output_token_ids=accepted.clamp(min=0), num_emitted=(accepted >= 0).sum(1),
                             accepted_nodes=accepted, last_node=last)
    got = branch_counts(tree, res)
    assert torch.equal(got, walk(tree, accepted))
    assert int(got[:, 1].sum() + got[:, 3].sum()) == int((accepted >= 0).sum()) - tree.num_requests
