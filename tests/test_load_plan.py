"""One load pipeline: `load_plan` reads what `load_model` reads at every rank, `load_model_sharded` is `load_model` with
a rank, and every wrapper stack `load_model` builds reads in batches."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import mstar_utils.model as model_mod
from mstar_utils.convert import ConvertedSource
from mstar_utils.model import load_model, load_model_sharded, load_plan
from mstar_utils.sources import FileSource, Source, checkpoint_source, read_weight_map
from mstar_utils.tensor_parallel import ShardedSource, take
from mstar_utils.testing import (
    assert_state_dict_equal,
    assert_tensors_equal,
    save_tiny,
    tiny_model,
    write_fp8_checkpoint,
)


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """bf16 checkpoints: Qwen2 (plain), GPT-NeoX (renamed head), Mixtral and Qwen3-MoE (our recipes), OLMoE
    (transformers' rules)."""
    root = tmp_path_factory.mktemp('plan')
    return {
        n: save_tiny(n, root / n, dtype=torch.bfloat16) for n in ('qwen2', 'gpt_neox', 'mixtral', 'qwen3_moe', 'olmoe')
    }


@pytest.fixture(scope='module')
def fp8_moe(tmp_path_factory):
    "A tiny Qwen3-MoE in block-fp8 (16 x 16 blocks), as DeepSeek-V3's releases store it."
    return write_fp8_checkpoint(tiny_model('qwen3_moe'), tmp_path_factory.mktemp('fp8') / 'qwen3_moe', block=(16, 16))


def _recording(monkeypatch) -> list:
    "Make every checkpoint source load_model opens record its reads; returns the list the sources are appended to."
    made = []

    def source(ckpt, dry=False, **kw):
        s = checkpoint_source(ckpt, record=True, dry=dry, **kw)
        made.append(s)
        return s

    monkeypatch.setattr(model_mod, 'checkpoint_source', source)
    return made


def _ranges(reads) -> dict:
    "{file name: merged [start, stop] ranges} of (file, offset, bytes) reads."
    spans = {}
    for path, off, n in reads:
        spans.setdefault(Path(path).name, []).append((off, off + n))
    out = {}
    for name, rs in spans.items():
        rs.sort()
        acc = [list(rs[0])]
        for lo, hi in rs[1:]:
            if lo > acc[-1][1]:
                acc.append([lo, hi])
            else:
                acc[-1][1] = max(acc[-1][1], hi)
        out[name] = acc
    return out


@pytest.mark.parametrize(
    'name,ep', [('qwen2', False), ('gpt_neox', False), ('mixtral', False), ('qwen3_moe', True), ('olmoe', False)]
)
@pytest.mark.parametrize('world_size', [1, 2, 4])
def test_plan_bytes_and_ranges_are_what_the_load_reads(tiny, monkeypatch, name, ep, world_size):
    made = _recording(monkeypatch)
    for rank in range(world_size):
        kw = dict(expert_parallel=ep) if world_size > 1 else {}
        plan = load_plan(tiny[name], rank, world_size, **kw)
        model = load_model(tiny[name], rank=rank, world_size=world_size, **kw)
        assert isinstance(plan.total_bytes, int) and plan.total_bytes == model.bytes_read, (
            rank,
            plan.total_bytes,
            model.bytes_read,
        )
        assert {f.file: [list(r) for r in f.ranges] for f in plan.files} == _ranges(made[-1].reads)
        assert sum(f.bytes for f in plan.files) == plan.total_bytes == sum(t.bytes for t in plan.tensors)
        if world_size > 1:
            assert model.tp_bytes_read == plan.total_bytes


def test_plan_reads_each_rank_only_its_slices(tiny):
    "Summed over ranks, a bf16 checkpoint is read once, plus the replicated tensors once more per extra rank."
    ws, folder = 2, tiny['qwen3_moe']
    plans = [load_plan(folder, r, ws, expert_parallel=True) for r in range(ws)]
    replicated = sum(t.bytes for t in plans[0].tensors if t.slice is None)
    assert sum(p.total_bytes for p in plans) == plans[0].checkpoint_bytes + (ws - 1) * replicated
    whole = {k: v for f in sorted(set(read_weight_map(folder).values())) for k, v in load_file(f).items()}
    assert plans[0].checkpoint_bytes == sum(t.numel() * t.element_size() for t in whole.values())


def test_plan_names_keys_and_transforms(tiny, fp8_moe):
    fused = next(
        t for t in load_plan(tiny['mixtral'], 1, 2).tensors if t.name == 'model.layers.0.mlp.experts.gate_up_proj'
    )
    experts = tiny_model('mixtral').config.num_local_experts
    assert len(fused.keys) == 2 * experts and fused.keys[0] == 'model.layers.0.block_sparse_moe.experts.0.w1.weight'
    assert fused.steps[0].startswith('fuse MergeModulelist') and fused.steps[-1].startswith('slice dim 1')
    head = next(t for t in load_plan(tiny['gpt_neox']).tensors if t.name == 'lm_head.weight')
    assert (
        head.keys == ['embed_out.weight']
        and head.steps == ['rename embed_out.weight -> lm_head.weight']
        and head.slice is None
    )
    q = next(t for t in load_plan(fp8_moe).tensors if t.name == 'model.layers.0.self_attn.q_proj.weight')
    assert q.keys == [q.name, q.name + '_scale_inv'] and q.steps[0].startswith('dequantize FP8BlockDequantize')
    plan = load_plan(fp8_moe, 1, 2, expert_parallel=True)
    d = json.loads(plan.to_json())
    assert d['total_bytes'] == plan.total_bytes and len(d['tensors']) == len(plan.tensors) and d['rank'] == 1
    assert 'rank 1 of 2' in repr(plan) and f'{len(plan.tensors)} tensors' in repr(plan)


def test_fp8_moe_at_two_ranks_with_experts_split_loads_as_one_device(fp8_moe):
    whole = load_model(fp8_moe, dtype=torch.float32).state_dict()
    for rank in range(2):
        plan = load_plan(fp8_moe, rank, 2, expert_parallel=True, dtype=torch.float32)
        model = load_model(fp8_moe, rank=rank, world_size=2, expert_parallel=True, dtype=torch.float32)
        assert plan.total_bytes == model.tp_bytes_read
        for k, v in model.state_dict().items():
            sl = model.tp_sharding.slice_for(k, whole[k].shape)
            assert_tensors_equal(v, take(whole[k], sl), k)


def test_load_model_sharded_is_load_model_at_a_rank(tiny):
    a = load_model_sharded(tiny['qwen3_moe'], 1, 2, expert_parallel=True)
    b = load_model(tiny['qwen3_moe'], rank=1, world_size=2, expert_parallel=True)
    assert_state_dict_equal(a, b)
    with pytest.raises(ValueError, match='pass both'):
        load_model(tiny['qwen2'], rank=1)


def test_every_rank_keeps_a_head_stored_beside_a_tie_and_reports_unused_keys(tiny, tmp_path):
    """A fine-tune that stores its own head under tie_word_embeddings loads at every rank as on one device; strict
    holds at every rank."""
    folder = tmp_path / 'tied'
    folder.mkdir()
    for f in tiny['qwen2'].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / 'config.json').read_text())
    cfg['tie_word_embeddings'] = True
    (folder / 'config.json').write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)
    for rank in range(2):
        m = load_model(folder, rank=rank, world_size=2)
        sl = m.tp_sharding.slice_for('lm_head.weight', ref.lm_head.weight.shape)
        assert torch.equal(m.lm_head.weight, take(ref.lm_head.weight, sl))
    shard = sorted(set(read_weight_map(folder).values()))[-1]
    extra = load_file(shard)
    extra['model.extra_scale'] = torch.ones(2)
    save_file(extra, str(shard), metadata={'format': 'pt'})
    index = json.loads((folder / 'model.safetensors.index.json').read_text())
    index['weight_map']['model.extra_scale'] = shard.name
    (folder / 'model.safetensors.index.json').write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.extra_scale"):
        load_model(folder, rank=1, world_size=2, strict=True)


def test_quantized_keep_under_tensor_parallelism_plans_its_reads(fp8_moe):
    """Codes and scales kept at each rank: the plan's bytes are the bytes the kept load reads; other ranks' experts
    are not unused keys."""
    for rank in range(2):
        m = load_model(fp8_moe, rank=rank, world_size=2, expert_parallel=True, quantized='keep', strict=True)
        assert load_plan(fp8_moe, rank, 2, expert_parallel=True, quantized='keep').total_bytes == m.tp_bytes_read > 0


@pytest.mark.parametrize(
    'name,world_size,quant',
    [
        ('qwen2', 1, False),
        ('gpt_neox', 1, False),
        ('mixtral', 1, False),
        ('olmoe', 1, False),
        ('mixtral', 2, False),
        ('olmoe', 2, False),
        ('qwen3_moe', 1, True),
        ('qwen3_moe', 2, True),
    ],
)
def test_every_wrapper_stack_reads_in_batches(tiny, fp8_moe, monkeypatch, name, world_size, quant):
    """No stack load_model builds falls back to one `get` a tensor: the checkpoint is read by FileSource.read_many
    (and slices)."""
    calls = {'get': 0, 'read_many': 0, 'fallback': 0, 'converted': 0, 'sharded': 0}

    def counting(cls, meth, key, reads=lambda self, *a: True):
        orig = getattr(cls, meth)

        def wrapped(self, *a, **kw):
            calls[key] += reads(self, *a)
            return orig(self, *a, **kw)

        monkeypatch.setattr(cls, meth, wrapped)

    counting(
        FileSource, 'get', 'get', lambda self, k, *a: not self.maps(k)
    )  # a view of a read-ahead buffer reads nothing
    counting(FileSource, 'read_many', 'read_many')
    counting(Source, 'read_many', 'fallback')
    counting(ConvertedSource, 'read_many', 'converted')
    counting(ShardedSource, 'read_many', 'sharded')
    folder = fp8_moe if quant else tiny[name]
    kw = dict(rank=0, world_size=world_size, expert_parallel=name == 'qwen3_moe') if world_size > 1 else {}
    load_model(folder, **kw)
    assert calls['fallback'] == 0 and (calls['read_many'] >= 1 or world_size == 1 and name in ('qwen2', 'gpt_neox')), (
        calls
    )
    if world_size == 1:
        assert calls['get'] == 0, calls
    else:
        assert calls['sharded'] == 1, calls
    if name != 'qwen2' and name != 'gpt_neox':
        assert calls['converted'] >= 1, calls
