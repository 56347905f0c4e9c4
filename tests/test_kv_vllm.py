"""`vllm_concurrency` from a byte budget against the figures a live vLLM logged (tests/engine/kv_figures.json).

The file holds what vLLM's CPU build stored beside its "CPU KV cache size: N tokens, Maximum concurrency ..." line for
tiny configs of many architectures (`load_format='dummy'`), at two budgets and two `max_model_len`s, collected by
tests/engine/collect_kv.py (`tools/engine --collect-kv`); tests/engine/test_kv_live.py recomputes a cut of them live.
Architectures the CPU backend refused are listed there with its error."""

import json
from pathlib import Path

import pytest

from mstar_utils.kv import vllm_concurrency

FIGURES = json.loads((Path(__file__).parent / 'engine' / 'kv_figures.json').read_text(encoding='utf-8'))
# vLLM's CPU platform keeps recurrent states in float32 on a CPU with AVX-512 BF16, as the collecting one has: its log
# says "Reset SSM cache type to float32 for accelerated GDN mamba backend" (vllm/platforms/cpu.py)
SSM_DTYPE = 'float32'
BUILT = {k: v for k, v in FIGURES['architectures'].items() if v.get('runs') and 'refused' not in v}


def requested_block_size(config: dict) -> int:
    "The block size the engine asked for: the collection's, except MLA, which vLLM's CPU backend sets to 16."
    return 16 if config.get('kv_lora_rank') else FIGURES['engine']['block_size']


def ours(config: dict, run: dict):
    return vllm_concurrency(
        config,
        budget_bytes=run['budget_bytes'],
        max_model_len=run['max_model_len'],
        block_size=requested_block_size(config),
        max_num_batched_tokens=run['max_num_batched_tokens'],
        ssm_dtype=SSM_DTYPE,
    )


@pytest.mark.parametrize('name', list(BUILT))
def test_budget_figures_equal_the_engine(name):
    entry = BUILT[name]
    for run in entry['runs']:
        v = ours(entry['config'], run)
        got = (v.num_blocks, v.block_size, v.kv_cache_tokens, round(v.max_concurrency, 6))
        want = (run['num_blocks'], run['block_size'], run['kv_cache_tokens'], round(run['max_concurrency'], 6))
        assert got == want, (run['budget_bytes'], run['max_model_len'], got, want)


def test_the_file_covers_two_budgets_and_two_lengths():
    assert len(BUILT) >= 10, sorted(BUILT)
    for entry in BUILT.values():
        runs = {(r['budget_bytes'], r['max_model_len']) for r in entry['runs']}
        assert len({b for b, _ in runs}) == 2 and len({m for _, m in runs}) == 2, runs
    refused = {k: v['refused'] for k, v in FIGURES['architectures'].items() if 'refused' in v}
    assert all(refused.values())  # each refusal carries the engine's error


def test_published_counts():
    "benchmarks/README.md quotes the counts of this file: architectures tried, built, refused and equal; runs equal."
    text = (Path(__file__).parents[1] / 'benchmarks' / 'README.md').read_text(encoding='utf-8')
    sec = text[text.index("## vLLM's own figures") :]
    runs = [(name, run) for name, e in BUILT.items() for run in e['runs']]
    equal_runs = [
        name
        for name, run in runs
        if (lambda v: (v.num_blocks, v.block_size, v.kv_cache_tokens))(ours(BUILT[name]['config'], run))
        == (run['num_blocks'], run['block_size'], run['kv_cache_tokens'])
    ]
    equal = [k for k in BUILT if equal_runs.count(k) == len(BUILT[k]['runs'])]
    tried, refused = len(FIGURES['architectures']), len(FIGURES['architectures']) - len(BUILT)
    assert f'{tried} architectures' in ' '.join(sec.split())
    assert f'built {len(BUILT)} and refused {refused}' in ' '.join(sec.split())
    assert f'for {len(equal)} of the {len(BUILT)}, in {len(equal_runs)} of {len(runs)} runs' in ' '.join(sec.split())
    assert equal == list(BUILT), sorted(set(BUILT) - set(equal))


def test_zamba2_heads_per_convention():
    "Zamba2 with fewer KV heads than query heads: transformers' cache keeps the KV heads, vLLM's the query heads."
    from kv_sweep import sweep_one

    from mstar_utils.kv import kv_geometry

    cfg = {k: v for k, v in BUILT['Zamba2']['config'].items() if k not in ('transformers_version', 'architectures')}
    assert cfg['num_key_value_heads'] < cfg['num_attention_heads']
    r = sweep_one('zamba2', overrides=cfg)  # transformers' own cache, filled on meta
    assert r.status == 'matched', r
    attention = [layer.token_bytes for layer in kv_geometry(cfg).layers if layer.token_bytes]
    ratio = cfg['num_attention_heads'] // cfg['num_key_value_heads']
    assert attention and all(b == ratio * r.grows // len(attention) for b in attention), (attention, r)
