"""KV pages, the KV plan and the admission check, and KV geometry for every layer kind, against config classes and
transformers' own caches."""

import json
import logging
import math
import os
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import torch
import transformers
from mstar_utils.upstream import output_cache
from mstar_utils import kv
from mstar_utils import kv_figures as kf
from mstar_utils.kv import (
    KVCachePool,
    KVPlan,
    check_kv_pools_fit,
    kv_pages,
    kv_max_requests,
    kv_bytes_per_token,
    kv_fixed_bytes_per_request,
    kv_geometry,
    plan_kv_pools,
)
from mstar_utils.checkpoints import smollm2_checkpoint
from mstar_utils.testing import (
    KV_ARCHITECTURES,
    released_kv_config,
    gemma3_4b_it_config,
    tiny_kv_config,
    transformers_kv_cache,
    cache_layer_bytes,
)

LOGGER = 'tests.kv'


class Model:
    "The model protocol as the check sees it."

    def __init__(self, pools):
        self.pools = pools

    def get_kv_cache_config(self):
        return self.pools


def check(pools, cap, caplog, path='serve.json'):
    "Run the check on a model with `pools`; returns the warnings it logged."
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        check_kv_pools_fit(
            Model(pools), {} if cap is ... else {'max_concurrent_requests': cap}, path, logging.getLogger(LOGGER)
        )
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


# ---- kv_pages


@given(st.integers(0, 10**7), st.integers(1, 10**5), st.integers(0, 10**4))
def test_kv_pages_formula(tokens, page_size, requests):
    assert kv_pages(tokens, page_size, requests) == requests * math.ceil(tokens / page_size) + 1


@given(st.integers(1, 10**6), st.integers(1, 4096), st.integers(1, 100))
def test_kv_pages_holds_the_tokens(tokens, page_size, requests):
    # enough slots for every token of every request, with less than one page slack per request, and one page on top
    n = kv_pages(tokens, page_size, requests) - 1
    assert n * page_size >= tokens * requests
    assert (n - requests) * page_size < tokens * requests


@pytest.mark.parametrize(
    'args,what',
    [
        ((100, 0, 1), 'page_size'),
        ((100, -16, 1), 'page_size'),
        ((-1, 16, 1), 'tokens'),
        ((100, 16, -1), 'requests'),
        ((100.0, 16, 1), 'tokens'),
        ((100, 16.0, 1), 'page_size'),
        ((100, 16, 1.5), 'requests'),
        (('100', 16, 1), 'tokens'),
        ((None, 16, 1), 'tokens'),
        ((True, 16, 1), 'tokens'),
        ((100, 16, False), 'requests'),
    ],
)
def test_kv_pages_refuses(args, what):
    with pytest.raises(ValueError, match=what):
        kv_pages(*args)


@given(st.integers(0, 10**5), st.integers(1, 10**5), st.integers(1, 512))
def test_kv_max_requests_is_the_boundary(n, tokens, page_size):
    c = kv_max_requests(n, tokens, page_size)
    assert c >= 0
    assert kv_pages(tokens, page_size, c) <= n or c == 0
    assert kv_pages(tokens, page_size, c + 1) > n


# ---- KVCachePool: invalid geometry fails at construction


@pytest.mark.parametrize(
    'args,what',
    [
        ((4096, 0, 1024), 'page_size must be at least 1'),
        ((0, 16, 1024), 'max_seq_len must be at least 1'),
        ((4096, 16, -1), 'max_num_pages must be at least 0'),
        ((4096, 16.0, 1024), 'page_size must be an integer'),
        ((4096, 16, True), 'max_num_pages must be an integer'),
        ((4096, 16, 1024, 'x', -5), "'x' cpu_offload_pages"),
    ],
)
def test_pool_with_invalid_geometry_fails_when_made(args, what):
    with pytest.raises(ValueError, match=what):
        KVCachePool(*args)
    with pytest.raises(ValueError, match='KVCachePool page_size'):
        KVCachePool(max_seq_len=4096, page_size=0, max_num_pages=9)


def test_pool_normalizes_integer_types():
    import numpy as np

    pool = KVCachePool(np.int64(4096), np.int32(16), 1025)
    assert type(pool.max_seq_len) is int and type(pool.page_size) is int and pool.max_requests == 4


# ---- check_kv_pools_fit: the admission cases


def test_13_pages_of_8192_hold_no_request_of_106496(caplog):
    pool = KVCachePool(max_seq_len=106496, page_size=8192, max_num_pages=13, name='text')
    assert 13 * 8192 == 106496
    with pytest.raises(ValueError) as e:
        check([pool], 1, caplog, path='/etc/mstar/serve.json')
    msg = str(e.value)
    for part in ('/etc/mstar/serve.json', "'text'", 'needs 14 pages', 'has 13', 'No max_concurrent_requests fits'):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match='cannot hold one request'):
        check([pool], ..., caplog)


def test_16384_token_pool_refuses_4_x_16384(caplog):
    pool = KVCachePool(max_seq_len=16384, page_size=16, max_num_pages=16384 // 16, name='p')
    with pytest.raises(ValueError) as e:
        check([pool], 4, caplog)
    msg = str(e.value)
    assert f'needs {4 * 1024 + 1} pages' in msg and 'has 1024' in msg and 'No max_concurrent_requests fits' in msg


def test_16384_token_pool_refuses_4_x_4096_for_the_sink(caplog):
    pool = KVCachePool(max_seq_len=4096, page_size=16, max_num_pages=1024, name='p')
    with pytest.raises(ValueError, match='needs 1025 pages.*has 1024.*largest max_concurrent_requests that fits is 3'):
        check([pool], 4, caplog)
    assert check([pool], 3, caplog) == []  # 3 fit: 769 of 1024 pages, not within 10%


@given(st.integers(1, 64), st.integers(1, 20000), st.sampled_from([1, 16, 64, 256, 8192]))
@settings(max_examples=200, deadline=None)
def test_exact_fit_passes(cap, seq, page_size):
    per = kv_pages(seq, page_size, 1) - 1
    pool = KVCachePool(max_seq_len=seq, page_size=page_size, max_num_pages=cap * per + 1)
    log = logging.getLogger(LOGGER)
    check_kv_pools_fit(Model([pool]), {'max_concurrent_requests': cap}, 'serve.json', log)
    tight = KVCachePool(max_seq_len=seq, page_size=page_size, max_num_pages=cap * per)
    with pytest.raises(ValueError, match=f'largest max_concurrent_requests that fits is {cap - 1}|No max_concurrent'):
        check_kv_pools_fit(Model([tight]), {'max_concurrent_requests': cap}, 'serve.json', log)


def test_exact_fit_passes_and_warns(caplog):
    pool = KVCachePool(max_seq_len=4096, page_size=16, max_num_pages=4 * 256 + 1, name='text')
    (w,) = check([pool], 4, caplog)
    assert 'within 10%' in w and "'text'" in w and '1025 of its 1025' in w and 'serve.json' in w


def test_no_cap_warns_unbounded_and_names_the_cap(caplog):
    pool = KVCachePool(max_seq_len=8192, page_size=16, max_num_pages=4000, name='text')
    for cap in (..., None):
        (w,) = check([pool], cap, caplog, path='cfg/serve.yaml')
        assert 'cfg/serve.yaml' in w and 'unbounded' in w
        assert f'largest max_concurrent_requests that fits is {(4000 - 1) // 512}' in w


def test_close_to_the_limit(caplog):
    per = 512  # 8192 / 16

    def pool(n):
        return KVCachePool(max_seq_len=8192, page_size=16, max_num_pages=n, name='text')

    need = 10 * per + 1
    assert check([pool(need * 10 // 9)], 10, caplog)  # 90.0x% used: warns
    assert check([pool(need * 10 // 9 + 1)], 10, caplog) == []  # just under 90%: quiet
    assert check([pool(100 * per)], 10, caplog) == []
    assert 10 * need < 9 * (need * 10 // 9 + 1) and 10 * need >= 9 * (need * 10 // 9)


def test_log_none_uses_the_module_logger(caplog):
    pool = KVCachePool(max_seq_len=8192, page_size=16, max_num_pages=4000, name='text')
    with caplog.at_level(logging.WARNING, logger='mstar_utils.kv'):
        check_kv_pools_fit(Model([pool]), {}, 'serve.json')
        check_kv_pools_fit(Model([pool]), {}, 'serve.json', None)
    msgs = [r.getMessage() for r in caplog.records if r.name == 'mstar_utils.kv']
    assert len(msgs) == 2 and all('unbounded' in m for m in msgs)


# ---- the protocol


def test_no_kv_cache_is_nothing_to_check(caplog):
    assert check(None, 4, caplog) == []
    assert check([], ..., caplog) == []
    assert check({}, ..., caplog) == []
    check_kv_pools_fit(object(), {'max_concurrent_requests': 4}, 'serve.json', logging.getLogger(LOGGER))
    check_kv_pools_fit(object(), None, 'serve.json')


def test_any_object_with_the_attributes(caplog):
    pool = SimpleNamespace(max_seq_len=4096, page_size=16, max_num_pages=1024)
    with pytest.raises(ValueError, match="pool '#0' needs 1025"):
        check([pool], 4, caplog)
    assert check((pool,), 3, caplog) == []
    with pytest.raises(TypeError, match="pool '#0' .*no max_num_pages"):
        check([SimpleNamespace(max_seq_len=4096, page_size=16)], 1, caplog)


def test_dict_from_node_to_pool(caplog):
    pools = {'thinker': KVCachePool(32768, 16, 40000), 'talker': KVCachePool(4096, 16, 1000, name='codec')}
    with pytest.raises(ValueError) as e:
        check(pools, 4, caplog)
    msg = str(e.value)
    assert "'talker (codec)' needs 1025" in msg and 'thinker' not in msg and 'fits is 3' in msg
    (w,) = check(pools, ..., caplog)
    assert "'thinker': 19" in w and "'talker (codec)': 3" in w and 'fits is 3' in w


def test_every_short_pool_is_named(caplog):
    pools = [KVCachePool(4096, 16, 1024, 'a'), KVCachePool(4096, 16, 5000, 'b'), KVCachePool(8192, 16, 1500, 'c')]
    with pytest.raises(ValueError) as e:
        check(pools, 4, caplog)
    msg = str(e.value)
    assert "'a' needs 1025" in msg and "'c' needs 2049" in msg and "'b'" not in msg
    assert 'fits is 2' in msg  # min(1023 // 256, 4999 // 256, 1499 // 512)


def test_offload_pages_do_not_count(caplog):
    pool = KVCachePool(4096, 16, 1024, 'text', cpu_offload_pages=10**6)
    with pytest.raises(ValueError, match='needs 1025'):
        check([pool], 4, caplog)


@pytest.mark.parametrize('cap', [0, -1, 2.5, '4', True, [4]])
def test_bad_cap_is_refused(cap, caplog):
    with pytest.raises(ValueError, match='serve.json: max_concurrent_requests'):
        check([KVCachePool(4096, 16, 100000)], cap, caplog)


def test_bad_protocol_values(caplog):
    with pytest.raises(TypeError, match=r'Model.get_kv_cache_config\(\) returned KVCachePool'):
        check(KVCachePool(4096, 16, 1024), 1, caplog)
    with pytest.raises(ValueError, match="serve.json: KV cache pool 'x' page_size must be at least 1"):
        check([SimpleNamespace(max_seq_len=4096, page_size=0, max_num_pages=1024, name='x')], 1, caplog)


@given(st.integers(1, 10**5), st.sampled_from([1, 16, 32, 128]), st.integers(2, 10**5), st.integers(1, 300))
@settings(max_examples=300, deadline=None)
def test_refusal_iff_pages_short(seq, page_size, n, cap):
    pool = KVCachePool(seq, page_size, n, 'p')
    log = logging.getLogger(LOGGER)
    fits = kv_pages(seq, page_size, cap) <= n
    try:
        check_kv_pools_fit(Model([pool]), {'max_concurrent_requests': cap}, 'serve.json', log)
        assert fits
    except ValueError as e:
        assert not fits
        best = kv_max_requests(n, seq, page_size)
        assert (f'fits is {best}' in str(e)) if best else ('No max_concurrent_requests fits' in str(e))


# ---- plan_kv_pools: the same verdicts as data

pools_st = st.lists(
    st.builds(
        KVCachePool,
        st.integers(1, 50000),
        st.sampled_from([1, 16, 64]),
        st.integers(0, 20000),
        st.sampled_from(['', 'a', 'b']),
    ),
    max_size=4,
)


@given(pools_st, st.one_of(st.none(), st.integers(1, 200)))
@settings(max_examples=300, deadline=None)
def test_plan_is_what_the_check_does(pools, cap):
    plan = plan_kv_pools(pools, cap, 'serve.json')
    assert plan_kv_pools(pools, cap, 'serve.json') == plan  # pure: same input, same data
    fits = [kv_pages(p.max_seq_len, p.page_size, cap) <= p.max_num_pages if cap else p.max_requests >= 1 for p in pools]
    assert [p.fits for p in plan.pools] == fits and [p.label for p in plan.short] == [
        p.label for p in plan.pools if not p.fits
    ]
    assert plan.max_requests == (min(p.max_requests for p in pools) if pools else None)
    assert (plan.error is not None) == (not all(fits)) and plan.verdict == (
        'refused' if plan.error else 'warning' if plan.warnings else 'fits'
    )
    logger = logging.getLogger(LOGGER)
    try:
        check_kv_pools_fit(Model(pools), {'max_concurrent_requests': cap}, 'serve.json', logger)
        assert plan.error is None
    except ValueError as e:
        assert str(e) == plan.error
    if pools and cap is None and all(fits):
        assert len(plan.warnings) == 1
    if cap is not None and not plan.error:
        assert len(plan.warnings) == sum(
            10 * kv_pages(p.max_seq_len, p.page_size, cap) >= 9 * p.max_num_pages for p in pools
        )


def test_plan_without_pools():
    assert plan_kv_pools(None, 4, 'x') == KVPlan('x', 4) and plan_kv_pools([], None).verdict == 'fits'
    with pytest.raises(TypeError, match='got KVCachePool'):
        plan_kv_pools(KVCachePool(4096, 16, 1024), 1)
    with pytest.raises(ValueError, match='x: max_concurrent_requests must be at least 1'):
        plan_kv_pools(None, 0, 'x')


def test_plan_leaves_logging_alone(caplog):
    with caplog.at_level(logging.DEBUG):
        plan = plan_kv_pools([KVCachePool(4096, 16, 1025, 'text')], 4, 'serve.json')
    assert plan.verdict == 'warning' and caplog.records == []


# ---- KV geometry: resolved through transformers' config classes


def per_token(c, nbytes=2):
    "K and V of each KV head of one attention layer of text config `c`, from its attributes."
    head_dim = getattr(c, 'head_dim', None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_key_value_heads * head_dim * nbytes


def expected_figures(cfg, nbytes=2, convention='vllm'):
    "(bytes per token, fixed bytes per request) of a released config, from its own attributes, arch by arch."
    t = cfg.get_text_config(decoder=True)
    kinds = getattr(t, 'layer_types', None) or ['full_attention'] * t.num_hidden_layers
    n_full, n_slide, n_lin = (kinds.count(k) for k in ('full_attention', 'sliding_attention', 'linear_attention'))
    if getattr(t, 'kv_lora_rank', None):
        return n_full * (t.kv_lora_rank + t.qk_rope_head_dim) * nbytes, 0
    window = (
        t.sliding_window - (convention == 'transformers') if n_slide else 0
    )  # transformers keeps sliding_window - 1
    fixed = n_slide and n_slide * min(window, t.max_position_embeddings) * per_token(t, nbytes)
    if n_lin:
        conv = 2 * t.linear_num_key_heads * t.linear_key_head_dim + t.linear_num_value_heads * t.linear_value_head_dim
        # vLLM: conv_kernel - 1 positions, the state in the model dtype; transformers: conv_kernel positions, the state
        # in float32
        positions, ssm = (
            (t.linear_conv_kernel_dim - 1, nbytes) if convention == 'vllm' else (t.linear_conv_kernel_dim, 4)
        )
        fixed += n_lin * (
            conv * positions * nbytes + t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim * ssm
        )
    if cfg.is_encoder_decoder:
        fixed += cfg.decoder_layers * cfg.max_source_positions * per_token(t, nbytes)
    return n_full * per_token(t, nbytes), fixed


@pytest.mark.parametrize('arch', list(KV_ARCHITECTURES))
def test_released_architectures(arch):
    cfg = released_kv_config(arch)
    assert (kv_bytes_per_token(cfg), kv_fixed_bytes_per_request(cfg)) == expected_figures(cfg)
    theirs = expected_figures(cfg, convention='transformers')
    assert (
        kv_bytes_per_token(cfg, convention='transformers'),
        kv_fixed_bytes_per_request(cfg, convention='transformers'),
    ) == theirs
    assert (kv_bytes_per_token(cfg, 'float32'), kv_fixed_bytes_per_request(cfg, torch.float32))[0] == expected_figures(
        cfg, 4
    )[0]


def test_the_figures_of_the_issue():
    ds = released_kv_config('DeepSeek-V3')
    assert (
        kv_bytes_per_token(ds)
        == ds.num_hidden_layers * (ds.kv_lora_rank + ds.qk_rope_head_dim) * 2
        == 61 * 576 * 2
        == 70272
    )
    oss = released_kv_config('gpt-oss')
    g = kv_geometry(oss)
    assert g.kinds == {
        'full_attention': oss.layer_types.count('full_attention'),
        'sliding_attention': oss.layer_types.count('sliding_attention'),
    }
    assert g.kinds['full_attention'] == oss.num_hidden_layers // 2  # 18 of 36 grow: all 36 counted was 2x
    assert kv_bytes_per_token(oss) * 2 == oss.num_hidden_layers * per_token(oss)
    w = released_kv_config('Whisper')
    assert kv_geometry(w).kinds == {'full_attention': w.decoder_layers, 'cross_attention': w.decoder_layers}
    assert kv_geometry(w).max_seq_len == w.max_target_positions


def test_qwen2_vl_head_dim_from_hidden_size():
    t = released_kv_config('Qwen2-VL').get_text_config()
    assert getattr(t, 'head_dim', None) is None
    assert (
        kv_bytes_per_token(released_kv_config('Qwen2-VL'))
        == t.num_hidden_layers * 2 * t.num_key_value_heads * (t.hidden_size // t.num_attention_heads) * 2
    )


@pytest.mark.parametrize('arch', list(KV_ARCHITECTURES))
def test_layers_hold_what_transformers_caches(arch):
    cfg = tiny_kv_config(arch)
    g = kv_geometry(cfg, convention='transformers')
    for tokens in (2, 9):
        theirs = cache_layer_bytes(transformers_kv_cache(cfg, tokens))
        assert len(theirs) == len(g.layers)
        for layer, (cls, held) in zip(g.layers, theirs, strict=True):
            if layer.kind == 'cross_attention':
                assert held == layer.fixed_bytes == layer.tokens * layer.token_bytes
            elif layer.kind == 'linear_attention':
                assert held == layer.state_bytes and layer.token_bytes == 0
            elif layer.tokens is None:
                assert held == tokens * layer.token_bytes  # full attention, MLA
            else:  # transformers keeps window - 1, as its convention counts
                assert held == min(tokens, layer.tokens) * layer.token_bytes, (layer, cls, held)
    assert g.bytes_per_token * 9 + sum(layer.state_bytes for layer in g.layers) == sum(
        held
        for layer, (_, held) in zip(g.layers, cache_layer_bytes(transformers_kv_cache(cfg, 9)), strict=True)
        if layer.tokens is None
    )


def test_windows_are_the_configs():
    for arch in ('Gemma-3', 'gpt-oss'):
        t = released_kv_config(arch).get_text_config()
        windows = {
            layer.tokens for layer in kv_geometry(released_kv_config(arch)).layers if layer.kind == 'sliding_attention'
        }
        assert windows == {t.sliding_window}
    short = transformers.MistralConfig(
        sliding_window=4096, max_position_embeddings=1000, num_hidden_layers=2, dtype='bfloat16'
    )
    assert kv_bytes_per_token(short) == 0 and kv_fixed_bytes_per_request(short) == 2 * 1000 * per_token(short)


def test_gemma3_sparse_text_config(tmp_path):
    (tmp_path / 'config.json').write_text(json.dumps(gemma3_4b_it_config()))
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    t, defaults = cfg.get_text_config(), transformers.Gemma3TextConfig()
    assert 'num_attention_heads' not in gemma3_4b_it_config()['text_config']
    assert (t.num_key_value_heads, t.head_dim) == (defaults.num_key_value_heads, defaults.head_dim)
    expected = (
        t.layer_types.count('full_attention') * per_token(t),
        t.layer_types.count('sliding_attention') * t.sliding_window * per_token(t),
    )
    for source in (tmp_path, tmp_path / 'config.json', gemma3_4b_it_config(), cfg):
        assert (kv_bytes_per_token(source), kv_fixed_bytes_per_request(source)) == expected
    assert kv_geometry(tmp_path).dtype == 'bfloat16'  # torch_dtype at the top level only


def test_dtype_at_either_level():
    top = transformers.Gemma3Config(dtype='float16')
    assert top.text_config.dtype is None and kv_geometry(top).dtype == 'float16'
    inner = transformers.Gemma3Config(text_config=dict(dtype='float32'))
    assert kv_geometry(inner).dtype == 'float32'
    assert kv_bytes_per_token(inner) == 2 * kv_bytes_per_token(top)
    assert kv_geometry(inner, 'bfloat16').dtype == 'bfloat16'  # the argument wins
    with pytest.raises(ValueError, match='gemma3 config has no dtype'):
        kv_geometry(transformers.Gemma3Config())


def test_heterogeneous_head_dim_matches_transformers():
    "Gemma-4's global layers have their own head_dim: read per layer, as transformers does."
    cfg = transformers.Gemma4TextConfig(
        dtype='bfloat16',
        hidden_size=64,
        intermediate_size=64,
        vocab_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_hidden_layers=6,
        sliding_window=4,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=128,
    )
    g = kv_geometry(cfg)
    theirs = cache_layer_bytes(transformers_kv_cache(cfg, 9))
    assert [layer.token_bytes * (9 if layer.tokens is None else layer.tokens - 1) for layer in g.layers] == [
        b for _, b in theirs
    ]
    assert len({layer.token_bytes for layer in g.layers}) == 2


def test_smollm2_bytes_per_token_match_transformers():
    transformers.utils.logging.disable_progress_bar()
    ck = smollm2_checkpoint()
    lm = transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    with torch.no_grad():
        out = lm(torch.arange(5)[None], use_cache=True)
    ref = sum(b for _, b in cache_layer_bytes(output_cache(out))) / 5
    assert kv_bytes_per_token(ck) == kv_bytes_per_token(ck / 'config.json') == kv_bytes_per_token(lm.config) == ref
    assert kv_bytes_per_token(json.loads((ck / 'config.json').read_text())) == ref
    assert kv.kv_page_bytes(ck, 16) == 16 * ref and kv_fixed_bytes_per_request(ck) == 0


@pytest.mark.parametrize(
    'arch,kwargs',
    [
        (
            'LlamaConfig',
            dict(
                hidden_size=64,
                num_attention_heads=8,
                num_key_value_heads=2,
                num_hidden_layers=3,
                head_dim=16,
                intermediate_size=64,
                vocab_size=100,
            ),
        ),
        (
            'LlamaConfig',
            dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=100),
        ),
        (
            'Qwen2Config',
            dict(
                hidden_size=96,
                num_attention_heads=6,
                num_key_value_heads=3,
                num_hidden_layers=2,
                intermediate_size=64,
                vocab_size=100,
            ),
        ),
        ('GPT2Config', dict(n_embd=64, n_head=4, n_layer=3, vocab_size=100, bos_token_id=0, eos_token_id=0)),
    ],
)
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_random_models_bytes_per_token_match_transformers(arch, kwargs, dtype):
    cfg = getattr(transformers, arch)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        out = model(torch.arange(5)[None], use_cache=True)
    ref = sum(b for _, b in cache_layer_bytes(output_cache(out))) / 5
    assert kv_bytes_per_token(model.config, dtype) == ref
    assert kv_bytes_per_token(cfg.to_dict(), dtype) == ref  # GPT-2's n_layer resolves through GPT2Config


def test_geometry_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        kv_geometry(tmp_path)
    (tmp_path / 'config.json').write_text('{"num_hidden_layers": ')
    with pytest.raises(ValueError, match='config.json'):
        kv_geometry(tmp_path)
    (tmp_path / 'config.json').write_text('[]')
    with pytest.raises(ValueError, match='holds a JSON array, expected an object'):
        kv_geometry(tmp_path)
    (tmp_path / 'config.json').write_text('{"num_hidden_layers": 2}')
    with pytest.raises(ValueError, match='config.json has no model_type'):
        kv_geometry(tmp_path)
    with pytest.raises(ValueError, match="model_type 'nope' is not one transformers knows"):
        kv_geometry({'model_type': 'nope'})
    base = dict(model_type='llama', num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    with pytest.raises(ValueError, match='llama config has no dtype'):
        kv_geometry(base)
    with pytest.raises(ValueError, match="unknown dtype 'fp7'"):
        kv_geometry({**base, 'dtype': 'float16'}, 'fp7')
    with pytest.raises(ValueError, match='model config: transformers cannot build LlamaConfig from it'):
        kv_geometry({**base, 'dtype': 'bf16'})
    assert kv_geometry({**base, 'torch_dtype': 'float16'}).dtype == 'float16'
    with pytest.raises(ValueError, match='not a multiple'):
        kv_geometry(transformers.Qwen2VLTextConfig(hidden_size=66, num_attention_heads=4, dtype='bfloat16'))
    odd = transformers.LlamaConfig(num_hidden_layers=2, dtype='bfloat16')
    odd.layer_types = ['full_attention', 'linear_attention']
    with pytest.raises(
        ValueError, match="llama config: its linear_attention layers keep a state of a kind not counted"
    ):
        kv_geometry(odd)
    with pytest.raises(ValueError, match="convention must be one of"):
        kv_geometry(transformers.LlamaConfig(dtype='bfloat16'), convention='sglang')
    odd = transformers.LlamaConfig(num_hidden_layers=2, dtype='bfloat16')
    odd.layer_types = ['full_attention', 'window_attention']
    with pytest.raises(ValueError, match="layer 1 is 'window_attention'"):
        kv_geometry(odd)
    odd.layer_types = ['full_attention']
    with pytest.raises(ValueError, match='1 layer_types for 2 layers'):
        kv_geometry(odd)
    t5 = transformers.T5Config(dtype='bfloat16')
    with pytest.raises(ValueError, match='t5 config has no max_source_positions'):
        kv_geometry(t5)


# ---- report and plot for the CLI


def test_kv_report_smollm2():
    ck = smollm2_checkpoint()
    cfg = json.loads((ck / 'config.json').read_text())
    r = kf.kv_report(ck, page_size=16)
    assert r['kv_bytes_per_token'] == kv_bytes_per_token(cfg) and r['kv_fixed_bytes_per_request'] == 0
    assert r['pages_per_request'] == math.ceil(cfg['max_position_embeddings'] / 16)
    assert r['verdict'] is None and r['plan'] is None
    per = r['pages_per_request']
    assert kf.kv_report(ck, 16, 4 * per + 1, 4)['verdict'] == 'warning'
    assert kf.kv_report(ck, 16, 40 * per, 4)['verdict'] == 'fits'
    refused = kf.kv_report(ck, 16, 4 * per, 4)
    assert (
        refused['verdict'] == 'refused'
        and 'fits is 3' in refused['plan']['error']
        and refused['plan']['short'] == [ck.name]
    )
    nocap = kf.kv_report(ck, 16, 40 * per, None)
    assert nocap['verdict'] == 'warning' and 'unbounded' in nocap['plan']['warnings'][0]
    assert json.loads(json.dumps(refused)) == refused
    lines = kf.format_kv_report(refused)
    assert (
        str(r['kv_bytes_per_token']) in lines[0] and f'{per} pages of 16 tokens' in lines[1] and 'refused' in lines[2]
    )
    with pytest.raises(ValueError, match='max_concurrent_requests must be at least 1'):
        kf.kv_report(ck, 16, 4000, 0)
    with pytest.raises(ValueError, match='page_size must be at least 1'):
        kf.kv_report(ck, 0)


def test_kv_report_shows_both_figures(tmp_path):
    (tmp_path / 'config.json').write_text(json.dumps(gemma3_4b_it_config()))
    r = kf.kv_report(tmp_path, page_size=16, max_num_pages=100000, max_concurrent_requests=4)
    g = kv_geometry(tmp_path)
    assert (r['kv_bytes_per_token'], r['kv_fixed_bytes_per_request']) == (g.bytes_per_token, g.fixed_bytes)
    assert r['layers'] == g.kinds and r['max_seq_len'] == g.max_seq_len
    line = kf.format_kv_report(r)[0]
    assert f"{g.bytes_per_token} bytes per token" in line and f"{g.fixed_bytes} bytes fixed per request" in line


def test_save_kv_plot(tmp_path):
    import matplotlib.pyplot as plt

    p = kf.save_kv_plot(smollm2_checkpoint(), tmp_path / 'kv.png', page_size=32, max_num_pages=5000)
    assert p.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    fig = kf.plot_kv(smollm2_checkpoint(), page_size=32, max_num_pages=5000, budgets_gib=(2,))
    (left,), lines = fig.axes[0].lines, fig.axes[1].lines
    assert len(lines) == 2
    x, y = left.get_data()
    assert y[-1] == math.ceil(x[-1] / 32) == math.ceil(kv_geometry(smollm2_checkpoint()).max_seq_len / 32)
    x, y = lines[1].get_data()
    assert y[-1] == kv_max_requests(5000, 8192, 32)
    plt.close(fig)


def test_plot_counts_the_fixed_bytes():
    import matplotlib.pyplot as plt

    cfg = released_kv_config('gpt-oss')
    g = kv_geometry(cfg)
    fig = kf.plot_kv(cfg, page_size=16, budgets_gib=(1,), max_context=4096)
    x, y = fig.axes[1].lines[0].get_data()
    page = 16 * g.bytes_per_token
    assert all(c == (2**30 - page) // (math.ceil(t / 16) * page + g.fixed_bytes) for t, c in zip(x, y, strict=True))
    title = fig._suptitle.get_text()
    assert (
        f'{g.bytes_per_token:,} B per token' in title and f'{g.fixed_bytes / 2**20:.2f} MiB fixed per request' in title
    )
    plt.close(fig)


@pytest.mark.parametrize(
    'kwargs',
    [
        dict(multi_query=True, new_decoder_architecture=False),  # Falcon-7B: one KV head
        dict(multi_query=False, new_decoder_architecture=False),
    ],
)  # one KV head per query head
def test_falcon_kv_heads_match_transformers(kwargs):
    cfg = transformers.FalconConfig(
        hidden_size=64, num_attention_heads=8, num_hidden_layers=2, vocab_size=100, dtype='bfloat16', **kwargs
    )
    theirs = [b for _, b in cache_layer_bytes(transformers_kv_cache(cfg, tokens=9))]
    assert [layer.token_bytes * 9 for layer in kv_geometry(cfg).layers] == theirs


def test_falcon_grouped_layout_counts_its_kv_projection():
    """Falcon-40B's layout projects num_kv_heads K and V heads; transformers' cache broadcasts them to every query
    head, a paged cache (vLLM) keeps them grouped."""
    cfg = transformers.FalconConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_kv_heads=2,
        new_decoder_architecture=True,
        num_hidden_layers=2,
        vocab_size=100,
        dtype='bfloat16',
    )
    qkv = (
        transformers.FalconModel(cfg).h[0].self_attention.query_key_value.out_features
    )  # (heads + 2 x kv heads) x head_dim
    kv_channels = qkv - cfg.hidden_size
    assert kv_geometry(cfg).layers[0].token_bytes == kv_channels * 2 == 2 * 2 * 8 * 2


def tiny_mllama():
    return transformers.MllamaConfig(
        text_config=dict(
            hidden_size=64,
            intermediate_size=64,
            vocab_size=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=4,
            cross_attention_layers=[1, 3],
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_global_layers=1,
            attention_heads=2,
            image_size=28,
            patch_size=14,
            max_num_tiles=4,
            vision_output_dim=64,
            intermediate_layers_indices=[0],
        ),
        dtype='bfloat16',
        image_token_index=5,
    )


def test_mllama_cross_attention_holds_one_image():
    """Mllama's cross-attention layers hold the image's tiles x (patches + 1) positions, its other layers the text:
    as transformers' cache."""
    cfg = tiny_mllama()
    torch.manual_seed(0)
    model = transformers.MllamaForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([[5] + list(range(6, 14))]),
            pixel_values=torch.randn(1, 1, 4, 3, 28, 28, dtype=torch.bfloat16),
            aspect_ratio_ids=torch.tensor([[1]]),
            aspect_ratio_mask=torch.tensor([[[1, 0, 0, 0]]]),
            cross_attention_mask=torch.ones(1, 9, 1, 4, dtype=torch.long),
            use_cache=True,
        )
    theirs = [b for _, b in cache_layer_bytes(output_cache(out))]
    g = kv_geometry(cfg)
    assert [layer.kind for layer in g.layers] == [
        'full_attention',
        'cross_attention',
        'full_attention',
        'cross_attention',
    ]
    assert [layer.fixed_bytes if layer.tokens else 9 * layer.token_bytes for layer in g.layers] == theirs
    assert g.fixed_bytes == theirs[1] + theirs[3] and g.bytes_per_token * 9 == theirs[0] + theirs[2]
    with pytest.raises(ValueError, match='cross_attention_layers but no vision_config'):
        kv_geometry(transformers.MllamaTextConfig(dtype='bfloat16'))


def test_top_level_dtype_wins_over_text_config(tmp_path):
    """from_pretrained(dtype='auto') and vLLM take the top-level dtype: a text_config's own dtype only fills in for a
    missing one."""
    cfg = tiny_kv_config('Gemma-3')
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    d = json.loads((tmp_path / 'config.json').read_text())
    d['text_config']['dtype'] = 'float32'
    (tmp_path / 'config.json').write_text(json.dumps(d))
    assert transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, dtype='auto').dtype == torch.bfloat16
    assert kv.read_model_config(tmp_path).get_text_config().dtype == torch.float32
    assert kv_geometry(tmp_path).dtype == 'bfloat16'


def test_fp8_kv_cache_leaves_linear_states_in_the_model_dtype():
    """A KV cache dtype changes attention layers only: Gated DeltaNet's conv window stays in the model's dtype (as in
    vLLM), its recurrent state float32."""
    cfg = tiny_kv_config('Qwen3-Next')
    bf16, fp8 = kv_geometry(cfg), kv_geometry(cfg, 'float8_e4m3fn')
    for a, b in zip(bf16.layers, fp8.layers, strict=True):
        if a.kind == 'linear_attention':
            assert b.state_bytes == a.state_bytes
        else:
            assert 2 * b.token_bytes == a.token_bytes
