"Checkpoint materialization: cache hits, checksum refusal, clear errors. Runs on the real pinned packages."
import json, shutil, time
from pathlib import Path

import pytest
from mstar_utils import checkpoints as ck


def test_cache_hit_is_fast():
    ck.smollm2_checkpoint()  # may build the first time
    t0 = time.perf_counter(); p = ck.smollm2_checkpoint(); dt = time.perf_counter() - t0
    assert dt < 1.0, dt
    index = json.loads((p/'model.safetensors.index.json').read_text())
    assert len(set(index['weight_map'].values())) >= 3
    for f in ('config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
        assert (p/f).exists(), f


def test_minilm_is_single_file():
    p = ck.minilm_checkpoint()
    assert (p/'model.safetensors').exists() and not (p/'model.safetensors.index.json').exists()


def test_checksum_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv('MSTAR_UTILS_CACHE', str(tmp_path))
    good = ck.PACKAGES['dashscope']
    # a file in downloads/ with the wrong bytes is not trusted, and a pin whose hash the registry's file does not match fails loudly
    (tmp_path/'downloads').mkdir()
    (tmp_path/'downloads'/good.filename).write_bytes(b'not a wheel')
    monkeypatch.setitem(ck.PACKAGES, 'dashscope', ck.RegistryFile(good.name, good.version, good.filename, '0'*64))
    with pytest.raises(ck.FetchError, match=r'dashscope-2\.0\.2-py3-none-any\.whl.*expected 0{64}'):
        ck.fetch_package('dashscope')


def test_unknown_names():
    with pytest.raises(KeyError, match='unknown package'): ck.fetch_package('nope')
    with pytest.raises(KeyError, match='unknown tokenizer'): ck.tokenizer_folder('nope')


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
