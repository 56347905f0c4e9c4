"KV pages, the admission check and KV geometry: every case of the issue, properties, and KV bytes against transformers' own caches."
import json, logging, math, os
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from mstar_utils import kv
from mstar_utils.kv import KVCachePool, check_kv_pools_fit, kv_pages, kv_max_requests, kv_bytes_per_token, kv_geometry
from mstar_utils.checkpoints import smollm2_checkpoint

LOGGER = 'tests.kv'


class Model:
    "The model protocol as the check sees it."
    def __init__(self, pools): self.pools = pools
    def get_kv_cache_config(self): return self.pools


def check(pools, cap, caplog, path='serve.json'):
    "Run the check on a model with `pools`; returns the warnings it logged."
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        check_kv_pools_fit(Model(pools), {} if cap is ... else {'max_concurrent_requests': cap}, path, logging.getLogger(LOGGER))
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


@pytest.mark.parametrize('args,what', [
    ((100, 0, 1), 'page_size'), ((100, -16, 1), 'page_size'), ((-1, 16, 1), 'tokens'), ((100, 16, -1), 'requests'),
    ((100.0, 16, 1), 'tokens'), ((100, 16.0, 1), 'page_size'), ((100, 16, 1.5), 'requests'), (('100', 16, 1), 'tokens'),
    ((None, 16, 1), 'tokens'), ((True, 16, 1), 'tokens'), ((100, 16, False), 'requests')])
def test_kv_pages_refuses(args, what):
    with pytest.raises(ValueError, match=what): kv_pages(*args)


@given(st.integers(0, 10**5), st.integers(1, 10**5), st.integers(1, 512))
def test_kv_max_requests_is_the_boundary(n, tokens, page_size):
    c = kv_max_requests(n, tokens, page_size)
    assert c >= 0
    assert kv_pages(tokens, page_size, c) <= n or c == 0
    assert kv_pages(tokens, page_size, c + 1) > n


# ---- check_kv_pools_fit: the cases

def test_13_pages_of_8192_hold_no_request_of_106496(caplog):
    pool = KVCachePool(max_seq_len=106496, page_size=8192, max_num_pages=13, name='text')
    assert 13 * 8192 == 106496
    with pytest.raises(ValueError) as e: check([pool], 1, caplog, path='/etc/mstar/serve.json')
    msg = str(e.value)
    for part in ('/etc/mstar/serve.json', "'text'", 'needs 14 pages', 'has 13', 'No max_concurrent_requests fits'):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match='cannot hold one request'): check([pool], ..., caplog)


def test_16384_token_pool_refuses_4_x_16384(caplog):
    pool = KVCachePool(max_seq_len=16384, page_size=16, max_num_pages=16384 // 16, name='p')
    with pytest.raises(ValueError) as e: check([pool], 4, caplog)
    msg = str(e.value)
    assert f'needs {4 * 1024 + 1} pages' in msg and 'has 1024' in msg and 'No max_concurrent_requests fits' in msg


def test_16384_token_pool_refuses_4_x_4096_for_the_sink(caplog):
    pool = KVCachePool(max_seq_len=4096, page_size=16, max_num_pages=1024, name='p')
    with pytest.raises(ValueError, match='needs 1025 pages.*has 1024.*largest max_concurrent_requests that fits is 3'):
        check([pool], 4, caplog)
    assert check([pool], 3, caplog) == []    # 3 fit: 769 of 1024 pages, not within 10%


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
    per = 512                         # 8192 / 16
    def pool(n): return KVCachePool(max_seq_len=8192, page_size=16, max_num_pages=n, name='text')
    need = 10 * per + 1
    assert check([pool(need * 10 // 9)], 10, caplog)                 # 90.0x% used: warns
    assert check([pool(need * 10 // 9 + 1)], 10, caplog) == []      # just under 90%: quiet
    assert check([pool(100 * per)], 10, caplog) == []
    assert 10 * need < 9 * (need * 10 // 9 + 1) and 10 * need >= 9 * (need * 10 // 9)


# ---- the protocol

def test_no_kv_cache_is_nothing_to_check(caplog):
    assert check(None, 4, caplog) == []
    assert check([], ..., caplog) == []
    assert check({}, ..., caplog) == []
    check_kv_pools_fit(object(), {'max_concurrent_requests': 4}, 'serve.json', logging.getLogger(LOGGER))


def test_any_object_with_the_attributes(caplog):
    pool = SimpleNamespace(max_seq_len=4096, page_size=16, max_num_pages=1024)
    with pytest.raises(ValueError, match="pool '#0' needs 1025"): check([pool], 4, caplog)
    assert check((pool,), 3, caplog) == []
    with pytest.raises(TypeError, match="pool '#0' .*no max_num_pages"):
        check([SimpleNamespace(max_seq_len=4096, page_size=16)], 1, caplog)


def test_dict_from_node_to_pool(caplog):
    pools = {'thinker': KVCachePool(32768, 16, 40000), 'talker': KVCachePool(4096, 16, 1000, name='codec')}
    with pytest.raises(ValueError) as e: check(pools, 4, caplog)
    msg = str(e.value)
    assert "'talker (codec)' needs 1025" in msg and 'thinker' not in msg and 'fits is 3' in msg
    (w,) = check(pools, ..., caplog)
    assert "'thinker': 19" in w and "'talker (codec)': 3" in w and 'fits is 3' in w


def test_every_short_pool_is_named(caplog):
    pools = [KVCachePool(4096, 16, 1024, 'a'), KVCachePool(4096, 16, 5000, 'b'), KVCachePool(8192, 16, 1500, 'c')]
    with pytest.raises(ValueError) as e: check(pools, 4, caplog)
    msg = str(e.value)
    assert "'a' needs 1025" in msg and "'c' needs 2049" in msg and "'b'" not in msg
    assert 'fits is 2' in msg     # min(1023 // 256, 4999 // 256, 1499 // 512)


def test_offload_pages_do_not_count(caplog):
    pool = KVCachePool(4096, 16, 1024, 'text', cpu_offload_pages=10**6)
    with pytest.raises(ValueError, match='needs 1025'): check([pool], 4, caplog)


@pytest.mark.parametrize('cap', [0, -1, 2.5, '4', True, [4]])
def test_bad_cap_is_refused(cap, caplog):
    with pytest.raises(ValueError, match='serve.json: max_concurrent_requests'):
        check([KVCachePool(4096, 16, 100000)], cap, caplog)


def test_bad_protocol_values(caplog):
    with pytest.raises(TypeError, match=r'Model.get_kv_cache_config\(\) returned KVCachePool'):
        check(KVCachePool(4096, 16, 1024), 1, caplog)
    with pytest.raises(ValueError, match="serve.json: KV cache pool 'x' page_size must be at least 1"):
        check([KVCachePool(4096, 0, 1024, 'x')], 1, caplog)


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


# ---- geometry against transformers

def _cache_bytes_per_token(model, n=5):
    import torch
    with torch.no_grad(): out = model(torch.arange(n)[None], use_cache=True)
    cache = out.cache if 'cache' in out else out.past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)) / n


def test_smollm2_bytes_per_token_match_transformers():
    import torch, transformers
    from transformers import AutoModelForCausalLM
    transformers.utils.logging.disable_progress_bar()
    ck = smollm2_checkpoint()
    lm = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    ref = _cache_bytes_per_token(lm)
    assert kv_bytes_per_token(ck) == ref
    assert kv_bytes_per_token(json.loads((ck/'config.json').read_text())) == ref
    assert kv_bytes_per_token(lm.config) == ref
    assert kv.kv_page_bytes(ck, 16) == 16 * ref


@pytest.mark.parametrize('arch,kwargs', [
    ('LlamaConfig', dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3, head_dim=16,
                         intermediate_size=64, vocab_size=100)),
    ('LlamaConfig', dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=100)),
    ('Qwen2Config', dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2,
                         intermediate_size=64, vocab_size=100)),
    ('GPT2Config', dict(n_embd=64, n_head=4, n_layer=3, vocab_size=100, bos_token_id=0, eos_token_id=0)),
])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_random_models_bytes_per_token_match_transformers(arch, kwargs, dtype):
    import torch, transformers
    cfg = getattr(transformers, arch)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).eval()
    assert kv_bytes_per_token(model.config, dtype) == _cache_bytes_per_token(model)
    if arch == 'GPT2Config':    # config.json spells it n_layer: the dict form needs transformers' names
        with pytest.raises(ValueError, match='no num_hidden_layers'): kv_bytes_per_token(cfg.to_dict(), dtype)
    else: assert kv_bytes_per_token(cfg.to_dict(), dtype) == _cache_bytes_per_token(model)


def test_geometry_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)): kv_geometry(tmp_path)
    (tmp_path/'config.json').write_text('{"num_hidden_layers": ')
    with pytest.raises(ValueError, match='config.json'): kv_geometry(tmp_path)
    (tmp_path/'config.json').write_text('[]')
    with pytest.raises(ValueError, match='JSON list'): kv_geometry(tmp_path)
    base = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    with pytest.raises(ValueError, match='no dtype'): kv_geometry(base)
    with pytest.raises(ValueError, match='no num_attention_heads'): kv_geometry(dict(num_hidden_layers=2, dtype='bf16'))
    with pytest.raises(ValueError, match='not a multiple'): kv_geometry({**base, 'hidden_size': 66, 'dtype': 'bf16'})
    with pytest.raises(ValueError, match='kv_lora_rank'): kv_geometry({**base, 'dtype': 'bf16', 'kv_lora_rank': 512})
    with pytest.raises(ValueError, match='unknown dtype'): kv_geometry({**base, 'dtype': 'int3'})
    assert kv_geometry({**base, 'torch_dtype': 'float16'})['dtype_bytes'] == 2


# ---- report and plot for the CLI

def test_kv_report_smollm2():
    ck = smollm2_checkpoint()
    cfg = json.loads((ck/'config.json').read_text())
    r = kv.kv_report(ck, page_size=16)
    assert r['kv_bytes_per_token'] == kv_bytes_per_token(cfg)
    assert r['pages_per_request'] == math.ceil(cfg['max_position_embeddings'] / 16)
    assert r['verdict'] is None
    per = r['pages_per_request']
    assert kv.kv_report(ck, 16, 4 * per + 1, 4)['verdict'] == 'warning'
    assert kv.kv_report(ck, 16, 40 * per, 4)['verdict'] == 'fits'
    refused = kv.kv_report(ck, 16, 4 * per, 4)
    assert refused['verdict'] == 'refused' and 'fits is 3' in refused['error']
    nocap = kv.kv_report(ck, 16, 40 * per, None)
    assert nocap['verdict'] == 'warning' and 'unbounded' in nocap['warnings'][0]
    lines = kv.format_kv_report(refused)
    assert str(r['kv_bytes_per_token']) in lines[0] and f'{per} pages of 16 tokens' in lines[1] and 'refused' in lines[2]
    assert not logging.getLogger('mstar_utils.kv.report').handlers


def test_save_kv_plot(tmp_path):
    p = kv.save_kv_plot(smollm2_checkpoint(), tmp_path/'kv.png', page_size=32, max_num_pages=5000)
    assert p.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    fig = kv.plot_kv(smollm2_checkpoint(), page_size=32, max_num_pages=5000, budgets_gib=(2,))
    (left,), lines = fig.axes[0].lines, fig.axes[1].lines
    assert len(lines) == 2
    x, y = left.get_data()
    assert y[-1] == math.ceil(x[-1] / 32) == 256
    x, y = lines[1].get_data()
    assert y[-1] == kv_max_requests(5000, 8192, 32)
    import matplotlib.pyplot as plt
    plt.close(fig)
