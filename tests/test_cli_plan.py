"""``hybridkv plan``: the table, ``--json``, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _configs import GEMMA3_27B, LLAMA4_SCOUT

from hybridkv.cli import COMMANDS, layer_ranges, main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, config: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_plan_is_registered_beside_room_for_others() -> None:
    assert "plan" in COMMANDS and COMMANDS["plan"].name == "plan"


def test_layer_ranges() -> None:
    assert layer_ranges([f"layers.{i}" for i in (0, 1, 2, 4, 5, 6, 9)]) == "0-2,4-6,9"
    names = ["layers.0.parallel", "layers.1.parallel", "layers.3.shared"]
    assert layer_ranges(names) == "0-1 parallel,3 shared"


def test_table_shows_the_groups(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "plan", str(write(tmp_path, LLAMA4_SCOUT)), "--max-model-len", "131072",
                         "--kv-memory", "640GiB")
    assert code == 0 and err == ""
    assert "Llama4ForConditionalGeneration" in out
    rows = [line for line in out.splitlines() if "chunked_local(8192)" in line]
    assert len(rows) == 3 and "0-2, 4-6, 8-10, 12-14" in rows[0]
    assert any("3, 7, 11, 15" in line and "full" in line for line in out.splitlines())
    for text in ("384.75 MiB", "6.00 GiB", "padding bytes", "max concurrent requests", "ratio 3.42x"):
        assert text in out


def test_bundled_name_and_checkpoint_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    write(tmp_path, GEMMA3_27B)
    code, by_dir, _ = run(capsys, "plan", str(tmp_path), "--max-model-len", "32768", "--kv-memory", "640GiB",
                          "--json")
    assert code == 0
    code, by_name, _ = run(capsys, "plan", "gemma3-27b", "--max-model-len", "32768", "--kv-memory", "640GiB",
                           "--json")
    assert code == 0
    by_dir_report, by_name_report = json.loads(by_dir), json.loads(by_name)
    assert by_dir_report.pop("model") != by_name_report.pop("model")
    assert by_dir_report == by_name_report


def test_json_is_one_object_with_the_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "gemma3-27b", "--max-model-len", "32768", "--kv-memory", "640GiB",
                         "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    for key in ("groups", "bytes_per_request_max", "bytes_per_request_if_all_full_attention", "padding_bytes",
                "max_concurrent_requests", "architecture", "model"):
        assert key in report
    assert report["architecture"] == "Gemma3ForConditionalGeneration" and report["model"] == "gemma3-27b"
    for group in report["groups"]:
        assert {"kind", "layers", "block_size", "bytes_per_request_max"} <= set(group)
        assert ("num_blocks" in group) or ("num_slots" in group)
    ratio = report["max_concurrent_requests"] / report["max_concurrent_requests_if_all_full_attention"]
    assert ratio >= 4.5


def test_json_for_a_mamba_hybrid_has_slots(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "nemotron-h-8b", "--kv-memory", "80GiB", "--json",
                       "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--kv-dtype", "float16")
    report = json.loads(out)
    assert code == 0 and report["max_concurrent_requests"] == 64 and report["padding_bytes"] == 0
    assert {g["kind"] for g in report["groups"]} == {"mamba", "full"}
    assert any("num_slots" in g for g in report["groups"]) and report["step_tokens"] == 4096


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "{tmp}/missing.json"], "no such file or directory"),
    (["plan", "{tmp}/bad.json"], "not valid JSON"),
    (["plan", "{tmp}/llama.json"], "unsupported architecture LlamaForCausalLM"),
    (["plan", "mistral-7b-v0.1", "--kv-memory", "100MiB"], "too small for one request"),
    (["plan", "mistral-7b-v0.1", "--kv-memory", "lots"], "cannot parse a byte size"),
    (["plan", "llama4-scout", "--block-size", "24"], "not a multiple of block_size=24"),
    (["plan", "mistral-7b-v0.1", "--kv-dtype", "int8"], "unknown KV dtype"),
    (["plan", "mistral-7b-v0.1", "--max-model-len", "-3"], "expected a positive integer"),
    (["plan"], "required: CONFIG_OR_DIR"),
    (["plan", "mistral-7b-v0.1", "--bogus"], "unrecognized arguments: --bogus"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          argv: list[str], message: str) -> None:
    write(tmp_path, "{not json", "bad.json")
    write(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "llama.json")
    code, out, err = run(capsys, *(arg.format(tmp=tmp_path) for arg in argv))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_kv_sharing_layers_and_their_savings(capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma-4-E4B: each group lists the KV-sharing layers that read it; the budget shows what they save."""
    code, out, err = run(capsys, "plan", "gemma4-e4b", "--max-model-len", "32768", "--kv-memory", "16GiB")
    assert code == 0 and err == ""
    assert any("19-22 (+ 24-28, 30-34, 36-40 read)" in line for line in out.splitlines())
    assert any("17, 23 (+ 29, 35, 41 read)" in line for line in out.splitlines())
    assert "18 (no cache of their own: 399.47 MiB per request saved)" in out and "(2-4 layers x 16 tokens)" in out
    code, out, _ = run(capsys, "plan", "gemma4-e4b", "--max-model-len", "32768", "--kv-memory", "16GiB", "--json")
    report = json.loads(out)
    assert report["kv_shared_layers"] == 18 and report["padding_bytes"] == 0
    assert report["kv_shared_bytes_per_request"] == (15 * 33 * 16 * 2 * 2 * 256 * 2 + 3 * 32768 * 2 * 2 * 512 * 2)
    readers = {r: d for g in report["groups"] for r, d in g.get("kv_shared_layers", {}).items()}
    assert readers == {f"layers.{i}": f"layers.{23 if (i + 1) % 6 == 0 else 22}" for i in range(24, 42)}
