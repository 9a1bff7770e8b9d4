"""Chat with a checkpoint through its own chat template (the BOS token exactly once), with vLLM's
sampling controls.

    python examples/chat.py PATH/TO/CHECKPOINT
    python examples/chat.py --tiny            # a tiny random checkpoint with a byte tokenizer: noise, but real
"""

from __future__ import annotations

from tiny import checkpoint_parser, open_llm

from hybridkv import SamplingParams


def main() -> None:
    ap = checkpoint_parser(__doc__, "a checkpoint directory with a tokenizer and a chat template")
    args = ap.parse_args()
    with open_llm(ap, args) as llm:
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
