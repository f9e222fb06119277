"""Numeric and statistical checks for tests (torch only)."""
import torch


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value (torch only: regularised upper incomplete gamma). Cells with
    expected count < 5 are pooled; any draw in a zero-probability cell gives 0."""
    observed = observed.double().flatten()
    probs = probs.double().flatten()
    n = observed.sum()
    zero = probs <= 0
    if observed[zero].sum() > 0:
        return 0.0
    obs, exp = observed[~zero], probs[~zero] * n
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (NaN anywhere gives NaN, which fails every bound)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))
