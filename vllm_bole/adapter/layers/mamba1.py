"""Mamba1 mixers (Jamba, Falcon-Mamba, Mamba: vLLM's ``MambaMixer``): vLLM's ``forward_impl`` runs
the whole mixer (input projection, conv, selective scan with its z gate, output projection) and
has no separable SSM stage, so the override takes the tree tokens' rows of the same pipeline: the
input projection, the tree conv over ancestor windows, vLLM's own ``_ssm_transform`` (x_proj, the
optional dt/B/C norms, dt_proj without its bias), the Mamba1 tree step from the committed state
with the pending path folded in (dt bias and softplus inside, the gate fused as vLLM does), the
output projection. State ``[S, Dn, N]``; conv state as vLLM lays it out."""
from __future__ import annotations

import torch

from vllm_bole.adapter.layers.recurrent import RecurrentLayer
from vllm_bole.mamba import mamba1_tree


class Mamba1Layer(RecurrentLayer):
    vllm_class = "MambaMixer"

    def _dims(self) -> None:
        self.Dn, self.N = self.module.A.shape
        mamba1_tree.check_mamba1_dims(self.Dn, self.N)

    def _install(self) -> None:
        layer = self.module
        if getattr(layer, "is_lora_enabled", False):
            raise NotImplementedError(f"vllm-bole: layer {self.name} uses LoRA, not supported with tree speculation")
        orig = getattr(layer, "_vllm_bole_orig_forward_impl", None) or layer.forward_impl

        def forward_impl(hidden_states, output):
            step = self.active.step
            if step is None:
                return orig(hidden_states, output)
            if step.num_plain > 0:
                orig(hidden_states, output)
            self._tree_forward(step, hidden_states, output)

        layer._vllm_bole_orig_forward_impl = orig
        layer.forward_impl = forward_impl

    def _tree_forward(self, step, hidden_states, output) -> None:
        layer = self.module
        s, T = step.tok_start, step.num_tokens
        xz = layer.in_proj(hidden_states[s : s + T])[0]
        x_in, gate = xz.chunk(2, dim=-1)
        x_in = x_in.contiguous()
        weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(2))
        x, slots = self.conv(step, x_in, weight, layer.conv1d.bias, layer.activation)
        dt, B, C = layer._ssm_transform(x)
        # dense once: the kernel and the commit's stash both read them so
        dt, B, C = dt.transpose(-2, -1).contiguous(), B.contiguous(), C.contiguous()
        y = mamba1_tree.mamba1_tree_step(x, dt, layer.A, B, C, step.tree, self.state_view(), slots,
                                         self.pending_path(), D=layer.D, z=gate.contiguous(),
                                         dt_bias=layer._time_proj_bias(), dt_softplus=True, kernels=step.kernels,
                                         reset_pending=False, pending_idx=self.rows_of(step, slots))
        output[s : s + T] = layer.out_proj(y.to(hidden_states.dtype))[0].to(output.dtype)
        self.save(step, slots, x_in, x=x, dt=dt, B=B)

    def state_view(self) -> torch.Tensor:
        return self.module.kv_cache[1]

    def _new_pending(self, num_rows: int, device):
        return mamba1_tree.PendingPath.empty(num_rows, self.max_path, self.Dn, self.N, dtype=self.pending_dtype(),
                                             device=device)

    def _stash(self, saved, tree, accepted) -> None:
        i = saved.inputs
        mamba1_tree.stash_accepted_path(self.pending_path(), saved.rows, tree, accepted, i["x"], i["dt"], i["B"],
                                        kernels=saved.step.kernels)

    def _commit_pending(self, slots, rows, kernels) -> None:
        layer = self.module
        mamba1_tree.mamba1_commit_pending(self.state_view(), slots, self.pending_path(), layer.A,
                                          dt_bias=layer._time_proj_bias(), dt_softplus=True, kernels=kernels,
                                          pending_idx=rows)
