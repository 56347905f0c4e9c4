"Generation defaults from generation_config.json (checked against transformers' GenerationConfig) and base_language."
import json, logging, math, os, tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from mstar_utils.generation import load_generation_defaults, base_language, TOP_K_DISABLED
from mstar_utils.checkpoints import smollm2_checkpoint

LOGGER = 'mstar_utils.generation'


def write(d: Path, cfg) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d/'generation_config.json').write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return d


def load(caplog, *args, **kwargs):
    "load_generation_defaults with its warnings: (result, [messages])."
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = load_generation_defaults(*args, **kwargs)
    return out, [r.getMessage() for r in caplog.records if r.name == LOGGER]


# ---- agreement with transformers

knob_values = st.fixed_dictionaries({}, optional={
    'temperature': st.floats(0.05, 2.0), 'top_p': st.floats(0.05, 1.0), 'top_k': st.integers(1, 500),
    'min_p': st.floats(0.0, 1.0), 'repetition_penalty': st.floats(0.5, 2.0), 'max_new_tokens': st.integers(1, 10**5),
    'max_length': st.integers(1, 10**5)})


@given(knob_values)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_knobs_match_transformers(knobs):
    from transformers import GenerationConfig
    with tempfile.TemporaryDirectory() as d:
        write(Path(d), {'do_sample': True, **knobs})
        gc = GenerationConfig.from_pretrained(d)
        got = load_generation_defaults(d)
    want = {k: getattr(gc, k) for k in ('temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty') if k in knobs}
    if 'max_new_tokens' in knobs: want['max_output_tokens'] = gc.max_new_tokens
    assert got == want
    assert 'max_length' not in got and 'max_new_tokens' not in got
    assert all(type(got[k]) is float for k in ('temperature', 'top_p', 'min_p', 'repetition_penalty') if k in got)


def test_real_checkpoint_declares_no_sampling(caplog):
    from transformers import GenerationConfig
    gc = GenerationConfig.from_pretrained(smollm2_checkpoint())
    declared = gc.to_diff_dict()
    assert not {'temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty', 'max_new_tokens', 'do_sample'} & set(declared)
    assert load(caplog, smollm2_checkpoint()) == ({}, [])


# ---- the contract's rules

def test_greedy(tmp_path, caplog):
    d = write(tmp_path, {'do_sample': False, 'temperature': 0.7, 'top_p': 0.9})
    assert load(caplog, d) == ({'temperature': 0.0, 'top_p': 0.9}, [])
    assert load(caplog, write(tmp_path, {'do_sample': False}))[0] == {'temperature': 0.0}
    assert load(caplog, write(tmp_path, {'do_sample': True, 'temperature': 0.7}))[0] == {'temperature': 0.7}


def test_dosample_spelling_and_prefix(tmp_path, caplog):
    d = write(tmp_path, {'do_sample': True, 'temperature': 0.9, 'top_k': 50, 'max_new_tokens': 8192,
                         'subtalker_dosample': False, 'subtalker_temperature': 0.9, 'subtalker_top_k': 30,
                         'talker_temperature': 0.6, 'talker_max_new_tokens': 100})
    assert load(caplog, d) == ({'temperature': 0.9, 'top_k': 50, 'max_output_tokens': 8192}, [])
    assert load(caplog, d, prefix='subtalker_')[0] == {'temperature': 0.0, 'top_k': 30}
    assert load(caplog, d, prefix='subtalker_', stage='code_predictor_')[0] == \
        {'code_predictor_temperature': 0.0, 'code_predictor_top_k': 30}
    assert load(caplog, d, prefix='talker_', stage='talker_')[0] == {'talker_temperature': 0.6, 'talker_max_output_tokens': 100}
    assert load(caplog, write(tmp_path, {'dosample': False, 'temperature': 1.0}))[0] == {'temperature': 0.0}


def test_no_file_gives_nothing(tmp_path, caplog):
    assert load(caplog, None) == ({}, [])
    assert load(caplog, tmp_path/'missing') == ({}, [])
    assert load(caplog, tmp_path) == ({}, [])
    assert load(caplog, str(tmp_path)) == ({}, [])
    (tmp_path/'weights.bin').write_bytes(b'')
    assert load(caplog, tmp_path/'weights.bin') == ({}, [])     # a file given as the folder: nothing under it


@pytest.mark.parametrize('content,why', [
    ('{"temperature": 0.7,', 'not valid JSON'), ('', 'not valid JSON'), ('[0.7]', 'JSON list'), ('0.7', 'JSON float'),
    (b'{"temperature": 0.7, "x": "\xff"}', 'cannot read')])
def test_broken_file_warns(tmp_path, caplog, content, why):
    f = tmp_path/'generation_config.json'
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    out, warns = load(caplog, tmp_path)
    assert out == {} and len(warns) == 1 and str(f) in warns[0] and why in warns[0], warns


def test_unreadable_file_warns(tmp_path, caplog):
    (tmp_path/'generation_config.json').mkdir()       # there, but not a file one can read
    out, warns = load(caplog, tmp_path)
    assert out == {} and len(warns) == 1 and str(tmp_path/'generation_config.json') in warns[0]



def test_prefix_without_underscore_is_normalized(tmp_path, caplog):
    d = write(tmp_path, {'talker_temperature': 0.6, 'talker_do_sample': False, 'subtalker_top_k': 30, 'top_k': 5})
    assert load(caplog, d, prefix='talker') == load(caplog, d, prefix='talker_') == ({'temperature': 0.0}, [])
    assert load(caplog, d, prefix='subtalker', stage='cp_') == ({'cp_top_k': 30}, [])
    assert load(caplog, d, prefix='') == ({'top_k': 5}, [])
    with pytest.raises(ValueError, match='prefix must be a string'): load_generation_defaults(d, prefix=None)


def test_prefix_that_selects_nothing_names_the_prefixes(tmp_path, caplog):
    d = write(tmp_path, {'temperature': 0.9, 'talker_temperature': 0.6, 'subtalker_dosample': False, 'subtalker_top_k': 30})
    out, warns = load(caplog, d, prefix='sub_talker')
    assert out == {} and len(warns) == 1
    assert "'sub_talker_'" in warns[0] and "'subtalker_', 'talker_'" in warns[0] and str(d/'generation_config.json') in warns[0]
    # no warning where the prefix selects a key, even an invalid one (that one warns on its own), or where the file has no prefixes
    assert load(caplog, d, prefix='talker_') == ({'temperature': 0.6}, [])
    assert load(caplog, write(tmp_path, {'temperature': 0.9}), prefix='talker') == ({}, [])
    out, warns = load(caplog, write(tmp_path, {'talker_temperature': 'hot'}), prefix='talker')
    assert out == {} and len(warns) == 1 and 'talker_temperature' in warns[0]


def test_path_to_the_file_itself(tmp_path, caplog):
    d = write(tmp_path/'ckpt', {'temperature': 0.7, 'max_new_tokens': 10})
    want = ({'temperature': 0.7, 'max_output_tokens': 10}, [])
    assert load(caplog, d/'generation_config.json') == load(caplog, str(d/'generation_config.json')) == load(caplog, d) == want
    (tmp_path/'talker_generation_config.json').write_text(json.dumps({'do_sample': False}))
    assert load(caplog, tmp_path/'talker_generation_config.json') == ({'temperature': 0.0}, [])
    assert load(caplog, tmp_path/'missing'/'generation_config.json') == ({}, [])
    (tmp_path/'bad.json').write_text('{')
    out, warns = load(caplog, tmp_path/'bad.json')
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
        procs = GenerationMixin._get_logits_processor(fake, GenerationConfig.from_pretrained(tmp_path), input_ids_seq_length=1,
            encoder_input_ids=None, prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList())
        return any(isinstance(p, TopKLogitsWarper) for p in procs)
    assert has_top_k(5) and not has_top_k(0)
    assert load_generation_defaults(tmp_path) == {'top_k': TOP_K_DISABLED} and TOP_K_DISABLED == -1


@pytest.mark.parametrize('key,value', [
    ('temperature', '0.7'), ('temperature', True), ('temperature', [0.7]), ('temperature', -0.1), ('temperature', 'NaN'),
    ('top_p', 0), ('top_p', 1.5), ('min_p', -0.1), ('min_p', 2), ('repetition_penalty', 0), ('top_k', 40.0), ('top_k', '40'),
    ('top_k', False), ('max_new_tokens', 0), ('max_new_tokens', 512.0), ('max_new_tokens', '512'), ('do_sample', 'false'),
    ('do_sample', 0)])
def test_wrong_value_warns_and_is_skipped(tmp_path, caplog, key, value):
    good = {'temperature': 0.5, 'top_p': 0.9, 'top_k': 20, 'min_p': 0.05, 'repetition_penalty': 1.1, 'max_new_tokens': 100}
    cfg = {**good, key: value}
    f = tmp_path/'generation_config.json'
    f.write_text(json.dumps(cfg).replace('"NaN"', 'NaN'))
    out, warns = load(caplog, tmp_path)
    want = {('max_output_tokens' if k == 'max_new_tokens' else k): v for k, v in good.items() if k != key}
    assert out == want
    assert len(warns) == 1 and str(f) in warns[0] and key in warns[0], warns


def test_null_is_unset(tmp_path, caplog):
    assert load(caplog, write(tmp_path, {'temperature': None, 'top_k': None, 'do_sample': None, 'top_p': 0.5})) == \
        ({'top_p': 0.5}, [])


def test_ints_for_floats(tmp_path, caplog):
    out, _ = load(caplog, write(tmp_path, {'temperature': 1, 'top_p': 1, 'repetition_penalty': 2}))
    assert out == {'temperature': 1.0, 'top_p': 1.0, 'repetition_penalty': 2.0}
    assert all(type(v) is float for v in out.values())


# ---- base_language

@pytest.mark.parametrize('code', ['en-US', 'en_us', 'EN', ' en ', 'en', 'En-gb', 'en-'])
def test_english(code): assert base_language(code) == 'en'


def test_script_and_region(): assert base_language('zh-Hant-TW') == 'zh'


def test_three_letters_stay(): assert base_language('yue') == 'yue'


@pytest.mark.parametrize('code', ['', ' ', '-US', '_us', '12', 'e', 'x-klingon', 'en1', 'e n', 'über', 'abcdefghi', None, 3])
def test_bad_codes(code):
    with pytest.raises(ValueError, match='language code'): base_language(code)


def test_whisper_languages():
    from transformers.models.whisper.tokenization_whisper import LANGUAGES
    for code in LANGUAGES:
        assert base_language(code) == code
        assert base_language(f' {code.upper()}-Latn_XX ') == code


@given(st.from_regex(r'[A-Za-z]{2,8}', fullmatch=True), st.sampled_from(['-', '_']),
       st.from_regex(r'[A-Za-z0-9]{1,8}([-_][A-Za-z0-9]{1,8}){0,2}', fullmatch=True))
def test_primary_subtag(lang, sep, rest):
    assert base_language(lang + sep + rest) == lang.lower()
    assert base_language(lang) == lang.lower()
