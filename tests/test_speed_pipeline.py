"""The fast read path: chunk packing, the reader threads, the staging ring and its copier, checked for correctness on
the CPU.

`read_many` hands a load's tensors to the reader engine (mstar_utils.io), which packs them into chunks of contiguous
file runs (`plan_chunks`), reads them on threads, and sends
destinations of another dtype or device through a ring of staging buffers whose only device-specific step is the copier.
Here the copier is `HostCopier` (or a recording subclass of it), so every rule of the GPU pipeline runs on the CPU:
bytes land exactly, casts match torch's, a buffer is refilled only after its copies, host staging stays bounded, no
tensor is ever whole in staging memory, and errors in a reader thread surface and stop the rest. The CUDA tests at the
end run only with a GPU (tools/gpu-check). Nothing here is timed; speed is in benchmarks/bench_load.py.
"""

import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import gc
import json
import struct
import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import ctypes
from mstar_utils import io as mio, sources
from mstar_utils.checkpoints import smollm2_checkpoint
from mstar_utils.loading import ModuleAndPrefix, check_loaded, load_weights_from_file, load_weights_from_hf_shards
from mstar_utils.model import build_on_meta
from mstar_utils.io import HostCopier, Reads
from mstar_utils.sources import checkpoint_source, file_source, read_weight_map
from mstar_utils.testing import assert_state_dict_equal


@pytest.fixture(scope='module')
def ref(smol_ckpt) -> dict:
    "SmolLM2's tensors as safetensors reads them (the reference reader)."
    out = {}
    for shard in sorted(set(read_weight_map(smol_ckpt).values())):
        out.update(load_file(str(shard)))
    return out


def _spans(src, keys):
    return [
        mio.Span(src.info(k)[0], src.info(k)[1] + src.info(k)[2].begin, src.info(k)[2].end - src.info(k)[2].begin)
        for k in keys
    ]


# ---------------------------------------------------------------- chunk packing


@st.composite
def file_spans(draw):
    "Tensors laid out back to back, with gaps, in up to 3 files, listed in random order."
    spans = []
    for f in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, 64))
        for _ in range(draw(st.integers(0, 12))):
            isz = draw(st.sampled_from([1, 2, 4, 8]))
            n = isz * draw(st.integers(0, 300))
            pos += isz * draw(st.sampled_from([0, 0, 0, 1, 5]))  # mostly contiguous, sometimes a gap
            spans.append((f'file{f}', pos, n))
            pos += n
    return draw(st.permutations(spans))


@settings(max_examples=200, deadline=None)
@given(spans=file_spans(), cap=st.sampled_from([64, 100, 256, 1000, 1 << 20]))
def test_chunks_cover_every_byte_once_in_file_order(spans, cap):
    chunks = mio.plan_chunks(spans, cap)
    covered = {i: [] for i in range(len(spans))}
    last = None
    for chunk in chunks:
        assert chunk and len({seg.file for seg in chunk}) == 1  # one file per chunk, never empty
        end = 0
        for path, pos, start, n, parts in chunk:
            assert start >= end and start + n <= cap and start % 16 == pos % 16  # in the buffer, aligned as in the file
            end, at_file = start + n, pos
            for i, at, m in parts:
                assert spans[i][0] == path and spans[i][1] + at == at_file and m > 0  # contiguous in the file
                assert at % 16 == 0 or at == 0  # split only between elements
                assert last is None or (path, at_file) > last  # file then offset order
                last = (path, at_file)
                covered[i].append((at, m))
                at_file += m
            assert at_file == pos + n
    for i, (_, _, n) in enumerate(spans):
        parts = sorted(covered[i])
        assert sum(m for _, m in parts) == n and all(
            a + m == b for (a, m), (b, _) in zip(parts, parts[1:], strict=False)
        )


# ---------------------------------------------------------------- direct reads


@pytest.mark.parametrize('threads', [1, 2, 5])
def test_direct_reads_match_safetensors(smol_ckpt, ref, threads):
    src = checkpoint_source(smol_ckpt, threads=threads)
    keys = sorted(src.keys())
    dests = [torch.empty(src.shape(k), dtype=src.dtype(k)) for k in keys]
    seen = []
    src.read_many(list(zip(keys, dests, strict=True)), progress=lambda b, n: seen.append((b, n)))
    src.close()
    assert_state_dict_equal(dict(zip(keys, dests, strict=True)), ref)
    assert sum(n for _, n in seen) == len(keys)
    assert sum(b for b, _ in seen) == sum(t.numel() * t.element_size() for t in ref.values())


def test_direct_reads_run_on_the_reader_threads(smol_ckpt, monkeypatch):
    "With 3 threads and chunks of several files, reads happen off the calling thread and on more than one thread."
    real, names = mio.read_at, set()

    def spy(fd, views, pos, disk=None):
        names.add(threading.current_thread().name)
        return real(fd, views, pos, disk)

    monkeypatch.setattr(mio, 'read_at', spy)
    src = checkpoint_source(smol_ckpt, threads=3)
    keys = list(src.keys())
    src.read_many([(k, torch.empty(src.shape(k), dtype=src.dtype(k))) for k in keys])
    src.close()
    assert threading.current_thread().name not in names and len(names) > 1, names


def test_large_parts_are_populated_before_their_read_and_small_ones_are_not(smol_ckpt, ref, monkeypatch):
    """Every part of 256 KiB or more is populated in the reader thread, for exactly its destination bytes, before the
    preadv that fills it."""
    real_pop, real_read, log = mio.populate_pages, mio.read_at, []

    def pop(addr, n):
        log.append(('pop', threading.current_thread().name, addr, n))
        return real_pop(addr, n)

    def read(fd, views, pos, disk=None):
        log.append(('read', threading.current_thread().name, views))
        return real_read(fd, views, pos, disk)

    monkeypatch.setattr(mio, 'populate_pages', pop)
    monkeypatch.setattr(mio, 'read_at', read)
    src = checkpoint_source(smol_ckpt, threads=2)
    keys = sorted(src.keys())
    dests = {k: torch.empty(src.shape(k), dtype=src.dtype(k)) for k in keys}
    src.read_many(list(dests.items()))
    src.close()
    assert_state_dict_equal(dests, ref)
    spans = {(d.data_ptr(), d.data_ptr() + d.numel() * d.element_size()) for d in dests.values()}
    pops = [e for e in log if e[0] == 'pop']
    assert pops and all(e[3] >= mio._POPULATE_MIN for e in pops)
    assert all(any(lo <= e[2] and e[2] + e[3] <= hi for lo, hi in spans) for e in pops)  # inside one destination
    plan = mio.plan_chunks(
        [
            (src.info(k)[0], src.info(k)[1] + src.info(k)[2].begin, src.info(k)[2].end - src.info(k)[2].begin)
            for k in keys
        ],
        8 << 20,
    )
    large = [n for c in plan for seg in c for _, _, n in seg.parts if n >= mio._POPULATE_MIN]
    assert sorted(e[3] for e in pops) == sorted(
        large
    )  # one call per large part (a tensor split over chunks is several parts)
    for i, e in enumerate(log):  # each populate is followed, on its thread, by the read into it
        if e[0] != 'pop':
            continue
        nxt = next(x for x in log[i + 1 :] if x[1] == e[1] and x[0] == 'read')
        assert any(
            ctypes.addressof(ctypes.c_char.from_buffer(v))
            <= e[2]
            < ctypes.addressof(ctypes.c_char.from_buffer(v)) + len(v)
            for v in nxt[2]
        )


def test_populate_faults_in_fresh_pages_without_writing():
    "On fresh anonymous memory, the whole pages inside the range become resident (mincore) and read as zeros."
    import ctypes
    import mmap

    if not mio._populating:
        pytest.skip('kernel without MADV_POPULATE_WRITE (Linux < 5.14)')
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 32 * page)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def resident():
        vec = (ctypes.c_ubyte * 32)()
        assert libc.mincore(addr, 32 * page, vec) == 0
        return [v & 1 for v in vec]

    assert resident() == [0] * 32
    assert mio.populate_pages(addr + 3 * page - 1, 10 * page)  # pages 3..11 lie wholly inside
    assert resident() == [0] * 3 + [1] * 9 + [0] * 20
    assert bytes(m) == bytes(32 * page)
    ro = mmap.mmap(
        -1, 4 * page, prot=mmap.PROT_READ
    )  # memory it cannot populate for writing: refused, and populating goes on elsewhere
    import numpy as np

    assert mio.populate_pages(np.frombuffer(ro, dtype=np.uint8).ctypes.data, 4 * page) is False and mio._populating
    assert mio.populate_pages(addr + 20 * page, 4 * page) and resident()[20:24] == [1] * 4


def test_batches_advise_sequential_reads_and_restore_normal(smol_ckpt, tmp_path, monkeypatch):
    """read_many advises POSIX_FADV_SEQUENTIAL on each file it reads, before any read, and POSIX_FADV_NORMAL after,
    even when a read fails."""
    if not hasattr(os, 'posix_fadvise'):
        pytest.skip('no posix_fadvise on this platform')
    calls, real = [], os.posix_fadvise
    monkeypatch.setattr(
        os, 'posix_fadvise', lambda fd, off, n, advice: (calls.append((fd, advice)), real(fd, off, n, advice))[1]
    )
    real_read = mio.read_at
    monkeypatch.setattr(mio, 'read_at', lambda *a, **kw: (calls.append(('read',)), real_read(*a, **kw))[1])
    src = checkpoint_source(smol_ckpt, threads=2)
    keys = sorted(src.keys())
    src.read_many([(k, torch.empty(src.shape(k), dtype=src.dtype(k))) for k in keys])
    fds = {src._file(p).fileno() for p in set(read_weight_map(smol_ckpt).values())}
    first_read = calls.index(('read',))
    assert {c[0] for c in calls[:first_read]} == fds and {c[1] for c in calls[:first_read]} == {
        os.POSIX_FADV_SEQUENTIAL
    }
    assert {c[0] for c in calls[-len(fds) :]} == fds and {c[1] for c in calls[-len(fds) :]} == {os.POSIX_FADV_NORMAL}
    calls.clear()
    with pytest.raises(ValueError):
        src.read_many([(keys[0], torch.empty(src.shape(keys[0]), dtype=src.dtype(keys[0]))), (keys[1], torch.empty(3))])
    assert calls == []  # a destination refused before any read: no advice at all

    def boom(*a, **kw):
        raise OSError('disk gone')

    monkeypatch.setattr(mio, 'read_at', boom)
    with pytest.raises(OSError):
        src.read_many([(keys[0], torch.empty(src.shape(keys[0]), dtype=src.dtype(keys[0])))])
    assert calls[-1][1] == os.POSIX_FADV_NORMAL
    src.close()


def test_one_read_per_contiguous_run(tmp_path):
    """2,000 small tensors back to back in one file: a handful of preadv calls (IOV_MAX buffers each), not one per
    tensor."""
    tensors = {f'{i}.weight': torch.full((4, 4), float(i)) for i in range(2000)}
    save_file(tensors, str(tmp_path / 'many.safetensors'))
    calls = []
    real = mio.read_at

    def spy(fd, views, pos, disk=None):
        calls.append(len(views))
        return real(fd, views, pos, disk)

    src = file_source(tmp_path / 'many.safetensors', threads=1)
    keys = list(src.keys())
    dests = [torch.empty(4, 4) for _ in keys]
    mio.read_at, saved = spy, mio.read_at
    try:
        src.read_many(list(zip(keys, dests, strict=True)))
    finally:
        mio.read_at = saved
        src.close()
    assert (
        len(calls) == 1 and calls[0] == 2000
    )  # one segment, one call of read_at (two preadv of <= 1024 buffers inside)
    assert_state_dict_equal(dict(zip(keys, dests, strict=True)), tensors)


@pytest.mark.skipif(not getattr(os, 'RWF_NOWAIT', 0), reason='needs RWF_NOWAIT (Linux >= 4.14)')
def test_cold_reads_overlap_across_threads_and_warm_reads_never_wait(tmp_path, monkeypatch):
    """Cold file: the reader threads' disk reads are in flight together (none waits for another's chunk); warm file:
    every read is served by the page cache, none waits for the disk."""
    tensors = {f't{i}': torch.randn(256, 1024) for i in range(24)}  # 24 MiB: three chunks or more
    path = tmp_path / 'cold.safetensors'
    save_file(tensors, str(path))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        still_cached = os.preadv(fd, [bytearray(4096)], 1 << 20, os.RWF_NOWAIT) > 0
    except OSError:
        still_cached = False
    os.close(fd)
    if still_cached:
        pytest.skip('this file system keeps the file in memory (tmpfs?): nothing to read from a disk')
    disks, spans, real = [], [], os.preadv

    class Disk(mio._Disk):
        def __init__(self):
            super().__init__()
            disks.append(self)

    def preadv(fd, views, pos, *flags):
        if flags:
            return real(fd, views, pos, *flags)  # RWF_NOWAIT: the page cache only
        t0 = time.monotonic()
        time.sleep(0.05)  # a slow disk: a read that waits on another's would never overlap it
        try:
            return real(fd, views, pos)
        finally:
            spans.append((t0, time.monotonic()))

    monkeypatch.setattr(mio, '_Disk', Disk)
    monkeypatch.setattr(os, 'preadv', preadv)
    for cold in (True, False):
        spans.clear()
        src = file_source(path, threads=3)
        dests = {k: torch.empty(256, 1024) for k in tensors}
        src.read_many(list(dests.items()))
        src.close()
        assert_state_dict_equal(dests, tensors)
        assert disks[-1].cold == cold
        if cold:
            assert any(a[0] < b[1] and b[0] < a[1] for a in spans for b in spans if a is not b), spans
        else:
            assert spans == []


# ---------------------------------------------------------------- the staging ring, with the CPU stand-in


class RecordingCopier(HostCopier):
    "HostCopier that records staging buffers, copy sizes, and the tokens readers wait on."

    def __init__(self):
        self.buffers, self.copies, self.marks, self.waits, self.finished = [], [], 0, [], 0

    def staging(self, nbytes):
        b = super().staging(nbytes)
        self.buffers.append(b)
        return b

    def copy(self, dst, src):
        assert (
            any(src.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in self.buffers)
            or src.numel() * src.element_size() <= 16 * 1024
        )
        self.copies.append((dst.numel(), src.numel() * src.element_size()))
        super().copy(dst, src)

    def mark(self):
        self.marks += 1
        return self.marks  # token j + 1: the copies of chunk j are issued

    def wait(self, token):
        self.waits.append(token)

    def finish(self):
        self.finished += 1


def some_key(k):
    "A key at either end of the file set."
    return k.startswith(('model.embed_tokens.', 'model.layers.0.', 'model.layers.29.', 'model.norm.'))


@pytest.mark.parametrize('dtype,threads', [(torch.float32, 1), (torch.bfloat16, 3), (torch.float16, 3)])
def test_staged_reads_cast_like_torch_and_bound_the_ring(smol_ckpt, ref, dtype, threads):
    """Tensors through 64 KiB chunks (SmolLM2's 56 MB embedding in ~900 pieces), cast as `Tensor.to` casts; at most
    threads + 1 buffers."""
    src = checkpoint_source(smol_ckpt, threads=threads)
    keys = sorted(k for k in src.keys() if some_key(k))  # noqa: SIM118 (keys(), no __iter__)
    dests = [torch.empty(src.shape(k), dtype=dtype) for k in keys]
    cop, chunk = RecordingCopier(), 64 << 10
    mio.read_staged(
        Reads(keys, dests, _spans(src, keys), [src.dtype(k) for k in keys]), src._fd, cop, threads, chunk_bytes=chunk
    )
    src.close()
    assert_state_dict_equal(dict(zip(keys, dests, strict=True)), {k: ref[k].to(dtype) for k in keys})
    assert len(cop.buffers) == threads + 1 and all(
        b.numel() == chunk for b in cop.buffers
    )  # host memory: the ring only
    assert max(n for _, n in cop.copies) <= chunk  # no tensor whole in host staging memory
    assert cop.finished == 1


def test_a_buffer_is_refilled_only_after_its_copies(smol_ckpt, ref):
    "Chunk j reuses buffer j % R and its reader first waits on the token marked after chunk j - R's copies."
    src = checkpoint_source(smol_ckpt, threads=2)
    keys = sorted(k for k in src.keys() if some_key(k))  # noqa: SIM118 (keys(), no __iter__)
    cop = RecordingCopier()
    order = []
    real = mio._copy_chunk

    def spy(chunk, buf, flats, dts, copier):
        order.append(buf.data_ptr())
        real(chunk, buf, flats, dts, copier=copier)

    mio._copy_chunk, saved = spy, mio._copy_chunk
    try:
        mio.read_staged(
            Reads(
                keys,
                [torch.empty(src.shape(k), dtype=torch.float32) for k in keys],
                _spans(src, keys),
                [src.dtype(k) for k in keys],
            ),
            src._fd,
            cop,
            src.threads,
            chunk_bytes=1 << 20,
        )
    finally:
        mio._copy_chunk = saved
        src.close()
    R = len(cop.buffers)
    assert R == 3 and len(order) > 2 * R
    assert all(order[j] == order[j % R] for j in range(len(order)))  # the ring, in turn
    assert cop.waits.count(None) == R and sorted(w for w in cop.waits if w is not None) == list(
        range(1, len(order) - R + 1)
    )  # chunk j >= R waited on mark j - R + 1


def test_misaligned_tensor_is_cast_through_an_aligned_copy(tmp_path):
    """A hand-written file whose fp32 tensor starts at an odd byte (safetensors' writer never does this) still reads
    exactly."""
    a, b = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16), torch.arange(5, dtype=torch.float32) / 3
    header = {
        'a': {'dtype': 'BF16', 'shape': [3], 'data_offsets': [0, 6]},
        'b': {'dtype': 'F32', 'shape': [5], 'data_offsets': [6, 26]},
    }
    h = json.dumps(header).encode()
    h += b' ' * (-len(h) % 8)
    p = tmp_path / 'odd.safetensors'
    p.write_bytes(
        struct.pack('<Q', len(h)) + h + a.view(torch.uint8).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes()
    )
    src = file_source(p)
    outs = [
        torch.empty(3, dtype=torch.float32),
        torch.empty(5, dtype=torch.float64),
        torch.empty(5, dtype=torch.float32),
    ]
    src.read_many([('a', outs[0]), ('b', outs[1]), ('b', outs[2])])
    src.close()
    assert torch.equal(outs[0], a.float()) and torch.equal(outs[1], b.double()) and torch.equal(outs[2], b)


# ---------------------------------------------------------------- whole loads through the pipeline


def _meta_smol(dtype=torch.bfloat16):
    return build_on_meta(AutoConfig.from_pretrained(smollm2_checkpoint()), dtype=dtype)


def test_device_load_through_the_stand_in_copier(smol_ckpt, ref, monkeypatch):
    """A load whose new tensors need staging (a float32 model from a bf16 checkpoint) runs the ring: exact values,
    bounded staging, Parameters kept."""
    made = []

    def copier_for(device):
        c = RecordingCopier()
        made.append(c)
        return c

    monkeypatch.setattr(sources, 'copier_for', copier_for)
    m = _meta_smol(torch.float32)
    part = torch.nn.ModuleDict(
        {'embed_tokens': m.model.embed_tokens, 'layers': torch.nn.ModuleList(m.model.layers[:3])}
    )  # a third of the bytes
    params = {n: p for n, p in part.named_parameters()}
    [names] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(part, 'model.')], progress=False)
    check_loaded(part, names, 'SmolLM2 float32, embedding and 3 layers')
    assert len(made) == 1 and made[0].finished == 1
    assert sum(b.numel() for b in made[0].buffers) <= 64 << 20  # the ring: host memory of a device load
    for n, p in part.named_parameters():
        assert p is params[n] and torch.equal(p, ref['model.' + n].float()), n


def test_reader_error_stops_the_load_and_its_threads(smol_ckpt, monkeypatch):
    """A read failing in a reader thread raises on the caller, leaves the module on meta, no thread behind, and the
    GC as it was."""
    real, calls = mio.read_at, [0]

    def preadv(fd, views, pos, disk=None):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(5, 'Input/output error (simulated)')
        return real(fd, views, pos, disk)

    monkeypatch.setattr(mio, 'read_at', preadv)
    before = threading.active_count()
    for dtype in (torch.bfloat16, torch.float32):  # direct reads, then the staging ring
        calls[0] = 0
        m = _meta_smol(dtype)
        with pytest.raises(OSError, match='simulated'):
            load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m)], progress=False)
        assert all(p.is_meta for p in m.parameters())
        assert gc.isenabled()
    assert threading.active_count() == before


def test_gc_left_as_the_caller_set_it(tmp_path):
    "Loads pause Python's cyclic GC and restore it: on after a load that found it on, off after one that found it off."
    save_file({'w.weight': torch.ones(2, 2)}, str(tmp_path / 'one.safetensors'))
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            load_weights_from_file(
                tmp_path / 'one.safetensors',
                [ModuleAndPrefix(torch.nn.Linear(2, 2, bias=False, device='meta'), 'w')],
                progress=False,
            )
            assert gc.isenabled() == enabled
        finally:
            gc.enable()


# ---------------------------------------------------------------- CUDA (tools/gpu-check)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')


@cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_cuda_load_matches_and_keeps_parameters(smol_ckpt, ref, dtype):
    m = _meta_smol(dtype)
    params = {n: p for n, p in m.named_parameters()}
    [names] = load_weights_from_hf_shards(smol_ckpt, [ModuleAndPrefix(m)], device='cuda', progress=False)
    check_loaded(m, names, 'SmolLM2 cuda')
    for n, p in m.named_parameters():
        assert p is params[n] and p.device.type == 'cuda' and torch.equal(p.cpu(), ref[n].to(dtype)), n


@cuda
def test_cuda_copier_uses_pinned_staging_and_a_side_stream():
    c = mio.CudaCopier('cuda')
    buf = c.staging(1 << 20)
    assert buf.is_pinned() and c.stream != torch.cuda.current_stream()
    dst = torch.empty(1 << 18, dtype=torch.float32, device='cuda')
    buf.view(torch.float32).copy_(torch.arange(1 << 18, dtype=torch.float32))
    c.copy(dst, buf.view(torch.float32))
    tok = c.mark()
    c.wait(tok)
    c.finish()
    assert torch.equal(dst.cpu(), torch.arange(1 << 18, dtype=torch.float32))
