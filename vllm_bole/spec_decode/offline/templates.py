"""Static-template instantiation (offline tools): top-k children (:func:`build_static`) and
sampled children for recursive rejection sampling (:func:`build_sampled`), from a one-pass
drafter's dense ``marginals [B, D, V]`` or an autoregressive ``step_fn``.

* **Sampled children**: the template's shape, but the ``r``-th child of a node is the ``r``-th
  draw from the parent's draft distribution ``q``: i.i.d. draws (``replacement=True``, SpecInfer;
  duplicate tokens stay separate siblings) or draws without replacement (Sequoia; if ``q`` has
  fewer than ``k`` tokens of positive mass the missing children and their subtrees are dropped,
  giving ragged trees). Siblings are stored in draw order, which is the order verification tries
  them in. Sampling uses one uniform per draw (:mod:`vllm_bole.spec_decode.sampling`).
"""
from __future__ import annotations

import math

import torch

from vllm_bole.spec_decode.offline.static import StaticTree
from vllm_bole.spec_decode.offline.trees import CHILDREN_DETERMINISTIC, CHILDREN_WITH_REPLACEMENT, \
    CHILDREN_WITHOUT_REPLACEMENT, DraftTree, Frontier, StepFn, as_tokens, call_step, check_drafter, finalize
from vllm_bole.spec_decode.sampling import sample_rows, sample_rows_without_replacement, uniforms

__all__ = ["build_sampled", "build_static"]


def _from_template(template: StaticTree, root_tokens, marginals, step_fn, mode: str, generator, keep_dists: bool):
    """mode: 'topk' | 'with' | 'without'."""
    root = as_tokens(root_tokens)
    B = root.numel()
    check_drafter(marginals, step_fn, B)
    device = marginals.device if marginals is not None else root.device
    root = root.to(device)
    if mode != "topk" and not template.contiguous_ranks:
        raise ValueError("sampled children need sibling ranks 0..k-1 (draw order)")
    ttree = template.tree()
    M = template.num_nodes
    tpath = ttree.path.long().to(device)
    par = torch.tensor(template.parents, dtype=torch.long, device=device)
    rk = torch.tensor(template.ranks, dtype=torch.long, device=device)
    token = torch.zeros(B, M, dtype=torch.long, device=device)
    token[:, 0] = root
    valid = torch.zeros(B, M, dtype=torch.bool, device=device)
    valid[:, 0] = True
    qprob = torch.ones(B, M, dtype=torch.float32, device=device)
    logrho = torch.zeros(B, M, dtype=torch.float64, device=device)
    row = torch.full((B, M), -1, dtype=torch.long, device=device)
    tables: list[torch.Tensor] = []
    n_rows = 0
    if marginals is not None:
        D, V = marginals.shape[1], marginals.shape[2]
        if template.max_depth > D:
            raise ValueError(f"template depth {template.max_depth} exceeds the drafter's {D} marginals")
        if mode == "topk" and M > 1:
            kmax = min(max(template.ranks[1:]) + 1, V)
            top_v, top_i = marginals.topk(kmax, dim=-1)  # [B, D, kmax]
    bidx = torch.arange(B, device=device)
    depths = template.depths
    for d in range(template.max_depth):
        # the level's structure comes from the (host-side) template: no device sync
        kid_list = [i for i in range(M) if depths[i] == d + 1]
        exp_list = sorted({template.parents[i] for i in kid_list})
        E = len(exp_list)
        k = max(template.ranks[i] for i in kid_list) + 1
        pos = {j: e for e, j in enumerate(exp_list)}
        kids = torch.tensor(kid_list, dtype=torch.long, device=device)
        kpar, krank = par[kids], rk[kids]
        expanders = torch.tensor(exp_list, dtype=torch.long, device=device)
        ke = torch.tensor([pos[template.parents[i]] for i in kid_list], dtype=torch.long, device=device)
        fmask = valid[:, expanders]  # [B, E]
        if not bool(fmask.any()):
            break
        g_tok = torch.zeros(B, E, k, dtype=torch.long, device=device)
        g_q = torch.zeros(B, E, k, dtype=torch.float32, device=device)
        g_ok = torch.zeros(B, E, k, dtype=torch.bool, device=device)
        if marginals is not None:
            q_rows = marginals[:, d]  # [B, V] children of any depth-d node
            if mode == "topk":
                kk = min(k, top_v.shape[-1])
                g_tok[:, :, :kk] = top_i[:, d, None, :kk]
                g_q[:, :, :kk] = top_v[:, d, None, :kk].float()
                g_ok[:, :, :kk] = True
            else:
                u = uniforms((B, E, k), generator, device, torch.float64)
                if mode == "with":
                    t = sample_rows(q_rows, u.reshape(B, E * k)).view(B, E, k)
                    okk = torch.ones_like(t, dtype=torch.bool)
                else:
                    t, okk = sample_rows_without_replacement(q_rows, u)
                g_tok, g_ok = t, okk
                g_q = q_rows.float().gather(1, t.reshape(B, -1)).view(B, E, k)
            row[:, expanders] = torch.where(fmask, (bidx * D + d)[:, None], row[:, expanders])
        else:
            fb, fe = fmask.nonzero(as_tuple=True)
            fj = expanders[fe]
            fr = Frontier(
                request=fb,
                node_id=fj,
                parent_id=par[fj],
                token=token[fb, fj],
                depth=d,
                path_tokens=token[fb[:, None], tpath[fj, : d + 1]],
            )
            probs = call_step(step_fn, fr)
            F, V = probs.shape
            if mode == "topk":
                kk = min(k, V)
                v, t = probs.topk(kk, dim=-1)
                okk = torch.ones_like(t, dtype=torch.bool)
                if kk < k:
                    pad = k - kk
                    v = torch.cat([v, v.new_zeros(F, pad)], 1)
                    t = torch.cat([t, t.new_zeros(F, pad)], 1)
                    okk = torch.cat([okk, okk.new_zeros(F, pad)], 1)
            else:
                u = uniforms((F, 1, k), generator, device, torch.float64)
                if mode == "with":
                    t = sample_rows(probs, u[:, 0])
                    okk = torch.ones_like(t, dtype=torch.bool)
                else:
                    t, okk = sample_rows_without_replacement(probs, u)
                    t, okk = t[:, 0], okk[:, 0]
                v = probs.float().gather(1, t)
            g_tok[fb, fe], g_q[fb, fe], g_ok[fb, fe] = t, v.float(), okk
            if keep_dists:
                row[fb, fj] = n_rows + torch.arange(F, device=device)
                tables.append(probs)
                n_rows += F
        sel = (slice(None), ke, krank)  # ke: expander position of each kid's parent
        kt, kq, kok = g_tok[sel], g_q[sel], g_ok[sel] & valid[:, kpar]
        token[:, kids] = torch.where(kok, kt, torch.zeros_like(kt))
        valid[:, kids] = kok
        qprob[:, kids] = torch.where(kok, kq, torch.zeros_like(kq))
        logrho[:, kids] = torch.where(kok, logrho[:, kpar] + kq.double().log(), torch.full_like(logrho[:, kpar], -math.inf))
    parent = par[None, :].expand(B, M)
    src = torch.arange(M, device=device)[None, :].expand(B, M)
    tree, ex = finalize(token, parent, valid, {"q": qprob, "lr": logrho, "row": row, "src": src}, ttree)
    if marginals is not None:
        table = marginals.reshape(-1, marginals.shape[-1])
    else:
        table = torch.cat(tables, 0) if tables else None
    keep = marginals is not None or keep_dists
    children = {"topk": CHILDREN_DETERMINISTIC, "with": CHILDREN_WITH_REPLACEMENT,
                "without": CHILDREN_WITHOUT_REPLACEMENT}[mode]
    return DraftTree(
        tree=tree,
        draft_probs=ex["q"],
        scores=ex["lr"].exp(),
        children=children,
        child_dist_table=table if keep else None,
        child_dist_index=ex["row"] if keep else None,
        source_ids=ex["src"],
    )


def build_static(template: StaticTree, root_tokens: torch.Tensor, *, marginals: torch.Tensor | None = None,
                 step_fn: StepFn | None = None, keep_dists: bool = True) -> DraftTree:
    """Instantiate a static template (chain, k-ary, Sequoia-optimal): the node of rank ``r``
    under a node of depth ``d`` takes the ``r``-th most probable token of its parent's draft
    distribution (``marginals[b, d]`` for a one-pass drafter, ``step_fn`` output for an
    autoregressive one, called once per depth level). Children are deterministic."""
    return _from_template(template, root_tokens, marginals, step_fn, "topk", None, keep_dists)


def build_sampled(
    template: StaticTree,
    root_tokens: torch.Tensor,
    *,
    marginals: torch.Tensor | None = None,
    step_fn: StepFn | None = None,
    replacement: bool = True,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """Template shape with *sampled* children for recursive rejection sampling: the ``r``-th
    child of a node is the ``r``-th draw from the node's draft distribution, i.i.d.
    (``replacement=True``, SpecInfer) or without replacement (Sequoia; exhausted draws are
    dropped with their subtrees). The draft distributions are kept for verification."""
    mode = "with" if replacement else "without"
    return _from_template(template, root_tokens, marginals, step_fn, mode, generator, True)
