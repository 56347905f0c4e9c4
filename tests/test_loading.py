"Loader behaviour on real checkpoints (SmolLM2, all-MiniLM-L6-v2): one test per promise of the loading notebook."

import json
import os
from pathlib import Path

import pytest
import torch
from mstar_utils.model import build_on_meta
from mstar_utils.testing import assert_state_dict_equal
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from mstar_utils import (
    ModuleAndPrefix,
    check_loaded,
    load_weights,
    load_weights_from_file,
    load_weights_from_hf_shards,
    process_weights_after_loading,
    smollm2_checkpoint,
    minilm_checkpoint,
)


def meta_smol(dtype=torch.bfloat16):
    return build_on_meta(AutoConfig.from_pretrained(smollm2_checkpoint()), dtype=dtype)


@pytest.fixture(scope='module')
def ref(smol_ckpt):
    return AutoModelForCausalLM.from_pretrained(smol_ckpt, dtype=torch.bfloat16)


def test_meta_module_is_filled_and_equals_from_pretrained(smol_ckpt, ref):
    m = meta_smol()
    [loaded] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m)])
    check_loaded(m, loaded, 'smol')
    assert not any(p.is_meta for p in m.parameters())
    assert_state_dict_equal(m, ref)


def test_declared_dtype_is_kept(smol_ckpt):
    m = meta_smol(torch.float32)
    [loaded] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m.model.norm, 'model.norm.')])
    assert loaded == {'weight'} and m.model.norm.weight.dtype == torch.float32


def test_materialized_module_is_copied_into(smol_ckpt, smol_config, ref):
    m = AutoModelForCausalLM.from_config(smol_config, dtype=torch.bfloat16)
    w = m.model.layers[0].mlp.up_proj.weight
    ptr = w.data_ptr()
    load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m.model.layers[0], 'model.layers.0.')])
    assert m.model.layers[0].mlp.up_proj.weight is w and w.data_ptr() == ptr
    assert torch.equal(w, ref.model.layers[0].mlp.up_proj.weight)


def test_materialized_fp32_module_gets_cast_copy(smol_ckpt, smol_config, ref):
    m = AutoModelForCausalLM.from_config(smol_config, dtype=torch.float32)
    load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m.model.layers[1], 'model.layers.1.')])
    assert m.model.layers[1].self_attn.q_proj.weight.dtype == torch.float32
    assert torch.equal(m.model.layers[1].self_attn.q_proj.weight, ref.model.layers[1].self_attn.q_proj.weight.float())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs two CUDA devices')
def test_any_device_string(smol_ckpt):
    m = meta_smol()
    load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m.model.norm, 'model.norm.')], device='cuda:1')
    assert m.model.norm.weight.device == torch.device('cuda:1')


def test_meta_device_target_is_refused_by_check_loaded(smol_ckpt):
    # loading "onto" meta would be a silent no-op copy; the result must not pass check_loaded
    m = meta_smol()
    [loaded] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m.model.norm, 'model.norm.')], device='meta')
    with pytest.raises(RuntimeError, match='still on meta'):
        check_loaded(m.model.norm, loaded, 'norm')


def test_ties_survive_and_one_name_fills_all(smol_ckpt):
    idx = json.loads((smol_ckpt / 'model.safetensors.index.json').read_text())
    assert 'lm_head.weight' not in idx['weight_map']  # the checkpoint stores only the embedding
    m = meta_smol()
    [loaded] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m)])
    assert 'lm_head.weight' in loaded
    assert m.lm_head.weight is m.model.embed_tokens.weight


def test_tied_materialized_module_stays_tied(smol_ckpt, smol_config):
    m = AutoModelForCausalLM.from_config(smol_config, dtype=torch.bfloat16)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m)])
    assert m.lm_head.weight is m.model.embed_tokens.weight


def test_loaded_names_per_module_in_order(smol_ckpt):
    m = meta_smol()
    mods = [
        ModuleAndPrefix(m.model.layers[3], 'model.layers.3.'),
        ModuleAndPrefix(m.model.embed_tokens, 'model.embed_tokens.'),
        ModuleAndPrefix(m.model.norm, 'model.norm'),
    ]
    got = load_weights_from_hf_shards(smol_ckpt, mods)
    assert [len(g) for g in got] == [9, 1, 1]
    assert got[1] == {'weight'} and 'mlp.down_proj.weight' in got[0]
    for mp, g in zip(mods, got, strict=True):
        check_loaded(mp.module, g, 'part')


def test_check_loaded_message_names_what_count_and_missing(smol_ckpt):
    m = meta_smol()
    [loaded] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m.model.layers[0], 'model.layers.0.')])
    with pytest.raises(RuntimeError, match=r"layer0: 1 of 9 .*mlp\.up_proj\.weight"):
        check_loaded(m.model.layers[0], loaded - {'mlp.up_proj.weight'}, 'layer0')


def test_check_loaded_refuses_meta_buffer(smol_ckpt, smol_config):
    with torch.device('meta'):
        m = AutoModelForCausalLM.from_config(smol_config, dtype=torch.bfloat16)  # inv_freq on meta too
    [loaded] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m)])
    with pytest.raises(RuntimeError, match=r'still on meta: .*inv_freq'):
        check_loaded(m, loaded, 'smol')


def test_missing_keys_raise_with_prefix(smol_ckpt):
    m = meta_smol()
    with pytest.raises(KeyError, match=r"missing key.*prefix 'model\.layers\.3\.'.*model\.layers\.3\.extra"):

        class Extra(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.input_layernorm = m.model.layers[3].input_layernorm
                self.extra = torch.nn.Parameter(torch.zeros(2))

        load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(Extra(), 'model.layers.3.')])


def test_missing_keys_tolerated_when_not_enforced(smol_ckpt):
    e = torch.nn.Module()
    e.input_layernorm = torch.nn.RMSNorm(576)
    e.extra = torch.nn.Parameter(torch.zeros(2))
    [loaded] = load_weights_from_hf_shards(
        smol_ckpt, [ModuleAndPrefix(e, 'model.layers.3.', enforce_missing_keys=False)]
    )
    assert loaded == {'input_layernorm.weight'}
    with pytest.raises(RuntimeError, match='extra'):
        check_loaded(e, loaded, 'extra')


def test_shape_mismatch_names_key_and_shapes(smol_ckpt):
    lin = torch.nn.Linear(576, 100, bias=False)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*checkpoint has \[1536, 576\].*expects \[100, 576\]"
    ):
        load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(lin, 'model.layers.0.mlp.up_proj.')])


def test_single_file_path_minilm_embeddings_match():
    mini = minilm_checkpoint()
    bert = build_on_meta(AutoConfig.from_pretrained(mini))
    [loaded] = load_weights_from_hf_shards(mini, [ModuleAndPrefix(bert)])
    check_loaded(bert, loaded, 'minilm')
    ref = AutoModel.from_pretrained(mini)
    assert_state_dict_equal(bert, ref)


def test_load_weights_from_file_reads_one_shard(smol_ckpt):
    m = meta_smol()
    shard = (
        smol_ckpt
        / json.loads((smol_ckpt / 'model.safetensors.index.json').read_text())['weight_map']['model.norm.weight']
    )
    [loaded] = load_weights_from_file(str(shard), [ModuleAndPrefix(m.model.norm, 'model.norm.')])
    assert loaded == {'weight'}


def link_checkpoint(tmp_path) -> Path:
    d = tmp_path / 'ckpt'
    d.mkdir()
    for f in smollm2_checkpoint().iterdir():
        if f.name != '.complete':
            os.link(f, d / f.name)
    return d


def test_index_is_truth_stray_single_file_ignored(tmp_path):
    d = link_checkpoint(tmp_path)
    save_file({'model.norm.weight': torch.full((576,), 7.0, dtype=torch.bfloat16)}, d / 'model.safetensors')
    m = meta_smol()
    load_weights_from_hf_shards(d, [ModuleAndPrefix(m.model.norm, 'model.norm.')])
    assert not torch.equal(m.model.norm.weight, torch.full((576,), 7.0, dtype=torch.bfloat16))


def test_index_is_truth_tensor_in_other_shard_ignored(smol_ckpt, tmp_path):
    d = link_checkpoint(tmp_path)
    idx = json.loads((d / 'model.safetensors.index.json').read_text())
    owner = idx['weight_map']['model.norm.weight']
    other = next(s for s in sorted(set(idx['weight_map'].values())) if s != owner)
    # rewrite `other` with an extra, wrong copy of model.norm.weight
    from safetensors.torch import load_file

    sd = load_file(d / other)
    sd['model.norm.weight'] = torch.full((576,), 7.0, dtype=torch.bfloat16)
    (d / other).unlink()
    save_file(sd, d / other)
    m = meta_smol()
    load_weights_from_hf_shards(d, [ModuleAndPrefix(m.model.norm, 'model.norm.')])
    truth = load_file(smol_ckpt / owner)['model.norm.weight']
    assert torch.equal(m.model.norm.weight, truth)


def test_missing_shard_names_shard_and_key(tmp_path):
    d = link_checkpoint(tmp_path)
    (d / 'model-00002-of-00003.safetensors').unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00003\.safetensors.*should hold 'model\."):
        load_weights_from_hf_shards(d, [ModuleAndPrefix(meta_smol())])


@pytest.mark.parametrize('bad', ['/etc/passwd', '../outside.safetensors', 'sub/../../x.safetensors'])
def test_shard_outside_repo_refused(tmp_path, bad):
    d = link_checkpoint(tmp_path)
    idx = json.loads((d / 'model.safetensors.index.json').read_text())
    idx['weight_map']['model.norm.weight'] = bad
    (d / 'model.safetensors.index.json').unlink()
    (d / 'model.safetensors.index.json').write_text(json.dumps(idx))
    with pytest.raises(ValueError, match='outside the checkpoint folder'):
        load_weights_from_hf_shards(d, [ModuleAndPrefix(meta_smol())])


def test_progress_bar_off_when_not_interactive_or_turned_off(smol_ckpt, capsys):
    m = meta_smol()
    load_weights_from_hf_shards(
        smol_ckpt, [ModuleAndPrefix(m.model.norm, 'model.norm.')]
    )  # stderr is not a tty under pytest
    assert 'tensor' not in capsys.readouterr().err
    load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m.model.norm, 'model.norm.')], progress=False)
    assert capsys.readouterr().err == ''
    load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m.model.norm, 'model.norm.')], progress=True)
    err = capsys.readouterr().err
    assert 'B/s' in err and '/1 tensors' in err, err  # bytes with their rate, and the tensors


def test_process_weights_after_loading_each_module_once_root_included():
    calls = []

    class P(torch.nn.Module):
        def process_weights_after_loading(self, device):
            calls.append((id(self), device))

    shared = P()
    root = P()
    root.a = shared
    root.b = torch.nn.Sequential(shared, P())
    process_weights_after_loading(root, 'cpu')
    assert len(calls) == 3 and len({c[0] for c in calls}) == 3 and calls[0][0] == id(root)


def test_load_weights_from_state_dict_prefix_and_ties():
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    m = torch.nn.Module()
    m.emb, m.head = emb, head
    m.head.weight = m.emb.weight
    w = torch.randn(5, 3)
    loaded = load_weights({'x.head.weight': w}, m, prefix='x.')
    assert loaded == {'emb.weight', 'head.weight'} and m.head.weight is m.emb.weight and torch.equal(m.emb.weight, w)


def test_mmap_mode_equal_tied_and_copy_on_write(tmp_path, ref):
    d = link_checkpoint(tmp_path)
    before = {f.name: f.read_bytes() for f in d.glob('*.safetensors')}
    m = meta_smol()
    [loaded] = load_weights_from_hf_shards(d, [ModuleAndPrefix(m)], mmap=True)
    check_loaded(m, loaded, 'smol mmap')
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert_state_dict_equal(m, ref)
    with torch.no_grad():
        m.model.norm.weight.fill_(3)  # a private mapping: the shard on disk must not change
    assert {f.name: f.read_bytes() for f in d.glob('*.safetensors')} == before
    # a cast still copies: a float32 module gets its own memory
    m32 = meta_smol(torch.float32)
    load_weights_from_hf_shards(d, [ModuleAndPrefix(m32.model.norm, 'model.norm.')], mmap=True)
    assert m32.model.norm.weight.dtype == torch.float32 and torch.equal(
        m32.model.norm.weight, ref.model.norm.weight.float()
    )


def test_stale_index_key_unlisted_says_where_it_is(tmp_path):
    """A key the shards hold but the index does not list: the missing-key error says which shard holds it and that
    the index is stale."""
    d = link_checkpoint(tmp_path)
    idx = json.loads((d / 'model.safetensors.index.json').read_text())
    shard = idx['weight_map'].pop('model.norm.weight')
    (d / 'model.safetensors.index.json').unlink()
    (d / 'model.safetensors.index.json').write_text(json.dumps(idx))
    with pytest.raises(KeyError, match=rf"1 missing key.*model\.norm\.weight.*is in {shard}.*index is stale"):
        load_weights_from_hf_shards(d, [ModuleAndPrefix(meta_smol())])


def test_stale_index_key_in_another_shard_says_where_it_is(tmp_path):
    d = link_checkpoint(tmp_path)
    idx = json.loads((d / 'model.safetensors.index.json').read_text())
    owner = idx['weight_map']['model.norm.weight']
    other = next(s for s in sorted(set(idx['weight_map'].values())) if s != owner)
    idx['weight_map']['model.norm.weight'] = other
    (d / 'model.safetensors.index.json').unlink()
    (d / 'model.safetensors.index.json').write_text(json.dumps(idx))
    with pytest.raises(
        KeyError, match=rf"{other}: has no tensor 'model\.norm\.weight'.*it is in {owner}: the index is stale"
    ):
        load_weights_from_hf_shards(d, [ModuleAndPrefix(meta_smol())])


@pytest.mark.parametrize(
    'out,what',
    [
        (torch.empty(576), 'got torch.float32 \\[576\\]'),
        (torch.empty(2, 288, dtype=torch.bfloat16), 'got torch.bfloat16 \\[2, 288\\]'),
        (torch.empty(1152, dtype=torch.bfloat16)[::2], 'not contiguous'),
    ],
)
def test_file_source_get_checks_out(smol_ckpt, out, what):
    """`get(key, out=)` reads raw bytes into `out`: one of another dtype, shape or layout is refused, not filled with
    reinterpreted bytes."""
    from mstar_utils.sources import checkpoint_source

    src = checkpoint_source(smol_ckpt)
    try:
        with pytest.raises(
            ValueError, match=rf"'model\.norm\.weight' is torch\.bfloat16 \[576\]; out must be .*{what}"
        ):
            src.get('model.norm.weight', out=out)
        good = torch.empty(576, dtype=torch.bfloat16)
        assert src.get('model.norm.weight', out=good) is good
        from safetensors import safe_open

        with safe_open(str(src.where('model.norm.weight')), 'pt') as f:
            assert torch.equal(good, f.get_tensor('model.norm.weight'))
    finally:
        src.close()
