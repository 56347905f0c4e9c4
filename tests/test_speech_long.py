"""Long-form Whisper transcription against transformers' long-form generate on the same checkpoint and file: token ids,
segment times and words; fine-tunes without the timestamp config; language and task. tiny.en on the JFK clip runs
always; whisper-base and the Piper voice clip run with MSTAR_UTILS_SLOW=1."""

import json
import os
import subprocess
import warnings
import numpy as np
import pytest
import soundfile as sf
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from mstar_utils import checkpoints as ck
from mstar_utils.model import load_model

from conftest import CLI
from mstar_utils.speech import (
    Language,
    Segment,
    audio_blocks,
    read_audio,
    transcribe,
    transcribe_events,
    transcribe_stream,
    whisper_decoding_config,
)

SLOW = pytest.mark.skipif(
    not os.environ.get('MSTAR_UTILS_SLOW'), reason='set MSTAR_UTILS_SLOW=1 (whisper-base, Piper voice clip)'
)
CLIPS = ['jfk', pytest.param('meeting', marks=SLOW)]
MODELS = ['tiny.en', pytest.param('base', marks=SLOW)]
_models: dict = {}


def _model(name):
    if name not in _models:
        _models[name] = load_model(ck.whisper_checkpoint(name), dtype=torch.float32)
    return _models[name]


_refs: dict = {}


def _ours(name, clip):
    "transcribe() of a long clip, computed once per session."
    if (name, clip) not in _refs:
        _refs[name, clip] = transcribe(ck.whisper_checkpoint(name), ck.long_speech_clip(clip), model=_model(name))
    return _refs[name, clip]


def _reference(name, path, **kw):
    "transformers' long-form generate on the whole file's features: (ids, [(start, end)], [segment words])."
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    ckpt = ck.whisper_checkpoint(name)
    fe, tok = WhisperFeatureExtractor.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    inputs = fe(
        read_audio(path),
        sampling_rate=16000,
        truncation=False,
        padding='longest',
        return_attention_mask=True,
        return_tensors='pt',
    )
    with torch.inference_mode():
        out = _model(name).generate(
            **inputs, return_timestamps=True, condition_on_prev_tokens=False, return_segments=True, **kw
        )
    segs = out['segments'][0]
    return (
        out['sequences'][0].tolist(),
        [(float(s['start']), float(s['end'])) for s in segs],
        [tok.decode(s['tokens'], skip_special_tokens=True) for s in segs],
    )


@pytest.mark.parametrize('clip', CLIPS)
def test_clips_are_what_they_claim(clip):
    info = sf.info(str(ck.long_speech_clip(clip)))
    assert (info.samplerate, info.channels, info.subtype) == (16000, 1, 'PCM_16')
    assert 60 <= info.duration <= 120
    audio = read_audio(ck.long_speech_clip(clip))
    quiet = np.abs(audio) < 0.02
    assert 0.05 < quiet.mean() < 0.6 and np.abs(audio).max() > 0.3  # pauses and speech both there
    assert (audio != 0).mean() > 0.99  # noise: no stretch of digital silence


@pytest.mark.parametrize('name', MODELS)
@pytest.mark.parametrize('clip', CLIPS)
def test_long_form_equals_transformers(name, clip):
    "Token ids, segment times and segment words equal transformers' long-form generate (greedy, no conditioning)."
    path = ck.long_speech_clip(clip)
    got = _ours(name, clip)
    ids, times, words = _reference(name, path)
    eos = _model(name).generation_config.eos_token_id
    assert got.ids == ids + [eos]
    assert [(s.start, s.end) for s in got.segments] == times
    assert [s.text for s in got.segments] == words
    assert len(got.segments) >= 5 and got.segments[-1].end > 50
    if clip == 'jfk':
        assert got.text.lower().count('what your country can do for you') >= 4


def test_events_stream_before_the_end():
    "Bytes come before the first segment record, and the first segment closes long before the last window is decoded."
    ckpt, path = ck.whisper_checkpoint('tiny.en'), ck.long_speech_clip('jfk')
    it = transcribe_events(ckpt, path, model=_model('tiny.en'))
    first = []
    for ev in it:
        first.append(ev)
        if isinstance(ev, Segment):
            break
    it.close()
    assert isinstance(first[0], bytes) and first[-1].end < 30 and first[-1].text.strip()


def test_audio_blocks_equal_read_audio(tmp_path):
    from mstar_utils.testing import jfk_resampled

    for rate, channels in ((44100, 2), (8000, 1), (48000, 1)):
        path = jfk_resampled(tmp_path, rate, channels, f'j{rate}.flac')
        whole = read_audio(path)
        for seconds in (0.3, 4.0):
            assert np.array_equal(np.concatenate(list(audio_blocks(path, seconds=seconds))), whole)


@SLOW
def test_resampled_long_file_equals_transformers_on_its_samples(tmp_path):
    "A 44.1 kHz stereo long file: read in blocks; the transcript equals generate on read_audio's samples."
    from scipy.signal import resample_poly

    audio = read_audio(ck.long_speech_clip('jfk'))
    up = resample_poly(audio, 441, 160).astype(np.float32)
    sf.write(tmp_path / 'long44.flac', np.stack([up, up], 1), 44100)
    got = transcribe(ck.whisper_checkpoint('tiny.en'), tmp_path / 'long44.flac', model=_model('tiny.en'))
    ids, times, _ = _reference('tiny.en', tmp_path / 'long44.flac')
    assert got.ids[:-1] == ids and [(s.start, s.end) for s in got.segments] == times


# ---------------------------------------------------------------- edges of the input


def _edge_audio(case):
    "The samples of an edge case, from the real clips: a cut of speech, or digital silence."
    kind, seconds = case.rsplit('-', 1)
    n = round(float(seconds[:-1]) * 16000)
    if kind == 'silence':
        return np.zeros(n, np.float32)
    return read_audio(ck.jfk_audio() if n < 16000 else ck.long_speech_clip('jfk'))[:n]


@pytest.mark.parametrize(
    'case',
    [
        'speech-0.5s',
        'silence-5s',
        pytest.param('speech-60.0s', marks=SLOW),
        pytest.param('silence-60.0s', marks=SLOW),
        pytest.param('speech-45.7s', marks=SLOW),
    ],
)
def test_edge_audio_equals_transformers(tmp_path, case):
    """Under 1 s, all silence, exactly two windows (60.0 s), cut inside the segment spoken from 39.0 s to 47.6 s: ids
    and segment times equal generate's. A window or less goes to generate's short form (the features padded to 30 s)."""
    from transformers import WhisperFeatureExtractor

    audio, model = _edge_audio(case), _model('tiny.en')
    path, eos = tmp_path / f'{case}.wav', model.generation_config.eos_token_id
    sf.write(path, audio, 16000, subtype='FLOAT')
    got = transcribe(ck.whisper_checkpoint('tiny.en'), path, model=model, return_timestamps=True)
    if len(audio) > 480000:
        ids, times, _ = _reference('tiny.en', path)
    else:
        fe = WhisperFeatureExtractor.from_pretrained(ck.whisper_checkpoint('tiny.en'))
        with torch.inference_mode():
            out = model.generate(
                fe(audio, sampling_rate=16000, return_tensors='pt').input_features,
                return_timestamps=True,
                return_segments=True,
            )
        ids, times = out['sequences'][0].tolist(), [(float(s['start']), float(s['end'])) for s in out['segments'][0]]
        # without timestamps the ids are generate's; the one segment ends at the audio's end, where generate's ends
        # at the window's (30 s): we know the audio's length, and a client wants no segment past it
        plain = transcribe(ck.whisper_checkpoint('tiny.en'), path, model=model)
        with torch.inference_mode():
            assert plain.ids == model.generate(fe(audio, sampling_rate=16000, return_tensors='pt').input_features)[
                0
            ].tolist() + [eos]
        assert [(s.start, s.end) for s in plain.segments] == [(0.0, len(audio) / 16000)]
    assert got.ids == ids + [eos] and [(s.start, s.end) for s in got.segments] == times


# ---------------------------------------------------------------- fine-tunes without the timestamp config


def _fine_tune(tmp_path, name, drop):
    import shutil

    src = ck.whisper_checkpoint(name)
    dest = tmp_path / f'{name}-ft-{"bare" if drop is None else "stripped"}'
    shutil.copytree(src, dest)
    if drop is None:
        (dest / 'generation_config.json').unlink()
    else:
        gen = json.loads((src / 'generation_config.json').read_text())
        (dest / 'generation_config.json').write_text(json.dumps({k: v for k, v in gen.items() if k not in drop}))
    return dest


STRIPPED = {
    'no_timestamps_token_id',
    'is_multilingual',
    'lang_to_id',
    'task_to_id',
    'max_initial_timestamp_index',
    'task',
}


@pytest.mark.parametrize('drop', [None, STRIPPED], ids=['no-generation-config', 'stripped'])
def test_fine_tune_transcribes_jfk_as_transformers(tmp_path, drop):
    """tiny.en saved without generation_config.json, or with one stripped of the timestamp keys: JFK as transformers
    transcribes it."""
    from mstar_utils.speech import log_mel

    ft, model = _fine_tune(tmp_path, 'tiny.en', drop), _model('tiny.en')
    features = log_mel(ft, read_audio(ck.jfk_audio()))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        plain = transcribe(ft, ck.jfk_audio(), model=model)
        stamped = transcribe(ft, ck.jfk_audio(), model=model, return_timestamps=True)
    derived = [str(w.message) for w in said if 'derived' in str(w.message)]
    assert len(derived) == 1 and 'no_timestamps_token_id=50362' in derived[0]
    with torch.inference_mode():
        assert plain.ids == model.generate(features)[0].tolist() + [50256]
        want = model.generate(features, return_timestamps=True, return_segments=True)
    assert stamped.ids == want['sequences'][0].tolist() + [50256]
    assert [(s.start, s.end) for s in stamped.segments] == [
        (float(s['start']), float(s['end'])) for s in want['segments'][0]
    ]
    assert 'ask not what your country can do for you' in plain.text
    # what we derived is what the original config says
    from transformers import GenerationConfig

    orig, ours = (
        GenerationConfig.from_pretrained(ck.whisper_checkpoint('tiny.en')),
        whisper_decoding_config(ft, warn=False),
    )
    for k in (
        'decoder_start_token_id',
        'eos_token_id',
        'no_timestamps_token_id',
        'is_multilingual',
        'max_initial_timestamp_index',
        'suppress_tokens',
        'begin_suppress_tokens',
    ):
        assert getattr(ours, k) == getattr(orig, k), k


@pytest.mark.parametrize('name', MODELS)
def test_stripped_fine_tune_decodes_as_transformers_with_the_derived_config(tmp_path, name):
    """A fine-tune whose generation_config.json lost its timestamp, language and task keys: our ids equal transformers'
    `generate` given the config we derive, and equal the original checkpoint's."""
    from transformers import GenerationConfig
    from mstar_utils.speech import log_mel

    ft, model = _fine_tune(tmp_path, name, STRIPPED), _model(name)
    features = log_mel(ft, read_audio(ck.jfk_audio()))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        ours, derived = transcribe(ft, ck.jfk_audio(), model=model), whisper_decoding_config(ft, warn=False)
    orig = GenerationConfig.from_pretrained(ck.whisper_checkpoint(name))
    assert getattr(derived, 'task', None) == getattr(orig, 'task', None)  # base: 'transcribe'; tiny.en: none
    eos = orig.eos_token_id
    with torch.inference_mode():
        assert ours.ids == model.generate(features, generation_config=derived)[0].tolist() + [eos]
        assert ours.ids == model.generate(features, generation_config=orig)[0].tolist() + [eos]
    assert 'ask not what your country can do for you, ask what' in ours.text.lower()


@SLOW
def test_multilingual_fine_tune_derives_languages_and_tasks(tmp_path):
    from transformers import GenerationConfig

    ft = _fine_tune(tmp_path, 'base', STRIPPED)
    orig = GenerationConfig.from_pretrained(ck.whisper_checkpoint('base'))
    with pytest.warns(UserWarning, match='lang_to_id .99 language tokens.'):
        ours = whisper_decoding_config(ft)
    assert ours.lang_to_id == orig.lang_to_id and ours.task_to_id == orig.task_to_id and ours.is_multilingual
    got = transcribe(ft, ck.jfk_audio(), model=_model('base'), task='translate', language='en')
    ref = transcribe(
        ck.whisper_checkpoint('base'), ck.jfk_audio(), model=_model('base'), task='translate', language='en'
    )
    assert got == ref


def test_fine_tune_refusals(tmp_path):
    import shutil

    ft = _fine_tune(tmp_path, 'tiny.en', None)
    for f in ('tokenizer.json', 'tokenizer_config.json'):
        shutil.copy(ck.tokenizer_folder('gpt2') / f, ft / f)
    with pytest.raises(
        ValueError,
        match=r'tiny.en-ft-bare/generation_config.json \(absent\) has no no_timestamps_token_id and its '
        r'tokenizer has no <\|notimestamps\|> token',
    ):
        next(transcribe_stream(ft, ck.jfk_audio(), model=_model('tiny.en')))


# ---------------------------------------------------------------- language and task


def test_english_only_refuses_translate_and_other_languages():
    ckpt, model = ck.whisper_checkpoint('tiny.en'), _model('tiny.en')
    with pytest.raises(ValueError, match="task='translate': whisper-tiny.en is an English-only Whisper"):
        next(transcribe_stream(ckpt, ck.jfk_audio(), model=model, task='translate'))
    with pytest.raises(ValueError, match="language='de': whisper-tiny.en is an English-only Whisper"):
        next(transcribe_stream(ckpt, ck.jfk_audio(), model=model, language='de'))
    with pytest.raises(ValueError, match='num_beams: transcription is greedy'):
        next(transcribe_stream(ckpt, ck.jfk_audio(), model=model, num_beams=2))
    assert (
        transcribe(ckpt, ck.jfk_audio(), model=model, language='en').ids
        == transcribe(ckpt, ck.jfk_audio(), model=model).ids
    )


@SLOW
def test_base_detects_language_as_transformers():
    from mstar_utils.speech import _features
    from transformers import WhisperFeatureExtractor

    ckpt, model = ck.whisper_checkpoint('base'), _model('base')
    got = next(e for e in transcribe_events(ckpt, ck.long_speech_clip('jfk'), model=model) if isinstance(e, Language))
    first = _features(ck.long_speech_clip('jfk'), WhisperFeatureExtractor.from_pretrained(ckpt))[1](0, 3000)
    gc = model.generation_config
    assert gc.lang_to_id[f'<|{got.code}|>'] == int(model.detect_language(first)[0]) and got.code == 'en'
    assert 0.5 < got.probability <= 1


@SLOW
@pytest.mark.parametrize(
    'options', [dict(task='translate'), dict(language='de'), dict(language='french', task='transcribe')]
)
def test_base_language_and_task_equal_transformers(options):
    ckpt, path = ck.whisper_checkpoint('base'), ck.long_speech_clip('jfk')
    got = transcribe(ckpt, path, model=_model('base'), **options)
    ids, times, _ = _reference('base', path, **options)
    assert got.ids == ids + [_model('base').generation_config.eos_token_id] or got.ids == ids
    assert [(s.start, s.end) for s in got.segments] == times


# ---------------------------------------------------------------- the decoding rules and the per-process cache


def _histories(tb: int, eos: int, n: int, seed: int):
    "`n` random id histories after the prompt: text ids and timestamps mixed, so that each timestamp rule is reached."
    rng = np.random.default_rng(seed)
    for k in range(n):
        yield [
            int(tb + rng.integers(0, 1501)) if rng.random() < 0.4 else int(rng.integers(0, eos)) for _ in range(k % 9)
        ]


@pytest.mark.parametrize('timestamps', [False, True])
def test_rules_equal_transformers_processors(timestamps):
    "Our logits rules mask what transformers' Whisper processors mask, in the order generate lists them."
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )
    from mstar_utils.speech import _prompt, _Rules

    ckpt = ck.whisper_checkpoint('tiny.en')
    gc, vocab = whisper_decoding_config(ckpt), _model('tiny.en').config.vocab_size
    prompt, _ = _prompt(gc, ckpt.name, None, None, timestamps=timestamps)
    hf = [
        SuppressTokensAtBeginLogitsProcessor(gc.begin_suppress_tokens, begin_index=len(prompt)),
        SuppressTokensLogitsProcessor(gc.suppress_tokens),
    ]
    hf = LogitsProcessorList(
        hf + ([WhisperTimeStampLogitsProcessor(gc, begin_index=len(prompt))] if timestamps else [])
    )
    ours, g, tb = _Rules(gc, timestamps, vocab), torch.Generator().manual_seed(0), gc.no_timestamps_token_id + 1
    fired = set()
    for k, toks in enumerate(_histories(tb, gc.eos_token_id, 120, seed=int(timestamps))):
        raw = torch.randn(1, vocab, generator=g) * 3
        raw[:, tb:] += (k % 3 - 1) * 4.0  # timestamps unlikely, even, likely: the log-probability rule both ways
        want = hf(torch.tensor([prompt + toks]), raw.clone())
        assert torch.equal(ours(raw.clone(), toks), want), (toks, k)
        fired.add(bool(torch.isinf(want[0, :tb]).all()))
    assert fired == ({True, False} if timestamps else {False})


def test_cached_rebuilds_when_a_file_changes(tmp_path):
    from mstar_utils.speech import _cached

    (tmp_path / 'config.json').write_text('{}')
    built = []

    def build():
        built.append(len(built))
        return len(built)

    assert [_cached(tmp_path, 'k', build), _cached(tmp_path, 'k', build), _cached(tmp_path, 'j', build)] == [1, 1, 2]
    (tmp_path / 'config.json').write_text('{"a": 1}')  # a new size
    assert _cached(tmp_path, 'k', build) == 3
    os.utime(tmp_path / 'config.json', ns=(10**9, 10**9))  # a new mtime, the same size
    assert _cached(tmp_path, 'k', build) == 4
    (tmp_path / 'tokenizer.json').write_text('{}')  # a new file
    assert _cached(tmp_path, 'k', build) == 5 and _cached(tmp_path, 'k', build) == 5


def test_second_transcription_reuses_the_tokenizer(monkeypatch):
    "A second call on the same folder loads no tokenizer, and still decodes generate's ids."
    import transformers
    from mstar_utils.speech import log_mel

    ckpt, model = ck.whisper_checkpoint('tiny.en'), _model('tiny.en')
    transcribe(ckpt, ck.jfk_audio(), model=model)

    def refuse(*a, **k):
        raise AssertionError('the tokenizer was loaded again')

    monkeypatch.setattr(transformers.AutoTokenizer, 'from_pretrained', refuse)
    got = transcribe(ckpt, ck.jfk_audio(), model=model)
    with torch.inference_mode():
        want = model.generate(log_mel(ckpt, read_audio(ck.jfk_audio())))[0].tolist()
    assert got.ids == want + [model.generation_config.eos_token_id]


# ---------------------------------------------------------------- the command line


def test_inspect_audio_long_clip_json(tmp_path):
    path = ck.long_speech_clip('jfk')
    env = {**os.environ, 'HF_HUB_OFFLINE': '1'}
    r = subprocess.run(
        [CLI, 'inspect', str(ck.whisper_checkpoint('tiny.en')), '--audio', str(path), '--json'],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    want = _ours('tiny.en', 'jfk')
    assert doc['segments'] == [{'start': s.start, 'end': s.end, 'text': s.text} for s in want.segments]
    assert doc['text'] == want.text == doc['transcription']['text']
