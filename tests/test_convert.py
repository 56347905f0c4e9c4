"""WeightConverter recipes: parity with transformers' from_pretrained per MoE family, expert order, every error case,
the semantics against transformers' own ops, and how a group is read."""

import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from safetensors.torch import save_file, load_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig
from mstar_utils.upstream import weight_ops
from transformers.utils import logging as hf_logging

from mstar_utils.convert import (
    Operation,
    WeightConverter,
    KeysAndConverter,
    group_keys,
    converted_source,
    convert_state_dict,
    MIXTRAL_CONVERSIONS,
    QWEN2_MOE_CONVERSIONS,
    QWEN3_MOE_CONVERSIONS,
    DEEPSEEK_V2_CONVERSIONS,
)
from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards, check_loaded
from mstar_utils.sources import read_weight_map, FileSource, Source
from mstar_utils.model import build_on_meta
from mstar_utils.testing import assert_state_dict_equal, save_tiny, tiny_configs

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

E = 16  # experts: string order (0, 1, 10, ...) differs from integer order
FAMILIES = {  # name: (config, recipe, per-expert key, the three projections' names)
    'mixtral': (MIXTRAL_CONVERSIONS, 'model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight', ('w1', 'w3', 'w2')),
    'qwen2_moe': (
        QWEN2_MOE_CONVERSIONS,
        'model.layers.{l}.mlp.experts.{e}.{w}.weight',
        ('gate_proj', 'up_proj', 'down_proj'),
    ),
    'qwen3_moe': (
        QWEN3_MOE_CONVERSIONS,
        'model.layers.{l}.mlp.experts.{e}.{w}.weight',
        ('gate_proj', 'up_proj', 'down_proj'),
    ),
    'deepseek_v2': (
        DEEPSEEK_V2_CONVERSIONS,
        'model.layers.{l}.mlp.experts.{e}.{w}.weight',
        ('gate_proj', 'up_proj', 'down_proj'),
    ),
}
FAMILIES = {name: ((lambda n=name: tiny_configs()[n]), *rest) for name, rest in FAMILIES.items()}


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    "Each family saved by transformers' save_pretrained (bf16, several shards)."
    root = tmp_path_factory.mktemp('moe')
    out = {}
    for name in FAMILIES:
        out[name] = save_tiny(name, root / name, dtype=torch.bfloat16)
    return out


@pytest.fixture(scope='module')
def refs(folders):
    return {name: AutoModelForCausalLM.from_pretrained(folder) for name, folder in folders.items()}


def meta_model(folder, dtype=torch.bfloat16):
    return build_on_meta(AutoConfig.from_pretrained(folder), dtype=dtype)


def checkpoint(folder):
    sd = {}
    for f in sorted(set(read_weight_map(folder).values())):
        sd.update(load_file(f))
    return sd


def copy_checkpoint(folder, dest, edit):
    "A single-file copy of the checkpoint in `folder`, after `edit(state_dict)`."
    dest.mkdir()
    sd = checkpoint(folder)
    edit(sd)
    save_file(sd, dest / 'model.safetensors')
    (dest / 'config.json').write_text((folder / 'config.json').read_text())
    return dest


# ---- parity with transformers


@pytest.mark.parametrize('name', list(FAMILIES))
def test_save_pretrained_writes_per_expert_layout(folders, name):
    _, _, key, (g, u, d) = FAMILIES[name]
    wm = read_weight_map(folders[name])
    for layer in (1, 2):
        for e in range(E):
            for w in (g, u, d):
                assert key.format(l=layer, e=e, w=w) in wm
    assert not any('gate_up_proj' in k for k in wm)
    # some layer's experts are spread over two shards: a group is read across files
    assert any(len({wm[key.format(l=layer, e=e, w=w)] for e in range(E) for w in (g, u)}) > 1 for layer in (1, 2)), (
        'a group should span shards'
    )


@pytest.mark.parametrize('name', list(FAMILIES))
def test_parity_meta_model(folders, refs, name):
    model = meta_model(folders[name])
    [loaded] = load_weights_from_hf_shards(folders[name], [ModuleAndPrefix(model)], conv=FAMILIES[name][1])
    check_loaded(model, loaded, name)
    ours, theirs = model.state_dict(), refs[name].state_dict()
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k
    ids = torch.tensor([[1, 5, 9, 13, 2, 77]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, refs[name](ids).logits)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_parity_materialized_model(folders, refs, dtype):
    """A materialized module is filled in place: in the checkpoint dtype straight into its memory (get(out=...)),
    otherwise by a cast copy."""
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders['qwen2_moe']), dtype=dtype)
    ptr = model.model.layers[1].mlp.experts.gate_up_proj.data_ptr()
    load_weights_from_hf_shards(folders['qwen2_moe'], [ModuleAndPrefix(model)], conv=QWEN2_MOE_CONVERSIONS)
    assert model.model.layers[1].mlp.experts.gate_up_proj.data_ptr() == ptr
    theirs = refs['qwen2_moe'].state_dict()
    assert_state_dict_equal(model, theirs, cast=True)


def test_parity_with_prefix(folders, refs):
    "The decoder alone, under prefix 'model.': target keys keep the prefix of the keys they came from."
    cfg = AutoConfig.from_pretrained(folders['mixtral'])
    dec = build_on_meta(cfg, type(AutoModelForCausalLM.from_config(cfg).model), torch.bfloat16)
    [loaded] = load_weights_from_hf_shards(
        folders['mixtral'], [ModuleAndPrefix(dec, 'model.')], conv=MIXTRAL_CONVERSIONS
    )
    check_loaded(dec, loaded, 'decoder')
    assert torch.equal(dec.layers[2].mlp.experts.down_proj, refs['mixtral'].model.layers[2].mlp.experts.down_proj)


@pytest.mark.parametrize('name', ['mixtral', 'deepseek_v2'])
def test_expert_order_is_integer_order(folders, name):
    _, conv, key, (g, u, d) = FAMILIES[name]
    sd, model = checkpoint(folders[name]), meta_model(folders[name])
    load_weights_from_hf_shards(folders[name], [ModuleAndPrefix(model)], conv=conv)
    experts = model.model.layers[2].mlp.experts
    i = experts.gate_up_proj.shape[1] // 2
    for e in range(E):
        assert torch.equal(experts.gate_up_proj[e, :i], sd[key.format(l=2, e=e, w=g)])
        assert torch.equal(experts.gate_up_proj[e, i:], sd[key.format(l=2, e=e, w=u)])
        assert torch.equal(experts.down_proj[e], sd[key.format(l=2, e=e, w=d)])
    # 10 follows 9: the string order would put 10 after 1
    assert torch.equal(experts.down_proj[10], sd[key.format(l=2, e=10, w=d)])
    assert not torch.equal(experts.down_proj[2], sd[key.format(l=2, e=10, w=d)])


def test_group_keys_ignores_key_order():
    keys = [f'm.layers.0.mlp.experts.{e}.{p}.weight' for e in range(E) for p in ('gate_proj', 'up_proj', 'down_proj')]
    a = group_keys(keys, QWEN2_MOE_CONVERSIONS)
    random.Random(0).shuffle(keys)
    b = group_keys(keys, QWEN2_MOE_CONVERSIONS)
    assert a == b and isinstance(a['m.layers.0.mlp.experts.gate_up_proj'], KeysAndConverter)
    assert len(a['m.layers.0.mlp.experts.gate_up_proj'].keys) == 2 * E


# ---- semantics against transformers' own ops


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 24), st.integers(1, 3), st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_ops_match_transformers(n, n_patterns, shape, data):
    """MergeModulelist(dim) then Concatenate(dim) give what transformers' ops of the same names give on the per-pattern
    lists in integer index order; where transformers' ops fail on shapes, ours raise ValueError naming the target."""
    r = len(shape)
    m = data.draw(st.integers(-(r + 1), r), label='merge_dim')
    c = data.draw(st.integers(-(r + 1), r), label='cat_dim')
    mn, cn = m % (r + 1), c % (r + 1)
    axis = None if cn == mn else (cn if cn < mn else cn - 1)  # the per-expert axis the concatenation runs along
    patterns = [f'experts.*.w{j}' for j in range(n_patterns)]
    lists, sd = {}, {}
    for j, p in enumerate(patterns):
        one = list(shape)
        if axis is not None:
            one[axis] = data.draw(st.integers(1, 3), label=f'width{j}')
        lists[p] = [torch.randn(one) for _ in range(n)]
    if data.draw(st.booleans(), label='perturb'):  # one expert of one pattern gets another shape
        j, e, a = (
            data.draw(st.integers(0, n_patterns - 1)),
            data.draw(st.integers(0, n - 1)),
            data.draw(st.integers(0, r - 1)),
        )
        t = lists[patterns[j]][e]
        bad = list(t.shape)
        bad[a] += 1
        lists[patterns[j]][e] = torch.randn(bad)
    for p, ts in lists.items():
        for e, t in enumerate(ts):
            sd[f'block.{p.replace("*", str(e))}'] = t
    keys = list(sd)
    random.Random(n).shuffle(keys)
    sd = {k: sd[k] for k in keys}
    ops = [Operation('MergeModulelist', m)] + ([Operation('Concatenate', c)] if n_patterns > 1 else [])
    try:
        want = weight_ops().MergeModulelist(m).convert({p: list(ts) for p, ts in lists.items()}, patterns, ['t'])
        if n_patterns > 1:
            want = weight_ops().Concatenate(c).convert(want, patterns, ['t'])
        [want] = want.values()
    except RuntimeError:
        with pytest.raises(ValueError, match="target 'block.fused'"):
            convert_state_dict(sd, [WeightConverter(patterns, 'fused', ops)])
        return
    got = convert_state_dict(sd, [WeightConverter(patterns, 'fused', ops)])
    assert list(got) == ['block.fused'] and torch.equal(got['block.fused'], want)


def test_rename_without_operations():
    sd = {'m.block_sparse_moe.gate.weight': torch.randn(4, 3), 'm.other': torch.zeros(1)}
    out = convert_state_dict(sd, [MIXTRAL_CONVERSIONS[2]])
    assert sorted(out) == ['m.mlp.gate.weight', 'm.other'] and torch.equal(
        out['m.mlp.gate.weight'], sd['m.block_sparse_moe.gate.weight']
    )


def test_patterns_match_whole_parts():
    c = WeightConverter(['experts.*.w1.weight'], 'experts.w1', [Operation('MergeModulelist')])
    assert c.match('layers.0.experts.3.w1.weight')[1:] == (3, 'layers.0.experts.w1')
    assert c.match('layers.0.shared_experts.3.w1.weight') is None  # 'experts' must start a part
    assert c.match('layers.0.experts.3.w1.weight_scale_inv') is None  # and 'weight' end one
    assert c.match('layers.0.experts.x.w1.weight') is None  # '*' is an integer
    assert (
        WeightConverter(['.experts.*.w1.weight'], '.experts.w1', [Operation('MergeModulelist')]).match(
            'a.experts.0.w1.weight'
        )[2]
        == 'a.experts.w1'
    )


# ---- reading a group


class Spy(Source):
    "A source over a state_dict that records each read and the buffer it was asked to fill."

    def __init__(self, sd):
        self.sd, self.reads = sd, []

    def keys(self):
        return self.sd.keys()

    def __contains__(self, k):
        return k in self.sd

    def shape(self, k):
        return tuple(self.sd[k].shape)

    def dtype(self, k):
        return self.sd[k].dtype

    def where(self, k):
        return 'spy'

    def get(self, k, out=None):
        self.reads.append((k, out))
        if out is None:
            return self.sd[k].clone()
        return out.copy_(self.sd[k])

    def close(self):
        pass


def experts_sd(n=E, i=3, h=5):
    return {
        f'l.mlp.experts.{e}.{p}.weight': torch.randn(h if p == 'down_proj' else i, i if p == 'down_proj' else h)
        for e in range(n)
        for p in ('gate_proj', 'up_proj', 'down_proj')
    }


def test_group_read_straight_into_result():
    "MergeModulelist(0) + Concatenate(1): every source tensor is read into its own slice of the result, no temporaries."
    sd = experts_sd()
    spy = Spy(sd)
    src = converted_source(spy, QWEN2_MOE_CONVERSIONS)
    assert spy.reads == []  # building the source reads headers only
    out = src.get('l.mlp.experts.gate_up_proj')
    assert out.shape == (E, 6, 5) and len(spy.reads) == 2 * E
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    for k, buf in spy.reads:
        assert buf is not None and lo <= buf.data_ptr() < hi, k
    # the loader's `out`: the module's own memory is the result
    target = torch.empty(E, 6, 5)
    assert src.get('l.mlp.experts.gate_up_proj', out=target) is target and torch.equal(target, out)
    assert sorted(src.keys()) == ['l.mlp.experts.down_proj', 'l.mlp.experts.gate_up_proj']


def test_group_read_through_one_scratch_buffer():
    """Concatenate on the last axis makes each slice strided: each source is read into a buffer of its own shape,
    then copied in."""
    sd = experts_sd()
    spy = Spy(sd)
    conv = [
        WeightConverter(
            ['mlp.experts.*.gate_proj.weight', 'mlp.experts.*.up_proj.weight'],
            'mlp.experts.gu_t',
            [Operation('MergeModulelist', 0), Operation('Concatenate', -1)],
        )
    ]
    out = converted_source(spy, conv).get('l.mlp.experts.gu_t')
    ref = torch.cat(
        [torch.stack([sd[f'l.mlp.experts.{e}.{p}.weight'] for e in range(E)]) for p in ('gate_proj', 'up_proj')], -1
    )
    assert torch.equal(out, ref)
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    assert len(spy.reads) == 2 * E and all(
        buf.shape == (3, 5) and not lo <= buf.data_ptr() < hi for _, buf in spy.reads
    )


def test_source_passthrough_and_headers(folders):
    "Unconsumed keys pass through; a target's shape and dtype come from the headers; consumed keys are gone."
    wm = read_weight_map(folders['mixtral'])
    src = converted_source(FileSource(wm, str(folders['mixtral'])), MIXTRAL_CONVERSIONS)
    try:
        assert 'model.layers.0.block_sparse_moe.experts.3.w1.weight' not in src
        assert 'model.layers.0.block_sparse_moe.gate.weight' not in src and 'model.layers.0.mlp.gate.weight' in src
        assert src.shape('model.layers.0.mlp.experts.gate_up_proj') == (E, 32, 32)
        assert src.shape('model.layers.0.mlp.experts.down_proj') == (E, 32, 16)
        assert src.dtype('model.layers.0.mlp.experts.gate_up_proj') == torch.bfloat16
        assert (
            len(src.keys()) == len(wm) - 3 * 3 * E + 3 * 2
        )  # per layer: 3 x E expert keys became 2 targets (the router is renamed)
        assert 'built from 32 keys' in src.where('model.layers.0.mlp.experts.gate_up_proj')
        assert 'model.embed_tokens.weight' in src
    finally:
        src.close()


# ---- errors


@pytest.mark.parametrize(
    'kw, msg',
    [
        (dict(source_patterns=['experts.*.w1.weight'], operations=[Operation('Stack')]), "unknown operation 'Stack'"),
        (
            dict(source_patterns=['gate.weight'], operations=[Operation('MergeModulelist')]),
            "'gate.weight' has no \"*\"",
        ),
        (dict(source_patterns=['experts.*.w1.*'], operations=[Operation('MergeModulelist')]), 'has 2 "*"'),
        (dict(source_patterns=['experts.*.w1.weight'], operations=[]), 'add Operation("MergeModulelist")'),
        (
            dict(
                source_patterns=['experts.*.w1.weight', 'experts.*.w3.weight'],
                operations=[Operation('MergeModulelist')],
            ),
            'add Operation("Concatenate")',
        ),
        (
            dict(
                source_patterns=['experts.*.w1.weight', 'experts.*.w3.weight'], operations=[Operation('Concatenate', 1)]
            ),
            'Concatenate before MergeModulelist',
        ),
        (
            dict(
                source_patterns=['experts.*.w1.weight'],
                operations=[Operation('MergeModulelist'), Operation('MergeModulelist')],
            ),
            'merged already',
        ),
        (
            dict(source_patterns=['experts.*.w1.weight'], operations=[Operation('MergeModulelist', 1.0)]),
            'dim must be an int',
        ),
        (
            dict(source_patterns=['a.weight', 'a.weight'], operations=[Operation('Concatenate')]),
            'repeated source pattern',
        ),
    ],
)
def test_converter_errors(kw, msg):
    with pytest.raises(ValueError, match="target 'experts.fused'") as e:
        WeightConverter(target_patterns='experts.fused', **kw)
    assert msg in str(e.value)


def test_target_with_star_is_refused():
    with pytest.raises(ValueError, match='without "\\*"'):
        WeightConverter(['experts.*.w1'], 'experts.*.w', [Operation('MergeModulelist')])


def test_conv_must_hold_converters():
    with pytest.raises(TypeError, match='WeightConverter'):
        group_keys(['a'], [Operation('MergeModulelist')])


def test_gap_in_indices_names_target(folders, tmp_path):
    drop = 'model.layers.1.block_sparse_moe.experts.9.w3.weight'
    folder = copy_checkpoint(folders['mixtral'], tmp_path / 'gap', lambda sd: sd.pop(drop))
    with pytest.raises(
        ValueError,
        match=(
            r"target 'model.layers.1.mlp.experts.gate_up_proj': "
            r"source pattern 'block_sparse_moe.experts.\*.w3.weight' has indices up to 15 but lacks \[9\]"
        ),
    ):
        load_weights_from_hf_shards(folder, [ModuleAndPrefix(meta_model(folder))], conv=MIXTRAL_CONVERSIONS)


def test_missing_last_expert_is_a_shape_mismatch(folders, tmp_path):
    "Without expert 15 the group is a complete 0..14: the module's shape catches it, naming the target key."

    def edit(sd):
        for w in ('gate_proj', 'up_proj', 'down_proj'):
            sd.pop(f'model.layers.2.mlp.experts.15.{w}.weight')

    folder = copy_checkpoint(folders['qwen2_moe'], tmp_path / 'short', edit)
    with pytest.raises(
        ValueError,
        match=(
            r"shape mismatch for 'model.layers.2.mlp.experts.gate_up_proj'.*"
            r"checkpoint has \[15, 32, 32\].*expects \[16, 32, 32\]"
        ),
    ):
        load_weights_from_hf_shards(folder, [ModuleAndPrefix(meta_model(folder))], conv=QWEN2_MOE_CONVERSIONS)


def test_repeated_index_names_both_keys():
    sd = experts_sd(4)
    sd['l.mlp.experts.02.gate_proj.weight'] = sd['l.mlp.experts.2.gate_proj.weight']
    with pytest.raises(
        ValueError,
        match=(
            r"target 'l.mlp.experts.gate_up_proj': index 2 given twice, by 'l.mlp.experts.0?2.gate_proj.weight' and "
            r"'l.mlp.experts.0?2.gate_proj.weight'"
        ),
    ):
        convert_state_dict(sd, QWEN2_MOE_CONVERSIONS)


def test_pattern_without_keys_in_group():
    sd = {k: v for k, v in experts_sd(4).items() if 'up_proj' not in k}
    with pytest.raises(
        ValueError,
        match=r"target 'l.mlp.experts.gate_up_proj': no key matches source pattern 'mlp.experts.\*.up_proj.weight'",
    ):
        convert_state_dict(sd, QWEN2_MOE_CONVERSIONS)


def test_shapes_disagree_names_keys(folders, tmp_path):
    key = 'model.layers.2.mlp.experts.11.down_proj.weight'
    folder = copy_checkpoint(
        folders['deepseek_v2'],
        tmp_path / 'shape',
        lambda sd: sd.__setitem__(key, torch.zeros(32, 17, dtype=torch.bfloat16)),
    )
    with pytest.raises(
        ValueError,
        match=(
            r"target 'model.layers.2.mlp.experts.down_proj': "
            rf"shapes disagree under MergeModulelist.*'{key}' has \[32, 17\]"
        ),
    ):
        load_weights_from_hf_shards(folder, [ModuleAndPrefix(meta_model(folder))], conv=DEEPSEEK_V2_CONVERSIONS)


def test_concat_shapes_disagree():
    sd = experts_sd(4)
    for e in range(4):
        sd[f'l.mlp.experts.{e}.up_proj.weight'] = torch.zeros(3, 6)
    with pytest.raises(
        ValueError,
        match=(
            r"target 'l.mlp.experts.gate_up_proj': "
            r"shapes disagree under Concatenate \(needs shapes equal except on dim 1\)"
        ),
    ):
        convert_state_dict(sd, QWEN2_MOE_CONVERSIONS)


def test_dtypes_disagree():
    sd = experts_sd(4)
    sd['l.mlp.experts.3.up_proj.weight'] = sd['l.mlp.experts.3.up_proj.weight'].half()
    with pytest.raises(
        ValueError,
        match=(
            r"target 'l.mlp.experts.gate_up_proj': dtypes disagree: .* is torch.float32, "
            r"'l.mlp.experts.3.up_proj.weight' is torch.float16"
        ),
    ):
        convert_state_dict(sd, QWEN2_MOE_CONVERSIONS)


def test_dim_out_of_range():
    c = WeightConverter(['experts.*.w'], 'experts.fused', [Operation('MergeModulelist', 3)])
    with pytest.raises(
        ValueError, match=r"target 'experts.fused': MergeModulelist dim=3 is out of range for 2-d tensors"
    ):
        convert_state_dict({f'experts.{e}.w': torch.zeros(2, 2) for e in range(3)}, [c])


def test_target_that_is_also_a_checkpoint_key():
    sd = experts_sd(2)
    sd['l.mlp.experts.down_proj'] = torch.zeros(1)
    with pytest.raises(ValueError, match="target key 'l.mlp.experts.down_proj' is also a checkpoint key"):
        convert_state_dict(sd, QWEN2_MOE_CONVERSIONS)


def test_key_matched_by_two_patterns():
    conv = QWEN2_MOE_CONVERSIONS + [
        WeightConverter(['experts.*.down_proj.weight'], 'experts.other', [Operation('MergeModulelist')])
    ]
    with pytest.raises(
        ValueError,
        match="matches source pattern 'mlp.experts.*.down_proj.weight'.*and 'experts.*.down_proj.weight'.*disjoint",
    ):
        group_keys(experts_sd(2), conv)


def test_unfed_target_is_a_missing_key(folders):
    "A fused parameter that no rule feeds is reported as missing, before anything is read."
    model = meta_model(folders['deepseek_v2'])
    conv = [DEEPSEEK_V2_CONVERSIONS[0]]  # down_proj has no rule
    with pytest.raises(KeyError, match=r"missing key\(s\).*model.layers.1.mlp.experts.down_proj"):
        load_weights_from_hf_shards(folders['deepseek_v2'], [ModuleAndPrefix(model)], conv=conv)
    assert model.model.layers[1].mlp.experts.gate_up_proj.is_meta
    with pytest.raises(KeyError, match=r"model.layers.1.mlp.experts.gate_up_proj"):
        load_weights_from_hf_shards(folders['deepseek_v2'], [ModuleAndPrefix(model)])


def test_unknown_key_after_conversion():
    src = converted_source(Spy(experts_sd(2)), QWEN2_MOE_CONVERSIONS)
    with pytest.raises(KeyError, match="no key 'l.mlp.experts.0.up_proj.weight' after conversion"):
        src.get('l.mlp.experts.0.up_proj.weight')
    with pytest.raises(
        ValueError,
        match=(
            r"out for 'l.mlp.experts.gate_up_proj' must be a contiguous CPU torch.float32 tensor of shape \[2, 6, 5\]"
        ),
    ):
        src.get('l.mlp.experts.gate_up_proj', out=torch.empty(2, 6, 4))


# ---- memory

_MEASURE = r'''
import json, os, sys
os.environ['HF_HUB_OFFLINE'] = '1'
import torch
from transformers import AutoConfig
import transformers.models.qwen3_moe.modeling_qwen3_moe
from mstar_utils.model import build_on_meta
from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards
from mstar_utils.convert import QWEN3_MOE_CONVERSIONS
def status(field):
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(field + ':'))
ck = sys.argv[1]
model = build_on_meta(AutoConfig.from_pretrained(ck), dtype=torch.bfloat16)
with open('/proc/self/clear_refs', 'w') as f: f.write('5')  # VmHWM := current RSS
base = status('VmRSS')
load_weights_from_hf_shards(ck, [ModuleAndPrefix(model)], conv=QWEN3_MOE_CONVERSIONS, progress=False)
print(json.dumps(dict(peak=status('VmHWM') - base, model=sum(t.nbytes for t in model.state_dict().values()))))
'''


@pytest.mark.skipif(
    not os.path.exists('/proc/self/clear_refs'), reason='needs Linux /proc/self/clear_refs to reset the peak RSS'
)
def test_peak_memory_is_the_model(tmp_path):
    """Loading into a meta model adds the model's bytes and next to nothing: no group is held twice (as a list of
    experts and their stack) and no two groups at once. The bound leaves a quarter of the largest group for allocator
    slack, less than the whole group that reading the experts into a list and then stacking them would add."""
    import subprocess
    import sys
    import json as _json

    cfg = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=512,
        moe_intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=E,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / 'ck', max_shard_size='30MB')
    group = E * 2 * 512 * 512 * 2  # gate_up_proj of one layer, bf16
    p = subprocess.run(
        [sys.executable, '-c', _MEASURE, str(tmp_path / 'ck')],
        capture_output=True,
        text=True,
        env={**os.environ, 'HF_HUB_OFFLINE': '1'},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    r = _json.loads(p.stdout.strip().splitlines()[-1])
    assert r['model'] > 6 * group
    assert r['peak'] <= r['model'] + group // 4, (r['peak'] - r['model']) / group
