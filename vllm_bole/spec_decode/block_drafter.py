"""One-pass block drafter: the marginals of the next ``D`` tokens from ONE small forward on the
target's own last hidden state (engine-agnostic: torch only).

After a step, request ``b``'s new root is the token the target just emitted from its final hidden
state ``h`` [H] (of the last accepted node, or the last prompt token). Depth ``d = 1 .. D`` (the
``d``-th token after the root) is predicted from that same ``h``:

    z_d = h + SiLU(W_d h + b_d)            W [D, H, H], b [D, H]   (one batched matmul)
    p_d = softmax(lm_head(z_d))            the TARGET's LM head (``logits_fn``)

Its top-``K`` per depth are :class:`~vllm_bole.spec_decode.candidates.Candidates` (per-depth marginals:
depth ``d``'s candidates continue any node of depth ``d - 1``), which the best-first builder turns into
a tree.

Decisions. Medusa-style residual heads rather than DFlash's attention block over ``D`` mask tokens:
one matmul plus one LM-head call per step whatever the tree's shape (so a wide tree costs what a chain
costs to draft: BASTION's argument), nothing kept per request (no KV or recurrent state to roll back,
evict or flush), and it trains in a minute on frozen target features (``benchmarks/train_pair.py
--model block``). The LM head is the target's, through the engine's own logits function (vocabulary
sharding under tensor parallelism, soft-capping), so a head checkpoint is only ``D (H^2 + H)``
numbers. ``W = 0, b = 0`` gives every depth the target's own next-token distribution (tests).

Checkpoint: a directory with ``block_drafter.json`` (``hidden_size``, ``depth``) and
``block_drafter.safetensors`` (``weight`` [D, H, H], ``bias`` [D, H]).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import torch

from vllm_bole.spec_decode.candidates import Candidates

CONFIG = "block_drafter.json"
WEIGHTS = "block_drafter.safetensors"

__all__ = ["BlockDrafter", "BlockHead", "check_block_dir"]


class BlockHead(torch.nn.Module):
    """``D`` residual blocks on a hidden state: ``[N, H] -> [N, D, H]``."""

    def __init__(self, hidden_size: int, depth: int):
        super().__init__()
        self.hidden_size, self.depth = int(hidden_size), int(depth)
        self.weight = torch.nn.Parameter(torch.zeros(self.depth, self.hidden_size, self.hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(self.depth, self.hidden_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, None, :] + torch.nn.functional.silu(torch.einsum("nh,dkh->ndk", h, self.weight) + self.bias)

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG), "w") as f:
            json.dump({"hidden_size": self.hidden_size, "depth": self.depth}, f)
        save_file({"weight": self.weight.detach().float().cpu().contiguous(),
                   "bias": self.bias.detach().float().cpu().contiguous()}, os.path.join(path, WEIGHTS))

    @classmethod
    def load(cls, path: str, device="cpu", dtype=torch.float32) -> "BlockHead":
        from safetensors.torch import load_file

        cfg = check_block_dir(path)
        head = cls(cfg["hidden_size"], cfg["depth"])
        head.load_state_dict(load_file(os.path.join(path, WEIGHTS)))
        return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_block_dir(path: str, hidden_size: int | None = None) -> dict:
    """The head's config; a one-line error naming ``model`` when ``path`` is not a block-drafter
    checkpoint, or was trained for another hidden size than the target's ``hidden_size``."""
    try:
        with open(os.path.join(path, CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {path!r} is not a block-drafter checkpoint ({CONFIG}: {e}); drafter 'block' "
                         "needs a directory written by BlockHead.save (benchmarks/train_pair.py --model block)") from None
    if not os.path.isfile(os.path.join(path, WEIGHTS)):
        raise ValueError(f"model: {path!r} has {CONFIG} but no {WEIGHTS}")
    if hidden_size is not None and cfg.get("hidden_size") != hidden_size:
        raise ValueError(f"model: the block drafter {path!r} was trained for hidden size {cfg.get('hidden_size')}, "
                         f"the target's is {hidden_size}")
    return cfg


class BlockDrafter:
    """A :class:`~vllm_bole.spec_decode.candidates.Drafter` over the target's hidden states: the runner
    hands it each request's last hidden state (:meth:`condition`) before every ``propose``.
    ``logits_fn``: ``[N, H] -> [N, vocab]``, the target's LM head."""

    def __init__(self, head: BlockHead, logits_fn: Callable[[torch.Tensor], torch.Tensor], top_k: int):
        self.head, self.logits_fn, self.top_k = head, logits_fn, int(top_k)
        self._hidden: torch.Tensor | None = None

    @property
    def runtime(self) -> str:
        """How it drafts (the engine's start-up line)."""
        return f"one-pass heads on the target's hidden state, depth {self.head.depth}"

    def condition(self, hidden: torch.Tensor) -> None:
        """``hidden`` [B, H]: row ``b`` is the final hidden state that emitted request ``b``'s root."""
        self._hidden = hidden

    @torch.inference_mode()
    def propose(self, histories: Sequence, depths: Sequence[int], keys=None) -> Candidates:
        """Candidates ``[B, min(max(depths), head depth), top_k]`` on the CPU (``histories`` only give B)."""
        h, self._hidden = self._hidden, None
        B = len(histories)
        dep = torch.as_tensor(list(depths), dtype=torch.long).clamp(min=0, max=self.head.depth).reshape(B)
        D = int(dep.max()) if B else 0
        if D == 0:
            return Candidates.empty(B, 0, self.top_k)
        if h is None or h.shape[0] != B:
            raise RuntimeError(f"block drafter: condition() must give {B} hidden states before propose "
                               f"(got {None if h is None else tuple(h.shape)})")
        z = self.head(h.to(self.head.weight.dtype))[:, :D]  # [B, D, H]
        logits = self.logits_fn(z.reshape(B * D, -1)).float()
        k = min(self.top_k, logits.shape[-1])
        probs, tokens = logits.softmax(-1).topk(k, dim=-1)
        probs, tokens = probs.reshape(B, D, k).cpu(), tokens.reshape(B, D, k).cpu()
        off = torch.arange(D)[None, :] >= dep[:, None]  # [B, D] beyond the request's depth
        return Candidates(tokens.masked_fill(off[..., None], -1), probs.masked_fill(off[..., None], 0.0))
