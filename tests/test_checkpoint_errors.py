"""Bad checkpoints are clear errors before anything is allocated, each one line naming the file or tensor.

A tiny HF Mistral checkpoint (``save_pretrained``) and a native one (``save_model``) are damaged one way per
case: a NaN or inf weight (and a finite one that overflows the load dtype) is named at load; a config whose
model could not fit (``hidden_size=10**9``) or is absurd (``num_hidden_layers=10**6``) is refused in well under
two seconds without building anything; a truncated file, a garbage header, bad data offsets and an index naming
files outside the checkpoint (absolute, ``..``, a symlink leading out) are ``CheckpointError``s naming the file,
while a Hugging Face cache snapshot (files symlinked into its ``blobs/``) loads. The CLI side of each case is in
``test_cli_errors.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import _hf_models as hf_models
import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv import LLM
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.loaders.weights import checkpoint_files
from hybridkv.models import memory
from hybridkv.models.hybrid import build_model, load_model, save_model
from hybridkv.models.safetensors_file import CheckpointError, read_header
from tests.test_engine import tiny_config

WEIGHT = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_models.save(hf_models.mistral(0), tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = hf_models.save(hf_models.mistral(0), tmp_path_factory.mktemp("sharded"), max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


def copy_of(checkpoint: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / name))


def edit_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def rewrite_header(file: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite a safetensors file's JSON header (same data bytes after it)."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def assert_one_line(err: BaseException, *needles: str) -> None:
    message = str(err)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


# -- non-finite weights ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_weight_is_named_at_load(bad: float, hf_checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(hf_checkpoint, tmp_path)

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors[WEIGHT][3, 5] = bad

    edit_tensors(directory, poison)
    with pytest.raises(ValueError, match="holds NaN or inf") as err:
        load_hf_checkpoint(directory, dtype=torch.float32)
    assert_one_line(err.value, str(directory / "model.safetensors"), WEIGHT, "layers.1.ffn.down_proj.weight")
    with pytest.raises(ValueError, match=WEIGHT):              # LLM loads the same way (no garbage tokens later)
        LLM(directory, device="cpu", kv_cache_memory=1 << 22)


def test_a_weight_that_overflows_the_load_dtype_is_named(hf_checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(hf_checkpoint, tmp_path)

    def big(tensors: dict[str, torch.Tensor]) -> None:
        tensors[WEIGHT][0, 0] = 1e6                                # finite in fp32, inf in fp16

    edit_tensors(directory, big)
    load_hf_checkpoint(directory, dtype=torch.float32)            # fine as stored
    with pytest.raises(ValueError, match=r"after conversion to float16 \(\|value\| up to 1e\+06 overflows it\)"):
        load_hf_checkpoint(directory, dtype=torch.float16)


def test_native_checkpoint_nan_is_named(tmp_path: Path) -> None:
    save_model(build_model(tiny_config(), seed=1), tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    name = sorted(n for n in tensors if n.endswith("q_proj.weight"))[0]
    tensors[name][0, 1] = float("nan")
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="holds NaN or inf") as err:
        load_model(tmp_path)
    assert_one_line(err.value, str(file), name)


def test_finite_check_agrees_with_isfinite() -> None:
    from hybridkv.models.hybrid import all_finite

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t = torch.randn(64, 33, generator=gen).to(dtype)
        assert all_finite(t) and all_finite(t[:, ::2]) and all_finite(t[:0])
        for value in (float("nan"), float("inf"), -float("inf")):
            for at in ((0, 0), (63, 32), (17, 4)):
                bad = t.clone()
                bad[at] = value
                assert not all_finite(bad) and not all_finite(bad.t())
    assert all_finite(torch.arange(5))                             # integers are always finite


# -- configs that could not be built ------------------------------------------------------------------------
_HUGE = {"hidden_size": {"hidden_size": 10**9}, "num_hidden_layers": {"num_hidden_layers": 10**6},
         "intermediate_size": {"intermediate_size": 10**9}, "vocab_size": {"vocab_size": 2**31 - 1}}

_PROBE = """
import json, resource, sys, time
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv import LLM
out = {}
for name, path in json.loads(sys.argv[1]).items():
    start = time.monotonic()
    try:
        (LLM(path, device="cpu") if name.startswith("llm") else load_hf_checkpoint(path))
        error = None
    except (ValueError, MemoryError) as err:
        error = f"{type(err).__name__}: {err}"
    out[name] = {"s": time.monotonic() - start, "error": error,
                 "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
print(json.dumps(out))
"""


@pytest.mark.slow          # ~3 s: a fresh interpreter per config
def test_huge_configs_are_refused_before_anything_is_built(hf_checkpoint: Path, tmp_path: Path) -> None:
    """In a fresh process (so its peak RSS is this test's): each refused in well under 2 s, the process never
    grows past what importing torch and hybridkv takes."""
    cases = {}
    for name, change in _HUGE.items():
        directory = tmp_path / name
        directory.mkdir()
        shutil.copy(hf_checkpoint / "model.safetensors", directory)
        config = json.loads((hf_checkpoint / "config.json").read_text()) | change
        (directory / "config.json").write_text(json.dumps(config))
        cases[name] = str(directory)
    cases["llm_hidden_size"] = cases["hidden_size"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    baseline = max(r["rss_mb"] for r in result.values()) - min(r["rss_mb"] for r in result.values())
    assert baseline < 100, result                                  # no case grew the process
    for name, r in result.items():
        assert r["error"] is not None and r["s"] < 2.0, (name, r)
        assert "\n" not in r["error"]
    assert "num_hidden_layers=1000000 is out of range (1 to 1024)" in result["num_hidden_layers"]["error"]
    for name in ("hidden_size", "intermediate_size", "vocab_size", "llm_hidden_size"):
        path = cases[name.removeprefix("llm_")]
        assert result[name]["error"].startswith(f"MemoryError: {path}: the model needs at least"), result[name]


def test_model_too_large_for_the_device_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 16)
    with pytest.raises(MemoryError, match=r"needs at least .* for its parameters \(float32\), more than the "
                                          r"64\.00 KiB available on cpu"):
        build_model(tiny_config())


def test_lower_bound_never_exceeds_the_parameter_count() -> None:
    """``parameter_lower_bound`` (from the config alone) against the meta model's exact count, for every
    bundled config and test mix, at tp 1 and 2: below it, and within 15% of it."""
    from _tp_helpers import MIXES

    from hybridkv.layers.parallel import TensorParallel
    from hybridkv.models.hybrid import meta_model, parameter_count
    from hybridkv.planning import bundled_config_names, load_model_config

    configs = {name: load_model_config(name) for name in bundled_config_names()} | {
        name: make() for name, make in MIXES.items()}
    for name, config in configs.items():
        for tp in (1, 2):
            try:
                config.check_tensor_parallel(tp)
            except ValueError:
                continue
            exact = parameter_count(meta_model(config, torch.bfloat16, tp=TensorParallel(rank=0, size=tp)))
            bound = memory.parameter_lower_bound(config, tp)
            assert 0.85 * exact <= bound <= exact, (name, tp, bound, exact)


def test_a_config_that_disagrees_with_the_tensors_is_found_before_allocating(
        hf_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shapes come from the headers and the meta model: the real model is never built, no tensor read."""
    import hybridkv.loaders.checkpoint as checkpoint_module
    from hybridkv.models.safetensors_file import TensorReader

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("allocated or read before the checks")

    directory = copy_of(hf_checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] += 8
    (directory / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(checkpoint_module, "empty_model", never)
    monkeypatch.setattr(TensorReader, "get", never)
    with pytest.raises(ValueError, match=r"model\.safetensors: checkpoint tensor model\.layers\.\d\.mlp\.\w+_proj"
                                         r"\.weight has shape \(\d+, \d+\); layers\.\d\.ffn\.\w+_proj\.weight "
                                         r"expects"):
        load_hf_checkpoint(directory)


# -- corrupt safetensors files ------------------------------------------------------------------------------
def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _garbage(file: Path) -> None:
    file.write_bytes(os.urandom(4096))


def _tiny_file(file: Path) -> None:
    file.write_bytes(b"\x01\x02")


def _header_not_json(file: Path) -> None:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    file.write_bytes(raw[:8] + b"{" + b"x" * (n - 1) + raw[8 + n:])


def _shift(name: str, delta: int) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [start + delta, end + delta]
    return edit


def _wrong_size(header: dict) -> None:
    header[WEIGHT]["shape"] = [header[WEIGHT]["shape"][0], header[WEIGHT]["shape"][1] + 1]


def _unknown_dtype(header: dict) -> None:
    header[WEIGHT]["dtype"] = "F4"


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (_truncate, "truncated"),
    "garbage": (_garbage, "not a safetensors file"),
    "shorter than a header": (_tiny_file, "truncated: 2 bytes"),
    "header not json": (_header_not_json, "its header is not JSON"),
    "overlapping offsets": (lambda f: rewrite_header(f, _shift(WEIGHT, -4)), "overlaps the tensor before it"),
    "offsets with a gap": (lambda f: rewrite_header(f, _shift(WEIGHT, 4)), "gap"),
    "offsets that disagree with the shape": (lambda f: rewrite_header(f, _wrong_size), "bytes) for shape"),
    "unknown dtype": (lambda f: rewrite_header(f, _unknown_dtype), "dtype 'F4', which is not supported"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_file_is_one_error_naming_it(case: str, hf_checkpoint: Path, tmp_path: Path) -> None:
    corrupt, message = CORRUPTIONS[case]
    directory = copy_of(hf_checkpoint, tmp_path)
    file = directory / "model.safetensors"
    corrupt(file)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(directory)
    assert_one_line(err.value, str(file), message)


def test_read_header_accepts_what_safetensors_writes(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16), "empty": torch.zeros(0, 5),
               "i": torch.arange(7)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    header = read_header(tmp_path / "x.safetensors")
    assert {n: (h.dtype, h.shape) for n, h in header.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}


def test_native_checkpoint_truncated_or_mismatched(tmp_path: Path) -> None:
    save_model(build_model(tiny_config(), seed=1), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hybridkv_config"]["hidden_size"] *= 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="embed_tokens.weight has shape .* the config gives"):
        load_model(tmp_path)
    _truncate(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(tmp_path)


# -- an index naming files outside the checkpoint -----------------------------------------------------------
def _point_first_shard(directory: Path, target: str) -> None:
    index = directory / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = target
    index.write_text(json.dumps(data))


@pytest.mark.parametrize(("target", "message"), [
    ("/etc/passwd", "is an absolute path"),
    ("../outside.safetensors", "leads out of the checkpoint directory ('..')"),
    ("sub/../../outside.safetensors", "leads out of the checkpoint directory ('..')"),
    ("link.safetensors", "outside the checkpoint directory"),
])
def test_index_entries_outside_the_checkpoint_are_refused(target: str, message: str, sharded_checkpoint: Path,
                                                          tmp_path: Path) -> None:
    directory = copy_of(sharded_checkpoint, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(next(directory.glob("model-0*.safetensors")), outside)
    (directory / "link.safetensors").symlink_to(outside)
    _point_first_shard(directory, target)
    with pytest.raises(CheckpointError) as err:
        checkpoint_files(directory)
    assert_one_line(err.value, str(directory / "model.safetensors.index.json"), message)
    with pytest.raises(CheckpointError):
        load_hf_checkpoint(directory)


def test_a_symlinked_single_file_leading_out_is_refused(hf_checkpoint: Path, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shutil.copy(hf_checkpoint / "config.json", directory)
    (directory / "model.safetensors").symlink_to(hf_checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_hf_checkpoint(directory)


def test_symlinks_inside_the_checkpoint_and_a_hub_cache_snapshot_load(sharded_checkpoint: Path,
                                                                     tmp_path: Path) -> None:
    """The hub cache keeps ``<repo>/snapshots/<rev>/<file>`` as symlinks to ``<repo>/blobs/<hash>``."""
    want = load_hf_checkpoint(sharded_checkpoint, dtype=torch.float32).state_dict()
    repo = tmp_path / "models--tiny--mistral"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(sharded_checkpoint.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    got = load_hf_checkpoint(snapshot, dtype=torch.float32).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
