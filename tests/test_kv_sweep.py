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


_T = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128
)
_INKLING = dict(
    _T,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=4,  # sliding layers with other heads than the full ones, as Inkling's release has
    swa_head_dim=8,
    sliding_window_size=4,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    conv_kernel_size=3,
    rel_extent=8,
    d_rel=4,
)
_QWEN4_EXP = dict(
    _T,
    num_hidden_layers=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    hc_lowrank=8,
    ple_layer_ids=[1, 3],  # 1-based, linear-attention layers only
    ple_embed_dim=32,
    ngram_vocab_size_base=1000,
    split_ngram_parts=4,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=8,
    indexer_compress_ratio=4,
    eos_token_id=1,
)
_GLM5_NEXT = dict(
    _T,
    num_hidden_layers=4,
    num_key_value_heads=4,  # its MLA asks for as many as the query heads
    intermediate_size=64,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_nope_head_dim=8,
    v_head_dim=8,
    index_head_dim=16,
    index_n_heads=2,
    index_topk=8,
    index_kpool=4,
    linear_head_dim=8,
    linear_num_heads=2,
    hc_mult=2,
    pad_token_id=0,
    # a 'shared' indexed layer reuses the selection of the indexed layer just before it, and keeps no indexer row
    layer_types=['linear_attention', 'indexed_attention', 'indexed_attention', 'linear_attention'],
    indexer_types=['full', 'full', 'shared', 'full'],
)
# Tiny configs of the classes whose layer kinds were once named but refused: ZAYA's CCA, Inkling's short
# convolutions (and Inkling2-Loop's per-pass caches), RecurrentGemma's RG-LRU, Qwen4-Exp's QSA indexer and PLE
# windows. Their released shapes run in the slow sweep where meta can run them; these run in seconds.
TINY = {
    'zaya': dict(
        _T,
        moe_intermediate_size=32,
        num_experts=2,
        router_hidden_size=16,
        cca_time0=2,
        cca_time1=3,
        sliding_window=4,
        layer_types=['hybrid', 'hybrid_sliding'],
    ),
    'inkling_text': dict(_INKLING, intermediate_size=64, n_shared_experts=1, local_layer_ids=[0]),
    'inkling2_text': dict(_INKLING, layer_types=['hybrid_sliding', 'hybrid'], n_layers_per_attn_res_block=1),
    'inkling2_loop_text': dict(
        _INKLING,
        num_hidden_layers=3,
        layer_types=['hybrid_sliding', 'hybrid', 'hybrid_sliding'],
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=2,
        loop_num_passes=3,
        loop_gate_rank=8,
    ),
    'recurrent_gemma': dict(
        _T, num_hidden_layers=3, lru_width=64, intermediate_size=96, attention_window_size=6, conv1d_width=3
    ),
    'qwen4_exp_text': _QWEN4_EXP,
    'qwen4_exp': dict(text_config=_QWEN4_EXP),
    # GLM-5-Next: KDA layers, and MLA without a rotary part beside a pooled indexer; no causal-LM class, so the
    # sweep builds its base model
    'glm5_next_text': _GLM5_NEXT,
    'glm5_next': dict(
        text_config=_GLM5_NEXT,
        vision_config=dict(
            depth=1,
            hidden_size=32,
            num_heads=2,
            intermediate_size=32,
            out_hidden_size=64,
            projection_intermediate_size=32,
        ),
    ),
}
# Qwen4-Exp's QSA indexer and GLM-5-Next's forward call `nonzero`, which meta cannot run: their tiny models run on
# the CPU
DEVICE = {'qwen4_exp_text': 'cpu', 'qwen4_exp': 'cpu', 'glm5_next_text': 'cpu', 'glm5_next': 'cpu'}


@pytest.mark.parametrize('model_type', TINY)
def test_tiny_hybrid_matches_transformers_cache(model_type):
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f'transformers {transformers.__version__} has no model type {model_type!r}')
    r = sweep_one(model_type, overrides=TINY[model_type], device=DEVICE.get(model_type, 'meta'))
    assert r.status == 'matched', r
    assert r.fixed > 0, r  # a state or window was counted, not skipped


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
