"""The engine process's own CPU: its step loop pinned to one CPU that the server's other processes keep off.

The step loop is one Python thread that prepares step N+1 while the GPU runs step N; at half the serving rate its
host work is most of a step. Sharing CPUs with the API processes, their tokenizer threads and the load's clients, it
is preempted and migrated now and then, and each time the steps in flight wait for it: on one H200 (16 CPUs, the
Gemma-3-like model of ``benchmarks/serve_trace.py`` at 325 req/s) the engine's p99 step interval was 4.7 ms with
``--engine-cpu off`` and 3.0 ms with the step loop alone on a CPU (``docs/design.md``, "The engine's step loop on a
CPU of its own").

``hybridkv serve --engine-cpu`` (``CoreJob.engine_cpu``; off unless asked for outside the CLI): ``auto`` (the
CLI's default) pins a CUDA engine's step loop when the server may use at least ``MIN_CPUS_TO_PIN`` CPUs (fewer, and
giving one away would starve the API processes), to the highest-numbered of them on the GPU's NUMA node (the PCI
device's ``local_cpulist``), else the highest-numbered; a CPU number pins to that one (any device); ``off`` leaves
every process where the OS puts it. The engine process keeps its other threads (socket readers, the CUDA driver's)
off that CPU, and the launcher and API processes keep off it once the engine says which it took (``keep_off``).
Tensor-parallel ranks' processes are not pinned. Linux only (``os.sched_setaffinity``); elsewhere nothing is pinned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Collection
from pathlib import Path

logger = logging.getLogger("hybridkv.engine")

MIN_CPUS_TO_PIN = 4
SETTINGS = ("auto", "off")


def check_setting(setting: str | int) -> str | int:
    """``setting`` if it is ``auto``, ``off`` or a CPU number (an int >= 0); else ``ValueError``."""
    if setting in SETTINGS or (isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0):
        return setting
    raise ValueError(f"engine_cpu must be 'auto', 'off' or a CPU number (an int >= 0), got {setting!r}")


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list (``0-3,8,10-11``) as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def choose_engine_cpu(setting: str | int, *, allowed: Collection[int], cuda: bool,
                      gpu_local: Collection[int] | None = None) -> int | None:
    """The CPU the step loop takes, or None (not pinned). ``allowed``: the CPUs this process may use; ``cuda``: the
    engine runs on a GPU; ``gpu_local``: the CPUs of the GPU's NUMA node, when known."""
    check_setting(setting)
    if setting == "off" or not allowed:
        return None
    if setting == "auto":
        if not cuda or len(allowed) < MIN_CPUS_TO_PIN:
            return None
        near = set(allowed) & set(gpu_local or ())
        return max(near or allowed)
    if setting not in allowed:
        raise ValueError(f"engine_cpu {setting}: not one of the CPUs this process may use "
                         f"({format_cpu_list(allowed)})")
    return setting


def format_cpu_list(cpus: Collection[int]) -> str:
    """``{0, 1, 2, 3, 8}`` as ``0-3,8``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def allowed_cpus() -> set[int]:
    """The CPUs this thread may run on (empty where the OS does not say)."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()


def gpu_local_cpus(device: object) -> set[int] | None:
    """The CPUs of ``device``'s (a CUDA ``torch.device``) NUMA node, from sysfs; None where unknown."""
    import torch

    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if None in ids:
        return None
    path = Path("/sys/bus/pci/devices") / f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0" / "local_cpulist"
    try:
        return parse_cpu_list(path.read_text()) or None
    except (OSError, ValueError):
        return None


def pin_engine(setting: str | int, device: object) -> int | None:
    """In the engine process, before it serves: choose its CPU (``choose_engine_cpu``), move every thread of this
    process but the calling one off it and pin the calling one (the step loop) to it; the CPU, or None. A CPU the OS
    refuses (a cpuset's rules) is ``ValueError`` when asked for by number; ``auto`` then runs unpinned."""
    allowed = allowed_cpus()
    cuda = getattr(device, "type", None) == "cuda"
    cpu = choose_engine_cpu(setting, allowed=allowed, cuda=cuda,
                            gpu_local=gpu_local_cpus(device) if cuda and setting == "auto" and allowed else None)
    if cpu is None:
        if setting == "auto" and cuda and allowed:
            logger.info("engine step loop not pinned: %d CPUs (pinned from %d)", len(allowed), MIN_CPUS_TO_PIN)
        elif setting != "off" and not allowed:
            logger.warning("engine step loop not pinned: this OS does not say which CPUs a process may use")
        return None
    try:
        keep_off(cpu)
        os.sched_setaffinity(0, {cpu})
    except OSError as err:
        if setting != "auto":
            raise ValueError(f"engine_cpu {cpu}: the OS refused it ({err})") from err
        logger.warning("engine step loop not pinned: the OS refused CPU %d (%s)", cpu, err)
        return None
    logger.info("engine step loop pinned to CPU %d; the server's other threads and processes keep off it", cpu)
    return cpu


def keep_off(cpu: int | None) -> None:
    """Take ``cpu`` out of the CPUs of every thread of this process (threads started later inherit their starter's);
    nothing for None, where the OS does not pin, or for a thread that has no other CPU."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return
    for tid, cpus in thread_cpus().items():
        if cpus - {cpu}:
            with contextlib.suppress(ProcessLookupError):      # (a thread that ended meanwhile)
                os.sched_setaffinity(tid, cpus - {cpu})


def sharing(cpu: int) -> list[int]:
    """The threads of this process but the calling one that may run on ``cpu``: after ``pin_engine``, those started
    since by the pinned thread (they inherit its CPU: a library's lazily started pool would share the step loop's)."""
    me = threading.get_native_id()
    return [tid for tid, cpus in thread_cpus().items() if tid != me and cpu in cpus]


def set_process_cpus(cpus: Collection[int]) -> None:
    """Let every thread of this process run on ``cpus`` (Linux)."""
    for tid in thread_cpus():
        with contextlib.suppress(ProcessLookupError):          # (a thread that ended meanwhile)
            os.sched_setaffinity(tid, cpus)


def thread_cpus(pid: int | str = "self") -> dict[int, set[int]]:
    """The CPUs each live thread of process ``pid`` (default this one) may run on (Linux, ``/proc``)."""
    out = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        with contextlib.suppress(ProcessLookupError):          # (a thread that ended meanwhile)
            out[tid] = os.sched_getaffinity(tid)
    return out


__all__ = ["MIN_CPUS_TO_PIN", "allowed_cpus", "check_setting", "choose_engine_cpu", "format_cpu_list",
           "gpu_local_cpus", "keep_off", "parse_cpu_list", "pin_engine", "set_process_cpus", "sharing",
           "thread_cpus"]
