"""Fuzzing the parser path of the loaders with hypothesis: safetensors files (8-byte header length, JSON header, data)
and `model.safetensors.index.json` files.

The documented outcomes are success or one of `ValueError`, `KeyError`, `FileNotFoundError` (mstar_utils.loading's
docstrings); anything else is a crash. Each example runs under a 5 s alarm, so a hang fails instead of stalling CI.
The oracle for safetensors files is safetensors itself: a file `safetensors.torch.load_file` reads must load to the
same bytes, and a file it refuses must be refused.
"""

import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import contextlib
import json
import math
import re
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, event, example, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from mstar_utils.loading import ModuleAndPrefix, load_weights_from_file, load_weights_from_hf_shards
from mstar_utils.sources import INDEX_FILE, SINGLE_FILE, read_weight_map

DOCUMENTED = (ValueError, KeyError, FileNotFoundError)
FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@contextlib.contextmanager
def alarm(seconds=5):
    "Turn a hang into a failure (POSIX; elsewhere hypothesis' deadline still flags slow cases)."
    if not hasattr(signal, 'setitimer'):
        yield
        return

    def boom(*_):
        raise TimeoutError(f'no answer within {seconds} s')

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def outcome(fn):
    "fn()'s result, or the documented exception it raised; any other exception propagates and fails the test."
    with alarm():
        try:
            out = fn()
        except DOCUMENTED as e:
            event(f'{type(e).__name__}: ' + re.sub(r"\d+|'[^']*'", '_', str(e).split(": ", 1)[-1])[:40])
            return e
    event('success')
    return out


# ---------------------------------------------------------------- safetensors files

BYTES_PER = {
    'F64': 8,
    'F32': 4,
    'F16': 2,
    'BF16': 2,
    'I64': 8,
    'I32': 4,
    'I16': 2,
    'I8': 1,
    'U8': 1,
    'BOOL': 1,
    'U16': 2,
    'U32': 4,
    'U64': 8,
    'C64': 8,
    'F8_E4M3': 1,
    'F8_E5M2': 1,
    'F8_E8M0': 1,
    'F8_E4M3FNUZ': 1,
    'F8_E5M2FNUZ': 1,
    'F4': 0.5,
    'F6_E2M3': 0.75,
    'F6_E3M2': 0.75,
}
dtypes = st.one_of(st.sampled_from(sorted(BYTES_PER)), st.sampled_from(['I4', 'f32', '', 'F128']), st.text(max_size=4))
small_shapes = st.lists(st.integers(0, 4), max_size=3)
wild_shapes = st.one_of(
    small_shapes,
    st.lists(st.one_of(st.integers(-3, 4), st.integers(2**31, 2**66)), max_size=3),
    st.just('x'),
    st.none(),
    st.lists(st.floats(allow_nan=True), max_size=2),
)
names = st.text('abcdefghij_0123456789', min_size=1, max_size=6).map(lambda s: 't' + s)  # valid buffer names


@st.composite
def safetensors_files(draw):
    "(file bytes, whether the header was built consistent before any damage)."
    keys = draw(st.lists(names, max_size=4, unique=True))
    consistent = draw(st.booleans())
    header, pos, body = {}, 0, b''
    for k in keys:
        dt = draw(dtypes if not consistent else st.sampled_from(sorted(BYTES_PER)))
        shape = draw(small_shapes if consistent else wild_shapes)
        try:
            n = math.ceil(math.prod(shape) * BYTES_PER.get(dt, 1))
        except (TypeError, ValueError, OverflowError):
            n = draw(st.integers(0, 16))
        n = max(n, 0) if consistent else draw(st.one_of(st.just(max(min(n, 64), 0)), st.integers(0, 64)))
        offsets = (
            [pos, pos + n] if consistent or draw(st.booleans()) else draw(st.lists(st.integers(-2, 2**65), max_size=3))
        )
        header[k] = {'dtype': dt, 'shape': shape, 'data_offsets': offsets}
        if consistent or not draw(st.booleans()):
            header[k] = dict(header[k])
        else:
            header[k] = draw(st.sampled_from([dict(header[k], extra=1), [1], None, 'x', {'dtype': dt}]))
        pos += n
        body += draw(st.binary(min_size=n, max_size=n))
    meta = draw(
        st.one_of(
            st.none(),
            st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
            st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2),
            st.just([]),
        )
    )
    if meta is not None:
        header['__metadata__'] = meta
    hb = (
        json.dumps(header).encode()
        if draw(st.booleans())
        else json.dumps(header, ensure_ascii=False, indent=1).encode()
    )
    hb += b' ' * draw(st.integers(0, 8))
    length = (
        len(hb)
        if consistent or draw(st.booleans())
        else draw(st.one_of(st.integers(0, 200), st.integers(0, 2**64 - 1)))
    )
    data = length.to_bytes(8, 'little') + hb + body
    damage = draw(st.sampled_from(['none', 'none', 'truncate', 'flip', 'append', 'junk']))
    if damage == 'truncate' and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == 'flip' and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    elif damage == 'append':
        data += draw(st.binary(min_size=1, max_size=16))
    elif damage == 'junk':
        data = draw(st.binary(max_size=64))
    return data, consistent and damage == 'none'


@pytest.fixture(scope='module')
def workdir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def _module_for(path: Path, materialized: bool) -> nn.Module:
    "A module with one buffer per tensor of the file, of the file's dtype and shape (read with safetensors)."
    m = nn.Module()
    for k, t in load_file(str(path)).items():
        m.register_buffer(
            k, torch.zeros_like(t) if materialized else torch.empty(t.shape, dtype=t.dtype, device='meta')
        )
    return m


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


@FUZZ
@given(f=safetensors_files(), materialized=st.booleans())
@example(f=(b'', False), materialized=False)
@example(f=((2**64 - 1).to_bytes(8, 'little') + b'{}', False), materialized=False)
@example(f=(b'\x02\x00\x00\x00\x00\x00\x00\x00{}', True), materialized=True)
@example(f=((10**5).to_bytes(8, 'little') + b'[' * 10**5, False), materialized=False)
def test_safetensors_file(workdir, f, materialized):
    data, consistent = f
    path = workdir / SINGLE_FILE
    path.write_bytes(data)
    try:
        ref = load_file(str(path))
    except Exception:
        ref = None
    keys = outcome(lambda: read_weight_map(workdir))
    if ref is None:
        assert isinstance(keys, ValueError), f'safetensors refuses this file, mstar_utils read {keys!r}'
        return
    if consistent:
        assert set(ref) == {
            k for k in json.loads(data[8 : 8 + int.from_bytes(data[:8], 'little')]) if k != '__metadata__'
        }
    if isinstance(keys, Exception):  # safetensors reads it: only a dtype that torch lacks may stop us
        assert isinstance(keys, ValueError) and 'no torch dtype' in str(keys), keys
        return
    assert set(keys) == set(ref) and all(p == path for p in keys.values())
    m = _module_for(path, materialized)
    got = outcome(lambda: load_weights_from_file(path, [ModuleAndPrefix(m)]))
    assert not isinstance(got, Exception), got
    assert got == [set(ref)]
    for k, t in ref.items():
        assert _same_bytes(getattr(m, k), t), k


# ---------------------------------------------------------------- index files

SHARD_NAMES = [
    'a.safetensors',
    './a.safetensors',
    'sub/../a.safetensors',
    'missing.safetensors',
    '../a.safetensors',
    '/etc/passwd',
    '',
    '.',
    'sub',
    'a.safetensors\x00',
    'x' * 300,
    '~/a.safetensors',
    'sub/../../a.safetensors',
]
shard_values = st.one_of(
    *[st.sampled_from(SHARD_NAMES)] * 8,
    st.text(max_size=12),
    st.integers(),
    st.none(),
    st.booleans(),
    st.lists(st.sampled_from(SHARD_NAMES), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)


def _obj(pairs) -> str:
    return '{' + ', '.join(f'{json.dumps(k)}: {v}' for k, v in pairs) + '}'


@st.composite
def index_texts(draw, keys):
    "The text of an index file: JSON (whose objects may repeat a key), cut JSON, or junk."
    pairs = draw(st.lists(st.tuples(st.one_of(st.sampled_from(keys), st.text(max_size=4)), shard_values), max_size=6))
    wm = _obj([(k, json.dumps(v)) for k, v in pairs])
    top = [('metadata', json.dumps(draw(json_values)))]
    shape = draw(st.sampled_from(['ok'] * 6 + ['no_weight_map', 'twice', 'list', 'wm_not_object']))
    if shape in ('ok', 'twice'):
        top.append(('weight_map', wm))
    if shape == 'twice':
        top.append(('weight_map', _obj([(k, json.dumps('a.safetensors')) for k in keys])))
    if shape == 'wm_not_object':
        top.append(('weight_map', json.dumps(draw(json_values))))
    text = _obj(top) if shape != 'list' else '[' + wm + ']'
    damage = draw(st.sampled_from(['none'] * 6 + ['cut', 'junk', 'deep']))
    if damage == 'cut' and text:
        text = text[: draw(st.integers(0, len(text) - 1))]
    elif damage == 'junk':
        text = draw(st.text(max_size=40))
    elif damage == 'deep':
        text = '{"weight_map": ' + '[' * draw(st.integers(1000, 100000)) + ']}'
    return text


KEYS = ['w0', 'w1', 'w2']


@pytest.fixture(scope='module')
def repo():
    "A folder with one real shard 'a.safetensors' (three fp32 tensors) and a subfolder."
    with tempfile.TemporaryDirectory() as d:
        d = Path(d) / 'repo'
        (d / 'sub').mkdir(parents=True)
        torch.manual_seed(0)
        save_file({k: torch.randn(2, 3) for k in KEYS}, str(d / 'a.safetensors'))
        save_file({'w0': torch.zeros(1)}, str(d.parent / 'a.safetensors'))  # what a path escaping the folder would find
        yield d


@FUZZ
@given(data=st.data())
def test_index_file(repo, data):
    text = data.draw(index_texts(KEYS))
    (repo / INDEX_FILE).write_text(text, encoding='utf-8', errors='surrogatepass')
    wm = outcome(lambda: read_weight_map(repo))
    if isinstance(wm, KeyError):
        pytest.fail(f'read_weight_map raised KeyError: {wm}')
    if isinstance(wm, Exception):
        return
    root = repo.resolve()
    for k, p in wm.items():  # only files inside the folder
        assert p.is_file() and p.resolve().is_relative_to(root), (k, p)
    parsed = json.loads(text)['weight_map']  # last value wins, as the loader read it
    assert set(wm) == set(parsed)
    m = nn.Module()
    for k in KEYS:
        m.register_buffer(k, torch.empty(2, 3, device='meta'))
    got = outcome(lambda: load_weights_from_hf_shards(repo, [ModuleAndPrefix(m, enforce_missing_keys=False)]))
    if isinstance(got, Exception):
        assert isinstance(got, KeyError) and 'has no tensor' in got.args[0], (
            got
        )  # the index assigns a key to a shard without it
        return
    ref = load_file(str(repo / 'a.safetensors'))
    for k in got[0]:
        assert torch.equal(getattr(m, k), ref[k]), k
