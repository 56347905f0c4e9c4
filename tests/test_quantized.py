"""Quantized checkpoints: each format's dequantization against transformers' and compressed-tensors' own code, both
loading modes against the dequantized reference model, refusals, MLA and tensor-parallel block slices."""

import json
import re
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from mstar_utils.upstream import fp4_values, fp8_dequantize_reference, mxfp4_dequantize_reference
from transformers.utils import logging as hf_logging
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from mstar_utils.convert import group_keys
from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards, process_weights_after_loading
from mstar_utils.mla import MLAAttention, rope_freqs
from mstar_utils.model import CONVERSIONS_BY_MODEL_TYPE, build_on_meta, load_model
from mstar_utils.quantized import *
from mstar_utils.quant_float import *
from mstar_utils.quant_int import *
from mstar_utils.quantized import _fragments
from mstar_utils.quant_float import _ct_scheme
from mstar_utils.sources import DictSource, checkpoint_source
from mstar_utils.testing import (
    assert_state_dict_equal,
    assert_tensors_equal,
    dequantized_reference,
    fp8_block_quantize,
    quantized_configs,
    write_compressed_tensors_checkpoint,
    write_quantized_checkpoint,
)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
FORMATS = list(quantized_configs())
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 17]])


def logits(m):
    with torch.no_grad():
        return m(IDS).logits


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp('quantized')
    return {fmt: write_quantized_checkpoint(fmt, root / fmt) for fmt in FORMATS}


@pytest.fixture(scope='module')
def refs(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp('reference')
    return {fmt: dequantized_reference(d, root / fmt) for fmt, d in ckpts.items()}


def config_of(d):
    return json.loads((d / 'config.json').read_text())


# ---- the operations against the formats' own code


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.sampled_from([(128, 128), (16, 32), (1, 64)]), st.integers(0, 2))
def test_fp8_block_matches_transformers(R, C, block, experts):
    shape = (experts, R, C) if experts else (R, C)
    w = (torch.randn(shape) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(scale_grid(shape, block)) + 1e-3
    op = FP8BlockDequantize(block, torch.float32)
    assert op.mismatch([w.shape, s.shape]) is None
    assert_tensors_equal(op.apply([w, s]), fp8_dequantize_reference(w, s, list(block), torch.float32))
    if not experts:  # compressed-tensors' converter, bf16 out: the float32 product rounded once
        assert_tensors_equal(
            FP8BlockDequantize(block).apply([w, s]),
            FP8BlockDequantizer(weight_block_size=block, dtype=torch.bfloat16)._create_dequantized_weight(w, s),
        )


def test_fp8_per_tensor_and_e8m0_scales():
    w = (torch.randn(5, 7) * 10).to(torch.float8_e4m3fn)
    assert_tensors_equal(
        FP8BlockDequantize((None, None), torch.float32).apply([w, torch.tensor([0.5])]), w.float() * 0.5
    )
    e = torch.randint(100, 140, (2, 1), dtype=torch.uint8)  # ue8m0 scales stored as bytes
    assert_tensors_equal(
        FP8BlockDequantize((4, 7), torch.float32).apply([w, e]),
        fp8_dequantize_reference(w, e.view(torch.float8_e8m0fnu).float(), [4, 7], torch.float32),
    )


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2), st.integers(1, 40), st.integers(1, 4))
def test_mxfp4_matches_transformers(E, R, G):
    shape = (E, R, G) if E else (R, G)
    blocks, scales = (
        torch.randint(0, 256, (*shape, 16), dtype=torch.uint8),
        torch.randint(100, 150, shape, dtype=torch.uint8),
    )
    if not E:
        blocks, scales = blocks[None], scales[None]  # transformers' converter wants an expert axis
    for dt in (torch.float32, torch.bfloat16):
        assert_tensors_equal(
            MXFP4Dequantize(dt).apply([blocks, scales]), mxfp4_dequantize_reference(blocks, scales, dtype=dt)
        )


def test_e8m0_nan_and_fp4_table():
    assert e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).isnan().all()
    assert list(FP4_E2M1) == fp4_values()


def scheme(**w):
    return QuantizationScheme(targets=['Linear'], weights=QuantizationArgs(**w))


# num_bits, strategy, group/block, symmetric, R, C: rows and columns that are not multiples of anything where the format
# allows
CT_CASES = [
    (4, 'group', 32, False, 13, 64),
    (4, 'group', 128, True, 3, 256),
    (4, 'channel', None, True, 5, 100),
    (4, 'channel', None, False, 17, 7),
    (8, 'channel', None, False, 9, 33),
    (8, 'channel', None, True, 4, 5),
    (2, 'group', 16, True, 3, 48),
    (4, 'tensor', None, True, 4, 40),
]
BLOCKS = {'group': lambda g: (1, g), 'channel': lambda g: (1, None), 'tensor': lambda g: (None, None)}


@pytest.mark.parametrize('bits,strategy,g,sym,R,C', CT_CASES)
def test_pack_quantized_matches_compressed_tensors(bits, strategy, g, sym, R, C):
    torch.manual_seed(R * C + bits)
    sc = scheme(num_bits=bits, type='int', strategy=strategy, symmetric=sym, **({'group_size': g} if g else {}))
    grid = {'group': (R, C // (g or 1)), 'channel': (R, 1), 'tensor': (1,)}[strategy]
    sd = {
        'weight': torch.randn(R, C, dtype=torch.bfloat16),
        'weight_scale': (torch.rand(grid) * 0.1 + 0.01).to(torch.bfloat16),
    }
    if not sym:
        sd['weight_zero_point'] = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), grid, dtype=torch.int8)
    packed = PackedQuantizationCompressor.compress(sd, sc)
    op = PackQuantizedDequantize(bits, BLOCKS[strategy](g), (R, C), sym)
    ins = [packed['weight' + s] for s in op.suffixes]
    assert op.mismatch([t.shape for t in ins]) is None
    assert_tensors_equal(op.apply(ins), PackedQuantizationCompressor.decompress(packed, sc)['weight'])


# activation-ordered groups (actorder "group"): num_bits, group_size, symmetric, R, C, dtype
AO_CASES = [
    (4, 16, False, 6, 64, torch.bfloat16),
    (4, 32, True, 13, 128, torch.bfloat16),
    (8, 16, False, 5, 48, torch.float16),
    (2, 16, True, 3, 64, torch.float32),
]


@pytest.mark.parametrize('bits,n,sym,R,C,dtype', AO_CASES)
def test_pack_quantized_actorder_matches_compressed_tensors(bits, n, sym, R, C, dtype):
    """`weight_g_idx` groups, whole and cut along both dims, equal compressed-tensors' decompression bit for bit.

    compressed-tensors 0.20.1 refuses actorder "group", so the codes come from its `quantize` in activation order and
    the reference is the sort its earlier releases (0.17.0) wrap around `dequantize`: columns sorted by g_idx,
    dequantized group_size at a time, put back. The same cases equal 0.17.0's own compressor and decompression."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from mstar_utils.quantized import dequantize_cut

    torch.manual_seed(bits * C + R)
    args = QuantizationArgs(num_bits=bits, strategy='group', group_size=n, symmetric=sym)
    perm = torch.randperm(C)  # perm[i]: the column quantized i-th
    w = torch.randn(R, C, dtype=dtype)[:, perm]
    s = (torch.rand(R, C // n) * 0.1 + 0.01).to(dtype)
    z = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), s.shape, dtype=torch.int8) if not sym else None
    q = quantize(w, s, z, args, dtype=torch.int8)[:, perm.argsort()]
    g_idx = (perm.argsort() // n).int()
    stored = [pack_to_int32(q, bits), s, torch.tensor([R, C])]
    stored += ([] if sym else [pack_to_int32(z, bits, packed_dim=0)]) + [g_idx]
    order = g_idx.argsort()
    want = dequantize(unpack_from_int32(stored[0], bits, torch.Size([R, C]))[:, order], s, z, args)[:, order.argsort()]
    op = PackQuantizedDequantize(bits, (1, n), (R, C), sym, target_dtype=dtype, g_idx=True)
    assert op.mismatch([t.shape for t in stored]) is None
    assert_tensors_equal(op.apply(stored), want)
    assert not torch.equal(
        PackQuantizedDequantize(bits, (1, n), (R, C), sym, target_dtype=dtype).apply(stored[:-1]), want
    )
    for dim in (0, 1):
        L = (R, C)[dim]
        for a, b in [(0, L // 2), (L // 2, L), (L // 4, 3 * L // 4)]:
            c = op.cut([t.shape for t in stored], dim, a, b)
            parts = [
                t if p is None else t.narrow(p[0], p[1], p[2] - p[1]) for t, p in zip(stored, c.parts, strict=True)
            ]
            assert_tensors_equal(dequantize_cut(c, parts), want.narrow(dim, a, b - a), f'dim {dim} [{a}, {b})')


@pytest.mark.parametrize(
    'kind,strategy,arg,sym',
    [
        ('float', 'channel', None, True),
        ('float', 'tensor', None, True),
        ('float', 'block', [64, 32], True),
        ('float', 'group', 32, True),
        ('int', 'channel', None, False),
        ('int', 'group', 16, True),
    ],
)
def test_float_quantized_matches_compressed_tensors(kind, strategy, arg, sym):
    R, C = 70, 96
    extra = {'block': {'block_structure': arg}, 'group': {'group_size': arg}}.get(strategy, {})
    sc = scheme(num_bits=8, type=kind, strategy=strategy, symmetric=sym, **extra)
    block = {
        'channel': (1, None),
        'tensor': (None, None),
        'block': tuple(arg) if strategy == 'block' else None,
        'group': (1, arg),
    }[strategy]
    grid = scale_grid((R, C), block) if strategy != 'tensor' else (1,)
    sd = {
        'weight': torch.randn(R, C, dtype=torch.bfloat16),
        'weight_scale': (torch.rand(grid) * 0.01 + 0.001).to(torch.bfloat16),
    }
    if not sym:
        sd['weight_zero_point'] = torch.randint(-5, 5, grid, dtype=torch.int8)
    q = NaiveQuantizationCompressor.compress(sd, sc)
    op = FloatQuantizedDequantize(block, torch.bfloat16, sym)
    assert_tensors_equal(
        op.apply([q['weight' + s] for s in op.suffixes]), NaiveQuantizationCompressor.decompress(q, sc)['weight']
    )


def test_unpack_int32_refuses_straddling_widths():
    with pytest.raises(ValueError, match='num_bits=3'):
        unpack_int32(torch.zeros(2, 3, dtype=torch.int32), 3, 32)


# ---- what a checkpoint stores quantized


def test_quantized_tensors_find_every_scaled_key(ckpts):
    for fmt, d in ckpts.items():
        with safe_open(str(d / 'model.safetensors'), 'pt') as f:
            keys = list(f.keys())
        units = quantized_tensors(checkpoint_source(d), config_of(d))
        suffix = {'fp8': '_scale_inv', 'mxfp4': '_scales'}.get(
            fmt, '_scale'
        )  # every scale the writer stored belongs to one parameter
        assert sorted(k for u in units for k in u.sources if k.endswith(suffix)) == sorted(
            k for k in keys if k.endswith(suffix)
        )
        assert all(k in keys for u in units for k in u.sources)


def without(d, *drop):
    return DictSource({k: v for k, v in load_file(str(d / 'model.safetensors')).items() if k not in drop})


def test_refusals_name_key_dtype_and_missing_scale(ckpts):
    k = 'model.layers.1.mlp.experts.0.down_proj.weight'
    with pytest.raises(
        ValueError,
        match=rf"'{k}' \(torch.float8_e4m3fn\) is quantized \(FP8BlockDequantize\) but its '{k}_scale_inv' is missing",
    ):
        quantized_tensors(without(ckpts['fp8'], k + '_scale_inv'), config_of(ckpts['fp8']))
    k = 'model.layers.0.mlp.experts.down_proj'
    with pytest.raises(
        ValueError, match=rf"'{k}_scales' \(torch.uint8\) belongs to quantized codes '{k}_blocks', which are missing"
    ):
        quantized_tensors(without(ckpts['mxfp4'], k + '_blocks'), config_of(ckpts['mxfp4']))
    k = 'model.layers.0.self_attn.q_proj'
    with pytest.raises(
        ValueError,
        match=(
            rf"'{k}.weight_packed' \(torch.int32\) is quantized \(PackQuantizedDequantize\) but its "
            rf"'{k}.weight_zero_point' is missing"
        ),
    ):
        quantized_tensors(without(ckpts['ct_pack'], k + '.weight_zero_point'), config_of(ckpts['ct_pack']))
    with pytest.raises(
        ValueError,
        match=(
            rf"'{k}.weight' \(torch.float8_e4m3fn\) is quantized \(FloatQuantizedDequantize\) but its "
            rf"'{k}.weight_scale' is missing"
        ),
    ):
        quantized_tensors(without(ckpts['ct_float'], k + '.weight_scale'), config_of(ckpts['ct_float']))
    with pytest.raises(
        ValueError,
        match=r"format 'nvfp4-pack-quantized' \(two FP4 codes a uint8\), but '.*weight_packed' is torch.int32",
    ):
        cfg = config_of(ckpts['ct_pack'])
        cfg['quantization_config']['format'] = 'nvfp4-pack-quantized'
        for g in cfg['quantization_config']['config_groups'].values():
            g.pop('format', None)
        quantized_tensors(checkpoint_source(ckpts['ct_pack']), cfg)


def test_unquantized_keys_of_a_quantized_dtype_are_refused(ckpts):
    sd = load_file(str(ckpts['fp8'] / 'model.safetensors'))
    sd['model.norm.weight'] = sd['model.norm.weight'].to(torch.float8_e4m3fn)  # an fp8 tensor with no scale at all
    with pytest.raises(
        ValueError,
        match=r"'model.norm.weight' \(torch.float8_e4m3fn\) is quantized .* 'model.norm.weight_scale_inv' is missing",
    ):
        quantized_tensors(DictSource(sd), config_of(ckpts['fp8']))


def test_fragments_stay_few_at_deepseek_v3_scale():
    """DeepSeek-V3's layout, 61 layers of 256 experts: one rule per projection name, grouping exactly each weight
    with its scale."""
    op, keys, units = FP8BlockDequantize(), ['model.embed_tokens.weight', 'lm_head.weight'], []

    class U:
        def __init__(self, t):
            self.target, self.op, self.sources = t, op, [t, t + '_scale_inv']

    for i in range(61):
        names = [f'self_attn.{p}' for p in ('q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj')]
        names += (
            [f'mlp.{p}' for p in ('gate_proj', 'up_proj', 'down_proj')]
            if i < 3
            else [
                f'mlp.{e}.{p}'
                for e in [*(f'experts.{j}' for j in range(256)), 'shared_experts']
                for p in ('gate_proj', 'up_proj', 'down_proj')
            ]
        )
        units += [U(f'model.layers.{i}.{n}.weight') for n in names]
        keys += [f'model.layers.{i}.mlp.gate.weight', f'model.layers.{i}.input_layernorm.weight']
    keys += [k for u in units for k in u.sources]
    rules = _fragments(units, keys)
    assert len(units) == 61 * 5 + 3 * 3 + 58 * 257 * 3 and sorted(t for _, t, _ in rules) == sorted(
        f'{p}.weight'
        for p in (
            'q_a_proj',
            'q_b_proj',
            'kv_a_proj_with_mqa',
            'kv_b_proj',
            'o_proj',
            'gate_proj',
            'up_proj',
            'down_proj',
        )
    )


# ---- compressed-tensors: which config group a module belongs to, against compressed-tensors' own matching


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=False,
        )
    )


W8 = {'num_bits': 8, 'type': 'int', 'strategy': 'channel', 'symmetric': True}
GROUPINGS = {  # name: (config groups as {group: targets}, ignore)
    'lm_head_then_linear': ({'head': ['lm_head'], 'rest': ['Linear']}, []),
    'linear_then_lm_head': ({'rest': ['Linear'], 'head': ['lm_head']}, []),
    'names_regexes_classes': (
        {'a': ['re:.*q_proj$', 'model.layers.0.mlp.down_proj'], 'b': ['re:.*proj$'], 'c': ['Linear'], 'd': ['lm_head']},
        [],
    ),
    'regexes_in_sorted_order': ({'z': ['re:.*layers\\.1\\..*'], 'a': ['re:.*mlp.*']}, ['lm_head']),
    'a_target_in_two_groups': (
        {'a': ['Linear', 'model.layers.1.self_attn.o_proj'], 'b': ['Linear', 're:.*mlp.*']},
        ['re:.*k_proj$'],
    ),
    'names_only': ({'a': ['lm_head', 'model.layers.0.self_attn.v_proj']}, []),
}


@pytest.mark.parametrize('grouping', GROUPINGS)
def test_ct_scheme_picks_the_group_compressed_tensors_picks(grouping):
    "apply_quantization_config on a real transformers model is the reference: the group each Linear gets, or none."
    import loguru
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    loguru.logger.disable('compressed_tensors')
    groups, ignore = GROUPINGS[grouping]
    qc = {'config_groups': {g: {'targets': t, 'weights': W8} for g, t in groups.items()}, 'ignore': ignore}
    model = _tiny_llama()
    apply_quantization_config(model, QuantizationConfig(**qc, quantization_status='initialized'), show_progress=False)
    by_targets = {tuple(t): g for g, t in groups.items()}
    got, want = {}, {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue  # the modules a checkpoint stores scales for
        scheme = getattr(m, 'quantization_scheme', None)
        want[name] = by_targets[tuple(scheme.targets)] if scheme is not None else None
        mine = _ct_scheme(qc, name)
        got[name] = by_targets[tuple(mine['targets'])] if mine is not None else None
    assert got == want
    assert len(set(want.values())) > 1 or grouping == 'names_only'  # the grouping tells groups apart


@pytest.mark.parametrize('head_first', [True, False])
def test_lm_head_group_beside_linear_loads(tmp_path, head_first):
    """A checkpoint whose lm_head is quantized per tensor by its own group and the other layers per channel by
    'Linear', the groups in either order."""
    groups = {
        'head': {'targets': ['lm_head'], 'weights': {'num_bits': 8, 'type': 'float', 'strategy': 'tensor'}},
        'rest': {'targets': ['Linear'], 'weights': {'num_bits': 8, 'type': 'float', 'strategy': 'channel'}},
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(quantized_configs()['ct_float'], dtype=torch.bfloat16)
    d = write_compressed_tensors_checkpoint(model, tmp_path / 'ckpt', groups, ignore=[])
    cfg = config_of(d)  # compressed-tensors saves its groups in an order of its own: put them in the one asked for
    saved = sorted(
        cfg['quantization_config']['config_groups'].values(), key=lambda g: (g['targets'] != ['lm_head']) == head_first
    )
    cfg['quantization_config']['config_groups'] = {f'group_{i}': g for i, g in enumerate(saved)}
    assert list(cfg['quantization_config']['config_groups'].values())[0]['targets'] == (
        ['lm_head'] if head_first else ['Linear']
    )
    (d / 'config.json').write_text(json.dumps(cfg))
    with safe_open(str(d / 'model.safetensors'), 'pt') as f:
        assert (
            f.get_slice('lm_head.weight_scale').get_shape() == [1]
            and f.get_slice('model.layers.0.self_attn.q_proj.weight_scale').get_shape()[1] == 1
        )
    ops = {u.target: u.op.block for u in quantized_tensors(checkpoint_source(d), config_of(d))}
    assert ops['lm_head.weight'] == (None, None) and ops['model.layers.0.self_attn.q_proj.weight'] == (1, None)
    # the reference: transformers' compressed-tensors integration, which matches groups on the model's modules,
    # dequantizing
    # (compressed-tensors' own checkpoint dequantizer, which sees names only, takes 'Linear' to mean every tensor,
    # embeddings too)
    from transformers.utils.quantization_config import CompressedTensorsConfig

    with pytest.warns(
        UserWarning, match='loading attributes'
    ):  # transformers: only `dequantize` is taken from the config passed
        ref_model = AutoModelForCausalLM.from_pretrained(
            d, quantization_config=CompressedTensorsConfig(dequantize=True)
        ).eval()
    deq = load_model(d)
    # transformers 5.19 keeps each `weight_scale` beside the weight it dequantized; 5.25 drops them
    kept = {k: v for k, v in ref_model.state_dict().items() if not k.endswith('.weight_scale')}
    assert_state_dict_equal(deq, kept)
    ref = logits(ref_model)
    assert_tensors_equal(logits(deq), ref)
    assert_tensors_equal(logits(load_model(d, quantized='keep')), ref)


# ---- fp8 without weight_block_size, and per-tensor weight_scale


def test_fp8_block_size_defaults_as_transformers(ckpts, refs, tmp_path):
    from transformers.utils.quantization_config import FineGrainedFP8Config

    d = tmp_path / 'no_block'
    d.mkdir()
    for f in ckpts['fp8'].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = config_of(d)
    assert cfg['quantization_config'].pop('weight_block_size') == [128, 128]
    (d / 'config.json').write_text(json.dumps(cfg))
    block = FineGrainedFP8Config.from_dict(cfg['quantization_config']).weight_block_size
    assert {u.op.block for u in quantized_tensors(checkpoint_source(d), cfg)} == {tuple(block)}
    assert_tensors_equal(logits(load_model(d)), logits(AutoModelForCausalLM.from_pretrained(refs['fp8']).eval()))
    cfg['quantization_config']['weight_block_size'] = (
        None  # explicit null: one scale per tensor, which these grids are not
    )
    with pytest.raises(ValueError, match='_scale_inv.* has shape .*FP8BlockDequantize needs one value per block'):
        quantized_tensors(checkpoint_source(d), cfg)


@pytest.mark.parametrize('scale_shape', [(), (1,), (1, 1)])
@pytest.mark.parametrize('suffix', ['_scale', '_scale_inv'])
@pytest.mark.parametrize(
    'qc', [{}, {'weight_block_size': [128, 128]}, {'weight_block_size': None}], ids=['absent', 'blocks', 'null']
)
def test_one_scale_is_per_tensor(scale_shape, suffix, qc):
    w = (torch.randn(300, 260) * 10).to(torch.float8_e4m3fn)
    s = torch.rand(scale_shape) + 0.1
    src = DictSource({'m.weight': w, 'm.weight' + suffix: s, 'm.input_scale': torch.tensor(0.25)})
    (u,) = quantized_tensors(src, {'quantization_config': {'quant_method': 'fp8', 'activation_scheme': 'static', **qc}})
    assert u.sources == ['m.weight', 'm.weight' + suffix] and u.op.block == (None, None)
    assert_tensors_equal(u.op.apply([w, s]), fp8_dequantize_reference(w, s, None, torch.float32).bfloat16())


def test_fp8_scale_refusals_name_the_scale_keys():
    w = (torch.randn(8, 8) * 10).to(torch.float8_e4m3fn)
    qc = {'quantization_config': {'quant_method': 'fp8'}}
    with pytest.raises(
        ValueError, match=r"'m.weight_scale_inv' is missing; the scale keys beside it are 'm.input_scale', 'm.k_scale'"
    ):
        quantized_tensors(DictSource({'m.weight': w, 'm.input_scale': torch.ones(()), 'm.k_scale': torch.ones(())}), qc)
    with pytest.raises(ValueError, match=r"'m.weight_scale_inv' is missing; there is no scale key beside it"):
        quantized_tensors(DictSource({'m.weight': w, 'n.weight_scale': torch.ones(())}), qc)
    with pytest.raises(ValueError, match=r"'m.weight' has two scales, 'm.weight_scale_inv' and 'm.weight_scale'"):
        quantized_tensors(
            DictSource({'m.weight': w, 'm.weight_scale_inv': torch.ones(1), 'm.weight_scale': torch.ones(1)}), qc
        )
    with pytest.raises(
        ValueError, match=r"'m.weight_scale' \(torch.float32\) belongs to quantized codes 'm.weight', which are missing"
    ):
        quantized_tensors(DictSource({'m.weight_scale': torch.ones(())}), qc)


def _per_tensor_fp8(src: Path, dest: Path) -> tuple:
    """(checkpoint, reference): `src`'s fp8 checkpoint re-quantized per tensor in the AutoFP8/vLLM layout
    (weight_scale, input_scale, no weight_block_size), and the model transformers' _dequantize_fp8_weight makes of
    it."""
    import shutil

    sd = load_file(str(src / 'model.safetensors'))
    full = load_file(
        str(dequantized_reference(src, dest / 'src_ref', torch.float32) / 'model.safetensors')
    )  # the checkpoint's keys
    weights = {k: v for k, v in full.items() if k + '_scale_inv' in sd}
    out, deq = {}, {}
    for k, v in sd.items():
        if k.endswith('_scale_inv'):
            continue
        if k not in weights:
            out[k] = deq[k] = v
            continue
        q, s = fp8_block_quantize(weights[k], tuple(weights[k].shape))  # one block: the whole tensor
        out[k], out[k + '_scale'], out[k[: -len('weight')] + 'input_scale'] = q, s.reshape(()), torch.tensor(0.5)
        deq[k] = fp8_dequantize_reference(q, s.reshape(()), None, torch.float32).bfloat16()
    for name, tensors, qc in (
        ('per_tensor', out, {'quant_method': 'fp8', 'activation_scheme': 'static'}),
        ('reference', deq, None),
    ):
        (dest / name).mkdir()
        cfg = config_of(src)
        cfg.pop('quantization_config')
        if qc:
            cfg['quantization_config'] = qc
        (dest / name / 'config.json').write_text(json.dumps(cfg))
        shutil.copy(src / 'generation_config.json', dest / name / 'generation_config.json')
        save_file(tensors, str(dest / name / 'model.safetensors'), metadata={'format': 'pt'})
    return dest / 'per_tensor', dest / 'reference'


def test_per_tensor_weight_scale_checkpoint_loads(ckpts, tmp_path, caplog):
    """input_scale (static activations) is no parameter's: load_model reports it unused, loads with strict=False and
    refuses with strict=True."""
    import logging

    d, ref_dir = _per_tensor_fp8(ckpts['fp8'], tmp_path)
    units = quantized_tensors(checkpoint_source(d), config_of(d))
    assert units and all(u.op.block == (None, None) and u.sources[1].endswith('.weight_scale') for u in units)
    ref = logits(AutoModelForCausalLM.from_pretrained(ref_dir).eval())
    with caplog.at_level(logging.WARNING, logger='mstar_utils.model'):
        assert_tensors_equal(logits(load_model(d)), ref)
        assert_tensors_equal(logits(load_model(d, quantized='keep')), ref)
    warned = [r.getMessage() for r in caplog.records if r.name == 'mstar_utils.model']
    assert len(warned) == 2 and all(
        f'{len(units)} checkpoint key(s) were not used' in w and '.input_scale' in w for w in warned
    ), warned
    with pytest.raises(ValueError, match=r'input_scale.*pass strict=False'):
        load_model(d, strict=True)


# ---- both loading modes against the reference model


@pytest.mark.parametrize('fmt', FORMATS)
def test_load_model_logits_equal_the_dequantized_reference(fmt, ckpts, refs):
    ref = logits(AutoModelForCausalLM.from_pretrained(refs[fmt]).eval())
    assert_tensors_equal(logits(load_model(ckpts[fmt])), ref)
    assert_tensors_equal(logits(load_model(ckpts[fmt], quantized='keep')), ref)


def test_float32_dequantization_equals_a_float32_reference(ckpts, tmp_path):
    ref = AutoModelForCausalLM.from_pretrained(
        dequantized_reference(ckpts['fp8'], tmp_path / 'ref', torch.float32), dtype=torch.float32
    ).eval()
    m = load_model(ckpts['fp8'], dtype=torch.float32)
    assert_tensors_equal(m.model.layers[1].self_attn.q_b_proj.weight, ref.model.layers[1].self_attn.q_b_proj.weight)
    assert_tensors_equal(logits(m), logits(ref))


@pytest.mark.parametrize('fmt', FORMATS)
def test_kept_model_holds_the_checkpoint_bytes(fmt, ckpts):
    d = ckpts[fmt]
    units = quantized_tensors(checkpoint_source(d), config_of(d))
    m = load_model(d, quantized='keep')
    params, file = dict(m.named_parameters()), load_file(str(d / 'model.safetensors'))
    for k in (k for u in units for k in u.sources):
        assert_tensors_equal(params[k].view(torch.uint8), file[k].view(torch.uint8))
    dense = {u.target for u in units} & {n for n, p in params.items() if p.dtype == torch.bfloat16}
    assert not dense  # no dequantized copy is held
    kept = sum(p.nbytes for n, p in params.items() if any(n in u.sources for u in units))
    assert kept == sum(file[k].nbytes for u in units for k in u.sources)


def test_scale_and_weight_in_different_shards(ckpts, refs, tmp_path):
    "A quantized weight whose scale the index puts in another shard loads both ways."
    d, out = ckpts['fp8'], tmp_path / 'sharded'
    out.mkdir()
    sd = load_file(str(d / 'model.safetensors'))
    shards = {
        'a.safetensors': {k: v for k, v in sd.items() if not k.endswith('_scale_inv')},
        'b.safetensors': {k: v for k, v in sd.items() if k.endswith('_scale_inv')},
    }
    for name, part in shards.items():
        save_file(part, str(out / name), metadata={'format': 'pt'})
    (out / 'model.safetensors.index.json').write_text(
        json.dumps({'metadata': {}, 'weight_map': {k: n for n, p in shards.items() for k in p}})
    )
    for f in ('config.json', 'generation_config.json'):
        (out / f).write_text((d / f).read_text())
    ref = logits(AutoModelForCausalLM.from_pretrained(refs['fp8']).eval())
    assert_tensors_equal(logits(load_model(out)), ref)
    assert_tensors_equal(logits(load_model(out, quantized='keep')), ref)


def test_quantized_conversions_group_each_weight_with_its_scale(ckpts):
    src = checkpoint_source(ckpts['ct_pack'])
    units, conv = (
        quantized_tensors(src, config_of(ckpts['ct_pack'])),
        quantized_conversions(src, config_of(ckpts['ct_pack'])),
    )
    assert {t: g.keys for t, g in group_keys(list(src.keys()), conv).items()} == {
        u.target: set(u.sources) for u in units
    }
    assert len(conv) < len(units)


def test_keep_quantized_returns_only_recipes_still_needed(ckpts):
    cfg = AutoConfig.from_pretrained(ckpts['fp8'])
    units = quantized_tensors(checkpoint_source(ckpts['fp8']), cfg)
    conv = CONVERSIONS_BY_MODEL_TYPE['deepseek_v3']
    assert keep_quantized(build_on_meta(cfg), units, conv) == []  # every expert kept quantized
    experts = [u for u in units if '.experts.' not in u.target]
    assert keep_quantized(build_on_meta(cfg), experts, conv) == list(conv)  # experts left to the recipes


# ---- MLA


@pytest.mark.parametrize('mode', ['keep', 'dequantize'])
def test_mla_absorbs_from_fp8(mode, ckpts, refs):
    d, prefix = ckpts['fp8'], 'model.layers.1.self_attn.'
    cfg, src = AutoConfig.from_pretrained(d), checkpoint_source(ckpts['fp8'])
    with torch.device('meta'):
        mla = MLAAttention.from_config(cfg, layer_idx=1).to(torch.bfloat16)
    conv = None
    if mode == 'keep':
        keep_quantized(mla, quantized_tensors(src, cfg), prefix=prefix)
    else:
        conv = quantized_conversions(src, cfg)
    load_weights_from_hf_shards(d, [ModuleAndPrefix(mla, prefix)], conv=conv)
    process_weights_after_loading(mla, 'cpu')
    ref_w = load_file(str(refs['fp8'] / 'model.safetensors'))[prefix + 'kv_b_proj.weight']
    N, P, V, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    assert_tensors_equal(mla.w_kc, ref_w.view(N, P + V, L)[:, :P].contiguous())
    assert_tensors_equal(mla.w_vc, ref_w.view(N, P + V, L)[:, P:].transpose(1, 2).contiguous())
    process_weights_after_loading(mla, 'cpu')  # again, as after a weight update: the same
    assert_tensors_equal(mla.w_kc, ref_w.view(N, P + V, L)[:, :P].contiguous())
    h = torch.randn(1, 3, cfg.hidden_size, dtype=torch.bfloat16)
    assert mla(h, rope_freqs(torch.arange(3)[None], cfg.qk_rope_head_dim))[0].isfinite().all()


# ---- tensor-parallel block slices


def test_block_slice():
    assert block_slice('k', 128, 0, 4096, size=32768) == slice(0, 32)
    assert block_slice('k', 128, 256, 300, size=300) == slice(2, 3)
    with pytest.raises(
        ValueError, match="'model.layers.3.mlp.down_proj.weight': a shard boundary at 100 cuts through a block of 128"
    ):
        block_slice('model.layers.3.mlp.down_proj.weight', 128, 0, 100, size=300)
    with pytest.raises(ValueError, match="'k': shard"):
        block_slice('k', 128, 256, 512, size=300)


def test_compressed_tensors_targets_name_the_models_modules_not_the_checkpoints(tmp_path):
    """PhiMoE stores its router under block_sparse_moe, which transformers renames to mlp.router: the config
    group targeting `re:.*mlp\\..*` quantized it (compressed-tensors matched the model's name), and load_model
    matches the target against that name too."""
    from mstar_utils.model import load_model
    from mstar_utils.testing import tiny_model, CT_PACK_GROUPS

    m = tiny_model('phimoe', dtype=torch.bfloat16)
    if not hasattr(m.model.layers[0], 'mlp'):
        pytest.skip(
            f'transformers {transformers.__version__} names the module block_sparse_moe, as the checkpoint does'
        )
    d = write_compressed_tensors_checkpoint(m, tmp_path / 'ct', CT_PACK_GROUPS)
    sd = load_file(d / 'model.safetensors')
    # transformers 5.25 writes the router back as block_sparse_moe.router, 5.19 as block_sparse_moe.gate
    (router,) = [
        k[: -len('weight_packed')]
        for k in sd
        if re.fullmatch(r'model\.layers\.0\.block_sparse_moe\.\w+\.weight_packed', k)
    ]
    ours = load_model(d)
    # the reference for the router: compressed-tensors' own decompression of what it stored, under the group that
    # quantized it
    sc = scheme(**CT_PACK_GROUPS['mlp']['weights'])
    want = PackedQuantizationCompressor.decompress(
        {k[len(router) :]: v for k, v in sd.items() if k.startswith(router)}, sc
    )['weight']
    assert_tensors_equal(ours.model.layers[0].mlp.router.weight.detach(), want.to(ours.dtype))


# ---- activation-ordered groups in a checkpoint


@pytest.fixture(scope='module')
def actorder(tmp_path_factory):
    "(checkpoint with `weight_g_idx`, its reference folder dequantized as compressed-tensors does, in float32)."
    from mstar_utils.testing import ct_actorder_reference, write_ct_actorder_checkpoint

    root = tmp_path_factory.mktemp('actorder')
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(quantized_configs()['ct_pack'], dtype=torch.float32)
    d = write_ct_actorder_checkpoint(model.to(torch.bfloat16), root / 'ao', group_size=4)  # down_proj: 100 inputs
    return d, ct_actorder_reference(d, root / 'ref')


def test_actorder_checkpoint_loads_as_compressed_tensors_decompresses(actorder):
    """Dequantized and kept, a checkpoint with activation-ordered groups computes the logits of the reference's weights;
    transformers with compressed-tensors 0.20.1 refuses the checkpoint, so it cannot be the reference."""
    d, ref_dir = actorder
    sd = load_file(str(d / 'model.safetensors'))
    g = sd['model.layers.0.mlp.down_proj.weight_g_idx'].long()
    assert not torch.equal(g, torch.arange(len(g)) // 4)  # groups gather columns from all over the row
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    m = load_model(d, dtype=torch.float32)
    k = 'model.layers.0.mlp.down_proj.weight'
    assert_tensors_equal(m.get_parameter(k), ref.get_parameter(k))
    assert_tensors_equal(logits(m), logits(ref))
    kept = load_model(d, dtype=torch.float32, quantized='keep')
    assert kept.get_submodule('model.layers.0.mlp.down_proj').weight_g_idx.dtype == torch.int32
    assert_tensors_equal(logits(kept), logits(ref))
    with pytest.raises(ValueError, match='actorder'):
        AutoModelForCausalLM.from_pretrained(d)


def test_actorder_refusals_name_the_key(actorder):
    d, _ = actorder
    k = 'model.layers.0.mlp.down_proj.weight_g_idx'
    sd = load_file(str(d / 'model.safetensors'))
    uneven = sd[k].clone()
    uneven[0] = (uneven[0] + 1) % int(uneven.max() + 1)  # one group gains a column, another loses one
    with pytest.raises(ValueError, match=rf"'{k}' does not put 4 columns \(group_size\) in each"):
        quantized_tensors(DictSource({**sd, k: uneven}), config_of(d))
    with pytest.raises(ValueError, match=rf"'{k}' is torch.int32 \[7\]; a g_idx holds one integer group per column"):
        quantized_tensors(DictSource({**sd, k: sd[k][:7]}), config_of(d))
    cfg = config_of(d)
    cfg['quantization_config']['config_groups']['group_0']['weights'].update(strategy='channel', group_size=None)
    with pytest.raises(ValueError, match=rf"'{k}': activation-ordered groups need weight strategy 'group'"):
        quantized_tensors(DictSource(sd), cfg)
    unset = {**sd, k: torch.full_like(sd[k], -1)}  # compressed-tensors reads a g_idx of -1s in column order
    (u,) = [u for u in quantized_tensors(DictSource(unset), config_of(d)) if u.target == k[: -len('_g_idx')]]
    assert not u.op.g_idx and u.dropped == (k,)
