"""The tokenizer a checkpoint ships, behind one small interface (``encode``, ``decode``,
``eos_token_ids``, ``apply_chat_template``).

Sources, in the order HF itself prefers them: ``tokenizer.json`` (HF tokenizers); Mistral's
``tekken.json`` / ``tokenizer.model.v*`` (through ``mistral-common``); ``tokenizer.model`` as a
sentencepiece model, or as Llama-4's tiktoken ranks file (through ``llama-models``). A checkpoint with
none of them has no tokenizer (``load_tokenizer`` returns None): token-id prompts still run. A source
that needs a package not installed is an error naming the package, never a silent fallback that
would tokenize differently.
"""

from __future__ import annotations

import base64
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
               **kwargs: Any) -> str:
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise RuntimeError("rendering a chat template needs jinja2 (pip install jinja2)") from None

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env.from_string(self.source).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs})


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
    """Shared ``apply_chat_template``: render the template, then encode without special tokens (the
    template writes them itself)."""

    eos_token_ids: tuple[int, ...] = ()
    chat_template: ChatTemplate | None = None
    source: str = ""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

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

    def __init__(self, file: Path, config: Mapping[str, Any], chat_template: ChatTemplate | None,
                 extra_eos: Sequence[int]) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.source = str(file)
        self._tok = _Tokenizer.from_file(str(file))
        eos_text = _token_text(config.get("eos_token"))
        eos = self._tok.token_to_id(eos_text) if eos_text else None
        self.eos_token_ids = _merge_ids([eos], extra_eos)
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def _encode_plain(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


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

    def encode(self, text: str) -> list[int]:
        ids = self._encode_plain(text)
        return ([self._bos] if self._bos is not None else []) + ids + ([self._eos] if self._add_eos else [])

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


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

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, bos=True, eos=False))

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._tok.encode(text, bos=False, eos=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


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

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, bos=True, eos=False))

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._tok.encode(text, bos=False, eos=False, allowed_special="all"))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


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
