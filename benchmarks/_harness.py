"""What every benchmark script shares: the set-up that makes its fresh processes fair, the runner of those processes,
the RSS sampler, the page-cache functions and the record of the environment a run was measured in."""

from __future__ import annotations
import json
import mmap
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil

GB = 1e9


def byte_compile() -> str:
    "Write mstar_utils' .pyc files as `pip install` does, so a fresh process imports it as it imports transformers."
    import compileall

    import mstar_utils

    pkg = Path(mstar_utils.__file__).parent
    compileall.compile_dir(
        pkg, quiet=1
    )  # writes even under PYTHONDONTWRITEBYTECODE, which would leave us compiling per run
    return f'{pkg.name} byte-compiled before the runs (transformers: by pip at install)'


def environment(gpu: bool, **run) -> dict:
    "The machine and library versions a run measured on, then `run`'s settings, then how mstar_utils was compiled."
    import safetensors
    import torch
    import transformers
    from mstar_utils.sources import default_threads

    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        safetensors=safetensors.__version__,
        cpus=os.cpu_count(),
        threads=default_threads(),
        mem_gb=round(psutil.virtual_memory().total / GB, 1),
        machine=platform.machine(),
        kernel=platform.release(),
        gpu=gpu,
        gpu_name=torch.cuda.get_device_name() if gpu else None,
        **run,
        bytecode=byte_compile(),
    )


# --------------------------------------------------------------------------------------------------------------- runner
def result_of(p: subprocess.CompletedProcess, what) -> dict:
    """The JSON of the last `RESULT ` line a child printed; `RuntimeError` naming `what` and its stderr when there is
    none."""
    line = next((out_line for out_line in reversed(p.stdout.splitlines()) if out_line.startswith('RESULT ')), None)
    if p.returncode or line is None:
        raise RuntimeError(f'{what}: run failed\n{p.stderr[-3000:]}')
    return json.loads(line[7:])


def run_script(argv: list, what, env: dict | None = None) -> dict:
    "Run `argv` in a new interpreter; the result it printed as `RESULT {json}`."
    return result_of(subprocess.run(argv, capture_output=True, text=True, env=env), what)


def _child(fn, arg, conn):
    try:
        conn.send(('ok', fn(arg)))
    except BaseException:
        conn.send(('error', traceback.format_exc()))
    finally:
        conn.close()


def run_forked(fn, arg, what) -> dict:
    """`fn(arg)` in a forked child (the parent's imports shared); its result, or `RuntimeError` with the child's
    traceback."""
    import multiprocessing as mp

    ctx = mp.get_context('fork')
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, arg, send))
    proc.start()
    send.close()
    status, payload = recv.recv()
    proc.join()
    if status != 'ok':
        raise RuntimeError(f'{what}: worker failed\n{payload}')
    return payload


# --------------------------------------------------------------------------------------------------------------- memory
def proc_status() -> dict:
    "VmRSS, VmHWM, RssAnon, RssFile of this process in bytes (/proc/self/status)."
    out = {}
    with open('/proc/self/status') as f:
        for line in f:
            k, _, v = line.partition(':')
            if k in ('VmRSS', 'VmHWM', 'RssAnon', 'RssFile'):
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_hwm() -> bool:
    "Reset VmHWM (the peak RSS that ru_maxrss reports) to the current RSS (`echo 5 > /proc/self/clear_refs`)."
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


class RssSampler:
    "Largest RSS seen by a thread that samples this process every `interval` seconds (psutil)."

    def __init__(self, interval=0.001):
        self.interval, self.peak, self._stop, self._proc = interval, 0, threading.Event(), psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


# ----------------------------------------------------------------------------------------------------------- page cache
def read_files(paths):
    "Read every file once so the page cache holds it; `paths`: files, or a checkpoint folder."
    if isinstance(paths, (str, Path)) and Path(paths).is_dir():
        paths = sorted(Path(paths).glob('*.safetensors'))
    for p in paths:
        with open(p, 'rb', buffering=0) as f:
            while f.read(64 << 20):
                pass


def drop_cache(paths, tries: int = 5) -> str | None:
    """Drop these files' pages from the page cache (posix_fadvise DONTNEED, after fdatasync), retried while another
    process still maps some; the error text when some stay."""
    for _ in range(tries):
        err = _drop(paths)
        if err is None:
            return None
        time.sleep(0.5)
    return err


def drop_or_warn(paths, what) -> None:
    "`drop_cache(paths)`, a warning on stderr naming `what` when some pages stay."
    err = drop_cache(paths)
    if err:
        print(
            f'warning: {what}: {err} (a process outside the benchmark maps the files); measured anyway', file=sys.stderr
        )


def _drop(paths) -> str | None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = cached_bytes(paths)
    return (
        None
        if left < 0.01 * sum(os.path.getsize(p) for p in paths)
        else f'{left / 1e6:.0f} MB still cached after POSIX_FADV_DONTNEED'
    )


def cached_bytes(paths) -> int:
    """Bytes of the files `paths` that sit in the page cache (mincore(2) over a fresh read-only mapping, which faults
    nothing in)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = (
        ctypes.c_void_p,
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long],
    )
    libc.mincore.argtypes, libc.munmap.argtypes = (
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p],
        [ctypes.c_void_p, ctypes.c_size_t],
    )
    page, total = mmap.PAGESIZE, 0
    for p in paths:
        size = os.path.getsize(p)
        if not size:
            continue
        with open(p, 'rb') as f:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f'mmap {p}')
            try:
                vec = ctypes.create_string_buffer((size + page - 1) // page)
                if libc.mincore(addr, size, vec):
                    raise OSError(ctypes.get_errno(), f'mincore {p}')
                total += sum(b & 1 for b in vec.raw) * page
            finally:
                libc.munmap(addr, size)
    return total
