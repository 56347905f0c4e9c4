"""refit: a model loaded from checkpoint A and refit with weights B equals `load_model` of checkpoint B, tensor for
tensor, with its logits, and no tensor changes storage; public refit bugs as small tests. MSTAR_UTILS_SLOW=1 runs
the bigger matrix (SmolLM2, more architectures and ranks)."""

import contextlib
import io
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards
from mstar_utils.mla import MLAAttention
from mstar_utils.model import load_model
from mstar_utils.refit import differing, moved, refit, refit_plan, storage
from mstar_utils.testing import (
    MLA_CONFIG,
    checkpoint_tensors,
    dequantized_reference,
    save_mla_checkpoint,
    save_tiny,
    tiny_model,
    tp_inputs,
    tp_model,
    write_fp8_checkpoint,
    write_mxfp4_checkpoint,
)

SLOW = pytest.mark.skipif(not os.environ.get('MSTAR_UTILS_SLOW'), reason='bigger refit matrix: set MSTAR_UTILS_SLOW=1')


def tiny_llama(folder, seed: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


def save_tp_model(name: str, folder, seed: int, fmt: str = 'bf16'):
    "`tp_model(name)` saved by save_pretrained in bf16, or as gpt-oss releases are (MXFP4 experts)."
    model = tp_model(name, seed=seed)
    if fmt == 'mxfp4':
        return write_mxfp4_checkpoint(model, folder)
    with contextlib.redirect_stderr(io.StringIO()):
        model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
    """Checkpoint pairs (A, B) of tiny real architectures: two seeds, as two training steps; gpt-oss's MXFP4 pair
    also holds B dequantized by transformers' own gpt-oss dequantizer (what its trainer sends)."""
    root = tmp_path_factory.mktemp('refit')
    out = {'llama': (tiny_llama(root / 'llama_a', 0), tiny_llama(root / 'llama_b', 1))}
    for name in ('qwen2', 'qwen3_moe', 'olmoe'):
        out[name] = tuple(save_tiny(name, root / f'{name}_{s}', seed=s) for s in (0, 1))
    for name in ('gpt_oss', 'llava'):
        out[name] = tuple(save_tp_model(name, root / f'{name}_{s}', s) for s in (0, 1))
    a, b = (save_tp_model('gpt_oss', root / f'gpt_oss_mxfp4_{s}', s, 'mxfp4') for s in (0, 1))
    out['gpt_oss_mxfp4'] = (a, b, dequantized_reference(b, root / 'gpt_oss_mxfp4_1_bf16'))
    return out


def check_refit(a, b, sent=None, inputs=None, **kw):
    """Load A (at a rank), refit with the trainer's tensors (`sent`, default B's), compare with load_model(B): every
    tensor, storage, logits on `inputs` (default five token ids)."""
    served = load_model(a, **kw)
    before = storage(served)
    sent = checkpoint_tensors(b) if sent is None else sent
    plan = refit_plan(served, sent)
    items = list(sent.items())[::-1]  # any order, buckets of three
    refit(served, [items[i : i + 3] for i in range(0, len(items), 3)], plan)
    fresh = load_model(b, **kw)
    assert differing(served, fresh) == []
    assert moved(before, served) == []
    if kw.get('world_size', 1) == 1:
        x = {'input_ids': torch.tensor([[1, 2, 3, 4, 5]])} if inputs is None else inputs
        with torch.no_grad():
            assert torch.equal(served(**x).logits, fresh(**x).logits)
    return served, plan


def check_cell(ckpts, name: str, kw: dict):
    "`check_refit` of the pair `name`: gpt-oss's MXFP4 pair loaded dequantized and sent B's dequantized weights."
    if name == 'gpt_oss_mxfp4':
        a, b, ref = ckpts[name]
        return check_refit(a, b, checkpoint_tensors(ref), tp_inputs('gpt_oss'), quantized='dequantize', **kw)
    a, b = ckpts[name]
    return check_refit(a, b, inputs=tp_inputs(name) if name in ('gpt_oss', 'llava') else None, **kw)


@pytest.mark.parametrize(
    'name,kw',
    [
        ('llama', {}),
        ('llama', dict(rank=1, world_size=2)),
        ('qwen3_moe', {}),
        ('qwen3_moe', dict(rank=1, world_size=2, expert_parallel=True)),
        ('olmoe', {}),
        ('gpt_oss', {}),
        ('gpt_oss', dict(rank=1, world_size=2, expert_parallel=True)),
        ('gpt_oss_mxfp4', {}),
        ('gpt_oss_mxfp4', dict(rank=1, world_size=2, expert_parallel=True)),
        ('llava', {}),
        ('llava', dict(rank=1, world_size=2)),
    ],
)
def test_refit_equals_a_fresh_load(ckpts, name, kw):
    check_cell(ckpts, name, kw)


@SLOW
@pytest.mark.parametrize(
    'name,kw',
    [
        ('qwen2', {}),
        ('qwen2', dict(rank=0, world_size=2)),
        ('llama', dict(rank=0, world_size=2)),
        ('qwen3_moe', dict(rank=0, world_size=2)),
        ('qwen3_moe', dict(rank=3, world_size=4, expert_parallel=True)),
        ('olmoe', dict(rank=1, world_size=2)),
        ('olmoe', dict(rank=2, world_size=4, expert_parallel=True)),
        ('llama', dict(dtype=torch.float32)),
        ('gpt_oss', dict(rank=0, world_size=2, expert_parallel=True)),
        ('gpt_oss', dict(rank=3, world_size=4, expert_parallel=True)),
        ('gpt_oss', dict(rank=1, world_size=2)),  # experts cut by columns, not by expert
        ('gpt_oss_mxfp4', dict(rank=0, world_size=2, expert_parallel=True)),
        ('gpt_oss_mxfp4', dict(rank=2, world_size=4, expert_parallel=True)),
        ('llava', dict(rank=0, world_size=2)),
        ('llava', dict(rank=3, world_size=4)),
    ],
)
def test_refit_matrix(ckpts, name, kw):
    check_cell(ckpts, name, kw)


@SLOW
@pytest.mark.parametrize('kw', [{}, dict(rank=1, world_size=2)])
def test_smollm2_refit(smol_ckpt, tmp_path, kw):
    "SmolLM2, refit with its weights moved as by a training step, equals a fresh load of those weights."
    new = {k: (v.float() * 1.01 + 1e-3).to(v.dtype) for k, v in checkpoint_tensors(smol_ckpt).items()}
    b = tmp_path / 'b'
    b.mkdir()
    (b / 'config.json').write_text((smol_ckpt / 'config.json').read_text())
    save_file(new, str(b / 'model.safetensors'), metadata={'format': 'pt'})
    check_refit(smol_ckpt, b, **kw)


def test_verify_checks_against_a_fresh_load(ckpts):
    a, b = ckpts['qwen2']
    served = load_model(a)
    refit(served, checkpoint_tensors(b), verify=True)
    assert differing(served, load_model(b)) == []


def test_plan_dumps_json_and_names_steps(ckpts):
    a, b = ckpts['qwen3_moe']
    plan = refit_plan(load_model(a, rank=1, world_size=2, expert_parallel=True), checkpoint_tensors(b))
    d = json.loads(plan.to_json())
    gu = next(r for r in d['routes'] if r['target'] == 'model.layers.0.mlp.experts.gate_up_proj')
    assert gu['slice'] == {'dim': 0, 'ranges': [[8, 16]]} and any(s.startswith('fuse') for s in gu['steps'])
    assert len(gu['keys']) == 16  # rank 1's 8 experts, gate and up
    assert 'model.layers.0.mlp.experts.0.gate_proj.weight' in d['skipped']  # rank 0's expert
    assert 'RefitPlan(' in repr(plan)


def test_fused_parts_written_not_zero(ckpts):
    """prime-rl (https://github.com/PrimeIntellect-ai/prime-rl/issues/3451):
    fused tensors written as zeros. A copy by name leaves the fused experts stale; refit fills them."""
    a, b = ckpts['qwen3_moe']
    naive, new = load_model(a), checkpoint_tensors(b)
    sd = naive.state_dict()
    with torch.no_grad():
        for k, v in new.items():
            if k in sd:
                sd[k].copy_(v)
    fresh = load_model(b)
    assert 'model.layers.0.mlp.experts.gate_up_proj' in differing(naive, fresh)
    refit(naive, new)
    gu = naive.model.layers[0].mlp.experts.gate_up_proj
    assert differing(naive, fresh) == [] and gu.abs().amax(dim=(1, 2)).min() > 0


def test_stacked_experts_accepted(ckpts, tmp_path):
    """NeMo-RL (https://github.com/NVIDIA-NeMo/RL/issues/3403):
    a trainer that sends experts stacked 3-D, under the model's fused names, is taken, at every rank."""
    a, b = ckpts['olmoe']
    fused = load_model(b).state_dict()  # the stacked experts, as the model holds them
    sent = {k: v for k, v in fused.items() if k != 'lm_head.weight' or 'lm_head.weight' in checkpoint_tensors(b)}
    for kw in ({}, dict(rank=1, world_size=2)):
        served = load_model(a, **kw)
        refit(served, sent)
        assert differing(served, load_model(b, **kw)) == []


def test_unknown_name_is_an_error(ckpts):
    """verl-omni (https://github.com/verl-project/verl-omni/issues/636):
    a name the receiver cannot place is an error listing it, not a warning; nothing moves."""
    a, b = ckpts['llama']
    served, new = load_model(a), checkpoint_tensors(b)
    before = storage(served)
    with pytest.raises(KeyError, match='model.layers.7.mlp.up_proj.weight'):
        refit_plan(served, {**new, 'model.layers.7.mlp.up_proj.weight': new['model.norm.weight']})
    plan = refit_plan(served, new)
    with pytest.raises(KeyError, match='not in the refit plan'):
        refit(served, [('model.layers.7.mlp.up_proj.weight', new['model.norm.weight'])], plan)
    with pytest.raises(KeyError, match='got nothing'):
        refit(served, [('model.norm.weight', new['model.norm.weight'])], plan)
    assert moved(before, served) == []


def test_partial_update(ckpts):
    a, b = ckpts['qwen3_moe']
    served, new = load_model(a), checkpoint_tensors(b)
    experts = {k: v for k, v in new.items() if '.experts.' in k}
    refit(served, experts, partial=True)
    fresh, old = load_model(b), load_model(a)
    assert [n for n in differing(served, fresh) if '.experts.' in n] == []
    assert [n for n in differing(served, old) if '.experts.' not in n] == []
    with pytest.raises(ValueError, match='no key matches source pattern'):  # half a fused tensor: never partial
        refit(served, {k: v for k, v in experts.items() if 'gate_proj' in k}, partial=True)


def mla(q_lora_rank=24):
    c = MLA_CONFIG
    return MLAAttention(
        c['hidden_size'],
        c['num_attention_heads'],
        c['kv_lora_rank'],
        c['qk_nope_head_dim'],
        qk_rope_head_dim=c['qk_rope_head_dim'],
        v_head_dim=c['v_head_dim'],
        q_lora_rank=q_lora_rank,
    )


def test_mla_absorbed_weights_rebuilt_in_place(tmp_path):
    """sglang (https://github.com/sgl-project/sglang/issues/30749):
    w_kc/w_vc rebuilt from stale values. A naive copy leaves them stale; refit rebuilds them in place."""
    a = save_mla_checkpoint(tmp_path / 'a')
    prefix = 'model.layers.0.self_attn.'
    att = mla()
    load_weights_from_hf_shards(a, [ModuleAndPrefix(att, prefix)])
    att.process_weights_after_loading('cpu')
    sent = {k: v * 1.5 for k, v in checkpoint_tensors(a).items() if k.startswith(prefix)}
    ref = mla()
    ref.load_state_dict({k.removeprefix(prefix): v for k, v in sent.items()})
    ref.process_weights_after_loading('cpu')
    naive = mla()
    naive.load_state_dict(att.state_dict())
    naive.process_weights_after_loading('cpu')
    with torch.no_grad():
        naive.kv_b_proj.weight.copy_(sent[prefix + 'kv_b_proj.weight'])
    assert 'w_kc' in differing(naive, ref)  # what a copy without the rebuild serves
    before, w_kc = storage([ModuleAndPrefix(att, prefix)]), att.w_kc
    plan = refit([ModuleAndPrefix(att, prefix)], sent, verify=True)
    assert att.w_kc is w_kc and moved(before, [ModuleAndPrefix(att, prefix)]) == []
    assert differing(att, ref) == []
    assert any('process_weights_after_loading' in s for s in plan.lands_in(prefix + 'kv_b_proj.weight')[0].stale)


def fp8_reference(model, dest, block, per_channel=False):
    """`model` saved with its projections quantized by transformers' own fine-grained fp8 quantizer (`Fp8Quantize`):
    with `block`, or per channel (a block of one row, no `weight_block_size` in the config)."""
    from mstar_utils.upstream import fp8_quantize_op

    model.save_pretrained(dest)
    out = {}
    for k, v in checkpoint_tensors(dest).items():
        op = fp8_quantize_op(weight_block_size=[1, v.shape[-1]] if per_channel else list(block))
        out.update(op.convert({k: v}) if '_proj.weight' in k else {k: v})
    cfg = json.loads((dest / 'config.json').read_text())
    cfg['quantization_config'] = {'quant_method': 'fp8', **({} if per_channel else {'weight_block_size': list(block)})}
    (dest / 'config.json').write_text(json.dumps(cfg))
    (dest / 'model.safetensors').unlink()
    save_file(out, str(dest / 'model.safetensors'), metadata={'format': 'pt'})
    return dest


def check_kept_refit(a, b, trainer: dict, **kw):
    "Load A keeping its codes, refit with the trainer's tensors: equal to load_model(B) keeping its codes, none moved."
    served = load_model(a, quantized='keep', **kw)
    before = storage(served)
    plan = refit(served, trainer)
    fresh = load_model(b, quantized='keep', **kw)
    assert differing(served, fresh) == [] and moved(before, served) == []
    return served, plan


@pytest.mark.parametrize('kw', [{}, pytest.param(dict(rank=1, world_size=2), marks=SLOW)])
def test_kept_fp8_requantized_as_transformers_does(tmp_path, kw):
    "Kept fp8 block codes: the refit equals load_model(keep) of B quantized by transformers' own quantizer."
    a = write_fp8_checkpoint(tiny_model('qwen2', seed=0), tmp_path / 'a', block=(16, 16))
    trainer = tiny_model('qwen2', dtype=torch.bfloat16, seed=1)
    b = fp8_reference(trainer, tmp_path / 'b', (16, 16))
    served, _ = check_kept_refit(a, b, trainer.state_dict(), **kw)
    assert served.model.layers[0].mlp.up_proj.weight.dtype == torch.float8_e4m3fn


def test_kept_per_channel_fp8(tmp_path):
    "Per-channel fp8 (one scale a row): re-quantized by transformers' Fp8Quantize with a block of one row."
    a = fp8_reference(tiny_model('qwen2', dtype=torch.bfloat16, seed=0), tmp_path / 'a', None, per_channel=True)
    trainer = tiny_model('qwen2', dtype=torch.bfloat16, seed=1)
    b = fp8_reference(trainer, tmp_path / 'b', None, per_channel=True)
    served, plan = check_kept_refit(a, b, trainer.state_dict())
    scale = served.model.layers[0].mlp.up_proj.weight_scale_inv
    assert scale.shape == (served.config.intermediate_size, 1)
    assert any('Fp8Quantize' in s for s in plan.lands_in('model.layers.0.mlp.up_proj.weight')[0].steps)


CT_PRESETS = {'nvfp4': 'NVFP4A16', 'mxfp8': 'MXFP8A16', 'w4a16': 'W4A16', 'fp8_dynamic': 'FP8_DYNAMIC'}


def ct_checkpoint(fmt: str, dest, seed: int) -> tuple:
    "(folder, weights): a tiny Qwen3 quantized and saved by compressed-tensors, and its bf16 weights before that."
    from transformers import AutoModelForCausalLM

    from mstar_utils.testing import (
        CT_FLOAT_GROUPS,
        CT_PACK_GROUPS,
        formats_config,
        quantized_configs,
        write_compressed_tensors_checkpoint,
        write_ct_preset_checkpoint,
    )

    cfg = formats_config() if fmt in CT_PRESETS else quantized_configs()[fmt]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if fmt in CT_PRESETS:
        return write_ct_preset_checkpoint(model, dest, CT_PRESETS[fmt]), sd
    groups = {'ct_float': CT_FLOAT_GROUPS, 'ct_pack': CT_PACK_GROUPS}[fmt]
    return write_compressed_tensors_checkpoint(model, dest, groups), sd


@pytest.mark.parametrize(
    'fmt,kw',
    [
        ('ct_float', {}),  # fp8 per channel, per tensor, per 64 x 64 block
        ('ct_pack', {}),  # int4 per channel, asymmetric int4 per group of 32 (packed zero points), int8 per channel
        ('nvfp4', {}),
        ('mxfp8', {}),
        pytest.param('w4a16', {}, marks=SLOW),
        pytest.param('fp8_dynamic', {}, marks=SLOW),
        pytest.param('ct_pack', dict(rank=1, world_size=2), marks=SLOW),
        pytest.param('ct_float', dict(rank=0, world_size=2), marks=SLOW),
        pytest.param('nvfp4', dict(rank=1, world_size=2), marks=SLOW),
        pytest.param('mxfp8', dict(rank=1, world_size=2), marks=SLOW),
    ],
)
def test_kept_compressed_tensors_requantized_as_it_does(tmp_path, fmt, kw):
    """Kept compressed-tensors codes: the refit equals load_model(keep) of B quantized and saved by compressed-tensors,
    every code, scale, zero point and global scale."""
    a, _ = ct_checkpoint(fmt, tmp_path / 'a', 0)
    b, trainer = ct_checkpoint(fmt, tmp_path / 'b', 1)
    served, plan = check_kept_refit(a, b, trainer, **kw)
    (route,) = [r for r in plan.lands_in('model.layers.0.mlp.up_proj.weight') if r.target.endswith('.weight_scale')]
    assert any("compressed-tensors' compressor" in s for s in route.steps)


def test_no_layer_left_in_the_checkpoints_mxfp8(tmp_path):
    """vLLM (https://github.com/vllm-project/vllm/issues/55684):
    after a weight update one branch left a layer in the checkpoint's MXFP8 format. A copy by name of the trainer's
    tensors into a model keeping MXFP8 codes casts them into the codes and leaves every layer's E8M0 scales as
    checkpoint A stored them; refit re-quantizes every kept layer as compressed-tensors' MXFP8 compressor does."""
    a, _ = ct_checkpoint('mxfp8', tmp_path / 'a', 0)
    b, trainer = ct_checkpoint('mxfp8', tmp_path / 'b', 1)
    fresh = load_model(b, quantized='keep')
    scales = sorted(n for n, _ in fresh.named_parameters() if n.endswith('.weight_scale'))
    assert scales and all(fresh.get_parameter(n).dtype == torch.uint8 for n in scales)  # E8M0 exponents
    naive = load_model(a, quantized='keep')
    sd = naive.state_dict()
    with torch.no_grad():
        for k, v in trainer.items():
            if k in sd and sd[k].shape == v.shape:
                sd[k].copy_(v)  # a bf16 weight cast into fp8 codes, its scale untouched
    stale = differing(naive, fresh)
    assert set(scales) <= set(stale)  # every MXFP8 layer still holds checkpoint A's scales
    served = load_model(a, quantized='keep')
    before = storage(served)
    plan = refit(served, trainer)
    assert differing(served, fresh) == [] and moved(before, served) == []
    requantized = sorted(r.target for r in plan.routes if any('mxfp8-quantized' in s for s in r.steps))
    assert [n for n in requantized if n.endswith('.weight_scale')] == scales  # no layer skipped


@pytest.mark.parametrize('kw', [{}, dict(rank=1, world_size=2, expert_parallel=True)])
def test_kept_mxfp4_is_refused(ckpts, kw):
    """gpt-oss keeping its MXFP4 experts: refit has no MXFP4 quantizer, so it refuses before writing anything, naming
    the format, the first expert tensor it cannot re-quantize and the fix; dequantized, the same tensors refit."""
    a, _, ref = ckpts['gpt_oss_mxfp4']
    served, sent = load_model(a, quantized='keep', **kw), checkpoint_tensors(ref)
    before = storage(served)
    key = re.escape("'model.layers.0.mlp.experts.down_proj'")
    with pytest.raises(ValueError, match=f"keeps mxfp4 codes.*incoming {key}.*quantized='dequantize' to refit it"):
        refit(served, sent)
    assert moved(before, served) == []


def test_plan_needed_to_stream(ckpts):
    a, b = ckpts['llama']
    with pytest.raises(TypeError, match='pass plan=refit_plan'):
        refit(load_model(a), iter(checkpoint_tensors(b).items()))


def test_gguf(tmp_path):
    "A GGUF model refits in dequantized form; keeping GGUF blocks is refused, naming the format and a key."
    from mstar_utils.testing import write_gguf_checkpoint

    qt = {'attn': 'Q8_0', 'ffn': 'Q4_K', 'output': 'Q4_K', 'token_embd': 'Q8_0'}
    fa, fb = (write_gguf_checkpoint(tmp_path / f'{s}.gguf', qt, seed=s) for s in (0, 1))
    served, fresh = load_model(fa), load_model(fb)
    before = storage(served)
    refit(served, {k: v.clone() for k, v in fresh.state_dict().items()})
    assert differing(served, fresh) == [] and moved(before, served) == []
    kept = load_model(fa, quantized='keep')
    with pytest.raises(ValueError, match="keeps GGUF codes.*'model.embed_tokens.weight'"):
        refit_plan(kept, {'model.embed_tokens.weight': torch.zeros(1)})


def test_a_layout_the_model_does_not_hold_is_refused(ckpts):
    """NeMo-RL (https://github.com/NVIDIA-NeMo/RL/issues/3659):
    bytes in another layout streamed over the model's; refused before anything is written."""
    a, b = ckpts['olmoe']
    served, new = load_model(a), load_model(b).state_dict()
    k = 'model.layers.0.mlp.experts.down_proj'
    bad = {**new, k: new[k].transpose(1, 2).contiguous()}  # [E, I, H] against the model's [E, H, I]
    before = storage(served)
    with pytest.raises(ValueError, match="make 'model.layers.0.mlp.experts.down_proj'.*the layout save_pretrained"):
        refit(served, bad)
    assert moved(before, served) == [] and differing(served, load_model(a)) == []


def test_kept_activation_order_is_refused(tmp_path):
    """compressed-tensors pack-quantized with activation-order groups (`weight_g_idx`): the column order is the
    quantizer's choice, which refit cannot repeat, so keeping it is refused naming the format and a key."""
    from transformers import AutoModelForCausalLM

    from mstar_utils.testing import quantized_configs, write_ct_actorder_checkpoint

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(quantized_configs()['ct_pack'], dtype=torch.float32)
    d = write_ct_actorder_checkpoint(model.to(torch.bfloat16), tmp_path / 'ao', group_size=4)
    served = load_model(d, quantized='keep')
    before = storage(served)
    with pytest.raises(ValueError, match=r'pack-quantized \(activation-order groups\) codes.*incoming \'model\.'):
        refit(served, {k: v.float() for k, v in model.state_dict().items()})
    assert moved(before, served) == []
