"""The KV sweep: transformers' own caches, filled on the meta device at the released shapes, against our figures
(convention='transformers'). The fast suite runs a cut of the hybrids and of each layer kind; MSTAR_UTILS_SLOW=1 runs
every causal-LM config class transformers declares and prints the counts."""

import collections
import os

import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import transformers
from kv_sweep import causal_lm_types, sweep_one

transformers.utils.logging.set_verbosity_error()

# the named hybrids, then one class per other kind of layer: sliding, chunked, MLA, indexed, GDN, KDA, lightning, pure
# SSMs
CUT = [
    'jamba',
    'bamba',
    'falcon_h1',
    'nemotron_h',
    'granitemoehybrid',
    'zamba2',
    'lfm2',
    'deepseek_v32',
    'dots3_note',
    'mamba',
    'minimax',
    'gpt_oss',
    'llama4_text',
    'mimo_v2_flash',
    'hy_v4',
    'exaone4',
]  # Qwen3-Next, Kimi: test_kv*.py


@pytest.mark.parametrize('model_type', CUT)
def test_released_shape_matches_transformers_cache(model_type):
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f'transformers {transformers.__version__} has no model type {model_type!r}')
    r = sweep_one(model_type)
    assert r.status == 'matched', r


@pytest.mark.skipif(
    not os.environ.get('MSTAR_UTILS_SLOW'), reason='every causal-LM class (about 7 min): set MSTAR_UTILS_SLOW=1'
)
def test_every_causal_lm_class(capsys):
    results = [sweep_one(mt) for mt in causal_lm_types()]
    counts = collections.Counter(r.status for r in results)
    with capsys.disabled():
        print(f'\nswept {len(results)} classes: {dict(counts)}')
        for r in results:
            if r.status != 'matched':
                print(f'  {r.model_type}: {r.status} {r.reason or (r.grows, r.stays, r.per_token, r.fixed)}')
    bad = [r for r in results if r.status == 'mismatched']
    assert not bad, bad
