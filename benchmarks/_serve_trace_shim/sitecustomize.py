"""``serve_trace.py``'s stamps inside ``hybridkv serve``: this directory goes on the traced server's ``PYTHONPATH``
only, so Python runs this file at the start of each of its processes (the launcher, the engine process, the API
processes; a ``sitecustomize`` of the environment's own is not run in them). It wraps the methods a streamed token
passes as their modules load and stamps them with ``time.time()`` (one clock for every process of the machine); each
process writes its stamps to ``traces/<pid>.pkl`` beside this file as it exits.

- engine process: ``LLMEngine.step`` (start, end, the tokens and decodes it scheduled, the wait for the step in
  flight's tokens) and ``_Channel.deliver`` (the request ids of each step's message to an API process);
- API processes: ``EngineCoreClient._route`` (the request ids of each message received), the app's ``_merged`` (each
  output as the handler takes it, before its chunk is written, with its new tokens: a busy event loop takes several
  steps' outputs as one) and ``_Server.chat`` (an intake, tokenization in).
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import pickle
import sys
import time
from pathlib import Path

STAMPS: dict[str, list] = {"steps": [], "sends": [], "receipts": [], "yields": [], "intakes": []}
_now = time.time


def _dump() -> None:
    if any(STAMPS.values()):
        out = Path(__file__).parent / "traces"
        out.mkdir(exist_ok=True)
        with open(out / f"{os.getpid()}.pkl", "wb") as f:
            pickle.dump(STAMPS, f)


def _engine(module) -> None:
    import hybridkv.engine.scheduler as scheduler

    schedule, step, tokens_on_host = (scheduler.Scheduler.schedule, module.LLMEngine.step,
                                      module._Launched.tokens_on_host)
    last: dict[str, object] = {"batch": None, "wait": 0.0}

    def scheduled(self, *args, **kwargs):
        last["batch"] = batch = schedule(self, *args, **kwargs)
        return batch

    def waited(self, *args, **kwargs):
        t = _now()
        try:
            return tokens_on_host(self, *args, **kwargs)
        finally:
            last["wait"] += _now() - t

    def stepped(self, **kwargs):
        last["batch"], last["wait"] = None, 0.0
        t0 = _now()
        outputs = step(self, **kwargs)
        batch = last["batch"]
        n = batch.num_new_tokens if batch is not None and batch.num_reqs else None
        STAMPS["steps"].append((t0, _now(), 0 if n is None else int(n.sum()), 0 if n is None else int((n == 1).sum()),
                                last["wait"]))
        return outputs

    scheduler.Scheduler.schedule, module.LLMEngine.step, module._Launched.tokens_on_host = scheduled, stepped, waited


def _core(module) -> None:
    deliver = module._Channel.deliver

    def delivered(self, outputs):
        STAMPS["sends"].append((_now(), [o.request_id for o in outputs]))
        deliver(self, outputs)

    module._Channel.deliver = delivered


def _client(module) -> None:
    route = module.EngineCoreClient._route

    def routed(self, packed, waiting, adds):
        STAMPS["receipts"].append((_now(), [p[0] if type(p) is tuple else p.request_id for p in packed]))
        route(self, packed, waiting, adds)

    module.EngineCoreClient._route = routed


def _app(module) -> None:
    merged, chat = module._merged, module._Server.chat

    async def traced(streams, server):
        async for index, out in merged(streams, server):
            STAMPS["yields"].append((_now(), out.request_id, sum(len(c.token_ids) for c in out.outputs)))
            yield index, out

    async def intake(self, body, request):
        t = _now()
        response = await chat(self, body, request)
        STAMPS["intakes"].append((t, _now()))
        return response

    module._merged, module._Server.chat = traced, intake


_PATCHES = {"hybridkv.engine.engine": _engine, "hybridkv.engine.core": _core,
            "hybridkv.engine.core_client": _client, "hybridkv.server.app": _app}


class _Patching(importlib.abc.Loader):
    """A module's own loader, then its patch."""

    def __init__(self, loader, patch) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _Finder:
    """Finds the patched modules as the other finders do, with ``_Patching`` loaders."""

    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Patching(spec.loader, _PATCHES[name])
        return spec


for _name, _patch in _PATCHES.items():     # (none is loaded this early; should one be, it is patched here)
    if _name in sys.modules:
        _patch(sys.modules[_name])
sys.meta_path.insert(0, _Finder())
atexit.register(_dump)
