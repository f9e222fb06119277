"""``benchmarks/bench_e2e.py --parallel``: engines started side by side are timed one at a time, stage by
stage, with a stand-in for the engine subprocess (no vLLM)."""
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_e2e  # noqa: E402


def test_parallel_runs_one_engine_at_a_time_stage_by_stage(monkeypatch):
    running, timed, lock = [], [], threading.Lock()

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
                running.append(name)
                assert len(set(running)) == 1, running  # only one engine's jobs at a time
            if job.get("cell"):
                timed.append((name, bench_e2e.stage_of(job["cell"]["dataset"], job["cell"]["temperature"])))
            time.sleep(0.001)
            with lock:
                running.remove(name)
            n = len(job["prompts"])
            results.append(dict(tokens=[[1] * job["max_tokens"]] * n, generate_s=0.1, stats=None, counters={}))
        return dict(jobs=results, start_s=0.0)

    monkeypatch.setattr(bench_e2e.engine_run, "run_engine", fake_engine)
    monkeypatch.setattr(bench_e2e, "CONCURRENCY", (1, 2))
    monkeypatch.setattr(bench_e2e, "BUDGETS", (2,))
    prompts = {d: [[1, 2, 3]] for d in bench_e2e.DATASETS}
    todo = [e for e in bench_e2e.engines("all", quick=False) if e["mode"] != "bole_chain"]
    todo = [todo[0], todo[2], next(e for e in todo if e["mode"] == "vllm_chain")]  # ar, trees (ngram), a chain
    args = SimpleNamespace(pair=Path("/nonexistent"), target="t", dtype="float32", eager=True, parallel=True,
                           tree_graphs=False)
    rows = bench_e2e.run_parallel(todo, args, prompts, deadline=time.time() + 60)
    assert [len(r) for r in rows] == [len(e["cells"]) for e in todo]
    assert [k for _, k in timed] == sorted(k for _, k in timed)  # every engine's stage k before any one's k + 1
    order = [json.dumps(bench_e2e.spec_for(e["mode"], e["drafter"], args.pair, e["k"]), sort_keys=True) for e in todo]
    for _, group in itertools.groupby(timed, key=lambda x: x[1]):  # within a stage: engine by engine, in order
        names = [n for n, _ in itertools.groupby(n for n, _ in group)]
        assert names == [n for n in order if n in names]
