"""Triton kernels of vllm-bole. On CPU they run only under ``TRITON_INTERPRET=1`` (set before import).

Each kernel has a plain-torch twin (the CPU path) and a float64 reference (the tests' oracle)
side by side in the operation's package, whose ``__init__`` is the public API and dispatch
(``kernels`` = "auto" | "torch" | "triton", ``vllm_bole.dispatch``):

  kernel (here)        API                                  twin / reference (beside the API)
  gdn_tree.py          vllm_bole.gdn                        gdn/naive.py, gdn/reference.py
  gdn_gating.py        vllm_bole.gdn (gdn_gating)           gdn/naive.py, gdn/reference.py
  ssd_tree.py          vllm_bole.mamba.ssd_tree             mamba/ssd_tree/{naive,reference}.py
  tree_conv.py         vllm_bole.mamba.tree_conv            mamba/tree_conv/{naive,reference}.py
  tree_attention.py    vllm_bole.attention.tree_attention   attention/tree_attention/{naive,reference}.py
  kv_compaction.py     vllm_bole.attention.kv_compaction    attention/kv_compaction/{naive,reference}.py
  pending_stash.py     vllm_bole.pending                    (the stash's torch twin is inline there)
  mamba1_tree.py       vllm_bole.mamba.mamba1_tree          mamba/mamba1_tree/{naive,reference}.py
  greedy_walk.py       vllm_bole.spec_decode.verification   verify_greedy's twin _descend_by_choice (the
                                                            oracle: plain greedy decoding, tests)

``tiles.py`` holds the tile helpers the recurrent kernels share (mm, ancestor-mask tiles, the
nilpotent inverse).
"""
