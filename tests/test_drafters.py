"""The draft-model drafter's batch path: attention-only drafts run all requests as one left-padded
batch and must propose what they propose one request at a time; recurrent drafts fall back."""
import sys

import pytest
import torch

from vllm_bole.spec_decode.drafters import HFDraftModel
from vllm_bole.testing.tiny_models import build_tiny_model

_ABSENT = object()


@pytest.fixture(scope="module")
def keep_fla_state():
    """On CPU ``HFDraftModel`` hides FLA from transformers (``sys.modules["fla"] = None``, what the
    engine's worker wants); undo that for the rest of the test session."""
    before = sys.modules.get("fla", _ABSENT)
    yield
    if before is _ABSENT:
        sys.modules.pop("fla", None)
    else:
        sys.modules["fla"] = before


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, keep_fla_state):
    root = tmp_path_factory.mktemp("draft")
    return {a: build_tiny_model(a, root) for a in ("llama", "mamba2", "granitemoehybrid")}


# Mamba2: no attention cache; GraniteMoeHybrid: transformers' DynamicCache holding linear-attention layers
@pytest.mark.parametrize("arch,batched", [("llama", True), ("mamba2", False), ("granitemoehybrid", False)])
def test_batch_equals_one_by_one(tiny, arch, batched):
    g = torch.Generator().manual_seed(7)
    hists = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in (5, 17, 1, 9, 30)]
    hists.append([])
    depths = [4, 2, 3, 0, 6, 3]  # a zero depth and an empty history: no candidates
    draft = HFDraftModel(str(tiny[arch]), top_k=3)
    got = draft.candidates_batch(hists, depths)
    assert draft._batched is batched
    for h, d, c in zip(hists, depths, got):
        if d == 0 or not h:
            assert c.depth == 0
            continue
        want = HFDraftModel.candidates(draft, h, d)
        assert c.depth == d == want.depth
        for a, b, pa, pb in zip(c.tokens, want.tokens, c.probs, want.probs):
            assert torch.equal(a, b)
            assert torch.allclose(pa, pb, atol=1e-5)
