"""The MTP head's teacher forcing, A/B on the CPU (2026-12-05): the same head, seed, windows and steps trained
feeding the target's greedy tokens (``old``, ``train_pair.py`` until then) or the text's tokens (``new``, what each
label's context holds: ``train_pair._head_logits``), on the trained pair's frozen NemotronH; both evaluated on
held-out text (top-1 agreement by depth, fed the text) and on greedy chains as verification sees them (the
target's own greedy continuation at a position, the head fed the root and then its own picks: the fraction of
positions whose chain is accepted through depth d). Small (depth 3, 128-token windows, 240 steps of 4 windows):
the GPU run trains 600+ steps at 1024 tokens; this compares the two feeds at equal cost.

    python benchmarks/mtp_feed_ab.py --pair /tmp/pair --data .pair/data     # writes mtp_feed_ab.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.modules["fla"] = None  # transformers' torch path of the Mamba2 mixers on the CPU
import train_pair as tp  # noqa: E402

from vllm_bole.spec_decode.block_drafter import MTPHead  # noqa: E402

D, SEQ, NTR, NHE, STEPS, BATCH = 3, 128, 96, 24, 240, 4


def features(target, x):
    out = [tp._target_features(target, r) for r in x.split(8)]
    return torch.cat([o[0] for o in out]).float(), out[0][1], torch.cat([o[2] for o in out])


def head_logits(head, lm, h, x, greedy, feed_greedy: bool):
    """``train_pair._head_logits`` as shipped (fed the text), or fed the greedy tokens as before 2026-12-05: step d
    reads ``fed[:, d : S + 1]``, so the old feed is the greedy tokens shifted one column right."""
    return tp._head_logits(head, lm, h, torch.cat([x[:, :1], greedy], 1) if feed_greedy else x)


def chain_acceptance(target, head, lm, h, x) -> tuple[list, int]:
    """Per depth, the fraction of held-out positions whose greedy chain the head drafts correctly through it."""
    acc, n = torch.zeros(D), 0
    for w in range(x.shape[0]):
        for t in range(16, SEQ - 1, 14):
            ctx, chain = x[w, : t + 1].clone(), []
            for _ in range(D + 1):
                nxt = target(input_ids=ctx[None], use_cache=False).logits[0, -1].argmax()
                chain.append(int(nxt))
                ctx = torch.cat([ctx, nxt[None]])
            s, tok = h[w, t][None], torch.tensor([chain[0]])
            for d in range(D):
                s = head(s, tok)
                tok = lm(s).argmax(-1)
                if int(tok) != chain[d + 1]:
                    break
                acc[d] += 1
            n += 1
    return [round(float(a / n), 4) for a in acc], n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", type=Path, default=Path("/tmp/pair"), help="the trained pair (its nemotron_h)")
    ap.add_argument("--data", type=Path, default=Path(".pair/data"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    train, held = tp.tokens(args.data, torch.device("cpu"))
    starts = torch.randint(0, train.numel() - SEQ - 1, (NTR,), generator=torch.Generator().manual_seed(1))
    xtr, xhe = train[starts[:, None] + torch.arange(SEQ + 1)], held[: NHE * (SEQ + 1)].view(NHE, SEQ + 1)
    target = tp._load(args.pair / "nemotron_h", torch.device("cpu")).float().requires_grad_(False)
    t0 = time.time()
    (htr, lm, gtr), (hhe, _, ghe) = features(target, xtr), features(target, xhe)
    res = {}
    for name, feed_greedy in (("old", True), ("new", False)):
        torch.manual_seed(0)
        head = MTPHead(htr.shape[-1], D, target.config.vocab_size)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        gen = torch.Generator().manual_seed(2)
        for step in range(STEPS):
            i = torch.randint(0, NTR, (BATCH,), generator=gen)
            ls = head_logits(head, lm, htr[i], xtr[i], gtr[i], feed_greedy)
            loss = sum(torch.nn.functional.cross_entropy(l.flatten(0, 1), gtr[i][:, d:].flatten())
                       for d, l in enumerate(ls, 1)) / D
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            if step % 40 == 0:
                print(name, step, round(float(loss.detach()), 3), f"{time.time() - t0:.0f} s", flush=True)
        with torch.no_grad():
            ls = head_logits(head, lm, hhe, xhe, ghe, False)
            res[name] = dict(top1_fed_text_by_depth=[round(float((l.argmax(-1) == ghe[:, d:]).float().mean()), 4)
                                                     for d, l in enumerate(ls, 1)])
            res[name]["chain_accepted_through_depth"], res[name]["chain_positions"] = \
                chain_acceptance(target, head, lm, hhe, xhe)
        print(name, res[name], flush=True)
    doc = dict(res=res, depth=D, seq=SEQ, steps=STEPS, batch=BATCH, train_windows=NTR, heldout_windows=NHE,
               seconds=round(time.time() - t0))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mtp_feed_ab.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
