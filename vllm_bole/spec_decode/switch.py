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
  first step after a switch carries the switch's cost and is not a sample); its rate is tokens
  emitted per second per request (``1 / TPOT``), exponentially weighted per bucket (the batch size
  rounded up to a power of two) and mode; a sample counts as at most ``clip`` times the current
  estimate either way (a step that compiled kernels, an engine idle between requests);
* a bucket first runs ``probe`` steps of each mode (trees first), then the faster mode, and every
  ``explore_every`` steps ``probe`` steps of the other one (its estimate follows acceptance and
  context lengths as they change); a decision of the other mode's probe costs at most
  ``probe / explore_every`` of the steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpeculationSwitch"]


@dataclass
class _Bucket:
    rate: dict = field(default_factory=dict)  # speculate (bool) -> tokens / s / request
    samples: dict = field(default_factory=lambda: {True: 0, False: 0})
    mode: bool = True
    left: int = 0  # steps of the current run still to take in ``mode``
    steps: int = 0
    next_probe: int = 0


@dataclass
class SpeculationSwitch:
    probe: int = 3  # steps per probe of a mode (the first is the switch's, not a sample)
    explore_every: int = 128  # steps between probes of the slower mode
    alpha: float = 0.25  # weight of a new sample
    clip: float = 4.0
    buckets: dict = field(default_factory=dict)  # power of two -> _Bucket

    def __post_init__(self):
        if not self.probe >= 2:
            raise ValueError(f"probe: must be >= 2 (got {self.probe}): a probe's first step is not a sample")
        if not self.explore_every > self.probe:
            raise ValueError(f"explore_every: must be > probe ({self.probe}) (got {self.explore_every})")

    def _bucket(self, batch: int) -> _Bucket:
        return self.buckets.setdefault(1 << max(int(batch) - 1, 0).bit_length(), _Bucket())

    def decide(self, batch: int) -> bool:
        """Whether the next step of ``batch`` requests verifies trees (True) or decodes plainly."""
        b = self._bucket(batch)
        b.steps += 1
        if b.left == 0:
            unseen = [m for m in (True, False) if b.samples[m] < self.probe - 1]
            best = self.best(batch)
            if unseen:
                b.mode, b.left = unseen[0], self.probe
            elif b.steps >= b.next_probe:
                b.mode, b.left, b.next_probe = not best, self.probe, b.steps + self.explore_every
            else:
                b.mode, b.left = best, 1
        b.left -= 1
        return b.mode

    def best(self, batch: int) -> bool:
        """The mode with the higher estimated rate (trees on ties and before any sample)."""
        rate = self._bucket(batch).rate
        return rate.get(True, 0.0) >= rate.get(False, 0.0)

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One steady step of ``batch`` requests emitted ``tokens`` tokens in ``seconds``."""
        if not (batch > 0 and seconds > 0 and tokens >= 0):
            return
        b = self._bucket(batch)
        r = tokens / seconds / batch
        old = b.rate.get(speculated)
        if old is not None:
            r = min(max(r, old / self.clip), old * self.clip)
        b.rate[speculated] = r if old is None else (1 - self.alpha) * old + self.alpha * r
        b.samples[speculated] += 1
