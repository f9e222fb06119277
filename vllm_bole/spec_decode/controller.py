"""The verification budget per step, batch-wide and ragged per request (BASTION's S(N) and Bole's
B_ver(c) on one cost model). Engine-agnostic: the runner feeds it the grown trees' scores, the
requests' context lengths and its measured step times.

* :class:`Roofline`: a prior for one target forward from the model and the GPU: weights read once,
  every request's KV read once per full-attention layer, every request's recurrent and conv state
  read once and written once, 2 flops per parameter per token plus attention's 4 * head_dim *
  heads flops per (token, context token); time = overhead + max(bytes / bandwidth, flops / peak).
* :class:`StepCostModel`: that prior times a correction learnt online from measured steps, an
  exponentially weighted ratio per token bucket (the padded token count, i.e. the CUDA-graph
  size), each measurement clipped to 4x the current ratio (outliers: steps that compiled kernels);
  an unseen bucket lies on the line ``a + r * prior`` through the seen buckets, not at the nearest seen
  one's ratio: on the H100 at 992f2cd (the 70M pair, c = 128) every bucket up to 512 tokens measured
  ~25x its prior (the host work around a forward the prior puts at ~0.3 ms, flat in the tokens), and that
  ratio carried onto the prior's flops-bound buckets (above ~1200 tokens) made the forward of 16 nodes a
  request look 1.5-2x that of 3, where the fixed budgets' runs (8 and 16) measured their whole steps within 1.3x.
  The line's slope is fitted only over priors at least ``SLOPE_SPREAD`` apart, else ``r = 1`` (the prior's own
  growth on top of the measured excess), and the controller keeps one model per batch bucket
  (:meth:`BudgetController.cost_model`): the measured forward grows with the requests (the host's work per
  request), the prior with the tokens, and in one model the first posed as the second. Seen on the H100 at
  fbec640 (c = 128, MT-Bench): points from batches of 1 to 128 gave ``r = 21.9``, which priced 16 nodes a
  request (2176 tokens, the prior flops-bound) ~2.6 ms above 6 (~900 tokens; our reconstruction of the prior),
  where the fixed budget of 16 ran its whole tree step faster than the controller's; at 128 requests alone the
  seen buckets' priors lay within a few percent of each other, a slope of noise.
* :class:`NodeTimes`: the step's time beside the forward, its drafting and its rest, each ``a + b * nodes``
  per batch bucket (requests rounded up to a power of two), fitted online: the drafting in the per-request
  search budget, the rest in the step's chosen draft nodes.
  The forward is flat within a CUDA-graph bucket, but drafting and the host's work grow with every node: on
  the H200 at ebdbbaa (c = 1, the 70M pair) 16 nodes a request took 1.3 ms a step more than 8, and with one
  number for the drafting and one for the rest the controller chose 16 where 8 gave 1.16x the tokens per
  second. The drafting is the search's, not the chosen trees' (every request is searched at one budget, 1.5x
  the batch's largest choice: :meth:`BudgetController.search_budget`), so a choice is priced with
  the search it leads to: one request's deep tree against the search it makes every request pay for. It is learnt
  at that same search budget (``Choice.search``), not at the trees' width: on the H100 at f428370 the paged
  draft's slots were the cap's 32 whatever the budget, the drafting line got fitted to the drifting batch alone
  (through the origin, 0.0055 ms a node at c = 32) and priced at requests x 6-32, and the controller chose 5.3
  nodes a request where budget 8 gave 1.5x its tokens per second. And in the per-request budget, not in requests
  x budget: the paged draft's step costs the same at every search budget (fixed shapes) but grows with the
  requests, and the batch drifts across its bucket as requests finish (17-32 at c = 32): on the H100 at fbec640
  a line in requests x budget rose with the requests (0.0063 ms a node between 17 and 32 requests of 16 nodes,
  the draftings that caught up on prompts left out) and priced 16 nodes a request 1.4 ms above 9 at 32 requests,
  where those searches' draftings measured within 0.1 ms. In the per-request budget the requests' share is
  the intercept and the paged draft's line comes out flat.
* :class:`BudgetController`: given every request's best-first tree at its maximum budget (node
  scores ``rho``, whose sum estimates the accepted tokens), it orders all draft nodes of the batch
  by ``rho`` (after each request's first ``min_per_request``) and picks the total N maximising the
  estimated throughput ``(B + sum rho of the first N) / (cost(B + N) + drafting(search(N)) + rest(N))``
  (``search(N)``: the bounded search that choice leads to, below; ``rest``:
  the engine step's time around the forward and the drafting, its scheduling and output processing,
  measured by the engine; without it, on the H200 at 59e0ecd, the choice at 32 requests was ~6 nodes
  a request where 16 gave 1.09x the tokens per second: a step's fixed ~4 ms of host work was
  missing from the denominator), among totals
  whose step (forward, drafting and rest) stays within ``(1 + eps)`` times the step of root-only trees
  of the same batch (Bole's cap, on the whole step: on the H200 at af4cf8f, capping the forward alone
  at 2x kept 128 requests at 3-6 nodes each, the prior's flops growing 3x from 128 to 2048 tokens,
  where 16 nodes each were 1.9x the tokens per second: the step was ~25 ms of which the forward ~5,
  flat in the node count; a cap on the forward never lets the exploration measure that). A request
  with poor acceptance scores low and gets a small tree; one without candidates gets none. Every
  16th choice explores the next larger bucket, filled (the cap still holds), so a prior that overrates the
  cost of larger buckets (an MoE model's inactive experts, say) gets corrected by measurement, and
  every 16th, half-way between, half the nodes, so that the times' slopes are measured over node counts
  far enough apart: with the next smaller bucket instead (often a node or a few less, and above the
  largest CUDA-graph size one token less) the slopes were fitted to noise, and on the H100 at 992f2cd the
  controller at c = 128 chose 2.6 nodes a request where budget 8 (5.7 chosen) gave 1.56x the tokens per
  second, its drafting line at 0.014 ms a node where the fixed budgets' runs differ by 0.0009.
  Every choice runs the whole rule. Tried and not kept (the 31st session, after ``choose_ms`` on the H100 at
  ad1f02e: 0.46-0.6 ms a step at c = 1 and 8, 0.7-0.9 at c = 32, 1.1-1.6 at c = 128, the cut included): a full
  choice every 4th, the others reusing its threshold (nodes scoring at least its last one, within its largest
  per-request budget and its token bucket). It saved 20-130 us a choice on the CPU (the per-request sort, the cut
  and the Choice remain) and cost 0.3-1.5% of the tokens per second in ``tests/test_controller.py``'s closed
  loops (its steps' node counts spread by the trees alone, the drafting and rest lines' slopes fit to noise).
  :meth:`BudgetController.search_budget` bounds the search the trees are cut from: ``SEARCH_GROWTH``
  (1.5) times the largest per-request budget chosen last (at least ``SEARCH_FLOOR``), the full cap before
  the first choice and before every exploring one. Seen on the H200 (198194b, c = 128): searching at the
  cap every step made drafting 20 ms against 8 ms for the budget the controller then chose. The cut trees
  are the same best-first trees (``Slots.tree(budget)``) whenever the choice stays below the bound; the
  bound only limits how fast the choice grows (1.5x per step; until 992f2cd 2x, so that at c = 1 a choice of
  8 searched 16, ~0.25 ms a step more drafting than budget 8 on the H100; in ``tests/test_controller.py``'s
  closed loops 1.5x gives 0.96-0.99x the best fixed budget, 2x 0.93-0.99x).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

__all__ = ["BudgetController", "Choice", "NodeTimes", "Roofline", "StepCostModel"]
SEARCH_FLOOR = 4  # draft nodes per request the bounded search always allows
SEARCH_GROWTH = 1.5  # the bounded search: this times the last choice's largest per-request budget (module docstring)
SLOPE_SPREAD = 1.5  # the forward's line fits a slope only over priors at least this far apart (module docstring)


@dataclass(frozen=True)
class Roofline:
    weight_bytes: float  # read once per forward
    params_active: float  # parameters touched per token (2 flops each)
    kv_bytes_per_token: float  # K + V bytes of one context token over all full-attention layers
    attn_flops_per_pair: float  # flops per (query token, context token) over all full-attention layers
    state_bytes: float  # recurrent + conv state bytes of one request over all layers
    bandwidth: float  # bytes / s
    peak_flops: float  # flop / s
    overhead_s: float = 0.0  # per forward (launches, host)

    def __post_init__(self):
        for name in ("bandwidth", "peak_flops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")

    def seconds(self, num_requests: int, tokens, pairs, kv_tokens: float) -> np.ndarray:
        """Time of one forward over ``tokens`` query tokens (any shape) with ``pairs`` (query,
        context) token pairs, ``num_requests`` requests holding ``kv_tokens`` context tokens."""
        tokens, pairs = np.asarray(tokens, dtype=np.float64), np.asarray(pairs, dtype=np.float64)
        nbytes = self.weight_bytes + self.kv_bytes_per_token * kv_tokens + 2 * self.state_bytes * num_requests
        flops = 2 * self.params_active * tokens + self.attn_flops_per_pair * pairs
        return self.overhead_s + np.maximum(nbytes / self.bandwidth, flops / self.peak_flops)


@dataclass
class StepCostModel:
    prior: Roofline
    alpha: float = 0.2  # weight of a new measurement
    # a measurement counts as at most ``clip`` times the bucket's ratio (or the predicted one's, or
    # the prior's): a step that compiled Triton kernels (1-25 s on the H200, against ~10 ms) must not
    # dominate the bucket for dozens of steps (seen: 162 ms predicted against 11 ms measured)
    clip: float = 4.0
    ratio: dict = field(default_factory=dict)  # bucket -> measured / prior
    points: dict = field(default_factory=dict)  # bucket -> weighted means (prior s, measured s)
    seed: float = 1.0  # the ratio before any measurement (a new batch bucket's: :meth:`BudgetController.cost_model`)
    # (seen buckets ascending, their ratios, :meth:`line`) as of the last observation (:meth:`seconds` runs every step)
    _fit: tuple | None = field(default=None, repr=False, compare=False)

    def seconds(self, buckets, prior) -> np.ndarray:
        """``[n]`` predicted seconds of forwards over token buckets ``[n]`` whose prior is ``prior`` ``[n]``: a seen
        bucket's prior times its ratio; an unseen one's on the line ``a + r * prior`` through the seen buckets'
        mean (prior, measured) points (least squares, ``0 <= r <=`` their largest ratio; ``r = 1`` over priors less
        than ``SLOPE_SPREAD`` apart, one point included), never below the prior; before any measurement the prior
        times ``seed``."""
        buckets, prior = np.asarray(buckets, dtype=np.int64), np.asarray(prior, dtype=np.float64)
        if not self.ratio:
            return prior * self.seed
        if self._fit is None:  # above the CUDA-graph sizes every token count is a bucket: dozens seen
            seen = np.array(sorted(self.ratio), dtype=np.int64)
            self._fit = seen, np.array([self.ratio[int(k)] for k in seen]), self.line()
        seen, ratios, (a, r) = self._fit
        out = np.maximum(a + r * prior, prior)
        i = np.minimum(np.searchsorted(seen, buckets), seen.size - 1)
        hit = seen[i] == buckets
        out[hit] = prior[hit] * ratios[i[hit]]
        return out

    def line(self) -> tuple[float, float]:
        """(a, r) through the seen buckets' points (plain Python: ~20 points, every step)."""
        pts, k = self.points.values(), len(self.points)
        mp, mm = sum(p for p, _ in pts) / k, sum(m for _, m in pts) / k
        if max(p for p, _ in pts) >= SLOPE_SPREAD * min(p for p, _ in pts):
            var = sum((p - mp) ** 2 for p, _ in pts) / k
            r = min(max(sum((p - mp) * (m - mm) for p, m in pts) / k / var, 0.0), max(self.ratio.values()))
        else:
            r = 1.0
        return mm - r * mp, r

    def observe(self, bucket: int, predicted_prior_s: float, measured_s: float) -> None:
        """One measured forward of token bucket ``bucket`` whose prior predicted ``predicted_prior_s``."""
        if not (predicted_prior_s > 0 and math.isfinite(measured_s) and measured_s > 0):
            return
        bucket = int(bucket)
        old = self.ratio.get(bucket)
        ref = old if old is not None else float(self.seconds([bucket], [predicted_prior_s])[0]) / predicted_prior_s
        r = min(max(measured_s / predicted_prior_s, ref / self.clip), ref * self.clip)
        w = 1.0 if old is None else self.alpha
        p, m = self.points.get(bucket, (0.0, 0.0))
        self._fit = None
        self.ratio[bucket] = r if old is None else (1 - w) * old + w * r
        self.points[bucket] = ((1 - w) * p + w * predicted_prior_s, (1 - w) * m + w * r * predicted_prior_s)


@dataclass
class NodeTimes:
    """Seconds of a part of the step as ``a + b * nodes`` per batch bucket (requests rounded up to a power of
    two; an unseen bucket reads the nearest seen one's line, none: 0), by exponentially weighted least
    squares (a sample weighs ``alpha``) with ``b >= 0`` (0 until two node counts were seen); a sample counts
    as at most ``clip`` times the line's value there (a step that compiled kernels)."""
    alpha: float = 0.05
    clip: float = 4.0
    means: dict = field(default_factory=dict)  # batch bucket -> weighted means of [n, n^2, t, n t]
    _lines: dict = field(default_factory=dict, repr=False, compare=False)  # batch bucket -> line, until an observation

    def line(self, batch: int) -> tuple[float, float]:
        """(a, b) seconds of the batch's bucket."""
        if not self.means:
            return 0.0, 0.0
        k = batch_bucket(batch)
        if k not in self._lines:
            n, nn, t, nt = self.means[nearest_bucket(self.means, batch)]
            var = nn - n * n
            b = max((nt - n * t) / var, 0.0) if var > 1e-6 * max(n * n, 1.0) else 0.0
            self._lines[k] = max(t - b * n, 0.0), b
        return self._lines[k]

    def at(self, batch: int, nodes) -> np.ndarray:
        a, b = self.line(batch)
        return a + b * np.asarray(nodes, dtype=np.float64)

    def observe(self, batch: int, nodes: int, sample: float) -> None:
        if not (math.isfinite(sample) and sample >= 0):
            return
        ref = float(self.at(batch, nodes))
        sample = min(sample, self.clip * ref) if ref > 0 else sample
        x = np.array([nodes, nodes * nodes, sample, nodes * sample], dtype=np.float64)
        k = batch_bucket(batch)
        old = self.means.get(k)
        self.means[k] = x if old is None else (1 - self.alpha) * old + self.alpha * x
        self._lines.clear()


def batch_bucket(batch: int) -> int:
    """Requests rounded up to a power of two (the buckets of :class:`NodeTimes` and of the speculation switch)."""
    return 1 << max(int(batch) - 1, 0).bit_length()


def nearest_bucket(buckets, batch: int) -> int:
    """The bucket of ``buckets`` (powers of two, at least one) nearest ``batch``'s on a log scale."""
    k = batch_bucket(batch)
    return min(buckets, key=lambda j: abs(math.log2(j / k)))


@dataclass(frozen=True)
class Choice:
    budgets: torch.Tensor  # [B] int64 draft nodes per request
    total: int  # draft nodes of the batch
    bucket: int  # padded token count of the verify forward
    predicted_s: float  # corrected cost of that forward
    prior_s: float  # the prior alone (what ``StepCostModel.observe`` compares against)
    expected_tokens: float  # B + sum rho of the chosen nodes
    # the per-request search budget the trees were drawn from (:meth:`BudgetController.search_budget`; not the
    # trees' width: the paged draft's step searches in slots of the full cap whatever the budget)
    search: int
    # [B, S] bool on the host: the slots the budgets keep (roots included; each request's best ``budgets[b]`` draft
    # slots by (rho desc, slot asc)): ``Slots.tree(keep=...)`` cuts the trees without ranking them again
    keep: torch.Tensor | None = None


class BudgetController:
    def __init__(self, cost: StepCostModel, *, min_per_request: int = 0, eps: float | None = 1.0,
                 buckets: Sequence[int] | None = None, explore_every: int | None = 16):
        if not min_per_request >= 0:
            raise ValueError(f"min_per_request: must be >= 0 (got {min_per_request})")
        if eps is not None and not eps >= 0:
            raise ValueError(f"eps: must be >= 0 or None (got {eps})")
        self.template, self.min, self.eps = cost, min_per_request, eps
        self.costs: dict[int, StepCostModel] = {}  # batch bucket -> the forward's model (:meth:`cost_model`)
        self.buckets = np.array(sorted(set(buckets)), dtype=np.int64) if buckets else None
        self.draft = NodeTimes()  # drafting time per step (the engine measures)
        self.rest = NodeTimes()  # the rest of an engine step beside the forward and the drafting (likewise)
        # every ``explore_every``-th choice takes the next larger allowed bucket and, half-way between, half the
        # nodes, so that buckets and node counts get measured (times are only learnt where steps ran)
        self.explore_every, self.choices = explore_every, 0
        self.reach: int | None = None  # the largest per-request budget of the last choice
        self.cap: int | None = None  # the per-request search budget's bound (:meth:`search_budget`)
        self.searching: int | None = None  # the per-request search budget the next choice's trees were searched at

    def cost_model(self, batch: int) -> StepCostModel:
        """The forward's model of ``batch``'s bucket (requests rounded up to a power of two; module docstring): a
        copy of the model the controller was given, learning apart from the other buckets', its ``seed`` the
        median ratio of the nearest bucket seen (so that its first steps are neither priced at the bare prior, ~20x
        too cheap on the H100 at fbec640, nor clipped to 4x it)."""
        k = batch_bucket(batch)
        if k not in self.costs:
            m = self.costs[k] = copy.deepcopy(self.template)
            seen = [j for j, c in self.costs.items() if c.ratio]
            if seen:
                m.seed = float(np.median(list(self.costs[nearest_bucket(seen, k)].ratio.values())))
        return self.costs[k]

    def search_budget(self, cap: int) -> int:
        """Draft nodes per request to search before :meth:`choose` (module docstring), at most ``cap``."""
        self.cap = cap
        exploring = self.explore_every and (self.choices + 1) % self.explore_every == 0
        self.searching = cap if self.reach is None or exploring else int(bounded_search(self.reach, cap))
        return self.searching

    def bucket(self, tokens) -> np.ndarray:
        """The padded token count of forwards over ``tokens`` tokens."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.buckets is None:
            return tokens
        i = np.minimum(np.searchsorted(self.buckets, tokens), self.buckets.size - 1)
        return np.where(tokens <= self.buckets[-1], self.buckets[i], tokens)

    def choose(self, logrho: torch.Tensor, valid: torch.Tensor, kv_lens: Sequence[int]) -> Choice:
        """``logrho`` / ``valid`` ``[B, S]``: every request's tree at its maximum budget (slot 0 the
        root, as :class:`~vllm_bole.spec_decode.best_first.Slots`); ``kv_lens`` [B] committed
        context lengths. Returns the per-request budgets (module docstring). Host work per step, in
        numpy (a fraction of torch's per-operation cost on these small arrays)."""
        B = logrho.shape[0]
        kv = np.asarray(kv_lens, dtype=np.float64).reshape(-1)
        if kv.size != B:
            raise ValueError(f"kv_lens: {kv.size} lengths for {B} requests")
        ok = _host(valid)
        lr = np.where(ok[:, 1:], _host(logrho)[:, 1:].astype(np.float64, copy=False), -math.inf)  # on any device
        # each request's draft nodes by score (ties: slot order, as ``Slots.tree``'s cut); the first ``min`` are
        # taken first, then the batch by score
        order = np.argsort(-lr, axis=1, kind="stable")
        rows = np.arange(B)[:, None]
        key = lr[rows, order]
        flat = np.flatnonzero(key > -math.inf)  # row-major: (request, rank) ascending
        k_score = key.reshape(-1)[flat]
        k_req, k_rank = np.divmod(flat, key.shape[1])
        later = k_rank >= self.min  # past a request's first ``min``
        # stable: equal scores keep (request, rank) order
        g = np.lexsort((-k_score, later)) if self.min else np.argsort(-k_score, kind="stable")
        node_req, rho, forced = k_req[g], np.exp(k_score[g]), int(flat.size - later.sum())
        N = node_req.size
        n = np.arange(N + 1)
        # per total of the first n nodes (index 0: none): the search it leads to (:meth:`search_budget`) from its
        # largest per-request budget (a request's nodes are taken in rank order), expected tokens, (query, context)
        # pairs
        curves = np.zeros((3, N + 1))
        np.maximum.accumulate(k_rank[g] + 1, out=curves[0, 1:], dtype=np.float64)
        np.cumsum(rho, out=curves[1, 1:])
        np.cumsum(kv[node_req] + 1, out=curves[2, 1:])
        search = bounded_search(curves[0], self.cap or lr.shape[1])
        expected = B + curves[1]
        pairs = kv.sum() + B + curves[2]
        bucket = self.bucket(B + n)
        prior = self.template.prior.seconds(B, bucket, pairs, float(kv.sum()))
        cost = self.cost_model(B).seconds(bucket, prior)
        cand = n >= forced
        step = cost + self.draft.at(B, search) + self.rest.at(B, n)  # the whole tree step's time
        if self.eps is not None:
            cand &= step <= (1 + self.eps) * step[0]
        if not cand.any():
            cand[forced] = True
        tput = expected / step
        best = int(np.where(cand, tput, -math.inf).argmax())
        self.choices += 1
        every = self.explore_every or 0
        phase = self.choices % every if every else None
        if phase == 0:  # the next larger bucket, filled
            larger = np.flatnonzero(cand & (bucket > bucket[best]))
            best = int(np.flatnonzero(cand & (bucket == bucket[larger[0]]))[-1]) if larger.size else best
        elif phase == every // 2:  # half the nodes
            smaller = np.flatnonzero(cand & (n <= best // 2))
            best = int(smaller[-1]) if smaller.size else best
        budgets = np.bincount(node_req[:best], minlength=B).astype(np.int64)
        self.reach = int(budgets.max()) if B else 0
        keep = np.empty(ok.shape, dtype=bool)
        keep[:, 0] = ok[:, 0]
        keep[rows, 1 + order] = np.arange(lr.shape[1]) < budgets[:, None]
        return Choice(budgets=torch.from_numpy(budgets), total=best, bucket=int(bucket[best]),
                      predicted_s=float(cost[best]), prior_s=float(prior[best]), expected_tokens=float(expected[best]),
                      search=self.searching or lr.shape[1], keep=torch.from_numpy(keep))


def bounded_search(reach, cap):
    """Draft nodes per request a search bounded by a choice whose largest per-request budget is ``reach`` (scalar
    or array) reaches for: ``SEARCH_GROWTH x reach``, rounded up, within ``[SEARCH_FLOOR, cap]``."""
    return np.minimum(cap, np.maximum(SEARCH_FLOOR, np.ceil(SEARCH_GROWTH * np.asarray(reach, dtype=np.float64))))


def _host(x) -> np.ndarray:
    """A tensor (any device) or array as a host numpy array."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
