"""The CLI never prints a traceback: every failure is exit code 2 and one line on stderr naming the cause
(``--debug`` adds the traceback); ``hybridkv --version`` names the versions. Run in-process (``main``)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import _hf_models as hf_models
import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv import __version__
from hybridkv.cli import EXIT_USAGE, main
from hybridkv.models import memory
from hybridkv.models.hybrid import build_model, save_model
from tests.test_engine import tiny_config

RUN = ["--prompt", "1,2,3", "--max-tokens", "2", "--device", "cpu", "--kv-memory", "4MiB"]


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("native")
    save_model(build_model(tiny_config(), seed=1), path)
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_models.save(hf_models.mistral(0), tmp_path_factory.mktemp("sharded"), max_shard_size="40KB")


def one_line_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    assert main(args) == EXIT_USAGE
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    assert captured.out == ""
    return err


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / "ckpt"))


def _edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["hybridkv_config"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _nan(directory: Path) -> str:
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    name = sorted(n for n in tensors if n.endswith("down_proj.weight"))[0]
    tensors[name].view(-1)[7] = float("nan")
    save_file(tensors, str(file))
    return name


def _truncate(directory: Path) -> str:
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    return "truncated"


def _bad_offsets(directory: Path) -> str:
    file = directory / "model.safetensors"
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = sorted(k for k in header if k != "__metadata__")[1]
    header[name]["data_offsets"][0] += 8
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return "data_offsets"


def _garbage_config(directory: Path) -> str:
    (directory / "config.json").write_text("{ not json")
    return "config.json is not valid JSON"


def _string_size(directory: Path) -> str:
    _edit_config(directory, hidden_size="64")
    return "HybridConfig.hidden_size must be an integer, got '64' (str)"


def _huge_hidden(directory: Path) -> str:
    _edit_config(directory, hidden_size=10**9)
    return "needs at least"


def _many_layers(directory: Path) -> str:
    config = json.loads((directory / "config.json").read_text())
    config["hybridkv_config"]["layers"] *= 3000
    (directory / "config.json").write_text(json.dumps(config))
    return "layers is more than the 1024 supported"


NATIVE_CASES = {"nan weight": _nan, "truncated file": _truncate, "bad offsets": _bad_offsets,
                "config not json": _garbage_config, "config field of the wrong type": _string_size,
                "huge hidden_size": _huge_hidden, "10**6 layers": _many_layers}


@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_a_bad_checkpoint_is_one_line(case: str, native: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    directory = _copy(native, tmp_path)
    needle = NATIVE_CASES[case](directory)
    err = one_line_error(capsys, ["generate", "--model", str(directory), *RUN])
    assert err.startswith("hybridkv generate: error: ") and needle in err, err
    assert str(directory) in err, err


@pytest.mark.parametrize(("target", "needle"), [("/etc/passwd", "is an absolute path"),
                                                ("../x.safetensors", "leads out of the checkpoint directory")])
def test_an_index_naming_files_outside_is_one_line(target: str, needle: str, sharded: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    directory = _copy(sharded, tmp_path)
    index = directory / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = target
    index.write_text(json.dumps(data))
    err = one_line_error(capsys, ["generate", "--model", str(directory), *RUN])
    assert needle in err and str(index) in err, err


def test_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, ["generate", "--model", str(tmp_path / "nope"), *RUN])
    assert "not a checkpoint directory" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of asking for CUDA where there is none")
def test_device_cuda_without_cuda(native: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, ["generate", "--model", str(native), "--prompt", "1", "--device", "cuda"])
    assert "argument --device: device 'cuda' is not available" in err
    err = one_line_error(capsys, ["generate", "--model", str(native), "--prompt", "1", "--device", "gpu0"])
    assert "'gpu0' is not a device" in err


@pytest.mark.parametrize(("value", "needle"), [
    ("x", "expected auto, off or a CPU number, got 'x'"),
    ("-1", "expected auto, off or a CPU number"),
    ("100000", "engine_cpu 100000: not one of the CPUs this process may use")])
def test_serve_engine_cpu(value: str, needle: str, native: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, ["serve", str(native), "--engine-cpu", value])
    assert "argument --engine-cpu" in err and needle in err, err


@pytest.mark.parametrize("flag", ["--prefill-floor", "--prefill-spread"])
def test_serve_prefill_settings(flag: str, native: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, ["serve", str(native), flag, "0"])
    assert f"argument {flag}: expected a positive integer, got '0'" in err, err


def test_a_model_too_large_for_memory(native: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 4096)
    err = one_line_error(capsys, ["generate", "--model", str(native), *RUN])
    assert "for its parameters (float32), more than the 4.00 KiB available on cpu" in err


def test_an_unexpected_error_is_one_line_and_named_by_type(native: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import hybridkv.engine.llm as llm_module

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something\ninternal")

    monkeypatch.setattr(llm_module, "_load", broken)
    err = one_line_error(capsys, ["generate", "--model", str(native), *RUN])
    assert err == "hybridkv generate: error: RuntimeError: something internal"


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_adds_the_traceback(where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--model", str(tmp_path / "nope"), *RUN]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)")
    assert err.strip().splitlines()[-1].startswith("hybridkv generate: error: ")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hybridkv {__version__} (torch {torch.__version__}")
