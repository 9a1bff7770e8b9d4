"""The server's streamed chunks, written from templates (``app._ChunkEvents``), equal what the protocol's pydantic
models serialize, for any text, finish and stop reason and usage."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.server import protocol as api
from hybridkv.server.app import _ChunkEvents

TEXTS = st.text(max_size=12) | st.sampled_from(["", 'a"b\\c', "line\nnext\t\r", "\x00\x1f\x7f", "héllo ☃ 𝄞",
                                                "\u2028\u2029", "</script>"])
FINISH = st.sampled_from([None, "stop", "length", "error"])
STOP = st.none() | st.integers(0, 2**31) | TEXTS
USAGE = st.none() | st.builds(lambda p, c: api.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c),
                              st.integers(0, 10**6), st.integers(0, 10**6))


def _pydantic_chat(rid, created, model, choices, usage) -> str:
    return "data: " + api.ChatCompletionChunk.model_construct(
        id=rid, object="chat.completion.chunk", created=created, model=model, choices=choices,
        usage=usage).model_dump_json() + "\n\n"


@settings(max_examples=200, deadline=None)
@given(rid=TEXTS, model=TEXTS, created=st.integers(0, 2**40), index=st.integers(0, 64), text=TEXTS, finish=FINISH,
       stop=STOP, role=st.sampled_from([None, "assistant"]), usage=USAGE)
def test_chat_chunks_equal_the_models(rid, model, created, index, text, finish, stop, role, usage) -> None:
    events = _ChunkEvents(rid, "chat.completion.chunk", created, model)
    fast = events.event([events.delta_choice(index, text, finish, stop, role=role)], usage)
    choice = api.ChatStreamChoice.model_construct(index=index, delta=api.DeltaMessage(role=role, content=text),
                                                  logprobs=None, finish_reason=finish, stop_reason=stop,
                                                  token_ids=None)
    slow = _pydantic_chat(rid, created, model, [choice], usage)
    assert fast.startswith("data: ") and fast.endswith("}\n\n")
    assert json.loads(fast[6:]) == json.loads(slow[6:])
    assert events.event([], usage) == _pydantic_chat(rid, created, model, [], usage)


@settings(max_examples=200, deadline=None)
@given(rid=TEXTS, index=st.integers(0, 64), text=TEXTS, finish=FINISH, stop=STOP, usage=USAGE)
def test_completion_chunks_equal_the_models(rid, index, text, finish, stop, usage) -> None:
    events = _ChunkEvents(rid, "text_completion", 7, "m")
    fast = events.event([events.text_choice(index, text, finish, stop)], usage)
    choice = api.CompletionChoice.model_construct(index=index, text=text, logprobs=None, finish_reason=finish,
                                                  stop_reason=stop, prompt_token_ids=None, token_ids=None,
                                                  prompt_logprobs=None)
    slow = "data: " + api.CompletionChunk.model_construct(id=rid, object="text_completion", created=7, model="m",
                                                          choices=[choice], usage=usage).model_dump_json() + "\n\n"
    assert json.loads(fast[6:]) == json.loads(slow[6:])


def test_plain_chunks_are_byte_identical_to_the_models() -> None:
    """Clients see exactly the bytes they saw before the templates (UTF-8 kept, control characters escaped)."""
    for text in ["", "hello", 'a"b\\c\n', "héllo ☃ 𝄞", "\x01"]:
        events = _ChunkEvents("chatcmpl-1", "chat.completion.chunk", 5, "tiny")
        choice = api.ChatStreamChoice.model_construct(index=1, delta=api.DeltaMessage(role=None, content=text),
                                                      logprobs=None, finish_reason="stop", stop_reason=3,
                                                      token_ids=None)
        assert events.event([events.delta_choice(1, text, "stop", 3)], None) == \
            _pydantic_chat("chatcmpl-1", 5, "tiny", [choice], None)
