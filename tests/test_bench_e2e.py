"""``benchmarks/bench_e2e.py --parallel``: engines started side by side are timed one at a time, stage by
stage, with a stand-in for the engine subprocess (no vLLM)."""
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_e2e  # noqa: E402
from vllm_bole.adapter.tree_step import PHASES, by_kind_keys  # noqa: E402


def stand_in(timed: list, running: list | None = None, lock=threading.Lock()):
    """A stand-in for ``engine_run.run_engine``: gates wait for their go, cells append (engine, cell) to
    ``timed``; with ``running``, asserts that only one engine's jobs run at a time."""
    def fake_engine(target, jobs, *, spec=None, **kw):
        name = json.dumps(spec, sort_keys=True)
        time.sleep(0.3 if spec is None else 0.0)  # engines start in any order
        results = []
        for job in jobs:
            if job["kind"] == "gate":
                Path(job["ready"]).touch()
                while not Path(job["go"]).exists():
                    time.sleep(0.01)
                results.append({})
                continue
            with lock:
                if running is not None:
                    running.append(name)
                    assert len(set(running)) == 1, running  # only one engine's jobs at a time
            if job.get("cell"):
                timed.append((name, job["cell"]))
            time.sleep(0.001)
            with lock:
                if running is not None:
                    running.remove(name)
            n = len(job["prompts"])
            results.append(dict(tokens=[[1] * job["max_tokens"]] * n, generate_s=0.1, times=[[0.0, 0.01, 0.1]] * n,
                                stats=None, counters={}))
        return dict(jobs=results, start_s=0.0)
    return fake_engine


def test_parallel_runs_one_engine_at_a_time_stage_by_stage(monkeypatch):
    cells = []
    fake_engine = stand_in(cells, [])
    monkeypatch.setattr(bench_e2e.engine_run, "run_engine", fake_engine)
    monkeypatch.setattr(bench_e2e, "CONCURRENCY", (1, 2))
    monkeypatch.setattr(bench_e2e, "BUDGETS", (2,))
    prompts = {d: [[1, 2, 3]] for d in bench_e2e.DATASETS}
    todo = [e for e in bench_e2e.engines("all", quick=False) if e["mode"] != "bole_chain"]
    todo = [todo[0], todo[2], next(e for e in todo if e["mode"] == "vllm_chain")]  # ar, trees (ngram), a chain
    args = SimpleNamespace(pair=Path("/nonexistent"), target="t", dtype="float32", eager=True, parallel=True,
                           tree_graphs=False)
    rows = bench_e2e.run_parallel(todo, args, prompts, deadline=time.time() + 60)
    # one row a cell: AR's two runs merged, a swept cell's parts too
    assert [len(r) for r in rows] == [len({c[:4] for c in e["cells"]}) for e in todo]
    assert all(r.get("parts") == bench_e2e.SWEEP_PARTS for r in rows[1] if r["budget"] != "auto" or r["dataset"] in
               bench_e2e.SWEEP_DATASETS and r["temperature"] == 0.0)
    assert all(len(r["tokens_per_s_runs"]) == 2 and r["run_spread"] == 0.0 for r in rows[0])
    assert not any("tokens_per_s_runs" in r for r in rows[2]) and all("run_spread" not in r for r in rows[1])
    timed = [(n, bench_e2e.stage_of(c["dataset"], c["temperature"], c["batch"])) for n, c in cells]
    assert [k for _, k in timed] == sorted(k for _, k in timed)  # every engine's stage k before any one's k + 1
    order = [json.dumps(bench_e2e.spec_for(e["mode"], e["drafter"], args.pair, e["k"]), sort_keys=True) for e in todo]
    for _, group in itertools.groupby(timed, key=lambda x: x[1]):  # within a stage: engine by engine, in order,
        names = [n for n, _ in itertools.groupby(n for n, _ in group)]  # AR before and after the others
        assert names == [n for n in order if n in names] + [order[0]]


def test_merge_runs_keeps_each_run_and_their_spread():
    cell = dict(mode="ar", drafter="none", draft_beam=0, budget=None, batch=8, dataset="mt_bench", temperature=0.0,
                requests=32, tokens=4096)
    runs = [dict(cell, tokens_per_s=900.0, tpot_ms=2.0, seconds=4.0), dict(cell, tokens_per_s=1100.0, tpot_ms=3.0,
                                                                          seconds=3.0)]
    other = dict(cell, batch=1, tokens_per_s=100.0, tpot_ms=9.0, seconds=1.0)
    merged = bench_e2e.merge_runs(runs + [other, dict(mode="ar", drafter="none", error="boom")])
    assert len(merged) == 3 and merged[1] == other and merged[2]["error"] == "boom"
    m = merged[0]
    assert (m["tokens_per_s"], m["tokens_per_s_runs"], m["tpot_ms"], m["tpot_ms_runs"], m["seconds"]) == \
        (1000.0, [900.0, 1100.0], 2.5, [2.0, 3.0], 7.0)
    assert abs(m["run_spread"] - 0.2) < 1e-12


def test_swept_cells_run_in_parts_forth_and_back():
    """A swept cell's budgets run on the first part of its requests in order, then on the next part in reverse,
    forth and back over the four parts, so that the engine's drift through the group weighs on each budget alike;
    the parts merge into one row over all the cell's requests."""
    order = [(8, 0), (16, 0), ("auto", 0), ("auto", 1), (16, 1), (8, 1), (8, 2), (16, 2), ("auto", 2), ("auto", 3),
             (16, 3), (8, 3)]
    assert bench_e2e.swept([("mt_bench", 0.0, 8)], (8, 16, "auto")) == [("mt_bench", 0.0, 8, b, p) for b, p in order]
    jobs = [bench_e2e.job({"mt_bench": [[i] for i in range(20)]}, "mt_bench", 0.0, 8, 0.0, 16, p) for p in range(4)]
    assert [len(j) for j in jobs] == [2, 1, 1, 1]  # the untimed job before the first part only
    assert [len(j[-1]["prompts"]) for j in jobs] == [8] * 4  # a wave of the concurrency each
    assert [p for j in jobs for p in j[-1]["prompts"]] == bench_e2e.prompts_for(
        {"mt_bench": [[i] for i in range(20)]}, "mt_bench", 32)
    cell = dict(mode="bole_tree", drafter="draft_model", draft_beam=0, budget=16, batch=8, dataset="mt_bench",
                temperature=0.0, accept_len=3.0, tree_steps=10, steps_by_kind={"trees": 10})
    parts = [dict(cell, part=1, tokens=2048, seconds=2.0, requests=16, tokens_per_s=1024.0, accept_len=4.0,
                  tree_steps=12, digests=["c", "d"], steps_by_kind={"trees": 12}),
             dict(cell, part=0, tokens=2048, seconds=1.0, requests=16, tokens_per_s=2048.0, digests=["a", "b"])]
    (m,) = bench_e2e.merge_runs(parts)
    assert (m["tokens_per_s"], m["tokens_per_s_runs"], m["parts"], m["digests"]) == (4096 / 3, [2048.0, 1024.0], 2,
                                                                                     ["a", "b", "c", "d"])
    assert (m["tokens"], m["seconds"], m["requests"], m["tree_steps"], m["accept_len"]) == (4096, 3.0, 32, 22, 3.5)
    assert m["batch"] == 8 and isinstance(m["batch"], int) and m["steps_by_kind"] == {"trees": 10} and "part" not in m


def test_resume_runs_only_the_cells_not_yet_measured(monkeypatch, tmp_path):
    """``--resume``: a second run of a part keeps the cells the first measured and runs only the others
    (a run cut by its deadline is completed by the next one)."""
    cells = []
    monkeypatch.setattr(bench_e2e.engine_run, "run_engine", stand_in(cells))
    monkeypatch.setattr(bench_e2e, "STORE", tmp_path / "store")
    monkeypatch.setenv("OUT", str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.json").write_text(json.dumps({d: [[1, 2, 3]] for d in bench_e2e.DATASETS}))
    argv = ["bench_e2e.py", "--part", "all", "--data", str(tmp_path / "data"), "--pair", str(tmp_path), "--eager",
            "--budgets", "2", "--chain-k", "3", "--only", "ar/none", "--only", "vllm_chain/ngram"]

    def run(*extra):
        cells.clear()
        monkeypatch.setattr(sys, "argv", argv + list(extra))
        assert bench_e2e.main() == 0
        rows = json.loads((tmp_path / "e2e_throughput.json").read_text())["rows"]
        return rows, [(json.loads(n), c) for n, c in cells]

    rows, ran = run()
    assert len(rows) == len(ran) == 2 * 2 * len(bench_e2e.DATASETS) * len(bench_e2e.CONCURRENCY)  # 2 engines
    store = tmp_path / "store" / "all.json"
    part = json.loads(store.read_text())
    cut = [r for r in part["rows"] if r["mode"] == "ar" and r["temperature"] == 1.0]
    part["rows"] = [r for r in part["rows"] if r not in cut]
    store.write_text(json.dumps(part))
    rows2, ran2 = run("--resume")
    assert sorted((c["dataset"], c["batch"]) for _, c in ran2) == sorted((r["dataset"], r["batch"]) for r in cut)
    assert all(spec is None and c["temperature"] == 1.0 for spec, c in ran2)
    key = lambda r: (r["mode"], r["dataset"], r["temperature"], r["batch"])  # noqa: E731
    assert sorted(map(key, rows2)) == sorted(map(key, rows))
    rows3, ran3 = run()  # without it: everything again
    assert len(ran3) == len(ran)


def test_a_job_names_the_kernels_compiled_while_it_ran():
    """An engine's log is split at the child's job marks (its engine core's and workers' lines land in the
    same log), so that each cell's row names the compilations vLLM's jit monitor logged while it ran
    (``jit_compiled``: kernel and details)."""
    from vllm_bole.testing.engine_run import JIT_COMPILED, JOB_MARK, _job_logs

    warn = ("(EngineCore pid=7) WARNING jit_monitor.py: Triton kernel JIT compilation during inference: "
            "_tree_attn_fwd (constexprs={BLOCK_N=64}). This causes a latency spike")
    log = "\n".join(["start", warn, f"{JOB_MARK}0", "x", f"{JOB_MARK}1", warn, "y", f"{JOB_MARK}2"])
    jobs = _job_logs(log)
    assert sorted(jobs) == [0, 1, 2] and jobs[0] == ["x"] and jobs[2] == []
    assert [JIT_COMPILED.search(ln).group(1) for ln in jobs[1] if JIT_COMPILED.search(ln)] == [
        "_tree_attn_fwd (constexprs={BLOCK_N=64})"]


def test_a_job_counts_the_controller_choices_it_made():
    """A cell's counters are the job's differences: the controller's choices per token bucket too (buckets not
    chosen during the job left out); what it learnt per bucket as it stands."""
    from vllm_bole.testing.engine_run import stats_delta

    before = dict(budget_steps=3, budget_buckets={16: 2, 24: 1}, controller_model={16: dict(draft_ms=1.0)})
    after = dict(budget_steps=7, budget_buckets={16: 2, 24: 4, 32: 1}, controller_model={16: dict(draft_ms=1.5)})
    got = stats_delta(before, after)
    assert got["budget_steps"] == 4 and got["budget_buckets"] == {24: 3, 32: 1}
    assert got["controller_model"] == {16: dict(draft_ms=1.5)}


def test_a_tree_row_times_its_steps_by_kind():
    """A tree cell's row: the runner's timed engine steps per kind (trees alone, beside prompt rows, plain,
    trees right after a plain step) as counts and mean milliseconds; kinds without a timed step have no mean."""
    st = dict(accepted=30, verified_requests=10, steps=14, tree_steps=12, draft_s=0.1, verify_commit_s=0.01,
              forward_s=0.02, prepare_s=0.03, drafted_nodes=70, timed_trees_steps=8, timed_trees_steps_s=0.04,
              timed_mixed_steps=4, timed_mixed_steps_s=0.06, timed_plain_steps=0, timed_plain_steps_s=0.0,
              timed_catchup_steps=2, timed_catchup_steps_s=0.05, plain_drafts=4, plain_draft_s=0.01)
    st.update({k: 0 for k in by_kind_keys()}, by_kind_mixed_steps=4, by_kind_mixed_draft_s=0.02,
              by_kind_mixed_forward_s=0.012, by_kind_trees_steps=10, by_kind_trees_draft_s=0.01)
    res = dict(tokens=[[1] * 20] * 2, generate_s=0.2, times=[[0.0, 0.01, 0.1]] * 2, stats=st, counters={})
    row = bench_e2e.row_of(dict(mode="bole_tree", drafter="ngram"),
                           dict(batch=2, dataset="mt_bench", temperature=0.0, budget=8), res)
    assert row["steps_by_kind"] == {"trees": 8, "mixed": 4, "plain": 0, "catchup": 2}
    assert row["step_ms_by_kind"] == pytest.approx({"trees": 5.0, "mixed": 15.0, "catchup": 25.0})
    assert row["plain_drafts"] == 4 and row["plain_draft_ms"] == pytest.approx(2.5)
    by = row["phase_ms_by_kind"]  # per step of each kind that ran, every timed part
    assert set(by) == {"trees", "mixed"} and by["mixed"]["steps"] == 4 and by["trees"]["steps"] == 10
    assert by["mixed"]["draft_ms"] == pytest.approx(5.0) and by["mixed"]["forward_ms"] == pytest.approx(3.0)
    assert by["trees"]["draft_ms"] == pytest.approx(1.0) and by["trees"]["prepare_ms"] == 0
    parts = [0.0] * len(PHASES)
    log = [["trees", 2, 18, ms, *parts] for ms in (4.0, 5.0, 6.0, 50.0)] + [["mixed", 2, 9, 20.0, 3.0, *parts[1:]]]
    spread = bench_e2e.row_of(dict(mode="bole_tree", drafter="ngram"),
                              dict(batch=2, dataset="mt_bench", temperature=0.0, budget=8),
                              dict(res, stats=dict(st, step_log=log)))["step_spread"]
    assert spread["trees"]["steps"] == 4 and spread["trees"]["wall_ms"][0] == pytest.approx(5.5)
    assert spread["trees"]["wall_ms"][2] == 50.0 and spread["mixed"]["prepare_ms"] == [3.0, 3.0, 3.0]
    assert [r["wall_ms"] for r in spread["slowest"]] == [50.0, 20.0, 6.0, 5.0, 4.0]
    assert spread["slowest"][1]["kind"] == "mixed" and spread["slowest"][1]["tree_tokens"] == 9


def test_an_ar_row_has_its_mean_engine_step_from_vllms_counters():
    """AR's rows: the mean engine step from vLLM's own step count (``engine_steps``), to set beside ours."""
    res = dict(tokens=[[1] * 20] * 2, generate_s=0.2, times=[[0.0, 0.01, 0.1]] * 2, stats=None,
               counters=dict(engine_steps=40, engine_step_tokens=90))
    row = bench_e2e.row_of(dict(mode="ar", drafter="none", k=0), dict(batch=2, dataset="mt_bench", temperature=0.0,
                                                                      budget=None), res)
    assert row["engine_steps"] == 40 and row["step_ms"] == pytest.approx(5.0) and row["accept_len"] == 1.0


def teststats_delta_takes_the_records_appended_since_from_full_logs():
    """A log keeps its latest records only: the records of a job are the last ``{log}_total`` delta of them,
    also once the log is full (its length then no longer grows)."""
    from vllm_bole.testing.engine_run import stats_delta

    before = dict(step_log=[[i] for i in range(90, 100)], step_log_total=100, accept_log=[1, 2], accept_log_total=2)
    after = dict(step_log=[[i] for i in range(94, 104)], step_log_total=104, accept_log=[1, 2, 3], accept_log_total=3)
    got = stats_delta(before, after)
    assert got["step_log"] == [[100], [101], [102], [103]] and got["accept_log"] == [3]
    many = dict(after, step_log_total=150)  # more appended than the log keeps: all it still holds
    assert stats_delta(before, many)["step_log"] == after["step_log"]
