#!/usr/bin/env python
"""Long-form Whisper transcription: real-time factor of mstar_utils' `transcribe` against transformers' long-form
`generate` in the same run, and peak RSS growth of a 10-minute input against a 60 s one (fresh processes).

    python benchmarks/bench_speech.py                      # tiny.en and base on long_speech_clip('jfk'), then memory
    python benchmarks/bench_speech.py --models tiny.en --rounds 3 --no_memory
    python benchmarks/bench_speech.py --no_speed          # the memory runs alone (--mem_repeats 3 each length)
    python benchmarks/bench_speech.py --strict             # also exit 1 when a target is missed

Speed: both sides start from the audio file and the same loaded float32 model. transformers' side is what its docs
show for long audio: read the file (`read_audio`), the feature extractor over the whole audio (`truncation=False,
padding='longest'`), then `generate(..., return_timestamps=True, condition_on_prev_tokens=False)`. Ours is
`transcribe(checkpoint, path, model=model)`. Rounds alternate the two and the best round of each is kept, so load
from other processes weighs on both alike; every round checks that the ids are equal. RTF = seconds / audio seconds.

Memory: for 60 s and 600 s inputs (the clip tiled, written as 44.1 kHz stereo so that the file is decoded, mixed down
and resampled block by block), a fresh process loads tiny.en, transcribes a 40 s input made the same way to warm up
(so the long-form path's first-use allocations are paid before either measurement, not by the 60 s run alone), then
transcribes the input while a thread samples RSS every 5 ms; growth = peak RSS - RSS just before. `--mem_repeats` runs
of each length, alternating which goes first, each in its own process; the medians are compared. Held whole, the 600 s
file's float32 samples alone would be 212 MB at 44.1 kHz stereo (38 MB at 16 kHz mono).

Targets: ours <= 1.0x transformers' time, for tiny.en and base; growth(600 s) < 1.2x growth(60 s).
Writes benchmarks/results/speech.json.
"""

from __future__ import annotations
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

from fastcore.script import call_parse, store_true

RESULTS = Path(__file__).resolve().parent / 'results'
SPEED_TARGET = 1.0  # ours at most this fraction of transformers' long-form generate time
MEMORY_TARGET = 1.2  # peak RSS growth of the 10-minute input at most this multiple of the 60 s input's


def _reference(model, fe, path):
    "transformers' long-form generate on the whole file: its ids."
    import torch
    from mstar_utils.speech import read_audio

    inputs = fe(
        read_audio(path),
        sampling_rate=16000,
        truncation=False,
        padding='longest',
        return_attention_mask=True,
        return_tensors='pt',
    )
    with torch.inference_mode():
        return model.generate(**inputs, return_timestamps=True, condition_on_prev_tokens=False)[0].tolist()


def speed(name: str, clip: Path, rounds: int) -> dict:
    "Best-of-`rounds` seconds of ours and transformers' on `clip` with checkpoint `name`."
    import soundfile as sf
    import torch
    from transformers import WhisperFeatureExtractor
    from mstar_utils.checkpoints import whisper_checkpoint
    from mstar_utils.model import load_model
    from mstar_utils.speech import transcribe

    ckpt = whisper_checkpoint(name)
    model, fe = load_model(ckpt, dtype=torch.float32), WhisperFeatureExtractor.from_pretrained(ckpt)
    seconds = sf.info(str(clip)).duration
    best = {'ours': float('inf'), 'transformers': float('inf')}
    for r in range(rounds):
        for side in ('transformers', 'ours') if r % 2 == 0 else ('ours', 'transformers'):
            t = time.perf_counter()
            ids = _reference(model, fe, clip) if side == 'transformers' else transcribe(ckpt, clip, model=model).ids
            best[side] = min(best[side], time.perf_counter() - t)
            if side == 'transformers':
                want = ids
            else:
                got = ids
        if got[: len(want)] != want or len(got) - len(want) > 1:
            raise SystemExit(f'{name}: ids differ from transformers')
    return dict(
        model=name,
        audio_s=round(seconds, 2),
        ours_s=round(best['ours'], 3),
        transformers_s=round(best['transformers'], 3),
        ours_rtf=round(best['ours'] / seconds, 4),
        transformers_rtf=round(best['transformers'] / seconds, 4),
        ratio=round(best['ours'] / best['transformers'], 3),
    )


def _child(path: str, warm: str) -> None:
    "In a fresh process: warm up on `warm`, then print the peak RSS growth (bytes) of transcribing `path`."
    import psutil
    import torch
    from mstar_utils.checkpoints import whisper_checkpoint
    from mstar_utils.model import load_model
    from mstar_utils.speech import transcribe

    ckpt = whisper_checkpoint('tiny.en')
    model = load_model(ckpt, dtype=torch.float32)
    transcribe(ckpt, warm, model=model)
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    before = proc.memory_info().rss
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t = time.perf_counter()
    out = transcribe(ckpt, path, model=model)
    spent = time.perf_counter() - t
    done.set()
    watcher.join()
    print(
        json.dumps(
            dict(growth=max(peak[0], proc.memory_info().rss) - before, seconds=spent, segments=len(out.segments))
        )
    )


def memory(clip: Path, repeats: int = 3) -> dict:
    "Median peak RSS growth of 60 s and 600 s inputs (the clip tiled, 44.1 kHz stereo), each run in a fresh process."
    import statistics
    import numpy as np
    import soundfile as sf
    from scipy.signal import resample_poly
    from mstar_utils.speech import read_audio

    audio, runs = resample_poly(read_audio(clip), 441, 160).astype(np.float32), {60: [], 600: []}
    with tempfile.TemporaryDirectory() as tmp:
        for seconds in (40, 60, 600):
            mono = np.resize(audio, seconds * 44100)
            sf.write(str(Path(tmp) / f'{seconds}s.wav'), np.stack([mono, mono], 1), 44100, subtype='PCM_16')
        for r in range(repeats):
            for seconds in (60, 600) if r % 2 == 0 else (600, 60):
                cmd = [
                    sys.executable,
                    __file__,
                    '--child',
                    str(Path(tmp) / f'{seconds}s.wav'),
                    '--warm',
                    str(Path(tmp) / '40s.wav'),
                ]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode:
                    raise SystemExit(p.stderr[-2000:])
                runs[seconds].append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(f"  run {r + 1}: {seconds} s grew {runs[seconds][-1]['growth'] / 2**20:.1f} MB", flush=True)
    mb = {k: [round(x['growth'] / 2**20, 1) for x in v] for k, v in runs.items()}
    med = {k: statistics.median(x['growth'] for x in v) for k, v in runs.items()}
    return dict(
        growth_60s_mb=round(med[60] / 2**20, 1),
        growth_600s_mb=round(med[600] / 2**20, 1),
        ratio=round(med[600] / max(med[60], 1), 3),
        runs_60s_mb=mb[60],
        runs_600s_mb=mb[600],
        seconds_60s=round(statistics.median(x['seconds'] for x in runs[60]), 1),
        seconds_600s=round(statistics.median(x['seconds'] for x in runs[600]), 1),
    )


@call_parse
def main(
    models: str = 'tiny.en,base',  # checkpoints to time, comma-separated
    clip: str = 'jfk',  # a key of checkpoints.LONG_CLIPS
    rounds: int = 2,  # rounds of both sides; the best of each is kept
    no_memory: store_true = False,  # skip the memory runs
    no_speed: store_true = False,  # skip the timing runs
    mem_repeats: int = 3,  # fresh-process runs of each memory input; the medians are compared
    strict: store_true = False,  # exit 1 when a target is missed
    child: str = None,  # internal: the memory run's fresh process
    warm: str = None,  # internal: the file that process warms up on
):
    "Time long-form transcription against transformers and measure memory growth with the input's length."
    if child:
        return _child(child, warm)
    import torch
    from mstar_utils.checkpoints import long_speech_clip

    path, rows, missed = long_speech_clip(clip), [], []
    print(f'clip {clip}: {path}  torch threads {torch.get_num_threads()}')
    print(f"{'model':8} {'audio s':>8} {'ours s':>8} {'hf s':>8} {'ours RTF':>9} {'hf RTF':>8} {'ours/hf':>8}")
    for name in [] if no_speed else models.split(','):
        r = speed(name, path, rounds)
        rows.append(r)
        print(
            f"{name:8} {r['audio_s']:8.1f} {r['ours_s']:8.2f} {r['transformers_s']:8.2f} {r['ours_rtf']:9.3f} "
            f"{r['transformers_rtf']:8.3f} {r['ratio']:7.3f}x",
            flush=True,
        )
        if r['ratio'] > SPEED_TARGET:
            missed.append(f"{name}: {r['ratio']}x transformers' time")
    mem = None
    if not no_memory:
        mem = memory(path, mem_repeats)
        print(
            f"peak RSS growth, median of {mem_repeats}: 60 s {mem['growth_60s_mb']} MB {mem['runs_60s_mb']}, "
            f"600 s {mem['growth_600s_mb']} MB {mem['runs_600s_mb']}, ratio {mem['ratio']}x "
            f"(target < {MEMORY_TARGET}x; {mem['seconds_600s']} s for 600 s)"
        )
        if mem['ratio'] >= MEMORY_TARGET:
            missed.append(f"memory growth {mem['ratio']}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / 'speech.json').write_text(
        json.dumps(
            dict(machine=platform.machine(), cpus=os.cpu_count(), clip=clip, speed=rows, memory=mem, missed=missed),
            indent=2,
        )
    )
    print('targets met' if not missed else 'missed: ' + '; '.join(missed))
    if strict and missed:
        sys.exit(1)
