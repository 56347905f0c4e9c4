"Hybrid KV planning: recurrent states in both conventions, the shared pool, vLLM's logged figures, the curve, inspect."

import json
import math
import os
import random

import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import torch
import transformers
from mstar_utils.kv import (
    KVCachePool,
    check_kv_pools_fit,
    kv_bytes_per_token,
    kv_cache_pool,
    kv_fixed_bytes_per_request,
    kv_geometry,
    plan_kv_pools,
    vllm_concurrency,
)
from mstar_utils.kv_figures import kv_curve, plot_kv_curve
from mstar_utils.testing import cache_layer_bytes, transformers_kv_cache

transformers.utils.logging.set_verbosity_error()

_T = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
TINY = {  # small configs of each named hybrid's class, with its own mix of layers
    'Jamba': lambda: transformers.JambaConfig(
        **_T,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=2,
        expert_layer_period=2,
        mamba_d_state=8,
        use_mamba_kernels=False,
    ),
    'Bamba': lambda: transformers.BambaConfig(
        **_T,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=2,
    ),
    'Falcon-H1': lambda: transformers.FalconH1Config(
        **_T, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16
    ),
    'Nemotron-H': lambda: transformers.NemotronHConfig(
        **_T,
        head_dim=16,
        num_hidden_layers=3,
        layers_block_type=['mamba', 'attention', 'mlp'],
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
    ),
    'LFM2': lambda: transformers.Lfm2Config(**_T, num_hidden_layers=3, full_attn_idxs=[1]),
    'DeepSeek-V3.2': lambda: transformers.DeepseekV32Config(
        **{**_T, 'num_key_value_heads': 4},
        num_hidden_layers=2,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=4,
    ),
}


def tiny(arch, dtype=torch.bfloat16):
    cfg = TINY[arch]()
    cfg.dtype = dtype
    return cfg


# ---- transformers' own caches, layer by layer (transformers convention)


@pytest.mark.parametrize('arch', list(TINY))
def test_tiny_hybrids_hold_what_transformers_caches(arch):
    cfg = tiny(arch)
    g = kv_geometry(cfg, convention='transformers')
    for tokens in (3, 8):
        theirs = cache_layer_bytes(transformers_kv_cache(cfg, tokens))
        mine = [layer for layer in g.layers]
        assert len(theirs) >= len(mine)
        held = sum(b for _, b in theirs)
        if arch == 'DeepSeek-V3.2':  # cache_layer_bytes reads keys and values; the indexer keys come on top
            cache = transformers_kv_cache(cfg, tokens)
            held += sum(layer.indexer_keys.numel() * layer.indexer_keys.element_size() for layer in cache.layers)
        assert held == tokens * g.bytes_per_token + g.fixed_bytes, (arch, tokens)


# ---- released shapes against the per-layer formulas, from each config's own attributes


def released(name, **kw):
    return getattr(transformers, name)(dtype='bfloat16', **kw)


def test_released_jamba():
    c = released('JambaConfig')
    inner, n_attn = c.mamba_expand * c.hidden_size, c.num_hidden_layers // c.attn_layer_period
    per_token = n_attn * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    mamba = c.num_hidden_layers - n_attn
    assert kv_bytes_per_token(c) == per_token
    assert kv_fixed_bytes_per_request(c) == mamba * (inner * (c.mamba_d_conv - 1) * 2 + inner * c.mamba_d_state * 2)
    assert kv_fixed_bytes_per_request(c, convention='transformers') == mamba * (
        inner * c.mamba_d_conv * 2 + inner * c.mamba_d_state * 4
    )


@pytest.mark.parametrize(
    'name,kw,keys',
    [
        (
            'BambaConfig',
            dict(attn_layer_indices=[9, 18, 27]),
            ('mamba_n_heads', 'mamba_d_head', 'mamba_n_groups', 'mamba_d_state', 'mamba_d_conv'),
        ),
        ('FalconH1Config', {}, ('mamba_n_heads', 'mamba_d_head', 'mamba_n_groups', 'mamba_d_state', 'mamba_d_conv')),
        ('NemotronHConfig', {}, ('mamba_num_heads', 'mamba_head_dim', 'n_groups', 'ssm_state_size', 'conv_kernel')),
        (
            'GraniteMoeHybridConfig',
            dict(layer_types=['mamba'] * 3 + ['attention'] + ['mamba'] * 28),
            ('mamba_n_heads', 'mamba_d_head', 'mamba_n_groups', 'mamba_d_state', 'mamba_d_conv'),
        ),
        ('Zamba2Config', {}, ('n_mamba_heads', 'mamba_headdim', 'mamba_ngroups', 'mamba_d_state', 'mamba_d_conv')),
        ('Mamba2Config', {}, ('num_heads', 'head_dim', 'n_groups', 'state_size', 'conv_kernel')),
    ],
)
def test_released_mamba2(name, kw, keys):
    c = released(name, **kw)
    heads, head_dim, groups, state, kernel = (getattr(c, k) for k in keys)
    conv = heads * head_dim + 2 * groups * state
    ssm_bytes = 4 if getattr(c, 'mamba_ssm_cache_dtype', None) == 'float32' else 2  # vLLM reads it (Nemotron-H)
    layers = [layer for layer in kv_geometry(c).layers if layer.state]
    assert layers and {layer.state for layer in layers} == {'mamba2'}
    assert {layer.state_bytes for layer in layers} == {conv * (kernel - 1) * 2 + heads * head_dim * state * ssm_bytes}
    theirs = {layer.state_bytes for layer in kv_geometry(c, convention='transformers').layers if layer.state}
    assert theirs == {conv * kernel * 2 + heads * head_dim * state * 4}


@pytest.mark.parametrize('name', ['MambaConfig', 'FalconMambaConfig'])
def test_released_mamba1(name):
    c = released(name)
    g = kv_geometry(c)
    assert g.bytes_per_token == 0 and g.kinds == {'linear_attention': c.num_hidden_layers}
    assert g.fixed_bytes == c.num_hidden_layers * (
        c.intermediate_size * (c.conv_kernel - 1) * 2 + c.intermediate_size * c.state_size * 2
    )


def test_released_lfm2_short_conv():
    c = released('Lfm2Config', full_attn_idxs=[2, 5, 8, 10, 12, 14])  # LFM2-1.2B's layout
    g = kv_geometry(c)
    n_conv = c.num_hidden_layers - 6
    assert g.kinds == {'conv': n_conv, 'full_attention': 6}
    assert g.fixed_bytes == n_conv * c.hidden_size * (c.conv_L_cache - 1) * 2
    assert kv_fixed_bytes_per_request(c, convention='transformers') == n_conv * c.hidden_size * c.conv_L_cache * 2
    assert g.bytes_per_token == 6 * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2


def test_released_deepseek_v32_indexer():
    c = released('DeepseekV32Config')
    latent = (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    # vLLM: the indexer key in fp8 plus a float32 scale per 128 values (DeepseekV32IndexerCache, head_dim + head_dim //
    # 128 * 4)
    assert (
        kv_bytes_per_token(c)
        == c.num_hidden_layers * (latent + c.index_head_dim + c.index_head_dim // 128 * 4)
        == 61 * 1284
    )
    assert kv_bytes_per_token(c, convention='transformers') == c.num_hidden_layers * (latent + c.index_head_dim * 2)
    # leaving the indexer out undercounts by 11 % in vLLM's layout (sgl-project/sglang PR 11309: 54.52 GB planned, 65.49
    # GB taken)
    assert kv_bytes_per_token(released('DeepseekV3Config')) == c.num_hidden_layers * latent


def test_released_glm5_next_pooled_indexer():
    c = released('Glm5NextTextConfig')
    indexed = [i for i, k in enumerate(c.layer_types) if k == 'indexed_attention']
    # transformers' DynamicIndexedLayer: the latent (no rotary part), and in each layer that runs its own indexer a
    # packed row of the key, the pool gate's score and a validity flag (Glm5NextTextIndexer.forward)
    row = 2 * c.index_head_dim + 1
    full = [i for i in indexed if c.indexer_types[i] == 'full']
    assert kv_bytes_per_token(c, convention='transformers') == (len(indexed) * c.kv_lora_rank + len(full) * row) * 2
    k = c.linear_num_heads * c.linear_head_dim
    n = c.layer_types.count('linear_attention')
    assert kv_fixed_bytes_per_request(c, convention='transformers') == n * (
        3 * k * c.linear_conv_kernel_dim * 2 + c.linear_num_heads * c.linear_head_dim**2 * 4
    )
    with pytest.raises(
        ValueError, match="glm5_next_text config: vLLM 0.32 keeps the pooled indexer.*convention='transformers'"
    ):
        kv_geometry(c)
    with pytest.raises(ValueError, match="convention='transformers'"):
        kv_geometry(released('Glm5NextConfig'))


def test_released_qwen3_next_and_kimi_linear():
    q = released('Qwen3NextConfig')
    conv = 2 * q.linear_num_key_heads * q.linear_key_head_dim + q.linear_num_value_heads * q.linear_value_head_dim
    ssm = q.linear_num_value_heads * q.linear_key_head_dim * q.linear_value_head_dim
    n = q.layer_types.count('linear_attention')
    assert kv_fixed_bytes_per_request(q) == n * (conv * (q.linear_conv_kernel_dim - 1) * 2 + ssm * 2)
    k = released('KimiLinearConfig')
    n = k.layer_types.count('linear_attention')
    conv, ssm = 3 * k.linear_num_heads * k.linear_head_dim, k.linear_num_heads * k.linear_head_dim**2
    assert kv_fixed_bytes_per_request(k) == n * (
        conv * (k.linear_conv_kernel_dim - 1) * 2 + ssm * 4
    )  # vLLM: KDA's state in float32


def test_minimax_lightning_state():
    c = released('MiniMaxConfig')
    d = c.hidden_size // c.num_attention_heads
    n = c.layer_types.count('linear_attention')
    assert (
        kv_fixed_bytes_per_request(c)
        == kv_fixed_bytes_per_request(c, convention='transformers')
        == n * c.num_attention_heads * d * d * 2
    )


def test_fp8_cache_leaves_states_alone():
    c = tiny('Jamba')
    a, b = kv_geometry(c), kv_geometry(c, 'float8_e4m3fn')
    assert a.fixed_bytes == b.fixed_bytes and a.bytes_per_token == 2 * b.bytes_per_token


def test_not_counted_kinds_are_named():
    with pytest.raises(ValueError, match="deepseek_v4 config: layer 0 is DeepSeek-V4's heavily compressed attention"):
        kv_geometry(released('DeepseekV4Config'))
    with pytest.raises(ValueError, match="rwkv config: RWKV's time-mix and channel-mix states are not counted"):
        kv_geometry(released('RwkvConfig'))
    odd = released('LlamaConfig', num_hidden_layers=2)
    odd.layer_types = ['full_attention', 'linear_attention']
    with pytest.raises(
        ValueError, match='llama config: its linear_attention layers keep a state of a kind not counted'
    ):
        kv_geometry(odd)
    bad = tiny('Bamba')
    bad.mamba_d_conv = None
    with pytest.raises(ValueError, match='bamba config has Mamba-2 layers but no mamba_d_conv or conv_kernel'):
        kv_geometry(bad)


# ---- the shared pool: a paged-allocator simulation against the admission check, 10,000 random hybrids

FAMILIES = {  # a class, the keys its random shapes draw, the layer types it mixes
    'jamba': (
        transformers.JambaConfig(dtype='bfloat16'),
        dict(
            mamba_d_state=(1, 64),
            mamba_d_conv=(2, 8),
            mamba_expand=(1, 4),
            attn_layer_period=(1, 4),
            attn_layer_offset=(0, 0),
        ),  # Jamba's layer_types follow these
        ('linear_attention', 'full_attention'),
    ),
    'bamba': (
        transformers.BambaConfig(dtype='bfloat16'),
        dict(
            mamba_n_heads=(1, 16),
            mamba_d_head=(1, 64),
            mamba_n_groups=(1, 4),
            mamba_d_state=(1, 64),
            mamba_d_conv=(2, 8),
        ),
        ('linear_attention', 'full_attention'),
    ),
    'falcon_h1': (
        transformers.FalconH1Config(dtype='bfloat16'),
        dict(
            mamba_n_heads=(1, 16),
            mamba_d_head=(1, 64),
            mamba_n_groups=(1, 4),
            mamba_d_state=(1, 64),
            mamba_d_conv=(2, 8),
        ),
        ('hybrid',),
    ),
    'lfm2': (transformers.Lfm2Config(dtype='bfloat16'), dict(conv_L_cache=(2, 8)), ('conv', 'full_attention')),
    'qwen3_next': (
        transformers.Qwen3NextConfig(dtype='bfloat16'),
        dict(
            linear_num_key_heads=(1, 8),
            linear_num_value_heads=(1, 8),
            linear_key_head_dim=(1, 64),
            linear_value_head_dim=(1, 64),
            linear_conv_kernel_dim=(2, 8),
        ),
        ('linear_attention', 'full_attention', 'sliding_attention'),
    ),
}


def random_hybrid(rng):
    "A config of a real hybrid class with random shapes and a random layout that attends at least once."
    base, keys, kinds = FAMILIES[rng.choice(sorted(FAMILIES))]
    c = type(base).__new__(type(base))  # the class's own attributes, drawn anew: no __init__ (4 ms) per sample
    c.__dict__.update(vars(base))
    draw = {k: rng.randint(lo, hi) for k, (lo, hi) in keys.items()}
    draw['hidden_size'], draw['num_attention_heads'] = rng.choice([(64, 4), (128, 8), (256, 4)])
    draw.update(
        num_key_value_heads=rng.choice([1, 2, 4]), head_dim=rng.choice([8, 16, 32]), sliding_window=rng.randint(2, 64)
    )
    n = rng.randint(1, 12)
    layer_types = [rng.choice(kinds) for _ in range(n)]
    if not any(k in ('full_attention', 'hybrid') for k in layer_types):
        layer_types[rng.randrange(n)] = kinds[1] if len(kinds) > 1 else kinds[0]
    draw.update(num_hidden_layers=n, layer_types=layer_types, dtype=rng.choice(['bfloat16', 'float32']))
    c.__dict__.update(draw)
    return c


class Allocator:
    "A paged pool of `pages` pages of `page_bytes` bytes: page 0 is the sink, a request's pages are taken as it writes."

    def __init__(self, pages, page_bytes):
        self.free, self.page_bytes = pages - 1, page_bytes

    def take(self) -> bool:
        if self.free == 0:
            return False
        self.free -= 1
        return True

    def run(self, layers, tokens, page_size) -> bool:
        "Admit one request and write its states layer by layer, then `tokens` tokens; False when a page is missing."
        room = 0  # bytes left in the request's current state page
        for layer in layers:
            need = layer.fixed_bytes
            while need > room:
                need -= room
                if not self.take():
                    return False
                room = self.page_bytes
            room -= need
        return all(self.take() for _ in range(0, tokens, page_size))  # a token that starts a page takes one


class Model:
    def __init__(self, pool):
        self.pool = pool

    def get_kv_cache_config(self):
        return [self.pool]


def test_allocator_admits_exactly_what_the_check_accepts():
    rng = random.Random(26)
    for i in range(10_000):
        while not (g := kv_geometry(cfg := random_hybrid(rng))).bytes_per_token:
            pass  # a layout that attends
        page_size, seq = rng.choice([1, 2, 4, 16, 32, 64]), rng.randint(1, 256)
        pool = kv_cache_pool(cfg, page_size, max_num_pages=rng.randint(1, 400), max_seq_len=seq)
        alloc, admitted = Allocator(pool.max_num_pages, page_size * g.bytes_per_token), 0
        while alloc.run(g.layers, seq, page_size):
            admitted += 1
        assert plan_kv_pools([pool]).max_requests == admitted, (i, cfg.model_type, pool)
        if admitted:
            check_kv_pools_fit(Model(pool), {'max_concurrent_requests': admitted}, 'serve.json')
        with pytest.raises(ValueError, match=f'max_concurrent_requests: {admitted + 1} does not fit'):
            check_kv_pools_fit(Model(pool), {'max_concurrent_requests': admitted + 1}, 'serve.json')


def test_refusal_names_the_fixed_pages():
    pool = kv_cache_pool(tiny('Jamba'), 16, max_num_pages=40, max_seq_len=64)
    assert pool.fixed_pages_per_request > 0
    with pytest.raises(ValueError, match=rf'{pool.fixed_pages_per_request} of them fixed state'):
        check_kv_pools_fit(Model(pool), {'max_concurrent_requests': 100}, 'serve.json')


def test_pool_by_bytes():
    c = released('JambaConfig')
    page = 16 * kv_bytes_per_token(c)
    assert kv_cache_pool(c, 16, budget_bytes=10 * page + page - 1).max_num_pages == 10
    with pytest.raises(ValueError, match='no layer grows with the sequence'):
        kv_cache_pool(released('MambaConfig'), 16, max_num_pages=9)
    with pytest.raises(ValueError, match='max_num_pages or budget_bytes'):
        kv_cache_pool(c, 16)


# ---- vLLM's logged figures

QWEN15_7B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, dtype='float16'
)


def test_vllm_figures_of_its_own_test():
    # vLLM tests/v1/core/test_kv_cache_utils.py::test_get_max_concurrency_for_kv_cache_config: Qwen/Qwen1.5-7B, fp16,
    # max_model_len=16384, max_num_batched_tokens=1024, FullAttentionSpec/SlidingWindowSpec(block_size=16, 32 KV heads
    # of 128)
    full = transformers.Qwen2Config(**QWEN15_7B, num_hidden_layers=32)
    window = transformers.MistralConfig(**QWEN15_7B, num_hidden_layers=32, sliding_window=1024)
    both = transformers.Qwen2Config(
        **QWEN15_7B,
        num_hidden_layers=64,
        use_sliding_window=True,
        sliding_window=1024,
        layer_types=['full_attention'] * 32 + ['sliding_attention'] * 32,
    )
    # "num_blocks=int(1024 * 1.5) ... assert max_concurrency_full_attention == 1.5"
    assert vllm_concurrency(full, int(1024 * 1.5), 16, 16384, max_num_batched_tokens=1024).max_concurrency == 1.5
    # "num_blocks=129 * 3 ... assert max_concurrency_sliding_window == 3"
    v = vllm_concurrency(window, 129 * 3, 16, 16384, max_num_batched_tokens=1024)
    assert v.max_concurrency == 3 and v.blocks_per_request == 129
    # "num_blocks=(1024 + 129) * 3 ... assert max_concurrency_hybrid_model == 3"
    v = vllm_concurrency(both, (1024 + 129) * 3, 16, 16384, max_num_batched_tokens=1024)
    assert v.max_concurrency == 3 and [(gr.kind, gr.layers) for gr in v.groups] == [
        ('full_attention', 32),
        ('sliding_attention', 32),
    ]
    assert v.message == 'Maximum concurrency for 16,384 tokens per request: 3.00x'
    assert v.admitted == 2  # the null block: 3458 free blocks hold two requests of 1153


@pytest.mark.parametrize('seed', range(20))
def test_vllm_admitted_is_our_check(seed):
    rng = random.Random(seed)
    cfg = transformers.Qwen2Config(
        hidden_size=rng.choice([64, 128, 256]),
        num_attention_heads=4,
        num_key_value_heads=rng.choice([1, 2, 4]),
        num_hidden_layers=rng.randint(1, 40),
        max_position_embeddings=rng.randint(1, 10**5),
        dtype='bfloat16',
    )
    bs, blocks = rng.choice([1, 16, 32, 128]), rng.randint(1, 10**5)
    v = vllm_concurrency(cfg, blocks, bs)
    pool = kv_cache_pool(cfg, bs, max_num_pages=blocks)
    assert v.blocks_per_request == math.ceil(cfg.max_position_embeddings / bs)
    assert v.admitted == plan_kv_pools([pool]).max_requests
    assert v.max_concurrency == blocks / v.blocks_per_request >= v.admitted


def test_vllm_mamba_groups():
    c = released(
        'JambaConfig'
    )  # 4 attention + 28 Mamba layers: groups of 4; without prefix caching a Mamba group takes one block
    v = vllm_concurrency(c, 10_000, 528, max_model_len=32768, prefix_caching=False)
    assert sorted((gr.kind, gr.layers) for gr in v.groups) == sorted([('mamba', 4)] * 7 + [('full_attention', 4)])
    assert v.blocks_per_request == 7 + math.ceil(32768 / 528)


# ---- the curve


def test_curve_limits_and_the_cap():
    c = released('JambaConfig')
    curve = kv_curve(c, max_num_pages=80_000, page_size=16, max_concurrent_requests=32, max_seq_len=262144)
    p = curve.pool
    assert curve.fixed_state == (p.max_num_pages - 1) * curve.page_bytes / kv_fixed_bytes_per_request(c)
    assert all(f <= min(a, b) + 1e-9 for f, a, b in zip(curve.fits, curve.per_token, curve.unrounded, strict=True))
    assert curve.fits == tuple(
        (p.max_num_pages - 1) // (math.ceil(t / 16) + p.fixed_pages_per_request) for t in curve.context
    )
    reach = curve.cap_fits_to
    assert (
        plan_kv_pools(
            [KVCachePool(reach, 16, p.max_num_pages, fixed_pages_per_request=p.fixed_pages_per_request)], 32
        ).error
        is None
    )
    assert plan_kv_pools(
        [KVCachePool(reach + 1, 16, p.max_num_pages, fixed_pages_per_request=p.fixed_pages_per_request)], 32
    ).error
    import matplotlib.pyplot as plt

    fig = plot_kv_curve(curve)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert any(s.startswith('per-token pool') for s in labels) and any(s.startswith('fixed state') for s in labels)
    assert any(s.startswith('page rounding') for s in labels) and any(
        f'max_concurrent_requests 32 fits up to {reach:,}' in s for s in labels
    )
    plt.close(fig)


# ---- inspect on tiny folders of each named hybrid


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    out = {}
    for arch in TINY:
        d = tmp_path_factory.mktemp(arch)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(tiny(arch), dtype=torch.bfloat16).save_pretrained(d)
        out[arch] = d
    return out


@pytest.mark.parametrize('arch', list(TINY))
def test_inspect_prints_kv_figures(arch, folders, capsys, tmp_path):
    from mstar_utils.cli import inspect

    d = folders[arch]
    png, g = tmp_path / 'kv.png', kv_geometry(d)
    pool = kv_cache_pool(d, 16, max_num_pages=1)
    pages = (
        2 * (math.ceil(g.max_seq_len / 16) + pool.fixed_pages_per_request) + 1
    )  # two requests at max_seq_len, exactly
    assert inspect(str(d), kv_pages=pages, max_concurrent_requests=2, plot=str(png)) == 0
    out = capsys.readouterr().out
    assert f'KV check ({pages} pages, max_concurrent_requests 2): warning' in out
    assert f'KV cache: {g.bytes_per_token} bytes per token and {g.fixed_bytes} bytes fixed per request' in out
    assert 'not computed' not in out and png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    rep = json.loads((d / 'config.json').read_text())
    assert rep['model_type'] == g.model_type
