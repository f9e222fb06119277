"""Speculate at all? The choice between tree steps and plain decoding, per batch-size bucket, by the
measured output rate of whole engine steps in each mode. Engine-agnostic.

The budget controller (:mod:`~vllm_bole.spec_decode.controller`) sizes trees from a model of the
target forward; what a tree step costs around it (drafting, the host's per-request work, the
engine's own scheduling and output processing, a plain decode's whole-batch CUDA graph that a tree
step cannot use) it does not see. Seen on the H200 (711675d, a 70M hybrid with a 14M draft): tree
steps 0.2-0.33x plain decoding at 8-128 concurrent requests, 1.1x at 1. So the engine measures
both modes, as the user sees them, and keeps the faster one:

* a sample is one engine step, from one input preparation to the next (scheduler and output
  processing included), in a steady mode (the step ran in the mode its own drafting chose: the
  first step after a switch carries the switch's cost and is not a sample), decoding only, with the
  same requests at its end as at its beginning (none arrived, finished or resumed: an engine idle
  between requests never lands in a sample); a bucket (the batch size rounded up to a power of two)
  estimates a mode's rate as tokens emitted per request over seconds, both summed over its last
  ``window`` samples (``1 / TPOT`` of that stretch), leaving out steps over ``OUTLIER`` times the
  window's median step time (a step that compiled kernels);
* a bucket first runs ``probe`` steps of each mode (trees first), then the faster mode, and every
  ``explore_every`` steps ``probe`` steps of the other one (its estimate follows acceptance and
  context lengths as they change): the slower mode takes at most ``probe / explore_every`` of
  the steps.

Seen on the H200 at d8485d7 before these rules: the first samples of a bucket, taken across the
pause between two batches of requests and in the warm-up, rated a mode 10-700x too low, and an
exponentially weighted estimate took hundreds of steps to recover. At 59e0ecd the estimate was the
median of the last 5 samples' rates: a tree step emits 1 to 9 tokens, so that median fell below
plain decoding's whenever 3 of 5 steps accepted little, the switch went plain for ``explore_every``
steps at once, and trees ran 13% of the steps at one request although they emitted 1.46x plain
decoding's tokens per second (MT-Bench, the 70M pair): hence sums over a longer window.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

__all__ = ["SpeculationSwitch"]
OUTLIER = 4.0  # a sample whose step took this many times the window's median step time is left out


@dataclass
class _Bucket:
    samples: dict  # speculate (bool) -> deque of the latest (tokens per request, seconds)
    mode: bool = True
    left: int = 0  # steps of the current run still to take in ``mode``
    steps: int = 0
    next_probe: int = 0


@dataclass
class SpeculationSwitch:
    probe: int = 4  # steps per probe of a mode (the first is the switch's, not a sample)
    explore_every: int = 128  # steps between probes of the slower mode
    window: int = 16  # samples per mode and bucket in the estimate
    buckets: dict = field(default_factory=dict)  # power of two -> _Bucket

    def __post_init__(self):
        if not self.probe >= 2:
            raise ValueError(f"probe: must be >= 2 (got {self.probe}): a probe's first step is not a sample")
        if not self.explore_every > self.probe:
            raise ValueError(f"explore_every: must be > probe ({self.probe}) (got {self.explore_every})")
        if not self.window >= 1:
            raise ValueError(f"window: must be >= 1 (got {self.window})")

    def _bucket(self, batch: int) -> _Bucket:
        key = 1 << max(int(batch) - 1, 0).bit_length()
        if key not in self.buckets:
            self.buckets[key] = _Bucket({m: collections.deque(maxlen=self.window) for m in (True, False)})
        return self.buckets[key]

    def decide(self, batch: int) -> bool:
        """Whether the next step of ``batch`` requests verifies trees (True) or decodes plainly."""
        b = self._bucket(batch)
        b.steps += 1
        if b.left == 0:
            unseen = [m for m in (True, False) if not b.samples[m]]
            best = self.best(batch)
            if unseen:  # a first probe: the next one of the slower mode ``explore_every`` steps later
                b.mode, b.left, b.next_probe = unseen[0], self.probe, b.steps + self.explore_every
            elif b.steps >= b.next_probe:
                b.mode, b.left, b.next_probe = not best, self.probe, b.steps + self.explore_every
            else:
                b.mode, b.left = best, 1
        b.left -= 1
        return b.mode

    def rates(self, batch: int) -> dict:
        """The bucket's estimate per mode (tokens / s / request; a mode without samples is absent)."""
        out = {}
        for m, q in self._bucket(batch).samples.items():
            if q:
                cut = OUTLIER * statistics.median(s for _, s in q)
                kept = [(t, s) for t, s in q if s <= cut]
                out[m] = sum(t for t, _ in kept) / sum(s for _, s in kept)
        return out

    def samples(self, batch: int) -> dict:
        """The bucket's samples per mode, oldest first: [[tokens per request, seconds], ...] (what
        :meth:`rates` sums; exported to check it against the engine's own step times)."""
        return {m: [list(x) for x in q] for m, q in self._bucket(batch).samples.items() if q}

    def best(self, batch: int) -> bool:
        """The mode with the higher estimated rate (trees on ties and before any sample)."""
        rate = self.rates(batch)
        return rate.get(True, 0.0) >= rate.get(False, 0.0)

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One steady step of ``batch`` requests emitted ``tokens`` tokens in ``seconds``."""
        if batch > 0 and seconds > 0 and tokens >= 0:
            self._bucket(batch).samples[speculated].append((tokens / batch, seconds))
