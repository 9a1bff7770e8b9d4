import sys, torch
sys.path.insert(0, '.')
from tests.test_request_isolation import config, PROMPTS, GREEDY, tokens
from hybridkv import LLM
from hybridkv.models.hybrid import build_model
def build():
    return build_model(config(), seed=2, device=torch.device("cuda"))
for backend in ("torch", "triton"):
    m = build()
    outs = LLM(m, device="cuda", backend=backend, block_size=4, max_num_seqs=4, kv_cache_memory=1 << 22, cuda_graphs=False).generate([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False)
    t = tokens(outs)
    poison = t[1][2]
    m = build()
    with torch.no_grad():
        m.embed_tokens.weight[poison] = float("nan")
    llm = LLM(m, device="cuda", backend=backend, block_size=4, max_num_seqs=4, kv_cache_memory=1 << 22, cuda_graphs=False)
    x = m.embed_tokens(torch.tensor([poison], device="cuda"))
    print(backend, "poison", poison, "emb nan", torch.isnan(x).any().item())
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False)
    print(backend, [o.error for o in outs], tokens(outs)[1][:6], t[1][:6])
    print(backend, "prompt logprobs check:", llm.generate([[*PROMPTS[1], poison, 3]], GREEDY, use_tqdm=False)[0].error)
