"""More quantized formats: compressed-tensors dense, NVFP4 (compressed-tensors and ModelOpt), MXFP8, safetensors' F4
dtype, against compressed-tensors' own code."""

import json
import os
import shutil

import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging
from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
from compressed_tensors.quantization import preset_name_to_scheme

from mstar_utils.model import load_model
from mstar_utils.quantized import FloatQuantizedDequantize, NVFP4Dequantize, DenseQuantized, quantized_tensors
from mstar_utils.sources import checkpoint_source, read_header
from mstar_utils.testing_formats import _rewrite
from mstar_utils.testing import (
    as_modelopt,
    assert_tensors_equal,
    ct_nvfp4_reference,
    ct_preset_reference,
    formats_config,
    rank_reads,
    write_ct_preset_checkpoint,
)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 17]])


def logits(m):
    with torch.no_grad():
        return m(IDS).logits


def config_of(d):
    return json.loads((d / 'config.json').read_text())


def fresh():
    return AutoModelForCausalLM.from_config(formats_config(), dtype=torch.bfloat16)


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp('formats')
    out = {
        name: write_ct_preset_checkpoint(fresh(), root / name, preset, compress=comp, frozen=frozen)
        for name, preset, comp, frozen in [
            ('nvfp4', 'NVFP4A16', True, False),
            ('mxfp8', 'MXFP8A16', True, False),
            ('w4a16_dense', 'W4A16', False, False),
            ('nvfp4_dense', 'NVFP4A16', False, False),
            ('w4a16_frozen', 'W4A16', True, True),  # pack-quantized named, saved before compressing
        ]
    }
    out['modelopt'] = as_modelopt(out['nvfp4'], root / 'modelopt')
    return out


def modelopt_reference(d, dest, dtype):
    "ModelOpt checkpoint `d` through compressed-tensors' ModelOpt converter, then its NVFP4 decompression."
    sd = {
        k: (v.view(torch.uint8) if v.dtype == torch.float4_e2m1fn_x2 else v)
        for k, v in load_file(str(d / 'model.safetensors')).items()
    }
    ct = ModelOptNvfp4Converter(ignore=['lm_head'], targets=['re:.*_proj$']).process(sd)
    conv = dest.parent / (dest.name + '_ct')
    shutil.copytree(d, conv, dirs_exist_ok=True)
    qc = {
        'quant_method': 'compressed-tensors',
        'format': 'nvfp4-pack-quantized',
        'ignore': ['lm_head'],
        'quantization_status': 'compressed',
        'config_groups': {
            'group_0': {
                'targets': ['Linear'],
                'format': 'nvfp4-pack-quantized',
                'weights': {'num_bits': 4, 'type': 'float', 'strategy': 'tensor_group', 'group_size': 16},
            }
        },
    }
    _rewrite(conv, {k: v for k, v in ct.items() if not k.endswith('input_global_scale')}, qc, torch.bfloat16)
    return ct_preset_reference(conv, dest, dtype)


# ---- decoders against compressed-tensors


@pytest.mark.parametrize('R,C', [(1, 16), (7, 48), (33, 160), (5, 32)])
def test_nvfp4_op_equals_compressed_tensors(R, C):
    torch.manual_seed(R * C)
    p = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8)
    s = torch.randint(0, 127, (R, C // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    gs = torch.rand(1) * 1000
    assert_tensors_equal(NVFP4Dequantize(16, torch.float32).apply([p, s, gs]), ct_nvfp4_reference(p, s, gs))
    assert_tensors_equal(NVFP4Dequantize(16).apply([p, s, gs]), ct_nvfp4_reference(p, s, gs, torch.bfloat16))
    assert_tensors_equal(
        NVFP4Dequantize(16, torch.float32).apply([p.view(torch.float4_e2m1fn_x2), s, gs]), ct_nvfp4_reference(p, s, gs)
    )


@pytest.mark.parametrize('R,C', [(3, 32), (17, 96), (64, 320)])
def test_mxfp8_op_equals_compressed_tensors(R, C):
    torch.manual_seed(R + C)
    w = torch.randint(0, 256, (R, C), dtype=torch.uint8)
    w = torch.where((w & 0x7F) == 0x7F, 0, w).view(torch.float8_e4m3fn)  # no NaN codes
    e = torch.randint(100, 150, (R, C // 32), dtype=torch.uint8)
    ref = MXFP8QuantizationCompressor.decompress(
        {'weight': w, 'weight_scale': e}, preset_name_to_scheme('MXFP8A16', ['Linear'])
    )['weight']
    assert_tensors_equal(FloatQuantizedDequantize((1, 32)).apply([w, e]), ref)


# ---- loaded models against from_pretrained of the reference-dequantized checkpoint


@pytest.mark.parametrize('name', ['nvfp4', 'mxfp8', 'modelopt'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_logits_equal_the_dequantized_reference(name, dtype, ckpts, tmp_path):
    d = ckpts[name]
    ref_dir = (
        modelopt_reference(d, tmp_path / 'ref', dtype)
        if name == 'modelopt'
        else ct_preset_reference(d, tmp_path / 'ref', dtype)
    )
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype).eval()
    m = load_model(d, dtype=dtype)
    assert_tensors_equal(m.model.layers[1].mlp.down_proj.weight, ref.model.layers[1].mlp.down_proj.weight)
    assert_tensors_equal(logits(m), logits(ref))
    assert_tensors_equal(logits(load_model(d, dtype=dtype, quantized='keep')), logits(ref))


@pytest.mark.parametrize('name', ['w4a16_dense', 'nvfp4_dense'])
def test_dense_loads_as_from_pretrained(name, ckpts):
    d = ckpts[name]
    assert config_of(d)['quantization_config']['format'] == 'dense'
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    m = load_model(d)
    sd = load_file(str(d / 'model.safetensors'))
    assert_tensors_equal(m.model.layers[0].mlp.down_proj.weight, sd['model.layers.0.mlp.down_proj.weight'])
    assert_tensors_equal(logits(m), logits(hf))
    assert_tensors_equal(logits(load_model(d, quantized='keep')), logits(hf))
    units = quantized_tensors(checkpoint_source(d), config_of(d))
    assert units and all(isinstance(u.op, DenseQuantized) for u in units)


def test_plain_weights_under_a_packed_label_load_as_dense(ckpts, tmp_path):
    "An upload whose config says pack-quantized, frozen, but whose modules hold plain weights and their scales."
    d = shutil.copytree(ckpts['w4a16_dense'], tmp_path / 'mislabelled')
    cfg = config_of(d)
    cfg['quantization_config']['format'] = 'pack-quantized'
    cfg['quantization_config']['config_groups']['group_0']['format'] = 'pack-quantized'
    (d / 'config.json').write_text(json.dumps(cfg))
    assert_tensors_equal(
        logits(load_model(d)), logits(AutoModelForCausalLM.from_pretrained(ckpts['w4a16_dense']).eval())
    )


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_frozen_pack_quantized_with_plain_weights_loads_as_from_pretrained(ckpts, dtype):
    """quantization_status frozen, format pack-quantized, weights saved plain as calibration left them (no
    weight_packed): compressed-tensors' forward, which from_pretrained runs, quantizes and dequantizes each weight by
    its stored scales below status compressed, and so does the load."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    d, k = ckpts['w4a16_frozen'], 'model.layers.0.mlp.down_proj'
    qc = config_of(d)['quantization_config']
    assert (qc['format'], qc['quantization_status']) == ('pack-quantized', 'frozen')
    sd = load_file(str(d / 'model.safetensors'))
    assert k + '.weight_packed' not in sd and sd[k + '.weight'].dtype == torch.bfloat16
    args = preset_name_to_scheme('W4A16', ['Linear']).weights
    scale, zp = sd[k + '.weight_scale'].to(dtype), sd[k + '.weight_zero_point']
    want = fake_quantize(sd[k + '.weight'].to(dtype), scale, zp, args)  # compressed-tensors' own QDQ
    assert not torch.equal(want, sd[k + '.weight'].to(dtype))  # off the grid: the stored weight is not what runs
    m = load_model(d, dtype=dtype)
    assert_tensors_equal(m.model.layers[0].mlp.down_proj.weight, want)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    assert_tensors_equal(logits(m), logits(hf))
    assert_tensors_equal(logits(load_model(d, dtype=dtype, quantized='keep')), logits(hf))


@pytest.mark.parametrize(
    'kind,bits,strategy,block,sym',
    [
        ('int', 4, 'group', (1, 32), False),
        ('int', 8, 'channel', (1, None), True),
        ('float', 8, 'channel', (1, None), True),
    ],
)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_fake_quantized_op_equals_compressed_tensors(kind, bits, strategy, block, sym, dtype):
    "The frozen op against compressed-tensors' own fake_quantize, whole and cut inside a group."
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from mstar_utils.quantized import dequantize_cut

    torch.manual_seed(bits)
    w = torch.randn(6, 96, dtype=dtype)
    groups = w.unflatten(-1, (-1, block[1] or 96))
    top = 2 ** (bits - 1) - 1 if kind == 'int' else 448
    s = (groups.abs().amax(-1) / top).to(dtype)  # [6, G]
    z = torch.randint(-2, 3, s.shape, dtype=torch.int8) if not sym else torch.zeros(s.shape, dtype=torch.int8)
    args = QuantizationArgs(
        num_bits=bits, type=kind, symmetric=sym, strategy=strategy, group_size=block[1] if strategy == 'group' else None
    )
    want = fake_quantize(w, s, z, args)
    op = DenseQuantized(block, dtype, ('', '_scale', '_zero_point'), (kind, bits))
    assert_tensors_equal(op.apply([w, s, z]), want)
    c = op.cut([w.shape, s.shape, z.shape], 1, 40, 80)
    parts = [t if p is None else t.narrow(p[0], p[1], p[2] - p[1]) for t, p in zip([w, s, z], c.parts, strict=True)]
    assert_tensors_equal(dequantize_cut(c, parts), want[:, 40:80])


def test_f4_dtype_is_read(ckpts, tmp_path):
    d = as_modelopt(ckpts['nvfp4'], tmp_path / 'f4', f4=True)
    k = 'model.layers.0.mlp.down_proj.weight'
    with safe_open(str(d / 'model.safetensors'), 'pt') as f:
        want = f.get_tensor(k)
    info = read_header(d / 'model.safetensors')[1][k]
    assert (info.dtype, info.shape) == (want.dtype, tuple(want.shape)) == (torch.float4_e2m1fn_x2, (128, 128))
    src = checkpoint_source(d)
    assert_tensors_equal(src.get(k).view(torch.uint8), want.view(torch.uint8))
    ref = AutoModelForCausalLM.from_pretrained(
        modelopt_reference(d, tmp_path / 'ref', torch.float32), dtype=torch.float32
    ).eval()
    assert_tensors_equal(logits(load_model(d, dtype=torch.float32)), logits(ref))


def test_f4_odd_last_dimension_is_refused(tmp_path):
    p = tmp_path / 'odd.safetensors'
    save_file({'w': torch.zeros(2, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, str(p))
    raw = bytearray(p.read_bytes())
    raw[:200] = bytes(raw[:200]).replace(b'"shape":[2,6]', b'"shape":[2,5]')
    p.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"odd\.safetensors: not a readable safetensors file"):
        read_header(p)  # safetensors refuses it first


# ---- contradictions name both sides


def test_dense_label_with_fp8_codes_is_refused(ckpts, tmp_path):
    d = shutil.copytree(ckpts['mxfp8'], tmp_path / 'bad')
    cfg = config_of(d)
    cfg['quantization_config']['format'] = 'dense'
    cfg['quantization_config']['config_groups']['group_0']['format'] = 'dense'
    (d / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"format 'dense'.*'model\.layers\.0\..*\.weight' is torch\.float8_e4m3fn"):
        quantized_tensors(checkpoint_source(d), config_of(d))


def test_modelopt_algo_contradiction_is_refused(ckpts, tmp_path):
    d = shutil.copytree(ckpts['modelopt'], tmp_path / 'bad')
    cfg = config_of(d)
    cfg['quantization_config']['quant_algo'] = 'FP8'
    (d / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"stored as NVFP4.*quant_algo for it is 'FP8'"):
        quantized_tensors(checkpoint_source(d), config_of(d))


def test_nvfp4_scales_that_do_not_fit_the_group_are_refused(ckpts, tmp_path):
    d = shutil.copytree(ckpts['nvfp4'], tmp_path / 'bad')
    cfg = config_of(d)
    cfg['quantization_config']['config_groups']['group_0']['weights']['group_size'] = 32
    (d / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"weight_scale' has shape \[128, 16\].*one scale per 32 values, so \[128, 8\]"
    ):
        quantized_tensors(checkpoint_source(d), config_of(d))


def test_kept_nvfp4_holds_the_checkpoint_bytes(ckpts):
    d = ckpts['nvfp4']
    m = load_model(d, quantized='keep')
    file, params = load_file(str(d / 'model.safetensors')), dict(m.named_parameters())
    for k in [k for k in file if '.weight_' in k]:
        assert_tensors_equal(params[k].view(torch.uint8), file[k].view(torch.uint8))


# ---- a global scale per part of a fused tensor


def test_fused_qkv_with_a_global_scale_per_part_is_exact(tmp_path):
    "NVFP4 q/k/v and gate/up, each with its own global scale, fused into Phi-3's qkv_proj and gate_up_proj by recipes."
    import transformers as tf
    from mstar_utils.convert import Operation, WeightConverter

    kw = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    llama = write_ct_preset_checkpoint(
        tf.LlamaForCausalLM(tf.LlamaConfig(**kw)).to(torch.bfloat16), tmp_path / 'llama', 'NVFP4A16'
    )
    sd = load_file(str(llama / 'model.safetensors'))
    gs = {p: sd[f'model.layers.0.self_attn.{p}.weight_global_scale'].item() for p in ('q_proj', 'k_proj', 'v_proj')}
    assert len(set(gs.values())) == 3, gs  # the parts' global scales differ
    phi = shutil.copytree(llama, tmp_path / 'phi3')
    cfg = {
        **tf.Phi3Config(**kw).to_dict(),
        'architectures': ['Phi3ForCausalLM'],
        'quantization_config': config_of(llama)['quantization_config'],
    }
    (phi / 'config.json').write_text(json.dumps(cfg))
    conv = [
        WeightConverter(
            [f'self_attn.{p}_proj.weight' for p in 'qkv'], 'self_attn.qkv_proj.weight', [Operation('Concatenate', 0)]
        ),
        WeightConverter(
            ['mlp.gate_proj.weight', 'mlp.up_proj.weight'], 'mlp.gate_up_proj.weight', [Operation('Concatenate', 0)]
        ),
    ]
    ref_dir = ct_preset_reference(llama, tmp_path / 'ref', torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    m = load_model(phi, conv=conv, dtype=torch.float32)
    a = ref.model.layers[0].self_attn
    assert_tensors_equal(
        m.model.layers[0].self_attn.qkv_proj.weight, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    )
    torch.testing.assert_close(logits(m), logits(ref), atol=1e-4, rtol=0)
    with pytest.raises(
        NotImplementedError,
        match=r"'model\.layers\.0\.mlp\.gate_proj\.weight_packed': quantized='keep' .* "
        r"'model\.layers\.0\.mlp' \(Phi3MLP\) has modules of its own \(gate_up_proj, down_proj\)",
    ):
        load_model(
            phi, conv=conv, dtype=torch.float32, quantized='keep'
        )  # not the silent NaNs of modules hidden inside a wrapper


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_nvfp4_apply_into_equals_apply(dtype):
    "apply_into writes NVFP4 straight into the destination, equal to apply; other shapes and dtypes go through apply."
    torch.manual_seed(2)
    for R, C in [(1, 16), (7, 48), (300, 2048), (5, 40)]:
        p = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8)
        s = torch.randint(0, 127, (R, -(-C // 16)), dtype=torch.uint8).view(torch.float8_e4m3fn)
        gs = torch.rand(1) * 1000
        for op in (NVFP4Dequantize(16, dtype), NVFP4Dequantize(16, dtype, ('', '_scale', '_scale_2'), True)):
            want = op.apply([p, s, gs])
            assert_tensors_equal(op.apply_into([p, s, gs], torch.empty(R, C, dtype=dtype)), want)
            other = torch.float16 if dtype == torch.float32 else torch.float32
            assert_tensors_equal(op.apply_into([p, s, gs], torch.empty(R, C, dtype=other)), want.to(other))


# ---- tensor parallelism: each rank's tensors are the full load's slices, and it reads what its plan says


@pytest.mark.parametrize('name', ['nvfp4', 'mxfp8', 'modelopt', 'w4a16_dense', 'nvfp4_dense', 'w4a16_frozen'])
@pytest.mark.parametrize('ws', [2, 4])
def test_ranks_are_slices_of_the_full_load(name, ws, ckpts):
    r = rank_reads(ckpts[name], ws, dtype=torch.float32)
    assert r.full <= r.checkpoint, r  # one device reads no byte twice (modelopt's unused input scales not at all)
    # every sliced tensor's codes and scales are read once over the ranks (its columns cut in whole groups of 16)
    assert sum(r.per_rank) <= r.bound(), (sum(r.per_rank), r.bound(), r)
