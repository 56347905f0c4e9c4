"""`vllm_concurrency(config, budget_bytes=...)` against engines started now: a cut of tests/engine/kv_figures.json
(a dense model, sliding windows, MLA and three recurrent hybrids, Zamba2's KV heads included) at one budget and one
`max_model_len`, the engine's figures taken live; tests/test_kv_vllm.py checks every architecture against the file."""

import pytest

from mstar_utils.kv import vllm_concurrency

CUT = ['Qwen2 (GQA)', 'Gemma-3', 'DeepSeek-V2 (MLA)', 'Jamba', 'Qwen3-Next (Gated DeltaNet)', 'Zamba2']


@pytest.mark.parametrize('name', CUT)
def test_live_engine_equals_ours(name, tmp_path):
    from engine import collect_kv

    cfg = dict(collect_kv.configs())[name]()
    cfg.save_pretrained(tmp_path)
    budget, mml = collect_kv.BUDGETS[0], collect_kv.LENS[0]
    f = collect_kv.figures(str(tmp_path), budget, mml)
    bs = 16 if getattr(cfg, 'kv_lora_rank', None) else collect_kv.BLOCK_SIZE  # vLLM's CPU MLA backend takes 16
    v = vllm_concurrency(
        cfg,
        budget_bytes=budget,
        max_model_len=mml,
        block_size=bs,
        max_num_batched_tokens=f['max_num_batched_tokens'],
        ssm_dtype='float32',  # vLLM's CPU platform: "Reset SSM cache type to float32" where the CPU has AVX-512 BF16
    )
    assert (v.num_blocks, v.block_size, v.kv_cache_tokens) == (f['num_blocks'], f['block_size'], f['kv_cache_tokens'])
    assert v.max_concurrency == pytest.approx(f['max_concurrency'], rel=1e-12)


def test_live_engine_refuses_deepseek_v32(tmp_path):
    "DeepSeek-V3.2 is refused as kv_figures.json says: its indexed layers take sparse MLA, which vLLM's CPU refuses."
    from engine import collect_kv

    name = 'DeepSeek-V3.2 (MLA, indexer)'
    recorded = collect_kv.json.loads(collect_kv.OUT.read_text(encoding='utf-8'))['architectures'][name]['refused']
    dict(collect_kv.configs())[name]().save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError) as e:
        collect_kv.figures(str(tmp_path), collect_kv.BUDGETS[0], collect_kv.LENS[0])
    assert recorded == f'NotImplementedError: {e.value}'
