"""The drafters' common output: per-depth candidate tokens with probabilities (one request)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EMPTY", "Candidates"]


@dataclass
class Candidates:
    """Per-depth candidates of one request: ``tokens[d]`` / ``probs[d]`` (equal-length 1-D
    tensors) for depth ``d + 1``; an empty list means no draft."""

    tokens: list[torch.Tensor]
    probs: list[torch.Tensor]

    @property
    def depth(self) -> int:
        return len(self.tokens)


EMPTY = Candidates([], [])
