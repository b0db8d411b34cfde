"""Token ids of texts for ``anytrain prepare``'s workers: ``encode_batch_fast``'s ids, through a cache of whitespace-cut
pieces where the tokenizer allows it (:func:`pieces_compose`)."""

from __future__ import annotations

import json
import re

import numpy as np

# A text cut before every space, tab, newline or carriage return that follows a non-whitespace character: each match
# is one piece, and the pieces partition the text.
PIECES = re.compile(r"\s*\S+(?:[^\S \t\n\r]\s*\S*)*|\s+")
PIECE_CACHE = 1 << 17  # cached pieces per process (about 15 MB); emptied when a batch of texts starts with more
PIECE_BATCH = 4096  # new pieces per encode_batch_fast call


def pieces_compose(config: dict) -> bool:
    """Whether a tokenizer (its JSON ``config``) encodes a text without added tokens as the concatenation of the ids
    of its :data:`PIECES`. True for a byte-level BPE without normalizer, truncation or padding (the tokenizer this
    command trains): no match of its pre-tokenizer's GPT-2 pattern holds a non-whitespace character followed by a
    whitespace one, so every cut of :data:`PIECES` is a pre-token boundary (space, tab, newline and carriage return are
    whitespace to the pattern, and Python's whitespace includes the pattern's, so a character that is not whitespace
    here is not there either); pre-tokens are encoded independently, and no branch of the pattern looks behind, so a
    piece splits alone as it does inside the text."""
    pre, model = config.get("pre_tokenizer") or {}, config.get("model") or {}
    return (
        config.get("normalizer") is None
        and config.get("truncation") is None
        and config.get("padding") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and model.get("type") == "BPE"
        and not model.get("dropout")
        and (config.get("post_processor") or {"type": "ByteLevel"})["type"] == "ByteLevel"
    )


class TextEncoder:
    """Each text's token ids as bytes of ``dtype``, the ids of ``tokenizer.encode_batch_fast`` (no special tokens
    added). When :func:`pieces_compose` holds, a text is cut into :data:`PIECES` and each piece's ids are looked up in
    a cache of the pieces seen before (pieces repeat: words with their leading space), the new ones encoded together;
    a text holding an added token's content is encoded whole."""

    def __init__(self, tokenizer, dtype: np.dtype, batch_docs: int) -> None:
        self.encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # the same ids, no offsets
        self.dtype, self.batch_docs = dtype, batch_docs
        config = json.loads(tokenizer.to_str())
        self.cache: dict[str, bytes] | None = {} if pieces_compose(config) else None
        self.added = [token["content"] for token in config.get("added_tokens") or []]

    def _ids(self, texts: list[str], batch: int) -> list[bytes]:
        out = []
        for lo in range(0, len(texts), batch):
            encodings = self.encode(texts[lo : lo + batch], add_special_tokens=False)
            out.extend(np.array(e.ids, dtype=self.dtype).tobytes() for e in encodings)
        return out

    def __call__(self, texts: list[str]) -> list[bytes]:
        if self.cache is None:
            return self._ids(texts, self.batch_docs)
        out: list[bytes] = []
        for lo in range(0, len(texts), self.batch_docs):
            out.extend(self._pieces(texts[lo : lo + self.batch_docs]))
        return out

    def _pieces(self, texts: list[str]) -> list[bytes]:
        cache = self.cache
        if len(cache) > PIECE_CACHE:
            cache.clear()
        lookup, pieces_of = cache.__getitem__, PIECES.findall
        out: list[bytes | None] = []
        missing: list[tuple[int, list[str]]] = []  # texts with a piece not in the cache
        whole: list[int] = []  # texts holding an added token's content
        for i, text in enumerate(texts):
            if any(token in text for token in self.added):
                whole.append(i)
                out.append(None)
                continue
            pieces = pieces_of(text)
            try:
                out.append(b"".join(map(lookup, pieces)))
            except KeyError:
                missing.append((i, pieces))
                out.append(None)
        if missing:
            new = list(set().union(*(pieces for _, pieces in missing)).difference(cache))
            cache.update(zip(new, self._ids(new, PIECE_BATCH), strict=True))
            for i, pieces in missing:
                out[i] = b"".join(map(lookup, pieces))
        for i, ids in zip(whole, self._ids([texts[i] for i in whole], self.batch_docs), strict=True):
            out[i] = ids
        return out  # type: ignore[return-value]
