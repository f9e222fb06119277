"""Mamba2 mixers (NemotronH, GraniteMoeHybrid, FalconH1, Mamba2): vLLM's ``conv_ssm_forward`` (inside its
``mamba_mixer2`` op, after the input projection, before the gated norm) gets the tree tokens' part:
tree conv over ancestor windows, then the SSD tree step from the committed state with the pending
path folded in. State ``[S, H, P, N]``; dt as vLLM computes it (softplus, limit (0, inf))."""
from __future__ import annotations

import torch

from vllm_bole.adapter.layers.recurrent import RecurrentLayer, owned
from vllm_bole.mamba import ssd_tree

INF = float("inf")


class Mamba2Layer(RecurrentLayer):
    vllm_class = "MambaMixer2"

    def _dims(self) -> None:
        layer = self.module
        tp = layer.tp_size
        self.H, self.P = layer.num_heads // tp, layer.head_dim
        self.G, self.N = layer.n_groups // tp, layer.ssm_state_size
        ssd_tree.check_ssd_dims(self.H, self.G, self.P, self.N)

    def _install(self) -> None:
        layer = self.module
        if getattr(layer, "use_replayssm", False):
            raise NotImplementedError(f"vllm-bole: layer {self.name} uses ReplaySSM, not supported with tree "
                                      "speculation")
        orig = getattr(layer, "_vllm_bole_orig_conv_ssm", None) or layer.conv_ssm_forward

        def conv_ssm_forward(projected_states, output):
            step = self.active.step
            if step is None:
                return orig(projected_states=projected_states, output=output)
            if step.num_plain > 0:
                orig(projected_states=projected_states, output=output)
            self._tree_forward(step, projected_states, output)

        layer._vllm_bole_orig_conv_ssm = orig
        layer.conv_ssm_forward = conv_ssm_forward

    def _tree_forward(self, step, projected_states, output) -> None:
        layer, H, P, G, N = self.module, self.H, self.P, self.G, self.N
        s, T = step.tok_start, step.num_tokens
        xBC, dt = torch.split(projected_states[s : s + T, layer.tped_intermediate_size :],
                              [layer.tped_conv_size, layer.tped_dt_size], dim=-1)
        xBC = owned(xBC)
        conv_out, slots = self.conv(step, xBC, layer.conv_weights, layer.conv1d.bias, layer.activation)
        x, B, C = layer.split_hidden_states_B_C_fn(conv_out)
        # dense once: the kernel and the commit's stash both read them so
        x, B, C = x.reshape(T, H, P).contiguous(), B.reshape(T, G, N).contiguous(), C.reshape(T, G, N).contiguous()
        dt = dt.contiguous()
        dst = output[s : s + T]
        direct = dst.dtype == x.dtype and dst.is_contiguous()  # the kernel writes the layer's output in place
        y = ssd_tree.ssd_tree_step(x, dt, layer.A, B, C, step.tree, self.state_view(), slots, self.pending_path(),
                                   D=layer.D, dt_bias=layer.dt_bias, dt_softplus=True, dt_limit=(0.0, INF),
                                   out=dst.view(T, H, P) if direct else None, kernels=step.kernels, reset_pending=False,
                                   pending_idx=self.rows_of(step, slots))
        if not direct:
            dst.copy_(y.reshape(T, H * P))
        self.save(step, slots, xBC, x=x, dt=dt, B=B)

    def state_view(self) -> torch.Tensor:
        return self.module.kv_cache[1]

    def _new_pending(self, num_rows: int, device):
        return ssd_tree.PendingPath.empty(num_rows, self.max_path, self.H, self.G, self.P, self.N,
                                          dtype=self.pending_dtype(), device=device)

    def _stash(self, saved, tree, accepted) -> None:
        i = saved.inputs
        ssd_tree.stash_accepted_path(self.pending_path(), saved.rows, tree, accepted, i["x"], i["dt"], i["B"],
                                     kernels=saved.step.kernels)

    def _commit_pending(self, slots, rows, kernels) -> None:
        layer = self.module
        ssd_tree.ssd_commit_pending(self.state_view(), slots, self.pending_path(), layer.A, dt_bias=layer.dt_bias,
                                    dt_softplus=True, dt_limit=(0.0, INF), kernels=kernels, pending_idx=rows)
