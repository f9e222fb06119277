"""Qwen3-Next's GDN gating for the tree tokens in one launch (Triton).

``gdn_gating_kernel``: g = -exp(A_log) * softplus(a + dt_bias) (the log decay) and beta = sigmoid(b),
per token and value head, in fp32 whatever the inputs' dtype; softplus as torch's (x above 20 passes
through). In torch the same is seven elementwise launches per layer and tree step.
API and dispatch: ``vllm_bole.gdn.gdn_gating``; plain-torch twin: ``vllm_bole/gdn/naive.py``
(``gating_torch``); float64 reference: ``vllm_bole/gdn/reference.py`` (``gdn_gating``).
"""
import triton
import triton.language as tl


@triton.jit
def gdn_gating_kernel(a, b, A_log, dt_bias, g, beta, T, Hv, s_a, s_b, BH: tl.constexpr):
    """Program (token t): a [T, Hv] and b [T, Hv] rows at strides s_a, s_b; g, beta [T, Hv] dense fp32."""
    t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BH)
    hm = o_h < Hv
    x = tl.load(a + t * s_a + o_h, mask=hm, other=0.0).to(tl.float32) + tl.load(dt_bias + o_h, mask=hm, other=0.0).to(tl.float32)
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    gv = -tl.exp(tl.load(A_log + o_h, mask=hm, other=0.0).to(tl.float32)) * sp
    bv = tl.load(b + t * s_b + o_h, mask=hm, other=0.0).to(tl.float32)
    tl.store(g + t * Hv + o_h, gv, mask=hm)
    tl.store(beta + t * Hv + o_h, 1.0 / (1.0 + tl.exp(-bv)), mask=hm)


def gdn_gating(a, b, A_log, dt_bias):
    """Launch ``gdn_gating_kernel``; arguments as ``vllm_bole.gdn.gdn_gating``. Returns (g, beta)."""
    import torch

    T, Hv = a.shape
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    g = torch.empty(T, Hv, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if T:
        gdn_gating_kernel[(T,)](a, b, A_log.contiguous(), dt_bias.contiguous(), g, beta, T, Hv, a.stride(0), b.stride(0),
                                BH=triton.next_power_of_2(Hv))
    return g, beta
