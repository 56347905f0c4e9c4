"""GPTQ, AWQ and bitsandbytes checkpoints: decoders against the packed integers and bitsandbytes' own functional API,
loads against from_pretrained of the dequantized checkpoint, tensor-parallel ranks against the full load's slices."""

import io
import json
import os
import re
import shutil

import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from bitsandbytes.functional import QuantState, dequantize_4bit, int8_vectorwise_dequant
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from mstar_utils.model import load_model, load_plan
from mstar_utils.quant_int import _unpack_cols, _unpack_rows
from mstar_utils.quantized import (
    AWQ_ORDER,
    AWQDequantize,
    GPTQDequantize,
    QuantizedLinear,
    QuantizedTensor,
    dequantize_cut,
    held_names,
    keep_quantized,
    quantized_tensors,
)
from mstar_utils.sources import checkpoint_source
from mstar_utils.testing_formats import _pack, _rewrite
from mstar_utils.testing import (
    assert_tensors_equal,
    awq_quantize,
    formats_config,
    gptq_quantize,
    rank_reads,
    write_bnb_checkpoint,
    write_int4_checkpoint,
)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 17]])
GPTQ_KEYS = ('qweight', 'qzeros', 'scales', 'g_idx')


def logits(m):
    with torch.no_grad():
        return m(IDS).logits


def config_of(d):
    return json.loads((d / 'config.json').read_text())


def fresh():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(formats_config(), dtype=torch.float32)


CKPTS = {
    'gptq': ('gptq', dict(group_size=32)),
    'gptq_act': ('gptq', dict(group_size=32, act_order=True)),
    'gptq8_v2': ('gptq', dict(bits=8, group_size=-1, sym=False, v1=False)),
    'awq': ('awq', dict(group_size=32)),
    'awq_one_group': ('awq', dict(group_size=-1)),
}
BNB = {
    'nf4_nested': ('nf4', True),
    'nf4': ('nf4', False),
    'fp4_nested': ('fp4', True),
    'fp4': ('fp4', False),
    'int8': ('int8', False),
    # transformers' bnb_4bit_quant_storage: the packed bytes stored as another dtype
    'nf4_nested_bf16': ('nf4', True, torch.bfloat16),
    'fp4_fp16': ('fp4', False, torch.float16),
    'nf4_fp32': ('nf4', False, torch.float32),
}


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
    "{name: (folder, {weight key: the float32 weight it dequantizes to} or None for bitsandbytes)}."
    root = tmp_path_factory.mktemp('intq')
    out = {n: write_int4_checkpoint(fresh(), root / n, m, **kw) for n, (m, kw) in CKPTS.items()}
    out.update({n: (write_bnb_checkpoint(fresh(), root / n, *spec), None) for n, spec in BNB.items()})
    return out


def bnb_reference(d) -> dict:
    "{weight key: bitsandbytes' own float32 dequantization} of every quantized weight of checkpoint `d`."
    sd, out = load_file(str(d / 'model.safetensors')), {}
    for k in sd:
        if k.endswith('.SCB'):
            out[k[:-4] + '.weight'] = int8_vectorwise_dequant(sd[k[:-4] + '.weight'], sd[k])
        elif '.quant_state.bitsandbytes__' in k:
            w = k.partition('.quant_state.')[0]
            qs = QuantState.from_dict(
                {n[len(w) + 1 :]: v for n, v in sd.items() if n.startswith(w + '.')}, device='cpu'
            )
            qs.dtype = torch.float32
            out[w] = dequantize_4bit(sd[w], qs)
    return out


def reference_dir(d, weights: dict, dest):
    "Checkpoint `d` with its quantized weights replaced by `weights` (float32) and no quantization_config."
    mods = {k.rpartition('.')[0] for k in weights}
    rest = {
        k: v
        for k, v in load_file(str(d / 'model.safetensors')).items()
        if k.rpartition('.')[0] not in mods and not any(k.startswith(m + '.') for m in mods)
    }
    shutil.copytree(d, dest)
    return _rewrite(dest, {**rest, **weights}, None, torch.float32)


def weights_of(ckpts, name):
    d, refs = ckpts[name]
    return d, refs if refs is not None else bnb_reference(d)


# ---- decoders on shapes that divide neither the words nor the groups


@pytest.mark.parametrize('N,K', [(20, 96), (7, 40), (64, 128)])
@pytest.mark.parametrize('bits', [4, 8])
@pytest.mark.parametrize('group_size', [32, -1])
@pytest.mark.parametrize('act_order', [False, True])
@pytest.mark.parametrize('v1,sym', [(True, True), (False, False)])
def test_gptq_decodes_the_packed_integers(N, K, bits, group_size, act_order, v1, sym):
    torch.manual_seed(N + K + bits)
    t, ref = gptq_quantize(torch.randn(N, K), bits, group_size, sym, act_order=act_order, v1=v1)
    ts = [t[k] for k in GPTQ_KEYS]
    op = GPTQDequantize(bits, group_size, v1, act_order, target_dtype=torch.float32)
    assert op.mismatch([x.shape for x in ts]) is None
    assert_tensors_equal(op.apply(ts), ref)
    wrong = GPTQDequantize(bits, group_size, not v1, act_order, target_dtype=torch.float32).apply(
        ts
    )  # the zero-point offset is read
    assert not torch.equal(wrong, ref)


@pytest.mark.parametrize('N,K', [(20, 96), (7, 40), (64, 128)])
@pytest.mark.parametrize('group_size', [32, -1])
def test_awq_decodes_the_packed_integers(N, K, group_size):
    torch.manual_seed(N * K)
    t, ref = awq_quantize(torch.randn(N, K), group_size)
    ts = [t[k] for k in ('qweight', 'qzeros', 'scales')]
    assert_tensors_equal(AWQDequantize(group_size, torch.float32).apply(ts), ref)


def test_word_orders_are_the_documented_ones():
    """Codes 0..7 of one word: GPTQ's in nibble order down the inputs, AutoAWQ's across the outputs in order 0 2 4 6
    1 3 5 7."""
    codes = torch.arange(8)
    assert _pack(codes[:, None], 4, 0).item() == 0x76543210
    assert _pack(codes[None], 4, 1, AWQ_ORDER).item() == 0x75316420
    assert_tensors_equal(_unpack_rows(torch.tensor([[0x76543210]], dtype=torch.int32), 4)[:, 0], codes.int())
    assert_tensors_equal(_unpack_cols(torch.tensor([[0x75316420]], dtype=torch.int32), 4, AWQ_ORDER)[0], codes.int())


@pytest.mark.parametrize('name', list(BNB))
def test_bnb_decoders_equal_bitsandbytes(name, ckpts):
    d, _ = ckpts[name]
    sd, want = load_file(str(d / 'model.safetensors')), bnb_reference(d)
    units = quantized_tensors(checkpoint_source(d), config_of(d), torch.float32)
    assert sorted(u.target for u in units) == sorted(want) and len(units) == 14
    for u in units:
        assert_tensors_equal(u.op.apply([sd[k] for k in u.sources]), want[u.target], u.target)
    nested = [k for k in sd if k.endswith('.nested_absmax')]
    assert bool(nested) == BNB[name][1]
    storage = BNB[name][2] if len(BNB[name]) > 2 else torch.uint8 if BNB[name][0] != 'int8' else torch.int8
    assert {sd[u.sources[-1] if BNB[name][0] != 'int8' else u.sources[0]].dtype for u in units} == {storage}


def test_codes_of_another_dtype_are_named_by_their_dtype(ckpts, tmp_path):
    "qweight saved as the same bytes in uint8 (four elements a word): the error names the dtype, not the element count."
    from safetensors.torch import save_file

    d = shutil.copytree(ckpts['gptq'][0], tmp_path / 'u8')
    sd, k = load_file(str(d / 'model.safetensors')), 'model.layers.0.mlp.down_proj.qweight'
    sd[k] = sd[k].view(torch.uint8)
    save_file(sd, str(d / 'model.safetensors'), metadata={'format': 'pt'})
    with pytest.raises(
        ValueError, match=re.escape(f"{k!r}: GPTQDequantize: codes are torch.uint8, the format stores torch.int32")
    ):
        quantized_tensors(checkpoint_source(d), config_of(d), torch.float32)


# ---- loaded models against from_pretrained of the reference-dequantized checkpoint


@pytest.mark.parametrize('name', list(CKPTS) + list(BNB))
def test_logits_equal_the_dequantized_reference(name, ckpts, tmp_path):
    d, weights = weights_of(ckpts, name)
    ref = AutoModelForCausalLM.from_pretrained(reference_dir(d, weights, tmp_path / 'ref'), dtype=torch.float32).eval()
    m = load_model(d, dtype=torch.float32)
    assert_tensors_equal(m.model.layers[1].mlp.down_proj.weight, ref.model.layers[1].mlp.down_proj.weight)
    assert_tensors_equal(logits(m), logits(ref), atol=1e-4)
    if name == 'gptq_act':
        ref16 = AutoModelForCausalLM.from_pretrained(tmp_path / 'ref', dtype=torch.bfloat16).eval()
        assert_tensors_equal(logits(load_model(d, dtype=torch.bfloat16)), logits(ref16))


@pytest.mark.parametrize('name', list(CKPTS) + list(BNB))
def test_keep_holds_the_stored_tensors_and_forwards_as_the_reference(name, ckpts, tmp_path):
    """quantized='keep': each quantized layer a QuantizedLinear holding the file's tensors as stored; its weight the
    reference's (the packed integers, bitsandbytes.functional), its logits from_pretrained's of the dequantized file."""
    d, weights = weights_of(ckpts, name)
    sd = load_file(str(d / 'model.safetensors'))
    kept = load_model(d, dtype=torch.float32, quantized='keep')
    units = quantized_tensors(checkpoint_source(d), config_of(d), torch.float32)
    assert len(units) == 14
    for u in units:
        m = kept.get_submodule(u.target.rpartition('.')[0])
        assert isinstance(m, QuantizedLinear), u.target
        held = dict(m.named_parameters())
        if isinstance(u.op, GPTQDequantize) and u.dropped:  # the g_idx the dequantizing load drops: held when kept
            assert_tensors_equal(held.pop('g_idx'), sd[u.dropped[0]], u.target)
        assert sorted(held) == sorted(held_names(u.op)), (u.target, sorted(held))
        for n, k in zip(held_names(u.op), u.sources, strict=True):  # the very bytes (bfloat16-stored codes hold NaNs)
            same = torch.equal(held[n].reshape(-1).view(torch.uint8), sd[k].reshape(-1).view(torch.uint8))
            assert held[n].dtype == sd[k].dtype and held[n].shape == sd[k].shape and same, (u.target, n, k)
        assert_tensors_equal(m.dequantized_weight(), weights[u.target], u.target)
    ref = AutoModelForCausalLM.from_pretrained(reference_dir(d, weights, tmp_path / 'ref'), dtype=torch.float32).eval()
    assert_tensors_equal(logits(kept), logits(ref), atol=1e-4)
    assert_tensors_equal(logits(kept), logits(load_model(d, dtype=torch.float32)))  # as the dequantized load


def test_readme_names_the_formats_keep_holds():
    "The README's keep sentence names GPTQ, AWQ and bitsandbytes, which the test above loads kept."
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / 'README.md').read_text(encoding='utf-8')
    kept = re.search(r"kept quantized \(`quantized='keep'`: ([^)]*)\)", readme)
    assert kept, 'README.md: no "kept quantized (`quantized=\'keep\'`: ...)" sentence'
    named = set(re.split(r', | and ', kept[1]))
    assert {'GPTQ', 'AWQ', 'bitsandbytes'} <= named, named


def test_keep_refuses_codes_of_a_linear_elsewhere_by_key():
    "GPTQ codes on a module that is not an nn.Linear (an Embedding) have no kept layout: refused by key, with the fix."
    t, _ = gptq_quantize(torch.randn(8, 64), 4, 32)
    keys = [f'0.{k}' for k in GPTQ_KEYS]
    u = QuantizedTensor(
        '0.weight', keys, GPTQDequantize(4, 32, True, False), [t[k].shape for k in GPTQ_KEYS], dtypes=[torch.int32] * 4
    )
    with pytest.raises(NotImplementedError) as e:
        keep_quantized(torch.nn.Sequential(torch.nn.Embedding(8, 64)), [u])
    msg = str(e.value)
    assert msg.startswith("'0.qweight': quantized='keep' holds GPTQ codes only in place of an nn.Linear"), msg
    assert msg.endswith("load it with quantized='dequantize'"), msg


def test_contradictions_are_named(ckpts, tmp_path):
    d = shutil.copytree(ckpts['gptq'][0], tmp_path / 'bad')
    cfg = config_of(d)
    cfg['quantization_config']['group_size'] = 64
    (d / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.g_idx' is not k // group_size \(64\).*desc_act false"
    ):
        load_model(d)
    cfg['quantization_config']['desc_act'] = True
    (d / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.scales' has shape \[8, 128\].*group of 64 of 256 inputs"
    ):
        load_model(d)
    cfg['quantization_config'].update(group_size=32, checkpoint_format='marlin')
    (d / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="checkpoint_format 'marlin'"):
        load_model(d)
    a = shutil.copytree(ckpts['awq'][0], tmp_path / 'gemv')
    cfg = config_of(a)
    cfg['quantization_config']['version'] = 'gemv'
    (a / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="version 'gemv'"):
        load_model(a)


def stored_bytes(d) -> int:
    "Bytes of tensor data the checkpoint's file holds, from its safetensors header."
    with open(d / 'model.safetensors', 'rb') as f:
        head = json.loads(f.read(int.from_bytes(f.read(8), 'little')))
    return sum(v['data_offsets'][1] - v['data_offsets'][0] for k, v in head.items() if k != '__metadata__')


@pytest.mark.parametrize('name', ['gptq', 'gptq_act', 'gptq8_v2', 'nf4', 'nf4_nested', 'fp4_nested', 'int8'])
def test_one_device_reads_every_byte_once(name, ckpts):
    "What detection reads (a `g_idx`, a quant state blob) is not read again by the load, nor counted twice by its plan."
    d, _ = ckpts[name]
    assert load_model(d, dtype=torch.float32).bytes_read == stored_bytes(d)
    assert load_plan(d, 0, 1, dtype=torch.float32).total_bytes == stored_bytes(d)


# ---- tensor parallelism: each rank's tensors are the full load's slices, and it reads what its plan says

ONE_GROUP = {'gptq8_v2', 'awq_one_group'}


def whole_keys(name):
    "(stored key, cut dim) -> True where every rank needs all of it: what the bound counts as replicated."

    def whole(k, dim):
        if k.endswith(('.g_idx', '.weight_format')):
            return True  # read to tell act-order from plain groups; a format tag
        # a layer split by its inputs needs every output's scale: int8's absmax, a single group's scales and zero points
        return dim == 1 and (k.endswith('.SCB') or name in ONE_GROUP and k.endswith(('.scales', '.qzeros')))

    return whole


@pytest.mark.parametrize('name', ['gptq', 'gptq8_v2', 'awq', 'awq_one_group', 'int8'])
@pytest.mark.parametrize('ws', [2, 4])
def test_ranks_are_slices_of_the_full_load(name, ws, ckpts):
    d, _ = ckpts[name]
    r = rank_reads(d, ws, whole_keys(name), dtype=torch.float32)
    assert r.full == r.checkpoint, r  # one device reads every byte once
    # the codes, scales and zero points of a split layer are read once over the ranks, in whole words and groups
    assert sum(r.per_rank) <= r.bound(), (sum(r.per_rank), r.bound(), r)


@pytest.mark.parametrize('quantized', ['dequantize', 'keep'])
def test_row_parallel_act_order_and_bnb_4bit_are_refused_by_key(ckpts, quantized):
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj\.qweight': act-order g_idx"):
        load_model(ckpts['gptq_act'][0], rank=0, world_size=2, quantized=quantized)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight': bitsandbytes nf4 stores"):
        load_model(ckpts['nf4_nested'][0], rank=0, world_size=2, quantized=quantized)


@pytest.mark.parametrize('name', ['gptq', 'gptq8_v2', 'awq', 'awq_one_group', 'int8'])
@pytest.mark.parametrize('ws', [2, 4])
def test_kept_ranks_hold_slices_of_the_reference(name, ws, ckpts):
    """Kept under TP: each rank holds the full keep's codes, scales and zero points cut where its plan pins them, reads
    what its load_plan says, and its kept layers dequantize to its slice of the reference weight."""
    d, weights = weights_of(ckpts, name)
    r = rank_reads(d, ws, whole_keys(name), dtype=torch.float32, quantized='keep')
    # detection reads each g_idx whole (act-order or plain groups?) before the load reads the rank's part of it
    g_idx = sum(t.nbytes for k, t in load_file(str(d / 'model.safetensors')).items() if k.endswith('.g_idx'))
    assert r.full == r.checkpoint + g_idx, r
    assert sum(r.per_rank) <= r.bound() + ws * g_idx, (sum(r.per_rank), r.bound(), r)
    for rank in range(ws):
        m = load_model(d, rank=rank, world_size=ws, dtype=torch.float32, quantized='keep')
        kept = {n: q for n, q in m.named_modules() if isinstance(q, QuantizedLinear)}
        assert len(kept) == 14
        for n, q in kept.items():
            w, sl = weights[n + '.weight'], q.tp_slice
            ((a, b),) = sl.ranges
            assert_tensors_equal(q.dequantized_weight(), w.narrow(sl.dim, a, b - a), f'rank {rank}: {n}')


@pytest.mark.parametrize('fmt', ['gptq', 'gptq_no_g_idx', 'awq'])
@pytest.mark.parametrize('dim', [0, 1])
def test_cuts_read_whole_words_and_groups(fmt, dim):
    """Cuts of every start and stop on a shape that divides neither the words nor the groups equal the full decode's
    slice."""
    torch.manual_seed(dim)
    N, K = 20, 100
    t, ref = awq_quantize(torch.randn(N, K), 32) if fmt == 'awq' else gptq_quantize(torch.randn(N, K), 4, 32)
    keys = GPTQ_KEYS if fmt == 'gptq' else GPTQ_KEYS[:3]
    ts = [t[k] for k in keys]
    # plain groups: the load takes no g_idx, and the op counts the inputs itself
    op = {
        'gptq': GPTQDequantize(4, 32, True, False, target_dtype=torch.float32),
        'awq': AWQDequantize(32, torch.float32),
        'gptq_no_g_idx': GPTQDequantize(4, 32, True, False, target_dtype=torch.float32, g_idx=False, inputs=K),
    }[fmt]
    size = (N, K)[dim]
    for a in range(0, size, 3):
        for b in range(a + 1, size + 1, 5):
            c = op.cut([x.shape for x in ts], dim, a, b)
            parts = [x if p is None else x.narrow(p[0], p[1], p[2] - p[1]) for x, p in zip(ts, c.parts, strict=True)]
            assert_tensors_equal(dequantize_cut(c, parts), ref.narrow(dim, a, b - a), f'[{a}, {b}) of dim {dim}')
            unit = 32 if dim == 1 else 8  # whole groups of 32 inputs, or whole words of eight outputs
            lo, hi = a // unit * unit, min(-(-b // unit) * unit, size)
            packed = fmt != 'awq' and dim == 1 or fmt == 'awq' and dim == 0
            assert parts[0].shape[1 - dim] == (-(-hi // 8) - lo // 8 if packed else hi - lo), (
                f'[{a}, {b}): codes read {list(parts[0].shape)}'
            )


@pytest.mark.skipif(not os.environ.get('MSTAR_UTILS_SLOW'), reason='spawns two ranks (40 s): set MSTAR_UTILS_SLOW=1')
def test_tp_logits_equal_the_dequantized_reference(ckpts, tmp_path):
    "Two ranks with their collectives, dequantized and kept: each rank's logits equal from_pretrained of the reference."
    from mstar_utils.testing import run_ranks, tp_cells

    cells = [(n, q) for n in ['gptq', 'awq', 'int8'] for q in ('dequantize', 'keep')]
    jobs = [(ckpts[n][0], {'input_ids': IDS}, False, q) for n, q in cells]
    per_rank = run_ranks(tp_cells, 2, jobs, timeout=600)
    for i, (n, q) in enumerate(cells):
        d, weights = weights_of(ckpts, n)
        ref_dir = tmp_path / n
        ref_dir = ref_dir if ref_dir.exists() else reference_dir(d, weights, ref_dir)
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
        for r, res in enumerate(per_rank):
            got = torch.load(io.BytesIO(res[i]), weights_only=False)['logits']
            assert_tensors_equal(got, logits(ref), f'{n} {q} rank {r}', atol=1e-4)


@pytest.mark.parametrize(
    'name,line',
    [
        ('gptq_act', 'GPTQ int4 in int32, groups of 32, act-order, gptq zero points'),
        ('gptq8_v2', 'GPTQ int8 in int32, one group, gptq_v2 zero points'),
        ('awq', 'AWQ int4 in int32 (GEMM order), groups of 32'),
        ('nf4_nested', 'bitsandbytes nf4, absmax per 64, nested'),
        ('int8', 'bitsandbytes int8, SCB per row'),
    ],
)
def test_explore_names_the_format(name, line, ckpts):
    from mstar_utils.explore import explore

    text = str(explore(ckpts[name][0]))
    assert re.search(r'model\.layers\.\*\.mlp\.down_proj\.weight +' + re.escape(line) + ' ', text), text[
        text.index('2. Formats') :
    ][:800]
    assert '3. Will it load: yes' in text


@pytest.mark.parametrize('name', ['nf4_nested', 'fp4', 'int8'])
def test_explore_lists_only_the_tp_sizes_load_accepts(name, ckpts):
    """explore's bytes-per-rank summary names a size only where load_plan and load_model take it; the others are
    refused by both."""
    from transformers import AutoConfig
    from mstar_utils.explore import explore, rank_table
    from mstar_utils.explore_render import _ranks

    d = ckpts[name][0]
    rows, _ = rank_table(d, AutoConfig.from_pretrained(d))
    listed = {r.world_size for r in rows if not r.refused}
    assert 1 in listed and (name == 'int8') == (listed == {1, 2, 4, 8}), (
        listed
    )  # 4-bit: flattened blocks, one device only
    for r in rows:
        if r.refused:
            with pytest.raises(ValueError, match=re.escape(r.refused.split(';')[0])):
                load_model(d, rank=0, world_size=r.world_size)
        else:
            for rank in range(r.world_size):
                load_plan(d, rank, r.world_size)
            load_model(d, rank=r.world_size - 1, world_size=r.world_size)
    summary = _ranks(explore(d, stats=False))[0]
    assert summary.split(';')[0] == 'TP ' + ', '.join(map(str, sorted(listed))), summary


def test_a_format_keep_cannot_hold_is_still_refused_by_key():
    "An op that sets `keepable = False` is refused by its codes' key, with what keep holds and the fix."
    import dataclasses
    from typing import ClassVar

    from mstar_utils.quantized import FP8BlockDequantize

    @dataclasses.dataclass(frozen=True)
    class Unkept(FP8BlockDequantize):
        keepable: ClassVar[bool] = False
        format_name: ClassVar[str] = 'a new format'

    u = QuantizedTensor(
        '0.weight', ['0.weight', '0.weight_scale_inv'], Unkept(), [(2, 2), (1, 1)], dtypes=[torch.uint8] * 2
    )
    with pytest.raises(NotImplementedError) as e:
        keep_quantized(torch.nn.Sequential(torch.nn.Linear(2, 2)), [u])
    msg = str(e.value)
    assert msg.startswith("'0.weight': quantized='keep' holds no a new format codes (Unkept)"), msg
    assert 'GPTQ, AWQ, bitsandbytes NF4, FP4 and int8' in msg and msg.endswith("quantized='dequantize'"), msg
