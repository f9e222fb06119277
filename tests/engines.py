"""The engine runs the engine-level tests share: one engine start (~20 s on 2 cores) per configuration,
each running every job the tests need from it (``vllm_bole.testing.engine_run``), cached for the
session. This process imports neither vllm nor transformers.

Per architecture:

* ``base``: non-speculative vLLM: the greedy streams (8 prompts x 64 tokens, top-k logprobs, rescored
  through the prefill path: the engine's own noise), transformers' teacher-forced
  reference on them, and the constrained and sampled jobs of the architectures that have them;
* ``draft_model``: tree speculation with the target as its own drafter, the same jobs;
* ``ngram``: tree speculation with the n-gram drafter, greedy only (Llama: also with at most 3 requests in
  flight).
"""
from __future__ import annotations

from vllm_bole.testing import engine_run
from vllm_bole.testing.tiny_models import PROMPTS, VLLM_DIFFERS_FROM_HF, checkpoint_dtype

MAX_TOKENS = 64
BUDGET, DEPTH = 8, 4
LLM_KWARGS = dict(max_num_seqs=64)

CONSTRAINED = [  # per-prompt sampling parameters vLLM's sampler applies before temperature (greedy here)
    dict(presence_penalty=0.8),
    dict(frequency_penalty=2.0, presence_penalty=-0.5),
    dict(repetition_penalty=1.5),
    dict(logit_bias={7: 4.0, 11: 2.5, 300: -100.0}),
    dict(bad_words=["the", " the", "a"]),
    dict(allowed_token_ids=list(range(0, 1024, 3))),
    # + stop tokens: tokens 2..11 of the prompt's unconstrained stream (would stop at token 3 without min_tokens)
    dict(min_tokens=24, stop_token_ids=dict(from_job=0, prompt=6, start=2, end=12)),
    dict(repetition_penalty=1.2, frequency_penalty=0.2, min_p=0.3, logit_bias={3: 1.0}),
]
CONSTRAINED_ARCHS = ("llama", "nemotron_h")

SAMPLED = {  # arch -> sampling parameters of the distribution test
    "llama": dict(temperature=1.0, top_k=4, min_p=0.1),
    "nemotron_h": dict(temperature=0.8, top_p=0.7),
    # bf16 Qwen3-Next: temperature only. Hard top-k / top-p boundaries turn bf16 rounding into support
    # changes at near ties on this chaotic tiny model (measured: vLLM's own bf16 samples with top_k=3 sit at a
    # total variation of 0.13 from the same checkpoint run in fp32, ours at 0.17; both far outside sampling
    # noise), which no sampling test can attribute; without hard boundaries bf16 rounding moves
    # probabilities only slightly.
    "qwen3_next": dict(temperature=0.7),
}
# samples per side of the distribution test; Qwen3-Next fewer (its CPU engine is 5x slower): its 0.6x
# colder control is still detected at p ~ 1e-20 (measured p <= 7e-41 with 800)
NUM_SAMPLES = {"llama": 800, "nemotron_h": 800, "qwen3_next": 400}
SAMPLE_TOKENS = 5
COLDER = 0.6  # the power control's temperature factor


def logprobs_k(arch) -> int:
    """Top logprobs per position: fp32 compares vLLM's top-2 exactly; bf16 needs a wider row for the
    noise criterion (``vllm_bole.testing.lossless``)."""
    return 2 if checkpoint_dtype(arch) == "float32" else 10


def spec_config(drafter: str, model=None, **kw) -> dict:
    """A fixed budget unless ``kw`` says otherwise: the shared runs' trees do not depend on timing."""
    cfg = dict(method="bole_tree", drafter=drafter, num_speculative_tokens=BUDGET, max_depth=DEPTH,
               **{"budget": BUDGET, **kw})
    if model is not None:
        cfg["model"] = str(model)
    return cfg


NGRAM_ARCHS = ("llama", "nemotron_h", "qwen3_next")  # the n-gram drafter's shared runs


class Engines:
    """Lazily run and cache the shared engine runs (module docstring), one after another: each
    engine uses both cores (decided: two engines at once, one core each, ran the bf16 Qwen3-Next
    runs more than 3x slower, past their timeout)."""

    def __init__(self, models: dict):
        self.models = models
        self._runs: dict[tuple[str, str], dict] = {}

    def prompts(self, arch) -> list[list[int]]:
        return engine_run.prompt_token_ids(self.models[arch], PROMPTS)

    def _jobs(self, arch, kind) -> dict[str, dict]:
        bf16 = checkpoint_dtype(arch) != "float32"
        prompts = self.prompts(arch)
        jobs = {"greedy": engine_run.generate_job(prompts, MAX_TOKENS, logprobs=logprobs_k(arch),
                                                  rescore=logprobs_k(arch) if kind == "base" else None)}
        if kind == "ngram":
            if arch == "llama":  # the benchmarks' concurrency: at most 3 in flight, refilled as they finish
                jobs["refill"] = engine_run.generate_job(prompts, MAX_TOKENS, logprobs=logprobs_k(arch), concurrency=3)
            return jobs
        if arch in CONSTRAINED_ARCHS:
            jobs["constrained"] = engine_run.generate_job(prompts, MAX_TOKENS, sampling=CONSTRAINED)
        if arch in SAMPLED:
            sp = dict(SAMPLED[arch], max_tokens=SAMPLE_TOKENS)
            sampling = [sp] * NUM_SAMPLES[arch]
            if kind == "base":
                sampling += [dict(sp, temperature=sp["temperature"] * COLDER)] * NUM_SAMPLES[arch]
            jobs["sampled"] = engine_run.generate_job([prompts[0]] * len(sampling), SAMPLE_TOKENS, sampling=sampling)
        return jobs

    def run(self, arch: str, kind: str) -> dict:
        """{job name: job result} of engine ``kind`` ('base', 'draft_model', 'ngram') on ``arch``."""
        key = (arch, kind)
        if key not in self._runs:
            jobs = self._jobs(arch, kind)
            spec = None if kind == "base" else spec_config(kind, self.models[arch] if kind == "draft_model" else None)
            r = engine_run.run_engine(self.models[arch], list(jobs.values()), spec=spec, llm_kwargs=LLM_KWARGS,
                                      hf_job=0 if kind == "base" and arch not in VLLM_DIFFERS_FROM_HF else None)
            self._runs[key] = dict(zip(jobs, r["jobs"]), plugin_lines=r["plugin_lines"])
        return self._runs[key]
