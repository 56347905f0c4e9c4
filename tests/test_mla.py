"""MLA finalization: the absorbed decode path against transformers' DeepseekV2Attention, the w_kc/w_vc split, and
each finalization error."""

import math
import os

import pytest
import torch
from torch import nn

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from transformers import AutoModelForCausalLM, DeepseekV2Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
from transformers.utils import logging as hf_logging

from mstar_utils.mla import MLAAttention, rope_freqs, apply_rope
from mstar_utils.loading import (
    ModuleAndPrefix,
    load_weights_from_hf_shards,
    check_loaded,
    process_weights_after_loading,
    load_weights,
)
from mstar_utils.testing import MLA_CONFIG as CFG, save_mla_checkpoint as save

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

N, P, R, V, L = (
    CFG['num_attention_heads'],
    CFG['qk_nope_head_dim'],
    CFG['qk_rope_head_dim'],
    CFG['v_head_dim'],
    CFG['kv_lora_rank'],
)


@pytest.fixture(scope='module', params=[None, 24], ids=['q_proj', 'q_lora'])
def ckpt(request, tmp_path_factory):
    folder = save(tmp_path_factory.mktemp('mla'), request.param)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation='eager').eval()
    return folder, ref


def loaded_layer(folder, config, layer=1, dtype=torch.float32):
    with torch.device('meta'):
        mla = MLAAttention.from_config(config, layer_idx=layer).to(dtype)
    [names] = load_weights_from_hf_shards(folder, [ModuleAndPrefix(mla, f'model.layers.{layer}.self_attn.')])
    check_loaded(mla, names, f'layer {layer}')
    return mla


def decode(mla, h, freqs, prefill):
    with torch.no_grad():
        out, cache = mla(h[:, :prefill], freqs[:, :prefill])
        outs = [out]
        for t in range(prefill, h.shape[1]):
            out, cache = mla(h[:, t : t + 1], freqs[:, t : t + 1], cache)
            outs.append(out)
    return torch.cat(outs, 1), cache


def reference(attn, h, freqs):
    T = h.shape[1]
    mask = torch.full((T, T), float('-inf')).triu(1)[None, None].to(h.dtype)
    with torch.no_grad():
        return attn(h, attention_mask=mask, position_embeddings=freqs)[0]


def inputs(T=13, B=2, seed=0, dtype=torch.float32):
    h = torch.randn(B, T, CFG['hidden_size'], generator=torch.Generator().manual_seed(seed)).to(dtype)
    return h, torch.arange(T)[None].expand(B, T)


@pytest.mark.parametrize('prefill', [1, 5, 13])
@pytest.mark.parametrize('layer', [0, 1])
def test_absorbed_decode_matches_transformers(ckpt, layer, prefill):
    folder, ref = ckpt
    mla = loaded_layer(folder, ref.config, layer)
    process_weights_after_loading(mla, 'cpu')
    h, pos = inputs()
    freqs = ref.model.rotary_emb(h, pos)
    ours, (c, k_pe) = decode(mla, h, freqs, prefill)
    theirs = reference(ref.model.layers[layer].self_attn, h, freqs)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert theirs.abs().max().item() > 0.5  # outputs at a scale where 1e-5 means something
    assert c.shape == (2, 13, L) and k_pe.shape == (2, 13, R)


def test_attention_is_not_uniform(ckpt):
    "The test weights give peaked attention, so a wrong score would change the output."
    folder, ref = ckpt
    mla = loaded_layer(folder, ref.config)
    process_weights_after_loading(mla, 'cpu')
    h, pos = inputs()
    freqs = ref.model.rotary_emb(h, pos)
    with torch.no_grad():
        _, (c, k_pe) = mla(h, freqs)
        q_nope, q_pe = mla.queries(h)
        s = (
            torch.einsum('bntp,npl,bsl->bnts', q_nope, mla.w_kc, c)
            + torch.einsum('bntr,bsr->bnts', apply_rope(q_pe, freqs), k_pe)
        ) * mla.softmax_scale
    assert s[..., -1, :].softmax(-1).max().item() > 0.3  # the last query over 13 keys: far from 1/13


def test_split_is_exact(ckpt):
    folder, ref = ckpt
    mla = loaded_layer(folder, ref.config)
    process_weights_after_loading(mla, 'cpu')
    w = ref.model.layers[1].self_attn.kv_b_proj.weight.view(N, P + V, L)
    assert mla.w_kc.shape == (N, P, L) and mla.w_vc.shape == (N, L, V)
    assert torch.equal(mla.w_kc, w[:, :P]) and torch.equal(mla.w_vc, w[:, P:].transpose(1, 2))
    assert mla.w_kc.is_contiguous() and mla.w_vc.is_contiguous()
    assert set(mla.state_dict()) == set(ref.model.layers[1].self_attn.state_dict())  # no new checkpoint keys
    # absorbed keys reproduce transformers' expanded keys: q_nope . k_nope == (q_nope w_kc) . c
    c = torch.randn(3, L)
    q = torch.randn(N, P)
    k_nope = (c @ ref.model.layers[1].self_attn.kv_b_proj.weight.T).view(3, N, P + V)[..., :P]
    assert torch.allclose(
        torch.einsum('np,snp->ns', q, k_nope), torch.einsum('np,npl,sl->ns', q, mla.w_kc, c), atol=1e-5
    )


def test_bf16_within_stated_tolerance(ckpt):
    """The tolerance the notebook's GPU cell states, checked here in bf16 on the CPU: at most twice transformers'
    bf16 error against fp32, or 1% of the output."""
    folder, ref = ckpt
    ref16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation='eager').eval()
    mla = loaded_layer(folder, ref.config, dtype=torch.bfloat16)
    process_weights_after_loading(mla, 'cpu')
    assert mla.w_kc.dtype == torch.bfloat16
    h, pos = inputs()
    want = reference(ref.model.layers[1].self_attn, h, ref.model.rotary_emb(h, pos))
    hb = h.bfloat16()
    fb = ref16.model.rotary_emb(hb, pos)
    ours = (decode(mla, hb, fb, 9)[0].float() - want).abs().max().item()
    theirs = (reference(ref16.model.layers[1].self_attn, hb, fb).float() - want).abs().max().item()
    assert ours <= max(2 * theirs, 0.01 * want.abs().max().item()), (ours, theirs)


def test_whole_tree_is_finalized_once(ckpt):
    folder, ref = ckpt
    with torch.device('meta'):
        layers = nn.ModuleList([MLAAttention.from_config(ref.config, layer_idx=i) for i in range(2)])
    for i, m in enumerate(layers):
        load_weights_from_hf_shards(folder, [ModuleAndPrefix(m, f'model.layers.{i}.self_attn.')])
    process_weights_after_loading(layers, 'cpu')
    assert all(m.w_kc is not None for m in layers)
    assert not torch.equal(layers[0].w_kc, layers[1].w_kc)


def test_rope_matches_transformers(ckpt):
    _, ref = ckpt
    pos = torch.arange(40)[None]
    assert torch.allclose(rope_freqs(pos, R), ref.model.rotary_emb(torch.zeros(1), pos), atol=1e-6)


def test_yarn_softmax_scale():
    cfg = DeepseekV2Config(
        **CFG,
        q_lora_rank=None,
        rope_parameters=dict(
            rope_type='yarn',
            rope_theta=10000.0,
            factor=40.0,
            mscale_all_dim=0.707,
            original_max_position_embeddings=16,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
        ),
    )
    assert math.isclose(MLAAttention.from_config(cfg).softmax_scale, DeepseekV2Attention(cfg, 0).scaling, rel_tol=1e-12)
    assert MLAAttention.from_config(cfg).softmax_scale != (P + R) ** -0.5


# ---- errors


def test_second_call_rebuilds_from_current_weights(ckpt):
    """Finalizing again after an in-place weight update equals a fresh layer loaded with the new weights (the RL
    weight-sync case)."""
    folder, ref = ckpt
    mla = loaded_layer(folder, ref.config)
    mla.process_weights_after_loading('cpu')
    torch.manual_seed(3)
    new = {k: v + 0.1 * torch.randn_like(v) for k, v in mla.state_dict().items()}
    load_weights(new, mla)
    process_weights_after_loading(mla, 'cpu')
    fresh = MLAAttention.from_config(ref.config, layer_idx=1)
    load_weights(new, fresh)
    process_weights_after_loading(fresh, 'cpu')
    h, pos = inputs()
    freqs = rope_freqs(pos, R)
    assert torch.equal(mla.w_kc, fresh.w_kc) and torch.equal(mla.w_vc, fresh.w_vc)
    assert torch.equal(decode(mla, h, freqs, 5)[0], decode(fresh, h, freqs, 5)[0])


def test_finalizing_twice_without_new_weights_changes_nothing(ckpt):
    folder, ref = ckpt
    mla = loaded_layer(folder, ref.config)
    mla.process_weights_after_loading('cpu')
    w_kc, w_vc = mla.w_kc.clone(), mla.w_vc.clone()
    mla.process_weights_after_loading('cpu')
    assert torch.equal(mla.w_kc, w_kc) and torch.equal(mla.w_vc, w_vc)


@pytest.mark.parametrize('shape', [(N * (P + V) - 4, L), (N * (P + V), L + 1), (N * P, L)])
def test_wrong_kv_b_proj_shape(ckpt, shape):
    _, ref = ckpt
    mla = MLAAttention.from_config(ref.config, layer_idx=3)
    mla.kv_b_proj.weight = nn.Parameter(torch.zeros(shape))
    with pytest.raises(
        ValueError,
        match=(
            rf'MLAAttention\(layer_idx=3\): kv_b_proj.weight has shape \[{shape[0]}, {shape[1]}\], '
            rf'expected \[N\*\(P\+V\), L\] = \[{N * (P + V)}, {L}\]'
        ),
    ):
        mla.process_weights_after_loading('cpu')
    assert mla.w_kc is None


def test_finalize_before_load_and_decode_before_finalize(ckpt):
    _, ref = ckpt
    with torch.device('meta'):
        mla = MLAAttention.from_config(ref.config)
    with pytest.raises(RuntimeError, match='kv_b_proj.weight is still on meta'):
        mla.process_weights_after_loading('cpu')
    h, pos = inputs(T=2)
    with pytest.raises(RuntimeError, match=r'call process_weights_after_loading\(device\) after loading'):
        MLAAttention.from_config(ref.config)(h, rope_freqs(pos, R))
