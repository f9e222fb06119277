"""The vLLM entry point and the engine-agnostic core's independence from vLLM."""
import importlib.metadata
import pkgutil
import re
import subprocess
import sys

import numpy as np
import pytest

import vllm_bole
from vllm_bole.plugin import check_vllm_version


def _run_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter: it must exit 0 and print ``ok`` last."""
    out = subprocess.run([sys.executable, "-c", code + "print('ok')\n"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "vllm_bole" and ep.value == "vllm_bole.plugin:register" for ep in eps)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.1"])
def test_supported_versions(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_unsupported_version_fails_clearly(version):
    with pytest.raises(RuntimeError, match=rf"supports vLLM 0.32.x, 0.33.x; found vLLM {re.escape(version)}"):
        check_vllm_version(version)


def test_plugin_info_lines_reach_vllms_log():
    # vLLM configures only its "vllm" logger, per process at engine start (after plugins may have
    # loaded): the plugin's INFO lines ("method bole_tree active") must come out through it
    code = (
        "import logging\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())\n"
        "logging.getLogger('vllm_bole').info('bole-info-line')\n"
        "logging.getLogger('vllm_bole').debug('bole-debug-line')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    logs = out.stdout + out.stderr
    assert "bole-info-line" in logs and "bole-debug-line" not in logs, logs[-2000:]


def test_vllm_loads_plugin_once_per_process():
    code = (
        "import vllm_bole.plugin as p\n"
        "from vllm.plugins import load_general_plugins\n"
        "calls = []\n"
        "orig = p.check_vllm_version\n"
        "p.check_vllm_version = lambda v: (calls.append(v), orig(v))\n"
        "load_general_plugins(); load_general_plugins(); p.register()\n"
        "assert p._registered and len(calls) == 1, calls\n"
    )
    _run_ok(code)


def test_core_imports_without_vllm():
    """Every core module (all but the vLLM adapter: ``vllm_bole.plugin`` and the ``vllm_bole.adapter``
    package) imports with vllm made unimportable."""
    core = [
        m.name
        for m in pkgutil.walk_packages(vllm_bole.__path__, "vllm_bole.")
        if m.name != "vllm_bole.plugin" and not (m.name + ".").startswith("vllm_bole.adapter.")
    ]
    assert "vllm_bole.config" in core and not any(n.startswith("vllm_bole.adapter") for n in core)
    core += ["csrc_triton"] + [m.name for m in pkgutil.walk_packages(__import__("csrc_triton").__path__, "csrc_triton.")]
    code = (
        "import sys, importlib\n"
        "sys.modules['vllm'] = None\n"
        f"for m in {core!r}:\n"
        "    importlib.import_module(m)\n"
        "assert sys.modules['vllm'] is None\n"
    )
    _run_ok(code)


def test_tree_steps_never_dispatched_as_uniform_decode():
    """A batch of root-only trees has one token per request, which vLLM takes for a uniform decode
    and would replay as a FULL CUDA graph without the tree overrides (seen on the H200): the runner
    forces tree steps to be mixed batches, and plain steps with a request still in its prompt, and leaves the
    other plain steps to vLLM, counting the graph mode vLLM gives each plain step it prepared (not capture or
    dummy runs)."""
    from types import SimpleNamespace

    from vllm_bole.adapter.runner import TreeRunnerMixin

    class Base:
        def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, *a, force_uniform_decode=None):
            return SimpleNamespace(name="FULL" if force_uniform_decode is None else "NONE"), force_uniform_decode

    class Runner(TreeRunnerMixin, Base):
        pass

    import numpy as np

    r = Runner()
    r._bole_stats = dict(plain_full_steps=0, plain_piecewise_steps=0, plain_eager_steps=0)
    r.input_batch = SimpleNamespace(num_reqs=2, num_computed_tokens_cpu=np.array([7, 3, 0]),
                                    num_prompt_tokens=np.array([5, 3, 1]))  # two decodes (a stale third row)
    r._bole_step, r._bole_plain_mode_due = object(), False
    assert r._determine_batch_execution_and_padding(4, 4)[1] is False
    r._bole_step = None
    assert r._determine_batch_execution_and_padding(4, 4)[1] is None
    assert r._determine_batch_execution_and_padding(4, 4, force_uniform_decode=True)[1] is True
    assert r._bole_stats["plain_full_steps"] == 0  # none of those was a prepared plain step
    r._bole_plain_mode_due = True
    r._determine_batch_execution_and_padding(4, 4)
    r._bole_plain_mode_due = True
    r._determine_batch_execution_and_padding(4, 4, force_uniform_decode=True)
    r._determine_batch_execution_and_padding(4, 4)  # a dummy run after it: not counted
    assert (r._bole_stats["plain_full_steps"], r._bole_stats["plain_eager_steps"]) == (1, 1)
    # a plain step with a one-token prompt among the decodes (vLLM's V1 would replay a FULL decode graph, whose
    # recurrent layers then read and write stale state slots for that row): a mixed batch
    r.input_batch.num_reqs, r._bole_plain_mode_due = 3, True
    assert r._determine_batch_execution_and_padding(3, 3)[1] is False
    assert r._bole_stats["plain_eager_steps"] == 2
    r.input_batch.num_computed_tokens_cpu[2] = 1  # that prompt done: its next step decodes as vLLM dispatches it
    r._bole_plain_mode_due = True
    assert r._determine_batch_execution_and_padding(3, 3)[1] is None


def test_plain_rows_first_in_few_swaps():
    """The persistent batch's plain rows (prompts beside trees) go first, in vLLM's order, with at most one swap
    each (a prompt arriving at the end of 128 trees moved every row until ffbdad9: 3.2 ms a step on the H100);
    every row stays in the batch. Random batches, the swaps applied as ``swap_states`` applies them."""
    from vllm_bole.adapter.runner import plain_first_swaps

    rng = np.random.default_rng(0)
    for n in [0, 1, 2, 5, 33, 128] * 20:
        is_tree = (rng.random(n) < rng.random()).tolist()
        rows = list(range(n))
        swaps = plain_first_swaps(is_tree)
        for k, j in swaps:
            rows[k], rows[j] = rows[j], rows[k]
        P = n - sum(is_tree)
        assert sorted(rows) == list(range(n)) and len(swaps) <= P
        assert rows[:P] == [i for i in range(n) if not is_tree[i]]
        assert all(is_tree[i] for i in rows[P:])


def test_budget_switch_in_place():
    """``bole_set_budget`` (the benchmarks' budget sweep in one engine): fixed <-> "auto" between steps,
    the controller kept across switches, an out-of-range budget refused by name with nothing changed."""
    import pydantic

    from vllm_bole.adapter.runner import TreeRunnerMixin
    from vllm_bole.config import TreeSpecConfig

    r = TreeRunnerMixin()
    r._bole_auto = None
    r._bole_set_config(TreeSpecConfig(method="bole_tree", drafter="ngram", num_speculative_tokens=16, eps=0.5))
    auto = r._bole_budget
    assert auto is not None and r.bole_config.fixed_budget is None
    assert r.bole_set_budget(4) == 4 and r._bole_budget is None and r.bole_config.eps == 1.0
    assert r.bole_set_budget("auto") == "auto" and r._bole_budget is auto
    with pytest.raises(pydantic.ValidationError, match="budget"):
        r.bole_set_budget(17)
    assert r.bole_config.budget == "auto" and r._bole_budget is auto and r.bole_config.depth == 8


def test_draft_read_after_a_budget_switch_reaches_its_controller():
    """Under async scheduling a draft launched under ``"auto"`` is read at the next step's settle, which can come
    after ``bole_set_budget(8)`` (the benchmarks' sweep): its choice goes to the controller that made it (at
    a44eb73 to ``None``: every async cell of the H100 sweep failed)."""
    import collections

    import torch

    from vllm_bole.adapter.metrics import WorkerMetrics
    from vllm_bole.adapter.runner import TreeRunnerMixin
    from vllm_bole.adapter.tree_step import PHASES
    from vllm_bole.config import TreeSpecConfig
    from vllm_bole.spec_decode.controller import Choice
    from vllm_bole.spec_decode.tree import TreeBatch

    r = TreeRunnerMixin()
    r._bole_auto = None
    r._bole_set_config(TreeSpecConfig(method="bole_tree", drafter="ngram", num_speculative_tokens=8))
    r._bole_async, r._bole_drafter, r._bole_step_kind = True, None, "trees"
    r._bole_stats, r._bole_parts = collections.Counter(), dict.fromkeys(PHASES, 0.0)
    r._bole_metrics = WorkerMetrics(None)
    tree = TreeBatch.from_parents([[-1, 0]], [[5, 6]])
    choice = Choice(torch.tensor([1]), 1, 2, 1e-3, 1e-3, 2.0, 4)
    auto = r._bole_budget
    r._bole_pending_draft = (lambda: (tree, choice), ["a"], 0.0, auto)
    assert r.bole_set_budget(8) == 8 and r._bole_budget is None
    r._bole_finish_draft()
    assert auto.stats["budget_steps"] == 1 and auto.stats["budget_last"] == [1]
    assert r._bole_drafted[0] is tree and r._bole_pending_draft is None


def test_worker_metrics_snapshot_round_trip(tmp_path):
    """The worker's series reach the frontend's collector through the snapshot file: histogram buckets
    cumulative, sums and counts exact, counters and gauges as set; a missing file yields nothing."""
    import time

    from vllm_bole.adapter.metrics import WORKER_SERIES, WorkerCollector, WorkerMetrics

    path = tmp_path / "m" / "dp0.json"
    col = WorkerCollector(str(path), dict(model_name="m", engine="0"))
    assert list(col.collect()) == []
    w = WorkerMetrics(str(path))
    for x in (3e-4, 2e-3, 2e-3, 7.0):
        w.observe("vllm:bole_draft_seconds", x)
    w.set("vllm:bole_draft_pages_used", 12)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        fams = {f.name: f for f in col.collect()}
        h = fams.get("vllm:bole_draft_seconds")
        if h is not None and [s for s in h.samples if s.name.endswith("_count")][0].value == 4:
            break
        time.sleep(0.1)
    samples = {(s.name, s.labels.get("le")): s.value for s in fams["vllm:bole_draft_seconds"].samples}
    assert samples[("vllm:bole_draft_seconds_count", None)] == 4
    assert samples[("vllm:bole_draft_seconds_sum", None)] == pytest.approx(7.0043)
    assert samples[("vllm:bole_draft_seconds_bucket", "0.0005")] == 1
    assert samples[("vllm:bole_draft_seconds_bucket", "0.0025")] == 3
    assert samples[("vllm:bole_draft_seconds_bucket", "+Inf")] == 4
    assert fams["vllm:bole_draft_pages_used"].samples[0].value == 12
    assert set(fams) == set(WORKER_SERIES)


def test_every_vllm_import_resolves(tmp_path):
    # the project's vLLM imports (lazy ones inside functions too) against the installed vLLM; a planted
    # moved name is caught, an ImportError fallback with one good alternative is not
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "def f():\n    from vllm.v1.core.kv_cache_utils import no_such_name\n\n"
        "try:\n    from vllm.no_such_module import x\nexcept ImportError:\n    from vllm import SamplingParams\n")
    _run_ok("from pathlib import Path\nfrom vllm_bole.testing.vllm_imports import unresolved\n"
            "assert unresolved() == [], unresolved()\n"
            f"bad = unresolved(Path({str(tmp_path / 'pkg')!r}))\n"
            "assert bad == ['pkg/m.py:2 vllm.v1.core.kv_cache_utils.no_such_name'], bad\n")


def test_async_scheduling_refuses_structured_output_requests():
    """With the tree config's ``async_scheduling`` a request with structured output is refused alone, when it is
    validated (vLLM's grammar layout counts the drafts its scheduler booked, which the runner cuts to its
    trees); without it, and other requests with it, pass."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from vllm_bole.adapter import config_hook

    config_hook.install()
    spec = SimpleNamespace(method="custom_class", model=config_hook.PROPOSER)
    structured = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    structured._validate_spec_decode(spec)  # a synchronous engine verifies such requests plainly
    setattr(spec, config_hook.ASYNC_FLAG, True)
    with pytest.raises(ValueError, match="structured_outputs: not supported with method 'bole_tree' and its "
                                         "async_scheduling"):
        structured._validate_spec_decode(spec)
    SamplingParams(temperature=0.5, min_p=0.1)._validate_spec_decode(spec)
