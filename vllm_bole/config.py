"""The one user-facing configuration of vllm-bole's tree speculation (engine-agnostic, pydantic).

Users pass it as vLLM's speculative config, e.g.::

    vllm serve MODEL --speculative-config '{"method": "bole_tree", "drafter": "ngram", "num_speculative_tokens": 16}'
    LLM(MODEL, speculative_config={"method": "bole_tree", "drafter": "draft_model", "model": "/path/draft",
                                   "num_speculative_tokens": 16, "max_depth": 6})

Fields (every other key is refused, with the list of allowed ones):

* ``method``: ``"bole_tree"`` (selects this plugin; vLLM itself does not know the name).
* ``drafter``: ``"ngram"`` (prompt lookup over the request's own tokens), ``"draft_model"`` (a
  separate small model with the target's tokenizer, path in ``model``), ``"block"`` (a one-pass
  block drafter on the target's own last hidden state) or ``"mtp"`` (a multi-token-prediction block
  applied recurrently from that state), each with its checkpoint in ``model``
  (:mod:`vllm_bole.spec_decode.block_drafter`; they draft at most as deep as they were trained).
* ``num_speculative_tokens``: the most draft nodes per request and step (the root excluded), 1-255.
  vLLM reserves this many KV slots per request beyond the bonus token; the tree has at most
  ``num_speculative_tokens + 1`` nodes.
* ``budget``: ``"auto"`` (default: the budget controller, :mod:`vllm_bole.spec_decode.controller`,
  chooses every step's draft nodes for the whole batch from a cost model of the target step
  corrected by measured step times, ragged per request, between ``min_budget`` and
  ``num_speculative_tokens``) or an integer: that many draft nodes for every request, every step
  (at most ``num_speculative_tokens``).
* ``eps``: with ``"auto"``, a tree step (its forward, drafting and the engine's rest) may take at
  most ``1 + eps`` times the step of root-only trees of the same batch (Bole's cap, on the whole
  step; default 1.0; ``null``: no cap, throughput alone).
* ``min_budget``: with ``"auto"``, draft nodes every request with candidates gets first (default 0).
* ``plain_fallback``: with ``"auto"``, ``true`` (default): the engine decodes plainly (no drafts,
  vLLM's own decode step) for batch sizes where that measures faster than tree steps
  (:mod:`vllm_bole.spec_decode.switch`); ``false``: tree steps always.
* ``calibrate``: ``true`` (default): the tree builder rescales the drafter's probabilities per
  (depth, node kind: main path, its siblings, their subtrees) by the acceptance measured on this
  engine's verified trees (:mod:`vllm_bole.spec_decode.calibration`); ``false``: the drafter's own
  probabilities. Lossless either way (only the trees' shapes change).
* ``max_depth``: deepest draft node (1-64, default 8; capped at ``num_speculative_tokens``).
* ``top_k``: candidate children per node considered by the best-first builder (default: the
  budget, which makes the builder exact).
* ``model``: draft model directory, a local checkpoint with the target's tokenizer (``drafter:
  draft_model``), or the head checkpoint trained on this target (``drafter: block`` or ``mtp``);
  required with those, refused with ``ngram``.
* ``draft_dtype``: ``"auto"`` (the draft checkpoint's dtype), ``"float32"``, ``"bfloat16"``,
  ``"float16"`` (``draft_model`` only).
* ``draft_runtime``: how a ``draft_model`` drafter runs (``draft_model`` only): ``"auto"`` (default:
  ``"paged"`` when the draft can, else ``"transformers"``), ``"paged"`` (inside the engine, incremental
  over its own paged KV cache, all requests in one batch, each step one CUDA graph replay:
  :mod:`vllm_bole.spec_decode.paged_draft`; attention-only drafts) or ``"transformers"`` (the
  reference: every step re-reads the histories, :mod:`vllm_bole.spec_decode.draft_model`; any draft,
  hybrids included).
* ``draft_beam``: ``0`` (default): the paged draft model drafts its greedy chain with the top-``k``
  candidates per depth (each step one CUDA graph replay); ``w >= 1``: it drafts the tree node by node,
  the ``w`` best frontier nodes of every request and depth through one draft forward, every node's
  children from its own context (:mod:`vllm_bole.spec_decode.paged_tree_draft`; each step one CUDA graph
  replay, as the chain's; ``w * (max_depth - 1) <= 256``). ``draft_model`` with the paged runtime only.
* ``prompt_lookup_min`` / ``prompt_lookup_max``: suffix lengths matched (``ngram`` only; default
  1 / 4): every earlier occurrence of the context's last ``n`` tokens votes, with weight ``4 ** n``,
  for what followed it (``vllm_bole.spec_decode.ngram``).
* ``kernels``: ``"auto"`` (default: the Triton kernels on CUDA, their torch twins on CPU),
  ``"torch"`` or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``, for tests). Full-attention
  layers on vLLM's CPU backend always use the torch path: that backend stores keys transposed
  (``vec``) or VNNI-tiled (``amx``), which the Triton kernel (unit-stride head dim) cannot address.

* ``async_scheduling``: ``False`` (default) or ``True``: vLLM's async scheduling (the engine schedules
  the next step and processes the last one's output while the GPU runs a step); the tree runner then
  settles each step at the start of the next one (:meth:`~vllm_bole.adapter.runner.TreeRunnerMixin._bole_settle`);
  the scheduler books ``num_speculative_tokens`` drafts a request (KV slots, token budget), which the runner
  cuts to its trees; logprobs make a step wait for its results; every drafter (the heads draft behind a tree
  step's verification, and after a step without trees at the next settle from that step's hidden states, kept
  by request); requests with structured output are refused. Opt-in until measured on a GPU.

Errors name the field and its allowed values (:class:`ConfigError`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES

METHOD = "bole_tree"


class ConfigError(ValueError):
    """An invalid vllm-bole speculative configuration; the message names the field."""


class TreeSpecConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # "8" is not an integer

    method: Literal["bole_tree"]
    drafter: Literal["ngram", "draft_model", "block", "mtp"]
    num_speculative_tokens: int = Field(ge=1, le=MAX_NODES - 1)
    budget: Literal["auto"] | Annotated[int, Field(ge=1, le=MAX_NODES - 1)] = "auto"
    eps: float | None = Field(default=1.0, ge=0)
    min_budget: int = Field(default=0, ge=0)
    plain_fallback: bool = True
    max_depth: int = Field(default=8, ge=1, le=MAX_DEPTH)
    calibrate: bool = True
    top_k: int | None = Field(default=None, ge=1)
    model: str | None = None
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    draft_runtime: Literal["auto", "paged", "transformers"] = "auto"
    draft_beam: int = Field(default=0, ge=0, le=MAX_NODES)
    prompt_lookup_min: int = Field(default=1, ge=1)
    prompt_lookup_max: int = Field(default=4, ge=1)
    kernels: Literal["auto", "torch", "triton"] = "auto"
    async_scheduling: bool = False

    @model_validator(mode="after")
    def _check(self) -> "TreeSpecConfig":
        if self.drafter != "ngram" and not self.model:
            raise ValueError(f"model: required with drafter '{self.drafter}' (its checkpoint directory)")
        if self.drafter == "ngram" and self.model:
            raise ValueError("model: only allowed with drafter 'draft_model', 'block' or 'mtp' (drafter is 'ngram')")
        for name in ("draft_runtime", "draft_dtype"):
            if self.drafter != "draft_model" and getattr(self, name) != "auto":
                raise ValueError(f"{name}: only allowed with drafter 'draft_model' (drafter is '{self.drafter}')")
        if self.draft_beam and (self.drafter != "draft_model" or self.draft_runtime == "transformers"):
            raise ValueError(f"draft_beam: {self.draft_beam} needs drafter 'draft_model' with draft_runtime 'auto' or "
                             f"'paged'; allowed otherwise: 0")
        if self.draft_beam * max(self.depth - 1, 1) > MAX_NODES:
            raise ValueError(f"draft_beam: {self.draft_beam} x (max_depth - 1 = {self.depth - 1}) must be at most "
                             f"{MAX_NODES}")
        if isinstance(self.budget, int) and self.budget > self.num_speculative_tokens:
            raise ValueError(f"budget: {self.budget} must be 'auto' or an integer <= num_speculative_tokens "
                             f"({self.num_speculative_tokens})")
        if self.min_budget > self.num_speculative_tokens:
            raise ValueError(f"min_budget: {self.min_budget} must be <= num_speculative_tokens "
                             f"({self.num_speculative_tokens})")
        defaults = TreeSpecConfig.model_fields  # values, not set-ness: the config travels as a dump
        auto_only = [k for k in AUTO_ONLY if getattr(self, k) != defaults[k].default]
        if self.budget != "auto" and auto_only:
            raise ValueError(f"{', '.join(auto_only)}: only allowed with budget 'auto' (budget is {self.budget})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min: {self.prompt_lookup_min} must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self

    @property
    def depth(self) -> int:
        """Effective maximum depth: a tree of ``budget`` draft nodes is at most that deep."""
        return min(self.max_depth, self.num_speculative_tokens)

    @property
    def fixed_budget(self) -> int | None:
        """Draft nodes per request every step, or None when the controller chooses."""
        return None if self.budget == "auto" else self.budget


AUTO_ONLY = ("eps", "min_budget", "plain_fallback")  # fields of the budget controller (budget "auto")
_UNION_HELP = {"budget": f"allowed: 'auto' or an integer in [1, {MAX_NODES - 1}]"}


def _field_help(name: str) -> str:
    if name in _UNION_HELP:
        return _UNION_HELP[name]
    f = TreeSpecConfig.model_fields[name]
    ann = f.annotation
    args = getattr(ann, "__args__", None)
    if args and all(isinstance(a, str) for a in args):
        return "allowed values: " + ", ".join(repr(a) for a in args)
    lo = next((m.ge for m in f.metadata if hasattr(m, "ge")), None)
    hi = next((m.le for m in f.metadata if hasattr(m, "le")), None)
    if lo is not None or hi is not None:
        kind = "integer" if ann is int else "number"
        return f"allowed: {kind} in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
    return ""


def is_tree_spec(config: Any) -> bool:
    """Whether a user speculative config (dict) selects vllm-bole."""
    return isinstance(config, dict) and str(config.get("method", "")).replace("-", "_") == METHOD


def parse_config(config: dict) -> TreeSpecConfig:
    """Validate a user config dict (keys may use dashes); raise ConfigError naming the field."""
    if not isinstance(config, dict):
        raise ConfigError(f"speculative_config: expected a JSON object, got {type(config).__name__}")
    data = {str(k).replace("-", "_"): v for k, v in config.items()}
    try:
        return TreeSpecConfig(**data)
    except ValidationError as e:
        lines = []
        allowed = ", ".join(TreeSpecConfig.model_fields)
        for err in e.errors():
            if err["loc"] and err["loc"][0] in _UNION_HELP:  # one line per union field, not per member
                line = f"{err['loc'][0]}: got {err.get('input')!r}; {_UNION_HELP[err['loc'][0]]}"
                if line not in lines:
                    lines.append(line)
                continue
            loc = ".".join(str(x) for x in err["loc"]) or "config"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                lines.append(f"{loc}: unknown field for method 'bole_tree' (allowed fields: {allowed})")
                continue
            if err["type"] == "missing":
                hint = f" ({_field_help(loc)})" if loc in TreeSpecConfig.model_fields else ""
                lines.append(f"{loc}: required field missing{hint}")
                continue
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
                lines.append(msg)
                continue
            hint = _field_help(loc) if loc in TreeSpecConfig.model_fields else ""
            got = err.get("input")
            lines.append(f"{loc}: {msg} (got {got!r})" + (f"; {hint}" if hint else ""))
        raise ConfigError("invalid vllm-bole speculative_config: " + "; ".join(lines)) from None
