"The loader benchmark's tables are whole: every method has a label and a loader, every target names methods that exist."

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmarks'))
import bench_load as bl  # noqa: E402


@pytest.mark.parametrize('m', bl.METHODS, ids=lambda m: m.name)
def test_method_is_whole(m):
    assert m.label.strip() and callable(m.load), m.name
    assert m.construct is None or callable(m.construct), m.name
    assert m.caches and set(m.caches) <= {'warm', 'cold'}, m.name
    assert m.on and set(m.on) <= {*bl.BIG, bl.MOE_NAME, *bl.SMALL}, m.name
    assert not (m.gpu and 'cold' in m.caches), f'{m.name}: CUDA rows run warm only'
    assert (m.e2e is None) or set(m.e2e) == {'hf', 'mmap', 'call'}, m.name


def test_method_names_are_unique():
    names = [m.name for m in bl.METHODS]
    assert len(names) == len(set(names)) and names == bl.ALL_METHODS


@pytest.mark.parametrize('t', [t for t in bl.TARGETS if isinstance(t, bl.Target)], ids=lambda t: t.name.strip())
def test_target_names_methods(t):
    for name in (t.a, t.b):
        assert name is None or name in bl.METHOD, f'{t.name!r} names {name!r}, which is no method'
    assert t.cache in ('warm', 'cold') and (t.op is None) == (t.limit is None), t.name
    for name in (t.a, t.b):  # a method measured only warm cannot explain a cold line
        assert name is None or t.cache in bl.METHOD[name].caches, f'{t.name!r}: {name!r} does not run {t.cache}'


def test_targets_are_rows_or_functions():
    assert all(isinstance(t, bl.Target) or callable(t) for t in bl.TARGETS)


def test_a_ratio_line_from_a_summary():
    ck = bl.SMOL
    row = dict(ready_s=1.0, load_s=1.0, peak_rss=1.0, rss_x_bytes=1.0, us_per_tensor=1.0)
    summary = [
        dict(row, ckpt=ck, cache='warm', method='ours', gbps=3.0),
        dict(row, ckpt=ck, cache='warm', method='limit-prefaulted', gbps=4.0),
    ]
    got = [t for t in bl.targets(summary, {ck: {}}) if t['target'].startswith('1.')]
    assert got == [
        dict(
            ckpt=ck,
            cache='warm',
            target='1. warm: ours GB/s / readinto per file into pre-faulted memory',
            value=0.75,
            op='>=',
            limit=0.8,
            met=False,
        )
    ]
