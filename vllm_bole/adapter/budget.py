"""The budget controller inside vLLM's runner (``budget: "auto"``): its roofline prior from the
loaded model, its KV caches and the device; its measurements (each tree step, from input
preparation to the sampled tokens, which the verification reads back to the host); its counters.

Above the controller, its :class:`~vllm_bole.spec_decode.switch.SpeculationSwitch`: whether the
next step drafts trees at all or decodes plainly (vLLM's own decode step, its whole-batch CUDA graph
included), by the measured rate of whole engine steps in each mode (from one input preparation to the
next).

The prior's device numbers are nominal (HBM bandwidth, dense bf16 peak; a CPU gets a rough
default): the online correction per token bucket absorbs what they miss, from the first tree step
of each bucket on.
"""
from __future__ import annotations

import collections
import time

import torch

from vllm_bole.spec_decode.controller import BudgetController, Choice, Roofline, StepCostModel
from vllm_bole.spec_decode.switch import SpeculationSwitch

# device-name substring -> (bytes / s, flop / s)
DEVICES = {"H200": (4.8e12, 9.89e14), "H100": (3.35e12, 9.89e14), "H20": (4.0e12, 1.48e14),
           "A100": (2.0e12, 3.12e14), "L40S": (8.64e11, 3.62e14), "L4": (3.0e11, 1.21e14)}
CPU = (2.0e10, 2.0e11)
OVERHEAD_S = {"cuda": 1e-4, "cpu": 1e-3}


def device_roofline(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        return CPU
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DEVICES.items() if k in name), DEVICES["A100"])


def active_params(params, hf_config) -> float:
    """Parameters one token touches: an expert tensor (3-D, one slice per expert) counts
    ``experts_per_token / experts`` of itself."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    k = next((getattr(cfg, a) for a in ("num_experts_per_tok", "moe_topk") if getattr(cfg, a, None)), None)
    e = next((getattr(cfg, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
              if getattr(cfg, a, None)), None)
    share = k / e if k and e else 1.0
    return float(sum(p.numel() * (share if k and e and p.dim() == 3 and p.shape[0] == e else 1.0) for p in params))


def _state_bytes(layer) -> int:
    """Bytes of one request's state (every tensor of the layer's cache, one slot)."""
    return sum(t[0].numel() * t.element_size() for t in layer.module.kv_cache)


class StepBudget:
    def __init__(self, config):
        self.config = config
        self.ctl: BudgetController | None = None
        self.t0: float | None = None
        self.predicted_s: float | None = None
        self.switch = SpeculationSwitch()
        self.last: dict | None = None  # the engine step under way, as the switch samples it
        self.decided: bool | None = None  # the switch's choice for the next step (None: it made none)
        self.next_trees: tuple[int, int] | None = None  # (requests, draft nodes) of the trees drafted for the next step
        self.drafting: Choice | None = None  # the choice of those trees, until :meth:`drafted` samples its drafting
        self.drafts = collections.deque(maxlen=64)  # the last drafting samples: [requests, search, chosen, ms]
        self.stats = dict(budget_steps=0, budget_nodes=0, budget_last=[], budget_buckets={}, observed_steps=0,
                          predicted_step_s=0.0, measured_step_s=0.0, plain_decode_steps=0)

    def controller(self, runner) -> BudgetController:
        """Built at the first drafting step (model loaded, KV caches bound, layers installed)."""
        if self.ctl is None:
            self.ctl = BudgetController(StepCostModel(self._prior(runner)), min_per_request=self.config.min_budget,
                                        eps=self.config.eps, buckets=self._buckets(runner))
        return self.ctl

    @staticmethod
    def _prior(runner) -> Roofline:
        params = list(runner.get_model().parameters())
        kv = pair = 0.0
        for group in runner._bole_attention:
            for layer in group.layers:
                m = layer.module
                kv += 2 * m.num_kv_heads * m.head_size * m.kv_cache[0].element_size()
                pair += 4 * m.num_heads * m.head_size
        state = sum(_state_bytes(x) for x in runner._bole_recurrent_layers())
        device = torch.device(runner.device)
        bw, peak = device_roofline(device)
        return Roofline(weight_bytes=sum(p.numel() * p.element_size() for p in params),
                        params_active=active_params(params, runner.model_config.hf_config), kv_bytes_per_token=kv,
                        attn_flops_per_pair=pair, state_bytes=state, bandwidth=bw, peak_flops=peak,
                        overhead_s=OVERHEAD_S.get(device.type, 1e-3))

    @staticmethod
    def _buckets(runner):
        mode = getattr(runner.compilation_config, "cudagraph_mode", None)
        if mode is None or mode.name == "NONE":
            return None
        return list(getattr(runner, "cudagraph_batch_sizes", None) or []) or None

    def chosen(self, choice: Choice) -> None:
        st = self.stats
        st["budget_steps"] += 1
        st["budget_nodes"] += choice.total
        st["budget_last"] = choice.budgets.tolist()
        st["budget_buckets"][choice.bucket] = st["budget_buckets"].get(choice.bucket, 0) + 1
        self.predicted_s, self.next_trees = choice.predicted_s, (len(choice.budgets), choice.total)
        self.drafting = choice

    def model(self) -> dict:
        """What the controller has learnt: per batch bucket, the forward's ratio to its prior per token bucket and,
        for the token buckets not seen, its line [ms, per prior second] through them; drafting and the rest per
        batch bucket as [ms, ms per draft node] (the per-request search budget for the drafting, chosen nodes for
        the rest); the last drafting samples as [requests, search budget, chosen nodes, ms]."""
        if self.ctl is None:
            return {}
        c = self.ctl
        line = lambda t: {k: [round(1000 * v, 4) for v in t.line(k)] for k in sorted(t.means)}  # noqa: E731
        costs = {k: m for k, m in sorted(c.costs.items()) if m.points}
        lines = {k: m.line() for k, m in costs.items()}
        return dict(forward_ratio={k: {b: round(r, 4) for b, r in sorted(m.ratio.items())} for k, m in costs.items()},
                    forward_line={k: [round(1000 * a, 4), round(r, 4)] for k, (a, r) in lines.items()},
                    draft=line(c.draft), rest=line(c.rest), draft_samples=list(self.drafts))

    def drafted(self, seconds: float, catching_up: bool = False) -> None:
        """The step under way drafted the next step's trees for ``seconds``: a sample of the controller's
        drafting time at the search budget its trees were drawn from (unless ``catching_up``: the drafter also took in
        tokens beyond one step's, a new prompt's or a plain step's, whatever the budget), and the part of this
        step's interval that is not its rest (:meth:`step_begun`). Catching up is no sample: on the H100 at fbec640
        (c = 32, MT-Bench) such draftings took 7-16 ms against 3.8-4.2 for trees alone, and as they came at the
        full batch, the line (then in requests x search budget) rose 0.0127 ms a searched node (6.5 ms at 32 x 16
        nodes), so the controller chose 9 nodes a request where the fixed 16 gave 1.08x its tokens per second."""
        c, self.drafting = self.drafting, None
        if self.ctl is not None and c is not None and not catching_up:
            self.ctl.draft.observe(len(c.budgets), c.search, seconds)
            self.drafts.append([len(c.budgets), c.search, c.total, round(1000 * seconds, 3)])
        if self.last is not None:
            self.last["draft_s"] = seconds

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def step_begun(self, batch: int, tree: bool, prefill: bool, changed: bool) -> None:
        """An engine step of ``batch`` requests began at :meth:`start` (a tree step or not; with prompt
        tokens or not; ``changed``: requests arrived, finished or resumed since the previous step): the
        previous step, when it decoded only, is a sample of the switch: its tokens always, its duration
        (from its beginning to this one's) when it was steady (in the mode the switch chose for it, that of
        the step before it) and kept its requests, or as the switch's cost when it kept its requests and was
        the first in its mode."""
        last = self.last
        if last is not None and not last["prefill"]:
            seconds = None if changed else self.t0 - last["t"]
            steady = last["steady"] and not changed
            self.switch.observe(last["batch"], last["tree"], last["tokens"], seconds if steady else None,
                                last.get("per_request"), switched=seconds if last["switched"] else None)
            if steady and self.ctl is not None and "forward_s" in last and last["trees"] is not None:
                rest = self.t0 - last["t"] - last["forward_s"] - last.get("draft_s", 0.0)  # the rest of a tree step
                self.ctl.rest.observe(*last["trees"], max(rest, 0.0))
        steady = last is not None and last["tree"] == tree and self.decided in (None, tree)
        self.last = dict(t=self.t0, batch=batch, tree=tree, prefill=prefill, tokens=batch, steady=steady,
                         switched=last is not None and last["tree"] != tree and not last["prefill"],
                         trees=self.next_trees if tree else None)  # (requests, draft nodes) it verifies
        self.next_trees = None
        self.decided = None

    def emitted(self, tokens: int, per_request: dict) -> None:
        """The tree step under way emitted ``tokens`` tokens (a plain decode step: one per request),
        ``per_request`` {request id: tokens} of them its trees'."""
        self.last["tokens"], self.last["per_request"] = tokens, per_request

    def speculate(self, req_ids: list) -> bool:
        """Whether the next step of the requests ``req_ids`` drafts trees (the switch's decision)."""
        self.decided = self.switch.decide(len(req_ids), req_ids)
        self.stats["plain_decode_steps"] += not self.decided
        return self.decided

    def observe(self, num_requests: int, tokens: int, kv_tokens: float,
                drafting_s: float = 0.0, mixed: bool = False) -> tuple[float, float] | None:
        """The tree step begun at :meth:`start` has its sampled tokens on the host (``drafting_s`` of that
        time spent launching the next drafts: not the step's); returns (predicted, measured) seconds where
        the controller predicted this step. ``mixed``: prompt rows beside the trees, whose forward (a second
        one with tree graphs) is not the tree forward the cost model predicts: not learnt from (H200,
        af4cf8f: 13-63% of the tree steps at c = 8-128 had prompt rows, and the measured steps averaged
        1.3-2.5x the predicted ones there; their buckets' ratios had learnt both kinds). Under async scheduling
        a tree step's results are read at the next step's settle, so the measured time runs from this step's
        input preparation to that settle: the step's period as the engine runs it (the engine's work between
        steps overlapped with the device's), which the throughput rule is about; the ``rest`` line then learns
        what is left of the interval, about nothing. Decided so (not the device time alone): under async the
        period, not the forward, is what a larger tree lengthens; not yet checked against the H200."""
        if self.ctl is None or self.t0 is None or mixed:
            self.t0 = self.predicted_s = None
            return None
        measured, self.t0 = time.perf_counter() - self.t0 - drafting_s, None
        if self.last is not None:
            self.last["forward_s"] = measured
        bucket = int(self.ctl.bucket([tokens])[0])
        prior = float(self.ctl.template.prior.seconds(num_requests, [bucket], [kv_tokens + tokens], kv_tokens)[0])
        self.ctl.cost_model(num_requests).observe(bucket, prior, measured)
        st = self.stats
        if self.predicted_s is None:
            return None
        st["observed_steps"] += 1
        st["predicted_step_s"] += self.predicted_s
        st["measured_step_s"] += measured
        predicted, self.predicted_s = self.predicted_s, None
        return predicted, measured

