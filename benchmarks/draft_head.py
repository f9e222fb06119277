"""A small autoregressive draft head for the acceptance benchmark (benchmark code, CPU).

Hydra / EAGLE-like: it reads the target's last hidden state (after the final norm) ``h`` at the
position that produced the root token, and walks forward one token at a time with a residual
MLP cell over the target's frozen token embeddings; the next-token logits come from the target's
frozen (tied) embedding matrix restricted to a shortlist of frequent tokens (FR-Spec / EAGLE-3
style reduced draft vocabulary, here ``K`` tokens):

    s_0 = h
    s_j = s_{j-1} + W2 silu(W1 [norm(s_{j-1}); norm(E[x_{j-1}]); norm(h)])   x_0 = root
    q_j = softmax(E[shortlist] . norm(s_j) / T_j)                             (depth j)

Only W1, W2 and the RMSNorm weights are trained (about 1.2M parameters with the default width
512), on the target's *own* greedy continuations of ShareGPT prompts: teacher-forced, hard labels
(the target's greedy tokens), ``depth`` steps per position, depth-weighted cross-entropy, dropout,
early stopping on held-out prompts, then per-depth temperature calibration on the same held-out
prompts (best-first trees rank paths by the product of draft probabilities, so those should be
calibrated). Deterministic from a seed on a given machine and thread count.

:class:`HeadStepFn` adapts it to the builders' autoregressive interface (``step_fn(frontier)``),
keeping every node's state keyed by (request, node id). :func:`get_head` loads the benchmark's
head from the cache or trains it (data from ``benchmarks/acceptance_data.py``).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from vllm_bole.spec_decode.offline import Frontier


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, weight: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if weight is None else weight.detach().clone().float())
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DraftHead(nn.Module):
    def __init__(self, embed: torch.Tensor, shortlist: torch.Tensor, width: int = 512,
                 out_norm: torch.Tensor | None = None, dropout: float = 0.3, max_temp_depth: int = 8):
        super().__init__()
        V, H = embed.shape
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("shortlist", shortlist.long().clone())
        self.register_buffer("out_w", embed.detach().float()[shortlist].contiguous(), persistent=False)
        inv = torch.full((V,), -1, dtype=torch.long)
        inv[shortlist] = torch.arange(shortlist.numel())
        self.register_buffer("inv_shortlist", inv, persistent=False)
        self.norm_s, self.norm_e, self.norm_h = RMSNorm(H), RMSNorm(H), RMSNorm(H)
        self.fc1 = nn.Linear(3 * H, width, bias=False)
        self.fc2 = nn.Linear(width, H, bias=False)
        self.norm_o = RMSNorm(H, weight=out_norm)
        self.drop = nn.Dropout(dropout)
        # per-depth softmax temperatures, fitted on held-out data after training (calibration);
        # depth j uses temps[min(j, len - 1) - 1]
        self.register_buffer("temps", torch.ones(max_temp_depth))
        nn.init.normal_(self.fc1.weight, std=1.0 / math.sqrt(3 * H))
        nn.init.zeros_(self.fc2.weight)

    @property
    def hidden(self) -> int:
        return self.embed.shape[1]

    def cell(self, s: torch.Tensor, tok: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        u = torch.cat([self.norm_s(s), self.norm_e(self.embed[tok]), self.norm_h(h)], -1)
        return s + self.fc2(F.silu(self.fc1(self.drop(u))))

    def logits(self, s: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """Shortlist logits of the tokens at ``depth`` (>= 1) from the state ``s`` (the state after
        the parent's token); divided by the calibrated temperature of that depth when given."""
        z = self.norm_o(s) @ self.out_w.T
        if depth is not None:
            z = z / self.temps[min(depth, self.temps.numel()) - 1].to(z.dtype)
        return z

    def unroll(self, h: torch.Tensor, tokens: torch.Tensor, calibrated: bool = True) -> torch.Tensor:
        """Teacher-forced logits ``[N, D, K]`` from ``h [N, H]`` and input tokens ``[N, D]``
        (root, then the true tokens at depths 1..D-1)."""
        s, out = h, []
        for j in range(tokens.shape[1]):
            s = self.cell(s, tokens[:, j], h)
            out.append(self.logits(s, j + 1 if calibrated else None))
        return torch.stack(out, 1)


def training_samples(conts: list[torch.Tensor], hiddens: list[torch.Tensor], depth: int, inv_shortlist: torch.Tensor):
    """From continuations ``c_1..c_L`` (``conts[i] [L]``) and the hidden states that produced
    them (``hiddens[i] [L, H]``: row ``j`` produced ``c_{j+1}``), one sample per root ``c_t``
    (``1 <= t < L``): ``h = hiddens[t - 1]``, inputs ``c_t..c_{t+depth-1}``, labels
    ``c_{t+1}..c_{t+depth}`` as shortlist ids (``-1``: not in the shortlist, a sure miss;
    ``-100``: beyond the end). Returns ``(h [N, H], inputs [N, depth], labels [N, depth])``."""
    hs, ins, labs = [], [], []
    for c, H in zip(conts, hiddens):
        L = c.numel()
        if L < 2:
            continue
        t = torch.arange(1, L)  # root c_t at index t - 1
        pos_in = (t - 1)[:, None] + torch.arange(depth)[None, :]
        pos_lab = pos_in + 1
        inp = c[pos_in.clamp(max=L - 1)]
        lab = inv_shortlist[c[pos_lab.clamp(max=L - 1)]]
        lab = torch.where(pos_lab < L, lab, torch.full_like(lab, -100))
        hs.append(H[t - 1])
        ins.append(inp)
        labs.append(lab)
    return torch.cat(hs), torch.cat(ins), torch.cat(labs)


def _masked_ce(logits, lab, w):
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.clamp(min=0).reshape(-1),
                         reduction="none").view(lab.shape)
    m = (lab >= 0).float() * w
    return (ce * m).sum(), m.sum()


def train_head(head: DraftHead, h, inputs, labels, *, epochs: int, lr: float, batch: int, seed: int,
               weight_decay: float = 0.05, depth_decay: float = 0.8, log=print, val=None,
               bf16: bool = True, patience: int = 2) -> dict:
    """AdamW with warm-up and cosine decay, matmuls in bf16 autocast (``bf16``), dropout on the
    cell input; keeps the epoch with the lowest validation loss (``val``: held-out samples, same
    layout; stops after ``patience`` epochs without improvement), then fits per-depth temperatures on ``val`` (:func:`calibrate_temperatures`).
    Loss: cross-entropy on in-shortlist labels, depth ``d`` weighted ``depth_decay ** (d - 1)``."""
    g = torch.Generator().manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    N, D = labels.shape
    steps = epochs * math.ceil(N / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    w = depth_decay ** torch.arange(D, dtype=torch.float32)
    best = (math.inf, None, -1)
    history = []
    for ep in range(epochs):
        head.train()
        perm = torch.randperm(N, generator=g)
        tot, cnt = 0.0, 0.0
        for i in range(0, N, batch):
            idx = perm[i:i + batch]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = head.unroll(h[idx], inputs[idx], calibrated=False)  # [b, D, K]
            num, den = _masked_ce(logits.float(), labels[idx], w)
            loss = num / den.clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            tot += float(num.detach())
            cnt += float(den)
        msg = f"  epoch {ep + 1}/{epochs}: train loss {tot / max(cnt, 1):.3f}"
        if val is not None:
            vl = validation_loss(head, *val, w=w, bf16=bf16)
            msg += f"  val loss {vl:.3f}"
            history.append(round(vl, 4))
            if vl < best[0]:
                best = (vl, {k: v.detach().clone() for k, v in head.state_dict().items()}, ep + 1)
        log(msg)
        if val is not None and ep + 1 - best[2] >= patience:
            break
    if best[1] is not None:
        head.load_state_dict(best[1])
    head.eval()
    info = {"best_epoch": best[2], "val_loss_by_epoch": history}
    if val is not None:
        info["temperatures"] = calibrate_temperatures(head, *val, bf16=bf16)
        info["val_top1_by_depth"] = [round(x, 4) for x in evaluate_head(head, *val, bf16=bf16)]
    return info


@torch.no_grad()
def _val_logits(head: DraftHead, h, inputs, bf16: bool, batch: int = 1024, calibrated: bool = True):
    head.eval()
    out = []
    for i in range(0, h.shape[0], batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out.append(head.unroll(h[i:i + batch], inputs[i:i + batch], calibrated=calibrated).float())
    return torch.cat(out)


@torch.no_grad()
def validation_loss(head: DraftHead, h, inputs, labels, w, bf16: bool = True) -> float:
    num, den = _masked_ce(_val_logits(head, h, inputs, bf16, calibrated=False), labels, w)
    return float(num / den.clamp(min=1))


@torch.no_grad()
def calibrate_temperatures(head: DraftHead, h, inputs, labels, bf16: bool = True) -> list[float]:
    """Per-depth softmax temperature minimising the held-out negative log-likelihood of the
    target's token (a labelled token outside the shortlist has draft probability 0 whatever the
    temperature and is left out), grid search; depths beyond the training depth reuse the
    deepest one's. Stored in ``head.temps``."""
    z = _val_logits(head, h, inputs, bf16, calibrated=False)
    grid = torch.exp(torch.linspace(math.log(0.4), math.log(6.0), 80))
    temps = []
    for d in range(labels.shape[1]):
        lab = labels[:, d]
        ok = lab >= 0
        zd, ld = z[ok, d], lab[ok]
        nll = [float(F.cross_entropy(zd / T, ld)) for T in grid.tolist()]
        temps.append(float(grid[int(torch.tensor(nll).argmin())]))
    n = head.temps.numel()
    head.temps.copy_(torch.tensor((temps + [temps[-1]] * n)[:n]))
    return [round(t, 3) for t in temps]


@torch.no_grad()
def evaluate_head(head: DraftHead, h, inputs, labels, bf16: bool = True) -> list[float]:
    """Teacher-forced top-1 accuracy per depth (labels outside the shortlist count as misses)."""
    lg = _val_logits(head, h, inputs, bf16)
    hit = ((lg.argmax(-1) == labels) & (labels >= 0)).float().sum(0)
    cnt = (labels != -100).float().sum(0)
    return (hit / cnt.clamp(min=1)).tolist()


class HeadStepFn:
    """``step_fn`` for the builders: request ``b`` has root hidden ``h[b]`` (the target's hidden
    state that produced the root) and root token ``roots[b]`` (a real token id, passed to the
    builder as the root token); every non-root node token is a *shortlist* id. The state of each
    expanded node is kept by (request, node id) for its children. Returns shortlist probabilities
    ``[F, K]``. ``calls`` / ``nodes`` count drafter invocations and node evaluations. ``bf16``:
    run the head's matmuls in bfloat16 (autocast; 4-5x faster on CPUs with AMX)."""

    def __init__(self, head: DraftHead, h: torch.Tensor, roots: torch.Tensor, bf16: bool = True):
        self.head, self.h, self.roots, self.bf16 = head, h, roots.long(), bf16
        self.keys = torch.empty(0, dtype=torch.long)
        self.states = torch.empty(0, h.shape[1])
        self.calls = 0
        self.nodes = 0

    @torch.no_grad()
    def __call__(self, fr: Frontier) -> torch.Tensor:
        # builders call level by level (depth 0, 1, ...): a frontier node's parent is a node of
        # the previous call, so only that level's states are kept
        req = fr.request.cpu()
        hb = self.h[req]
        if fr.depth == 0:
            s_par, tok = hb, self.roots[req]
        else:
            key = req * (1 << 40) + fr.parent_id.cpu()
            pos = torch.searchsorted(self.keys, key).clamp(max=max(self.keys.numel() - 1, 0))
            if self.keys.numel() == 0 or not bool((self.keys[pos] == key).all()):
                raise KeyError("HeadStepFn: a frontier node's parent was not expanded at the previous level")
            s_par, tok = self.states[pos], self.head.shortlist[fr.token.cpu()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            s = self.head.cell(s_par, tok, hb).float()
            logits = self.head.logits(s, fr.depth + 1)
        keys = req * (1 << 40) + fr.node_id.cpu()
        order = torch.argsort(keys)
        self.keys, self.states = keys[order], s[order]
        self.calls += 1
        self.nodes += req.numel()
        return torch.softmax(logits, -1, dtype=torch.float32)

    @torch.no_grad()
    def teacher_forced_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, D, K]`` probabilities along given real-token paths ``tokens [B, D]`` (root first)."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.head.unroll(self.h, tokens)
        return torch.softmax(logits, -1, dtype=torch.float32)


# ------------------------------------------------------------------------ benchmark training
def get_head(args, tok, model, use_cache: bool):
    """The benchmark's draft head: loaded from the cache, or trained on the target's greedy
    continuations of ShareGPT prompts (settings in ``args``, see ``acceptance_quality.py``)."""
    from acceptance_data import cache_root, cached_generation, digest, log, sharegpt_prompts

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
