"""The drafters' common interface: every drafter proposes ``Candidates [B, D, K]`` for a whole batch.
The draft-model drafter's batch path: attention-only drafts run all requests as one left-padded
batch and must propose what they propose one request at a time; recurrent drafts go request by
request (the choice is an explicit check of the model's cache, made once). FLA stays importable."""
import sys

import pytest
import torch

from vllm_bole.spec_decode.candidates import Candidates, Drafter
from vllm_bole.spec_decode.draft_model import HFDraftModel, hidden_fla
from vllm_bole.spec_decode.ngram import NgramDrafter
from vllm_bole.testing.tiny_models import build_tiny_model

_ABSENT = object()


@pytest.fixture(scope="module")
def keep_fla_state():
    """Restore FLA's ``sys.modules`` entry after the module, whatever a drafter did to it."""
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
@pytest.mark.parametrize("arch,batched,kind", [("llama", True, "attention"), ("mamba2", False, "cache_params"),
                                               ("granitemoehybrid", False, "past_key_values")])
def test_batch_equals_one_by_one(tiny, arch, batched, kind):
    g = torch.Generator().manual_seed(7)
    hists = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in (5, 17, 1, 9, 30, 9, 5)]  # equal lengths: one batch
    hists.append([])
    depths = [4, 2, 3, 0, 6, 2, 5, 3]  # a zero depth and an empty history: no candidates
    before = sys.modules.get("fla", _ABSENT)
    draft = HFDraftModel(str(tiny[arch]), top_k=3)
    assert sys.modules.get("fla", _ABSENT) is before  # FLA hidden only while the model loaded
    assert isinstance(draft, Drafter)
    assert draft.cache_kind == kind and (draft.cache_kind == "attention") is batched
    got = draft.propose(hists, depths).validate()
    assert got.tokens.shape == (len(hists), max(depths), 3)
    for b, (h, d) in enumerate(zip(hists, depths)):
        if d == 0 or not h:
            assert int(got.depths[b]) == 0
            continue
        want_t, want_p = (x[0] for x in draft._propose_group([h], d))
        assert int(got.depths[b]) == d == want_t.shape[0]
        assert torch.equal(got.tokens[b, :d], want_t)
        assert torch.allclose(got.probs[b, :d], want_p, atol=1e-5)
        assert (got.tokens[b, d:] == -1).all() and (got.probs[b, d:] == 0).all()


def test_hidden_fla_is_scoped():
    before = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    with hidden_fla():
        with pytest.raises(ImportError):
            __import__("fla")
    after = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_candidates_container():
    ng = NgramDrafter(1, 2, top_k=2)
    assert isinstance(ng, Drafter)
    c = ng.propose([[1, 2, 1, 2, 1], [3], []], [3, 2, 0])
    assert c.num_requests == 3 and c.depth == 3 and c.width == 2
    assert c.depths.tolist() == [3, 0, 0]
    e = Candidates.empty(2, 3, 4).validate()
    assert (e.tokens == -1).all() and e.depths.tolist() == [0, 0]
    dense = c.to_dense(5)
    assert dense.shape == (3, 3, 5) and float(dense[0, 0, 2]) == pytest.approx(float(c.probs[0, 0, 0]))
    with pytest.raises(ValueError, match="repeats"):
        Candidates(torch.tensor([[[4, 4]]]), torch.tensor([[[0.5, 0.2]]])).validate()
    with pytest.raises(ValueError, match="padding"):
        Candidates(torch.tensor([[[4, -1]]]), torch.tensor([[[0.5, 0.2]]])).validate()
