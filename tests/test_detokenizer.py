"""``IncrementalDetokenizer`` against decoding the whole sequence, for every tokenizer source: byte-level BPE
(multi-byte characters split over tokens), sentencepiece with byte fallback (a leading space stripped from
the first token), Tekken and Llama-4's tiktoken. Whatever the chunks tokens arrive in, the released pieces
plus ``finish`` are the whole text, every piece released is a prefix of it, and nothing that could begin a
stop string is released early."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.engine.detokenizer import IncrementalDetokenizer
from tests.test_tokenizers import CORPUS, _tokenizer_of

TEXTS = [*CORPUS[:5], "naïve café — 東京 🚀 ok", "  leading spaces\tand\ttabs  "]


@pytest.fixture(scope="module", params=["hf", "sentencepiece", "mistral", "llama4"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return _tokenizer_of(request.param, tmp_path_factory.mktemp(request.param))


@settings(max_examples=40, deadline=None)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(1, 4), max_size=60), stop=st.booleans())
def test_pieces_join_to_the_whole_text(tokenizer, text: str, cuts: list[int], stop: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    stops = (whole[len(whole) // 2:len(whole) // 2 + 3],) if stop and len(whole) > 8 else ()
    detok = IncrementalDetokenizer(tokenizer.decode, stop=stops)
    released = ""
    start = 0
    for n in [*cuts, len(ids)]:
        piece = detok.add(ids[start:start + n])
        start += n
        released += piece
        assert whole.startswith(released)
        known = tokenizer.decode(ids[:start])
        assert len(released) <= max(len(known) - (max(map(len, stops)) - 1 if stops else 0), 0)
        if start >= len(ids):
            break
    assert released + detok.finish(whole) == whole
    assert detok.text == whole


@pytest.mark.parametrize("stop", ["fox", "x j", "brown fox jumps over"])
def test_nothing_past_a_stop_string_is_released(tmp_path: Path, stop: str) -> None:
    """Tokens arrive one step at a time until one completes the stop string: that step finishes the request,
    whose final text is cut before the stop string; what was released before is a prefix of it."""
    tok = _tokenizer_of("hf", tmp_path)
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.decode, stop=(stop,))
    released = ""
    for n in range(1, len(ids) + 1):
        if stop in tok.decode(ids[:n]):        # the step that finishes the request: its final text comes
            break
        released += detok.add(ids[n - 1:n])
    final = tok.decode(ids[:n])
    final = final[:final.index(stop)]
    assert final.startswith(released)
    assert released + detok.finish(final) == final
