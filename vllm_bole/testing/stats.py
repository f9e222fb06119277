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


def chi2_homogeneity_pvalue(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    """Pearson chi-square test that two samples of categorical outcomes (``counts_a``, ``counts_b``:
    per-category counts, same categories) come from one distribution (2 x K contingency table).
    Categories with an expected count < 5 in either row are pooled into one."""
    a, b = counts_a.double().flatten(), counts_b.double().flatten()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    col = a + b
    small = (col * torch.minimum(na, nb) / (na + nb)) < 5
    if small.any():
        a = torch.cat([a[~small], a[small].sum()[None]])
        b = torch.cat([b[~small], b[small].sum()[None]])
        col = a + b
    if col.numel() < 2:
        return 1.0
    ea, eb = col * na / (na + nb), col * nb / (na + nb)
    stat = ((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum()
    df = col.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (NaN anywhere gives NaN, which fails every bound)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def sample_homogeneity(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Chi-square homogeneity p-values of two samples of equal-length token sequences: on the whole
    sequences (``"seq"``) and on each position (``"pos<i>"``)."""
    out = {}
    keys = [("seq", tuple)] + [(f"pos{i}", lambda t, i=i: t[i]) for i in range(len(a[0]))]
    for name, key in keys:
        cats = sorted({key(t) for t in a} | {key(t) for t in b})
        ix = {c: i for i, c in enumerate(cats)}
        ca, cb = torch.zeros(len(cats)), torch.zeros(len(cats))
        for t in a:
            ca[ix[key(t)]] += 1
        for t in b:
            cb[ix[key(t)]] += 1
        out[name] = chi2_homogeneity_pvalue(ca, cb)
    return out
