"""The tokenizer a checkpoint ships, behind one small interface (``encode``, ``decode``,
``eos_token_ids``, ``bos_token``, ``apply_chat_template``).

BOS exactly once: ``encode`` adds the BOS token as the checkpoint's tokenizer does, unless the text already
starts with the BOS token's text (a rendered chat template usually does): then that text is the BOS.
``encode_prompt`` applies the same rule to any tokenizer object (e.g. one from transformers).

Sources, in the order HF itself prefers them: ``tokenizer.json`` (HF tokenizers); Mistral's
``tekken.json`` / ``tokenizer.model.v*`` (through ``mistral-common``); ``tokenizer.model`` as a
sentencepiece model, or as Llama-4's tiktoken ranks file (through ``llama-models``). A checkpoint with
none of them has no tokenizer (``load_tokenizer`` returns None): token-id prompts still run. A source
that needs a package not installed is an error naming the package, never a silent fallback that
would tokenize differently.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a prompt, with the BOS token exactly once: ours follow the rule themselves; for another
    tokenizer (transformers') a text that starts with its ``bos_token`` is encoded without special tokens."""
    if isinstance(tokenizer, _Base):
        return tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_token", None)
    if isinstance(bos, str) and bos and text.startswith(bos):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def _text_content(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message whose content is a list of parts becomes one with string content (text parts joined by
    newlines, as vLLM does for templates that take strings); other parts are refused."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ValueError(f"only text content is supported, got a part {part!r}")
    return {**message, "content": "\n".join(texts)}


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
    """A conversation as text through a chat template: ``chat_template`` (a Jinja source) or the tokenizer's
    own; our tokenizers or any with transformers' ``apply_chat_template``. ``continue_final_message`` ends
    the text with the last message's content (no end-of-turn), so the model continues that message."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or \
            not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError("a conversation is a list of messages, dicts with a 'role' and a 'content'")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other")
    messages = [_text_content(m) for m in messages]
    if isinstance(tokenizer, _Base):
        template = tokenizer.chat_template if chat_template is None else ChatTemplate(
            source=chat_template, special_tokens=tokenizer.chat_template.special_tokens
            if tokenizer.chat_template is not None else tokenizer.special_tokens())
        if template is None:
            raise ValueError(f"{tokenizer.source}: this tokenizer has no chat template (no chat_template in "
                             f"{TOKENIZER_CONFIG} and no {CHAT_TEMPLATE_FILE}); pass chat_template=")
        text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    elif hasattr(tokenizer, "apply_chat_template"):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tools=tools, **kwargs)
    elif chat_template is not None:
        text = ChatTemplate(source=chat_template).render(messages, add_generation_prompt=add_generation_prompt,
                                                         tools=tools, **kwargs)
    else:
        raise ValueError("this tokenizer has no chat template: pass chat_template=")
    if continue_final_message:
        final = messages[-1].get("content")
        if not isinstance(final, str) or final.strip() not in text:
            raise ValueError("continue_final_message: the final message's content is not in the rendered text")
        final = final.strip()
        text = text[:text.rindex(final) + len(final)]
    return text


# -- chat templates --------------------------------------------------------------------------------------
def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts ({"content": ...})."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A Jinja chat template rendered as HF does (sandboxed, trim_blocks + lstrip_blocks)."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)   # bos_token, eos_token, ...

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        extra = {"tools": list(tools)} if tools is not None else {}
        return _compiled(self.source).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                             **{**self.special_tokens, **extra, **kwargs})


@functools.lru_cache(maxsize=64)
def _compiled(source: str) -> Any:
    """``source`` compiled once (compiling costs ~50x a render: a server renders every request's messages)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise RuntimeError("rendering a chat template needs jinja2 (pip install jinja2)") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def _read_tokenizer_config(directory: Path) -> dict[str, Any]:
    file = directory / TOKENIZER_CONFIG
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    return data if isinstance(data, dict) else {}


def _chat_template(directory: Path, config: Mapping[str, Any]) -> ChatTemplate | None:
    """``chat_template.jinja`` (what transformers 5.x writes) or ``tokenizer_config["chat_template"]``
    (a string, or a list of named templates of which "default" is used)."""
    file = directory / CHAT_TEMPLATE_FILE
    source: Any = file.read_text() if file.is_file() else config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str) or not source:
        return None
    special = {key: text for key in ("bos_token", "eos_token", "unk_token", "pad_token")
               if (text := _token_text(config.get(key))) is not None}
    return ChatTemplate(source=source, special_tokens=special)


def _generation_eos(directory: Path) -> tuple[int, ...]:
    """``generation_config.json``'s eos ids (chat models list their end-of-turn tokens there)."""
    file = directory / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        value = json.loads(file.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return ()
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _merge_ids(*groups: Sequence[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for group in groups for i in group if i is not None))


# -- implementations -------------------------------------------------------------------------------------
class _Base:
    """Shared ``encode`` (the BOS rule) and ``apply_chat_template``: render the template, then encode without
    special tokens (the template writes them itself). ``bos_token``: the text of the BOS token ``encode``
    adds (None when it adds none)."""

    eos_token_ids: tuple[int, ...] = ()
    chat_template: ChatTemplate | None = None
    source: str = ""
    bos_token: str | None = None

    releases_gil = False
    """Whether ``encode_batch`` runs without holding the GIL (then a worker thread can tokenize while the
    calling thread's event loop goes on)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (BOS) as the tokenizer adds them, BOS exactly once."""
        if not add_special_tokens:
            return self._encode_plain(text)
        if self.bos_token and text.startswith(self.bos_token):
            return self._encode_from_bos(text)
        return self._encode_special(text)

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text."""
        return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def _encode_special(self, text: str) -> list[int]:
        raise NotImplementedError

    def _encode_from_bos(self, text: str) -> list[int]:
        """``text`` that starts with the BOS token's text: that text is the BOS token."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def special_tokens(self) -> dict[str, str]:
        """Template variables for the special tokens (a chat template given without the checkpoint's)."""
        return {"bos_token": self.bos_token} if self.bos_token else {}

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """The conversation as the model's chat template writes it (text, or token ids with
        ``tokenize=True``). Errors when the checkpoint ships no template."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: this tokenizer has no chat template (no chat_template in "
                             f"{TOKENIZER_CONFIG} and no {CHAT_TEMPLATE_FILE})")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self._encode_plain(text) if tokenize else text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source})"


class HFTokenizer(_Base):
    """``tokenizer.json`` through HF ``tokenizers``; special tokens (BOS) as its post-processor adds them,
    as ``AutoTokenizer`` does by default."""

    releases_gil = True

    def __init__(self, file: Path, config: Mapping[str, Any], chat_template: ChatTemplate | None,
                 extra_eos: Sequence[int]) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.source = str(file)
        self._tok = _Tokenizer.from_file(str(file))
        # (padding or truncation set in the file would pad or cut prompts; AutoTokenizer does neither unless asked)
        self._tok.no_padding()
        self._tok.no_truncation()
        eos_text = _token_text(config.get("eos_token"))
        eos = self._tok.token_to_id(eos_text) if eos_text else None
        self.eos_token_ids = _merge_ids([eos], extra_eos)
        self.chat_template = chat_template
        added = self._tok.encode("").ids[:1]         # what the post-processor puts first in every text: the BOS
        self.bos_token = self._tok.id_to_token(added[0]) if added and self._tok.encode("x").ids[:1] == added else None

    def _encode_special(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, through ``tokenizers``' ``encode_batch``, which releases the GIL (``encode``
        holds it)."""
        plain = [not add_special_tokens or bool(self.bos_token and t.startswith(self.bos_token)) for t in texts]
        ids: list[list[int]] = [[] for _ in texts]
        for without_special in (False, True):
            picked = [i for i, p in enumerate(plain) if p == without_special]
            if picked:
                encodings = self._tok.encode_batch([texts[i] for i in picked],
                                                   add_special_tokens=not without_special)
                for i, enc in zip(picked, encodings, strict=True):
                    ids[i] = enc.ids
        return ids

    def _encode_from_bos(self, text: str) -> list[int]:
        return self._encode_plain(text)          # the BOS text is an added token: it encodes to the BOS id

    def _encode_plain(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class SentencePieceTokenizer(_Base):
    """A sentencepiece ``tokenizer.model`` (Llama-2 / Mistral v1 style); BOS unless the tokenizer config
    sets ``add_bos_token`` false, EOS only when it sets ``add_eos_token``."""

    def __init__(self, file: Path, config: Mapping[str, Any], chat_template: ChatTemplate | None,
                 extra_eos: Sequence[int]) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise RuntimeError(f"{file} is a sentencepiece model: pip install sentencepiece") from None
        self.source = str(file)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
        self._bos = self._sp.bos_id() if config.get("add_bos_token", True) and self._sp.bos_id() >= 0 else None
        self._eos = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self._add_eos = bool(config.get("add_eos_token", False)) and self._eos is not None
        self.eos_token_ids = _merge_ids([self._eos], extra_eos)
        self.chat_template = chat_template
        self.bos_token = self._sp.id_to_piece(self._bos) if self._bos is not None else None

    def _encode_special(self, text: str) -> list[int]:
        ids = self._encode_plain(text)
        return ([self._bos] if self._bos is not None else []) + ids + ([self._eos] if self._add_eos else [])

    def _encode_from_bos(self, text: str) -> list[int]:
        # sentencepiece reads control-token text as plain text: the BOS text is dropped, the BOS id added
        assert self.bos_token is not None
        return self._encode_special(text[len(self.bos_token):])

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self._sp.decode(ids)
        # sentencepiece always drops control tokens: decode the runs between them, keep their pieces
        parts, run = [], []
        for i in ids:
            if self._sp.is_control(i):
                parts += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join([*parts, self._sp.decode(run)])


class MistralTokenizer(_Base):
    """Mistral's own formats (``tokenizer.model.v1..v7`` sentencepiece, ``tekken.json``) through
    ``mistral-common``, which owns their control-token handling; BOS is prepended as Mistral does."""

    def __init__(self, file: Path, chat_template: ChatTemplate | None, extra_eos: Sequence[int]) -> None:
        try:
            from mistral_common.tokens.tokenizers.mistral import MistralTokenizer as _Mistral
        except ImportError:
            raise RuntimeError(f"{file} is a Mistral tokenizer: pip install mistral-common") from None
        self.source = str(file)
        self._tok = _Mistral.from_file(str(file)).instruct_tokenizer.tokenizer
        self.eos_token_ids = _merge_ids([self._tok.eos_id], extra_eos)
        self.chat_template = chat_template
        self.bos_token = self._tok.id_to_piece(self._tok.bos_id)

    def _encode_special(self, text: str) -> list[int]:
        return list(self._tok.encode(text, bos=True, eos=False))

    def _encode_from_bos(self, text: str) -> list[int]:
        # mistral-common reads control-token text as plain text: the BOS text is dropped, the BOS id added
        assert self.bos_token is not None
        return self._encode_special(text[len(self.bos_token):])

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._tok.encode(text, bos=False, eos=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        policy = SpecialTokenPolicy.IGNORE if skip_special_tokens else SpecialTokenPolicy.KEEP
        return self._tok.decode(list(ids), special_token_policy=policy)


class Llama4TiktokenTokenizer(_Base):
    """Meta's Llama-4 ``tokenizer.model`` (tiktoken BPE ranks) through ``llama-models``; BOS prepended,
    stop tokens end-of-text, end-of-message and end-of-turn."""

    def __init__(self, file: Path, chat_template: ChatTemplate | None, extra_eos: Sequence[int]) -> None:
        try:
            from llama_models.llama4.tokenizer import Tokenizer as _Llama4
        except ImportError:
            raise RuntimeError(f"{file} is a tiktoken (Llama-4) tokenizer: pip install llama-models "
                               f"tiktoken") from None
        self.source = str(file)
        self._tok = _Llama4(file)
        self.eos_token_ids = _merge_ids(self._tok.stop_tokens, extra_eos)
        self.chat_template = chat_template
        self._special = frozenset(self._tok.special_tokens.values())
        self.bos_token = next(t for t, i in self._tok.special_tokens.items() if i == self._tok.bos_id)

    def _encode_special(self, text: str) -> list[int]:
        return list(self._tok.encode(text, bos=True, eos=False))

    def _encode_from_bos(self, text: str) -> list[int]:
        return self._encode_plain(text)          # special-token text is read as the token here

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._tok.encode(text, bos=False, eos=False, allowed_special="all"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        return self._tok.decode([i for i in ids if i not in self._special] if skip_special_tokens else ids)


def is_tiktoken_file(file: Path) -> bool:
    """tiktoken rank files are text lines ``<base64 token> <rank>``; sentencepiece models are protobuf."""
    with open(file, "rb") as handle:
        first = handle.readline(4096).strip()
    parts = first.split()
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except ValueError:
        return False
    return True


def _mistral_files(directory: Path) -> list[Path]:
    """``tekken.json`` first (newest format), then ``tokenizer.model.v*`` newest version first."""
    tekken = [directory / "tekken.json"] if (directory / "tekken.json").is_file() else []
    versions = sorted(directory.glob("tokenizer.model.v*"), key=lambda p: p.name, reverse=True)
    return tekken + versions


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer shipped in checkpoint directory ``path``, or None when it ships none."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a checkpoint directory")
    config = _read_tokenizer_config(directory)
    template = _chat_template(directory, config)
    extra_eos = _generation_eos(directory)
    builders: list[tuple[Path, Callable[[Path], _Base]]] = []
    builders.append((directory / "tokenizer.json", lambda f: HFTokenizer(f, config, template, extra_eos)))
    builders += [(f, lambda f: MistralTokenizer(f, template, extra_eos)) for f in _mistral_files(directory)]
    builders.append((directory / "tokenizer.model",
                     lambda f: Llama4TiktokenTokenizer(f, template, extra_eos) if is_tiktoken_file(f)
                     else SentencePieceTokenizer(f, config, template, extra_eos)))
    for file, build in builders:
        if file.is_file():
            return build(file)
    return None
