"""Speculate at all? The choice between tree steps and plain decoding, per batch-size bucket, by the
measured output rate of whole engine steps in each mode. Engine-agnostic.

The budget controller (:mod:`~vllm_bole.spec_decode.controller`) sizes trees from a model of the
target forward; what a tree step costs around it (drafting, the host's per-request work, the
engine's own scheduling and output processing, a plain decode's whole-batch CUDA graph that a tree
step cannot use) it does not see. Seen on the H200 (711675d, a 70M hybrid with a 14M draft): tree
steps 0.2-0.33x plain decoding at 8-128 concurrent requests, 1.1x at 1. So the engine measures
both modes, as the user sees them, and keeps the faster one:

* a bucket (the batch size rounded up to a power of two) estimates a mode's rate as the mean tokens a
  step emits per request, over that mode's last ``yields`` decode steps, divided by the median seconds
  of its last ``window`` steady steps (``1 / TPOT`` of that mode);
* a step's tokens count whenever it decoded only (no prompt tokens in it); its seconds, from one input
  preparation to the next (scheduler and output processing included), only when it was steady: it ran
  in the same mode as the step before it (the first step after a switch carries the switch's cost: the
  draft catching up on the tokens decoded plainly) and kept its requests (none arrived, finished or
  resumed: an engine idle between requests never lands in a sample); the median leaves out a step that
  compiled kernels;
* a bucket first runs ``probe`` steps of each mode (trees first), then the faster mode, and every
  ``explore_every`` steps ``probe`` steps of the other one (its estimate follows acceptance and context
  lengths as they change): the slower mode takes at most ``probe / explore_every`` of the steps; while
  the slower mode's estimate is within two standard errors of the faster one's, its probes come every
  ``4 * probe`` steps instead (an unlucky first probe of trees is corrected within a few probes);
* a bucket's first probe of plain decoding waits ``explore_every`` steps while its trees, less one standard
  error, beat every smaller bucket's plain rate: a plain step of more requests is no faster, so that rate
  bounds this bucket's. Checked at every decision, so the probe comes as soon as the trees' estimate falls to
  the bound (one standard error, not two: after the first probe of 4 tree steps the error is ~18%, and two
  would skip nothing). Seen on the H100 at fbec640 (the 70M pair, MT-Bench, ``budget: "auto"``): at c = 8,
  12 of 83 steps decoded plainly (each at ~0.6x a tree step's rate), mostly probes of buckets 4 and 8 met for
  the first time, whose trees ran at 1.3x / 1.5x bucket 1's plain rate; at c = 32 (29 of 113 steps plain) the
  bound is too loose to skip any: bucket 16's trees at 1.03x it, bucket 32's below it (plain steps of 32
  requests ran at half the rate of 16's).

Why tokens and seconds apart, over windows of different lengths: a tree step emits 1 to 9 tokens per
request while its duration varies by a few percent, and the switch stops running trees exactly when
their recent tokens dip (and then refreshes their estimate only ``probe`` steps in ``explore_every``),
so a short window of tokens leaves the estimate at its low. Seen on the H200 at 6088b99 (the 70M pair,
one request, MT-Bench): with the sums over the last 16 steady steps the switch rated trees at 363
tokens/s against plain decoding's 482 (their last 16 samples emitted 2.4 tokens a step; all its tree
steps emitted 4.06) and decoded plainly 91% of the steps, where a fixed budget of 16 delivered 603
tokens/s with trees alone (``tests/test_switch.py`` reproduces it: trees at 1.2x plain decoding ran 12-18%
of the steps; now 86-97%, delivering 0.96-0.98x the faster mode's rate at 0.8-1.46x). Before that
(59e0ecd) the estimate was the median of the last 5 samples' rates, which fell below plain decoding's
whenever 3 of 5 steps accepted little.

What a switch costs: the steps around a change of mode are slower than either mode's steady steps
(plain to trees: the draft catches up on the tokens decoded plainly, in the last plain step of a
synchronous engine; trees to plain: the pending paths committed, vLLM's own decode graph again). Seen on
the H100 at ff6ad01 (the 70M pair, one request, MT-Bench, ``budget: "auto"``): tree steps averaged
8.1 ms against 5.95 ms steady, plain steps 4.4 against 2.45, and the switch, which changed mode
every ~14 steps (probes of the slower mode every ``4 * probe`` steps while the two estimates were
close, per-request decisions near the break-even), delivered 0.71x a fixed budget of 16 with trees
alone. So each bucket measures a switch's cost ``x``: the excess over the modes' steady medians of the
step that leaves a mode and the one that enters the other, summed (the median of its last ``window``
round halves, doubled: a probe is a round trip), and uses it twice:

* hysteresis: the faster mode replaces the one the bucket runs outside probes only when what it saves until
  the next probe of the other (``explore_every`` of its steps) exceeds ``x / 2``: ``explore_every * t_best *
  (rate_best / rate_current - 1) > x / 2``; leaving trees also needs a lead beyond two standard errors of
  the tree estimate (its tokens are the noisy part: a request's few unlucky tree steps must not send it to
  plain decoding for good);
* probes: plain decoding, whose rate barely moves, at most every ``max(explore_every, 32 * x / t)`` steps
  (``t`` the running mode's step); trees, while their estimate is within two standard errors of plain
  decoding's, every ``max(4 * probe, 4 * x / t)``, else like plain decoding.

``tests/test_switch.py`` drives it on the H100's numbers (16 requests, each its own acceptance, trees at
~1.3x plain decoding) with round trips of 20 / 40 / 80 ms: 0.959 / 0.955 / 0.948x trees alone on average
(the cost-blind switch 0.92 / 0.86 / 0.76), and it still decodes plainly the requests the draft cannot
follow (>= 1.04x trees alone). First run on the H100 at a44eb73 (one request, MT-Bench): 16 steps decoded
plainly beside 473 tree steps (251 of 830 at ff6ad01), the cell 0.93x the best fixed budget (0.71x).

Per request (``keys``): acceptance is a property of the request far more than of the bucket (one
pair, MT-Bench at one request: 1.1 to 6.6 tokens a tree step by request). With the bucket's window
alone, one request whose continuation the draft cannot follow filled it with 1-token tree steps, and
the requests after it decoded plainly too: at d342dbe (H200, HumanEval, one request) the switch
decoded plainly 95% of the steps and delivered 0.62x the fixed budget's rate. So a tree step's tokens
are also kept per request (its last ``yields`` tree steps; :meth:`forget` drops finished requests),
and with the batch's ``keys`` a bucket's tree estimate is the mean over its requests of each one's own
mean, shrunk towards the bucket's by ``prior_weight`` pseudo-samples (a request without tree steps of
its own gets the bucket's). A batch of which at least half the requests never ran a tree step probes
trees at once (once per request: a request that never gets a tree does not keep asking).
"""
from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field

from vllm_bole.spec_decode.controller import batch_bucket

__all__ = ["SpeculationSwitch"]


@dataclass
class _Bucket:
    yields: dict  # speculate (bool) -> deque of the latest decode steps' tokens per request
    seconds: dict  # speculate (bool) -> deque of the latest steady steps' seconds
    excess: collections.deque  # the latest switches' excess seconds (a mode's last step plus the next one's)
    mode: bool = True
    home: bool = True  # the mode run outside probes
    left: int = 0  # steps of the current run still to take in ``mode``
    steps: int = 0
    last_probe: int = 0  # the step the last probe began
    leaving: float | None = None  # the excess of the last step of a mode the switch has just left


@dataclass
class _Own:
    """A request's last tree steps' tokens and their running sum (a decision reads every request's mean)."""
    steps: collections.deque
    total: float = 0.0

    def add(self, tokens: float) -> None:
        if len(self.steps) == self.steps.maxlen:
            self.total -= self.steps[0]
        self.steps.append(tokens)
        self.total += tokens


@dataclass
class SpeculationSwitch:
    probe: int = 4  # steps per probe of a mode (the first is the switch's, not timed)
    explore_every: int = 128  # steps between probes of the slower mode
    window: int = 16  # steady steps' seconds per mode and bucket in the estimate
    yields: int = 128  # decode steps' tokens per mode and bucket in the estimate
    prior_weight: float = 4.0  # the bucket's mean in a request's own estimate, as that many tree steps
    buckets: dict = field(default_factory=dict)  # power of two -> _Bucket
    own: dict = field(default_factory=dict)  # request key -> _Own: its last tree steps' tokens
    tried: set = field(default_factory=set)  # requests whose arrival started a probe of trees

    def __post_init__(self):
        if not self.probe >= 2:
            raise ValueError(f"probe: must be >= 2 (got {self.probe}): a probe's first step is not timed")
        if not self.explore_every > self.probe:
            raise ValueError(f"explore_every: must be > probe ({self.probe}) (got {self.explore_every})")
        if not self.window >= 1:
            raise ValueError(f"window: must be >= 1 (got {self.window})")
        if not self.yields >= 1:
            raise ValueError(f"yields: must be >= 1 (got {self.yields})")
        if not self.prior_weight > 0:
            raise ValueError(f"prior_weight: must be > 0 (got {self.prior_weight})")

    def _bucket(self, batch: int) -> _Bucket:
        key = batch_bucket(batch)
        if key not in self.buckets:
            self.buckets[key] = _Bucket({m: collections.deque(maxlen=self.yields) for m in (True, False)},
                                        {m: collections.deque(maxlen=self.window) for m in (True, False)},
                                        collections.deque(maxlen=self.window))
        return self.buckets[key]

    def decide(self, batch: int, keys=None) -> bool:
        """Whether the next step of ``batch`` requests verifies trees (True) or decodes plainly; ``keys``:
        the batch's requests (their own tree steps in the estimate)."""
        b = self._bucket(batch)
        b.steps += 1
        if b.left == 0:
            unseen = [m for m in (True, False) if not (b.seconds[m] and b.yields[m])]
            rate = self._rates(b, keys)
            if unseen == [False] and (bound := self._plain_bound(batch)) < math.inf \
                    and rate[True] * (1 - self._tree_error(b, keys)) > bound:
                unseen = []  # plain decoding is probed after ``explore_every`` steps (:meth:`_interval`)
            best = _faster(rate)
            run = self._run(b, best, rate, keys)
            since = b.steps - b.last_probe
            if unseen:  # a first probe of each mode
                b.mode, b.left, b.last_probe = unseen[0], self.probe, b.steps
            elif not run and keys and 2 * len(new := self._untried(keys)) >= len(keys):  # barely tried
                self.tried.update(new)
                b.mode, b.left, b.last_probe = True, self.probe, b.steps
            elif since >= 4 * self.probe and since >= self._interval(b, not run, rate, keys):
                b.mode, b.left, b.last_probe = not run, self.probe, b.steps
            else:
                b.mode = b.home = run
                b.left = 1
        b.left -= 1
        return b.mode

    def _plain_bound(self, batch: int) -> float:
        """The lowest plain rate of the buckets below ``batch``'s (``inf``: none measured): a bound of its own."""
        key = batch_bucket(batch)
        return min((self._rates(o, None).get(False, math.inf) for k, o in self.buckets.items() if k < key),
                   default=math.inf)

    def _interval(self, b: _Bucket, slower: bool, rate: dict, keys) -> int:
        """Steps until the probe after this one of the ``slower`` mode (the one not run): for trees while their
        estimate is within two standard errors of plain decoding's (:meth:`_tree_error`: a few unlucky tree steps
        must not keep them out for ``explore_every`` steps) ``4 * probe``, else ``explore_every``; at least 4
        (close) or 32 round trips' cost in steps of the running mode (module docstring)."""
        if len(b.yields[slower]) < 2 or len(rate) < 2:
            return self.explore_every
        close = slower and rate[True] * (1 + 2 * self._tree_error(b, keys)) >= rate[False]  # plain's rate barely moves
        trips = self._cost(b) / statistics.median(b.seconds[not slower])  # a round trip, in steps
        return math.ceil(max(4 * self.probe, 4 * trips) if close else max(self.explore_every, 32 * trips))

    def _tree_error(self, b: _Bucket, keys) -> float:
        """The relative standard error of the tree steps' tokens per request and step (with ``keys`` over the tree
        steps its requests' estimates rest on): plain decoding's tokens do not vary."""
        y = b.yields[True]
        mean = statistics.fmean(y) if len(y) >= 2 else 0.0
        if not mean > 0:
            return 0.0
        n = sum(self._seen(k) for k in keys) / len(keys) + self.prior_weight if keys else len(y)
        # the sample stdev in floats (statistics.stdev's exact fractions: ~125 us over 128 steps, every decision)
        return math.sqrt(math.fsum((x - mean) ** 2 for x in y) / (len(y) - 1)) / mean / n ** 0.5

    def _run(self, b: _Bucket, best: bool, rate: dict, keys) -> bool:
        """The mode to run outside probes: ``best``, unless the bucket ran the other one (before any probe) and
        switches cost time (module docstring): then only when what ``best`` saves over ``explore_every`` of its
        steps pays for the switch and its lead is beyond two standard errors of the tree estimate."""
        cur, cost = b.home, self._cost(b)
        if best == cur or cost == 0 or len(rate) < 2 or not rate[cur] > 0:
            return best
        lead = rate[best] / rate[cur] - 1
        saved = self.explore_every * statistics.median(b.seconds[best]) * lead
        sure = best or lead > 2 * self._tree_error(b, keys)  # trees are left on a lead beyond their noise
        return best if saved > cost / 2 and sure else cur

    def cost(self, batch: int) -> float:
        """The bucket's estimated seconds of a round trip between the modes beyond their steady steps."""
        return self._cost(self._bucket(batch))

    @staticmethod
    def _cost(b: _Bucket) -> float:
        return 2 * max(statistics.median(b.excess), 0.0) if b.excess else 0.0

    def rates(self, batch: int, keys=None) -> dict:
        """The bucket's estimate per mode (tokens / s / request; a mode without tokens and seconds is absent);
        ``keys``: the batch's requests, each tree estimate from its own tree steps (see the module)."""
        return self._rates(self._bucket(batch), keys)

    def _rates(self, b: _Bucket, keys) -> dict:
        rate = {m: statistics.fmean(b.yields[m]) / statistics.median(b.seconds[m])
                for m in (True, False) if b.yields[m] and b.seconds[m]}
        if keys and True in rate:
            pooled, w = statistics.fmean(b.yields[True]), self.prior_weight
            none = _Own(collections.deque())
            own = [self.own.get(k, none) for k in keys]
            tokens = sum((o.total + w * pooled) / (len(o.steps) + w) for o in own) / len(own)
            rate[True] = tokens / statistics.median(b.seconds[True])
        return rate

    def samples(self, batch: int) -> dict:
        """The bucket's samples per mode, oldest first: {"tokens": per request, "seconds": ...} (what
        :meth:`rates` reads; exported to check it against the engine's own step times)."""
        b = self._bucket(batch)
        return {m: dict(tokens=list(b.yields[m]), seconds=list(b.seconds[m])) for m in (True, False) if b.yields[m]}

    def best(self, batch: int, keys=None) -> bool:
        """The mode with the higher estimated rate (trees on ties and before any sample)."""
        return _faster(self.rates(batch, keys))

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float | None,
                per_request: dict | None = None, switched: float | None = None) -> None:
        """A decode step of ``batch`` requests emitted ``tokens`` tokens; ``seconds``: its duration when it was
        steady, else None; ``per_request``: a tree step's tokens per request key (its tree requests);
        ``switched``: its duration when it was not steady only because it was the first in its mode (its
        requests those of the step before it). Called after :meth:`decide` chose the next step's mode."""
        if batch <= 0 or tokens < 0:
            return
        b = self._bucket(batch)
        b.yields[speculated].append(tokens / batch)
        steady = b.seconds[speculated]
        if switched is not None and b.leaving is not None and steady:
            b.excess.append(b.leaving + switched - statistics.median(steady))
        b.leaving = None
        if seconds is not None and seconds > 0:
            if b.mode != speculated and steady:  # the next step runs in the other mode
                b.leaving = seconds - statistics.median(steady)
            steady.append(seconds)
        for k, n in (per_request or {}).items() if speculated else ():
            o = self.own.get(k)
            if o is None:
                o = self.own[k] = _Own(collections.deque(maxlen=self.yields))
            o.add(n)

    def _untried(self, keys) -> list:
        """The requests of ``keys`` with fewer than ``probe`` tree steps whose arrival started no probe yet."""
        return [k for k in keys if self._seen(k) < self.probe and k not in self.tried]

    def _seen(self, key) -> int:
        """Tree steps of ``key`` in its estimate."""
        o = self.own.get(key)
        return len(o.steps) if o is not None else 0

    def forget(self, keys) -> None:
        """Finished requests: their own tree steps leave the estimates."""
        for k in keys:
            self.own.pop(k, None)
            self.tried.discard(k)


def _faster(rate: dict) -> bool:
    """The mode with the higher estimated rate in ``rate`` (trees on ties and before any sample)."""
    return rate.get(True, 0.0) >= rate.get(False, 0.0)
