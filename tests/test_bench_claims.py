"""The benchmarks page states the loader's speed, in its opening summary, as the published benchmark measured it: every
figure there is recomputed from benchmarks/load_results.json."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = json.loads((ROOT / 'benchmarks' / 'load_results.json').read_text(encoding='utf-8'))
LINE = next(
    ''.join(c['source'])
    for c in json.loads((ROOT / 'nbs' / '13_benchmarks.ipynb').read_text(encoding='utf-8'))['cells']
    if c['cell_type'] == 'markdown' and ''.join(c['source']).startswith('**In short.**')
)
BIG, MOE = ('SmolLM2-135M', 'Llama-synth-1.1B'), 'qwen3-moe-64x8-bf16'


def target(ck, cache, text):
    return next(t['value'] for t in RES['targets'] if t['ckpt'] == ck and t['cache'] == cache and text in t['target'])


def span(values, digits=2):
    return f'{min(values):.{digits}f}–{max(values):.{digits}f}'


def test_per_tensor_and_its_anchor():
    us = target('many-16x16-fp32', 'warm', 'us per tensor')
    x = target('many-16x16-fp32', 'warm', 'load_state_dict(assign) time / ours')
    assert f'{us:.1f} µs per tensor' in LINE and f'{x:.0f}× faster' in LINE, LINE


def test_end_to_end_against_from_pretrained():
    warm = [target(ck, 'warm', '6. warm: load_model / from_pretrained') for ck in BIG]
    mmap = [target(ck, 'warm', '6. warm: load_model(mmap=True) / from_pretrained') for ck in BIG]
    cold = [target(ck, 'cold', '6. cold: load_model / from_pretrained') for ck in BIG]
    moe = target(MOE, 'warm', '6. warm: load_model / from_pretrained')
    assert f'{span(warm)}× the time of `from_pretrained`' in LINE and f'({span(mmap)}× with `mmap=True`)' in LINE, LINE
    assert f'{span(cold)}× from a cold page cache' in LINE and f'{moe:.2f}× on a 64-expert MoE' in LINE, LINE


def test_peers_and_memory():
    runai = [target(ck, c, '8. raw loader: runai ready time') for ck in BIG for c in ('warm', 'cold')]
    fst = [target(ck, c, '8. raw loader: fastsafetensors ready time') for ck in BIG for c in ('warm', 'cold')]
    clone = [target(ck, c, '8. raw loader: load_file + clone ready time') for ck in BIG for c in ('warm', 'cold')]
    assert (
        f'{span(runai)}× faster than the Run:ai model streamer' in LINE
        and f'{span(fst)}× faster than fastsafetensors' in LINE
    ), LINE
    assert f'`load_file` plus a clone takes {span(clone)}× its time' in LINE, LINE
    rss = [target(ck, c, '7. load_model peak RSS above baseline') for ck in (*BIG, MOE) for c in ('warm', 'cold')]
    assert f'peak RSS above baseline is {span(rss)}× the checkpoint' in LINE, LINE


def test_gpu_figures_said_unmeasured_only_when_they_are():
    measured = any(t['target'].strip().startswith('5.') for t in RES['targets'])
    assert ('unmeasured' in LINE) == (not measured)
