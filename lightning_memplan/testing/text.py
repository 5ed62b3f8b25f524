"""Real English text that is available offline, and a tokenizer built from it locally.

The corpus is the docstrings of the Python standard library that ships with the interpreter, then of
this project's installed dependencies (read from source with :mod:`ast`, never imported): megabytes of
real technical English on every machine, with no download. The tokenizer is a word-level vocabulary over that corpus with a byte
fallback, so any text round-trips and the vocabulary can be made as large as the logits need
(>= 16K tokens, so the [b, s, V] logits matter as they do in real LLM training).

Written here rather than taken from a library because no tokenizer package is a dependency and
nothing may be downloaded at run time.
"""

from __future__ import annotations

import ast
import collections
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TokenWindows", "WordTokenizer", "offline_corpus"]

_TOKEN_RE = re.compile(r"\w+|[^\w\s]|\s+")
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def _docstrings(path: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) > 40:
                yield doc


def _source_roots(packages: Sequence[str]) -> list[str]:
    import importlib.util

    roots = [sysconfig.get_paths()["stdlib"]]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(sorted(spec.submodule_search_locations))
    return roots


def _python_files(root: str) -> list[str]:
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(paths)


def offline_corpus(
    max_chars: int = 3_000_000, packages: Sequence[str] = ("lightning", "torchmetrics", "rich", "torch")
) -> str:
    """Docstrings of the standard library, then of the installed ``packages`` (this project's own
    dependencies, so always present), in a fixed sorted order, up to ``max_chars`` characters.

    Args:
        max_chars: stop once this many characters are collected (a deterministic prefix).
        packages: installed packages whose sources are read after the standard library.

    Raises:
        ValueError: ``max_chars`` is not positive, or no sources with docstrings were found.
    """
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars <= 0:
        raise ValueError(f"max_chars={max_chars!r} must be a positive int, e.g. 2_000_000")
    parts: list[str] = []
    total = 0
    roots = _source_roots(packages)
    for root in roots:
        for path in _python_files(root):
            for doc in _docstrings(path):
                parts.append(doc)
                total += len(doc) + 2
                if total >= max_chars:
                    return "\n\n".join(parts)[:max_chars]
    if not parts:
        raise ValueError(f"no Python sources with docstrings under {roots!r}; the corpus needs the standard library")
    return "\n\n".join(parts)


@dataclass(frozen=True)
class WordTokenizer:
    """Word-level tokenizer with a byte fallback: ids ``0..255`` are bytes, then the most frequent
    words/punctuation/whitespace runs of the training text. Unknown pieces are spelled in bytes, so
    ``decode(encode(text)) == text`` for any text."""

    vocab: tuple[str, ...]

    @classmethod
    def train(cls, text: str, vocab_size: int) -> WordTokenizer:
        if not isinstance(vocab_size, int) or vocab_size <= 256:
            raise ValueError(f"vocab_size={vocab_size!r} must be an int > 256 (256 ids are the byte fallback)")
        counts = collections.Counter(_TOKEN_RE.findall(text))
        # Sort by (-count, piece) so equal counts break ties deterministically.
        pieces = [p for p, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        return cls(vocab=tuple(pieces[: vocab_size - 256]))

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.vocab)

    @property
    def _index(self) -> dict[str, int]:
        cached = self.__dict__.get("_index_cache")
        if cached is None:
            cached = {p: 256 + i for i, p in enumerate(self.vocab)}
            object.__setattr__(self, "_index_cache", cached)
        return cached

    def encode(self, text: str) -> list[int]:
        index = self._index
        ids: list[int] = []
        for piece in _TOKEN_RE.findall(text):
            tid = index.get(piece)
            if tid is None:
                ids.extend(piece.encode("utf-8"))
            else:
                ids.append(tid)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for tid in ids:
            if tid < 256:
                out.append(tid)
            else:
                out.extend(self.vocab[tid - 256].encode("utf-8"))
        return out.decode("utf-8", errors="replace")


class TokenWindows:
    """Non-overlapping windows of ``seq_len`` tokens from one long token stream: a map-style dataset
    (``len`` and indexing) for ``torch.utils.data.DataLoader``, shared by the examples' training jobs."""

    def __init__(self, tokens: Any, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
