"""vLLM's sampling parameters applied to tree nodes: the constraints vLLM's sampler applies before
temperature (per node, each node seeing its own context), the per-request sampling of the
verification, and the logprobs of the emitted tokens in vLLM's layout."""
from __future__ import annotations

import torch

from vllm_bole.adapter.tree_step import TreeStep
from vllm_bole.spec_decode.sampling import SAMPLING_EPS
from vllm_bole.spec_decode.step import Sampling
from vllm_bole.transfer import upload


def supports_tree(sp) -> bool:
    """Sampling parameters tree verification reproduces exactly (else: no drafts, vLLM's path).
    Penalties, logit bias, bad words, allowed tokens, min_tokens and min_p are applied per node
    (:func:`constrain`); structured output is not."""
    if sp is None:
        return False
    return (
        getattr(sp, "structured_outputs", None) is None
        and not getattr(sp, "logprob_token_ids", None)
        and (sp.logprobs is None or sp.logprobs >= 0)
    )


def tree_sampling(params: list, generators: list) -> Sampling | None:
    """The verification's per-request sampling (None when every request is greedy). top-k / top-p / min-p
    are None when no request uses them (as vLLM's sampler skips them): top-k and top-p sort the vocabulary
    per visited node and level, 0.2-0.4 ms a level on the H200 at 128 requests."""
    temps = [float(sp.temperature) for sp in params]
    if all(t < SAMPLING_EPS for t in temps):
        return None
    top_k = [max(int(sp.top_k or 0), 0) for sp in params]
    top_p = [float(sp.top_p) if sp.top_p is not None else 1.0 for sp in params]
    min_p = [float(getattr(sp, "min_p", 0.0) or 0.0) for sp in params]
    return Sampling(temperature=torch.tensor(temps), top_k=torch.tensor(top_k) if any(top_k) else None,
                    top_p=torch.tensor(top_p) if min(top_p) < 1.0 else None,
                    min_p=torch.tensor(min_p) if any(min_p) else None, generators=generators)


def constrain(input_batch, step: TreeStep, logits: torch.Tensor, params: list) -> torch.Tensor:
    """vLLM's sampler constraints before temperature, per tree node, in vLLM's order: allowed
    tokens, bad words, min_tokens, logit bias, then repetition / frequency / presence penalties.
    Node ``i`` of request ``r`` sees the request's output tokens (its root last) followed by the
    draft tokens on its path (depth ``1 .. depth(i)``), exactly what non-speculative decoding
    would have seen there. ``logits`` ``[T, V]`` float32, modified in place and returned;
    ``params``: the tree requests' ``SamplingParams``."""
    ib = input_batch
    md = ib.sampling_metadata
    min_tokens = any(p.min_tokens for p in params)
    if (md.allowed_token_ids_mask is None and not md.bad_words_token_ids and md.no_penalties and not min_tokens
            and not any(p.logit_bias for p in params)):
        return logits  # nothing to apply (the usual step: no host work)
    tree = step.host_tree  # the bookkeeping on the host (no device syncs); logits stay where they are
    req = tree.request_index.long()
    rows = torch.tensor(step.rows, dtype=torch.long)[req]  # persistent-batch row of every node
    ctx: list[list[int]] = []
    if md.bad_words_token_ids or not md.no_penalties or min_tokens:
        outs = [ib.token_ids_cpu[i, int(ib.num_prompt_tokens[i]) : int(ib.num_tokens_no_spec[i])].tolist()
                for i in step.rows]
        toks, path, depth = tree.token_ids.tolist(), tree.path, tree.depth.tolist()
        cu = tree.cu_nodes.tolist()
        for i, r in enumerate(req.tolist()):
            ctx.append(outs[r] + [toks[cu[r] + int(j)] for j in path[i, 1 : depth[i] + 1]])
    if md.allowed_token_ids_mask is not None:
        logits.masked_fill_(md.allowed_token_ids_mask[rows.to(md.allowed_token_ids_mask.device)], -float("inf"))
    if md.bad_words_token_ids:
        from vllm.v1.sample.ops.bad_words import apply_bad_words

        words = {i: md.bad_words_token_ids[row] for i, row in enumerate(rows.tolist()) if row in md.bad_words_token_ids}
        apply_bad_words(logits, words, ctx)
    for i, r in enumerate(req.tolist() if min_tokens else ()):
        sp = params[r]
        if sp.min_tokens and len(ctx[i]) < sp.min_tokens and sp.all_stop_token_ids:
            logits[i, list(sp.all_stop_token_ids)] = -float("inf")
    for r, sp in enumerate(params):
        if sp.logit_bias:
            ids = torch.tensor([int(t) for t in sp.logit_bias], device=logits.device)
            bias = torch.tensor(list(sp.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            s, e = int(tree.cu_nodes[r]), int(tree.cu_nodes[r + 1])
            logits[s:e, ids] += bias
    if not md.no_penalties:
        from vllm.v1.sample.ops.penalties import apply_all_penalties

        dev_rows = rows.to(md.presence_penalties.device)
        logits = apply_all_penalties(logits, md.prompt_token_ids[dev_rows], md.presence_penalties[dev_rows],
                                     md.frequency_penalties[dev_rows], md.repetition_penalties[dev_rows], ctx)
    return logits


def emitted_logprobs(sampler, logprobs_mode: str, logits, num_plain: int, tree, result, grid, k: int):
    """Logprobs of every emitted token in vLLM's flattened ``[num_reqs * width]`` layout: plain rows
    from their last position, tree rows from the accepted nodes (``grid``: the emitted tokens)."""
    num_reqs, width = grid.shape
    rows = torch.zeros(num_reqs, width, dtype=torch.long)
    rows[:num_plain, :] = torch.arange(num_plain)[:, None]
    acc = result.accepted_nodes.long().cpu()
    rows[num_plain:] = torch.where(acc >= 0, acc + tree.cu_nodes[:-1, None].long().cpu(), torch.zeros_like(acc)) \
        + num_plain
    sel = logits[upload(rows.flatten(), logits.device)]
    lp = sampler.compute_logprobs(sel) if logprobs_mode == "raw_logprobs" else sel.float()
    return sampler.gather_logprobs(lp, k, upload(grid.clamp(min=0).flatten(), logits.device))
