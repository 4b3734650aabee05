"""Training text every machine has: the Python standard library's own ``*.py`` sources.

Files are read from ``sysconfig.get_paths()["stdlib"]`` (installed packages excluded), sorted by relative
path; a file is held out when the CRC-32 of its relative path falls in bucket 0 of ``HELDOUT_BUCKETS``, so
the split depends on names only and is the same on every machine with the same Python. Each document is
``BOS + tokens + EOS``. The corpus differs between Python versions: :attr:`Corpus.meta` records which.
"""

from __future__ import annotations

import platform
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ds4serve.tokenizer import Tokenizer

HELDOUT_BUCKETS = 50  # one file in 50 (about 2 % of the text) is held out
_INSTALLED = {"site-packages", "dist-packages"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``*.py`` under the standard library directory (not under site- or dist-packages), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _INSTALLED & set(p.relative_to(root).parts))


def is_heldout(relative: str) -> bool:
    """Whether the file at ``relative`` (a POSIX path under the stdlib directory) is held out."""
    return zlib.crc32(relative.encode()) % HELDOUT_BUCKETS == 0


@dataclass
class Corpus:
    train: torch.Tensor  # int64 [N]: every training document, BOS + tokens + EOS, concatenated
    heldout: list[list[int]]  # one BOS + tokens + EOS list per held-out file, in path order
    meta: dict  # python version, stdlib path, file / byte / token counts


def read_sources(root: Path | None = None, limit_files: int | None = None) -> list[tuple[str, str]]:
    """``(relative path, text)`` of the first ``limit_files`` (default all) :func:`stdlib_files`; files that
    are not UTF-8 (a few test fixtures) are skipped."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in stdlib_files(root)[:limit_files]:
        try:
            out.append((path.relative_to(root).as_posix(), path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def _documents(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [[tokenizer.bos_id, *ids, tokenizer.eos_id] for ids in tokenizer.encode_batch(texts)]


def heldout_documents(tokenizer: Tokenizer, root: Path | None = None) -> list[list[int]]:
    """The held-out documents of :func:`load_corpus` alone (without tokenizing the rest)."""
    return _documents(tokenizer, [text for name, text in read_sources(root) if is_heldout(name)])


def load_corpus(tokenizer: Tokenizer, root: Path | None = None, limit_files: int | None = None) -> Corpus:
    """Tokenize the standard library (the first ``limit_files`` files only, when given: tests)."""
    sources = read_sources(root, limit_files)
    docs = _documents(tokenizer, [text for _, text in sources])
    train = [d for (name, _), d in zip(sources, docs) if not is_heldout(name)]
    heldout = [d for (name, _), d in zip(sources, docs) if is_heldout(name)]
    meta = {
        "python": platform.python_version(),
        "stdlib": str(root or sysconfig.get_paths()["stdlib"]),
        "files": len(sources),
        "heldout_files": len(heldout),
        "bytes": sum(len(text.encode()) for _, text in sources),
        "train_tokens": sum(map(len, train)),
        "heldout_tokens": sum(map(len, heldout)),
    }
    stream = torch.tensor([t for d in train for t in d], dtype=torch.long)
    return Corpus(train=stream, heldout=heldout, meta=meta)
