"""Tokenizing a chat prompt again costs only its new messages: token ids of the text between special
tokens, remembered.

Owns `SegmentCache`, which `router.kv.prompt_tokenizer.PromptTokenizer` uses for rendered chat prompts.
A multi-turn conversation sends its whole history with every turn, and the history is most of a
long prompt: turn n+1 is turn n's messages, the reply and a new message. Tokenizing it from scratch
costs time linear in the whole prompt (docs/benchmarks.md, "Tokenizing in the router": tens of
milliseconds for 32k tokens), several hundred times the JSON parse.

**Why the split is exact.** The `tokenizers` pipeline first cuts the input at its added tokens
that match the raw text (``normalized: false``: the special tokens a chat template writes between
messages, such as ``<|im_start|>`` or ``<|eot_id|>``), then normalizes, pre-tokenizes and runs the
model on each piece on its own (tokenizers/src/tokenizer/added_vocabulary.rs,
`extract_and_normalize`). So the ids of a text are the ids of its pieces, each piece's ids
depending on the piece alone, as long as no added token eats the whitespace beside it
(``lstrip``/``rstrip``/``single_word``) and no step looks at where a piece lies in the whole text
(a ``Metaspace`` pre-tokenizer with ``prepend_scheme: first``). `SegmentCache.for_tokenizer`
checks both from tokenizer.json and then checks the result on a sample against a whole encode;
for any other tokenizer it returns None and the caller encodes whole texts.

Pieces of at least `MIN_CACHED_CHARS` characters are remembered, least recently used first out,
up to `MAX_CACHED_CHARS` characters in all (their ids kept as 4-byte arrays). Thread-safe.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

MIN_CACHED_CHARS = 256
"""Shorter pieces are encoded every time (a few microseconds; not worth an entry)."""
MAX_CACHED_CHARS = 16 * 2**20
"""Characters of remembered pieces per tokenizer (~16 MiB of text, ~4 M token ids beside it)."""

_SAMPLE = "Hello  world.\n\n  {0}\nLine one\tx{1}  trailing spaces {0}{1}\n{0} ümlaut 推理 🚀 12345 x{1}"


def _regex_of(literals: list[str]) -> str:
    """An alternation of ``literals`` as a prefix trie (one branch per first character), longest
    first at each point: the leftmost-longest match that `tokenizers` makes, without trying
    every literal at every position."""
    trie: dict[str, Any] = {}
    for text in literals:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in node.items() if ch]
        branches.sort(key=len, reverse=True)
        if "" in node:
            return f"(?:{'|'.join(branches)})?" if branches else ""
        return branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"

    return build(trie)


def _position_dependent(component: object) -> bool:
    """A (normalizer or pre-tokenizer) description that depends on where a piece lies."""
    if isinstance(component, Mapping):
        if component.get("type") == "Metaspace" and component.get("prepend_scheme") == "first":
            return True
        return any(_position_dependent(v) for v in component.values())
    if isinstance(component, list):
        return any(_position_dependent(v) for v in component)
    return False


class SegmentCache:
    """Token ids (no special tokens added) of texts cut at a tokenizer's raw-matching added tokens,
    with each piece's ids remembered. Build with `for_tokenizer`."""

    def __init__(self, tokenizer: Any, splitter: re.Pattern[str], ids: Mapping[str, int],
                 max_chars: int = MAX_CACHED_CHARS) -> None:  # fmt: skip
        self._tokenizer = tokenizer
        self._splitter = splitter
        self._ids = dict(ids)
        self._max_chars = max_chars
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, array] = OrderedDict()
        self.chars = 0
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, description: Mapping[str, Any],
                      max_chars: int = MAX_CACHED_CHARS) -> SegmentCache | None:  # fmt: skip
        """The cache for ``tokenizer`` (a `tokenizers.Tokenizer`) whose tokenizer.json is
        ``description``, or None when splitting would change its ids (module docstring)."""
        added = [t for t in description.get("added_tokens") or () if isinstance(t, Mapping)]
        raw = [t for t in added if not t.get("normalized", True)]
        if not raw or any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in raw):
            return None
        if _position_dependent(description.get("pre_tokenizer")) or _position_dependent(description.get("normalizer")):
            return None
        ids = {t["content"]: t["id"] for t in raw if isinstance(t.get("content"), str) and t["content"]}
        literals = sorted(ids, key=len, reverse=True)
        cache = cls(tokenizer, re.compile(f"({_regex_of(literals)})"), ids, max_chars)
        sample = _SAMPLE.format(*(literals * 2)[:2]) * 3
        whole = tokenizer.encode_batch_fast([sample], add_special_tokens=False)[0].ids
        if cache.encode(sample) != whole or cache.encode(sample) != whole:   # cold, then from the cache
            return None
        cache.clear()
        return cache

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.chars = self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` without special tokens added: equal to the tokenizer's
        ``encode(text, add_special_tokens=False)``. Raises what the tokenizer raises."""
        parts = self._splitter.split(text)
        out: list[int] = []
        todo: list[tuple[int, str]] = []   # (index in pieces, text) to encode
        pieces: list[Any] = []
        cache = self._cache
        with self._lock:
            for i, part in enumerate(parts):
                if i % 2:
                    pieces.append(self._ids[part])
                elif not part:
                    continue
                elif len(part) >= MIN_CACHED_CHARS and (hit := cache.get(part)) is not None:
                    cache.move_to_end(part)
                    self.hits += 1
                    pieces.append(hit)
                else:
                    todo.append((len(pieces), part))
                    pieces.append(None)
        if todo:   # one call for every piece not remembered (the GIL released while it runs)
            encoded = self._tokenizer.encode_batch_fast([t for _, t in todo], add_special_tokens=False)
            with self._lock:
                for (at, part), enc in zip(todo, encoded):
                    ids = enc.ids
                    pieces[at] = ids
                    if len(part) >= MIN_CACHED_CHARS and part not in cache:
                        self.misses += 1
                        cache[part] = array("I", ids)
                        self.chars += len(part)
                while self.chars > self._max_chars and cache:
                    old, _ = cache.popitem(last=False)
                    self.chars -= len(old)
        for piece in pieces:
            if type(piece) is int:
                out.append(piece)
            else:
                out.extend(piece)
        return out
