"""The engine step loop's CPU (``engine/affinity.py``): which CPU each setting takes, table-driven; CPU lists as the
kernel writes them; and, on Linux, that ``pin_engine`` leaves the calling thread alone on its CPU and every other
thread of the process off it (in a child process, so this one's CPUs are left alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hybridkv.engine.affinity import check_setting, choose_engine_cpu, format_cpu_list, parse_cpu_list
from tests._server import ROOT

SIXTEEN = set(range(16))


@pytest.mark.parametrize(("setting", "allowed", "cuda", "gpu_local", "want"), [
    ("off", SIXTEEN, True, None, None),
    ("auto", SIXTEEN, True, None, 15),                      # the highest-numbered CPU
    ("auto", SIXTEEN, True, set(range(8)), 7),              # ... of the GPU's NUMA node
    ("auto", set(range(8, 16)), True, set(range(8)), 15),   # the node's CPUs are not ours: the highest of ours
    ("auto", SIXTEEN, False, None, None),                   # a CPU engine keeps its threads' CPUs
    ("auto", {0, 1, 2}, True, None, None),                  # too few CPUs to give one away
    ("auto", {0, 1, 2, 3}, True, None, 3),
    ("auto", set(), True, None, None),                      # the OS does not say
    (5, SIXTEEN, False, None, 5),                           # a CPU number, on any device
    (0, {0, 1}, True, None, 0),
])
def test_choose_engine_cpu(setting, allowed, cuda, gpu_local, want) -> None:
    assert choose_engine_cpu(setting, allowed=allowed, cuda=cuda, gpu_local=gpu_local) == want


@pytest.mark.parametrize("setting", ["on", "", -1, True, 1.5, None])
def test_bad_settings_are_refused(setting) -> None:
    with pytest.raises(ValueError, match="engine_cpu must be"):
        check_setting(setting)


def test_a_cpu_this_process_may_not_use_is_refused() -> None:
    with pytest.raises(ValueError, match=r"engine_cpu 9: not one of the CPUs this process may use \(0-3\)"):
        choose_engine_cpu(9, allowed={0, 1, 2, 3}, cuda=True)


@pytest.mark.parametrize(("text", "cpus"), [("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}), ("", set())])
def test_cpu_lists(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list(cpus) == text.strip()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs")
def test_pin_engine_keeps_the_other_threads_off_its_cpu() -> None:
    code = textwrap.dedent("""
        import json, os, threading, torch
        from hybridkv.engine.affinity import allowed_cpus, pin_engine, sharing
        def cpus(tid):
            return sorted(os.sched_getaffinity(tid))
        allowed = allowed_cpus()
        cpu = max(allowed)
        stop = threading.Event()
        before = threading.Thread(target=stop.wait, daemon=True)          # started before the pin
        before.start()
        assert pin_engine(cpu, torch.device("cpu")) == cpu
        assert sharing(cpu) == []
        after = threading.Thread(target=stop.wait, daemon=True)           # started by the pinned thread
        after.start()
        assert sharing(cpu) == [after.native_id]
        print(json.dumps({"main": cpus(threading.get_native_id()), "before": cpus(before.native_id),
                          "after": cpus(after.native_id), "cpu": cpu, "others": sorted(allowed - {cpu})}))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["main"] == [got["cpu"]]
    assert got["before"] == got["others"]
    assert got["after"] == [got["cpu"]]                     # inherits the pinned thread's CPU: start threads first
