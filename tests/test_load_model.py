"""load_model against transformers' from_pretrained: state_dict, logits, eval mode and generation config, on real
checkpoints (SmolLM2, all-MiniLM-L6-v2) and tiny models of other families written by save_pretrained."""

import logging
import os

import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSpeechSeq2Seq,
    GenerationConfig,
)
from transformers.utils import logging as hf_logging

from mstar_utils import load_model, smollm2_checkpoint, minilm_checkpoint
from mstar_utils.testing import ListHandler, assert_state_dict_equal, save_tiny
from mstar_utils.upstream import tied_weights_keys

hf_logging.set_verbosity_error()

AUTO = {'t5': AutoModelForSeq2SeqLM, 'whisper': AutoModelForSpeechSeq2Seq}


def inputs(name, model):
    "Model inputs of the family's kind: token ids, and for encoder-decoders decoder ids or mel features."
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=g)
    if name == 't5':
        return dict(input_ids=ids, decoder_input_ids=ids[:, :5])
    if name == 'whisper':
        c = model.config
        feats = torch.randn(2, c.num_mel_bins, 2 * c.max_source_positions, generator=g).to(model.dtype)
        return dict(input_features=feats, decoder_input_ids=ids[:, :5])
    return dict(input_ids=ids)


def assert_same(ours, ref, kwargs):
    assert type(ours) is type(ref)
    assert_state_dict_equal(ours, ref)
    assert ours.training is False and ref.training is False
    with torch.no_grad():
        assert torch.equal(ours(**kwargs).logits, ref(**kwargs).logits)


@pytest.mark.parametrize(
    'name',
    [
        'qwen2',
        'gemma2',
        'gpt_neox',
        't5',
        'whisper',
        'mixtral',
        'qwen2_moe',
        'qwen3_moe',
        'olmoe',
        'phimoe',
        'deepseek_v2',
    ],
)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_tiny_families_equal_from_pretrained(tmp_path, name, dtype):
    folder = save_tiny(name, tmp_path / name, dtype=dtype)
    ours = load_model(folder)
    ref = AUTO.get(name, AutoModelForCausalLM).from_pretrained(folder)
    assert_same(ours, ref, inputs(name, ref))
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()


def test_smollm2_equals_from_pretrained():
    ckpt = smollm2_checkpoint()
    ours, ref = load_model(ckpt), AutoModelForCausalLM.from_pretrained(ckpt)
    assert_same(ours, ref, dict(input_ids=torch.tensor([[1, 504, 3458, 282, 4649, 314]])))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.generation_config.to_dict() == GenerationConfig.from_pretrained(ckpt).to_dict()


def test_minilm_equals_from_pretrained_and_is_in_eval_mode():
    ckpt = minilm_checkpoint()
    ours, ref = load_model(ckpt), AutoModel.from_pretrained(ckpt)
    ids = torch.tensor([[101, 1996, 4937, 7719, 2006, 1996, 13523, 1012, 102]])
    assert_state_dict_equal(ours, ref)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)
    assert not ours.training


def test_renamed_keys_load_as_from_pretrained_loads_them(tmp_path):
    """Checkpoint names that transformers renames: GPT-NeoX's embed_out (as save_pretrained writes it), and
    all-MiniLM-L6-v2 rewritten with BERT's old LayerNorm.gamma/beta names."""
    import shutil
    from safetensors.torch import load_file, save_file
    from mstar_utils.sources import read_weight_map

    neox = save_tiny('gpt_neox', tmp_path / 'neox')
    assert 'embed_out.weight' in read_weight_map(neox) and 'lm_head.weight' not in read_weight_map(neox)
    ours, ref = load_model(neox), AutoModelForCausalLM.from_pretrained(neox)
    assert_same(ours, ref, inputs('gpt_neox', ref))
    with pytest.raises(KeyError, match='lm_head.weight'):
        load_model(neox, renames=False)  # the old names, as they are
    old = tmp_path / 'minilm-gamma'
    shutil.copytree(minilm_checkpoint(), old)
    sd = load_file(old / 'model.safetensors')
    legacy = {
        k.replace('LayerNorm.weight', 'LayerNorm.gamma').replace('LayerNorm.bias', 'LayerNorm.beta'): v
        for k, v in sd.items()
    }
    assert sum('gamma' in k for k in legacy) == 13
    save_file(legacy, str(old / 'model.safetensors'), metadata={'format': 'pt'})
    ours, ref = load_model(old, strict=True), AutoModel.from_pretrained(minilm_checkpoint())
    assert_state_dict_equal(ours, ref)


def test_vision_language_checkpoint_in_the_legacy_layout(tmp_path):
    """A tiny Llava as save_pretrained writes it (language_model.model.*, language_model.lm_head): loaded into
    today's layout (model.language_model.*, lm_head) equal to from_pretrained, vision tower and projector included."""
    import transformers as tf
    from mstar_utils.sources import read_weight_map

    text = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    vision = tf.CLIPVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    torch.manual_seed(0)
    tf.LlavaForConditionalGeneration(
        tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=120)
    ).save_pretrained(tmp_path / 'llava')
    keys = read_weight_map(tmp_path / 'llava')
    assert 'language_model.lm_head.weight' in keys and not any(k.startswith('model.') for k in keys)
    ours, ref = (
        load_model(tmp_path / 'llava', strict=True),
        tf.AutoModelForImageTextToText.from_pretrained(tmp_path / 'llava'),
    )
    assert_state_dict_equal(ours, ref)
    a = ours.state_dict()
    assert any(k.startswith('model.vision_tower.') for k in a) and any(
        k.startswith('model.multi_modal_projector.') for k in a
    )
    with pytest.raises(KeyError):
        load_model(tmp_path / 'llava', renames=False)


def test_fusing_rules_come_from_transformers_for_types_we_have_no_recipe_for(tmp_path):
    """OLMoE and PhiMoE are not in CONVERSIONS_BY_MODEL_TYPE: their experts, one key each in the checkpoint, are
    fused by rules taken from transformers (PhiMoE's after its renames)."""
    from mstar_utils.model import CONVERSIONS_BY_MODEL_TYPE
    from mstar_utils.sources import read_weight_map

    for name in ('olmoe', 'phimoe'):
        assert name not in CONVERSIONS_BY_MODEL_TYPE
        folder = save_tiny(name, tmp_path / name)
        keys = read_weight_map(folder)
        assert any('.experts.0.' in k for k in keys) and not any(k.endswith('gate_up_proj') for k in keys)
        with pytest.raises(KeyError, match='gate_up_proj'):
            load_model(folder, conv=None)
        ours, ref = load_model(folder, strict=True), AutoModelForCausalLM.from_pretrained(folder)
        assert_same(ours, ref, inputs(name, ref))


def test_dtype_and_model_class_overrides(tmp_path):
    folder = save_tiny('qwen2', tmp_path / 'q')
    m = load_model(folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    from transformers import Qwen2ForCausalLM, Qwen2Model

    assert type(load_model(folder, Qwen2ForCausalLM)) is Qwen2ForCausalLM
    base, ref = (
        load_model(folder, Qwen2Model),
        Qwen2Model.from_pretrained(folder),
    )  # the base model from a causal LM checkpoint, as from_pretrained reads it
    assert type(base) is Qwen2Model
    assert_state_dict_equal(base, ref)
    with pytest.raises(ValueError, match='lm_head.weight'):
        load_model(folder, Qwen2Model, strict=True)  # the head it leaves unused
    with pytest.raises(KeyError, match=r"the module's names occur under \['model.'\]"):
        load_model(folder, Qwen2Model, renames=False)


def test_moe_without_recipes_is_refused_naming_the_fused_key(tmp_path):
    folder = save_tiny('mixtral', tmp_path / 'm')
    with pytest.raises(KeyError, match='mlp.experts.gate_up_proj'):
        load_model(folder, conv=None)


def test_unused_keys_warn_or_raise(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_tiny('qwen2', tmp_path / 'q', max_shard_size='10GB')
    sd = load_file(folder / 'model.safetensors')
    sd['model.extra.weight'] = torch.zeros(2)
    save_file(sd, str(folder / 'model.safetensors'))
    h = ListHandler()
    logging.getLogger('mstar_utils.model').addHandler(h)
    try:
        load_model(folder)
    finally:
        logging.getLogger('mstar_utils.model').removeHandler(h)
    assert [r.getMessage() for r in h.records] == [
        'q: 1 checkpoint key(s) were not used by Qwen2ForCausalLM: model.extra.weight'
    ]
    with pytest.raises(
        ValueError,
        match=r'1 checkpoint key\(s\) were not used by Qwen2ForCausalLM: model.extra.weight; pass strict=False',
    ):
        load_model(folder, strict=True)


def test_no_generation_config_file_derives_one_from_the_config(tmp_path):
    folder = save_tiny('qwen2', tmp_path / 'q')
    (folder / 'generation_config.json').unlink()
    ours, ref = load_model(folder), AutoModelForCausalLM.from_pretrained(folder)
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()


def test_concurrent_load_model_calls():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as ex:
        models = list(ex.map(lambda _: load_model(minilm_checkpoint()), range(3)))
    ref = models[0].state_dict()
    for m in models[1:]:
        assert_state_dict_equal(m, ref)


def rewrite(folder, change):
    "Apply `change(state_dict)` to every shard of a save_pretrained checkpoint, index kept in step."
    import json
    from safetensors.torch import load_file, save_file

    idx_path = folder / 'model.safetensors.index.json'
    idx = json.loads(idx_path.read_text()) if idx_path.exists() else None
    files = sorted(set(idx['weight_map'].values())) if idx else ['model.safetensors']
    sd = {}
    for f in files:
        sd.update(load_file(folder / f))
        (folder / f).unlink()
    change(sd)
    save_file(sd, folder / 'model.safetensors', metadata={'format': 'pt'})
    if idx:
        idx_path.unlink()


@pytest.mark.parametrize(
    'name,tied_key,source_key',
    [
        ('qwen2', 'lm_head.weight', 'model.embed_tokens.weight'),
        ('t5', 'encoder.embed_tokens.weight', 'shared.weight'),
        ('t5', 'lm_head.weight', 'shared.weight'),
    ],
)
@pytest.mark.parametrize('equal', [True, False])
def test_a_tie_stored_twice_loads_as_from_pretrained(tmp_path, name, tied_key, source_key, equal):
    """A tied name the checkpoint stores besides its source: tied again when equal, loaded apart (with a warning)
    when not, as from_pretrained does."""
    import json

    folder = save_tiny(name, tmp_path / name)
    cfg = json.loads((folder / 'config.json').read_text())
    cfg['tie_word_embeddings'] = True
    (folder / 'config.json').write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(1)

    def change(sd):
        sd[tied_key] = sd[source_key].clone() if equal else torch.randn(sd[source_key].shape, generator=g)

    rewrite(folder, change)
    ref = AUTO.get(name, AutoModelForCausalLM).from_pretrained(folder)
    h = ListHandler()
    logging.getLogger('mstar_utils.model').addHandler(h)
    try:
        ours = load_model(folder)
    finally:
        logging.getLogger('mstar_utils.model').removeHandler(h)
    assert_same(ours, ref, inputs(name, ref))

    def same(m):
        return m.get_parameter(tied_key) is m.get_parameter(source_key)

    assert same(ours) == same(ref) == equal
    assert sorted(tied_weights_keys(ours)) == sorted(tied_weights_keys(ref))
    assert any('different values' in r.getMessage() for r in h.records) == (not equal)


def test_config_without_dtype_builds_in_the_checkpoint_dtype(tmp_path):
    import json

    folder = save_tiny('qwen3_moe', tmp_path / 'm', dtype=torch.bfloat16)
    cfg = json.loads((folder / 'config.json').read_text())
    cfg.pop('dtype', None)
    cfg.pop('torch_dtype', None)
    (folder / 'config.json').write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(folder)
    assert ref.dtype == torch.bfloat16
    assert_same(load_model(folder), ref, inputs('qwen3_moe', ref))


def test_missing_built_buffers_are_kept_and_reported_but_missing_parameters_are_not(tmp_path):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    ResNetForImageClassification(
        ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1], num_labels=2)
    ).save_pretrained(tmp_path / 'r')
    rewrite(
        tmp_path / 'r',
        lambda sd: [
            sd.pop(k) for k in [k for k in sd if k.endswith('num_batches_tracked') or k.endswith('running_var')]
        ],
    )
    ref = ResNetForImageClassification.from_pretrained(tmp_path / 'r')
    h = ListHandler()
    logging.getLogger('mstar_utils.model').addHandler(h)
    try:
        ours = load_model(tmp_path / 'r')
    finally:
        logging.getLogger('mstar_utils.model').removeHandler(h)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(ours(pixel_values=x).logits, ref(pixel_values=x).logits)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    assert [r.getMessage().split(':')[1].strip() for r in h.records] == [
        '16 persistent buffer(s) the checkpoint lacks are initialized as ResNetForImageClassification initializes them'
    ]
    rewrite(tmp_path / 'r', lambda sd: sd.pop('classifier.1.weight'))
    with pytest.raises(KeyError, match=r"missing key\(s\).*classifier\.1\.weight"):
        load_model(tmp_path / 'r')


@pytest.mark.parametrize(
    'arch,kwargs',
    [
        ('GPTJConfig', dict(n_embd=64, n_layer=1, n_head=4, rotary_dim=16, n_positions=2048)),
        ('CodeGenConfig', dict(n_embd=64, n_layer=1, n_head=4, rotary_dim=16, n_positions=2048, n_ctx=2048)),
    ],
)
def test_non_persistent_buffers_are_initialized_as_from_pretrained_does(tmp_path, arch, kwargs):
    """GPT-J's and CodeGen's sin/cos tables are built while bf16 is the default dtype; from_pretrained computes them
    again after loading, and so does load_model."""
    import transformers

    cfg = getattr(transformers, arch)(vocab_size=96, bos_token_id=0, eos_token_id=0, **kwargs)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / 'm')
    ours, ref = load_model(tmp_path / 'm'), AutoModelForCausalLM.from_pretrained(tmp_path / 'm')
    a, b = dict(ours.named_buffers()), dict(ref.named_buffers())  # non-persistent ones included
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)
    assert_same(ours, ref, dict(input_ids=torch.arange(9)[None]))


def test_transformers_rules_listed_once_and_the_rest_named():
    """A rule transformers lists for a model type and again for its text model is taken once; rules our converter
    cannot express are named in load errors."""
    from transformers import CONFIG_MAPPING
    from mstar_utils.upstream import checkpoint_conversions
    from mstar_utils.model import transformers_conversions, transformers_conversions_skipped, _with_skipped_rules

    omni = CONFIG_MAPPING['qwen3_omni_moe']().thinker_config
    rules = transformers_conversions(omni)
    assert rules and len({(tuple(c.source_patterns), c.target_patterns) for c in rules}) == len(rules)
    types = [t for t in ('hrm_text', 'lara_mini', 'kimi_linear') if t in CONFIG_MAPPING]  # lara_mini: 5.25
    assert len(types) >= 2
    for t in types:
        cfg = CONFIG_MAPPING[t]()
        theirs = [c for c in checkpoint_conversions(t) if hasattr(c, 'operations')]
        skipped = transformers_conversions_skipped(cfg)
        assert len(skipped) + len(transformers_conversions(cfg)) == len(theirs) and skipped
        e = _with_skipped_rules(KeyError('ckpt: 2 missing key(s)'), cfg, 'auto')
        assert 'rules load_model cannot apply' in e.args[0] and skipped[0] in e.args[0]
        assert _with_skipped_rules(KeyError('x'), cfg, None).args[0] == 'x'
    from mstar_utils.model import auto_conversions

    subs = {k: CONFIG_MAPPING[t]().to_dict() for k, t in [('text_encoder', 't5'), ('audio_encoder', 'encodec')]}
    musicgen = CONFIG_MAPPING['musicgen'](**subs, decoder=CONFIG_MAPPING['musicgen_decoder']().to_dict())
    assert auto_conversions(musicgen) == []  # several text configs: get_text_config refuses to pick one


def test_a_meta_build_allocates_no_parameter(tmp_path):
    """DeepSeek-V3's full config, built on meta in float32 under a 12 GB address-space limit: one layer's experts
    alone are 30 GB, so a build that allocated each parameter before moving it to meta could not finish."""
    import subprocess
    import sys

    code = (
        'import resource, torch, transformers\n'
        'from mstar_utils.model import build_on_meta\n'
        'resource.setrlimit(resource.RLIMIT_AS, (12 * 2**30, resource.RLIM_INFINITY))\n'
        "cfg = transformers.DeepseekV3Config(architectures=['DeepseekV3ForCausalLM'])\n"
        'm = build_on_meta(cfg, dtype=torch.float32)\n'
        'print(sum(p.numel() for p in m.parameters()), {p.device.type for p in m.parameters()})\n'
    )
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device('meta'):  # transformers' own count of the same model, built wholly on meta
        ref = DeepseekV3ForCausalLM(DeepseekV3Config())
    assert r.stdout.split() == [str(sum(p.numel() for p in ref.parameters())), "{'meta'}"]
