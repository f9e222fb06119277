"""Choice between a Triton kernel and its plain-torch twin."""
import torch

IMPLS = ("auto", "torch", "triton")


def use_triton(impl: str, x: torch.Tensor, field: str = "impl") -> bool:
    """'triton' (CUDA, or CPU under TRITON_INTERPRET=1), 'torch', or 'auto' (triton on CUDA tensors).
    ``field`` names the argument in the error."""
    if impl not in IMPLS:
        raise ValueError(f"{field}: {impl!r} is not one of 'auto', 'torch', 'triton'")
    return impl == "triton" or (impl == "auto" and x.is_cuda)
