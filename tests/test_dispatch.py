"""``vllm_bole.dispatch.triton_variants``: the slow-step diagnostics' count of compiled Triton variants."""
import sys
import types

from triton.runtime.autotuner import Heuristics
from triton.runtime.jit import JITFunction

from vllm_bole.dispatch import triton_variants


class Placeholder:
    """Like vLLM's ``PlaceholderModule``: any attribute lookup imports a package that is not installed."""

    def __getattr__(self, name):
        raise ModuleNotFoundError("No module named 'runai_model_streamer'")


def _kernel(x):
    return x


def test_counts_kernels_and_never_touches_other_objects(monkeypatch):
    """Seen on the H200 (3adce69): ``hasattr(obj, "fn")`` on vLLM's placeholder for runai_model_streamer
    imported it and stopped the engine at its first slow step. Only Triton kernels are read, by type
    (a JIT function, or one wrapped by an autotuner or heuristics: uncompiled here, 0 variants)."""
    mod = types.ModuleType("vllm_bole_test_placeholders")
    mod.streamer, mod.kernel = Placeholder(), JITFunction(_kernel)
    mod.wrapped = Heuristics(JITFunction(_kernel), ["x"], {})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert triton_variants(prefixes=(mod.__name__,)) == {f"{mod.__name__}.kernel": 0, f"{mod.__name__}.wrapped": 0}
