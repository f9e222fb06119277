"""Train the hybrid pair of the end-to-end benchmark on the H200: two hybrid targets and one draft,
from a seed, in one run (the models named train at once, one process each, on the one GPU).

    python3 benchmarks/train_pair.py --data .pair/data --out /tmp/pair --model nemotron_h --model draft --model block --model mtp
    python3 benchmarks/train_pair.py --data .pair/data --out /tmp/pair --steps 3 --tiny  # CPU dry run

Models (HF checkpoints that vLLM loads natively; bf16 weights; SmolLM2's tokenizer):
  * ``nemotron_h``  NemotronH-style Mamba2 + attention + MLP hybrid, hidden 512, 12 layers
    (6 Mamba2 [16 heads x 64, state 64], 4 ReLU^2 MLPs, 2 GQA attention), ~70M parameters;
  * ``qwen3_next``  Qwen3-Next-style Gated DeltaNet + gated attention + MoE hybrid, hidden 512,
    8 layers (6 GDN [2 key / 4 value heads x 128], 2 attention), 8 experts top-2, ~115M parameters;
  * ``draft``       Llama, hidden 256, 2 layers, tied embeddings, ~14M parameters;
  * ``distill``     the trained draft fine-tuned on the frozen trained target's next-token distributions
    (``--head-target``; KL(target || draft) per position on the training text, the draft's CE-trained
    weights as the start, kept as ``draft_ce``), written back as ``draft``: what verification accepts is the
    target's choice, which plain text labels reach only through the target's own errors;
  * ``block``, ``mtp``  the hidden-state drafters' heads (``vllm_bole.spec_decode.block_drafter``, depth
    ``HEAD_DEPTH``, the target's frozen LM head): ``block`` one residual block per depth on the target's
    final hidden state (~2.1M parameters at hidden 512), ``mtp`` one block over (state, token) applied
    recurrently (~6.8M, mostly its 128-wide token embedding), each trained on the frozen target
    (``--head-target``, default ``nemotron_h``) after it. Self-distilled: the label of depth ``d`` at
    position ``t`` is the target's own greedy token there (``argmax`` of its logits at ``t + d``, the text
    before it as context), and the MTP head steps on the text's tokens that context holds (teacher forcing;
    ``_head_logits``); loss the mean cross-entropy over depths. Evaluation: per depth, how often the head's
    top-1 equals that greedy token on held-out text (``top1_agreement_by_depth``: a chain's ``d``-th node
    accepted given the tokens before it).

Decision: trained from scratch on real text (``benchmarks/pair_data.py``: ShareGPT chats in the
chat template, Python sources, GSM8K), not distilled from SmolLM2-135M-Instruct. The teacher is a
93 MB GGUF, more than one device run may carry beside the vLLM bundle, and ShareGPT-style chats are
what an instruction model is trained on anyway; the pair is for measuring speculation (acceptance
comes from how well the draft predicts the target, not from how good the target is), and a held-out
perplexity and the draft's top-1 agreement with the target say what it is.

Training: AdamW (0.9, 0.95), weight decay 0.1, peak lr 2e-3 (draft 3e-3), warmup over the first
100 steps (a tenth of shorter runs) then cosine to 10%, bf16 autocast, gradient clip 1, 32 sequences of 1024 tokens per step drawn at
seeded random offsets. Each model trains ``STEPS`` steps (``--steps N`` for all) or for ``SECONDS``,
whichever ends first, the schedule running over that same measure: deterministic from ``--seed`` (up to
GPU reduction order) when the steps end first; ``steps`` says how many ran. Writes ``$OUT/train_pair.json``:
per model parameters, steps, tokens, seconds, loss curve, held-out perplexity; and the draft's top-1
agreement with each target on held-out text (with ``distill``: the distilled ``draft`` and ``draft_ce``, the
draft it started from). Decision (2026-12-05): the draft is distilled after its plain training because the
stays' drafts agreed with the target on 0.55-0.56 of held-out tokens while their perplexities matched the
target's, and at one request the tree step's acceptance (3.2 tokens at budget 16 on the H100, ff6ad01) is the
lever left beside host work.

Seen on the H200 (2026-12-01): transformers has no fast Mamba2 path there (no ``mamba_ssm``), and its
torch fallback takes 1.4 s per 32k-token step of ``nemotron_h`` (Qwen3-Next's torch GDN fallback
0.9 s, the draft 0.07 s), so a few minutes give the targets only 100-300 steps; and the three
together beside vLLM engines ran out of GPU memory (``nemotron_h``): train alone on the GPU.
2026-12-02: the three at once ran out of memory again (``nemotron_h``'s torch fallback holds 68 GB,
``qwen3_next`` asked for 6 GB more), and a step count taken from the first steps' speed (the former
``--minutes``) overran its run: the others' start-up had made those steps look fast. Hence fixed
counts, sized from the speeds seen with two models at once (``nemotron_h`` 1.4-3.1 s per step, the
draft 0.06 s), about 4 minutes each, and the benchmark's stay trains ``nemotron_h`` and the draft only.
2026-12-03: the slow part was transformers 5.17's Mamba2 fallback, which broadcasts ``C * B`` to
``[b, chunks, l, l, heads, state]`` before summing; ``mamba2_train.use_fast_mamba2`` swaps in the same
computation as einsums (checked against transformers in ``tests/test_mamba2_train.py``), and a time cap per
model (``SECONDS``) keeps the run inside its 10 minutes whatever the speed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mamba2_train import use_fast_mamba2  # noqa: E402
from pair_data import load_xz  # noqa: E402

SEQ, BATCH, WARMUP = 1024, 32, 100
EOS, BOS = 2, 1
MODELS = ("nemotron_h", "qwen3_next", "draft", "block", "mtp", "distill")
HEADS = ("block", "mtp")  # trained on a trained target, after it
AFTER_TARGET = HEADS + ("distill",)  # need the trained target (distill also the trained draft): a second phase
LR = {"nemotron_h": 2e-3, "qwen3_next": 2e-3, "draft": 3e-3, "block": 1e-3, "mtp": 1e-3, "distill": 1e-3}
STEPS = {"nemotron_h": 2000, "qwen3_next": 1000, "draft": 3500, "block": 1500, "mtp": 1500, "distill": 2000}
SECONDS = {"nemotron_h": 240, "qwen3_next": 240, "draft": 240, "block": 200, "mtp": 200,
           "distill": 150}  # whichever ends first
HEAD_DEPTH, HEAD_BATCH, DISTILL_BATCH = 8, 8, 16
EVAL_TOKENS = 131_072


def make_config(name: str, vocab: int, tiny: bool = False):
    """The pair's configurations (module docstring); ``tiny`` shrinks them for a CPU dry run."""
    import transformers

    h = 64 if tiny else 512
    common = dict(vocab_size=vocab, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, max_position_embeddings=4096,
                  initializer_range=0.02)
    if name == "nemotron_h":
        M, F, A = "linear_attention", "mlp", "full_attention"
        cfg = transformers.NemotronHConfig(
            **common, hidden_size=h, intermediate_size=4 * h, num_attention_heads=h // 64,
            num_key_value_heads=min(2, h // 64), head_dim=64, layers_block_type=[M, F, M, A, M, F, M, F, M, A, M, F], mamba_num_heads=h // 32,
            mamba_head_dim=64, ssm_state_size=16 if tiny else 64, n_groups=1, conv_kernel=4, expand=2,
            chunk_size=128, tie_word_embeddings=False)
    elif name == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            **common, hidden_size=h, intermediate_size=h, num_hidden_layers=8,
            layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=max(h // 128, 1), num_key_value_heads=max(h // 256, 1), head_dim=128,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=h, shared_expert_intermediate_size=h,
            decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)
    elif name == "draft":
        d = 32 if tiny else 256
        cfg = transformers.LlamaConfig(**common, hidden_size=d, intermediate_size=3 * d, num_hidden_layers=2,
                                       num_attention_heads=max(d // 64, 1), num_key_value_heads=max(d // 128, 1),
                                       head_dim=64,
                                       tie_word_embeddings=True)
    else:
        raise ValueError(f"model: {name!r} not one of {MODELS}")
    cfg.dtype = "bfloat16"
    return cfg


def tokens(data: Path, device):
    import numpy as np
    import torch

    shards = sorted(data.glob("shard*.npy.xz"))
    if not shards:
        raise SystemExit(f"--data: no shard*.npy.xz in {data} (run benchmarks/pair_data.py)")
    train = torch.from_numpy(np.concatenate([load_xz(s) for s in shards]).astype(np.int64)).to(device)
    held = torch.from_numpy(load_xz(data / "heldout.npy.xz").astype(np.int64)).to(device)
    return train, held


def lr_at(step: int, progress: float, total: int, peak: float) -> float:
    """Linear warm-up over the first steps, then cosine to 10% over ``progress`` (0..1: steps or seconds)."""
    warmup = min(WARMUP, max(total // 10, 1))
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (progress - warmup / total) / max(1 - warmup / total, 1e-9)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(frac, 0.0), 1.0))))


def _optimize(name: str, params, opt, loss_of, train, seq: int, batch: int, total: int, gen,
              budget_s: float) -> tuple[list, float, int]:
    """Up to ``total`` steps of ``opt`` on ``loss_of(x)`` (x: ``batch`` random windows of ``seq + 1`` tokens of
    ``train``, bf16 autocast on CUDA) within ``budget_s`` seconds, lr by ``lr_at`` over whichever of the two
    runs out first, gradients clipped at 1. Returns (loss curve, seconds, steps done)."""
    import torch

    params = list(params)
    peak = opt.param_groups[0]["lr"]
    losses, t0 = [], time.monotonic()
    for step in range(total):
        progress = max(step / total, (time.monotonic() - t0) / budget_s)
        if progress >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, total, peak)
        starts = torch.randint(0, train.numel() - seq - 1, (batch,), generator=gen)
        x = train[(starts[:, None] + torch.arange(seq + 1)).to(train.device)]
        with torch.autocast(train.device.type, dtype=torch.bfloat16, enabled=train.device.type == "cuda"):
            loss = loss_of(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == total - 1:
            losses.append([step, round(float(loss.detach()), 4)])
            print(f"{name} step {step}/{total} loss {float(loss.detach()):.3f} {time.monotonic() - t0:.0f}s", flush=True)
    else:
        step = total
    return losses, time.monotonic() - t0, step


def train_one(name: str, args) -> dict:
    import torch
    import transformers

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    train, held = tokens(args.data, dev)
    cfg = make_config(name, vocab=args.vocab, tiny=args.tiny)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dev).train()
    use_fast_mamba2(model)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)],
                            lr=LR[name], betas=(0.9, 0.95), fused=dev.type == "cuda")
    seq, batch = (64, 4) if args.tiny else (SEQ, BATCH)
    total = args.steps or STEPS[name]
    losses, seconds, done = _optimize(name, model.parameters(), opt, lambda x: _loss(model, x), train, seq, batch,
                                      total, torch.Generator(device="cpu").manual_seed(args.seed + 1), SECONDS[name])
    _save(model, args.out / name, args.data)
    return dict(model=name, arch=cfg.architectures[0] if cfg.architectures else type(model).__name__,
                params=params, steps=done, step_limit=total, tokens=done * batch * seq, seconds=round(seconds, 1),
                loss=losses, lr=LR[name], seq=seq, batch=batch)


def _save(model, out: Path, data: Path) -> None:
    """A trained model as a bf16 checkpoint in ``out`` (replaced), with the pair's tokenizer."""
    import torch

    shutil.rmtree(out, ignore_errors=True)
    model.eval().to(torch.bfloat16).save_pretrained(out)
    model.generation_config.save_pretrained(out)
    for f in (data / "tokenizer").iterdir():
        shutil.copy(f, out / f.name)


def _target_features(target, x):
    """The target's final hidden states ``[b, S, H]`` of inputs ``x[:, :-1]`` (the LM head's input, as vLLM's
    ``compute_logits`` gets it), its LM head, and its greedy tokens ``[b, S]`` (the token after each position)."""
    import torch

    lm, feats = target.get_output_embeddings(), {}
    hook = lm.register_forward_hook(lambda m, i, o: feats.__setitem__("h", i[0]))
    try:
        with torch.no_grad():
            greedy = target(input_ids=x[:, :-1], use_cache=False).logits.argmax(-1)
    finally:
        hook.remove()
    return feats["h"], lm, greedy


def _head_logits(head, lm, h, x):
    """Per depth d = 1..D, the head's logits ``[b, S - d, V]`` for the d-th token after the next one at every
    position t (its label: the target's greedy token at t + d, ``greedy[:, d:]``). Teacher-forced on the text:
    an MTP head's step d at t reads token ``x[t + d]``, the token that label's context holds there. Until
    2026-12-05 it read the target's greedy token ``greedy[t + d - 1]`` instead, which the label's context does not
    hold wherever the target's guess differs from the text (mostly, for a small target): contradicting targets,
    the likely cause of the MTP head's flat 0.18-0.20 agreement at every depth (198194b, under the block head's
    0.27 at depth 1). At inference the fed token (the root, then each depth's pick) is the one the target
    verifies the next depth after, as here."""
    from vllm_bole.spec_decode.block_drafter import BlockHead

    b, S, H = h.shape
    lm_fn = lambda z: lm(z.to(lm.weight.dtype))  # noqa: E731
    if isinstance(head, BlockHead):
        z = head(h.reshape(-1, H)).view(b, S, head.depth, H)
        return [lm_fn(z[:, : S - d, d - 1]) for d in range(1, head.depth + 1)]
    out, s = [], h
    for d in range(1, head.depth + 1):  # step d: states at positions t (< S - d + 1), fed token x[t + d]
        s = head(s[:, : S - d + 1].reshape(-1, H), x[:, d : S + 1].reshape(-1)).view(b, S - d + 1, H)
        out.append(lm_fn(s[:, : S - d]))
    return out


def _new_head(kind: str, cfg):
    from vllm_bole.spec_decode.block_drafter import BlockHead, MTPHead

    if kind == "block":
        return BlockHead(cfg.hidden_size, HEAD_DEPTH)
    return MTPHead(cfg.hidden_size, HEAD_DEPTH, cfg.vocab_size)


def train_head(kind: str, args) -> dict:
    """A block or MTP drafter's head on the frozen trained target ``args.head_target`` (module docstring)."""
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    train, _ = tokens(args.data, dev)
    target = _load(args.out / args.head_target, dev).requires_grad_(False)
    head = _new_head(kind, target.config).to(dev)
    opt = torch.optim.AdamW(head.parameters(), lr=LR[kind], betas=(0.9, 0.95), weight_decay=0.0)
    seq, batch = (64, 2) if args.tiny else (SEQ, HEAD_BATCH)
    total = args.steps or STEPS[kind]

    def loss_of(x):
        h, lm, greedy = _target_features(target, x)
        logits = _head_logits(head, lm, h.float(), x)
        return sum(torch.nn.functional.cross_entropy(l.flatten(0, 1).float(), greedy[:, d:].flatten())
                   for d, l in enumerate(logits, 1)) / len(logits)

    losses, seconds, done = _optimize(kind, head.parameters(), opt, loss_of, train, seq, batch, total,
                                      torch.Generator(device="cpu").manual_seed(args.seed + 2), SECONDS[kind])
    out = args.out / kind
    shutil.rmtree(out, ignore_errors=True)
    head.save(str(out))
    return dict(model=kind, arch=type(head).__name__, target=args.head_target, depth=HEAD_DEPTH,
                params=sum(p.numel() for p in head.parameters()), steps=done, step_limit=total, tokens=done * batch * seq,
                seconds=round(seconds, 1), loss=losses, lr=LR[kind], seq=seq, batch=batch)


def train_distill(args) -> dict:
    """The trained draft fine-tuned on the frozen target's distributions (module docstring); the CE-trained
    draft moves to ``draft_ce``."""
    import torch
    import transformers

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    train, _ = tokens(args.data, dev)
    target = _load(args.out / args.head_target, dev).requires_grad_(False)
    shutil.rmtree(args.out / "draft_ce", ignore_errors=True)
    shutil.copytree(args.out / "draft", args.out / "draft_ce")
    draft = transformers.AutoModelForCausalLM.from_pretrained(args.out / "draft_ce", dtype=torch.float32).to(dev).train()
    opt = torch.optim.AdamW(draft.parameters(), lr=LR["distill"], betas=(0.9, 0.95), weight_decay=0.0,
                            fused=dev.type == "cuda")
    seq, batch = (64, 2) if args.tiny else (SEQ, DISTILL_BATCH)
    total = args.steps or STEPS["distill"]

    def loss_of(x):
        with torch.no_grad():
            teacher = torch.log_softmax(target(input_ids=x[:, :-1], use_cache=False).logits.float(), -1)
        student = torch.log_softmax(draft(input_ids=x[:, :-1], use_cache=False).logits.float(), -1)
        return torch.nn.functional.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True,
                                          reduction="batchmean")

    losses, seconds, done = _optimize("distill", draft.parameters(), opt, loss_of, train, seq, batch, total,
                                      torch.Generator(device="cpu").manual_seed(args.seed + 3), SECONDS["distill"])
    _save(draft, args.out / "draft", args.data)
    return dict(model="distill", target=args.head_target, steps=done, step_limit=total, tokens=done * batch * seq,
                seconds=round(seconds, 1), loss=losses, lr=LR["distill"], seq=seq, batch=batch)


def _load(path: Path, device):
    """A trained checkpoint in bf16 for evaluation (its Mamba2 mixers through ``use_fast_mamba2``)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    use_fast_mamba2(model)
    return model


def evaluate_heads(args, kinds, x) -> dict:
    """Per head and depth d: how often the head's top-1 for the d-th token after the next equals the target's
    own greedy token there, on held-out rows ``x`` (an MTP head stepping on the target's greedy tokens); the
    target runs once for all heads."""
    import torch

    from vllm_bole.spec_decode.block_drafter import load_head

    if not kinds:
        return {}
    target = _load(args.out / args.head_target, x.device)
    heads = {kind: load_head(str(args.out / kind), kind, x.device, torch.bfloat16) for kind in kinds}
    hits, count = torch.zeros(len(heads), HEAD_DEPTH), torch.zeros(HEAD_DEPTH)
    with torch.no_grad():
        for row in x.split(8):
            h, lm, greedy = _target_features(target, row)
            for i, head in enumerate(heads.values()):
                for d, l in enumerate(_head_logits(head, lm, h, row), 1):
                    hits[i, d - 1] += float((l.argmax(-1) == greedy[:, d:]).sum())
            count += torch.tensor([float(greedy[:, d:].numel()) for d in range(1, HEAD_DEPTH + 1)])
    return {kind: dict(top1_agreement_by_depth=[round(float(v), 4) for v in hits[i] / count.clamp(min=1)])
            for i, kind in enumerate(heads)}


def _loss(model, x):
    import torch

    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def evaluate(args, names) -> dict:
    """Held-out perplexity of each model and the draft's top-1 agreement with each target."""
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, held = tokens(args.data, dev)
    seq = 64 if args.tiny else SEQ
    n = min(4 * (seq + 1) if args.tiny else EVAL_TOKENS, held.numel()) // (seq + 1) * (seq + 1)
    x = held[:n].view(-1, seq + 1)
    top1, out = {}, evaluate_heads(args, [n for n in names if n in HEADS], x)
    # the distilled draft is ``draft``; the one it started from, ``draft_ce``, beside it
    models = [n for n in names if n not in AFTER_TARGET] + (["draft", "draft_ce"] if "distill" in names else [])
    for name in dict.fromkeys(models):
        model = _load(args.out / name, dev)
        nll, preds = 0.0, []
        with torch.no_grad():
            for row in x.split(8):
                logits = model(input_ids=row[:, :-1], use_cache=False).logits.float()
                nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), row[:, 1:].flatten(),
                                                               reduction="sum"))
                preds.append(logits.argmax(-1))
        top1[name] = torch.cat(preds)
        out[name] = dict(heldout_ppl=round(math.exp(nll / (x.shape[0] * seq)), 3), heldout_tokens=x.shape[0] * seq)
        del model
    for d in ("draft", "draft_ce"):
        for t in (t for t in top1 if d in top1 and not t.startswith("draft")):
            out[d][f"top1_agreement_{t}"] = round(float((top1[d] == top1[t]).float().mean()), 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path(".pair/data"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/pair"))
    ap.add_argument("--model", action="append", choices=MODELS, help="train only these (default: all)")
    ap.add_argument("--head-target", default="nemotron_h", choices=("nemotron_h", "qwen3_next"),
                    help="the trained target the block / MTP heads learn from (trained first when named too)")
    ap.add_argument("--steps", type=int, default=None, help=f"steps of every model (default: {STEPS})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU dry run of the script)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.vocab = json.loads((args.data / "manifest.json").read_text())["vocab"]
    names = args.model or list(MODELS)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:  # FLA's kernels need a GPU (or the interpreter): transformers' torch fallback on CPU
        sys.modules["fla"] = None
    if args.child:
        n = names[0]
        got = train_distill(args) if n == "distill" else train_head(n, args) if n in HEADS else train_one(n, args)
        (args.out / f"{n}.train.json").write_text(json.dumps(got))
        return 0
    t0 = time.monotonic()
    base = [sys.executable, __file__, "--data", str(args.data), "--out", str(args.out), "--seed", str(args.seed),
            "--child", "--head-target", args.head_target] + (["--steps", str(args.steps)] if args.steps else []) \
        + (["--tiny"] if args.tiny else [])
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    procs = {n: subprocess.Popen(base + ["--model", n], env=env) for n in names if n not in AFTER_TARGET}
    failed = [n for n, p in procs.items() if p.wait() != 0]
    # after their target (trained now or before; distill also after the draft), side by side
    later = [n for n in names if n in AFTER_TARGET]
    ready = lambda n: all((args.out / m / "config.json").exists() and m not in failed  # noqa: E731
                          for m in (args.head_target,) + (("draft",) if n == "distill" else ()))
    failed += [n for n in later if not ready(n)]
    procs = {n: subprocess.Popen(base + ["--model", n], env=env) for n in later if ready(n)}
    failed += [n for n, p in procs.items() if p.wait() != 0]
    result = dict(seed=args.seed, data=json.loads((args.data / "manifest.json").read_text()), models={})
    for n in names:
        f = args.out / f"{n}.train.json"
        result["models"][n] = json.loads(f.read_text()) if f.exists() else dict(error="training failed")
    if not failed:
        for n, ev in evaluate(args, names).items():
            result["models"].setdefault(n, {}).update(ev)  # draft_ce: the distilled draft's start
    result["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(result, indent=1)
    (args.out / "train_pair.json").write_text(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "train_pair.json").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
