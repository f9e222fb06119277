"""Greedy tree verification in one launch (Triton): the accepted path of every request from the
target's pick at every node.

One program per request. It holds the request's parent and token vectors ([NP], NP = the largest
tree rounded up to a power of two) and walks from the root: at depth d the current node's pick
``choice[node]`` is emitted, and the walk moves to the FIRST child (smallest local index) whose
token equals it; it stops where no child matches (the pick there is the bonus token). Writes the
``VerificationResult`` rows: tokens emitted (accepted drafts, then the bonus; -1 padded), their
count, the accepted local nodes (root first, -1 padded) and the flat index of the last one.

The torch twin (several dozen vectorised operations, no loop) is
``vllm_bole.spec_decode.verification._descend_by_choice``; the API is ``verify_greedy`` there.
"""
import triton
import triton.language as tl


@triton.jit
def greedy_walk_kernel(choice, token_ids, parent, cu_nodes, out, num_emitted, accepted, last_node,
                       W, NP: tl.constexpr):
    b = tl.program_id(0)
    bos = tl.load(cu_nodes + b).to(tl.int64)
    n = tl.load(cu_nodes + b + 1).to(tl.int64) - bos
    o_r = tl.arange(0, NP)
    rm = o_r < n
    par = tl.load(parent + bos + o_r, mask=rm, other=-1)
    tok = tl.load(token_ids + bos + o_r, mask=rm, other=-1)
    row = b.to(tl.int64) * W
    tl.store(accepted + row, 0)
    cur = 0
    done = 0
    m = 0
    for d in range(0, W):
        if done == 0:
            pick = tl.load(choice + bos + cur)
            tl.store(out + row + d, pick)
            nxt = tl.min(tl.where((par == cur) & (tok == pick), o_r, NP))
            if nxt < NP:
                cur = nxt
                tl.store(accepted + row + d + 1, nxt.to(tl.int64))
            else:
                m = d
                done = 1
    tl.store(num_emitted + b, (m + 1).to(tl.int64))
    tl.store(last_node + b, bos + cur)


def greedy_walk(tree, choice):
    """``choice`` [T] int64 (the target's pick at every node) -> (output_token_ids [B, L + 1],
    num_emitted [B], accepted_nodes [B, L + 1], last_node [B]), int64, on choice's device."""
    import torch

    B, W = tree.num_requests, tree.max_depth + 1
    dev = choice.device
    out = torch.full((B, W), -1, dtype=torch.int64, device=dev)
    accepted = torch.full((B, W), -1, dtype=torch.int64, device=dev)
    num_emitted = torch.empty(B, dtype=torch.int64, device=dev)
    last = torch.empty(B, dtype=torch.int64, device=dev)
    NP = max(2, triton.next_power_of_2(tree.max_nodes))
    greedy_walk_kernel[(B,)](choice.contiguous(), tree.token_ids, tree.parent, tree.cu_nodes, out, num_emitted,
                             accepted, last, W, NP=NP)
    return out, num_emitted, accepted, last
