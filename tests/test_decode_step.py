"""The engine-agnostic decode step (``vllm_bole.spec_decode.step``) driven without vLLM: a small torch
hybrid model (conv + Gated DeltaNet layer, a gated Mamba1 layer, then a full-attention layer over a
paged KV cache), its
tree forward through the core ops and its commit through TreeLayer objects, against greedy decoding
of the same model by the float64 sequential oracles. Tree speculative decoding must emit exactly
the oracle's greedy tokens, whatever the drafter proposes (right chains, wrong chains, siblings)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_bole import gdn
from vllm_bole.mamba import mamba1_tree
from vllm_bole.attention.kv_compaction import compact_accepted_kv
from vllm_bole.attention.tree_attention import tree_attention, tree_slot_mapping
from vllm_bole.mamba.tree_conv import commit_conv_state, tree_conv
from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.step import commit, draft_trees, verify_tree
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.testing.oracles import (attention_tree_reference, chain_tree, conv_tree_reference, gdn_tree_reference,
                                      mamba1_tree_reference)

VOCAB, HID, W = 48, 32, 4
HK, HV, K, V = 1, 2, 16, 16
HQ, HKV, D = 2, 1, 16
DN, N1 = 16, 8  # Mamba1 channels and state
BLOCK, NBLOCKS = 8, 64
BUDGET, DEPTH = 6, 3


class ToyModel:
    """Weights and both forwards: ``tree_forward`` (core ops on the committed state, fp32) and
    ``reference_logits`` (float64 oracles on a whole chain from zero state)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s, std=1.0: torch.randn(*s, generator=g) * std  # noqa: E731
        self.C = 2 * HK * K + HV * V
        self.emb, self.w_in, self.conv_w = r(VOCAB, HID), r(HID, self.C, std=HID**-0.5), r(self.C, W, std=0.5)
        self.w_a, self.w_b = r(HID, HV, std=HID**-0.5), r(HID, HV, std=HID**-0.5)
        self.A_log, self.dt_bias = r(HV, std=0.3), r(HV, std=0.3)
        self.w_o1 = r(HV * V, HID, std=30 * (HV * V) ** -0.5)  # both layers change the argmax (ablation-checked)
        self.wq, self.wk, self.wv = (r(HID, h * D, std=HID**-0.5) for h in (HQ, HKV, HKV))
        self.w_o2 = r(HQ * D, HID, std=3 * (HQ * D) ** -0.5)
        self.w_head = r(HID, VOCAB, std=HID**-0.5)
        self.m1_in, self.m1_conv = r(HID, 2 * DN, std=HID**-0.5), r(DN, W, std=0.5)
        self.m1_dt, self.m1_B, self.m1_C = r(DN, DN, std=DN**-0.5), r(DN, N1, std=DN**-0.5), r(DN, N1, std=DN**-0.5)
        self.m1_A = -torch.exp(r(DN, N1, std=0.5))
        self.m1_D, self.m1_bias = r(DN), r(DN, std=0.3)
        self.m1_out = r(DN, HID, std=10 * DN**-0.5)

    def _mamba1_inputs(self, conv_out):
        d = conv_out.dtype
        return conv_out @ self.m1_dt.to(d), conv_out @ self.m1_B.to(d), conv_out @ self.m1_C.to(d)

    def _gdn_inputs(self, x, mixed_conv):
        q, k, v = mixed_conv.split([HK * K, HK * K, HV * V], dim=-1)
        T, d = x.shape[0], x.dtype
        g = -torch.exp(self.A_log.to(d)) * F.softplus(x @ self.w_a.to(d) + self.dt_bias.to(d))
        return q.reshape(T, HK, K), k.reshape(T, HK, K), v.reshape(T, HV, V), g, torch.sigmoid(x @ self.w_b.to(d))

    def _head(self, x):
        return 4.0 * x @ self.w_head.to(x.dtype)

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits after the last token of ``tokens``, float64, every layer by its sequential oracle."""
        tree = chain_tree(len(tokens))
        d = torch.float64
        x = self.emb[tokens].to(d)
        mixed, _ = conv_tree_reference(tree, x @ self.w_in.to(d), self.conv_w.to(d), torch.zeros(1, self.C, W - 1, dtype=d))
        q, k, v, g, beta = self._gdn_inputs(x, mixed)
        o, _ = gdn_tree_reference(tree, q, k, v, g, beta, torch.zeros(1, HV, K, V, dtype=d))
        x = x + o.reshape(-1, HV * V) @ self.w_o1.to(d)
        xi, z = (x @ self.m1_in.to(d)).chunk(2, dim=-1)
        cx, _ = conv_tree_reference(tree, xi, self.m1_conv.to(d), torch.zeros(1, DN, W - 1, dtype=d))
        dt, Bm, Cm = self._mamba1_inputs(cx)
        y, _ = mamba1_tree_reference(tree, cx, dt, self.m1_A, Bm, Cm, torch.zeros(1, DN, N1, dtype=d), D=self.m1_D, z=z,
                                     dt_bias=self.m1_bias)
        x = x + y @ self.m1_out.to(d)
        T = x.shape[0]
        qa, ka, va = (x @ w.to(d) for w in (self.wq, self.wk, self.wv))
        empty = torch.zeros(0, HKV, D, dtype=d)
        a = attention_tree_reference(tree, qa.reshape(T, HQ, D), ka.reshape(T, HKV, D), va.reshape(T, HKV, D),
                                     [empty], [empty])
        x = x + a.reshape(T, HQ * D) @ self.w_o2.to(d)
        return self._head(x)[-1]


class ToyGDN:
    """The conv + GDN layer's state (one slot per request) as a TreeLayer."""

    def __init__(self, model: ToyModel, B: int, kernels: str):
        self.m, self.kernels = model, kernels
        self.conv_state = torch.zeros(B, model.C, W - 1)
        self.state = torch.zeros(B, HV, K, V)
        self.pending = gdn.PendingPath.empty(B, DEPTH + 1, HK, HV, K, V, dtype=torch.float32)
        self.slots = torch.arange(B)

    def forward(self, tree, x):
        conv_in = x @ self.m.w_in
        mixed = tree_conv(conv_in, self.m.conv_w, self.conv_state, self.slots, tree, kernels=self.kernels)
        q, k, v, g, beta = self.m._gdn_inputs(x, mixed)
        o = gdn.gdn_tree_step(q, k, v, g, beta, tree, self.state, self.slots, self.pending, kernels=self.kernels)
        self.saved = (conv_in, k, v, g, beta)
        return o.reshape(-1, HV * V) @ self.m.w_o1

    def commit(self, tree, res):
        conv_in, k, v, g, beta = self.saved
        commit_conv_state(self.conv_state, self.slots, tree, res.last_node.long() - tree.cu_nodes[:-1].long(), conv_in,
                          kernels=self.kernels)
        gdn.stash_accepted_path(self.pending, self.slots, tree, res.accepted_nodes.to(torch.int32)[:, : DEPTH + 1],
                                k, v, g, beta, kernels=self.kernels)


class ToyMamba1:
    """The gated Mamba1 layer's conv and SSM states (one slot per request) as a TreeLayer."""

    def __init__(self, model: ToyModel, B: int, kernels: str):
        self.m, self.kernels = model, kernels
        self.conv_state = torch.zeros(B, DN, W - 1)
        self.state = torch.zeros(B, DN, N1)
        self.pending = mamba1_tree.PendingPath.empty(B, DEPTH + 1, DN, N1, dtype=torch.float32)
        self.slots = torch.arange(B)

    def forward(self, tree, x):
        m = self.m
        xi, z = (x @ m.m1_in).chunk(2, dim=-1)
        xi = xi.contiguous()
        cx = tree_conv(xi, m.m1_conv, self.conv_state, self.slots, tree, kernels=self.kernels)
        dt, Bm, Cm = m._mamba1_inputs(cx)
        y = mamba1_tree.mamba1_tree_step(cx, dt, m.m1_A, Bm, Cm, tree, self.state, self.slots, self.pending, D=m.m1_D,
                                         z=z.contiguous(), dt_bias=m.m1_bias, kernels=self.kernels)
        self.saved = (xi, cx, dt, Bm)
        return y @ m.m1_out

    def commit(self, tree, res):
        xi, cx, dt, Bm = self.saved
        commit_conv_state(self.conv_state, self.slots, tree, res.last_node.long() - tree.cu_nodes[:-1].long(), xi,
                          kernels=self.kernels)
        mamba1_tree.stash_accepted_path(self.pending, self.slots, tree, res.accepted_nodes.to(torch.int32)[:, : DEPTH + 1],
                                        cx, dt, Bm, kernels=self.kernels)


class ToyAttention:
    """The attention layer's paged KV cache (block tables per request) as a TreeLayer."""

    def __init__(self, model: ToyModel, B: int, kernels: str):
        self.m, self.kernels = model, kernels
        self.kc, self.vc = torch.zeros(NBLOCKS, BLOCK, HKV, D), torch.zeros(NBLOCKS, BLOCK, HKV, D)
        self.block_table = torch.randperm(NBLOCKS)[: B * (NBLOCKS // B)].to(torch.int32).reshape(B, -1)  # scattered blocks
        self.prefix = torch.zeros(B, dtype=torch.long)

    def forward(self, tree, x):
        T = x.shape[0]
        q, k, v = (x @ w for w in (self.m.wq, self.m.wk, self.m.wv))
        slot = tree_slot_mapping(tree, self.prefix, self.block_table, BLOCK)
        self.kc.view(-1, HKV, D)[slot], self.vc.view(-1, HKV, D)[slot] = k.reshape(T, HKV, D), v.reshape(T, HKV, D)
        o = tree_attention(q.reshape(T, HQ, D), self.kc, self.vc, self.block_table, self.prefix, tree,
                           kernels=self.kernels)
        return o.reshape(T, HQ * D) @ self.m.w_o2

    def commit(self, tree, res):
        compact_accepted_kv([self.kc], [self.vc], self.block_table, self.prefix, res.accepted_nodes.to(torch.int32),
                            kernels=self.kernels)
        self.prefix += res.num_accepted.long() + 1


class ChainDrafter:
    """Proposes, per depth, the oracle's true continuation or (when ``wrong``) a wrong token first,
    and two other candidates: the trees hold right chains, wrong chains and siblings."""

    def __init__(self, truth: list[list[int]], seed: int):
        self.truth, self.g = truth, torch.Generator().manual_seed(seed)

    def propose(self, histories, depths, keys=None) -> Candidates:
        Dm = max(depths)
        out = Candidates.empty(len(histories), Dm, 3)
        for b, (h, dep) in enumerate(zip(histories, depths)):
            for d in range(dep):
                pos = len(h) + d
                right = self.truth[b][pos] if pos < len(self.truth[b]) else 0
                others = [t for t in torch.randperm(VOCAB, generator=self.g).tolist() if t != right][:2]
                toks = others[:1] + [right] + others[1:] if torch.rand(1, generator=self.g) < 0.3 else [right] + others
                out.tokens[b, d] = torch.tensor(toks)
                out.probs[b, d] = torch.tensor([0.6, 0.25, 0.15])
        return out


PROMPTS, NEW = [[3, 17, 5, 9], [40, 2], [11, 11, 30, 7, 1, 22]], 16


@pytest.fixture(scope="module")
def oracle():
    """The toy model and its float64 greedy continuations (with margins: the test's premise, no near ties)."""
    model, truth = ToyModel(0), []
    for p in PROMPTS:
        seq = list(p)
        for _ in range(NEW + DEPTH + 1):
            lg = model.reference_logits(seq)
            top = lg.topk(2).values
            assert float(top[0] - top[1]) > 1e-3
            seq.append(int(lg.argmax()))
        truth.append(seq)
    return model, truth


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_tree_decode_step_equals_oracle_greedy(oracle, kernels):
    (model, truth), B, new, prompts = oracle, len(PROMPTS), NEW, PROMPTS
    layers = [ToyGDN(model, B, kernels), ToyMamba1(model, B, kernels), ToyAttention(model, B, kernels)]
    drafter = ChainDrafter(truth, 1)
    history = [list(p[:1]) for p in prompts]  # processed tokens + the root, which is not processed yet
    fed = [1] * B  # prompt tokens handed over so far
    emitted = [[] for _ in range(B)]
    steps = 0
    while min(len(e) for e in emitted) < new:
        decoding = [fed[b] == len(prompts[b]) for b in range(B)]
        tree, _ = draft_trees(drafter, [h[-1] for h in history], history,
                              [DEPTH if decoding[b] else 0 for b in range(B)], BUDGET, max_depth=DEPTH)
        x = model.emb[tree.token_ids.clamp(min=0)]
        for layer in layers:
            x = x + layer.forward(tree, x)
        res = verify_tree(tree, model._head(x), None)
        commit(layers, tree, res)
        for b in range(B):
            if decoding[b]:
                toks = [t for t in res.output_token_ids[b].tolist() if t >= 0]
                emitted[b] += toks
                history[b] += toks
            else:  # prompt: root-only steps, the next prompt token becomes the root
                history[b].append(prompts[b][fed[b]])
                fed[b] += 1
        steps += 1
    for b in range(B):
        assert emitted[b][:new] == truth[b][len(prompts[b]): len(prompts[b]) + new], b
    assert steps < max(map(len, prompts)) + new  # trees were accepted, not just bonus tokens
