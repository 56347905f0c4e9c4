"""The loader's contract at the edges: parameter objects survive, caller tensors are never aliased, ties are one slot
for the whole load, unused keys are reported and quantized keys refused, the folders people have, errors that say the
fix, UTF-8 whatever the locale. Each handed case is a test, and each kind has a test over many shapes (hypothesis)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st, HealthCheck
from safetensors.torch import save_file, load_file

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import mstar_utils
from mstar_utils.loading import (
    ModuleAndPrefix,
    load_weights,
    load_weights_from_file,
    load_weights_from_hf_shards,
    check_loaded,
    load_from_source,
    qualifying_keys,
)
from mstar_utils.sources import INDEX_FILE, SINGLE_FILE, DictSource, read_weight_map
from mstar_utils.convert import WeightConverter
from mstar_utils.testing import assert_state_dict_equal
from mstar_utils.model import build_on_meta, load_model


class TaggedParameter(nn.Parameter):
    """A parameter subclass with attributes, as vLLM's layers hang `weight_loader`, `output_dim` and quantization
    metadata."""


class VllmStyleParameter(nn.Parameter):
    "A subclass whose constructor needs a keyword (as vLLM's BasevLLMParameter): the loader must not call it."

    def __new__(cls, data, *, weight_loader):
        p = super().__new__(cls, data, requires_grad=False)
        p.weight_loader = weight_loader
        return p


def tagged_linear(device='meta', cls=TaggedParameter, requires_grad=False):
    lin = nn.Linear(3, 2, bias=False, device=device)
    if cls is VllmStyleParameter:
        p = cls(lin.weight.data, weight_loader='wl')
    else:
        p = cls(lin.weight.data, requires_grad=requires_grad)
        p.weight_loader = 'wl'
    p.output_dim = 0
    lin.weight = p
    return lin


def one_file(tmp_path, sd, name='w.safetensors'):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / name))
    return tmp_path / name


# ---------------------------------------------------------------- 1. parameter objects survive


def test_handed_case_parameter_subclass_keeps_class_and_attributes(tmp_path):
    """A meta Linear whose weight is a Parameter subclass carrying weight_loader and output_dim=0, by
    load_weights_from_file."""
    lin = tagged_linear()
    before = lin.weight
    f = one_file(tmp_path, {'weight': torch.randn(2, 3)})
    load_weights_from_file(f, [ModuleAndPrefix(lin)])
    assert lin.weight is before and type(lin.weight) is TaggedParameter
    assert (lin.weight.weight_loader, lin.weight.output_dim, lin.weight.requires_grad) == ('wl', 0, False)
    assert torch.equal(lin.weight, load_file(f)['weight'])


LOADERS = ['state_dict', 'file', 'shards', 'shards_conv', 'shards_mmap']


def _load(kind, tmp_path, module, sd):
    if kind == 'state_dict':
        return load_weights(sd, module)
    f = one_file(tmp_path, sd, SINGLE_FILE)
    if kind == 'file':
        return load_weights_from_file(f, [module])
    conv = (
        [WeightConverter(['weight'], 'weight', [])] if kind == 'shards_conv' else None
    )  # a rename onto itself: through ConvertedSource
    return load_weights_from_hf_shards(tmp_path, [module], conv=conv, mmap=kind == 'shards_mmap')


@pytest.mark.parametrize('kind', LOADERS)
@pytest.mark.parametrize('device', ['meta', 'cpu'])
@pytest.mark.parametrize('cls', [TaggedParameter, VllmStyleParameter])
@pytest.mark.parametrize('requires_grad', [False, True])
def test_parameter_object_class_attributes_and_requires_grad_survive(tmp_path, kind, device, cls, requires_grad):
    if cls is VllmStyleParameter and requires_grad:
        pytest.skip('that subclass fixes requires_grad=False')
    lin = tagged_linear(device, cls, requires_grad)
    p, rg = lin.weight, lin.weight.requires_grad
    w = torch.randn(2, 3)
    _load(kind, tmp_path, lin, {'weight': w})
    assert (
        lin.weight is p and type(p) is cls and p.weight_loader == 'wl' and p.output_dim == 0 and p.requires_grad == rg
    )
    assert not p.is_meta and torch.equal(p.detach(), w)


def test_load_model_keeps_parameter_objects_of_a_cast_dtype(smol_ckpt):
    "load_model into float32 from bf16 shards: every parameter object the build made is the one the model holds."
    model = build_on_meta(__import__('transformers').AutoConfig.from_pretrained(smol_ckpt), dtype=torch.float32)
    ids = {n: id(p) for n, p in model.named_parameters()}
    [names] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(model)])
    assert {n: id(p) for n, p in model.named_parameters()} == ids
    assert all(p.dtype == torch.float32 and not p.is_meta for p in model.parameters())


# ---------------------------------------------------------------- 2. never alias the caller's tensors


def test_handed_case_trainer_step_does_not_reach_the_server():
    "A trainer syncs weights into a server module with load_weights, then steps: the server's weights stay."
    torch.manual_seed(0)
    trainer = nn.Linear(4, 4)
    with torch.device('meta'):
        server = nn.Linear(4, 4)
    load_weights(trainer.state_dict(), server)
    snap = {k: v.clone() for k, v in server.state_dict().items()}
    opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
    trainer(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert not torch.equal(trainer.weight, snap['weight'])
    assert_state_dict_equal(server, snap)


@pytest.mark.parametrize('device', ['meta', 'cpu'])
@pytest.mark.parametrize('contiguous', [True, False])
def test_no_storage_shared_with_state_dict(device, contiguous):
    w = torch.randn(3, 2).t() if not contiguous else torch.randn(2, 3)
    b = torch.randn(2)
    m = nn.Linear(3, 2, device=device)
    m.register_buffer('stat', torch.zeros(2, device=device))
    load_weights({'weight': w, 'bias': b, 'stat': b}, m)
    mine = {t.untyped_storage().data_ptr() for t in m.state_dict().values()}
    assert not mine & {w.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}


def test_convert_state_dict_and_conv_loads_do_not_alias():
    sd = {'a.weight': torch.randn(2, 2)}
    with torch.device('meta'):
        m = nn.Module()
        m.b = nn.Linear(2, 2, bias=False)
    load_from_source(
        __import__('mstar_utils.convert', fromlist=['x']).converted_source(
            DictSource(sd), [WeightConverter(['a.weight'], 'b.weight', [])]
        ),
        [m],
    )
    assert m.b.weight.untyped_storage().data_ptr() != sd['a.weight'].untyped_storage().data_ptr()


# ---------------------------------------------------------------- 3. ties are one tensor for the whole load


def tied_pair(device='meta'):
    emb = nn.Embedding(5, 3, device=device)
    head = nn.Linear(3, 5, bias=False, device=device)
    head.weight = emb.weight
    return emb, head


@pytest.mark.parametrize(
    'held', [['model.embed_tokens.weight'], ['lm_head.weight'], ['model.embed_tokens.weight', 'lm_head.weight']]
)
def test_tie_across_entries_is_one_slot(held):
    emb, head = tied_pair()
    w = torch.randn(5, 3)
    res = load_from_source(
        DictSource({k: w for k in held}), [ModuleAndPrefix(emb, 'model.embed_tokens'), ModuleAndPrefix(head, 'lm_head')]
    )
    assert head.weight is emb.weight and not emb.weight.is_meta and torch.equal(emb.weight, w)
    assert res == [{'weight'}, {'weight'}] and res.unexpected_keys == []
    check_loaded(emb, res[0], 'emb')
    check_loaded(head, res[1], 'head')


def test_tie_across_entries_with_disagreeing_shapes_is_refused():
    emb, head = tied_pair()
    sd = {'model.embed_tokens.weight': torch.randn(5, 3), 'lm_head.weight': torch.randn(5, 4)}
    with pytest.raises(ValueError, match=r"shape mismatch for 'lm_head.weight'"):
        load_from_source(DictSource(sd), [ModuleAndPrefix(emb, 'model.embed_tokens'), ModuleAndPrefix(head, 'lm_head')])


# ---------------------------------------------------------------- 4. unused keys and quantized keys


def test_unexpected_keys_are_reported():
    with torch.device('meta'):
        lin = nn.Linear(2, 2)
    sd = {
        'l.weight': torch.ones(2, 2),
        'l.bias': torch.ones(2),
        'other.weight': torch.ones(1),
        'l.extra': torch.ones(1),
    }
    res = load_from_source(DictSource(sd), [ModuleAndPrefix(lin, 'l')])
    assert res.unexpected_keys == ['l.extra', 'other.weight']
    assert load_weights(sd, nn.Linear(2, 2), 'l').unexpected_keys == ['l.extra', 'other.weight']


def test_handed_case_fp8_weight_with_scale_inv_is_refused(tmp_path):
    "F8_E4M3 weight + weight_scale_inv into a bf16 Linear: refused, naming the key, its dtype and the scale."
    w = (torch.randn(128, 128) * 100).to(torch.float8_e4m3fn)
    f = one_file(tmp_path, {'weight': w, 'weight_scale_inv': torch.full((1, 1), 1 / 6554.0)})
    lin = nn.Linear(128, 128, bias=False, device='meta', dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'weight' in .* is torch.float8_e4m3fn, a quantized or packed dtype"):
        load_weights_from_file(f, [lin])
    assert lin.weight.is_meta  # nothing half-loaded


@pytest.mark.parametrize(
    'key, qualifier',
    [
        ('l.weight', 'l.weight_scale_inv'),
        ('l.weight', 'l.weight_scale'),
        ('l.weight', 'l.weight_zero_point'),
        ('e.gate_up_proj_blocks', 'e.gate_up_proj_scales'),
        ('l.bias', 'l.bias_scale'),
    ],
)
def test_a_loaded_key_whose_qualifier_goes_unused_is_refused(key, qualifier):
    assert qualifier in qualifying_keys(key)
    m = nn.Module()
    m.register_parameter(key.split('.')[1], nn.Parameter(torch.zeros(2, 2)))
    sd = {key: torch.ones(2, 2), qualifier: torch.ones(1)}
    with pytest.raises(
        ValueError, match=rf"{key!r} .* is quantized: {qualifier!r} qualifies it, and no parameter takes {qualifier!r}"
    ):
        load_weights(sd, m, key.split('.')[0])
    assert torch.equal(getattr(m, key.split('.')[1]), torch.zeros(2, 2))


def test_a_module_that_keeps_the_scale_loads():
    "A quantized layer that declares its scale takes both keys, in their own dtypes."
    m = nn.Module()
    m.weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.float8_e4m3fn), requires_grad=False)
    m.weight_scale_inv = nn.Parameter(torch.zeros(1, 1), requires_grad=False)
    sd = {'weight': torch.ones(2, 2).to(torch.float8_e4m3fn), 'weight_scale_inv': torch.full((1, 1), 0.5)}
    assert load_weights(sd, m) == {'weight', 'weight_scale_inv'}
    assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.item() == 0.5


@pytest.mark.parametrize(
    'src_dtype,what',
    [
        (torch.int32, 'an integer dtype'),
        (torch.uint8, 'an integer dtype'),
        (torch.int8, 'an integer dtype'),
        (torch.int64, 'an integer dtype'),
        (torch.float8_e5m2, 'a quantized or packed dtype'),
    ],
)
def test_integer_or_float8_into_float_needs_a_recipe(src_dtype, what):
    with pytest.raises(ValueError, match=what):
        load_weights({'weight': torch.ones(2, 3).to(src_dtype)}, nn.Linear(3, 2, bias=False))


def test_integer_buffer_into_integer_buffer_is_fine():
    m = nn.Module()
    m.register_buffer('position_ids', torch.zeros(4, dtype=torch.int64))
    load_weights({'position_ids': torch.arange(4, dtype=torch.int32)}, m)
    assert m.position_ids.tolist() == [0, 1, 2, 3] and m.position_ids.dtype == torch.int64


# ---------------------------------------------------------------- 5. the folders people really have


def hub_cache(tmp_path, files: dict) -> Path:
    "A huggingface_hub cache repo: files in blobs/ by content name, snapshots/<rev>/ holding relative symlinks to them."
    repo = tmp_path / 'models--org--tiny'
    (repo / 'blobs').mkdir(parents=True)
    snap = repo / 'snapshots' / 'a1b2c3'
    snap.mkdir(parents=True)
    (repo / 'refs').mkdir()
    (repo / 'refs' / 'main').write_text('a1b2c3')
    for i, (name, data) in enumerate(files.items()):
        (repo / 'blobs' / f'blob{i}').write_bytes(data)
        (snap / name).symlink_to(Path('../../blobs') / f'blob{i}')
    return repo


def test_hub_cache_snapshot_of_smollm2_loads(smol_ckpt, tmp_path):
    files = {p.name: p.read_bytes() for p in smol_ckpt.iterdir() if p.is_file()}
    snap = hub_cache(tmp_path, files) / 'snapshots' / 'a1b2c3'
    assert all((snap / n).is_symlink() for n in files)
    model = load_model(snap)
    ref = load_model(smol_ckpt)
    assert_state_dict_equal(model, ref)


def test_hub_repo_root_points_to_its_snapshot(tmp_path):
    repo = hub_cache(tmp_path, {SINGLE_FILE: b''})
    with pytest.raises(
        FileNotFoundError,
        match=r'is a hub cache repo, not a checkpoint folder; give one of its snapshots, e.g. .*snapshots/a1b2c3',
    ):
        read_weight_map(repo)


def test_file_given_where_a_folder_is_expected(tmp_path):
    f = one_file(tmp_path, {'a': torch.zeros(1)}, SINGLE_FILE)
    with pytest.raises(FileNotFoundError, match='is a file; give the checkpoint folder that holds it'):
        load_model(f)
    (tmp_path / 'config.json').write_text('{}', encoding='utf-8')
    with pytest.raises(FileNotFoundError, match='is a file, not a checkpoint folder'):
        read_weight_map(tmp_path / 'config.json')


def test_pickle_only_folder_is_explained(tmp_path):
    (tmp_path / 'pytorch_model.bin').write_bytes(b'\x80\x02')
    with pytest.raises(
        FileNotFoundError,
        match=r'holds only a pickle checkpoint \(pytorch_model.bin\): it is not loaded, because unpickling runs code',
    ):
        load_weights_from_hf_shards(tmp_path, [nn.Linear(1, 1)])


def index_folder(tmp_path, shard_name):
    d = tmp_path / 'ck'
    d.mkdir()
    save_file({'weight': torch.ones(1, 1)}, str(d / 's.safetensors'))
    (d / INDEX_FILE).write_text(json.dumps({'weight_map': {'weight': shard_name}}))
    return d


@pytest.mark.parametrize(
    'name', ['/abs/s.safetensors', '../s.safetensors', 'sub/../s.safetensors', 'a\x00b', '', '..\\s.safetensors']
)
def test_index_names_with_traversal_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match='weight'):
        read_weight_map(index_folder(tmp_path, name))


def test_symlinks_inside_the_folder_are_followed_wherever_they_point(tmp_path):
    d = index_folder(tmp_path, 'linked.safetensors')
    outside = tmp_path / 'elsewhere'
    outside.mkdir()
    (d / 's.safetensors').rename(outside / 'real.safetensors')
    (d / 'linked.safetensors').symlink_to(outside / 'real.safetensors')
    lin = nn.Linear(1, 1, bias=False)
    load_weights_from_hf_shards(d, [lin])
    assert lin.weight.item() == 1.0


# ---------------------------------------------------------------- 6. errors that say the fix


def test_untied_lm_head_says_to_tie(smol_ckpt):
    model = build_on_meta(__import__('transformers').AutoConfig.from_pretrained(smol_ckpt))
    model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))  # re-registered: no longer tied
    with pytest.raises(
        KeyError,
        match=r"tie_word_embeddings, so 'lm_head.weight' should be the input embedding: call model.tie_weights\(\)",
    ):
        load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(model)])


def test_meta_non_persistent_buffer_says_how_to_build():
    with torch.device('meta'):
        m = nn.Module()
        m.register_buffer('inv_freq', torch.ones(2), persistent=False)
    with pytest.raises(
        RuntimeError,
        match=(
            r'build with buffers real \(accelerate.init_empty_weights\(include_buffers=False\)\) or use '
            r'mstar_utils.load_model'
        ),
    ):
        check_loaded(m, set(), 'rotary')


def test_base_model_checkpoint_into_causal_lm_names_the_submodule(smol_ckpt, tmp_path):
    ref = load_model(smol_ckpt)
    save_file({k: v.contiguous() for k, v in ref.model.state_dict().items()}, str(tmp_path / SINGLE_FILE))
    model = build_on_meta(ref.config)
    with pytest.raises(
        KeyError,
        match=(
            r"keys are its names without 'model.' \(saved from the base model\): "
            r"load ModuleAndPrefix\(module.model, ''\)"
        ),
    ):
        load_weights_from_hf_shards(tmp_path, [ModuleAndPrefix(model)])
    [names] = load_weights_from_hf_shards(tmp_path, [ModuleAndPrefix(model.model)])
    check_loaded(model.model, names, 'decoder')


# ---------------------------------------------------------------- 7. UTF-8 whatever the locale


def _text_io_calls(tree):
    "(line, call) for open()/read_text()/write_text() calls that may read or write text without an explicit encoding."
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        kw = {k.arg for k in node.keywords}
        if name in ('read_text', 'write_text') and 'encoding' not in kw:
            yield node.lineno, name
        if name == 'open' and isinstance(f, ast.Name) and 'encoding' not in kw:
            mode = (
                node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == 'mode'), None)
            )
            if not (isinstance(mode, ast.Constant) and 'b' in str(mode.value)):
                yield node.lineno, name


def test_every_text_file_is_read_and_written_as_utf8():
    pkg = Path(mstar_utils.__file__).parent
    bad = [
        f'{p.name}:{line} {call}'
        for p in sorted(pkg.glob('*.py'))
        for line, call in _text_io_calls(ast.parse(p.read_text(encoding='utf-8')))
    ]
    assert bad == [], bad


def test_inspect_under_the_c_locale_without_utf8_mode(smol_ckpt):
    env = {
        **os.environ,
        'LC_ALL': 'C',
        'LANG': 'C',
        'PYTHONUTF8': '0',
        'PYTHONIOENCODING': 'ascii:backslashreplace',
        'HF_HUB_OFFLINE': '1',
    }
    p = subprocess.run(
        [sys.executable, '-m', 'mstar_utils', 'inspect', str(smol_ckpt)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert 'LlamaForCausalLM' in p.stdout


# ---------------------------------------------------------------- property tests over random module trees


@st.composite
def trees(draw):
    "A random module tree of Linear/Embedding leaves in nested containers, some parameters shared between leaves."
    n = draw(st.integers(1, 6))
    shapes = [draw(st.tuples(st.integers(1, 4), st.integers(1, 4))) for _ in range(n)]
    leaves = [nn.Linear(s[1], s[0], bias=draw(st.booleans()), device='meta') for s in shapes]
    for i in range(1, n):  # tie to an earlier leaf of the same shape, sometimes
        j = draw(st.integers(0, i - 1))
        if shapes[j] == shapes[i] and draw(st.booleans()):
            leaves[i].weight = leaves[j].weight
    root, groups = nn.Module(), draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    for g in range(3):
        setattr(root, f'g{g}', nn.ModuleList())
    for leaf, g in zip(leaves, groups, strict=True):
        getattr(root, f'g{g}').append(leaf)
    return root


def _tie_groups(m):
    by = {}
    for n, p in m.named_parameters(remove_duplicate=False):
        by.setdefault(id(p), []).append(n)
    return sorted(sorted(v) for v in by.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.booleans(), st.booleans(), st.data())
def test_random_trees_ties_and_aliasing(root, materialize, split_entries, data):
    if materialize:
        root.to_empty(device='cpu')  # may untie: the ties to keep are those the module has when loaded
    ties, ids = _tie_groups(root), {n: id(p) for n, p in root.named_parameters(remove_duplicate=False)}
    sd = {n: torch.randn(p.shape) for n, p in root.named_parameters(remove_duplicate=False)}
    # the checkpoint holds one name of each tie group, or several
    keep = {k for g in _tie_groups(root) for k in ([g[0]] if data.draw(st.booleans()) else g)}
    sd = {k: (sd[_group_of(k, root)[0]]) for k in keep}
    entries = (
        [ModuleAndPrefix(getattr(root, f'g{g}'), f'g{g}') for g in range(3)]
        if split_entries
        else [ModuleAndPrefix(root)]
    )
    res = load_from_source(DictSource(sd), entries)
    assert _tie_groups(root) == ties
    assert {n: id(p) for n, p in root.named_parameters(remove_duplicate=False)} == ids
    theirs = {t.untyped_storage().data_ptr() for t in sd.values()}
    for n, p in root.named_parameters(remove_duplicate=False):
        assert not p.is_meta and p.untyped_storage().data_ptr() not in theirs
        assert torch.equal(p.detach(), sd[next(k for k in _group_of(n, root) if k in sd)])
    assert res.unexpected_keys == []


def _group_of(name, root):
    return next(g for g in _tie_groups(root) if name in g)
