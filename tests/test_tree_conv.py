"""Tree conv and conv-state commit against the float64 oracle, both implementations, all tree
families, both vLLM conv-state layouts, widths 2..4; outputs poisoned, other slots untouched."""
import pytest
import torch

from vllm_bole.mamba.tree_conv import commit_conv_state, tree_conv
from vllm_bole.testing.oracles import conv_tree_reference, make_tree_shape, strided, tree_shapes

C = 40  # not a multiple of the channel block


def _cache(S, W, layout, gen):
    s = torch.randn(S, C, W - 1, generator=gen)
    return s if layout == "dim_first" else s.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("shape", tree_shapes())
@pytest.mark.parametrize("W,layout", [(4, "dim_first"), (4, "width_first"), (2, "dim_first"), (3, "width_first")])
def test_tree_conv_and_commit(kernels, shape, W, layout):
    gen = torch.Generator().manual_seed(hash((kernels, shape, W, layout)) % 2**31)
    tree = make_tree_shape(shape, seed=int(torch.randint(100, (1,), generator=gen)))
    B, T = tree.num_requests, tree.num_nodes
    x = torch.randn(T, C, generator=gen)
    if layout == "width_first":  # and x as a non-contiguous slice, as vLLM's fused projections give it
        x = strided(x)
    weight, bias = torch.randn(C, W, generator=gen), torch.randn(C, generator=gen)
    cache = _cache(B + 2, W, layout, gen)
    slots = torch.randperm(B + 2, generator=gen)[:B].to(torch.int32)
    y_ref, st_ref = conv_tree_reference(tree, x, weight, cache[slots.long()], bias=bias)
    y = tree_conv(x, weight, cache, slots, tree, bias=bias, kernels=kernels)
    assert torch.allclose(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    y_nob = tree_conv(x, weight, cache, slots, tree, activation=None, kernels=kernels)
    y_nob_ref, _ = conv_tree_reference(tree, x, weight, cache[slots.long()], activation=None)
    assert torch.allclose(y_nob.double(), y_nob_ref, rtol=1e-5, atol=1e-5)
    # accept a random node per request (-1 for one request: its slot must not move)
    last = torch.tensor([int(torch.randint(int(n), (1,), generator=gen)) for n in tree.nodes_per_request])
    if B > 1:
        last[0] = -1
    before = cache.clone()
    commit_conv_state(cache, slots, tree, last, x, kernels=kernels)
    for r in range(B):
        s = int(slots[r])
        want = before[s] if last[r] < 0 else st_ref[int(tree.cu_nodes[r]) + int(last[r])].float()
        assert torch.allclose(cache[s], want, rtol=1e-6, atol=1e-6), (r, int(last[r]))
    others = [s for s in range(B + 2) if s not in slots.tolist()]
    assert torch.equal(cache[others], before[others])


def test_bad_activation():
    with pytest.raises(ValueError, match="activation: 'relu' is not one of"):
        tree_conv(torch.zeros(1, C), torch.zeros(C, 4), torch.zeros(1, C, 3), torch.zeros(1), None, activation="relu")
