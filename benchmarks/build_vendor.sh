#!/usr/bin/env bash
# Build vendor wheels (mamba-ssm, causal-conv1d, flash-attn) from the sdists in .whl_src/ (offline, one GPU arch)
# and install them into a private site dir. Meant for the GPU machine (no network; torch 2.11+cu130, nvcc 13, ninja):
#
#   bash benchmarks/build_vendor.sh start     # detached (setsid): returns at once, other GPU work can run
#   bash benchmarks/build_vendor.sh status    # RUNNING / DONE / FAILED + the log tail
#   bash benchmarks/build_vendor.sh wait 540  # block until done (at most N seconds), then status
#   bash benchmarks/build_vendor.sh run       # the build itself, in the foreground
#   PYTHONPATH=/tmp/site python benchmarks/gpu_vendor.py      # then use them
#
# The sdists come from `pip download --no-deps --no-binary :all: --no-build-isolation mamba-ssm==2.3.2.post1
# causal-conv1d==1.7.0 flash-attn==2.8.3` (with MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE
# FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE for the metadata step).
# Each setup.py is patched in a scratch copy: its -gencode list is replaced by one arch (9.0 = H100/H200: the
# full list compiles ~8 archs), and bdist_wheel comes from setuptools when the `wheel` package is absent.
# *_FORCE_BUILD=TRUE stops setup.py from trying to download a prebuilt wheel from GitHub (it would hang
# offline). The packages build in parallel (mamba-ssm + causal-conv1d ~7-8 min on 16 cores).
#
# flash-attn's full build (~50 min for one arch) is cut down to what our adapter needs: paged KV always runs
# FA2's split-KV forward (`run_mha_fwd(params, stream, /*force_split_kernel=*/paged_KV)`), so only the bf16
# forward kernels (split-KV and plain) of FLASH_ATTN_HDIMS (default "64 128 256": our models' head dims; FA2 runs
# a head dim on the next of 32 64 96 128 192 256) compile from their real sources; every other kernel file (fp16,
# other head dims, backward) becomes a stub that throws "flash-attn reduced build ...: <file> was not compiled",
# and backward, dropout and ALiBi are compiled out with flash-attn's own -DFLASHATTENTION_DISABLE_* switches (its
# API then refuses them with its own errors). The kernels that do run are flash-attn's unmodified code.
# MAX_JOBS applies to each package: building flash-attn beside the others, lower it (its nvcc jobs take GBs).
#
# Env overrides: VENDOR_PACKAGES ("mamba_ssm causal_conv1d"; add or pick flash_attn), FLASH_ATTN_HDIMS,
# VENDOR_SRC, VENDOR_WORK (/tmp/vendor_build), VENDOR_SITE (/tmp/site), TORCH_CUDA_ARCH_LIST (9.0), MAX_JOBS (16),
# PYTHON (python).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC=${VENDOR_SRC:-$ROOT/.whl_src}
WORK=${VENDOR_WORK:-/tmp/vendor_build}
SITE=${VENDOR_SITE:-/tmp/site}
ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
SM=${ARCH_LIST//./}
JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python}
PACKAGES=${VENDOR_PACKAGES:-mamba_ssm causal_conv1d}
FA_HDIMS=${FLASH_ATTN_HDIMS:-64 128 256}
SELF="${BASH_SOURCE[0]}"

patch_setup() {  # $1 setup.py
  "$PY" - "$1" "$SM" <<'PYEOF'
import sys

path, sm = sys.argv[1], sys.argv[2]
src = open(path).read()
anchor = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI"
if anchor not in src:
    sys.exit(f"{path}: anchor not found, cannot pin the arch list (setup.py changed?)")
pin = f'    cc_flag = ["-gencode", "arch=compute_{sm},code=sm_{sm}"]  # hybridkv build_vendor.sh: one arch\n'
src = src.replace(anchor, pin + anchor, 1)
old = "from wheel.bdist_wheel import bdist_wheel as _bdist_wheel"
new = ("try:\n    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel\n"
       "except ImportError:\n    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel")
src = src.replace(old, new, 1)
open(path, "w").write(src)
PYEOF
}

reduce_flash_attn() {  # $1 unpacked flash-attn sdist: keep the bf16 forward kernels of FA_HDIMS, stub the rest
  "$PY" - "$1" "$FA_HDIMS" <<'PYEOF'
import pathlib
import re
import sys

root, hdims = pathlib.Path(sys.argv[1]), sys.argv[2].split()
bad = [h for h in hdims if h not in ("32", "64", "96", "128", "192", "256")]
if bad or not hdims:
    sys.exit(f"FLASH_ATTN_HDIMS {sys.argv[2]!r}: each must be one of flash-attn's kernel head dims 32 64 96 128 192 256")
setup = root / "setup.py"
src = setup.read_text()
anchor = '    "--use_fast_math",\n'
if anchor not in src:
    sys.exit(f"{setup}: nvcc flag anchor not found (setup.py changed?)")
flags = "".join(f'    "-DFLASHATTENTION_DISABLE_{x}",\n' for x in ("BACKWARD", "DROPOUT", "ALIBI"))
setup.write_text(src.replace(anchor, anchor + flags, 1))

keep = re.compile(r"flash_fwd_(split_)?hdim(%s)_bf16(_causal)?_sm80\.cu$" % "|".join(hdims))
decl = re.compile(r"template(?:<>)?\s+void (run_mha_\w+<[^>]*>)\((Flash_\w+_params) &params, cudaStream_t stream\)")
kept, stubbed = [], 0
for cu in sorted((root / "csrc/flash_attn/src").glob("flash_*_sm80.cu")):
    if keep.search(cu.name):
        kept.append(cu.name)
        continue
    m = decl.search(cu.read_text())
    if m is None:
        sys.exit(f"{cu}: no run_mha_* instantiation found (generated file format changed?)")
    cu.write_text(
        "// hybridkv build_vendor.sh: reduced flash-attn build, this kernel is not compiled\n"
        '#include "namespace_config.h"\n#include "flash.h"\n#include <cutlass/numeric_types.h>\n'
        "#include <stdexcept>\n\nnamespace FLASH_NAMESPACE {\n\n"
        f"template<>\nvoid {m.group(1)}({m.group(2)} &params, cudaStream_t stream) {{\n"
        f'    throw std::runtime_error("flash-attn reduced build (hybridkv build_vendor.sh): {cu.stem} '
        'was not compiled");\n}\n\n}  // namespace FLASH_NAMESPACE\n')
    stubbed += 1
if len(kept) != 4 * len(hdims):
    sys.exit(f"{len(kept)} kernel files match head dims {hdims}, expected 4 each (file names changed?)")
print(f"flash-attn reduced build: compiling {len(kept)} kernel files ({', '.join(kept)}), {stubbed} stubbed")
PYEOF
}

build_one() {  # $1 sdist glob prefix, e.g. mamba_ssm
  local name=$1 sdist dir
  sdist=$(ls "$SRC"/"$name"-*.tar.gz 2>/dev/null | head -n 1 || true)
  [[ -n "$sdist" ]] || { echo "[$name] no sdist $SRC/$name-*.tar.gz"; return 1; }
  dir="$WORK/src/$name"
  rm -rf "$dir" && mkdir -p "$dir"
  tar -xzf "$sdist" -C "$dir" --strip-components=1
  patch_setup "$dir/setup.py"
  if [[ $name == flash_attn ]]; then reduce_flash_attn "$dir"; fi
  echo "[$name] building $(basename "$sdist") for sm_$SM with MAX_JOBS=$JOBS ($(date +%T))"
  local t0=$SECONDS
  if (cd "$dir" && MAX_JOBS=$JOBS TORCH_CUDA_ARCH_LIST=$ARCH_LIST MAMBA_FORCE_BUILD=TRUE \
        CAUSAL_CONV1D_FORCE_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE NVCC_THREADS=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$PY" -m pip wheel --no-build-isolation --no-deps -w "$WORK/wheels" . ) > "$WORK/$name.log" 2>&1; then
    echo "[$name] wheel built in $((SECONDS - t0)) s"
  else
    echo "[$name] FAILED after $((SECONDS - t0)) s; last lines of $WORK/$name.log:"
    tail -n 30 "$WORK/$name.log"
    return 1
  fi
}

import_check() {  # $1 package: a Python snippet importing the calls hybridkv's adapters use
  case $1 in
    mamba_ssm) echo "import mamba_ssm
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
from mamba_ssm.ops.triton.selective_state_update import selective_state_update
print('import ok: mamba_ssm', mamba_ssm.__version__)" ;;
    causal_conv1d) echo "import causal_conv1d
from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
print('import ok: causal_conv1d', causal_conv1d.__version__)" ;;
    flash_attn) echo "import flash_attn
from flash_attn import flash_attn_varlen_func
print('import ok: flash_attn', flash_attn.__version__)" ;;
    *) echo "raise SystemExit('unknown vendor package $1')" ;;
  esac
}

run() {
  mkdir -p "$WORK/wheels"
  echo RUNNING > "$WORK/status"
  trap 'echo FAILED > "$WORK/status"' ERR
  echo "torch: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'), nvcc: $(nvcc --version | tail -n 2 | head -n 1)"
  rm -f "$WORK"/wheels/*.whl
  local pids=() ok=0 name p
  for name in $PACKAGES; do build_one "$name" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p" || ok=1; done
  if [[ $ok -ne 0 ]]; then echo FAILED > "$WORK/status"; echo "build FAILED"; exit 1; fi
  mkdir -p "$SITE"
  PIP_NO_INDEX=1 "$PY" -m pip install --no-deps --no-index --upgrade --target "$SITE" "$WORK"/wheels/*.whl
  for name in $PACKAGES; do
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "$(import_check "$name")"
  done
  echo DONE > "$WORK/status"
  echo "installed into $SITE: use PYTHONPATH=$SITE"
}

status() {
  echo "status: $(cat "$WORK/status" 2>/dev/null || echo 'not started')"
  tail -n "${1:-15}" "$WORK/build.log" 2>/dev/null || true
}

case "${1:-start}" in
  run) run ;;
  start)
    # run a private copy of this script and of the sdists: a later re-sync of the work tree cannot change
    # what the detached build reads
    mkdir -p "$WORK/sdist"
    cp "$SELF" "$WORK/build_vendor.sh"
    cp "$SRC"/*.tar.gz "$WORK/sdist/"
    echo RUNNING > "$WORK/status"
    VENDOR_SRC="$WORK/sdist" VENDOR_WORK="$WORK" VENDOR_SITE="$SITE" \
      setsid nohup bash "$WORK/build_vendor.sh" run > "$WORK/build.log" 2>&1 < /dev/null &
    echo "started in the background (pid $!); log $WORK/build.log; check with: bash $0 status" ;;
  status) status "${2:-15}" ;;
  wait)
    limit=${2:-540}
    while [[ $(cat "$WORK/status" 2>/dev/null) == RUNNING && $SECONDS -lt $limit ]]; do sleep 5; done
    status 40 ;;
  *) echo "usage: $0 start|status|wait [seconds]|run" >&2; exit 2 ;;
esac
