"""Tensor-parallel loading: slices equal the whole tensors cut by the plan, only their bytes are read, and spawned 2-
and 4-rank groups give the unsharded model's logits."""

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, PhiConfig, PhiForCausalLM

from mstar_utils.convert import QWEN3_MOE_CONVERSIONS, MIXTRAL_CONVERSIONS, converted_source
from mstar_utils.loading import ModuleAndPrefix
from mstar_utils.model import build_on_meta, load_model
from mstar_utils.sources import DictSource, checkpoint_source
from mstar_utils.tensor_parallel import (
    WHOLE,
    Sharding,
    ShardedSource,
    Slice,
    PLANS,
    load_weights_sharded,
    plans_for,
    read_slice,
    shard_module,
    take,
    tp_plan,
)
from mstar_utils.testing import run_ranks, save_tiny, tp_jobs
from mstar_utils.upstream import config_ep_plan, config_tp_plan


def rchar() -> int:
    return int(re.search(r'rchar: (\d+)', Path('/proc/self/io').read_text())[1])


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """Tiny checkpoints: Qwen3-MoE and Mixtral (16 experts each, stored one by one), Qwen2 (q/k/v biases), Phi
    (biases on every Linear)."""
    root = tmp_path_factory.mktemp('tp')
    out = {name: save_tiny(name, root / name) for name in ('qwen3_moe', 'mixtral', 'qwen2')}
    torch.manual_seed(0)
    phi = PhiForCausalLM(
        PhiConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            pad_token_id=0,
        )
    )
    phi.save_pretrained(root / 'phi', max_shard_size='40KB')
    out['phi'] = root / 'phi'
    return out


@pytest.mark.parametrize('world_size', [2, 4])
def test_smollm2_slices_equal_cut_tensors_and_bytes_add_up(smol_ckpt, smol_config, world_size):
    plan, src = tp_plan(smol_config, world_size), checkpoint_source(smol_ckpt)
    keys = [k for k in src.keys() if k.startswith(('model.layers.0.', 'model.layers.29.', 'model.norm', 'model.embed'))]  # noqa: SIM118 (keys(), no __iter__)
    whole = {k: src.get(k) for k in keys}
    total = sum(t.numel() * t.element_size() for t in whole.values())
    replicated = sum(
        t.numel() * t.element_size()
        for k, t in whole.items()
        if Sharding(plan, 0, world_size).slice_for(k, t.shape) == WHOLE
    )
    read = []
    for rank in range(world_size):
        sharded, before = ShardedSource(checkpoint_source(smol_ckpt), Sharding(plan, rank, world_size)), rchar()
        for k in keys:
            part = sharded.get(k)
            assert tuple(part.shape) == sharded.shape(k) and torch.equal(part, take(whole[k], sharded.slice(k))), k
        after = rchar()
        sharded.close()
        assert abs((after - before) - sharded.bytes_read) < 256 * 1024, (
            after - before,
            sharded.bytes_read,
        )  # headers and /proc reads
        read.append(sharded.bytes_read)
    assert sum(read) == total + (world_size - 1) * replicated
    src.close()


def test_rowwise_slice_reads_row_by_row_not_the_whole_tensor(smol_ckpt):
    src, key = checkpoint_source(smol_ckpt), 'model.layers.3.mlp.down_proj.weight'
    src.info(key)
    before = rchar()
    part = src.get_slice(key, 1, [(384, 768)])
    got = rchar() - before
    assert part.shape == (576, 384) and got < 1.01 * part.numel() * 2 + 4096, got
    assert torch.equal(part, src.get(key)[:, 384:768])
    src.close()


@pytest.mark.parametrize('name,conv', [('qwen3_moe', QWEN3_MOE_CONVERSIONS), ('mixtral', MIXTRAL_CONVERSIONS)])
@pytest.mark.parametrize('world_size,ep', [(2, False), (4, False), (2, True), (4, True)])
def test_fused_targets_slice_through_the_converter(tiny, name, conv, world_size, ep):
    config = AutoConfig.from_pretrained(tiny[name])
    whole_src = converted_source(checkpoint_source(tiny[name]), conv)
    for rank in range(world_size):
        sh = Sharding(tp_plan(config, world_size, ep), rank, world_size)
        counted = []
        for k in whole_src.keys():  # noqa: SIM118 (keys(), no __iter__)
            sl = sh.slice_for(k, whole_src.shape(k))
            part = read_slice(whole_src, k, sl, count=counted.append)
            assert torch.equal(part, take(whole_src.get(k), sl)), (k, sl)
            assert sum(counted) == part.numel() * part.element_size()
            counted.clear()  # the slice's bytes, nothing more
    whole_src.close()


def test_non_divisible_dimension_names_key_dim_and_world_size(smol_ckpt, smol_config):
    with pytest.raises(
        ValueError,
        match=(
            r"model\.layers\.0\.mlp\.gate_proj\.weight: dim 0 of shape \[1536, 576\] has size 1536, "
            r"which does not divide by world_size 7"
        ),
    ):
        ShardedSource(checkpoint_source(smol_ckpt), Sharding(tp_plan(smol_config, 7), 0, 7)).shape(
            'model.layers.0.mlp.gate_proj.weight'
        )
    with pytest.raises(ValueError, match='does not divide by 2 packed parts x world_size 4'):
        Sharding({'experts.gate_up_proj': 'packed_colwise'}, 0, 4).slice_for('m.experts.gate_up_proj', (16, 12, 32))


def test_tied_tensor_cut_two_ways_is_refused(smol_config):
    model = build_on_meta(smol_config)
    with pytest.raises(ValueError, match='one tied tensor'):
        shard_module(model, Sharding({'lm_head': 'colwise'}, 0, 2))


def test_module_not_cut_is_refused_before_reading(smol_ckpt, smol_config):
    with pytest.raises(ValueError, match='call shard_module'):
        load_weights_sharded(
            smol_ckpt, [ModuleAndPrefix(build_on_meta(smol_config))], Sharding(tp_plan(smol_config, 2), 0, 2)
        )


def test_rules_decide_before_the_plan_and_dict_sources_are_sliced():

    def rule(sh, key, shape):
        return Slice(0, ((0, 1),)) if key == 'w.scale' else None

    sh = Sharding({'w': 'rowwise'}, 1, 2, rules=[rule])
    sd = {'w.weight': torch.arange(12.0).reshape(3, 4), 'w.scale': torch.arange(3.0), 'w.bias': torch.ones(3)}
    src = ShardedSource(DictSource(sd), sh)
    assert torch.equal(src.get('w.weight'), sd['w.weight'][:, 2:]) and torch.equal(
        src.get('w.scale'), sd['w.scale'][:1]
    )
    assert src.get('w.bias') is sd['w.bias'] and src.borrowed('w.bias') and not src.borrowed('w.weight')


def test_cut_keeps_parameter_objects_class_and_linear_sizes(smol_config):
    model = build_on_meta(smol_config)
    cut = shard_module(model, Sharding(tp_plan(smol_config, 2), 1, 2))
    down = model.model.layers[4].mlp.down_proj
    assert cut['model.layers.4.mlp.down_proj.weight'] == Slice(1, ((768, 1536),))
    assert down.weight.is_meta and tuple(down.weight.shape) == (576, 768) and down.in_features == 768
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _check_ranks(results, refs):
    for job, ref in enumerate(refs):
        for rank, res in enumerate(results):
            diff = (res[job]['logits'] - ref).abs().max().item()
            assert diff <= 1e-5, (job, rank, diff)


def test_two_ranks_match_the_unsharded_models(tiny):
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    jobs = [
        (tiny['qwen3_moe'], ids, None, False),
        (tiny['qwen3_moe'], ids, None, True),
        (tiny['phi'], ids, None, False),
    ]
    results = run_ranks(tp_jobs, 2, jobs)
    with torch.no_grad():
        refs = [load_model(folder, dtype=torch.float32)(ids).logits for folder, *_ in jobs]
    _check_ranks(results, refs)
    gu = 'model.layers.0.mlp.experts.gate_up_proj'
    assert [r[0]['shapes'][gu] for r in results] == [[16, 16, 32]] * 2 and [r[1]['shapes'][gu] for r in results] == [
        [8, 32, 32]
    ] * 2
    assert results[0][2]['shapes']['model.layers.0.mlp.fc2.weight'] == [
        32,
        32,
    ]  # Phi's rowwise fc2 (with bias) is split


def test_ranks_read_renamed_and_transformers_fused_checkpoints(tmp_path):
    """GPT-NeoX (its head stored as embed_out) and OLMoE (experts stored one by one, fused by transformers' rules):
    two ranks load what load_model loads."""
    folders = [save_tiny(name, tmp_path / name) for name in ('gpt_neox', 'olmoe')]
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    jobs = [(f, ids, None, False) for f in folders]
    results = run_ranks(tp_jobs, 2, jobs)
    with torch.no_grad():
        refs = [load_model(f, dtype=torch.float32)(ids).logits for f in folders]
    _check_ranks(results, refs)


def test_four_ranks_match_the_unsharded_models(tiny):
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    config = AutoConfig.from_pretrained(tiny['qwen2'])
    vocab_split = {**tp_plan(config, 4), 'embed_tokens': 'embedding_rowwise', 'lm_head': 'colwise_gather_output'}
    jobs = [(tiny['qwen2'], ids, vocab_split, False), (tiny['qwen3_moe'], ids, None, False)]
    results = run_ranks(tp_jobs, 4, jobs)
    with torch.no_grad():
        refs = [load_model(folder, dtype=torch.float32)(ids).logits for folder, *_ in jobs]
    _check_ranks(results, refs)
    assert [r[0]['shapes']['model.embed_tokens.weight'] for r in results] == [[24, 32]] * 4
    assert [r[0]['shapes']['model.layers.0.self_attn.k_proj.bias'] for r in results] == [
        [4]
    ] * 4  # 2 kv heads over 4 ranks: gathered


def test_sharded_load_unties_a_tie_stored_twice_with_different_values_and_takes_the_checkpoint_dtype(tmp_path):
    """load_model_sharded is load_model at a rank: a checkpoint that stores both tied names with different values
    loads them untied, as from_pretrained does; a config without dtype builds in the checkpoint's."""
    import json
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from mstar_utils.model import load_model_sharded
    from mstar_utils.testing import save_tiny

    folder = save_tiny('qwen2', tmp_path / 'q', dtype=torch.bfloat16, max_shard_size='1GB')
    cfg = json.loads((folder / 'config.json').read_text())
    cfg.pop('dtype', None)
    cfg.pop('torch_dtype', None)
    (folder / 'config.json').write_text(json.dumps(cfg))
    assert load_model_sharded(folder, 0, 1).dtype == torch.bfloat16
    cfg['tie_word_embeddings'] = True
    (folder / 'config.json').write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(folder)
    for rank in range(2):
        m = load_model_sharded(folder, rank, 2)
        assert m.lm_head.weight is not m.model.embed_tokens.weight
        assert torch.equal(
            m.lm_head.weight,
            take(ref.lm_head.weight, m.tp_sharding.slice_for('lm_head.weight', ref.lm_head.weight.shape)),
        )
    sd = load_file(folder / 'model.safetensors')
    sd['lm_head.weight'] = sd['model.embed_tokens.weight'].clone()
    save_file(sd, folder / 'model.safetensors')
    m = load_model_sharded(folder, 0, 1)
    assert m.lm_head.weight is m.model.embed_tokens.weight


def test_vocab_parallel_embedding_with_a_pad_token(tmp_path):
    """An embedding built with padding_idx (config pad_token_id, as gpt-oss-20b's 199999 of 201088) split by
    vocabulary: each rank keeps its own row of the pad id, or none, and the logits match."""
    import json

    folder = save_tiny('qwen2', tmp_path / 'q')
    cfg = json.loads((folder / 'config.json').read_text())
    cfg['pad_token_id'] = 90
    (folder / 'config.json').write_text(json.dumps(cfg))
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    ids[0, -2:] = 90
    config = AutoConfig.from_pretrained(folder)
    vocab_split = {**tp_plan(config, 2), 'embed_tokens': 'embedding_rowwise', 'lm_head': 'colwise_gather_output'}
    results = run_ranks(tp_jobs, 2, [(folder, ids, vocab_split, False)])
    with torch.no_grad():
        ref = load_model(folder, dtype=torch.float32)
    assert ref.model.embed_tokens.padding_idx == 90
    with torch.no_grad():
        _check_ranks(results, [ref(ids).logits])
    sharding = Sharding(vocab_split, 1, 2)
    m = build_on_meta(config, dtype=torch.float32)
    shard_module(m, sharding)
    assert (m.model.embed_tokens.padding_idx, m.model.embed_tokens.num_embeddings) == (90 - 48, 48)
    m0 = build_on_meta(config, dtype=torch.float32)
    shard_module(m0, Sharding(vocab_split, 0, 2))
    assert m0.model.embed_tokens.padding_idx is None


MOE_TYPES = ('qwen3_moe', 'mixtral', 'olmoe', 'qwen2_moe', 'phimoe', 'deepseek_v2')


@pytest.mark.parametrize('name', MOE_TYPES)
def test_experts_split_under_tensor_parallelism_at_every_version(tmp_path, name):
    """transformers 5.25's plans name no experts: ours (or the config's, experts added) split each expert by rows, so
    the ranks together read the checkpoint once plus what the plan leaves whole, and no expert is a copy."""
    from mstar_utils.model import load_plan

    folder = save_tiny(name, tmp_path / name, max_shard_size='1GB')
    for ws in (2, 4):
        plans = [load_plan(folder, r, ws, detail=False, dtype=torch.float32) for r in range(ws)]
        copied = [n for p in plans for n, _ in p.replicated if '.experts.' in n or n.endswith('.experts')]
        assert copied == [], f'{name} at TP {ws}: experts held whole on every rank: {copied[:4]}'
        whole = plans[0].replicated_bytes
        read = sum(p.total_bytes for p in plans)
        assert read <= 1.01 * (plans[0].checkpoint_bytes + (ws - 1) * whole), (name, ws, read, whole)


@pytest.mark.parametrize('model_type', sorted(PLANS))
def test_our_plans_agree_with_transformers_where_both_name_a_module(model_type):
    "Where the installed transformers' config plan names a pattern ours names too, the styles are the same."
    cfg = AutoConfig.for_model(model_type)
    ours, our_ep = plans_for(cfg)
    theirs, their_ep = config_tp_plan(cfg), config_ep_plan(cfg)
    both = ours.keys() & theirs.keys()
    assert {k: ours[k] for k in both} == {k: theirs[k] for k in both}
    if our_ep and their_ep:
        both = our_ep.keys() & their_ep.keys()
        assert {k: our_ep[k] for k in both} == {k: their_ep[k] for k in both}
    if our_ep:  # a MoE type: its experts are split under tensor parallelism too
        assert any('.experts' in k for k in ours), model_type
