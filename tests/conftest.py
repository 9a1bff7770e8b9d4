"""Session-wide test setup.

Without CUDA, Triton kernels run under Triton's interpreter. The setting is read once, when triton is
first used in the process, so it must be in place before any test module imports torch code that
touches triton — hence here, before collection, rather than in the Triton test module.

Every engine a test builds (directly or through ``LLM``, in the test or in a fixture it sets up) must hold
nothing when the test ends: ``LLMEngine.check_idle`` runs at teardown (no request left, every block free or
cached, every working state slot free, the coordinator's invariants intact). The engines are found through a
wrapper around ``LLMEngine.__init__`` installed here (production code carries no test hook), which keeps them
until the teardown of the test that built them. A test that
leaves an engine busy on purpose says so with ``@pytest.mark.engine_busy``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (``-n``, in ``pyproject.toml``'s addopts) each worker gets its share of the cores for torch's
# intra-op threads, and so do the processes its tests start (servers, tensor-parallel ranks): two workers of two
# threads each on a 2-core machine ran no faster than one process, two of one thread each ran 1.5x faster.
MAX_WORKERS = 8     # ``-n auto``: past this many, each worker's imports and fixtures cost more than they save


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


if (_workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    _threads = max(1, _cores() // _workers)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        _threads = min(_threads, max(1, int(os.environ["OMP_NUM_THREADS"])))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: the cores this process may use, at most ``MAX_WORKERS``; ``PYTEST_XDIST_AUTO_NUM_WORKERS``
    (xdist's own setting) wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return max(1, min(MAX_WORKERS, _cores()))


_ENGINES: list = []          # engines built since the last test's teardown (held until it: a test's locals are gone)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engine_busy: the test leaves an engine with work on purpose "
                                       "(no idle check at teardown)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture(scope="session", autouse=True)
def _record_engines() -> Iterator[None]:
    from hybridkv.engine.engine import LLMEngine

    original = LLMEngine.__init__

    def init(self: LLMEngine, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        _ENGINES.append(self)

    LLMEngine.__init__ = init  # type: ignore[method-assign]
    yield
    LLMEngine.__init__ = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def engines_idle_at_teardown(request: pytest.FixtureRequest, _record_engines: None) -> Iterator[None]:
    yield
    engines = list(_ENGINES)
    _ENGINES.clear()
    if request.node.get_closest_marker("engine_busy") or request.node.stash.get(_CALL_FAILED, False):
        return      # (a failed test is reported as such, not again as a busy engine)
    for engine in engines:
        engine.check_idle()
