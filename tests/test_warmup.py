"""The start-up warm-up reaches every step class and leaves the engine as it found it."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine.warmup import scenarios, warm_up
from hybridkv.models.hybrid import build_model
from tests.test_engine import tiny_config


def test_scenarios_cover_the_row_classes_and_a_chunked_prompt():
    todo = scenarios(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=4096)
    tokens = {sum(s.prompt_lens) for s in todo if s.num_requests == 1}
    rows = {s.num_requests for s in todo if set(s.prompt_lens) == {2}}
    assert {16, 32, 64, 128} <= tokens                      # every row tile of the projections
    assert {8, 24, 48, 96, 256} <= rows                     # ... and of the logits head
    for budget, max_len in ((2048, 4096), (4096, 4096), (16, 64)):   # a short chunk over a long context
        (a, b), = [s.prompt_lens for s in scenarios(max_num_seqs=8, max_num_batched_tokens=budget,
                                                    max_model_len=max_len) if s.num_requests == 2]
        r = a + b - budget                                  # the second step's chunk
        assert 2 <= r <= 24 and b <= max_len - 4 and b - r >= min(budget, max_len - 4) // 2
    small = scenarios(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=24)
    assert all(s.num_requests <= 4 and max(s.prompt_lens) <= 20 for s in small)


def test_warm_up_leaves_the_engine_clean_and_outputs_unchanged():
    model = build_model(tiny_config(), seed=1)
    prompts = [np.random.default_rng(i).integers(1, 61, 9 + 5 * i).tolist() for i in range(3)]
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)     # seeds from the engine

    def run(warm: bool):
        llm = LLM(model, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64,
                  kv_cache_memory="2MiB", warmup=warm)
        if warm:
            eng = llm.engine
            assert not eng.has_unfinished and eng.coordinator.num_requests == 0
            stats = eng.stats()
            assert stats.steps == stats.generated_tokens == stats.prefix_query_tokens == 0
            eng.coordinator.check_invariants()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run(True) == run(False)


@pytest.mark.engine_busy
def test_warm_up_refuses_a_busy_engine():
    llm = LLM(build_model(tiny_config(), seed=1), block_size=4, max_model_len=64, kv_cache_memory="2MiB")
    llm.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="already has requests"):
        warm_up(llm.engine)
