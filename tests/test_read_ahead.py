"""load_model's reads that start before the build (start_reads, ReadAhead), `mmap=True`, and a build on meta that
initializes nothing and needs no accelerate: every load equals transformers' from_pretrained, tensor for tensor and in
its logits."""

import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from mstar_utils.checkpoints import smollm2_checkpoint
from mstar_utils.model import build_on_meta, load_model, start_reads
from mstar_utils.sources import ReadAhead, checkpoint_source
from mstar_utils.testing import assert_state_dict_equal, save_tiny

IDS = torch.tensor([[1, 2, 3, 4, 5]])


def assert_same(model, ref):
    "Equal state_dicts (names, dtypes, values), equal non-persistent buffers, equal logits."
    assert_state_dict_equal(model, ref)
    assert_state_dict_equal(dict(model.named_buffers()), dict(ref.named_buffers()))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


@pytest.fixture(scope='module')
def smol_ref():
    return AutoModelForCausalLM.from_pretrained(smollm2_checkpoint())


@pytest.mark.parametrize('mmap', [False, True])
def test_smollm2_equals_from_pretrained(smol_ref, mmap):
    model = load_model(smollm2_checkpoint(), mmap=mmap)
    assert_same(model, smol_ref)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    shards = {str(p) for p in checkpoint_source(smollm2_checkpoint()).k2f.values()}
    storages = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert len(storages) == len(shards)  # every weight a view of its shard's buffer (or mapping): nothing copied twice


def test_owned_views_outlive_the_source_and_are_writable(smol_ref):
    model = load_model(smollm2_checkpoint())
    w = model.model.norm.weight
    with torch.no_grad():
        w.add_(1)
    assert torch.equal(w, smol_ref.model.norm.weight + 1)  # owned memory: a write changes this model only
    fresh = load_model(smollm2_checkpoint())
    assert torch.equal(fresh.model.norm.weight, smol_ref.model.norm.weight)


def test_read_ahead_takes_only_shards_that_load_as_stored(tmp_path):
    ckpt = save_tiny('mixtral', tmp_path / 'mixtral', max_shard_size='20KB')
    cfg = AutoConfig.from_pretrained(ckpt)
    src = start_reads(ckpt, cfg, torch.float32)
    try:
        ahead = set(src.ahead.paths)
        experts = {src.k2f[k] for k in src.keys() if '.experts.' in k}  # noqa: SIM118 (keys(), no __iter__)
        assert (
            ahead and experts and not ahead & experts
        )  # a shard fused by the Mixtral recipes is read by the load itself
    finally:
        src.close()
    for mmap in (False, True):
        assert_same(load_model(ckpt, mmap=mmap), AutoModelForCausalLM.from_pretrained(ckpt))


@pytest.mark.parametrize('arch', ['olmoe', 'phimoe'])
def test_reads_begun_before_transformers_rules_give_up_the_fused_shards(tmp_path, arch, monkeypatch):
    "load_model's reads start before it knows transformers' fusing rules; the shards those rules fuse are given up."
    import mstar_utils.model as M

    started = []

    class Recorded(ReadAhead):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append(self)

    monkeypatch.setattr(M, 'ReadAhead', Recorded)
    ckpt = save_tiny(arch, tmp_path / arch)
    assert_same(load_model(ckpt), AutoModelForCausalLM.from_pretrained(ckpt))
    src = checkpoint_source(ckpt)
    experts = {src.k2f[k] for k in src.keys() if '.experts.' in k}  # noqa: SIM118 (keys(), no __iter__)
    src.close()
    (ahead,) = started
    assert experts and experts <= set(
        ahead.paths
    )  # config.json alone: no rule of ours fuses them, so they were read ahead
    assert set(ahead.cancelled) == experts  # then transformers' rules fuse them: given up, read by the load itself


def test_a_cast_reads_nothing_ahead_and_equals_from_pretrained(smol_ref):
    src = start_reads(smollm2_checkpoint(), AutoConfig.from_pretrained(smollm2_checkpoint()), torch.float32)
    assert src.ahead is None
    src.close()
    assert_same(
        load_model(smollm2_checkpoint(), dtype=torch.float32),
        AutoModelForCausalLM.from_pretrained(smollm2_checkpoint(), dtype=torch.float32),
    )


def test_closing_the_source_stops_the_reads():
    src = checkpoint_source(smollm2_checkpoint())
    shards = sorted(set(src.k2f.values()))
    ahead = ReadAhead(src, shards)
    src.close()
    assert not ahead._thread.is_alive() and not ahead._bufs
    for p in shards:
        if p in ahead._errors:
            assert 'stopped' in str(ahead._errors[p])


def test_build_initializes_nothing_and_needs_no_accelerate(monkeypatch, smol_ref):
    cfg = AutoConfig.from_pretrained(smollm2_checkpoint())
    build_on_meta(cfg)  # the modeling module imported (transformers itself may import accelerate when it is installed)
    calls = []
    init = PreTrainedModel._init_weights
    monkeypatch.setattr(PreTrainedModel, '_init_weights', lambda self, m: (calls.append(m), init(self, m))[1])
    monkeypatch.setitem(sys.modules, 'accelerate', None)  # any `import accelerate` from here on raises ImportError
    model = build_on_meta(cfg)
    assert calls == []
    assert model.lm_head.weight.is_meta and model.lm_head.weight is model.model.embed_tokens.weight
    inv = model.model.rotary_emb.inv_freq
    assert not inv.is_meta and torch.equal(inv, smol_ref.model.rotary_emb.inv_freq)


def test_gptj_sin_cos_are_built_real_and_equal(tmp_path):
    from transformers import GPTJConfig, GPTJForCausalLM

    cfg = GPTJConfig(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    GPTJForCausalLM(cfg).save_pretrained(tmp_path / 'gptj')
    model, ref = load_model(tmp_path / 'gptj'), AutoModelForCausalLM.from_pretrained(tmp_path / 'gptj')
    assert_same(model, ref)
    pos = {n: t for n, t in model.named_buffers() if n.endswith('embed_positions')}
    theirs = dict(ref.named_buffers())
    assert pos and all(not t.is_meta and torch.equal(t, theirs[n]) for n, t in pos.items())
