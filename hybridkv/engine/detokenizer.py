"""Incremental detokenization: a growing output's text a piece at a time, at a constant cost per token.

Decoding the whole output after every step costs O(length) per token. ``IncrementalDetokenizer`` decodes a
window of the last few tokens twice (with and without the new ones) and releases the difference — vLLM's
algorithm: the window starts one token early so that a decoder's rules for a sequence's first token (a
sentencepiece leading space stripped) apply to the earlier token, not the new one; an unfinished UTF-8
character (the text ends in U+FFFD) is held until the tokens that complete it arrive.

Stop strings: text that could be the start of a stop string is held back (the longest stop string's length
minus one character), so no released text ever has to be taken back; the request's final text (cut at its
stop string by the engine) then gives the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

logger = logging.getLogger("hybridkv.engine")

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one sequence's output tokens. ``decode(ids)`` decodes a list of token ids (as the
    request's final text is decoded: the same special-token rule)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], *, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0            # window start (one token before the first undecoded one)
        self._read = 0              # tokens whose text is in ``_text``
        self._text = ""             # decoded so far (complete characters)
        self._released = 0          # characters of ``_text`` handed out
        self._hold = max((len(s) for s in stop), default=1) - 1

    @property
    def text(self) -> str:
        """What has been released."""
        return self._text[:self._released]

    def add(self, ids: Sequence[int]) -> str:
        """Take new token ids; return the text that can be released now (may be empty)."""
        if not ids:
            return ""
        self._ids.extend(ids)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        end = len(self._text) - self._hold
        if end <= self._released:
            return ""
        piece = self._text[self._released:end]
        self._released = end
        return piece

    def finish(self, final_text: str | None) -> str:
        """The rest of the text, given the request's final text (None: nothing more)."""
        if final_text is None:
            return ""
        released = self.text
        if not final_text.startswith(released):       # (a decoder whose window text differs from the whole's)
            logger.debug("incremental text %r is not a prefix of the final text %r", released[-40:], final_text[-40:])
        rest = final_text[len(released):]
        self._text, self._released = final_text, len(final_text)
        return rest
