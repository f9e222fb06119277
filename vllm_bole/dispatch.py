"""The kernel-choice setting of every core operation: ``kernels`` = "auto" | "torch" | "triton".

"triton": the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); "torch": its plain-torch
twin (the CPU path); "auto": Triton on CUDA tensors, torch otherwise.
"""
import functools
import warnings

import torch

KERNELS = ("auto", "torch", "triton")
LEGACY_NAMES = ("impl", "backend")  # the setting's names before ``kernels``


def use_triton(kernels: str, x: torch.Tensor, field: str = "kernels") -> bool:
    """Whether ``kernels`` picks the Triton kernel for tensors like ``x``. ``field`` names the
    argument in the error."""
    if kernels not in KERNELS:
        raise ValueError(f"{field}: {kernels!r} is not one of 'auto', 'torch', 'triton'")
    return kernels == "triton" or (kernels == "auto" and x.is_cuda)


def takes_legacy_names(fn):
    """Transitional: ``impl=`` / ``backend=`` are still taken as ``kernels=`` (with a
    DeprecationWarning) until the vLLM adapter passes ``kernels=``; then delete this decorator."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for old in LEGACY_NAMES:
            if old in kwargs:
                if "kernels" in kwargs:
                    raise TypeError(f"{fn.__name__}: pass kernels= only ({old}= is its old name)")
                warnings.warn(f"{fn.__name__}: {old}= is now kernels=", DeprecationWarning, stacklevel=2)
                kwargs["kernels"] = kwargs.pop(old)
        return fn(*args, **kwargs)

    return wrapper
