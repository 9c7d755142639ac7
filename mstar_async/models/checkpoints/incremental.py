"""Streaming detokenization: turn token ids into text one id at a time."""

from __future__ import annotations

from mstar_async.models.checkpoints.tokenizer import ChatTokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Decode a token stream piece by piece, yielding only text that is final.

    Decoding ids one at a time and concatenating is wrong for byte-level BPE: one character may
    span several tokens, and a token's leading-space handling depends on its neighbours. So we
    decode a short window of recent ids twice — without and with the newest ones — and emit the
    difference, holding it back while it ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: ChatTokenizer, *, skip_special_tokens: bool = True) -> None:
        """Start an empty stream decoded with ``tokenizer``."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # _ids[:_read] were emitted last time and are kept only as decoding context;
        # _ids[_read:] are not emitted yet.
        self._ids: list[int] = []
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token id; return the text it completes (possibly ``""``)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """Return whatever is still held back (an unfinished character shows as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        seen = self._tokenizer.decode(self._ids[: self._read], self._skip)
        full = self._tokenizer.decode(self._ids, self._skip)
        if len(full) <= len(seen) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        # The older context is dropped so each push decodes a short window, not the whole stream.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return full[len(seen) :]
