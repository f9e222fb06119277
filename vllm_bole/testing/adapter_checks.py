"""Engine-free adapter checks in subprocesses that import vLLM: the CPU cache layouts the adapter reads,
vLLM's GDN kernel conventions, the configuration errors raised before any engine starts, and the
plugin's registration inside a Ray actor.

    python -m vllm_bole.testing.adapter_checks --checks MODEL RESULT.json | --ray MODEL RESULT.json
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from vllm_bole.testing.engine_run import PRELOAD
from vllm_bole.testing.isolation import RunnerError, engine_env, run_isolated, tail


def run_checks(model_dir, timeout: float = 300) -> dict:
    """Engine-free adapter checks in a subprocess that imports vLLM (see :func:`_checks`)."""
    with tempfile.TemporaryDirectory(prefix="vllm_bole_checks") as tmp:
        res = Path(tmp) / "result.json"
        log = run_isolated([sys.executable, "-m", "vllm_bole.testing.adapter_checks", "--checks", str(model_dir), str(res)],
                           timeout=timeout, env=engine_env(False), preload=PRELOAD)
        if not res.exists():
            raise RunnerError(f"checks wrote no result; output tail:\n{tail(log)}")
        return json.loads(res.read_text())


def run_ray_check(model_dir, timeout: float = 300) -> dict:
    """In a subprocess: start a local Ray (CPU), and inside a Ray actor process load vLLM's general
    plugins and build an engine config with ``method: bole_tree`` (see :func:`_ray_check`)."""
    with tempfile.TemporaryDirectory(prefix="vllm_bole_ray") as tmp:
        res = Path(tmp) / "result.json"
        env = engine_env(False)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        log = run_isolated([sys.executable, "-m", "vllm_bole.testing.adapter_checks", "--ray", str(model_dir), str(res)],
                           timeout=timeout, env=env)
        if not res.exists():
            raise RunnerError(f"ray check wrote no result; output tail:\n{tail(log)}")
        return json.loads(res.read_text())


# ----------------------------------------------------------------------------- child side

def _checks(model_dir: str) -> dict:
    """(1) The CPU attention cache layouts the adapter reads (``CpuPagedView``) against what
    vLLM's own ``cpu_attn_reshape_and_cache`` writes, for every ISA/dtype this machine runs.
    (2) vLLM's GDN CPU decode kernel against the core's GDN tree step on one-node trees (state
    layout, gating, GQA). (3) Configuration errors raised by ``LLM(...)`` before any engine starts."""
    import torch
    import torch.nn.functional as F
    import vllm._custom_ops as ops

    from vllm_bole import gdn
    from vllm_bole.adapter.layers.cpu_kv_layout import CpuPagedView
    from vllm_bole.spec_decode.tree import TreeBatch

    out: dict = {"layouts": [], "gdn": None, "config_errors": {}}
    isas = [("vec", torch.float32), ("vec", torch.bfloat16)]
    if torch.cpu._is_amx_tile_supported():
        isas.append(("amx", torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    for isa, dt in isas:
        for nb, H, bs, D in [(5, 2, 32, 32), (3, 4, 64, 128), (4, 1, 128, 64)]:
            kv = torch.zeros(nb, H, bs, 2 * D, dtype=dt)
            kc, vc = kv.view(nb, H, 2 * bs, D).chunk(2, dim=2)
            slots = torch.randperm(nb * bs, generator=g)[: 2 * bs]
            key = torch.randn(slots.numel(), H, D, generator=g).to(dt)
            val = torch.randn(slots.numel(), H, D, generator=g).to(dt)
            ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa)
            kview, vview = CpuPagedView(kv, isa, "k"), CpuPagedView(kv, isa, "v")
            blk, off = slots // bs, slots % bs
            ok_read = torch.equal(kview[blk, off], key) and torch.equal(vview[blk, off], val)
            kv2 = torch.zeros_like(kv)  # writes through the views land where vLLM's kernel puts them
            CpuPagedView(kv2, isa, "k")[blk, off] = key
            CpuPagedView(kv2, isa, "v")[blk, off] = val
            out["layouts"].append(dict(isa=isa, dtype=str(dt), shape=[nb, H, bs, D], read=ok_read,
                                       write=torch.equal(kv2, kv)))
    # GDN: vLLM's CPU decode kernel vs the core on one-node trees
    S, B, Hk, Hv, K, V = 6, 3, 1, 2, 128, 128
    state = torch.randn(S, Hv, V, K, generator=g) * 0.1  # vLLM declares [S, Hv, V, K]
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    q = torch.randn(1, B, Hk, K, generator=g).bfloat16()
    k = torch.randn(1, B, Hk, K, generator=g).bfloat16()
    v = torch.randn(1, B, Hv, V, generator=g).bfloat16()
    a = torch.randn(B, Hv, generator=g).bfloat16()
    b = torch.randn(B, Hv, generator=g).bfloat16()
    A_log, dt_bias = torch.randn(Hv, generator=g), torch.randn(Hv, generator=g).bfloat16()
    ref_state = state.clone()
    ref = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=ref_state.view(S, Hv, K, V),
        initial_state_indices=slots, cu_seqlens=torch.arange(B + 1, dtype=torch.int32), use_qk_l2norm_in_kernel=True,
    ).reshape(B, Hv, V).float()
    gg = -torch.exp(A_log) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    tree = TreeBatch.from_parents([[-1]] * B)
    ours_state = state.clone()
    o = gdn.gdn_tree_step(q[0], k[0], v[0], gg, beta, tree, ours_state.view(S, Hv, K, V), slots.long(), None,
                          scale=K**-0.5, kernels="torch").float()
    out["gdn"] = dict(max_abs_diff=float((o - ref).abs().max()), max_abs=float(ref.abs().max()))
    # configuration errors: LLM(...) fails before an engine starts, naming the field
    from vllm import LLM

    import shutil

    wrong_tok = Path(tempfile.mkdtemp(prefix="vllm_bole_tok")) / "draft"
    shutil.copytree(model_dir, wrong_tok)
    tok = json.loads((wrong_tok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (wrong_tok / "tokenizer.json").write_text(json.dumps(tok))
    tree = dict(method="bole_tree", drafter="ngram", num_speculative_tokens=4)
    bad = {
        "drafter": dict(speculative_config=dict(tree, drafter="eagle")),
        "budget": dict(speculative_config=dict(tree, num_speculative_tokens=0)),
        "string_budget": dict(speculative_config=dict(tree, num_speculative_tokens="8")),
        "unknown": dict(speculative_config=dict(tree, prompt_lookup_num=3)),
        "draft_model_without_model": dict(speculative_config=dict(tree, drafter="draft_model")),
        "draft_missing": dict(speculative_config=dict(tree, drafter="draft_model", model="/nonexistent/draft")),
        "block_missing": dict(speculative_config=dict(tree, drafter="block", model="/nonexistent/block")),
        "draft_tokenizer": dict(speculative_config=dict(tree, drafter="draft_model", model=str(wrong_tok))),
        "triton_cpu": dict(speculative_config=dict(tree, kernels="triton")),
        "prefix_caching": dict(speculative_config=tree, enable_prefix_caching=True),
        "cudagraph_full": dict(speculative_config=tree, compilation_config={"cudagraph_mode": "FULL"}),
        "near_miss": dict(speculative_config=dict(tree, method="bole-tre")),
        "worker_cls": dict(speculative_config=tree, worker_cls="vllm.v1.worker.cpu_worker.CPUWorker"),
        "async": dict(speculative_config=tree, async_scheduling=True),
    }
    for name, kw in bad.items():
        interpret = os.environ.pop("TRITON_INTERPRET", None) if name == "triton_cpu" else None
        try:
            LLM(model=model_dir, enforce_eager=True, **kw)
            out["config_errors"][name] = None
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            out["config_errors"][name] = f"{type(e).__name__}: {e}"
        finally:
            if interpret is not None:
                os.environ["TRITON_INTERPRET"] = interpret
    shutil.rmtree(wrong_tok.parent, ignore_errors=True)
    return out


def _ray_check(model_dir: str) -> dict:
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        @ray.remote(num_cpus=1)
        class Probe:
            def run(self, model):
                import os as _os

                from vllm.engine.arg_utils import EngineArgs
                from vllm.plugins import load_general_plugins

                import vllm_bole.plugin as plugin

                load_general_plugins()
                spec = dict(method="bole_tree", drafter="ngram", num_speculative_tokens=4)
                cfg = EngineArgs(model=model, enforce_eager=True, speculative_config=spec).create_engine_config()
                return dict(pid=_os.getpid(), registered=plugin._registered,
                            worker_cls=cfg.parallel_config.worker_cls,
                            method=cfg.speculative_config.method,
                            num_speculative_tokens=cfg.speculative_config.num_speculative_tokens,
                            tree_config=cfg.additional_config.get("vllm_bole"))

        actor = Probe.remote()
        out = ray.get(actor.run.remote(model_dir), timeout=240)
        out["driver_pid"] = os.getpid()
        return out
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in ("--checks", "--ray"):
        print("usage: python -m vllm_bole.testing.adapter_checks --checks|--ray MODEL RESULT.json", file=sys.stderr)
        return 2
    Path(argv[2]).write_text(json.dumps((_checks if argv[0] == "--checks" else _ray_check)(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
