"Generation defaults from generation_config.json (checked against transformers' GenerationConfig)."

import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from mstar_utils.generation import load_generation_defaults, TOP_K_DISABLED
from mstar_utils.checkpoints import smollm2_checkpoint

LOGGER = 'mstar_utils.generation'


def write(d: Path, cfg) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / 'generation_config.json').write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return d


def load(caplog, *args, **kwargs):
    "load_generation_defaults with its warnings: (result, [messages])."
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = load_generation_defaults(*args, **kwargs)
    return out, [r.getMessage() for r in caplog.records if r.name == LOGGER]


# ---- agreement with transformers

knob_values = st.fixed_dictionaries(
    {},
    optional={
        'temperature': st.floats(0.05, 2.0),
        'top_p': st.floats(0.05, 1.0),
        'top_k': st.integers(1, 500),
        'min_p': st.floats(0.0, 1.0),
        'repetition_penalty': st.floats(0.5, 2.0),
        'max_new_tokens': st.integers(1, 10**5),
        'max_length': st.integers(1, 10**5),
    },
)


@given(knob_values)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_knobs_match_transformers(knobs):
    from transformers import GenerationConfig

    with tempfile.TemporaryDirectory() as d:
        write(Path(d), {'do_sample': True, **knobs})
        gc = GenerationConfig.from_pretrained(d)
        got = load_generation_defaults(d)
    want = {k: getattr(gc, k) for k in ('temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty') if k in knobs}
    if 'max_new_tokens' in knobs:
        want['max_output_tokens'] = gc.max_new_tokens
    assert got == want
    assert 'max_length' not in got and 'max_new_tokens' not in got
    assert all(type(got[k]) is float for k in ('temperature', 'top_p', 'min_p', 'repetition_penalty') if k in got)


def test_real_checkpoint_declares_no_sampling(caplog):
    from transformers import GenerationConfig

    gc = GenerationConfig.from_pretrained(smollm2_checkpoint())
    declared = gc.to_diff_dict()
    assert not {'temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty', 'max_new_tokens', 'do_sample'} & set(
        declared
    )
    assert load(caplog, smollm2_checkpoint()) == ({}, [])


# ---- the contract's rules


def test_greedy(tmp_path, caplog):
    d = write(tmp_path, {'do_sample': False, 'temperature': 0.7, 'top_p': 0.9})
    assert load(caplog, d) == ({'temperature': 0.0, 'top_p': 0.9}, [])
    assert load(caplog, write(tmp_path, {'do_sample': False}))[0] == {'temperature': 0.0}
    assert load(caplog, write(tmp_path, {'do_sample': True, 'temperature': 0.7}))[0] == {'temperature': 0.7}


def test_dosample_spelling_and_prefix(tmp_path, caplog):
    d = write(
        tmp_path,
        {
            'do_sample': True,
            'temperature': 0.9,
            'top_k': 50,
            'max_new_tokens': 8192,
            'subtalker_dosample': False,
            'subtalker_temperature': 0.9,
            'subtalker_top_k': 30,
            'talker_temperature': 0.6,
            'talker_max_new_tokens': 100,
        },
    )
    assert load(caplog, d) == ({'temperature': 0.9, 'top_k': 50, 'max_output_tokens': 8192}, [])
    assert load(caplog, d, prefix='subtalker_')[0] == {'temperature': 0.0, 'top_k': 30}
    assert load(caplog, d, prefix='subtalker_', stage='code_predictor_')[0] == {
        'code_predictor_temperature': 0.0,
        'code_predictor_top_k': 30,
    }
    assert load(caplog, d, prefix='talker_', stage='talker_')[0] == {
        'talker_temperature': 0.6,
        'talker_max_output_tokens': 100,
    }
    assert load(caplog, write(tmp_path, {'dosample': False, 'temperature': 1.0}))[0] == {'temperature': 0.0}


def test_no_file_gives_nothing(tmp_path, caplog):
    assert load(caplog, None) == ({}, [])
    assert load(caplog, tmp_path / 'missing') == ({}, [])
    assert load(caplog, tmp_path) == ({}, [])
    assert load(caplog, str(tmp_path)) == ({}, [])
    (tmp_path / 'weights.bin').write_bytes(b'')
    assert load(caplog, tmp_path / 'weights.bin') == ({}, [])  # a file given as the folder: nothing under it


@pytest.mark.parametrize(
    'content,why',
    [
        ('{"temperature": 0.7,', 'not valid JSON'),
        ('', 'empty (0 bytes of JSON)'),
        ('[0.7]', 'holds a JSON array, expected an object'),
        ('0.7', 'holds a JSON number, expected an object'),
        (b'{"temperature": 0.7, "x": "\xff"}', 'not UTF-8 text'),
    ],
)
def test_broken_file_warns(tmp_path, caplog, content, why):
    f = tmp_path / 'generation_config.json'
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    out, warns = load(caplog, tmp_path)
    assert out == {} and len(warns) == 1 and str(f) in warns[0] and why in warns[0], warns


def test_unreadable_file_warns(tmp_path, caplog):
    (tmp_path / 'generation_config.json').mkdir()  # there, but not a file one can read
    out, warns = load(caplog, tmp_path)
    assert out == {} and len(warns) == 1 and str(tmp_path / 'generation_config.json') in warns[0]


def test_prefix_without_underscore_is_normalized(tmp_path, caplog):
    d = write(tmp_path, {'talker_temperature': 0.6, 'talker_do_sample': False, 'subtalker_top_k': 30, 'top_k': 5})
    assert load(caplog, d, prefix='talker') == load(caplog, d, prefix='talker_') == ({'temperature': 0.0}, [])
    assert load(caplog, d, prefix='subtalker', stage='cp_') == ({'cp_top_k': 30}, [])
    assert load(caplog, d, prefix='') == ({'top_k': 5}, [])
    with pytest.raises(ValueError, match='prefix must be a string'):
        load_generation_defaults(d, prefix=None)


def test_prefix_that_selects_nothing_names_the_prefixes(tmp_path, caplog):
    d = write(
        tmp_path, {'temperature': 0.9, 'talker_temperature': 0.6, 'subtalker_dosample': False, 'subtalker_top_k': 30}
    )
    out, warns = load(caplog, d, prefix='sub_talker')
    assert out == {} and len(warns) == 1
    assert (
        "'sub_talker_'" in warns[0]
        and "'subtalker_', 'talker_'" in warns[0]
        and str(d / 'generation_config.json') in warns[0]
    )
    # no warning where the prefix selects a key, even an invalid one (that one warns on its own), or where the file has
    # no prefixes
    assert load(caplog, d, prefix='talker_') == ({'temperature': 0.6}, [])
    assert load(caplog, write(tmp_path, {'temperature': 0.9}), prefix='talker') == ({}, [])
    out, warns = load(caplog, write(tmp_path, {'talker_temperature': 'hot'}), prefix='talker')
    assert out == {} and len(warns) == 1 and 'talker_temperature' in warns[0]


def test_path_to_the_file_itself(tmp_path, caplog):
    d = write(tmp_path / 'ckpt', {'temperature': 0.7, 'max_new_tokens': 10})
    want = ({'temperature': 0.7, 'max_output_tokens': 10}, [])
    assert (
        load(caplog, d / 'generation_config.json')
        == load(caplog, str(d / 'generation_config.json'))
        == load(caplog, d)
        == want
    )
    (tmp_path / 'talker_generation_config.json').write_text(json.dumps({'do_sample': False}))
    assert load(caplog, tmp_path / 'talker_generation_config.json') == ({'temperature': 0.0}, [])
    assert load(caplog, tmp_path / 'missing' / 'generation_config.json') == ({}, [])
    (tmp_path / 'bad.json').write_text('{')
    out, warns = load(caplog, tmp_path / 'bad.json')
    assert out == {} and len(warns) == 1 and 'bad.json' in warns[0]


# ---- beyond the contract


def test_max_length_is_not_max_output_tokens(tmp_path, caplog):
    assert load(caplog, write(tmp_path, {'max_length': 4096})) == ({}, [])
    assert load(caplog, write(tmp_path, {'max_length': 4096, 'max_new_tokens': 512}))[0] == {'max_output_tokens': 512}


@given(st.integers(-10, 1000))
@settings(max_examples=50, deadline=None)
def test_top_k_is_never_zero(k):
    with tempfile.TemporaryDirectory() as d:
        got = load_generation_defaults(write(Path(d), {'top_k': k}))
    assert got['top_k'] == (k if k >= 1 else TOP_K_DISABLED) and got['top_k'] != 0


def test_top_k_zero_means_no_top_k_in_transformers(tmp_path):
    # how transformers reads the same file: top_k 0 adds no top-k step at all (and top_k 5 does, the control)
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation import TopKLogitsWarper
    from transformers.generation.utils import GenerationMixin

    fake = type('M', (GenerationMixin,), {'config': None, 'device': 'cpu'})()

    def has_top_k(k):
        write(tmp_path, {'do_sample': True, 'top_k': k})
        procs = GenerationMixin._get_logits_processor(
            fake,
            GenerationConfig.from_pretrained(tmp_path),
            input_ids_seq_length=1,
            encoder_input_ids=None,
            prefix_allowed_tokens_fn=None,
            logits_processor=LogitsProcessorList(),
        )
        return any(isinstance(p, TopKLogitsWarper) for p in procs)

    assert has_top_k(5) and not has_top_k(0)
    assert load_generation_defaults(tmp_path) == {'top_k': TOP_K_DISABLED} and TOP_K_DISABLED == -1


@pytest.mark.parametrize(
    'key,value',
    [
        ('temperature', '0.7'),
        ('temperature', True),
        ('temperature', [0.7]),
        ('temperature', -0.1),
        ('temperature', 'NaN'),
        ('top_p', 0),
        ('top_p', 1.5),
        ('min_p', -0.1),
        ('min_p', 2),
        ('repetition_penalty', 0),
        ('top_k', 40.0),
        ('top_k', '40'),
        ('top_k', False),
        ('max_new_tokens', 0),
        ('max_new_tokens', 512.0),
        ('max_new_tokens', '512'),
        ('do_sample', 'false'),
        ('do_sample', 0),
    ],
)
def test_wrong_value_warns_and_is_skipped(tmp_path, caplog, key, value):
    good = {
        'temperature': 0.5,
        'top_p': 0.9,
        'top_k': 20,
        'min_p': 0.05,
        'repetition_penalty': 1.1,
        'max_new_tokens': 100,
    }
    cfg = {**good, key: value}
    f = tmp_path / 'generation_config.json'
    f.write_text(json.dumps(cfg).replace('"NaN"', 'NaN'))
    out, warns = load(caplog, tmp_path)
    want = {('max_output_tokens' if k == 'max_new_tokens' else k): v for k, v in good.items() if k != key}
    assert out == want
    assert len(warns) == 1 and str(f) in warns[0] and key in warns[0], warns


def test_null_is_unset(tmp_path, caplog):
    assert load(caplog, write(tmp_path, {'temperature': None, 'top_k': None, 'do_sample': None, 'top_p': 0.5})) == (
        {'top_p': 0.5},
        [],
    )


FLOAT_KNOBS = ('temperature', 'top_p', 'min_p', 'repetition_penalty')


@pytest.mark.parametrize('key', FLOAT_KNOBS)
@pytest.mark.parametrize('digits', [310, 400, 4000])
def test_int_too_large_for_a_float_warns_and_is_skipped(tmp_path, caplog, key, digits):
    """JSON integers have no bound: one past the largest float (sys.float_info.max) is dropped like any other wrong
    value."""
    import sys

    huge = '1' + '0' * digits
    assert int(huge) > sys.float_info.max
    with pytest.raises(OverflowError):
        float(int(huge))  # what GenerationConfig's own float() of it would do
    (tmp_path / 'generation_config.json').write_text('{"top_k": 20, "%s": %s}' % (key, huge))
    out, warns = load(caplog, tmp_path)
    assert out == {'top_k': 20}
    assert len(warns) == 1 and key in warns[0] and 'no float holds' in warns[0] and len(warns[0]) < 400, warns


@pytest.mark.parametrize('key', FLOAT_KNOBS)
def test_the_largest_int_a_float_holds_is_a_number(tmp_path, caplog, key):
    "The boundary: 10**308 is a float (and a legal temperature or penalty), 10**309 is not."
    (tmp_path / 'generation_config.json').write_text('{"%s": 1%s}' % (key, '0' * 308))
    out, warns = load(caplog, tmp_path)
    assert (out, len(warns)) == (({key: 1e308}, 0) if key in ('temperature', 'repetition_penalty') else ({}, 1))


def test_integer_knobs_have_no_upper_bound(tmp_path, caplog):
    """transformers' GenerationConfig.validate sets none either (max_new_tokens must only be > 0); vLLM's limits
    depend on the model."""
    from transformers import GenerationConfig

    big = 10**30
    write(tmp_path, {'do_sample': True, 'top_k': big, 'max_new_tokens': big})
    gc = GenerationConfig.from_pretrained(tmp_path)
    gc.validate(strict=True)
    assert (
        load(caplog, tmp_path) == ({'top_k': gc.top_k, 'max_output_tokens': gc.max_new_tokens}, []) and gc.top_k == big
    )


# ---- transformers' own keys are no stage's knobs


def transformers_keys_ending_in_a_knob() -> dict:
    "{GenerationConfig key: (the prefix it would seem to have, the knob)} for keys such as encoder_repetition_penalty."
    from transformers import GenerationConfig

    knobs = ('temperature', 'top_p', 'min_p', 'repetition_penalty', 'top_k', 'max_new_tokens', 'do_sample', 'dosample')
    return {k: (k[: -len(n)], n) for k in GenerationConfig().to_dict() for n in knobs if k.endswith('_' + n) and k != n}


def test_transformers_keys_are_no_stage(tmp_path, caplog):
    from transformers import GenerationConfig

    keys = transformers_keys_ending_in_a_knob()
    assert 'encoder_repetition_penalty' in keys  # the case at hand; the list itself comes from transformers
    good = {
        'temperature': 1.5,
        'top_p': 0.5,
        'min_p': 0.5,
        'repetition_penalty': 1.3,
        'top_k': 7,
        'max_new_tokens': 9,
        'do_sample': False,
        'dosample': False,
    }
    cfg = {'temperature': 0.5, **{k: good[n] for k, (_, n) in keys.items()}}
    write(tmp_path, cfg)
    gc = GenerationConfig.from_pretrained(tmp_path)
    assert all(getattr(gc, k) == v for k, v in cfg.items())  # transformers reads each as its own setting
    for prefix, _ in keys.values():
        assert load(caplog, tmp_path, prefix=prefix) == ({}, [])  # no stage, and no prefix to misspell
    assert load(caplog, tmp_path) == ({'temperature': 0.5}, [])
    # beside a real stage: that stage reads its keys, and the warning for a prefix that selects nothing lists it alone
    write(tmp_path, {**cfg, 'talker_temperature': 0.7})
    assert load(caplog, tmp_path, prefix='talker')[0] == {'temperature': 0.7}
    out, warns = load(caplog, tmp_path, prefix='encoder')
    assert out == {} and len(warns) == 1 and "the file's prefixes are 'talker_'" in warns[0], warns


# ---- stop ids: generation_config.json, else config.json (transformers' GenerationConfig.from_model_config)


def _without_generation_config(src: Path, dest: Path, **config) -> Path:
    """A copy of checkpoint `src`'s config and tokenizer files, without generation_config.json; `config` overrides
    config.json keys."""
    import shutil

    dest.mkdir()
    for f in src.iterdir():
        if f.suffix == '.json' and f.name != 'generation_config.json' and f.name != 'model.safetensors.index.json':
            shutil.copy(f, dest / f.name)
    if config:
        cfg = json.loads((dest / 'config.json').read_text(encoding='utf-8'))
        (dest / 'config.json').write_text(json.dumps({**cfg, **config}), encoding='utf-8')
    return dest


def _transformers_eos(folder: Path) -> list:
    "The eos ids transformers generates with for `folder` without a generation_config.json."
    from transformers import AutoConfig, GenerationConfig

    eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).eos_token_id
    return [] if eos is None else eos if isinstance(eos, list) else [eos]


@pytest.mark.parametrize('which', ['smollm2', 'whisper'])
def test_no_generation_config_falls_back_to_config_json_as_transformers(tmp_path, which):
    from mstar_utils.checkpoints import whisper_checkpoint
    from mstar_utils.detokenize import TextOutput, generation_eos_ids

    src = smollm2_checkpoint() if which == 'smollm2' else whisper_checkpoint()
    d = _without_generation_config(src, tmp_path / 'plain')
    assert generation_eos_ids(d) == _transformers_eos(d) != []
    two = _without_generation_config(src, tmp_path / 'two', eos_token_id=[2, 0])  # an id only config.json declares
    assert generation_eos_ids(two) == _transformers_eos(two) == [2, 0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(two)
    assert TextOutput.from_checkpoint(two, tokenizer=tok).stop_token_ids == {*_transformers_eos(two), tok.eos_token_id}
    # the file, where there is one, wins, as in from_pretrained: its eos_token_id alone, or none
    (two / 'generation_config.json').write_text('{"eos_token_id": 1}')
    assert generation_eos_ids(two) == [1]
    (two / 'generation_config.json').write_text('{}')
    assert generation_eos_ids(two) == []


def test_config_json_text_config_eos_as_transformers(tmp_path):
    """A composite model's config.json: the top level's eos_token_id, else its text config's (from_model_config on
    the dict and on the config object)."""
    from transformers import GenerationConfig, LlamaConfig, LlavaConfig
    from mstar_utils.detokenize import generation_eos_ids

    LlavaConfig(text_config=LlamaConfig(eos_token_id=7).to_dict()).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / 'config.json').read_text(encoding='utf-8'))
    assert cfg.get('eos_token_id') is None and cfg['text_config']['eos_token_id'] == 7
    assert (
        generation_eos_ids(tmp_path)
        == [GenerationConfig.from_model_config(cfg).eos_token_id]
        == _transformers_eos(tmp_path)
        == [7]
    )
    for variant in (
        {**cfg, 'eos_token_id': [3, 4]},
        {**cfg, 'eos_token_id': None},
        {**cfg, 'text_config': {**cfg['text_config'], 'eos_token_id': None}},
    ):
        (tmp_path / 'config.json').write_text(json.dumps(variant))
        eos = GenerationConfig.from_model_config(variant).eos_token_id
        assert generation_eos_ids(tmp_path) == ([] if eos is None else eos if isinstance(eos, list) else [eos])


@pytest.mark.parametrize('name', ['generation_config.json', 'config.json'])
@pytest.mark.parametrize(
    'content,why',
    [
        (b'\xff\xfe{\x00}\x00', ': not UTF-8 text'),
        (b'{"eos_token_id": 2, "x": "\xe9"}', ': not UTF-8 text'),
        (b'{"eos_token_id": 2', ': not valid JSON'),
        (b'[2]', ': holds a JSON array, expected an object'),
        (b'{"eos_token_id": ' + b'9' * 5000 + b'}', ': not valid JSON'),
    ],
    ids=['utf16', 'latin1', 'cut_short', 'list', '5000_digits'],
)
def test_unreadable_eos_file_is_a_value_error_naming_it(tmp_path, name, content, why):
    from mstar_utils.detokenize import TextOutput, generation_eos_ids

    d = _without_generation_config(smollm2_checkpoint(), tmp_path / 'ckpt')
    (d / name).write_bytes(content)
    with pytest.raises(ValueError, match=why) as e:
        generation_eos_ids(d)
    assert str(d / name) in str(e.value) and not isinstance(e.value, UnicodeDecodeError)
    if name == 'generation_config.json':
        with pytest.raises(ValueError, match=why) as e:
            TextOutput.from_checkpoint(d)
        assert str(d / name) in str(e.value)


def test_config_json_eos_outside_the_vocabulary_names_config_json(tmp_path):
    from mstar_utils.detokenize import TextOutput

    d = _without_generation_config(smollm2_checkpoint(), tmp_path / 'ckpt', eos_token_id=10**6)
    with pytest.raises(ValueError, match=r'config\.json: eos_token_id is 1000000, outside the vocabulary') as e:
        TextOutput.from_checkpoint(d)
    assert 'generation_config.json' not in str(e.value)


def test_ints_for_floats(tmp_path, caplog):
    out, _ = load(caplog, write(tmp_path, {'temperature': 1, 'top_p': 1, 'repetition_penalty': 2}))
    assert out == {'temperature': 1.0, 'top_p': 1.0, 'repetition_penalty': 2.0}
    assert all(type(v) is float for v in out.values())
