"""Sampled tree verification on the GPU: ``verify_deterministic`` (every node's sample drawn up front, in one
launch of ``sample_logits``' kernel where no top-k / top-p / min-p applies, then greedy's one-launch walk)
against the level-by-level walk it replaced (one host sync and ~15 launches per depth; rebuilt here from
``verification._walk``), results from the same uniforms, wall time of each (host syncs included) at the e2e
engines' shapes: the pair's vocabulary (49152), temperature 1, trees of 8 and 16 nodes a request whose paths
run 3-6 deep, batch 1..128. Writes ``sampled_verify.json``: ``rows`` (keys ``batch, nodes, vocab, walk_ms,
ours_ms, twin_ms, speedup, equal, same_frac, mean_emitted``; ``twin_ms``: the same without Triton, the
loop-free torch form; ``equal``: every request's result bitwise the walk's, ``same_frac``: the share of
requests whose result is. Both draw exactly from the fp32 target distribution; they part only where a uniform
falls within rounding of a CDF interval's end, as their sums run in different orders: at f47c613, before the
kernel, the two torch forms parted at 128 requests).

    python3 benchmarks/device/check_sampled_verify.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import bench_ms, write_results  # noqa: E402

from vllm_bole.spec_decode import verification as ver  # noqa: E402
from vllm_bole.spec_decode.sampling import sample_rows  # noqa: E402
from vllm_bole.testing.oracles import random_tree_batch  # noqa: E402


def level_walk(tree, logits, temperature, generator):
    """The level loop ``verify_deterministic`` ran until c44c979."""
    u = ver._node_uniforms(tree, generator, 2, logits.device)[:, 1]
    tokens = tree.token_ids.to(logits.device)

    def decide(A, nodes, kids, p):
        x = sample_rows(p, u[nodes])
        match = (kids >= 0) & (tokens[kids.clamp(min=0)] == x[:, None])
        has = match.any(1)
        child = torch.where(has, kids.gather(1, match.int().argmax(1)[:, None])[:, 0], torch.full_like(x, -1))
        return child, x

    return ver._walk(tree, logits, temperature, None, None, None, decide)


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V, rows = 49152, []
    g = torch.Generator().manual_seed(0)
    for N in (8, 16):
        for B in (1, 8, 32, 128) if dev == "cuda" else (2,):
            tree = random_tree_batch([N] * B, kind="random", generator=g, token_vocab=V, max_depth=8).to(dev)
            logits = torch.randn(tree.num_nodes, V, generator=g).to(dev)
            par, tok = tree.parent_flat.long(), tree.token_ids.long()
            kid = par >= 0
            logits[par[kid], tok[kid]] += 14.0  # the target mostly agrees with a child: paths run deep
            temp = torch.ones(B, device=dev)
            a = level_walk(tree, logits, temp, 7)
            b = ver.verify_deterministic(tree, logits, temperature=temp, generator=7)
            same = ((a.output_token_ids == b.output_token_ids).all(1) & (a.accepted_nodes == b.accepted_nodes).all(1)
                    & (a.last_node == b.last_node))
            if dev == "cuda":
                walk = bench_ms(lambda: level_walk(tree, logits, temp, None), graph=False)
                ours = bench_ms(lambda: ver.verify_deterministic(tree, logits, temperature=temp), graph=False)
                twin = bench_ms(lambda: ver.verify_deterministic(tree, logits, temperature=temp, kernels="torch"),
                                graph=False)
            else:
                walk = ours = twin = float("nan")
            rows.append(dict(batch=B, nodes=N, vocab=V, walk_ms=walk, ours_ms=ours, twin_ms=twin, speedup=walk / ours,
                             equal=bool(same.all()),
                             same_frac=float(same.float().mean()),
                             mean_emitted=float(b.num_emitted.float().mean())))
            print(rows[-1], flush=True)
    print(write_results("sampled_verify.json", rows))


if __name__ == "__main__":
    main()
