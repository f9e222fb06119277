"""Host-to-device copies that do not synchronise the stream.

``Tensor.to("cuda")`` from ordinary (pageable) host memory copies and then waits for the stream: the
host stalls until every kernel queued before it has run, and the next launches start late. The H200
profile of a tree step showed 24 such copies per step (tree metadata, block tables, draft inputs).
:func:`upload` stages through pinned memory and copies asynchronously instead (PyTorch's caching
host allocator keeps the staging block alive until the copy has run); :func:`upload_many` packs
several tensors into one staging buffer, allocated pinned, so a step's tree metadata crosses in one
copy. The other way, :func:`download_async` copies behind the queued work into pinned memory and waits
only when its result is read.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch

__all__ = ["SideStream", "download_async", "host_array", "upload", "upload_many"]


def upload(t: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (in ``dtype`` if given); CPU -> CUDA without a stream synchronisation."""
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype and t.device.type == "cpu":
        t = t.to(dtype)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device) if dtype is None else t.to(device, dtype)


def host_array(t: torch.Tensor) -> np.ndarray:
    """``t`` as numpy: a host tensor's view (no dispatched torch operation: a step's host work reads its host
    trees this way), a device tensor's copy."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


def download_async(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``t`` copied to the host behind the work queued so far: on CUDA into pinned memory without waiting
    (the callable returned waits for that copy only, not for work queued after it), elsewhere at once (a
    copy: the source may be a buffer that is reused)."""
    if t.device.type != "cuda":
        got = t.clone()
        return lambda: got
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return lambda: (done.synchronize(), host)[1]


def upload_many(tensors, device) -> list:
    """Host tensors on ``device``: on CUDA packed into ONE pinned staging buffer and copied once (the
    results are views of that copy, each 8-byte aligned); elsewhere ``Tensor.to``."""
    device = torch.device(device)
    if device.type != "cuda":
        return [t if t.device == device else t.to(device) for t in tensors]
    buf, spans = pack(tensors, pin=True)
    return unpack(buf.to(device, non_blocking=True), tensors, spans)


def pack(tensors, pin: bool = False) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(uint8 buffer, (offset, bytes) per tensor): the host tensors' bytes, each padded to 8 bytes; in
    pinned memory with ``pin``. Copied through numpy (a third of the host time of torch's per-tensor
    view, pad and concatenate operations for a step's dozen small tensors)."""
    arrays = [_bytes(t) for t in tensors]
    spans, off = [], 0
    for a in arrays:
        spans.append((off, a.size))
        off += a.size + (-a.size % 8)
    buf = torch.zeros(off, dtype=torch.uint8, pin_memory=pin)
    flat = buf.numpy()
    for a, (o, n) in zip(arrays, spans):
        flat[o: o + n] = a
    return buf, spans


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes (numpy, flat uint8); 16-bit floats numpy lacks through a torch view."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.contiguous().view(torch.int16)
    return np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)


def unpack(buf: torch.Tensor, like, spans) -> list:
    """Views of ``buf`` with the dtypes and shapes of ``like`` (:func:`pack`'s inverse): the buffer viewed
    once per dtype, then one strided view per tensor (half the host time of slicing and two views each,
    every step's upload)."""
    typed, out = {}, []
    for t, (o, _) in zip(like, spans):
        whole = typed.get(t.dtype)
        if whole is None:
            whole = typed[t.dtype] = buf.view(t.dtype)
        stride, step = [], 1
        for d in reversed(t.shape):
            stride.append(step)
            step *= d
        out.append(whole.as_strided(t.shape, stride[::-1], whole.storage_offset() + o // t.element_size()))
    return out


class SideStream:
    """Where a drafter's launches behind a step run (:meth:`after`): on CUDA a stream of its own, so that the
    host's next synchronisation of the current stream (vLLM reading the sampled tokens) does not wait for
    them; elsewhere the current stream."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._stream = None

    def after(self, tensors) -> contextlib.AbstractContextManager:
        """A context whose launches run after the work queued so far on the current stream, reading the
        device ``tensors`` (kept alive for that stream)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:
            t.record_stream(self._stream)
        return torch.cuda.stream(self._stream)
