#!/usr/bin/env python3
"""Byte-level BPE tokenizer of the built-in tiny code model, plus its corpus manifest and the
held-out evaluation prompts.

Writes, under ddtree-engine/models/tiny-code/:
- target/tokenizer.json: HF `tokenizers` byte-level BPE, VOCAB_SIZE tokens, special tokens
  <|bos|> = 0, <|eos|> = 1, <|mask|> = 2 (the DFlash drafter's mask token);
- target/tokenizer_config.json: the special tokens and a plain chat template;
- manifest.json: the corpus (crate names and versions, file counts, the hash of the file list
  with contents), the held-out files, and the tokenizer's training text rule;
- eval_prompts.json: prompts cut from held-out files (never trained on) for `ddtree eval`.

Trained on the first TOKENIZER_BYTES of every training file (scripts/tiny_corpus.py says which
files those are). Deterministic: the BPE trainer is run single-threaded on a sorted file list.

    python3 -m venv .venv-train && .venv-train/bin/pip install -r scripts/requirements-train.txt
    .venv-train/bin/python scripts/train_tokenizer.py
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the build machine is shared; also keeps BPE deterministic
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

import tiny_corpus as corpus  # noqa: E402

VOCAB_SIZE = 4096
TOKENIZER_BYTES = 16 * 1024
PROMPT_CHARS = 600
RUST_PROMPTS = 8
PYTHON_PROMPTS = 4
DEF_PREFIXES = ("fn ", "pub fn ", "pub(crate) fn ", "impl", "def ", "class ", "async def ")


def train(files: list[corpus.SourceFile]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=corpus.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text()[:TOKENIZER_BYTES] for f in files), trainer)
    return tok


def prompt_of(text: str) -> str | None:
    """The text up to and including the first definition line after the file's opening lines,
    at most PROMPT_CHARS long (cut at a line start)."""
    lines = text.splitlines(keepends=True)
    offset = 0
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if i >= 4 and stripped.startswith(DEF_PREFIXES) and line.rstrip().endswith(("{", ":")):
            end = offset + len(line)
            start = max(0, end - PROMPT_CHARS)
            nl = text.find("\n", start)
            start = 0 if start == 0 else nl + 1
            prompt = text[start:end]
            return prompt if len(prompt) >= 120 else None
        offset += len(line)
    return None


def eval_prompts(heldout: list[corpus.SourceFile]) -> list[dict]:
    out = []
    for lang, count in (("rust/", RUST_PROMPTS), ("python3.11/", PYTHON_PROMPTS)):
        picked = 0
        for f in heldout:
            if picked == count:
                break
            if not f.name.startswith(lang) or "/encodings/" in f.name or "sysconfigdata" in f.name:
                continue
            p = prompt_of(f.text())
            if p is not None:
                out.append({"file": f.name, "text": p})
                picked += 1
    return out


def main() -> None:
    files = corpus.corpus()
    training, heldout = corpus.split(files)
    tok = train(training)
    corpus.TARGET_DIR.mkdir(parents=True, exist_ok=True)
    tok.save(str(corpus.TARGET_DIR / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": corpus.BOS,
        "eos_token": corpus.EOS,
        "mask_token": corpus.MASK,
        "model_max_length": 4096,
        "chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
    }
    (corpus.TARGET_DIR / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    manifest = {
        "generator": "scripts/train_tokenizer.py (corpus rule: scripts/tiny_corpus.py)",
        "tokenizers": tokenizers.__version__,
        "vocab_size": VOCAB_SIZE,
        "tokenizer_training_text": f"the first {TOKENIZER_BYTES} bytes of every training file",
        "heldout_rule": f"sha256(file name)[0] < {corpus.HELDOUT_BYTE}",
        "files": len(files),
        "training_files": len(training),
        "training_bytes": sum(f.path.stat().st_size for f in training),
        "heldout_files": [f.name for f in heldout],
        "file_list_sha256": corpus.list_hash(files),
        "python_stdlib": f"CPython 3.11.7 {corpus.PYTHON_LIB} (no site-packages, no test suites)",
        "rust_crates": corpus.crates(files),
    }
    (corpus.MODEL_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    prompts = eval_prompts(heldout)
    (corpus.MODEL_DIR / "eval_prompts.json").write_text(json.dumps({"prompts": prompts}, indent=1) + "\n")
    sample = "fn main() {\n    let x = vec![1, 2, 3];\n}\n"
    print(f"tokenizer: {tok.get_vocab_size()} tokens; {len(training)} training / {len(heldout)} held-out files; "
          f"{len(prompts)} eval prompts; sample {len(sample)} chars -> {len(tok.encode(sample).ids)} tokens")


if __name__ == "__main__":
    main()
