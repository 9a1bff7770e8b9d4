"""`hybridkv demo` and `hybridkv generate` end to end (CPU, tiny models)."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.models.hybrid import build_model, save_model
from tests.test_engine import tiny_config


def test_demo_passes_its_reference_check(capsys):
    assert main(["demo", "--num-requests", "6", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "reference check: 6/6" in out
    assert "KV plan" in out and "per-group cache usage" in out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_model(build_model(tiny_config(), seed=1), path)
    return path


def test_generate_token_ids_json(checkpoint, capsys):
    args = ["generate", "--model", str(checkpoint), "--prompt", "5,6,7", "--prompt", "9, 9, 9, 9",
            "--max-tokens", "4", "--device", "cpu", "--kv-memory", "4MiB", "--json"]
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == [[5, 6, 7], [9, 9, 9, 9]]
    assert all(len(line["token_ids"]) <= 4 and line["error"] is None for line in lines)


def test_generate_reads_prompts_from_a_file(checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1,2,3\n\n4,5\n")
    assert main(["generate", "--model", str(checkpoint), "--prompts-file", str(prompts), "--max-tokens", "2",
                 "--device", "cpu", "--kv-memory", "4MiB"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt", "hello"], "no tokenizer"),
    ([], "give --prompt or --prompts-file"),
])
def test_generate_bad_input_is_one_line(checkpoint, capsys, args, message):
    assert main(["generate", "--model", str(checkpoint), "--device", "cpu", "--kv-memory", "4MiB", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_generate_missing_model_is_one_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "1"]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
