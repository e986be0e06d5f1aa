"""The corpus of the built-in tiny code model (shared by scripts/train_*.py).

Real, redistributable source text present on the build machine:

- every `*.rs` file (under 256 KiB) of the crates unpacked in the cargo registry
  (`~/.cargo/registry/src/index.crates.io-*/<crate>-<version>/`; MIT/Apache-2.0 style licences);
- every `*.py` file (under 256 KiB) of the CPython 3.11.7 standard library
  (`/root/.pyenv/versions/3.11.7/lib/python3.11`; PSF licence), except `site-packages` and the test
  suites (`test`, `tests`, `idle_test` folders).

Each file is named by a stable relative path: `rust/<crate>-<version>/<path>` or
`python3.11/<path>`. A file is HELD OUT (never trained on, the evaluation prompts come from it)
when the first byte of sha256(its relative path) is below HELDOUT_BYTE (about 2% of the files).
The manifest written next to the checkpoints lists the crates, the held-out files and a hash of
the full (path, content sha256) list, so a rebuild on another machine can be checked.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

REGISTRY = Path(os.path.expanduser("~/.cargo/registry/src"))
PYTHON_LIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
MAX_BYTES = 256 * 1024
HELDOUT_BYTE = 6
SKIP_PY_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "ddtree-engine" / "models" / "tiny-code"
TARGET_DIR = MODEL_DIR / "target"
DRAFTER_DIR = MODEL_DIR / "dflash"

BOS, EOS, MASK = "<|bos|>", "<|eos|>", "<|mask|>"
SPECIAL_TOKENS = [BOS, EOS, MASK]  # ids 0, 1, 2


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its stable name and where it is on this machine."""

    name: str
    path: Path

    @property
    def heldout(self) -> bool:
        return hashlib.sha256(self.name.encode()).digest()[0] < HELDOUT_BYTE

    def text(self) -> str | None:
        try:
            return self.path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            return None


def rust_files() -> list[SourceFile]:
    out = []
    for index in sorted(REGISTRY.glob("index.crates.io-*")):
        for crate in sorted(p for p in index.iterdir() if p.is_dir()):
            for f in sorted(crate.rglob("*.rs")):
                if f.is_file() and f.stat().st_size <= MAX_BYTES:
                    out.append(SourceFile(f"rust/{crate.name}/{f.relative_to(crate)}", f))
    return out


def python_files() -> list[SourceFile]:
    out = []
    for f in sorted(PYTHON_LIB.rglob("*.py")):
        rel = f.relative_to(PYTHON_LIB)
        if SKIP_PY_DIRS & set(rel.parts[:-1]) or not f.is_file() or f.stat().st_size > MAX_BYTES:
            continue
        out.append(SourceFile(f"python3.11/{rel}", f))
    return out


def corpus() -> list[SourceFile]:
    """All corpus files that read as UTF-8, sorted by name."""
    files = [f for f in rust_files() + python_files() if f.text() is not None]
    return sorted(files, key=lambda f: f.name)


def crates(files: list[SourceFile]) -> list[str]:
    return sorted({f.name.split("/")[1] for f in files if f.name.startswith("rust/")})


def list_hash(files: list[SourceFile]) -> str:
    """sha256 over `name<TAB>sha256(content)` lines of every file."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\t{hashlib.sha256(f.path.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(training files, held-out files)."""
    return [f for f in files if not f.heldout], [f for f in files if f.heldout]

