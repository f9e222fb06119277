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

