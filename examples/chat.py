"""Chat with a checkpoint through its own chat template (the BOS token exactly once), with vLLM's
sampling controls.

    python examples/chat.py PATH/TO/CHECKPOINT
    python examples/chat.py --tiny            # a tiny random checkpoint with a byte tokenizer: noise, but real
"""

from __future__ import annotations

import argparse
import tempfile

from hybridkv import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="a checkpoint directory with a tokenizer and a chat template")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if (args.checkpoint is None) == (not args.tiny):
        ap.error("give a checkpoint directory or --tiny")

    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from tiny import tiny_checkpoint

            args.checkpoint = tiny_checkpoint(tmp)
        llm = LLM(args.checkpoint, **(dict(device="cpu", kv_cache_memory="64MiB") if args.tiny else {}))
        conversations = [
            [{"role": "system", "content": "You answer in one sentence."},
             {"role": "user", "content": "What does a sliding-window attention layer keep in its cache?"}],
            [{"role": "user", "content": "Name three hybrid model families."}],
        ]
        params = SamplingParams(temperature=0.7, top_p=0.9, seed=0, max_tokens=48, presence_penalty=0.5)
        for conversation, out in zip(conversations, llm.chat(conversations, params, use_tqdm=False), strict=True):
            print(f"user: {conversation[-1]['content']}")
            print(f"assistant ({len(out.prompt_token_ids)} prompt tokens, {out.outputs[0].finish_reason}): "
                  f"{out.outputs[0].text!r}\n")


if __name__ == "__main__":
    main()
