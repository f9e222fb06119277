"""vLLM's plain greedy decoding against transformers on the same checkpoint: is the engine itself right?

:func:`teacher_forced` (child side, after the engine has shut down) runs transformers in the
checkpoint's dtype (FLA hidden: torch fallback, no cache): one teacher-forced forward over each vLLM
stream gives, at every position, HF's argmax, the logit gap ("regret") between HF's argmax and vLLM's
token, and HF's logprobs of vLLM's top tokens. HF's greedy stream is vLLM's up to the first position
whose vLLM token is not HF's argmax, and is decoded from there by re-running the full forward for
every new token.

:func:`compare` turns that into an :class:`Agreement`, judged by :data:`TOLERANCES`:

* fp32 checkpoints: identical token streams for every prompt, and vLLM's top logprobs equal HF's
  (median difference <= 1e-4, max <= 1e-2).
* bf16 checkpoints (Qwen3-Next): streams may part (each divergence is reported with its regret), but
  over all tokens >= 80 % of vLLM's tokens are HF's argmax given vLLM's own prefix, at most 5 % sit
  more than 1 logit below it, and the median logprob difference is <= 0.3 (calibration in the comment
  on TOLERANCES: per-token bounds are not sound for this model in bf16).
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """How far vLLM may be from HF for one checkpoint dtype (see the module docstring)."""
    exact: bool  # identical token streams required
    min_agree: float  # smallest fraction of vLLM tokens that must be HF's argmax (teacher-forced)
    far: float  # a vLLM token whose HF regret (HF max logit minus HF logit of the token) exceeds this is "far"
    max_far: float  # largest fraction of far tokens allowed
    logprob_median: float  # bound on the median |vLLM - HF| logprob over vLLM's top tokens, all positions
    logprob_max: float  # bound on the largest such difference


TOLERANCES = {
    # fp32: any token difference fails; logprobs agree to kernel rounding (measured: max 1e-4).
    "float32": Tolerance(exact=True, min_agree=1.0, far=0.0, max_far=0.0, logprob_median=1e-4, logprob_max=1e-2),
    # bf16 (Qwen3-Next): the tiny random model loses ~4 % relative accuracy in bf16 (errors roughly double per
    # layer through the gated norms, gated MLPs and MoE routing flips), against a median top-1/top-2 logit gap of
    # ~0.6. Calibration, HF bf16 greedy judged by HF fp32 on the same weights (40 random prompts x 24 tokens):
    # 7 % of tokens are not fp32's argmax (per 96-token batch: 3-10 %), 0.5 % have a regret > 1 logit, and
    # the largest regret per batch ranges 0.1-6.6 (so a per-token bound would be flaky). vLLM here: 94 %
    # argmax agreement, 1 token of 96 with regret > 1 (1.31), median logprob difference 0.06. A wrong
    # recurrent state or kernel gives agreement far below 80 % and logprob differences of several units.
    "bfloat16": Tolerance(exact=False, min_agree=0.8, far=1.0, max_far=0.05, logprob_median=0.3,
                          logprob_max=float("inf")),
}


@dataclass
class PromptVerdict:
    index: int
    status: str  # "equal" | "diverged"
    first_diff: int | None = None
    regret_at_diff: float | None = None  # HF regret of vLLM's token where the streams first differ
    detail: str = ""


@dataclass
class Agreement:
    dtype: str
    verdicts: list[PromptVerdict]
    tokens: int  # vLLM tokens compared
    argmax_agree: float  # fraction of vLLM tokens that are HF's argmax, teacher-forced on vLLM's stream
    regrets: list  # (prompt, position, HF regret) of every vLLM token that is not HF's argmax
    logprob_median: float  # |vLLM - HF| logprob over vLLM's top tokens at every position
    logprob_max: float

    def problems(self) -> list[str]:
        tol = TOLERANCES[self.dtype]
        out = []
        if tol.exact:
            out += [f"prompt {v.index}: {v.detail}" for v in self.verdicts if v.status != "equal"]
        if self.argmax_agree < tol.min_agree:
            out.append(f"only {self.argmax_agree:.1%} of vLLM tokens are HF's argmax (need {tol.min_agree:.0%})")
        far = [r for r in self.regrets if r[2] > tol.far]
        if len(far) > tol.max_far * self.tokens:
            out.append(f"{len(far)} of {self.tokens} vLLM tokens are more than {tol.far} logits below HF's argmax "
                       f"(allowed {tol.max_far:.0%}): (prompt, position, regret) {far}")
        if self.logprob_median > tol.logprob_median:
            out.append(f"median logprob difference {self.logprob_median:.3g} > {tol.logprob_median}")
        if self.logprob_max > tol.logprob_max:
            out.append(f"largest logprob difference {self.logprob_max:.3g} > {tol.logprob_max}")
        return out

    def summary(self) -> str:
        counts = {s: sum(v.status == s for v in self.verdicts) for s in ("equal", "diverged")}
        lines = [", ".join(f"{n} {s}" for s, n in counts.items() if n)
                 + f"; {self.argmax_agree:.1%} of {self.tokens} tokens are HF's argmax"
                 + f"; logprob diff median {self.logprob_median:.2g} max {self.logprob_max:.2g}"]
        lines += [f"    prompt {v.index}: {v.detail}" for v in self.verdicts if v.status != "equal"]
        lines += [f"    FAIL: {p}" for p in self.problems()]
        return "\n".join(lines)


def compare(dtype: str, hf: dict, tokens: list[list[int]], top: list) -> Agreement:
    """vLLM's greedy ``tokens`` (with their ``top`` logprob rows) against :func:`teacher_forced`'s ``hf``."""
    verdicts, regrets, errs, agree = [], [], [], 0
    for k, (h, v) in enumerate(zip(hf["tokens"], tokens)):
        forced = hf["forced"][k]  # per position: [argmax, max logit, logit of vLLM's token, HF logprobs of top]
        for i, (arg, best, of_v, lps) in enumerate(forced):
            agree += arg == v[i]
            if arg != v[i]:
                regrets.append((k, i, best - of_v))
            errs += [abs(lp - hf_lp) for (_, lp), hf_lp in zip(top[k][i], lps)]
        if h == v:
            verdicts.append(PromptVerdict(k, "equal"))
            continue
        p = next((i for i, (a, b) in enumerate(zip(h, v)) if a != b), min(len(h), len(v)))
        r = forced[p][1] - forced[p][2] if p < len(v) else None
        detail = f"streams differ from generated token {p}" + (
            f" (hf {h[p]}, vllm {v[p]}, {r:.4f} logits below HF's argmax)" if r is not None else
            f" (lengths hf {len(h)}, vllm {len(v)})")
        verdicts.append(PromptVerdict(k, "diverged", p, r, detail))
    errs.sort()
    n = sum(len(v) for v in tokens)
    return Agreement(dtype, verdicts, n, agree / max(n, 1), regrets, errs[len(errs) // 2] if errs else 0.0,
                     errs[-1] if errs else 0.0)


def degenerate_reason(streams: list[list[int]], min_distinct: int = 4) -> str | None:
    """Why a set of greedy streams proves nothing (identical across prompts, or nearly constant)."""
    if len({tuple(s) for s in streams}) < len(streams):
        return "some prompts give identical greedy streams"
    for i, s in enumerate(streams):
        if len(set(s)) < min_distinct:
            return f"stream {i} has only {len(set(s))} distinct tokens: {s}"
    return None


def teacher_forced(model: str, dtype: str, prompt_ids, tokens: list[list[int]], top: list) -> dict:
    """Child side (transformers imported, FLA hidden before): HF greedy streams and a teacher-forced
    pass over each vLLM stream (module docstring)."""
    import torch
    import transformers

    t0 = time.monotonic()
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    out_tokens, forced = [], []
    with torch.inference_mode():
        for k, ids in enumerate(prompt_ids):
            v, n = tokens[k], len(ids)
            logits = m(torch.tensor([list(ids) + v])).logits[0, n - 1 : n - 1 + len(v)].float()
            logprobs = logits.log_softmax(-1)
            best, arg = logits.max(-1)
            rows = []
            for i, t in enumerate(v):
                lps = [float(logprobs[i, tok]) for tok, _ in top[k][i]]
                rows.append([int(arg[i]), float(best[i]), float(logits[i, t]), lps])
            forced.append(rows)
            p = next((i for i, row in enumerate(rows) if row[0] != v[i]), len(v))
            seq = list(ids) + v[:p]
            while len(seq) < n + len(v):
                seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
            out_tokens.append(seq[n:])
    return dict(tokens=out_tokens, forced=forced, seconds=time.monotonic() - t0)
