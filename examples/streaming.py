"""Streaming: text as it is generated, from a plain loop (``LLM.generate_stream``) and from coroutines
(``AsyncLLM``: a dedicated engine thread; cancelling a consumer aborts its request and frees its cache).

    python examples/streaming.py PATH/TO/CHECKPOINT
    python examples/streaming.py --tiny
"""

from __future__ import annotations

import asyncio

from tiny import checkpoint_parser, open_llm

from hybridkv import AsyncLLM, SamplingParams


async def two_streams(engine: AsyncLLM, params: SamplingParams) -> None:
    """Two requests streamed concurrently; the second consumer gives up early (its request is aborted)."""
    async def consume(name: str, prompt: str, limit: int | None) -> None:
        pieces = []
        async for out in engine.generate(prompt, params):
            pieces.append(out.outputs[0].text)
            if limit is not None and len(pieces) >= limit:
                break                                # leaving the loop aborts the request
        print(f"[{name}] {len(pieces)} deltas: {''.join(pieces)!r}")

    await asyncio.gather(consume("a", "Once upon a time", None), consume("b", "In a galaxy far away", 3))
    snapshot = await engine.snapshot()
    print(f"after both: {snapshot.running} running, {snapshot.waiting} waiting")


def main() -> None:
    ap = checkpoint_parser(__doc__, "a checkpoint directory with a tokenizer")
    args = ap.parse_args()
    with open_llm(ap, args) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=24)

        # 1. A plain loop: each step's output (text so far) for every request of the call.
        for out in llm.generate_stream(["The cache of a Mamba layer"], params):
            print(f"\r{out.outputs[0].text!r}", end="", flush=True)
        print()

        # 2. Coroutines on the same engine.
        engine = AsyncLLM(llm)
        try:
            asyncio.run(two_streams(engine, params))
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
