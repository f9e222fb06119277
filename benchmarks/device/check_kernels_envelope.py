"""Every tree kernel over the advertised envelope against the float64 sequential oracles (issue 14).

Run on the H200 (torch + triton, no vLLM; about 130 kernel compilations, expected 1-3 minutes):
    python benchmarks/device/check_kernels_envelope.py                 # writes $OUT/kernel_envelope.json
    TRITON_INTERPRET=1 python benchmarks/device/check_kernels_envelope.py --cpu-smoke   # CPU: a tiny subset

Envelope (``TreeBatch``: 1..256 nodes per request, depth 1..64, ragged batches, root-only
requests): trees at the boundaries (N = 64, 65, 128, 129, 256 random; chains of depth 63 and 64;
a ragged batch with root-only requests), with the Triton kernels (``kernels="triton"``):
  gdn         verify, then stash of each request's deepest path + commit: K, V in {64, 128, 256},
              V = 96 and 80 (multiples of 16); every boundary tree and dtype at Qwen3-Next's 128;
  ssd         verify + commit: head_dim {32, 64, 128} x d_state {16, 64, 128, 256} (n_groups 2,
              fp32), n_groups {1, 8}; every boundary tree and dtype at the Nemotron-H shape
              (64, 128, 8 groups) and at (128, 256, 1 group);
  conv        tree conv (width 4) + conv-state commit;
  attention   tree attention over a paged cache (prefix 300) + accepted-path KV compaction.
dtype "float32": fp32 inputs and states; "bfloat16": bf16 inputs and bf16 states (vLLM 0.33's
default for the Qwen3-Next GDN state); "bfloat16/fp32-state": bf16 inputs, fp32 states. The
oracle reads exactly the (rounded) values the kernel reads. Outputs are poisoned (NaN) where the
API takes ``out``; one unused state slot holds NaN and must stay NaN.

Rows: kernel, dtype, N (largest tree of the batch), depth (deepest node), dims, max_rel_err_out /
max_rel_err_state (largest per-request ||x - ref|| / ||ref||; the state after the commit, or the
conv state / compacted K/V), ok (finite and within the dtype's bound, ``TOL``). A case that
raises is a row with ok=false and its ``error``; the script itself never fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from benchmarks.harness import write_results  # noqa: E402
from vllm_bole.spec_decode.tree import TreeBatch  # noqa: E402
from vllm_bole.testing import oracles as O  # noqa: E402

KERNELS = dict(kernels="triton")
# dtype -> (outputs, states) bound on the largest per-request relative error. fp32 runs tf32
# tensor-core products on the GPU (about 1e-3); bf16 operands and bf16 storage about 4e-3.
TOL = {"float32": (5e-3, 5e-3), "bfloat16": (3e-2, 2e-2), "bfloat16/fp32-state": (3e-2, 5e-3)}
DTYPES = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
          "bfloat16/fp32-state": (torch.bfloat16, torch.float32)}


# ------------------------------------------------------------------------------------- trees
def trees(smoke: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    rnd = lambda n, d=16, kind="random": O.random_tree(n, max_depth=d, kind=kind, generator=gen)  # noqa: E731
    chain = lambda n: list(range(-1, n - 1))  # noqa: E731
    if smoke:
        return {"N65_chain64": [chain(65)], "ragged_N129": [rnd(129), [-1], rnd(9), [-1]]}
    return {
        "N64": [rnd(64), rnd(64)], "N65": [rnd(65), rnd(40)], "N128": [rnd(128, 32)], "N129": [rnd(129), rnd(3)],
        "N256": [rnd(256, 64, "deep")], "chain63": [chain(64)], "chain64": [chain(65), chain(2)],
        "ragged": [rnd(256, 24), [-1], rnd(65), [-1], rnd(17), chain(33)],
    }


def per_request_err(x, ref, cu) -> float:
    """Largest ||x - ref|| / ||ref|| over the requests' row ranges (NaN if x is not finite)."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("nan")
    errs = [float((x[s:e] - ref[s:e]).norm() / ref[s:e].norm().clamp(min=1e-30)) for s, e in zip(cu[:-1], cu[1:])]
    return max(errs)


def slot_cache(B, row, scale, dtype, gen, dev):
    """(cache [B + 1, *row] random, slots [B] int32 of the requests, the unused slot), that slot
    holding NaN: it must never be read or written."""
    cache = (torch.randn(B + 1, *row, generator=gen) * scale).to(dev, dtype)
    slots = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    unused = [s for s in range(B + 1) if s not in slots.tolist()]
    cache[unused] = float("nan")
    return cache, slots.to(dev), unused


def draws(tree, seed, dev):
    """(T, B, gen, r): the tree's node and request counts, a generator seeded ``seed`` and
    ``r(*shape)``, standard normals from it on ``dev``."""
    gen = torch.Generator().manual_seed(seed)
    return tree.num_nodes, tree.num_requests, gen, lambda *s: torch.randn(*s, generator=gen).to(dev)


def errors(out, out_ref, tree, cache, slots, unused, states_ref, last):
    """(outputs' error, the committed slots' error against the reference states at ``last``,
    whether the unused slot is still NaN)."""
    err_s = per_request_err(cache[slots.long()], states_ref[last.to(cache.device)], list(range(slots.numel() + 1)))
    return per_request_err(out, out_ref, tree.cu_nodes.tolist()), err_s, bool(torch.isnan(cache[unused]).all())


# --------------------------------------------------------------------------------------- GDN
def check_gdn(tree, dims, dtype, dev):
    from vllm_bole.gdn import PendingPath, gdn_tree_step, stash_accepted_path

    Hk, Hv, K, V = dims
    dt, sdt = DTYPES[dtype]
    T, B, gen, r = draws(tree, 1, dev)
    q, k, v = r(T, Hk, K).to(dt), r(T, Hk, K).to(dt), r(T, Hv, V).to(dt)
    g = -torch.rand(T, Hv, generator=gen).to(dev) * 0.3
    beta = torch.rand(T, Hv, generator=gen).to(dev)
    state, slots, unused = slot_cache(B, (Hv, K, V), 0.1, sdt, gen, dev)
    o_ref, st = O.gdn_tree_reference(tree, q, k, v, g, beta, state[slots.long()])
    o = torch.full((T, Hv, V), float("nan"), dtype=dt, device=dev)
    gdn_tree_step(q, k, v, g, beta, tree, state, slots, out=o, **KERNELS)
    acc, last = O.deepest_accepted_paths(tree.to("cpu"))
    pend = PendingPath.empty(B + 1, tree.max_depth + 1, Hk, Hv, K, V, dtype=dt, device=dev)
    stash_accepted_path(pend, slots, tree, acc.to(dev), k, v, g, beta, **KERNELS)
    gdn_tree_step(None, None, None, None, None, None, state, slots, pend, **KERNELS)
    return errors(o, o_ref, tree, state, slots, unused, st, last)


# --------------------------------------------------------------------------------------- SSD
def check_ssd(tree, dims, dtype, dev):
    from vllm_bole.mamba.ssd_tree import PendingPath, ssd_tree_step, stash_accepted_path

    H, G, P, N = dims
    dt, sdt = DTYPES[dtype]
    T, B, gen, r = draws(tree, 2, dev)
    x, dtr = r(T, H, P).to(dt), r(T, H).to(dt)
    Bm, Cm = (r(T, G, N) * 0.3).to(dt), (r(T, G, N) * 0.3).to(dt)
    A = -(torch.rand(H, generator=gen) + 0.1).to(dev)
    kw = dict(D=r(H), dt_bias=r(H) * 0.3)
    state, slots, unused = slot_cache(B, (H, P, N), 0.3, sdt, gen, dev)
    y_ref, st = O.ssd_tree_reference(tree, x, dtr, A, Bm, Cm, state[slots.long()], **kw)
    y = torch.full((T, H, P), float("nan"), dtype=dt, device=dev)
    ssd_tree_step(x, dtr, A, Bm, Cm, tree, state, slots, out=y, **kw, **KERNELS)
    acc, last = O.deepest_accepted_paths(tree.to("cpu"))
    pend = PendingPath.empty(B + 1, tree.max_depth + 1, H, G, P, N, dtype=dt, device=dev)
    stash_accepted_path(pend, slots, tree, acc.to(dev), x, dtr, Bm, **KERNELS)
    ssd_tree_step(None, None, A, None, None, None, state, slots, pend, dt_bias=kw["dt_bias"], **KERNELS)
    return errors(y, y_ref, tree, state, slots, unused, st, last)


# -------------------------------------------------------------------------------------- conv
def check_conv(tree, dims, dtype, dev):
    from vllm_bole.mamba.tree_conv import commit_conv_state, tree_conv

    C, W = dims
    dt, sdt = DTYPES[dtype]
    T, B, gen, _ = draws(tree, 3, dev)
    x = torch.randn(T, C, generator=gen).to(dev, dt)
    w, bias = torch.randn(C, W, generator=gen).to(dev, dt), torch.randn(C, generator=gen).to(dev, dt)
    cs, slots, unused = slot_cache(B, (C, W - 1), 1.0, sdt, gen, dev)
    y = tree_conv(x, w, cs, slots, tree, bias=bias, **KERNELS)
    y_ref, st = O.conv_tree_reference(tree, x, w, cs[slots.long()], bias=bias)
    _, last = O.deepest_accepted_paths(tree.to("cpu"))
    commit_conv_state(cs, slots, tree, (last - tree.cu_nodes[:-1].cpu().long()).to(dev), x, **KERNELS)
    return errors(y, y_ref, tree, cs, slots, unused, st, last)


# --------------------------------------------------------------------------------- attention
def check_attention(tree, dims, dtype, dev, prefix=300, bs=16):
    from vllm_bole.attention.tree_attention import (
        accepted_path, compact_accepted_kv, tree_attention, tree_slot_mapping, write_tree_kv,
    )

    Hq, Hkv, D = dims
    dt = DTYPES[dtype][0]
    T, B, gen, _ = draws(tree, 4, dev)
    sizes = tree.nodes_per_request.tolist()
    P = torch.tensor([prefix + 7 * r for r in range(B)], dtype=torch.int32)
    nblk = [(int(p) + n + bs - 1) // bs for p, n in zip(P, sizes)]
    perm = torch.randperm(sum(nblk) + 2, generator=gen)
    bt = torch.zeros(B, max(nblk), dtype=torch.int32)
    c = 0
    for b in range(B):
        bt[b, : nblk[b]] = perm[c : c + nblk[b]]
        c += nblk[b]
    kv = torch.randn(sum(nblk) + 2, 2, bs, Hkv, D, generator=gen).to(dev, dt)
    kc, vc = kv.unbind(1)
    q = torch.randn(T, Hq, D, generator=gen).to(dev, dt)
    k, v = (torch.randn(T, Hkv, D, generator=gen).to(dev, dt) for _ in range(2))
    P, bt = P.to(dev), bt.to(dev)
    write_tree_kv(k, v, kc, vc, tree_slot_mapping(tree, P, bt, bs))
    kp, vp = [], []
    for b in range(B):
        pos = torch.arange(int(P[b]), device=dev)
        blk = bt[b].long()[pos // bs]
        kp.append(kc[blk, pos % bs].cpu())
        vp.append(vc[blk, pos % bs].cpu())
    out = torch.full_like(q, float("nan"))
    tree_attention(q, kc, vc, bt, P, tree, out=out, max_kv_len=int(P.max()) + tree.max_nodes, **KERNELS)
    ref = O.attention_tree_reference(tree.to("cpu"), q.cpu(), k.cpu(), v.cpu(), kp, vp)
    _, last = O.deepest_accepted_paths(tree.to("cpu"))
    acc = accepted_path(tree, (last - tree.cu_nodes[:-1].cpu().long()).to(dev))
    compact_accepted_kv(kc, vc, bt, P, acc, **KERNELS)
    errs = []
    for b in range(B):  # after compaction: positions P .. P + m - 1 hold the path's K/V
        path = [x for x in acc[b].tolist() if x >= 0]
        pos = torch.arange(int(P[b]), int(P[b]) + len(path), device=dev)
        blk = bt[b].long()[pos // bs]
        want = k[int(tree.cu_nodes[b]) + torch.tensor(path, device=dev)]
        errs.append(0.0 if torch.equal(kc[blk, pos % bs], want) else 1.0)
    return per_request_err(out.cpu(), ref, tree.cu_nodes.tolist()), max(errs), True


# ------------------------------------------------------------------------------------- cases
def cases(smoke: bool):
    """(kernel, dims, tree names, dtypes). Kept to about 130 kernel compilations (the run's main
    cost): the dims grids run in fp32 on the ragged batch (blocked form, pending paths of up to 25
    tokens) and the N = 64 trees (one block); every boundary tree and dtype at the shipped shapes."""
    tr = list(trees(smoke))
    if smoke:
        f32 = ["float32"]
        return [
            ("gdn", (1, 2, 64, 96), tr, f32), ("gdn", (1, 1, 256, 256), tr[:1], f32),
            ("ssd", (2, 2, 32, 256), tr, f32), ("ssd", (8, 8, 64, 16), tr[1:], f32),
            ("conv", (40, 4), tr, f32), ("attention", (4, 2, 32), tr, f32),
        ]
    every, f32, bf16 = ["float32", "bfloat16", "bfloat16/fp32-state"], ["float32"], ["bfloat16"]
    few = ["N64", "N129", "chain64", "ragged"]
    out = [("gdn", (1, 2, 128, 128), tr, every), ("gdn", (1, 2, 128, 96), tr, f32), ("gdn", (1, 2, 64, 64), few, f32),
           ("gdn", (1, 2, 256, 256), few, f32 + bf16), ("gdn", (1, 2, 64, 80), few, f32 + bf16)]
    for P in (32, 64, 128):
        for N in (16, 64, 128, 256):
            out.append(("ssd", (4, 2, P, N), ["N64", "ragged"], f32))
    out += [("ssd", (8, 1, 64, 128), ["N64", "ragged"], f32), ("ssd", (8, 8, 64, 128), tr, every),
            ("ssd", (2, 1, 128, 256), tr, every)]
    out += [("conv", (256, 4), tr, f32 + bf16), ("attention", (16, 2, 256), tr, f32 + bf16),
            ("attention", (8, 8, 128), ["N64", "N129", "ragged"], f32)]
    return out


CHECKS = {"gdn": check_gdn, "ssd": check_ssd, "conv": check_conv, "attention": check_attention}
DIM_NAMES = {"gdn": ("Hk", "Hv", "K", "V"), "ssd": ("H", "G", "head_dim", "d_state"), "conv": ("C", "W"),
             "attention": ("Hq", "Hkv", "D")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny subset on CPU (needs TRITON_INTERPRET=1)")
    ap.add_argument("--kernels", default="triton", choices=["triton", "torch"], help="torch: the same checks on the twins")
    args = ap.parse_args()
    KERNELS["kernels"] = args.kernels
    t0 = time.time()
    dev = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    built = {name: TreeBatch.from_parents(par).to(dev) for name, par in trees(args.cpu_smoke).items()}
    rows = []
    for kernel, dims, names, dtypes in cases(args.cpu_smoke):
        label = " ".join(f"{n}={d}" for n, d in zip(DIM_NAMES[kernel], dims))
        for name in names:
            tree = built[name]
            for dtype in dtypes:
                row = dict(kernel=kernel, dtype=dtype, N=tree.max_nodes, depth=tree.max_depth, dims=label,
                           max_rel_err_out=None, max_rel_err_state=None, ok=False)
                try:
                    e_out, e_state, untouched = CHECKS[kernel](tree, dims, dtype, dev)
                    tol_o, tol_s = TOL[dtype]
                    row.update(max_rel_err_out=e_out, max_rel_err_state=e_state,
                               ok=bool(e_out <= tol_o and e_state <= tol_s and untouched))
                    if not untouched:
                        row["error"] = "an unused state slot was written"
                except Exception as e:  # noqa: BLE001 - every failure becomes a row, the run goes on
                    where = traceback.extract_tb(e.__traceback__)[-1]
                    msg = str(e).splitlines()[0][:300] if str(e) else ""
                    row["error"] = f"{type(e).__name__}: {msg} ({os.path.basename(where.filename)}:{where.lineno})"
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                eo, es = row["max_rel_err_out"], row["max_rel_err_state"]
                print(f"{kernel:9s} {dtype:20s} {name:12s} N={row['N']:3d} depth={row['depth']:2d} {label:32s} "
                      f"out {eo if eo is None else f'{eo:.1e}'} state {es if es is None else f'{es:.1e}'} "
                      f"{'ok' if row['ok'] else 'FAIL ' + row.get('error', '')}", flush=True)
        if not args.cpu_smoke:  # rewritten after every case: an outer timeout keeps the rows checked so far
            path = write(rows, t0, args, complete=False)
    if args.cpu_smoke and not os.environ.get("OUT"):
        print(f"cpu smoke: {sum(r['ok'] for r in rows)}/{len(rows)} ok in {time.time() - t0:.0f} s (no file written)")
        return
    path = write(rows, t0, args, complete=True)
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} ok in {time.time() - t0:.0f} s -> {path}")


def write(rows: list[dict], t0: float, args, complete: bool) -> str:
    """``kernel_envelope.json``: the rows, their pass count, and ``complete`` (false: cut before the last case)."""
    passed = sum(r["ok"] for r in rows)
    return write_results("kernel_envelope.json", rows, dict(
        passed=passed, failed=len(rows) - passed, complete=complete, tolerances=TOL, cpu_smoke=args.cpu_smoke,
        kernels=args.kernels, wall_s=time.time() - t0))


if __name__ == "__main__":
    main()
