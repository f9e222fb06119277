"""The kernel-choice setting of every core operation: ``kernels`` = "auto" | "torch" | "triton".

"triton": the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); "torch": its plain-torch
twin (the CPU path); "auto": Triton on CUDA tensors, torch otherwise.
"""
import torch

KERNELS = ("auto", "torch", "triton")


def use_triton(kernels: str, x: torch.Tensor, field: str = "kernels") -> bool:
    """Whether ``kernels`` picks the Triton kernel for tensors like ``x``. ``field`` names the
    argument in the error."""
    if kernels not in KERNELS:
        raise ValueError(f"{field}: {kernels!r} is not one of 'auto', 'torch', 'triton'")
    return kernels == "triton" or (kernels == "auto" and x.is_cuda)


# (prefixes, number of loaded modules) -> [(name, JIT function)] of the last scan: a later call rescans only
# when modules were imported since
_KERNELS: dict = {}


def triton_variants(prefixes=("csrc_triton", "vllm", "fla")) -> dict[str, int]:
    """Compiled variants per Triton kernel of the loaded modules under ``prefixes`` (``module.kernel``: the
    kernels' caches summed over devices); a kernel whose count grew was compiled for a new
    specialisation. Scans ``sys.modules`` (tens of milliseconds) only when modules were imported since
    the last call; otherwise sums the kernels it found then. Reads only objects that are Triton kernels
    by type (an attribute lookup on anything else may import: vLLM's placeholder modules import their
    package on first access, and raise where it is not installed)."""
    import sys

    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    key = (prefixes, len(sys.modules))
    if key not in _KERNELS:
        kernels = []
        for name, mod in list(sys.modules.items()):
            if mod is None or not name.startswith(prefixes):
                continue
            for attr, obj in list(getattr(mod, "__dict__", {}).items()):
                while isinstance(obj, (Autotuner, Heuristics)):  # wrappers of the JIT function
                    obj = obj.fn
                if isinstance(obj, JITFunction):
                    kernels.append((f"{name}.{attr}", obj))
        _KERNELS.clear()
        _KERNELS[key] = kernels
    return {name: sum(len(c[0]) for c in (fn.__dict__.get("device_caches") or {}).values())
            for name, fn in _KERNELS[key]}
