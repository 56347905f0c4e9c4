#!/usr/bin/env python
"""Load-time benchmark: fill HuggingFace causal LMs from their safetensors shards with mstar_utils, transformers and
safetensors, and print each result as a ratio to the limits measured in the same run (the bare reads of the same bytes).

    python benchmarks/bench_load.py              # full run: SmolLM2, a 2.2 GB synthetic Llama (warm and cold),
                                                 # 20,000-tensor files
    python benchmarks/bench_load.py --quick      # SmolLM2 and the 20,000-tensor file, one warm repeat (a minute or two)
    python benchmarks/bench_load.py --publish    # also copy the results to benchmarks/load_results.json and
                                                 # nbs/images/bench_load.png
    python benchmarks/bench_load.py --gpu        # only the CUDA rows (tools/gpu-check runs this)
    python benchmarks/bench_load.py --e2e_only   # only the end-to-end rows (process start -> first logits) and the
                                                 # peers

The end-to-end rows (`e2e-*`, `call-*`) start a new interpreter per run and time it from the parent's spawn to the first
logits of a 4-token forward pass; they also run on the 64-expert MoE of bench_moe_load.py. The peers (Run:ai model
streamer, fastsafetensors, safetensors load_file with and without a clone) need the `bench` extra
(`pip install -e ".[bench]"`).

Each run is a fresh process (forked from a parent that has only imported the libraries; CUDA runs and `--spawn` start a
new interpreter). Prints the table and the targets, writes benchmarks/results/load.json and benchmarks/results/load.png.
"""

from __future__ import annotations
import gc
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

import psutil
from _harness import (
    RssSampler,
    cached_bytes,
    drop_or_warn,
    environment,
    proc_status,
    read_files,
    reset_hwm,
    run_forked,
    run_script,
)
from fastcore.script import call_parse

HERE = Path(__file__).resolve().parent
RESULTS = HERE / 'results'
GB, MiB = 1e9, 1 << 20
CHUNK = 8 << 20  # mstar_utils' staging chunk (FileSource.read_many's chunk_bytes default)

# Synthetic checkpoint: TinyLlama-shaped (1.1 B parameters, 2.2 GB in bf16), random init, untied lm_head.
SYNTH_NAME = 'llama-synth-1.1b-bf16'
SYNTH_CONFIG = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
SYNTH_SHARD = '400MB'
SMOL_NAME = 'SmolLM2-135M-Instruct-copy'  # mstar_utils.checkpoints.smollm2_checkpoint(), copied
# Many small tensors: 20,000 16x16 fp32 tensors in one file (a ModuleList of Linear layers), and a Llama with as many
# tensors.
MANY_NAME, MANY_N = 'many-16x16-fp32', 20_000
LLAMA20K_NAME = 'llama-20k-tensors-fp32'
LLAMA20K_CONFIG = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=2222,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)  # 2222 x 9 + 3 = 20,001
MOE_NAME = 'qwen3-moe-64x8-bf16'  # bench_moe_load.py's checkpoint: only the end-to-end rows run on it


# ---------------------------------------------------------------------------------------------------------- checkpoints
def cache_root() -> Path:
    from mstar_utils.checkpoints import cache_dir

    return cache_dir() / 'bench'


def built(name: str, build: bool = True) -> Path:
    "Folder of a benchmark checkpoint, built once in a child interpreter under `cache_dir()/'bench'`."
    out = cache_root() / name
    if (out / '.complete').exists() or not build:
        return out
    print(f'building {name} in {out} (once) ...', flush=True)
    subprocess.run([sys.executable, __file__, '--build', name], check=True)
    return out


def synth_checkpoint(build: bool = True) -> Path:
    "Folder of the 2.2 GB synthetic Llama (bench_tp_load.py uses it too)."
    return built(SYNTH_NAME, build)


def _build(name: str):
    import torch
    from mstar_utils.checkpoints import cached_folder  # build into a temporary folder, rename into place when complete

    def synth(tmp):
        from transformers import LlamaConfig, LlamaForCausalLM
        from mstar_utils.upstream import build_model

        torch.manual_seed(0)
        build_model(LlamaForCausalLM, LlamaConfig(**SYNTH_CONFIG, dtype='bfloat16'), torch.bfloat16).save_pretrained(
            tmp, max_shard_size=SYNTH_SHARD
        )

    def many(tmp):
        from safetensors.torch import save_file

        g = torch.Generator().manual_seed(0)
        Path(tmp).mkdir(parents=True, exist_ok=True)
        save_file(
            {f'{i}.weight': torch.randn(16, 16, generator=g) for i in range(MANY_N)},
            str(Path(tmp) / 'model.safetensors'),
        )

    def smol_copy(
        tmp,
    ):  # a copy of its own: other processes (tests) map the shared SmolLM2 files, and mapped pages cannot be dropped
        from mstar_utils.checkpoints import smollm2_checkpoint

        shutil.copytree(smollm2_checkpoint(), tmp, dirs_exist_ok=True, copy_function=shutil.copyfile)

    def llama20k(tmp):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA20K_CONFIG)).save_pretrained(tmp)

    cached_folder(
        'bench', name, {SYNTH_NAME: synth, MANY_NAME: many, LLAMA20K_NAME: llama20k, SMOL_NAME: smol_copy}[name]
    )


def checkpoint_tensors(ckpt: Path) -> list[dict]:
    """Every tensor of the checkpoint: key, file, dtype string, shape, absolute byte offset in the file and byte
    count; file then offset order."""
    index = ckpt / 'model.safetensors.index.json'
    files = (
        sorted(set(json.loads(index.read_text())['weight_map'].values())) if index.exists() else ['model.safetensors']
    )
    out = []
    for name in files:
        path = ckpt / name
        with open(path, 'rb') as f:
            n = int.from_bytes(f.read(8), 'little')
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k == '__metadata__':
                continue
            b, e = v['data_offsets']
            out.append(dict(key=k, file=str(path), dtype=v['dtype'], shape=v['shape'], offset=8 + n + b, nbytes=e - b))
    return sorted(out, key=lambda t: (t['file'], t['offset']))


# --------------------------------------------------------------------------------------------------------------- worker
def _preimport():
    "The imports every method needs; done by the parent once when runs are forked, so no method pays for them."
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import safetensors.torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import mstar_utils.loading  # noqa: F401
    import mstar_utils.model  # noqa: F401


def _meta_model(ckpt, dtype=None):
    from transformers import AutoConfig
    from mstar_utils.model import build_on_meta
    import torch

    return build_on_meta(AutoConfig.from_pretrained(ckpt), dtype=dtype or torch.bfloat16)


def _fingerprint(t) -> int:
    """Sum of ~4k bytes sampled evenly across the tensor's memory: equal for equal bytes, and different when an
    offset is wrong."""
    import torch

    b = t.detach().reshape(-1).view(torch.uint8)
    return int(b[:: max(1, b.numel() // 4093)].sum(dtype=torch.int64))


def _touch(tensors) -> None:
    "Read one byte of every 4 KiB page of each tensor: pages an mmap left unread are faulted in here."
    import torch

    seen = set()
    for t in tensors:
        if t.device.type != 'cpu' or t.is_meta:
            continue
        ptr = (
            t.data_ptr(),
            t.numel(),
        )  # tensors may share one storage (a whole mmapped file): tell them apart by their own memory
        if ptr in seen:
            continue
        seen.add(ptr)
        t.detach().reshape(-1).view(torch.uint8)[::4096].sum(dtype=torch.int64)


def _no_meta(model, what):
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f'{what}: {len(left)} tensors still on meta, e.g. {left[:3]}')


def _file_buffers(method, files) -> dict:
    """Destination memory for the per-file limits: fresh, faulted in, or advised for huge pages; pinned for the H2D
    limit."""
    import torch

    out = {}
    for f in files:
        n = os.path.getsize(f)
        if method in ('limit-thp', 'limit-populate'):  # page-aligned fresh memory
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if method == 'limit-thp':
                m.madvise(mmap.MADV_HUGEPAGE)
            out[f] = torch.frombuffer(m, dtype=torch.uint8)
        else:
            out[f] = torch.empty(n, dtype=torch.uint8, pin_memory=method == 'h2d-pinned')
        if method in ('limit-prefaulted', 'h2d-pinned'):
            out[f].fill_(1)  # every page mapped before the clock
    return out


def _read_file(f, buf):
    "One readinto of the whole file `f` into `buf` (restarted only if the kernel returns less)."
    with open(f, 'rb', buffering=0) as fh:
        view, got = memoryview(buf.numpy()), 0
        while got < len(view):
            n = fh.readinto(view[got:])
            if not n:
                raise EOFError(f)
            got += n


def _populate_threads(bufs: dict):
    """Fault in every page of the buffers with madvise(MADV_POPULATE_WRITE), in page-aligned pieces spread over
    `default_threads()` threads (ctypes releases the GIL)."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor
    from mstar_utils.sources import default_threads

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    T, page = default_threads(), mmap.PAGESIZE
    pieces = []
    for b in bufs.values():
        a, n = b.data_ptr(), b.numel()
        step = -(-n // T // page) * page
        pieces += [(a + i, min(step, n - i)) for i in range(0, n, step)]

    def pop(p):
        if libc.madvise(p[0], p[1], 23):
            raise OSError(ctypes.get_errno(), 'madvise(MADV_POPULATE_WRITE) failed')

    with ThreadPoolExecutor(T) as ex:
        list(ex.map(pop, pieces))


def _read_odirect(files):
    """Sequential 8 MiB O_DIRECT reads of each file into one reused page-aligned buffer: the disk's bandwidth without
    the page cache."""
    buf = mmap.mmap(-1, 8 << 20)
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            while os.readv(fd, [buf]) == len(buf):
                pass
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------------- construct and load
@dataclass
class Made:
    "What a method builds before the clock: the model it fills, the module its load names, the per-file buffers."

    model: object = None
    sub: object = None
    bufs: dict | None = None
    timed_s: float | None = None  # set by a load that times its own part (the host-to-device copy alone)


def _files(tensors) -> list:
    return sorted({t['file'] for t in tensors})


def _nothing(ckpt, tensors, res) -> Made:
    return Made()


def _meta(dtype: str | None = None):
    "Construct: the checkpoint's model built on meta, in `dtype` (bfloat16 when None)."

    def construct(ckpt, tensors, res):
        import torch

        return Made(_meta_model(ckpt, getattr(torch, dtype) if dtype else None))

    return construct


def _subset(ckpt, tensors, res) -> Made:
    "Construct: the meta model and a ModuleList of its first layers, about 10% of the checkpoint's bytes."
    import torch

    model, per_layer = _meta_model(ckpt), {}
    for t in tensors:
        if t['key'].startswith('model.layers.'):
            i = int(t['key'].split('.')[2])
            per_layer[i] = per_layer.get(i, 0) + t['nbytes']
    k = max(1, round(0.10 * sum(t['nbytes'] for t in tensors) / per_layer[0]))
    sub = torch.nn.ModuleList(
        list(model.model.layers[:k])
    )  # names 0.self_attn...: the checkpoint's under 'model.layers.'
    res['subset_layers'], res['subset_bytes'] = k, sum(per_layer[i] for i in range(k))
    return Made(model, sub)


def _many_module(ckpt, tensors, res) -> Made:
    import torch

    with torch.device('meta'):
        return Made(torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(MANY_N)))


def _buffers(kind: str):
    "Construct: destination memory per file, of `_file_buffers`' `kind`."
    return lambda ckpt, tensors, res: Made(bufs=_file_buffers(kind, _files(tensors)))


def _hf(dtype: str = 'bfloat16', device_map: str | None = None):
    "Load: from_pretrained, which builds the model too."

    def load(ckpt, files, made):
        import torch
        from transformers import AutoModelForCausalLM

        kw = dict(device_map=device_map) if device_map else {}
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype), **kw)

    return load


def _state_dict(backend: str = 'mmap'):
    "Load: safetensors load_file of every file, then load_state_dict(assign=True) into the meta model."

    def load(ckpt, files, made):
        from safetensors.torch import load_file

        sd, model = {}, made.model
        for f in files:
            sd.update(load_file(f, backend=backend))
        r = model.load_state_dict(sd, assign=True, strict=False)
        if hasattr(model, 'tie_weights'):
            model.tie_weights()  # assign replaced the embedding the tied lm_head pointed at
        if r.unexpected_keys:
            raise RuntimeError(
                f'load_state_dict: unexpected keys {r.unexpected_keys[:3]}'
            )  # missing: tied, checked by _no_meta
        return model

    return load


def _ours(device: str = 'cpu', mmap: bool = False):
    def load(ckpt, files, made):
        from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards

        load_weights_from_hf_shards(ckpt, [ModuleAndPrefix(made.model)], device=device, progress=False, mmap=mmap)
        return made.model

    return load


def _ours_1thread(ckpt, files, made):
    from mstar_utils.loading import ModuleAndPrefix, load_from_source
    from mstar_utils.sources import checkpoint_source

    src = checkpoint_source(ckpt, threads=1)
    try:
        load_from_source(src, [ModuleAndPrefix(made.model)], progress=False)
    finally:
        src.close()
    return made.model


def _ours_subset(ckpt, files, made):
    from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards

    load_weights_from_hf_shards(ckpt, [ModuleAndPrefix(made.sub, 'model.layers.')], progress=False)
    return made.model


def _ours_file(ckpt, files, made):
    from mstar_utils.loading import ModuleAndPrefix, load_weights_from_file

    load_weights_from_file(files[0], [ModuleAndPrefix(made.model)], progress=False)
    return made.model


def _readinto(ckpt, files, made):
    for f, b in made.bufs.items():
        _read_file(f, b)


def _odirect(ckpt, files, made):
    _read_odirect(files)


def _populate(ckpt, files, made):
    _populate_threads(made.bufs)


def _h2d(ckpt, files, made):
    "Load: a pinned host-to-device copy of each file's buffer, timed alone (device allocation excluded)."
    import torch

    outs = {f: torch.empty(b.numel(), dtype=torch.uint8, device='cuda') for f, b in made.bufs.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f, b in made.bufs.items():
        outs[f].copy_(b, non_blocking=True)
    torch.cuda.synchronize()
    made.timed_s = time.perf_counter() - t0


def _instanttensor(ckpt, files, made) -> dict:
    import torch
    from instanttensor import safe_open

    sd = {}
    for f in files:
        with safe_open(f, framework='pt', device=torch.cuda.current_device()) as fh:
            sd.update((k, t.clone()) for k, t in fh.tensors())  # its tensors view a buffer it reuses
    return sd


def _runai(ckpt, files, made) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as s:
        s.stream_files(files, owned=True)
        return dict(s.get_tensors())


def _fastsafetensors(ckpt, files, made) -> dict:
    from fastsafetensors import SafeTensorsFileLoader

    loader = SafeTensorsFileLoader(None, 'cpu', nogds=True)
    loader.add_filenames({0: files})
    fb = loader.copy_files_to_device()
    sd = {k: fb.get_tensor(k) for k in loader.get_keys()}  # the tensors keep their host buffer after close
    fb.close()
    loader.close()
    return sd


def _st_peer(clone: bool):
    "Load: a state dict of load_file per shard (page-cache mappings), or of clones of its tensors (owned memory)."

    def load(ckpt, files, made) -> dict:
        from safetensors.torch import load_file

        sd = {}
        for f in files:
            sd.update(load_file(f))
        return {k: v.clone() for k, v in sd.items()} if clone else sd

    return load


# ------------------------------------------------------------------------------------------------------------- methods
SMOL, SYNTH = 'SmolLM2-135M', 'Llama-synth-1.1B'
BIG = (SMOL, SYNTH)  # the checkpoints every loader runs on
SMALL = (MANY_NAME, LLAMA20K_NAME)  # the checkpoints of many small tensors: their own methods, warm only


@dataclass(frozen=True)
class Method:
    "One way to load a checkpoint: what it builds before the clock, what it times, where and how it runs."

    name: str
    label: str  # what the results' `labels` say it is
    load: Callable  # (ckpt, files, Made) -> what it loaded; for `e2e` methods (spec) -> the run's result
    construct: Callable | None = _nothing  # (ckpt, tensors, res) -> Made; None: the load builds the model itself
    caches: tuple = ('warm', 'cold')  # the page-cache states it runs in
    on: tuple = BIG  # the checkpoints it runs on
    gpu: bool = False  # needs CUDA; runs in a new interpreter, warm only
    peer: bool = False  # another library's loader (the `bench` extra)
    e2e: dict | None = None  # an end-to-end run in a new interpreter: the child's options (hf, mmap, call)
    once: bool = False  # measured in the first warm round only (quadratic here: 10-100 s a run)
    fingerprint: bool = True  # holds the checkpoint's bytes, checked against a plain read
    requires: str = ''  # the pip requirement of a module it imports ('x==1.0'); without the module it is skipped


def _e2e(name, label, hf=False, mmap=False, call=False) -> Method:
    return Method(name, label, _end_to_end, None, on=(*BIG, MOE_NAME), e2e=dict(hf=hf, mmap=mmap, call=call))


def _end_to_end(spec: dict) -> dict:
    return run_e2e(spec)  # the load of every end-to-end method: the whole run is timed


METHODS = [
    Method('hf', '(a) transformers from_pretrained', _hf(), None),
    Method('st-mmap', '(b) safetensors load_file (mmap) + load_state_dict(assign=True)', _state_dict('mmap'), _meta()),
    Method(
        'st-pread',
        "(b') safetensors load_file(backend='pread') + load_state_dict(assign=True)",
        _state_dict('pread'),
        _meta(),
        caches=('warm',),
    ),
    Method('ours', '(c) ours: load_weights_from_hf_shards (owned memory, default threads)', _ours(), _meta()),
    Method('ours-1thread', '(c) ours, one reader thread', _ours_1thread, _meta()),
    Method('ours-mmap', "(c') ours, mmap=True", _ours(mmap=True), _meta()),
    Method('ours-subset', '(c) ours, one ModuleAndPrefix over ~10% of the bytes', _ours_subset, _subset),
    Method(
        'limit-fresh',
        'limit, fresh memory: one readinto per file into memory allocated and never touched',
        _readinto,
        _buffers('limit-fresh'),
    ),
    Method(
        'limit-prefaulted',
        'limit, pre-faulted memory: one readinto per file into memory faulted in before the clock (the copy alone)',
        _readinto,
        _buffers('limit-prefaulted'),
    ),
    Method(
        'limit-thp',
        'one readinto per file into fresh memory advised MADV_HUGEPAGE (transparent huge pages)',
        _readinto,
        _buffers('limit-thp'),
        caches=('warm',),
    ),
    Method(
        'limit-populate',
        "the page faults alone: fresh memory of the files' size faulted in by MADV_POPULATE_WRITE, "
        "split over ours' reader threads (no read)",
        _populate,
        _buffers('limit-populate'),
        caches=('warm',),
        fingerprint=False,
    ),
    Method(
        'limit-odirect',
        'limit, O_DIRECT: sequential 8 MiB reads of the files around the page cache (the disk alone)',
        _odirect,
    ),
    Method(
        'runai',
        'peer: Run:ai model streamer, SafetensorsStreamer().stream_files(files, owned=True) (owned memory, a '
        'state dict)',
        _runai,
        peer=True,
    ),
    Method(
        'fastsafetensors',
        "peer: fastsafetensors SafeTensorsFileLoader(None, 'cpu', nogds=True) (owned memory: its host "
        "buffers, a state dict)",
        _fastsafetensors,
        peer=True,
    ),
    Method(
        'st-load',
        'peer: safetensors load_file per shard (page-cache mapping, a state dict)',
        _st_peer(False),
        peer=True,
    ),
    Method(
        'st-clone',
        'peer: safetensors load_file per shard + clone of every tensor (owned memory, a state dict)',
        _st_peer(True),
        peer=True,
    ),
    _e2e(
        'e2e-ours',
        'process start -> first logits: import torch, from mstar_utils import load_model, load_model(ckpt), a '
        '4-token forward (owned memory)',
    ),
    _e2e(
        'e2e-ours-mmap',
        'process start -> first logits: the same with load_model(ckpt, mmap=True) (page-cache mapping)',
        mmap=True,
    ),
    _e2e(
        'e2e-hf',
        'process start -> first logits: import torch, from transformers import AutoModelForCausalLM, '
        'from_pretrained(ckpt), the forward (page-cache mapping)',
        hf=True,
    ),
    _e2e(
        'call-ours',
        'load_model(ckpt) + the forward alone, torch, transformers, mstar_utils and the modeling module '
        'imported beforehand (owned memory)',
        call=True,
    ),
    _e2e(
        'call-ours-mmap',
        'load_model(ckpt, mmap=True) + the forward alone, modules imported beforehand (page-cache mapping)',
        mmap=True,
        call=True,
    ),
    _e2e(
        'call-hf',
        'from_pretrained(ckpt) + the forward alone, modules imported beforehand (page-cache mapping)',
        hf=True,
        call=True,
    ),
    Method(
        'hf-cuda', "(a) from_pretrained(device_map='cuda')", _hf(device_map='cuda'), None, caches=('warm',), gpu=True
    ),
    Method(
        'ours-cuda', "(c) ours, device='cuda' (pinned staging ring)", _ours('cuda'), _meta(), caches=('warm',), gpu=True
    ),
    Method(
        'h2d-pinned',
        'limit, pinned host-to-device copy of the same bytes',
        _h2d,
        _buffers('h2d-pinned'),
        caches=('warm',),
        gpu=True,
        fingerprint=False,
    ),
    Method(
        'instanttensor-cuda',
        "peer: InstantTensor safe_open(file, framework='pt', device=cuda) per shard + clone of "
        "each tensor (device memory)",
        _instanttensor,
        caches=('warm',),
        gpu=True,
        requires='instanttensor==0.2.2',
    ),
    Method(
        'many-ours',
        '(c) ours: load_weights_from_file into a meta-built ModuleList of 20,000 Linear(16, 16)',
        _ours_file,
        _many_module,
        caches=('warm',),
        on=(MANY_NAME,),
    ),
    Method(
        'many-st',
        '(b) safetensors load_file + load_state_dict(assign=True), same module',
        _state_dict(),
        _many_module,
        caches=('warm',),
        on=(MANY_NAME,),
        once=True,
    ),
    Method(
        'llama-ours',
        '(c) ours: build_on_meta + load_weights_from_hf_shards, Llama with 20,001 tensors',
        _ours(),
        _meta('float32'),
        caches=('warm',),
        on=(LLAMA20K_NAME,),
    ),
    Method(
        'llama-hf',
        '(a) from_pretrained, the same Llama (construction included)',
        _hf('float32'),
        None,
        caches=('warm',),
        on=(LLAMA20K_NAME,),
        once=True,
    ),
]
METHOD = {m.name: m for m in METHODS}
ALL_METHODS = list(METHOD)
LABELS = {m.name: m.label for m in METHODS}


# --------------------------------------------------------------------------------------------------------------- worker
def _owned(made: Made, loaded) -> list:
    "The tensors a load left in memory it owns or maps: its buffers, its state dict, or the module it filled."
    if made.bufs:
        return list(made.bufs.values())
    if isinstance(loaded, dict):
        return list(loaded.values())
    return [] if loaded is None else list((made.sub or loaded).state_dict().values())


def _fingerprints(made: Made, loaded, tensors) -> dict | None:
    "{checkpoint key: fingerprint} of what the load holds, None when it holds nothing."
    if made.bufs:
        return {t['key']: _fingerprint(made.bufs[t['file']][t['offset'] : t['offset'] + t['nbytes']]) for t in tensors}
    if isinstance(loaded, dict):
        return {k: _fingerprint(v) for k, v in loaded.items()}
    if loaded is None:
        return None
    sd, pre = (made.sub.state_dict(), 'model.layers.') if made.sub is not None else (loaded.state_dict(), '')
    keys = {t['key'] for t in tensors}
    return {pre + k: _fingerprint(v.cpu()) for k, v in sd.items() if pre + k in keys}


def _memory(res: dict, st0: dict, st1: dict, io0, io1, peak: int):
    "The RSS and I/O figures of one load, above the baseline before it."
    base = st0['VmRSS']
    res.update(
        baseline_rss=base,
        peak_sampled=peak - base,
        peak_hwm=st1['VmHWM'] - base if res['hwm_reset'] else None,
        anon_delta=st1['RssAnon'] - st0['RssAnon'],
        file_delta=st1['RssFile'] - st0['RssFile'],
        rchar=io1.read_chars - io0.read_chars,
        read_bytes=io1.read_bytes - io0.read_bytes,
    )
    res['peak_rss'] = max(res['peak_sampled'], res['peak_hwm'] or 0)


def worker(spec: dict) -> dict:
    "One measured load in this (fresh) process; returns the metrics."
    import torch

    m, ckpt, cold = METHOD[spec['method']], Path(spec['ckpt']), spec['cold']
    tensors = checkpoint_tensors(ckpt)
    files = _files(tensors)
    res = dict(
        method=m.name, ckpt=spec['ckpt_name'], cold=cold, construct_s=None, subset_bytes=None, tensors=len(tensors)
    )
    if m.gpu:
        torch.cuda.init()
        torch.empty(1, device='cuda')
        torch.cuda.synchronize()  # the CUDA context is no part of a load
    t0 = time.perf_counter()
    made = m.construct(ckpt, tensors, res) if m.construct else Made()
    if m.construct:
        res['construct_s'] = time.perf_counter() - t0
    gc.collect()
    if cold:
        drop_or_warn(files, spec)
    proc = psutil.Process()
    io0, st0 = proc.io_counters(), proc_status()
    res['hwm_reset'] = reset_hwm()
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        loaded = m.load(ckpt, files, made)
        if m.gpu:
            torch.cuda.synchronize()
        res['load_s'] = time.perf_counter() - t0 if made.timed_s is None else made.timed_s
        t0 = time.perf_counter()
        _touch(_owned(made, loaded))
        res['touch_s'] = time.perf_counter() - t0
    io1, st1 = proc.io_counters(), proc_status()
    res['cached_after'] = cached_bytes(files) if cold else None  # what the load pulled in from the disk
    res['ready_s'] = res['load_s'] + res['touch_s']
    _memory(res, st0, st1, io0, io1, sampler.peak)
    # ---- correctness: every method must hold the checkpoint's bytes under the checkpoint's keys
    if loaded is not None and not isinstance(loaded, dict):
        _no_meta(made.sub if made.sub is not None else loaded, m.name)
    res['fingerprint'] = _fingerprints(made, loaded, tensors) if m.fingerprint else None
    return res


E2E_CHILD = r'''
import json, sys, time
opts, ckpt = json.loads(sys.argv[1]), sys.argv[2]  # the method's `e2e` options: hf, mmap, call
def status():
    out = {}
    with open('/proc/self/status') as f:
        for line in f:
            k, _, v = line.partition(':')
            if k in ('VmRSS', 'VmHWM'): out[k] = int(v.split()[0]) * 1024
    return out
t_before = time.time()
if opts['call']:  # the modules imported before the clock
    import torch, transformers, mstar_utils
    from transformers import AutoConfig, AutoModelForCausalLM
    from mstar_utils import load_model
    getattr(transformers, AutoConfig.from_pretrained(ckpt).architectures[0])
    open('/proc/self/clear_refs', 'w').write('5')  # VmHWM from here
    t_before = time.time()
base = status()['VmRSS']
import torch
if opts['hf']:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt)
else:
    from mstar_utils import load_model
    model = load_model(ckpt, mmap=opts['mmap'])
t_loaded = time.time()
with torch.inference_mode(): logits = model(torch.tensor([[1, 2, 3, 4]])).logits
t_logits = time.time()
st = status()
print('RESULT ' + json.dumps(dict(t_before=t_before, t_loaded=t_loaded, t_logits=t_logits, base=base, hwm=st['VmHWM'],
                                  dtype=str(model.dtype), logits=[float(x) for x in logits[0, -1, :8].float()])))
'''


def run_e2e(spec: dict) -> dict:
    "One end-to-end run in a new interpreter: spawn -> first logits (e2e-*), or the call and forward alone (call-*)."
    m, ckpt = METHOD[spec['method']], spec['ckpt']
    if spec['cold']:
        drop_or_warn(sorted(str(p) for p in Path(ckpt).glob('*.safetensors')), spec)
    env = {
        **os.environ,
        'HF_HUB_OFFLINE': '1',
        'TOKENIZERS_PARALLELISM': 'false',
        'TRANSFORMERS_VERBOSITY': 'error',
        'HF_HUB_DISABLE_PROGRESS_BARS': '1',
    }
    t0 = time.time()
    r = run_script([sys.executable, '-c', E2E_CHILD, json.dumps(m.e2e), ckpt], f'{spec}: end-to-end', env)
    call = m.e2e['call']
    start = r['t_before'] if call else t0
    peak = r['hwm'] - r['base'] if call else r['hwm']
    return dict(
        method=m.name,
        ckpt=spec['ckpt_name'],
        cold=spec['cold'],
        construct_s=None,
        subset_bytes=None,
        load_s=r['t_loaded'] - start,
        touch_s=r['t_logits'] - r['t_loaded'],
        ready_s=r['t_logits'] - start,
        peak_rss=peak,
        peak_sampled=None,
        peak_hwm=peak,
        anon_delta=None,
        file_delta=None,
        rchar=None,
        read_bytes=None,
        cached_after=None,
        fingerprint=None,
        logits=r['logits'],
        dtype=r['dtype'],
    )


def run_one(spec: dict, spawn: bool) -> dict:
    """One run of `spec`'s method: end-to-end, or `worker(spec)` forked (imports shared) or in a new interpreter
    (`spawn`, always for CUDA)."""
    m = METHOD[spec['method']]
    if m.e2e:
        return m.load(spec)
    if spawn or m.gpu:
        return run_script([sys.executable, __file__, '--worker_spec', json.dumps(spec)], spec)
    return run_forked(worker, spec, spec)


# -------------------------------------------------------------------------------------------------------------- summary
def _med(rows, k):
    vals = [r[k] for r in rows if r.get(k) is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict], ckpts: dict) -> list[dict]:
    out = []
    keys = sorted(
        {(r['ckpt'], r['cold'], r['method']) for r in runs},
        key=lambda k: (list(ckpts).index(k[0]), k[1], ALL_METHODS.index(k[2])),
    )
    for ck, cold, m in keys:
        rows = [r for r in runs if (r['ckpt'], r['cold'], r['method']) == (ck, cold, m)]
        nbytes = rows[0]['subset_bytes'] or ckpts[ck]['bytes']
        s = dict(ckpt=ck, cache='cold' if cold else 'warm', method=m, label=LABELS[m], n=len(rows), bytes=nbytes)
        for k in (
            'construct_s',
            'load_s',
            'touch_s',
            'ready_s',
            'peak_rss',
            'peak_sampled',
            'peak_hwm',
            'anon_delta',
            'file_delta',
            'rchar',
            'read_bytes',
            'cached_after',
        ):
            s[k] = _med(rows, k)
        s['ready_min_s'], s['ready_max_s'] = min(r['ready_s'] for r in rows), max(r['ready_s'] for r in rows)
        s['gbps'] = nbytes / GB / s['ready_s']
        s['us_per_tensor'] = s['load_s'] / ckpts[ck]['tensors'] * 1e6
        s['rss_x_bytes'] = s['peak_rss'] / nbytes
        out.append(s)
    return out


def verify(runs: list[dict]) -> list[str]:
    """Methods whose bytes differ, for some key, from those a plain readinto of the file got (limit-fresh, or ours
    where no limit ran); end-to-end runs whose logits differ from from_pretrained's."""
    bad = []
    for r in runs:
        ref = next((x for x in runs if x['ckpt'] == r['ckpt'] and x['method'] == 'e2e-hf'), None)
        if r.get('logits') is None or ref is None:
            continue
        if r['dtype'] != ref['dtype'] or any(
            abs(a - b) > 1e-3 * (1 + abs(b)) for a, b in zip(r['logits'], ref['logits'], strict=False)
        ):
            bad.append(
                f"{r['ckpt']}/{r['method']}: first logits {r['logits'][:3]} ({r['dtype']}) differ from "
                f"from_pretrained's {ref['logits'][:3]}"
            )
    for r in runs:
        if not r.get('fingerprint'):
            continue
        ref = next((x['fingerprint'] for x in runs if x['ckpt'] == r['ckpt'] and x['method'] == 'limit-fresh'), None)
        ref = ref or next((x['fingerprint'] for x in runs if x['ckpt'] == r['ckpt'] and x['method'] == 'ours'), None)
        if ref is None:
            continue
        if r['method'] != 'ours-subset' and set(r['fingerprint']) != set(ref):
            bad.append(f"{r['ckpt']}/{r['method']}: keys differ from the checkpoint's")
            continue
        diff = [k for k, v in r['fingerprint'].items() if ref.get(k) != v]
        if diff:
            bad.append(f"{r['ckpt']}/{r['method']}: bytes differ for {diff[:3]}")
    return bad


def _get(summary, ck, cache, m):
    return next((s for s in summary if (s['ckpt'], s['cache'], s['method']) == (ck, cache, m)), None)


THREADS = [1]  # the reader threads of the run (set by main from the environment it records)


THREADS = [1]  # the reader threads of the run (set by main from the environment it records)


@dataclass(frozen=True)
class Target:
    """One line of the targets: `a`'s `key` over `b`'s (`a`'s alone, divided by `scale`, when `b` is None), and its
    bound."""

    name: str
    a: str
    b: str | None = None
    cache: str = 'warm'
    key: str = 'gbps'
    op: str | None = None
    limit: float | dict | None = None  # a dict: by checkpoint, None for the others (the line printed without a bound)
    scale: float = 1


def _populate_bound(summary, ckpts, ck) -> list:
    """Faults (measured on all threads) plus the copy (measured on one, assumed to scale with the threads), against
    the copy."""
    pop, pre = _get(summary, ck, 'warm', 'limit-populate'), _get(summary, ck, 'warm', 'limit-prefaulted')
    if not (pop and pre):
        return []
    T = max(1, THREADS[0])
    bound = 1 / (1 / pop['gbps'] + 1 / (T * pre['gbps']))
    out = [
        (
            'warm',
            f'   warm: owned-memory bound on {T} threads (populate, then copy) / pre-faulted readinto',
            bound / pre['gbps'],
            None,
            None,
        )
    ]
    o = _get(summary, ck, 'warm', 'ours')
    if o:
        out.append(('warm', '   warm: ours GB/s / that owned-memory bound', o['gbps'] / bound, None, None))
    return out


def _shard_bound(cache: str):
    "load_model's peak RSS over the checkpoint's bytes, bounded by 1.05 plus its largest shard's share."

    def rows(summary, ckpts, ck) -> list:
        c = _get(summary, ck, cache, 'call-ours')
        if not (c and ck in ckpts):
            return []
        shard = ckpts[ck].get('max_shard', 0) / c['bytes']
        return [
            (
                cache,
                f'7. load_model peak RSS above baseline / checkpoint bytes (bound 1.05 + one shard, {shard:.2f})',
                c['rss_x_bytes'],
                '<=',
                round(1.05 + shard, 4),
            )
        ]

    return rows


def _per_cache(cache: str) -> list:
    "The rows measured warm and cold alike: the end-to-end call alone, load_model's memory, the peers."
    c = cache
    return [
        Target(
            f'   {c}: the call + forward alone, modules imported: load_model / from_pretrained',
            'call-ours',
            'call-hf',
            c,
            'ready_s',
        ),
        Target(
            f'   {c}: the call + forward alone: load_model(mmap=True) / from_pretrained',
            'call-ours-mmap',
            'call-hf',
            c,
            'ready_s',
        ),
        _shard_bound(c),
        *[
            Target(f'8. raw loader: {p} ready time / ours', p, 'ours', c, 'ready_s', '>=', 1.2)
            for p in ('runai', 'fastsafetensors')
        ],
        Target('8. raw loader: load_file + clone ready time / ours', 'st-clone', 'ours', c, 'ready_s', '>=', 1.0),
        Target('   raw loader: load_file (mapped, touched) ready time / ours', 'st-load', 'ours', c, 'ready_s'),
        *[
            Target(
                f'8. raw loader: ours peak RSS / {p} peak RSS (owned memory both)', 'ours', p, c, 'peak_rss', '<=', 1.0
            )
            for p in ('runai', 'fastsafetensors', 'st-clone')
        ],
    ]


def E2E_BOUND(big: float, moe: float = 0.5) -> dict:
    return {SMOL: big, SYNTH: big, MOE_NAME: moe}  # the end-to-end bounds


# in the order they print, per checkpoint: Target rows, or functions (summary, ckpts, ck) -> [(cache, name, value, op,
# limit)]
TARGETS = [
    Target(
        '1. warm: ours GB/s / readinto per file into pre-faulted memory', 'ours', 'limit-prefaulted', op='>=', limit=0.8
    ),
    Target('   warm: ours GB/s / readinto per file into fresh memory', 'ours', 'limit-fresh'),
    Target('   warm: ours with one thread GB/s / readinto into fresh memory', 'ours-1thread', 'limit-fresh'),
    Target('   warm: fresh memory / pre-faulted memory (the page-fault cost)', 'limit-fresh', 'limit-prefaulted'),
    Target('   warm: huge-page-advised memory / fresh memory', 'limit-thp', 'limit-fresh'),
    _populate_bound,
    Target('   warm: ours GB/s / from_pretrained GB/s (ready time)', 'ours', 'hf'),
    Target('   warm: ours mmap=True GB/s / from_pretrained GB/s', 'ours-mmap', 'hf'),
    Target('2. cold: ours GB/s / O_DIRECT sequential read', 'ours', 'limit-odirect', 'cold', op='>=', limit=0.9),
    Target('2. cold: ours mmap=True GB/s (ready) / O_DIRECT', 'ours-mmap', 'limit-odirect', 'cold', op='>=', limit=0.9),
    Target(
        '   cold profile: page-cache readinto into pre-faulted memory / O_DIRECT',
        'limit-prefaulted',
        'limit-odirect',
        'cold',
    ),
    Target('   cold profile: page-cache readinto into fresh memory / O_DIRECT', 'limit-fresh', 'limit-odirect', 'cold'),
    Target('   cold: ours with one thread / O_DIRECT', 'ours-1thread', 'limit-odirect', 'cold'),
    *[
        Target('4. ours peak RSS above baseline / checkpoint bytes', 'ours', None, c, 'rss_x_bytes', '<=', 1.05)
        for c in ('warm', 'cold')
    ],
    Target(
        '6. warm: load_model / from_pretrained, process start -> first logits',
        'e2e-ours',
        'e2e-hf',
        'warm',
        'ready_s',
        '<=',
        E2E_BOUND(1.0),
    ),
    Target(
        '6. warm: load_model(mmap=True) / from_pretrained, start -> logits',
        'e2e-ours-mmap',
        'e2e-hf',
        'warm',
        'ready_s',
        '<=',
        E2E_BOUND(0.9),
    ),
    Target(
        '6. cold: load_model / from_pretrained, start -> logits',
        'e2e-ours',
        'e2e-hf',
        'cold',
        'ready_s',
        '<=',
        E2E_BOUND(0.7),
    ),
    Target(
        '6. cold: load_model(mmap=True) / from_pretrained, start -> logits',
        'e2e-ours-mmap',
        'e2e-hf',
        'cold',
        'ready_s',
        '<=',
        E2E_BOUND(0.7),
    ),
    *_per_cache('warm'),
    *_per_cache('cold'),
    Target('5. cuda: ours GB/s / pinned host-to-device GB/s', 'ours-cuda', 'h2d-pinned', op='>=', limit=0.8),
    Target(
        "5. cuda: ours time / from_pretrained(device_map='cuda') time",
        'ours-cuda',
        'hf-cuda',
        key='ready_s',
        op='<=',
        limit=0.5,
    ),
    Target('   cuda: InstantTensor time / ours time', 'instanttensor-cuda', 'ours-cuda', key='ready_s'),
    Target(
        '4. cuda: ours host peak RSS growth, MiB (bound: 2 staging chunks + 64 MiB)',
        'ours-cuda',
        None,
        key='peak_rss',
        op='<=',
        limit=(2 * CHUNK + 64 * MiB) / MiB,
        scale=MiB,
    ),
    Target(
        '3. ours us per tensor beyond building the module', 'many-ours', None, key='us_per_tensor', op='<=', limit=20
    ),
    Target('   load_file + load_state_dict(assign) time / ours time', 'many-st', 'many-ours', key='load_s'),
    Target('   from_pretrained time / ours (build on meta + load) time', 'llama-hf', 'llama-ours', key='ready_s'),
]


def _rows(t: Target, summary, ck) -> list:
    "The one line of Target `t` on checkpoint `ck`, or none when a method it names did not run there."
    x = _get(summary, ck, t.cache, t.a)
    y = x and (_get(summary, ck, t.cache, t.b) if t.b else {t.key: t.scale})
    if not (x and y):
        return []
    limit = t.limit.get(ck) if isinstance(t.limit, dict) else t.limit
    return [(t.cache, t.name, x[t.key] / y[t.key], t.op, limit)]


def targets(summary: list[dict], ckpts: dict) -> list[dict]:
    "The targets (op and limit set) and the ratios that explain them (limit None), per checkpoint and cache state."
    out = []
    for ck in ckpts:
        for t in TARGETS:
            for cache, name, value, op, limit in (
                _rows(t, summary, ck) if isinstance(t, Target) else t(summary, ckpts, ck)
            ):
                met = None if limit is None else (value >= limit if op == '>=' else value <= limit)
                out.append(dict(ckpt=ck, cache=cache, target=name, value=value, op=op, limit=limit, met=met))
    return out


def table(summary: list[dict]) -> str:
    head = (
        f"{'checkpoint':<24} {'cache':<5} {'method':<16} {'build s':>7} {'load s':>7} {'touch s':>7} {'ready s':>7} "
        f"{'(min-max)':>13} {'GB/s':>6} {'us/tens':>7} {'peak MB':>8} {'x bytes':>7} {'anon MB':>8} {'file MB':>8} "
        f"{'read MB':>8}"
    )
    lines = [head, '-' * len(head)]

    def f(v, spec):
        return format(v, spec) if v is not None else '-'

    for s in summary:
        lines.append(
            f"{s['ckpt']:<24} {s['cache']:<5} {s['method']:<16} {f(s['construct_s'], '7.3f'):>7} {s['load_s']:7.3f} "
            f"{s['touch_s']:7.3f} {s['ready_s']:7.3f} "
            f"{s['ready_min_s']:6.3f}-{s['ready_max_s']:<6.3f} {s['gbps']:6.2f} {s['us_per_tensor']:7.1f} "
            f"{s['peak_rss'] / 1e6:8.0f} {s['rss_x_bytes']:7.2f} "
            f"{f(s['anon_delta'] and s['anon_delta'] / 1e6, '8.0f'):>8} "
            f"{f(s['file_delta'] and s['file_delta'] / 1e6, '8.0f'):>8} "
            f"{f(s['rchar'] and s['rchar'] / 1e6, '8.0f'):>8}"
        )
    return '\n'.join(lines)


def plot(summary: list[dict], ckpts: dict, path: Path):
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    big = [c for c in ckpts if c not in (*SMALL, MOE_NAME) and any(s['ckpt'] == c for s in summary)]
    many = [s for s in summary if s['ckpt'] in SMALL]
    rows = len(big) + (1 if many else 0)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.8 * rows), squeeze=False)
    for row, ck in zip(axes, big, strict=False):  # with many-tensor files, axes has one more row, for them
        methods = [
            m.name
            for m in METHODS
            if BIG[0] in m.on and not m.e2e and (_get(summary, ck, 'warm', m.name) or _get(summary, ck, 'cold', m.name))
        ]
        w = 0.38
        for off, cache, hatch in ((-w / 2, 'warm', None), (w / 2, 'cold', '//')):
            rs = [_get(summary, ck, cache, m) for m in methods]
            if not any(rs):
                continue
            xs = [i + off for i in range(len(methods))]
            row[0].bar(
                xs,
                [r['gbps'] if r else 0 for r in rs],
                w,
                color='tab:blue' if cache == 'warm' else 'tab:cyan',
                hatch=hatch,
                edgecolor='white',
                label=f'{cache} cache',
            )
            row[1].bar(
                xs,
                [r['rss_x_bytes'] if r else 0 for r in rs],
                w,
                color='tab:green' if cache == 'warm' else 'tab:olive',
                hatch=hatch,
                edgecolor='white',
                label=f'{cache} cache',
            )
        row[1].axhline(1.05, color='k', ls='--', lw=1, label='target for ours: 1.05')
        for ax, title in zip(
            row,
            ('GB/s on ready time (load + first touch), median', 'peak RSS above baseline / checkpoint bytes, median'),
            strict=True,
        ):
            ax.set_xticks(range(len(methods)))
            ax.set_xticklabels(methods, rotation=25, ha='right', fontsize=8)
            ax.set_title(f"{ck} ({ckpts[ck]['bytes'] / 1e9:.2f} GB, {ckpts[ck]['shards']} shards): {title}", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(axis='y', alpha=0.3)
    if many:
        ax = axes[-1][0]
        ax.bar(range(len(many)), [s['us_per_tensor'] for s in many], color='tab:purple')
        ax.axhline(20, color='k', ls='--', lw=1, label='target for ours: 20 us')
        ax.set_xticks(range(len(many)))
        ax.set_xticklabels([f"{s['method']}" for s in many], rotation=25, ha='right', fontsize=8)
        ax.set_title('20,000 small tensors: load time per tensor, us (construction apart, except llama-hf)', fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis='y', alpha=0.3)
        ax.set_yscale('log')
        axes[-1][1].axis('off')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------- main
def _checkpoints(no_synth: bool, no_moe: bool, no_many: bool) -> dict:
    "{name: its figures and path} of the checkpoints this run measures, built once when missing."
    dirs = {}
    try:
        dirs[SMOL] = built(SMOL_NAME)
    except Exception as e:
        print(f'SmolLM2 skipped: {type(e).__name__}: {e}')
    if not no_synth:
        dirs[SYNTH] = built(SYNTH_NAME)
    if not no_moe:
        from bench_moe_load import checkpoint as moe_checkpoint

        dirs[MOE_NAME] = moe_checkpoint()
    if not no_many:
        dirs[MANY_NAME], dirs[LLAMA20K_NAME] = built(MANY_NAME), built(LLAMA20K_NAME)
    ckpts = {}
    for name, d in dirs.items():
        ts = checkpoint_tensors(d)
        ckpts[name] = dict(
            path=str(d),
            bytes=sum(t['nbytes'] for t in ts),
            tensors=len(ts),
            shards=len({t['file'] for t in ts}),
            max_shard=max(sum(t['nbytes'] for t in ts if t['file'] == f) for f in {t['file'] for t in ts}),
            file_bytes=sum(p.stat().st_size for p in d.glob('*.safetensors')),
        )
    return ckpts


def _wanted(methods: str, has_gpu: bool) -> list:
    "The methods asked for (all by default), less the CUDA ones without a GPU and those whose module is missing."
    wanted = [m for m in methods.split(',') if m] or ALL_METHODS
    unknown = set(wanted) - set(ALL_METHODS)
    if unknown:
        raise SystemExit(f'unknown methods {sorted(unknown)}; known: {ALL_METHODS}')
    out = []
    for name in wanted:
        m = METHOD[name]
        if m.gpu and not has_gpu:
            continue
        module = m.requires.partition('==')[0]
        if module and subprocess.run([sys.executable, '-c', f'import {module}'], capture_output=True).returncode:
            print(f'{name} skipped: {module} is not installed (pip install {m.requires})')
            continue
        out.append(name)
    return out


def _plan(name: str, cold: bool, rep: int, wanted: list) -> list:
    """The methods of one round, in an order shuffled per round: on a VM that hands freed memory back to the host, a
    run's speed depends on what ran before it."""
    cache = 'cold' if cold else 'warm'
    ms = [m.name for m in METHODS if name in m.on and cache in m.caches and m.name in wanted]
    random.Random(rep).shuffle(ms)
    return [m for m in ms if not (METHOD[m].once and rep)]


def _rounds(ckpts: dict, wanted: list, repeats: int, cold_repeats: int, spawn: bool) -> list:
    "Every run: `repeats` warm rounds over every checkpoint, then `cold_repeats` cold ones."
    runs = []

    def go(name, m, cold):
        r = run_one(dict(method=m, ckpt=ckpts[name]['path'], ckpt_name=name, cold=cold), spawn)
        runs.append(r)
        print(
            f"  {name:<24} {'cold' if cold else 'warm'} {m:<16} load {r['load_s']:7.3f} s  "
            f"touch {r['touch_s']:6.3f} s  peak +{r['peak_rss'] / 1e6:6.0f} MB",
            flush=True,
        )

    for rep in range(repeats):
        print(f'warm page cache, round {rep + 1}/{repeats}', flush=True)
        for name in ckpts:
            read_files(_files(checkpoint_tensors(Path(ckpts[name]['path']))))
            for m in _plan(name, False, rep, wanted):
                go(name, m, False)
    for rep in range(cold_repeats):
        print(f'cold page cache, round {rep + 1}/{cold_repeats}', flush=True)
        for name in ckpts:
            for m in _plan(name, True, rep, wanted):
                go(name, m, True)
    return runs


def _report(env: dict, ckpts: dict, summary: list, tg: list, bad: list):
    "Print the run's setting, the table, the targets and whether every load held the checkpoint's bytes."
    print(
        f"\n{env['cpus']} CPUs, {env['mem_gb']} GB; torch {env['torch']}, transformers {env['transformers']}, "
        f"safetensors {env['safetensors']}; "
        f"ours with {env['threads']} reader threads; runs are fresh {env['process']}ed processes; "
        f"{env['repeats']} warm, {env['cold_repeats']} cold repeats, medians"
    )
    for name, c in ckpts.items():
        print(f"{name}: {c['bytes'] / 1e6:.0f} MB of tensors in {c['shards']} shards, {c['tensors']} tensors")
    print(
        'ready = load call + first touch of every page; GB/s = tensor bytes / ready; us/tens = load s / tensors; '
        'peak = RSS above the '
        'pre-load baseline; anon/file = growth of RssAnon/RssFile; read MB = bytes through read(2) (rchar)\n'
    )
    print(table(summary))
    print('\ntargets and ratios (medians):')
    for t in tg:
        mark = '    ' if t['met'] is None else ('MET ' if t['met'] else 'MISS')
        lim = '' if t['limit'] is None else f"  ({t['op']} {t['limit']:g})"
        print(f"  {mark} {t['ckpt']:<24} {t['cache']:<5} {t['target']:<82} {t['value']:7.2f}{lim}")
    print(
        'correctness: '
        + ('every method holds the checkpoint bytes under every key' if not bad else 'MISMATCH ' + '; '.join(bad))
    )


def _write(data: dict, summary: list, ckpts: dict, publish: bool):
    "benchmarks/results/load.json and load.png; with `publish`, load_results.json (no runs) and the docs' image too."
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / 'load.json').write_text(json.dumps(data, indent=1))
    plot(summary, ckpts, RESULTS / 'load.png')
    print(f'\nwrote {RESULTS / "load.json"} and {RESULTS / "load.png"} ({data["wall_s"]} s)')
    if publish:
        (HERE / 'load_results.json').write_text(json.dumps({k: v for k, v in data.items() if k != 'runs'}, indent=1))
        img = HERE.parent / 'nbs' / 'images'
        img.mkdir(exist_ok=True)
        shutil.copy(RESULTS / 'load.png', img / 'bench_load.png')
        print(f'published to {HERE / "load_results.json"} and {img / "bench_load.png"}')


def _gpu_available() -> bool:
    return (
        subprocess.run(
            [sys.executable, '-c', 'import torch; print(torch.cuda.is_available())'], capture_output=True, text=True
        ).stdout.strip()
        == 'True'
    )


@call_parse
def main(
    quick: bool = False,  # SmolLM2 and the 20,000-tensor file, one warm repeat
    repeats: int = 3,  # warm-cache runs per method and checkpoint
    cold_repeats: int = 3,  # cold-cache runs per method and checkpoint (0: none)
    no_synth: bool = False,  # skip the 2.2 GB synthetic checkpoint
    no_many: bool = False,  # skip the 20,000-tensor checkpoints
    no_moe: bool = False,  # skip the 64-expert MoE (end-to-end rows only)
    e2e_only: bool = False,  # only the end-to-end rows, the peers and ours (raw loader)
    gpu: bool = False,  # only the CUDA rows (warm, SmolLM2 and the synthetic checkpoint)
    methods: str = '',  # comma-separated subset of the methods (default: all; CUDA ones only with a GPU)
    spawn: bool = False,  # a new interpreter per run instead of a fork of an imported parent
    publish: bool = False,  # copy results to benchmarks/load_results.json and nbs/images/bench_load.png
    worker_spec: str = '',  # internal: run one measurement (JSON spec)
    build: str = '',  # internal: build one benchmark checkpoint
):
    "Benchmark loading HF safetensors checkpoints: mstar_utils against transformers, safetensors and the read limits."
    if worker_spec:
        _preimport()
        print('RESULT ' + json.dumps(worker(json.loads(worker_spec))))
        return
    if build:
        _build(build)
        return
    if quick:
        repeats, cold_repeats, no_synth = 1, 0, True
    if e2e_only:
        methods, no_many = methods or ','.join(m.name for m in METHODS if m.name == 'ours' or m.peer or m.e2e), True
    has_gpu = _gpu_available()
    if gpu:
        if not has_gpu:
            raise SystemExit('--gpu: no CUDA device')
        methods, cold_repeats, no_many = methods or ','.join(m.name for m in METHODS if m.gpu), 0, True
    ckpts = _checkpoints(no_synth, no_moe, no_many)
    wanted = _wanted(methods, has_gpu)
    if not spawn:
        _preimport()
    env = environment(
        has_gpu,
        process='spawn' if spawn else 'fork',
        repeats=repeats,
        cold_repeats=cold_repeats,
        cache_drop='posix_fadvise(POSIX_FADV_DONTNEED) per file',
    )
    THREADS[0] = env['threads']
    t_start = time.time()
    runs = _rounds(ckpts, wanted, repeats, cold_repeats, spawn)
    bad, summary = verify(runs), summarize(runs, ckpts)
    tg = targets(summary, ckpts)
    _report(env, ckpts, summary, tg, bad)
    for r in runs:
        r.pop('fingerprint', None)
    data = dict(
        env=env,
        checkpoints={k: {**v, 'path': Path(v['path']).name} for k, v in ckpts.items()},
        labels=LABELS,
        summary=summary,
        targets=tg,
        verified=not bad,
        mismatches=bad,
        runs=runs,
        wall_s=round(time.time() - t_start, 1),
    )
    _write(data, summary, ckpts, publish)
    if bad:
        sys.exit(1)
