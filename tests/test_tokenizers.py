"""Every tokenizer source a checkpoint may ship, each round-tripping text: HF ``tokenizer.json`` (BPE and
WordLevel, built here; checked against transformers' own tokenizer), a sentencepiece model trained
here, Mistral's v3 sentencepiece and Tekken files and Meta's Llama-4 tiktoken file (shipped by the
``mistral-common`` / ``llama-models`` packages; skipped when they are not installed), chat templates,
and a checkpoint without a tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hybridkv.loaders.tokenizer import (
    HFTokenizer,
    Llama4TiktokenTokenizer,
    MistralTokenizer,
    SentencePieceTokenizer,
    is_tiktoken_file,
    load_tokenizer,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hybrid models mix sliding-window, chunked and full attention with Mamba layers.",
    "A paged KV cache stores keys and values in fixed-size blocks; 1234 tokens, 5678 requests!",
    "def add(a, b):\n    return a + b\n",
    "Sphinx of black quartz, judge my vow. Pack my box with five dozen liquor jugs.",
] * 4
TEXTS = ["The lazy fox mixes attention with Mamba.", "def add(a, b):\n    return a + b", "1234 blocks; 5678!"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _bpe_dir(directory: Path, *, template_file: bool = False) -> Path:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}, "pad_token": "<pad>"}
    if template_file:
        (directory / "chat_template.jinja").write_text(TEMPLATE)
    else:
        config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return directory


def test_hf_bpe_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    directory = _bpe_dir(tmp_path)
    ours = load_tokenizer(directory)
    ref = AutoTokenizer.from_pretrained(str(directory))
    assert isinstance(ours, HFTokenizer)
    assert ours.eos_token_ids == (1, 2)                  # tokenizer's eos, then generation_config's
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"] and ids[0] == 0
        assert ours.decode(ids) == text
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s><|system|>Be brief.</s><|user|>Hi there</s><|assistant|>"
    ids = ours.apply_chat_template(MESSAGES, tokenize=True)
    assert ids.count(0) == 1 and ours.decode(ids) == "<|system|>Be brief.<|user|>Hi there<|assistant|>"


def test_chat_template_file_and_missing_template(tmp_path: Path) -> None:
    ours = load_tokenizer(_bpe_dir(tmp_path / "file", template_file=True))
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("Hi there</s>")
    plain = _bpe_dir(tmp_path / "none")
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(plain).apply_chat_template(MESSAGES)


def _wordlevel_dir(directory: Path) -> Path:
    words = sorted({w for line in CORPUS + TEXTS for w in line.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")          # joins words with single spaces
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return directory


def test_hf_wordlevel_tokenizer(tmp_path: Path) -> None:
    ours = load_tokenizer(_wordlevel_dir(tmp_path))
    assert ours.eos_token_ids == (1,)
    for text in TEXTS:
        normalized = " ".join(text.split())
        assert ours.decode(ours.encode(text)) == normalized
    assert ours.encode("unknown words") == [0, 0]


def test_sentencepiece_model_trained_here(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=400, model_type="bpe", hard_vocab_limit=False,
                                   byte_fallback=True, minloglevel=2, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)
    (tmp_path / "sp.model").rename(tmp_path / "tokenizer.model")
    assert not is_tiktoken_file(tmp_path / "tokenizer.model")
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, SentencePieceTokenizer)
    proc = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert ours.eos_token_ids == (proc.eos_id(),)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == proc.bos_id() and ids[1:] == proc.encode(text)
        assert ours.decode(ids) == text
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False,
                                                                 "add_eos_token": True}))
    ids = load_tokenizer(tmp_path).encode(TEXTS[0])
    assert ids[0] != proc.bos_id() and ids[-1] == proc.eos_id()


def _package_file(package: str, relative: str) -> Path:
    module = pytest.importorskip(package, reason=f"{package} is not installed (pip install "
                                                  f"{package.replace('_', '-')}): its shipped tokenizer files "
                                                  f"are the only real ones available offline")
    file = Path(module.__file__).parent / relative
    if not file.is_file():
        pytest.skip(f"{package} does not ship {relative}")
    return file


@pytest.mark.parametrize(("shipped", "name"), [
    ("data/mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3"),   # Mamba-Codestral's
    ("data/tekken_240911.json", "tekken.json"),
])
def test_mistral_common_tokenizers(shipped: str, name: str, tmp_path: Path) -> None:
    shutil.copy(_package_file("mistral_common", shipped), tmp_path / name)
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, MistralTokenizer)
    assert 2 in ours.eos_token_ids
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == 1 and ours.decode(ids) == text
    if name == "tokenizer.model.v3":     # the same file read as a plain sentencepiece model agrees
        (tmp_path / "sp").mkdir()
        shutil.copy(tmp_path / name, tmp_path / "sp" / "tokenizer.model")
        plain = load_tokenizer(tmp_path / "sp")
        assert isinstance(plain, SentencePieceTokenizer)
        assert all(plain.encode(text) == ours.encode(text) for text in TEXTS)


def test_llama4_tiktoken_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken", reason="tiktoken is not installed (needed by llama-models)")
    shutil.copy(_package_file("llama_models", "llama4/tokenizer.model"), tmp_path / "tokenizer.model")
    assert is_tiktoken_file(tmp_path / "tokenizer.model")
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, Llama4TiktokenTokenizer)
    assert ours.eos_token_ids == (200001, 200007, 200008)   # end_of_text, eom, eot (Scout's config)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == 200000 and ours.decode(ids[1:]) == text


def test_no_tokenizer_is_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_text_prompts_through_llm(tmp_path: Path) -> None:
    """A checkpoint that ships a tokenizer takes text prompts; the output text is the decoded ids."""
    import _hf_models as hf_models

    from hybridkv import LLM, SamplingParams

    hf = hf_models.mistral(0)
    hf_models.save(hf, tmp_path)
    tok = load_tokenizer(_wordlevel_dir(tmp_path))           # ids below the tiny model's vocab
    text = "The lazy fox jumps"
    ids = tok.encode(text)
    assert max(ids) < hf_models.VOCAB
    llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=8, dtype="float32", device="cpu",
              kv_cache_memory="4MiB")
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == tuple(ids)
    assert list(out.outputs[0].token_ids) == hf_models.hf_greedy(hf, ids, 6)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def _tokenizer_of(kind: str, tmp_path: Path):
    """One tokenizer of each source, built or copied into ``tmp_path``."""
    if kind == "hf":
        return load_tokenizer(_bpe_dir(tmp_path))
    if kind == "sentencepiece":
        spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
        spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(tmp_path / "sp"),
                                       vocab_size=400, model_type="bpe", hard_vocab_limit=False, byte_fallback=True,
                                       minloglevel=2, normalization_rule_name="identity",
                                       remove_extra_whitespaces=False)
        (tmp_path / "sp.model").rename(tmp_path / "tokenizer.model")
    elif kind == "mistral":
        shutil.copy(_package_file("mistral_common", "data/tekken_240911.json"), tmp_path / "tekken.json")
    else:
        pytest.importorskip("tiktoken", reason="tiktoken is not installed (needed by llama-models)")
        shutil.copy(_package_file("llama_models", "llama4/tokenizer.model"), tmp_path / "tokenizer.model")
    return load_tokenizer(tmp_path)


@pytest.mark.parametrize("kind", ["hf", "sentencepiece", "mistral", "llama4"])
def test_bos_exactly_once(kind: str, tmp_path: Path) -> None:
    """A text that already starts with the BOS token's text (a rendered chat template) gets no second BOS;
    special tokens stay in the decoded text only when asked."""
    tok = _tokenizer_of(kind, tmp_path)
    assert tok.bos_token
    plain = tok.encode(TEXTS[0])
    bos = plain[0]
    with_text = tok.encode(tok.bos_token + TEXTS[0])
    assert with_text == plain and with_text.count(bos) == 1
    assert tok.encode(TEXTS[0], add_special_tokens=False) == plain[1:]
    assert tok.decode(plain) == TEXTS[0]
    kept = tok.decode(plain, skip_special_tokens=False)
    assert kept.startswith(tok.bos_token) and kept != tok.decode(plain)


@pytest.mark.parametrize("kind", ["hf", "sentencepiece", "mistral", "llama4"])
def test_encode_batch_is_encode_of_each_text(kind: str, tmp_path: Path) -> None:
    """``encode_batch`` (what the server tokenizes with, off its event loop where the tokenizer releases the
    GIL) gives ``encode``'s ids for every text, with a BOS text or without, with special tokens or without."""
    tok = _tokenizer_of(kind, tmp_path)
    texts = [*TEXTS, tok.bos_token + TEXTS[0], "", tok.bos_token]
    for special in (True, False):
        assert tok.encode_batch(texts, add_special_tokens=special) == \
            [tok.encode(t, add_special_tokens=special) for t in texts]
    assert tok.encode_batch([]) == []
    assert tok.releases_gil is (kind == "hf")


@pytest.mark.parametrize("setting", ["padding", "truncation"])
def test_padding_or_truncation_in_tokenizer_json_changes_no_prompt(setting: str, tmp_path: Path) -> None:
    """Prompts are never padded or cut, one at a time or in a batch, whatever ``tokenizer.json`` asks for (as
    ``AutoTokenizer``, which pads and truncates only when told)."""
    directory = _bpe_dir(tmp_path)
    plain = load_tokenizer(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    if setting == "padding":
        tok.enable_padding(pad_id=2, pad_token="<pad>", length=None)      # BatchLongest
    else:
        tok.enable_truncation(max_length=4)
    tok.save(str(directory / "tokenizer.json"))
    changed = load_tokenizer(directory)
    assert changed.encode_batch(TEXTS) == [plain.encode(t) for t in TEXTS] == [changed.encode(t) for t in TEXTS]
    assert all(len(ids) > 4 for ids in changed.encode_batch(TEXTS))


def test_a_chat_template_is_compiled_once_and_errors_still_raise() -> None:
    from jinja2.exceptions import TemplateError

    from hybridkv.loaders.tokenizer import ChatTemplate, _compiled

    source = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}{{ when }}")
    template = ChatTemplate(source=source, special_tokens={"eos_token": "</s>"})
    before = _compiled.cache_info()
    for i in range(3):
        text = template.render([{"role": "user", "content": f"hi {i}"}], when=i)
        assert text == f"[user]hi {i}</s>[assistant]{i}"
    after = _compiled.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 2
    with pytest.raises(TemplateError, match="no system"):
        ChatTemplate(source="{{ raise_exception('no system') }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate(source="{% if %}").render([])
