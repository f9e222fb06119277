"""Train the hybrid pair of the end-to-end benchmark on the H200: two hybrid targets and one draft,
from a seed, in one run (the models named train at once, one process each, on the one GPU).

    python3 benchmarks/train_pair.py --data .pair/data --out /tmp/pair --model nemotron_h --model draft --model block
    python3 benchmarks/train_pair.py --data .pair/data --out /tmp/pair --steps 3 --tiny  # CPU dry run

Models (HF checkpoints that vLLM loads natively; bf16 weights; SmolLM2's tokenizer):
  * ``nemotron_h``  NemotronH-style Mamba2 + attention + MLP hybrid, hidden 512, 12 layers
    (6 Mamba2 [16 heads x 64, state 64], 4 ReLU^2 MLPs, 2 GQA attention), ~70M parameters;
  * ``qwen3_next``  Qwen3-Next-style Gated DeltaNet + gated attention + MoE hybrid, hidden 512,
    8 layers (6 GDN [2 key / 4 value heads x 128], 2 attention), 8 experts top-2, ~115M parameters;
  * ``draft``       Llama, hidden 256, 2 layers, tied embeddings, ~14M parameters;
  * ``block``       the block drafter's heads (``vllm_bole.spec_decode.block_drafter``: ``BLOCK_DEPTH``
    residual blocks on the target's final hidden state, the target's frozen LM head), trained on the
    frozen target (``--block-target``, default ``nemotron_h``) after it: ``D (H^2 + H)`` ~1.6M parameters.
    Loss: mean over depths ``d`` of the cross-entropy of the ``d``-th token after the next one. Its
    evaluation: per depth, how often the head's top-1 equals the target's own greedy token there on
    held-out text (``top1_agreement_by_depth``: the acceptance of a greedy chain's ``d``-th node given
    the ones before it).

Decision: trained from scratch on real text (``benchmarks/pair_data.py``: ShareGPT chats in the
chat template, Python sources, GSM8K), not distilled from SmolLM2-135M-Instruct. The teacher is a
93 MB GGUF, more than one device run may carry beside the vLLM bundle, and ShareGPT-style chats are
what an instruction model is trained on anyway; the pair is for measuring speculation (acceptance
comes from how well the draft predicts the target, not from how good the target is), and a held-out
perplexity and the draft's top-1 agreement with the target say what it is.

Training: AdamW (0.9, 0.95), weight decay 0.1, peak lr 2e-3 (draft 3e-3), warmup over the first
100 steps (a tenth of shorter runs) then cosine to 10%, bf16 autocast, gradient clip 1, 32 sequences of 1024 tokens per step drawn at
seeded random offsets. Fixed step counts (``STEPS``, or ``--steps N`` for all): deterministic from
``--seed``, up to GPU reduction order. Writes ``$OUT/train_pair.json``:
per model parameters, steps, tokens, seconds, loss curve, held-out perplexity; and the draft's top-1
agreement with each target on held-out text.

Seen on the H200 (2026-12-01): transformers has no fast Mamba2 path there (no ``mamba_ssm``), and its
torch fallback takes 1.4 s per 32k-token step of ``nemotron_h`` (Qwen3-Next's torch GDN fallback
0.9 s, the draft 0.07 s), so a few minutes give the targets only 100-300 steps; and the three
together beside vLLM engines ran out of GPU memory (``nemotron_h``): train alone on the GPU.
2026-12-02: the three at once ran out of memory again (``nemotron_h``'s torch fallback holds 68 GB,
``qwen3_next`` asked for 6 GB more), and a step count taken from the first steps' speed (the former
``--minutes``) overran its run: the others' start-up had made those steps look fast. Hence fixed
counts, sized from the speeds seen with two models at once (``nemotron_h`` 1.4-3.1 s per step, the
draft 0.06 s), about 4 minutes each, and the benchmark's stay trains ``nemotron_h`` and the draft only.
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
from pair_data import load_xz  # noqa: E402

SEQ, BATCH, WARMUP = 1024, 32, 100
EOS, BOS = 2, 1
MODELS = ("nemotron_h", "qwen3_next", "draft", "block")
LR = {"nemotron_h": 2e-3, "qwen3_next": 2e-3, "draft": 3e-3, "block": 1e-3}
STEPS = {"nemotron_h": 120, "qwen3_next": 250, "draft": 3500, "block": 400}
BLOCK_DEPTH, BLOCK_BATCH = 8, 8
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


def lr_at(step: int, total: int, peak: float) -> float:
    warmup = min(WARMUP, max(total // 10, 1))
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train_one(name: str, args) -> dict:
    import torch
    import transformers

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    train, held = tokens(args.data, dev)
    cfg = make_config(name, vocab=args.vocab, tiny=args.tiny)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dev).train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)],
                            lr=LR[name], betas=(0.9, 0.95), fused=dev.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    seq, batch = (64, 4) if args.tiny else (SEQ, BATCH)
    total, losses, t0 = args.steps or STEPS[name], [], time.monotonic()
    for step in range(total):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, LR[name])
        starts = torch.randint(0, train.numel() - seq - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)
        x = train[idx.to(dev)]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = _loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == total - 1:
            losses.append([step, round(float(loss.detach()), 4)])
            print(f"{name} step {step}/{total} loss {float(loss.detach()):.3f} {time.monotonic() - t0:.0f}s", flush=True)
    seconds = time.monotonic() - t0
    model.eval()
    out = args.out / name
    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out)
    model.generation_config.save_pretrained(out)
    for f in (args.data / "tokenizer").iterdir():
        shutil.copy(f, out / f.name)
    return dict(model=name, arch=cfg.architectures[0] if cfg.architectures else type(model).__name__,
                params=params, steps=total, tokens=total * batch * seq, seconds=round(seconds, 1),
                loss=losses, lr=LR[name], seq=seq, batch=batch)


def _target_features(target, x):
    """The target's final hidden states ``[b, S, H]`` of inputs ``x[:, :-1]`` (the LM head's input, as vLLM's
    ``compute_logits`` gets it) and its LM head."""
    import torch

    lm, feats = target.get_output_embeddings(), {}
    hook = lm.register_forward_hook(lambda m, i, o: feats.__setitem__("h", i[0]))
    try:
        with torch.no_grad():
            target(input_ids=x[:, :-1])
    finally:
        hook.remove()
    return feats["h"], lm


def _block_logits(head, lm, h, d):
    """Depth ``d``'s (1-based) logits ``[b, S - d, V]`` from hidden states ``h [b, S, H]``."""
    b, S, H = h.shape
    z = head(h[:, : S - d].reshape(-1, H))[:, d - 1]
    return lm(z.to(lm.weight.dtype)).view(b, S - d, -1)


def train_block(args) -> dict:
    """The block drafter's heads on the frozen trained target ``args.block_target`` (module docstring)."""
    import torch
    import transformers

    from vllm_bole.spec_decode.block_drafter import BlockHead

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    train, _ = tokens(args.data, dev)
    target = transformers.AutoModelForCausalLM.from_pretrained(args.out / args.block_target, dtype=torch.bfloat16)
    target = target.to(dev).eval().requires_grad_(False)
    head = BlockHead(target.config.hidden_size, BLOCK_DEPTH).to(dev)
    opt = torch.optim.AdamW(head.parameters(), lr=LR["block"], betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 2)
    seq, batch = (64, 2) if args.tiny else (SEQ, BLOCK_BATCH)
    total, losses, t0 = args.steps or STEPS["block"], [], time.monotonic()
    for step in range(total):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, LR["block"])
        starts = torch.randint(0, train.numel() - seq - 1, (batch,), generator=gen)
        x = train[(starts[:, None] + torch.arange(seq + 1)).to(dev)]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            h, lm = _target_features(target, x)
            loss = sum(torch.nn.functional.cross_entropy(_block_logits(head, lm, h.float(), d).flatten(0, 1).float(),
                                                         x[:, 1 + d :].flatten()) for d in range(1, BLOCK_DEPTH + 1))
            loss = loss / BLOCK_DEPTH
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == total - 1:
            losses.append([step, round(float(loss.detach()), 4)])
            print(f"block step {step}/{total} loss {float(loss.detach()):.3f} {time.monotonic() - t0:.0f}s", flush=True)
    out = args.out / "block"
    shutil.rmtree(out, ignore_errors=True)
    head.save(str(out))
    return dict(model="block", arch="BlockHead", target=args.block_target, depth=BLOCK_DEPTH,
                params=sum(p.numel() for p in head.parameters()), steps=total, tokens=total * batch * seq,
                seconds=round(time.monotonic() - t0, 1), loss=losses, lr=LR["block"], seq=seq, batch=batch)


def evaluate_block(args, x) -> dict:
    """Per depth d: how often the head's top-1 for the d-th token after the next equals the target's own
    greedy token at that position, on held-out rows ``x``."""
    import torch
    import transformers

    from vllm_bole.spec_decode.block_drafter import BlockHead

    dev = x.device
    target = transformers.AutoModelForCausalLM.from_pretrained(args.out / args.block_target, dtype=torch.bfloat16)
    target = target.to(dev).eval()
    head = BlockHead.load(str(args.out / "block"), dev, torch.bfloat16)
    hits = torch.zeros(BLOCK_DEPTH)
    count = torch.zeros(BLOCK_DEPTH)
    with torch.no_grad():
        for row in x.split(8):
            h, lm = _target_features(target, row)
            greedy = lm(h).argmax(-1)  # [b, S]: the target's token after each position
            for d in range(1, BLOCK_DEPTH + 1):
                pred = _block_logits(head, lm, h, d).argmax(-1)  # the token at position t + 1 + d
                hits[d - 1] += float((pred == greedy[:, d:]).sum())
                count[d - 1] += pred.numel()
    return dict(top1_agreement_by_depth=[round(float(v), 4) for v in hits / count.clamp(min=1)])


def _loss(model, x):
    import torch

    logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def evaluate(args, names) -> dict:
    """Held-out perplexity of each model and the draft's top-1 agreement with each target."""
    import torch
    import transformers

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, held = tokens(args.data, dev)
    seq = 64 if args.tiny else SEQ
    n = min(4 * (seq + 1) if args.tiny else EVAL_TOKENS, held.numel()) // (seq + 1) * (seq + 1)
    x = held[:n].view(-1, seq + 1)
    top1, out = {}, {}
    if "block" in names:
        out["block"] = evaluate_block(args, x)
    for name in (n for n in names if n != "block"):
        model = transformers.AutoModelForCausalLM.from_pretrained(args.out / name, dtype=torch.bfloat16).to(dev).eval()
        nll, preds = 0.0, []
        with torch.no_grad():
            for row in x.split(8):
                logits = model(input_ids=row[:, :-1]).logits.float()
                nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), row[:, 1:].flatten(),
                                                               reduction="sum"))
                preds.append(logits.argmax(-1))
        top1[name] = torch.cat(preds)
        out[name] = dict(heldout_ppl=round(math.exp(nll / (x.shape[0] * seq)), 3), heldout_tokens=x.shape[0] * seq)
        del model
    if "draft" in top1:
        for t in top1:
            if t != "draft":
                out["draft"][f"top1_agreement_{t}"] = round(float((top1["draft"] == top1[t]).float().mean()), 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path(".pair/data"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/pair"))
    ap.add_argument("--model", action="append", choices=MODELS, help="train only these (default: all)")
    ap.add_argument("--block-target", default="nemotron_h", choices=("nemotron_h", "qwen3_next"),
                    help="the trained target the block drafter's heads learn from (trained first when named too)")
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
        train = train_block if names[0] == "block" else train_one
        (args.out / f"{names[0]}.train.json").write_text(json.dumps(train(names[0], args) if train is train_one
                                                                    else train(args)))
        return 0
    t0 = time.monotonic()
    base = [sys.executable, __file__, "--data", str(args.data), "--out", str(args.out), "--seed", str(args.seed),
            "--child", "--block-target", args.block_target] + (["--steps", str(args.steps)] if args.steps else []) \
        + (["--tiny"] if args.tiny else [])
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    procs = {n: subprocess.Popen(base + ["--model", n], env=env) for n in names if n != "block"}
    failed = [n for n, p in procs.items() if p.wait() != 0]
    if "block" in names:  # after its target (trained now or before)
        if args.block_target in failed or not (args.out / args.block_target / "config.json").exists():
            failed.append("block")
        elif subprocess.call(base + ["--model", "block"], env=env) != 0:
            failed.append("block")
    result = dict(seed=args.seed, data=json.loads((args.data / "manifest.json").read_text()), models={})
    for n in names:
        f = args.out / f"{n}.train.json"
        result["models"][n] = json.loads(f.read_text()) if f.exists() else dict(error="training failed")
    if not failed:
        for n, ev in evaluate(args, names).items():
            result["models"][n].update(ev)
    result["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(result, indent=1)
    (args.out / "train_pair.json").write_text(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "train_pair.json").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
