"""The sim engine's built-in tokenizer: no download, deterministic, easy to count by hand.

How it counts:

- Text is split into words (runs of letters, digits and `_`) and single punctuation marks;
  whitespace is dropped. Each word or punctuation mark is ONE token:
  ``"Hello, world!"`` -> ``Hello`` ``,`` ``world`` ``!`` = 4 tokens.
- A token's id is a stable hash (CRC-32) of the word into ``[3, vocab_size)``; ids 0, 1, 2
  are ``<unk>``, ``<s>`` (BOS) and ``</s>`` (EOS). Case matters.
- With special tokens (the default for prompts, as Llama tokenizers do) a BOS is prepended:
  ``"Hello, world!"`` is 5 prompt tokens.
- Chat prompts go through `CHAT_TEMPLATE`: every message becomes
  ``<|{role}|> {content}`` and an ``<|assistant|>`` generation prompt closes the list. Each
  ``<|role|>`` marker counts ``<`` ``|`` ``role`` ``|`` ``>`` = 5 tokens, so a chat prompt is
  1 (BOS) + sum over messages of (5 + tokens of content) + 5.
- Decoding joins words with a space and glues punctuation to the word before it. Generated
  tokens come from a fixed list of common English words (`WORDS`), so replies read like
  (nonsense) English; ids of words seen by `encode` in this process decode back to them; any
  other id decodes to ``<id>``.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL_TOKENS = 3
SPECIAL_TOKENS = {UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n{% endfor %}<|assistant|>"

# Common English words (and a little punctuation) the sim "generates" from.
_WORDS_TEXT = (
    "the of and to in a is that for it as was with be by on not he I this are or his from "
    "at which but have an had they you were their one all we can her has there been if more "
    "when will would who so no time may out up only about into its some could them than "
    "first other new very also after our like over such people years way most many well "
    "made two just where these much before through back good long same work life day world "
    "own man little old right great still small large between never under last might here "
    "part place while both home water number line light system model token engine fast slow "
    "data cache batch step pipe gear ready clear simple model serve request stream answer "
    "open bright quiet river stone garden window , , , . . . ; : "
)
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())


def _word_id(word: str, vocab_size: int) -> int:
    return NUM_SPECIAL_TOKENS + zlib.crc32(word.encode("utf-8")) % (vocab_size - NUM_SPECIAL_TOKENS)


def _is_punct(word: str) -> bool:
    return len(word) == 1 and not (word.isalnum() or word == "_")


class Tokenizer:
    """Words and punctuation marks to ids by a stable hash (see the module docstring)."""

    def __init__(self, vocab_size: int, max_remembered: int = 200_000) -> None:
        if vocab_size <= NUM_SPECIAL_TOKENS + 1:
            raise ValueError("vocab_size too small")
        self.vocab_size = vocab_size
        self._max_remembered = max_remembered
        self._id_to_word: dict[int, str] = dict(SPECIAL_TOKENS)
        self._word_to_id: dict[str, int] = {}
        # The generation vocabulary: (id, text fragment as it follows earlier text).
        gen: dict[int, str] = {}
        for word in WORDS:
            tid = _word_id(word, vocab_size)
            if tid not in gen:
                gen[tid] = word
        self.gen_ids: tuple[int, ...] = tuple(gen)
        self.gen_fragments: dict[int, str] = {
            tid: (w if _is_punct(w) else " " + w) for tid, w in gen.items()
        }
        for tid, word in gen.items():
            self._id_to_word[tid] = word
            self._word_to_id[word] = tid

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        cache = self._word_to_id
        vocab = self.vocab_size
        for word in _TOKEN_RE.findall(text):
            tid = cache.get(word)
            if tid is None:
                tid = _word_id(word, vocab)
                if len(cache) < self._max_remembered:
                    cache[word] = tid
                    self._id_to_word.setdefault(tid, word)
            ids.append(tid)
        return ids

    def count(self, text: str) -> int:
        """Tokens in `text` without special tokens."""
        return len(_TOKEN_RE.findall(text))

    def token_str(self, token_id: int) -> str:
        return self._id_to_word.get(token_id, f"<{token_id}>")

    def fragment(self, token_id: int) -> str:
        """The text a generated token adds after earlier text (leading space for words)."""
        frag = self.gen_fragments.get(token_id)
        if frag is not None:
            return frag
        word = self.token_str(token_id)
        return word if _is_punct(word) else " " + word

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        for tid in ids:
            if skip_special_tokens and tid in SPECIAL_TOKENS:
                continue
            parts.append(self.fragment(tid))
        return "".join(parts).lstrip(" ")

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render `CHAT_TEMPLATE` (content may be a string or OpenAI content parts)."""
        lines = []
        for m in messages:
            lines.append(f"<|{m.get('role', 'user')}|> {message_text(m.get('content'))}\n")
        if add_generation_prompt:
            lines.append("<|assistant|>")
        return "".join(lines)


def message_text(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
        return " ".join(texts)
    return str(content)
