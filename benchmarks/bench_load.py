#!/usr/bin/env python
"""Load-time benchmark: fill HuggingFace causal LMs from their safetensors shards with mstar_utils, transformers and
safetensors, and print each result as a ratio to the limits measured in the same run (the bare reads of the same bytes).

    python benchmarks/bench_load.py              # full run: SmolLM2, a 2.2 GB synthetic Llama (warm and cold), 20,000-tensor files
    python benchmarks/bench_load.py --quick      # SmolLM2 and the 20,000-tensor file, one warm repeat (a minute or two)
    python benchmarks/bench_load.py --publish    # also copy the results to benchmarks/load_results.json and nbs/images/bench_load.png
    python benchmarks/bench_load.py --gpu        # only the CUDA rows (tools/gpu-check runs this)
    python benchmarks/bench_load.py --e2e_only   # only the end-to-end rows (process start -> first logits) and the peers

The end-to-end rows (`e2e-*`, `call-*`) start a new interpreter per run and time it from the parent's spawn to the first
logits of a 4-token forward pass; they also run on the 64-expert MoE of bench_moe_load.py. The peers (Run:ai model
streamer, fastsafetensors, safetensors load_file with and without a clone) need the `bench` extra (`pip install -e ".[bench]"`).

Each run is a fresh process (forked from a parent that has only imported the libraries; CUDA runs and `--spawn` start a
new interpreter). Prints the table and the targets, writes benchmarks/results/load.json and benchmarks/results/load.png.
"""
from __future__ import annotations
import gc
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

import psutil
from _harness import byte_compile
from fastcore.script import call_parse

HERE = Path(__file__).resolve().parent
RESULTS = HERE/'results'
GB, MiB = 1e9, 1 << 20
CHUNK = 8 << 20  # mstar_utils' staging chunk (FileSource.read_many's chunk_bytes default)

# Synthetic checkpoint: TinyLlama-shaped (1.1 B parameters, 2.2 GB in bf16), random init, untied lm_head.
SYNTH_NAME = 'llama-synth-1.1b-bf16'
SYNTH_CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                    num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5)
SYNTH_SHARD = '400MB'
SMOL_NAME = 'SmolLM2-135M-Instruct-copy'  # mstar_utils.checkpoints.smollm2_checkpoint(), copied
# Many small tensors: 20,000 16x16 fp32 tensors in one file (a ModuleList of Linear layers), and a Llama with as many tensors.
MANY_NAME, MANY_N = 'many-16x16-fp32', 20_000
LLAMA20K_NAME = 'llama-20k-tensors-fp32'
LLAMA20K_CONFIG = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2222, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)  # 2222 x 9 + 3 = 20,001

PEER_METHODS = ['runai', 'fastsafetensors', 'st-load', 'st-clone']
E2E_METHODS = ['e2e-ours', 'e2e-ours-mmap', 'e2e-hf', 'call-ours', 'call-ours-mmap', 'call-hf']
CPU_METHODS = ['hf', 'st-mmap', 'st-pread', 'ours', 'ours-1thread', 'ours-mmap', 'ours-subset',
               'limit-fresh', 'limit-prefaulted', 'limit-thp', 'limit-populate', 'limit-odirect'] + PEER_METHODS + E2E_METHODS
COLD_METHODS = ['hf', 'st-mmap', 'ours', 'ours-1thread', 'ours-mmap', 'ours-subset', 'limit-fresh', 'limit-prefaulted',
                'limit-odirect'] + PEER_METHODS + E2E_METHODS
MOE_NAME = 'qwen3-moe-64x8-bf16'  # bench_moe_load.py's checkpoint: only the end-to-end rows run on it
MOE_METHODS = E2E_METHODS
GPU_METHODS = ['hf-cuda', 'ours-cuda', 'h2d-pinned', 'instanttensor-cuda']
MANY_METHODS = {MANY_NAME: ['many-ours', 'many-st'], LLAMA20K_NAME: ['llama-ours', 'llama-hf']}
ONCE = {'many-st', 'llama-hf'}  # quadratic in the number of modules here (10-100 s a run): measured in the first round only
LABELS = {'hf': '(a) transformers from_pretrained', 'st-mmap': '(b) safetensors load_file (mmap) + load_state_dict(assign=True)',
          'st-pread': "(b') safetensors load_file(backend='pread') + load_state_dict(assign=True)",
          'ours': '(c) ours: load_weights_from_hf_shards (owned memory, default threads)', 'ours-1thread': '(c) ours, one reader thread',
          'ours-mmap': "(c') ours, mmap=True", 'ours-subset': '(c) ours, one ModuleAndPrefix over ~10% of the bytes',
          'limit-fresh': 'limit, fresh memory: one readinto per file into memory allocated and never touched',
          'limit-prefaulted': 'limit, pre-faulted memory: one readinto per file into memory faulted in before the clock (the copy alone)',
          'limit-thp': 'one readinto per file into fresh memory advised MADV_HUGEPAGE (transparent huge pages)',
          'limit-populate': "the page faults alone: fresh memory of the files' size faulted in by MADV_POPULATE_WRITE, split over ours' reader threads (no read)",
          'limit-odirect': 'limit, O_DIRECT: sequential 8 MiB reads of the files around the page cache (the disk alone)',
          'hf-cuda': "(a) from_pretrained(device_map='cuda')", 'ours-cuda': "(c) ours, device='cuda' (pinned staging ring)",
          'h2d-pinned': 'limit, pinned host-to-device copy of the same bytes',
          'instanttensor-cuda': "peer: InstantTensor safe_open(file, framework='pt', device=cuda) per shard + clone of each tensor (device memory)",
          'many-ours': '(c) ours: load_weights_from_file into a meta-built ModuleList of 20,000 Linear(16, 16)',
          'many-st': '(b) safetensors load_file + load_state_dict(assign=True), same module',
          'llama-ours': '(c) ours: build_on_meta + load_weights_from_hf_shards, Llama with 20,001 tensors',
          'llama-hf': '(a) from_pretrained, the same Llama (construction included)',
          'runai': 'peer: Run:ai model streamer, SafetensorsStreamer().stream_files(files, owned=True) (owned memory, a state dict)',
          'fastsafetensors': "peer: fastsafetensors SafeTensorsFileLoader(None, 'cpu', nogds=True) (owned memory: its host buffers, a state dict)",
          'st-load': 'peer: safetensors load_file per shard (page-cache mapping, a state dict)',
          'st-clone': 'peer: safetensors load_file per shard + clone of every tensor (owned memory, a state dict)',
          'e2e-ours': 'process start -> first logits: import torch, from mstar_utils import load_model, load_model(ckpt), a 4-token forward (owned memory)',
          'e2e-ours-mmap': 'process start -> first logits: the same with load_model(ckpt, mmap=True) (page-cache mapping)',
          'e2e-hf': 'process start -> first logits: import torch, from transformers import AutoModelForCausalLM, from_pretrained(ckpt), the forward (page-cache mapping)',
          'call-ours': 'load_model(ckpt) + the forward alone, torch, transformers, mstar_utils and the modeling module imported beforehand (owned memory)',
          'call-ours-mmap': 'load_model(ckpt, mmap=True) + the forward alone, modules imported beforehand (page-cache mapping)',
          'call-hf': 'from_pretrained(ckpt) + the forward alone, modules imported beforehand (page-cache mapping)'}

# ----------------------------------------------------------------------------------------------------------- checkpoints
def cache_root() -> Path:
    from mstar_utils.checkpoints import cache_dir
    return cache_dir()/'bench'

def built(name: str, build: bool = True) -> Path:
    "Folder of a benchmark checkpoint, built once in a child interpreter under `cache_dir()/'bench'`."
    out = cache_root()/name
    if (out/'.complete').exists() or not build: return out
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
        torch.manual_seed(0)
        LlamaForCausalLM._from_config(LlamaConfig(**SYNTH_CONFIG, dtype='bfloat16'), dtype=torch.bfloat16).save_pretrained(tmp, max_shard_size=SYNTH_SHARD)
    def many(tmp):
        from safetensors.torch import save_file
        g = torch.Generator().manual_seed(0)
        Path(tmp).mkdir(parents=True, exist_ok=True)
        save_file({f'{i}.weight': torch.randn(16, 16, generator=g) for i in range(MANY_N)}, str(Path(tmp)/'model.safetensors'))
    def smol_copy(tmp):  # a copy of its own: other processes (tests) map the shared SmolLM2 files, and mapped pages cannot be dropped
        from mstar_utils.checkpoints import smollm2_checkpoint
        shutil.copytree(smollm2_checkpoint(), tmp, dirs_exist_ok=True, copy_function=shutil.copyfile)
    def llama20k(tmp):
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA20K_CONFIG)).save_pretrained(tmp)
    cached_folder('bench', name, {SYNTH_NAME: synth, MANY_NAME: many, LLAMA20K_NAME: llama20k, SMOL_NAME: smol_copy}[name])

def checkpoint_tensors(ckpt: Path) -> list[dict]:
    "Every tensor of the checkpoint: key, file, dtype string, shape, absolute byte offset in the file and byte count; file then offset order."
    index = ckpt/'model.safetensors.index.json'
    files = sorted(set(json.loads(index.read_text())['weight_map'].values())) if index.exists() else ['model.safetensors']
    out = []
    for name in files:
        path = ckpt/name
        with open(path, 'rb') as f:
            n = int.from_bytes(f.read(8), 'little')
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k == '__metadata__': continue
            b, e = v['data_offsets']
            out.append(dict(key=k, file=str(path), dtype=v['dtype'], shape=v['shape'], offset=8 + n + b, nbytes=e - b))
    return sorted(out, key=lambda t: (t['file'], t['offset']))

def read_files(paths):
    "Read every file once so the page cache holds it; `paths`: files, or a checkpoint folder."
    if isinstance(paths, (str, Path)) and Path(paths).is_dir(): paths = sorted(Path(paths).glob('*.safetensors'))
    for p in paths:
        with open(p, 'rb', buffering=0) as f:
            while f.read(64 << 20): pass

def drop_cache(paths, tries: int = 5) -> str | None:
    "Drop these files' pages from the page cache (posix_fadvise DONTNEED, after fdatasync), retried while another process still maps some; the error text when some stay."
    for i in range(tries):
        err = _drop(paths)
        if err is None: return None
        time.sleep(0.5)
    return err

def _drop(paths) -> str | None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try: os.fdatasync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally: os.close(fd)
    left = cached_bytes(paths)
    return None if left < 0.01*sum(os.path.getsize(p) for p in paths) else f'{left/1e6:.0f} MB still cached after POSIX_FADV_DONTNEED'

def cached_bytes(paths) -> int:
    "Bytes of the files `paths` that sit in the page cache (mincore(2) over a fresh read-only mapping, which faults nothing in)."
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes, libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p], [ctypes.c_void_p, ctypes.c_size_t]
    page, total = mmap.PAGESIZE, 0
    for p in paths:
        size = os.path.getsize(p)
        if not size: continue
        with open(p, 'rb') as f:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if addr in (None, ctypes.c_void_p(-1).value): raise OSError(ctypes.get_errno(), f'mmap {p}')
            try:
                vec = ctypes.create_string_buffer((size + page - 1)//page)
                if libc.mincore(addr, size, vec): raise OSError(ctypes.get_errno(), f'mincore {p}')
                total += sum(b & 1 for b in vec.raw)*page
            finally: libc.munmap(addr, size)
    return total

# --------------------------------------------------------------------------------------------------------------- memory
def _status() -> dict:
    "VmRSS, VmHWM, RssAnon, RssFile of this process in bytes (/proc/self/status)."
    out = {}
    with open('/proc/self/status') as f:
        for line in f:
            k, _, v = line.partition(':')
            if k in ('VmRSS', 'VmHWM', 'RssAnon', 'RssFile'): out[k] = int(v.split()[0])*1024
    return out

def _reset_hwm() -> bool:
    "Reset VmHWM (the peak RSS that ru_maxrss reports) to the current RSS (`echo 5 > /proc/self/clear_refs`)."
    try:
        with open('/proc/self/clear_refs', 'w') as f: f.write('5')
        return True
    except OSError: return False

class RssSampler:
    "Largest RSS seen by a thread that samples this process every `interval` seconds (psutil)."
    def __init__(self, interval=0.001):
        self.interval, self.peak, self._stop, self._proc = interval, 0, threading.Event(), psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)
    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval)
    def __enter__(self): self.peak = self._proc.memory_info().rss; self._thread.start(); return self
    def __exit__(self, *a):
        self._stop.set(); self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

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
    "Sum of ~4k bytes sampled evenly across the tensor's memory: equal for equal bytes, and different when an offset is wrong."
    import torch
    b = t.detach().reshape(-1).view(torch.uint8)
    return int(b[::max(1, b.numel()//4093)].sum(dtype=torch.int64))

def _touch(tensors) -> None:
    "Read one byte of every 4 KiB page of each tensor: pages an mmap left unread are faulted in here."
    import torch
    seen = set()
    for t in tensors:
        if t.device.type != 'cpu' or t.is_meta: continue
        ptr = (t.data_ptr(), t.numel())  # tensors may share one storage (a whole mmapped file): tell them apart by their own memory
        if ptr in seen: continue
        seen.add(ptr)
        t.detach().reshape(-1).view(torch.uint8)[::4096].sum(dtype=torch.int64)

def _no_meta(model, what):
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left: raise RuntimeError(f'{what}: {len(left)} tensors still on meta, e.g. {left[:3]}')

def _file_buffers(method, files) -> dict:
    "Destination memory for the per-file limits: fresh, faulted in, or advised for huge pages; pinned for the H2D limit."
    import torch
    out = {}
    for f in files:
        n = os.path.getsize(f)
        if method in ('limit-thp', 'limit-populate'):  # page-aligned fresh memory
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if method == 'limit-thp': m.madvise(mmap.MADV_HUGEPAGE)
            out[f] = torch.frombuffer(m, dtype=torch.uint8)
        else: out[f] = torch.empty(n, dtype=torch.uint8, pin_memory=method == 'h2d-pinned')
        if method in ('limit-prefaulted', 'h2d-pinned'): out[f].fill_(1)  # every page mapped before the clock
    return out

def _read_file(f, buf):
    "One readinto of the whole file `f` into `buf` (restarted only if the kernel returns less)."
    with open(f, 'rb', buffering=0) as fh:
        view, got = memoryview(buf.numpy()), 0
        while got < len(view):
            n = fh.readinto(view[got:])
            if not n: raise EOFError(f)
            got += n

def _populate_threads(bufs: dict):
    "Fault in every page of the buffers with madvise(MADV_POPULATE_WRITE), in page-aligned pieces spread over `default_threads()` threads (ctypes releases the GIL)."
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
        if libc.madvise(p[0], p[1], 23): raise OSError(ctypes.get_errno(), 'madvise(MADV_POPULATE_WRITE) failed')
    with ThreadPoolExecutor(T) as ex: list(ex.map(pop, pieces))

def _read_odirect(files):
    "Sequential 8 MiB O_DIRECT reads of each file into one reused page-aligned buffer: the disk's bandwidth without the page cache."
    buf = mmap.mmap(-1, 8 << 20)
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            while os.readv(fd, [buf]) == len(buf): pass
        finally: os.close(fd)

def _construct(method, ckpt, tensors, res):
    "Build what the method loads into, before the clock: (model, module the load fills, per-file buffers)."
    import torch
    model = sub = bufs = None
    if method in ('st-mmap', 'st-pread', 'ours', 'ours-1thread', 'ours-mmap', 'ours-subset', 'ours-cuda', 'llama-ours'):
        model = _meta_model(ckpt, torch.float32 if method == 'llama-ours' else None)
        if method == 'ours-subset':
            per_layer = {}
            for t in tensors:
                if t['key'].startswith('model.layers.'): i = int(t['key'].split('.')[2]); per_layer[i] = per_layer.get(i, 0) + t['nbytes']
            k = max(1, round(0.10*sum(t['nbytes'] for t in tensors)/per_layer[0]))
            sub = torch.nn.ModuleList(list(model.model.layers[:k]))  # names 0.self_attn...: the checkpoint's under 'model.layers.'
            res['subset_layers'], res['subset_bytes'] = k, sum(per_layer[i] for i in range(k))
    elif method in ('many-ours', 'many-st'):
        with torch.device('meta'): model = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(MANY_N))
    elif method.startswith('limit') and method != 'limit-odirect' or method == 'h2d-pinned':
        bufs = _file_buffers(method, sorted({t['file'] for t in tensors}))
    return model, sub, bufs

def _load(method, ckpt, tensors, model, sub, bufs):
    "The timed part: the model (for from_pretrained) and what the method loaded into `model`/`sub`/`bufs`."
    import torch
    from mstar_utils.loading import ModuleAndPrefix, load_weights_from_file, load_weights_from_hf_shards, load_from_source
    from mstar_utils.sources import checkpoint_source
    files = sorted({t['file'] for t in tensors})
    if method in ('hf', 'hf-cuda', 'llama-hf'):
        from transformers import AutoModelForCausalLM
        kw = dict(device_map='cuda') if method == 'hf-cuda' else {}
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32 if method == 'llama-hf' else torch.bfloat16, **kw)
    if method in PEER_METHODS or method == 'instanttensor-cuda': return _load_peer(method, files)
    if method in ('st-mmap', 'st-pread', 'many-st'):
        from safetensors.torch import load_file
        sd = {}
        for f in files: sd.update(load_file(f, backend='pread' if method == 'st-pread' else 'mmap'))
        r = model.load_state_dict(sd, assign=True, strict=False)
        if hasattr(model, 'tie_weights'): model.tie_weights()  # assign replaced the embedding the tied lm_head pointed at
        if r.unexpected_keys: raise RuntimeError(f'{method}: unexpected keys {r.unexpected_keys[:3]}')  # missing: tied, checked by _no_meta
    elif method in ('ours', 'ours-mmap', 'ours-cuda', 'llama-ours'):
        load_weights_from_hf_shards(ckpt, [ModuleAndPrefix(model)], device='cuda' if method == 'ours-cuda' else 'cpu', progress=False, mmap=method == 'ours-mmap')
    elif method == 'ours-1thread':
        src = checkpoint_source(ckpt, threads=1)
        try: load_from_source(src, [ModuleAndPrefix(model)], progress=False)
        finally: src.close()
    elif method == 'ours-subset': load_weights_from_hf_shards(ckpt, [ModuleAndPrefix(sub, 'model.layers.')], progress=False)
    elif method == 'many-ours': load_weights_from_file(files[0], [ModuleAndPrefix(model)], progress=False)
    elif method == 'limit-odirect': _read_odirect(files)
    elif method == 'limit-populate': _populate_threads(bufs)
    elif method == 'h2d-pinned':
        outs = {f: torch.empty(b.numel(), dtype=torch.uint8, device='cuda') for f, b in bufs.items()}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for f, b in bufs.items(): outs[f].copy_(b, non_blocking=True)
        torch.cuda.synchronize()
        bufs['__h2d_s__'] = time.perf_counter() - t0  # the copy alone, device allocation excluded
    else:
        for f, b in bufs.items(): _read_file(f, b)
    return model

def _load_peer(method, files) -> dict:
    "A state dict {checkpoint key: CPU tensor} of the files, read by one of the peers."
    sd = {}
    if method == 'instanttensor-cuda':
        import torch
        from instanttensor import safe_open
        for f in files:
            with safe_open(f, framework='pt', device=torch.cuda.current_device()) as fh:
                sd.update((k, t.clone()) for k, t in fh.tensors())  # its tensors view a buffer it reuses
    elif method == 'runai':
        from runai_model_streamer import SafetensorsStreamer
        with SafetensorsStreamer() as s:
            s.stream_files(files, owned=True)
            sd.update(s.get_tensors())
    elif method == 'fastsafetensors':
        from fastsafetensors import SafeTensorsFileLoader
        loader = SafeTensorsFileLoader(None, 'cpu', nogds=True)
        loader.add_filenames({0: files})
        fb = loader.copy_files_to_device()
        sd = {k: fb.get_tensor(k) for k in loader.get_keys()}  # the tensors keep their host buffer after close
        fb.close(); loader.close()
    else:
        from safetensors.torch import load_file
        for f in files: sd.update(load_file(f))
        if method == 'st-clone': sd = {k: v.clone() for k, v in sd.items()}
    return sd

def worker(spec: dict) -> dict:
    "One measured load in this (fresh) process; returns the metrics."
    import torch
    import mstar_utils.loading  # noqa: F401 (before the clock, as the parent imports it)
    method, ckpt, cold = spec['method'], Path(spec['ckpt']), spec['cold']
    tensors = checkpoint_tensors(ckpt)
    files = sorted({t['file'] for t in tensors})
    res = dict(method=method, ckpt=spec['ckpt_name'], cold=cold, construct_s=None, subset_bytes=None, tensors=len(tensors))
    if method in GPU_METHODS: torch.cuda.init(); torch.empty(1, device='cuda'); torch.cuda.synchronize()  # the CUDA context is no part of a load
    t0 = time.perf_counter()
    model, sub, bufs = _construct(method, ckpt, tensors, res)
    if method not in ('hf', 'hf-cuda', 'llama-hf'): res['construct_s'] = time.perf_counter() - t0
    gc.collect()
    if cold:
        err = drop_cache(files)
        if err: print(f'warning: {spec}: {err} (a process outside the benchmark maps the files); measured anyway', file=sys.stderr)
    proc = psutil.Process()
    io0, st0 = proc.io_counters(), _status()
    res['hwm_reset'] = _reset_hwm()
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        model = _load(method, ckpt, tensors, model, sub, bufs)
        sd = model if isinstance(model, dict) else None  # a peer's state dict
        if sd is not None: model = None
        if method in GPU_METHODS: torch.cuda.synchronize()
        res['load_s'] = time.perf_counter() - t0
        if method == 'h2d-pinned': res['load_s'] = bufs.pop('__h2d_s__')
        t0 = time.perf_counter()
        owned = list(bufs.values()) if bufs else list(sd.values()) if sd is not None else [] if model is None else list((sub or model).state_dict().values())
        _touch(owned)
        res['touch_s'] = time.perf_counter() - t0
    io1, st1 = proc.io_counters(), _status()
    res['cached_after'] = cached_bytes(files) if cold else None  # what the load pulled in from the disk
    res['ready_s'] = res['load_s'] + res['touch_s']
    base = st0['VmRSS']
    res.update(baseline_rss=base, peak_sampled=sampler.peak - base, peak_hwm=st1['VmHWM'] - base if res['hwm_reset'] else None,
               anon_delta=st1['RssAnon'] - st0['RssAnon'], file_delta=st1['RssFile'] - st0['RssFile'],
               rchar=io1.read_chars - io0.read_chars, read_bytes=io1.read_bytes - io0.read_bytes)
    res['peak_rss'] = max(res['peak_sampled'], res['peak_hwm'] or 0)
    # ---- correctness: every method must hold the checkpoint's bytes under the checkpoint's keys
    if model is not None: _no_meta(sub if sub is not None else model, method)
    if bufs: res['fingerprint'] = {t['key']: _fingerprint(bufs[t['file']][t['offset']:t['offset'] + t['nbytes']]) for t in tensors}
    elif sd is not None: res['fingerprint'] = {k: _fingerprint(v) for k, v in sd.items()}
    elif model is not None:
        sd = sub.state_dict() if sub is not None else model.state_dict()
        pre = 'model.layers.' if sub is not None else ''
        keys = {t['key'] for t in tensors}
        res['fingerprint'] = {pre + k: _fingerprint(v.cpu()) for k, v in sd.items() if pre + k in keys}
    else: res['fingerprint'] = None
    if method in ('h2d-pinned', 'limit-populate'): res['fingerprint'] = None  # nothing read: no bytes to check
    return res

E2E_CHILD = r'''
import json, sys, time
method, ckpt = sys.argv[1], sys.argv[2]
def status():
    out = {}
    with open('/proc/self/status') as f:
        for line in f:
            k, _, v = line.partition(':')
            if k in ('VmRSS', 'VmHWM'): out[k] = int(v.split()[0]) * 1024
    return out
t_before = time.time()
if method.startswith('call-'):  # the modules imported before the clock
    import torch, transformers, mstar_utils
    from transformers import AutoConfig, AutoModelForCausalLM
    from mstar_utils import load_model
    getattr(transformers, AutoConfig.from_pretrained(ckpt).architectures[0])
    open('/proc/self/clear_refs', 'w').write('5')  # VmHWM from here
    t_before = time.time()
base = status()['VmRSS']
import torch
if method.endswith('-hf'):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt)
else:
    from mstar_utils import load_model
    model = load_model(ckpt, mmap=method.endswith('-mmap'))
t_loaded = time.time()
with torch.inference_mode(): logits = model(torch.tensor([[1, 2, 3, 4]])).logits
t_logits = time.time()
st = status()
print('RESULT ' + json.dumps(dict(t_before=t_before, t_loaded=t_loaded, t_logits=t_logits, base=base, hwm=st['VmHWM'],
                                  dtype=str(model.dtype), logits=[float(x) for x in logits[0, -1, :8].float()])))
'''

def run_e2e(spec: dict) -> dict:
    "One end-to-end run in a new interpreter: spawn -> first logits (e2e-*), or the call and forward alone (call-*)."
    method, ckpt = spec['method'], spec['ckpt']
    files = sorted(str(p) for p in Path(ckpt).glob('*.safetensors'))
    if spec['cold']:
        err = drop_cache(files)
        if err: print(f'warning: {spec}: {err} (a process outside the benchmark maps the files); measured anyway', file=sys.stderr)
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'TOKENIZERS_PARALLELISM': 'false', 'TRANSFORMERS_VERBOSITY': 'error',
           'HF_HUB_DISABLE_PROGRESS_BARS': '1'}
    t0 = time.time()
    p = subprocess.run([sys.executable, '-c', E2E_CHILD, method, ckpt], capture_output=True, text=True, env=env)
    line = next((l for l in reversed(p.stdout.splitlines()) if l.startswith('RESULT ')), None)
    if p.returncode or line is None: raise RuntimeError(f'{spec}: end-to-end run failed\n{p.stderr[-3000:]}')
    r = json.loads(line[7:])
    start = r['t_before'] if method.startswith('call-') else t0
    peak = r['hwm'] - r['base'] if method.startswith('call-') else r['hwm']
    return dict(method=method, ckpt=spec['ckpt_name'], cold=spec['cold'], construct_s=None, subset_bytes=None, load_s=r['t_loaded'] - start,
                touch_s=r['t_logits'] - r['t_loaded'], ready_s=r['t_logits'] - start, peak_rss=peak, peak_sampled=None, peak_hwm=peak,
                anon_delta=None, file_delta=None, rchar=None, read_bytes=None, cached_after=None, fingerprint=None,
                logits=r['logits'], dtype=r['dtype'])

def _child(spec, conn):
    try: conn.send(('ok', worker(spec)))
    except BaseException: conn.send(('error', traceback.format_exc()))
    finally: conn.close()

def run_one(spec: dict, spawn: bool) -> dict:
    "Run `worker(spec)` in a fresh process: forked (imports shared with the parent) or a new interpreter (`spawn`, always for CUDA)."
    if spawn or spec['method'] in GPU_METHODS:
        p = subprocess.run([sys.executable, __file__, '--worker_spec', json.dumps(spec)], capture_output=True, text=True)
        line = next((l for l in reversed(p.stdout.splitlines()) if l.startswith('RESULT ')), None)
        if p.returncode or line is None: raise RuntimeError(f'{spec}: worker failed\n{p.stderr[-3000:]}')
        return json.loads(line[7:])
    import multiprocessing as mp
    ctx = mp.get_context('fork')
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec, send))
    proc.start(); send.close()
    status, payload = recv.recv()
    proc.join()
    if status != 'ok': raise RuntimeError(f'{spec}: worker failed\n{payload}')
    return payload

# -------------------------------------------------------------------------------------------------------------- summary
ALL_METHODS = CPU_METHODS + GPU_METHODS + [m for ms in MANY_METHODS.values() for m in ms]
ALL_METHODS = list(dict.fromkeys(ALL_METHODS))

def _med(rows, k):
    vals = [r[k] for r in rows if r.get(k) is not None]
    return statistics.median(vals) if vals else None

def summarize(runs: list[dict], ckpts: dict) -> list[dict]:
    out = []
    keys = sorted({(r['ckpt'], r['cold'], r['method']) for r in runs}, key=lambda k: (list(ckpts).index(k[0]), k[1], ALL_METHODS.index(k[2])))
    for ck, cold, m in keys:
        rows = [r for r in runs if (r['ckpt'], r['cold'], r['method']) == (ck, cold, m)]
        nbytes = rows[0]['subset_bytes'] or ckpts[ck]['bytes']
        s = dict(ckpt=ck, cache='cold' if cold else 'warm', method=m, label=LABELS[m], n=len(rows), bytes=nbytes)
        for k in ('construct_s', 'load_s', 'touch_s', 'ready_s', 'peak_rss', 'peak_sampled', 'peak_hwm', 'anon_delta', 'file_delta', 'rchar', 'read_bytes', 'cached_after'):
            s[k] = _med(rows, k)
        s['ready_min_s'], s['ready_max_s'] = min(r['ready_s'] for r in rows), max(r['ready_s'] for r in rows)
        s['gbps'] = nbytes/GB/s['ready_s']
        s['us_per_tensor'] = s['load_s']/ckpts[ck]['tensors']*1e6
        s['rss_x_bytes'] = s['peak_rss']/nbytes
        out.append(s)
    return out

def verify(runs: list[dict]) -> list[str]:
    "Methods whose bytes differ, for some key, from those a plain readinto of the file got (limit-fresh, or ours where no limit ran); end-to-end runs whose logits differ from from_pretrained's."
    bad = []
    for r in runs:
        ref = next((x for x in runs if x['ckpt'] == r['ckpt'] and x['method'] == 'e2e-hf'), None)
        if r.get('logits') is None or ref is None: continue
        if r['dtype'] != ref['dtype'] or len(r['logits']) != len(ref['logits']) or any(
                abs(a - b) > 1e-3 * (1 + abs(b)) for a, b in zip(r['logits'], ref['logits'], strict=True)):
            bad.append(f"{r['ckpt']}/{r['method']}: first logits {r['logits'][:3]} ({r['dtype']}) differ from from_pretrained's {ref['logits'][:3]}")
    for r in runs:
        if not r.get('fingerprint'): continue
        ref = next((x['fingerprint'] for x in runs if x['ckpt'] == r['ckpt'] and x['method'] == 'limit-fresh'), None)
        ref = ref or next((x['fingerprint'] for x in runs if x['ckpt'] == r['ckpt'] and x['method'] == 'ours'), None)
        if ref is None: continue
        if r['method'] != 'ours-subset' and set(r['fingerprint']) != set(ref):
            bad.append(f"{r['ckpt']}/{r['method']}: keys differ from the checkpoint's"); continue
        diff = [k for k, v in r['fingerprint'].items() if ref.get(k) != v]
        if diff: bad.append(f"{r['ckpt']}/{r['method']}: bytes differ for {diff[:3]}")
    return bad

def _get(summary, ck, cache, m): return next((s for s in summary if (s['ckpt'], s['cache'], s['method']) == (ck, cache, m)), None)

THREADS = [1]  # the reader threads of the run (set by main from the environment it records)

def targets(summary: list[dict], ckpts: dict) -> list[dict]:
    "The targets (op and limit set) and the ratios that explain them (limit None), per checkpoint and cache state."
    out = []
    def add(ck, cache, name, value, op=None, limit=None):
        met = None if limit is None else (value >= limit if op == '>=' else value <= limit)
        out.append(dict(ckpt=ck, cache=cache, target=name, value=value, op=op, limit=limit, met=met))
    def ratio(ck, cache, a, b, name, op=None, limit=None, key='gbps'):
        x, y = _get(summary, ck, cache, a), _get(summary, ck, cache, b)
        if x and y: add(ck, cache, name, x[key]/y[key], op, limit)
    for ck in ckpts:
        ratio(ck, 'warm', 'ours', 'limit-prefaulted', '1. warm: ours GB/s / readinto per file into pre-faulted memory', '>=', 0.8)
        ratio(ck, 'warm', 'ours', 'limit-fresh', '   warm: ours GB/s / readinto per file into fresh memory')
        ratio(ck, 'warm', 'ours-1thread', 'limit-fresh', '   warm: ours with one thread GB/s / readinto into fresh memory')
        ratio(ck, 'warm', 'limit-fresh', 'limit-prefaulted', '   warm: fresh memory / pre-faulted memory (the page-fault cost)')
        ratio(ck, 'warm', 'limit-thp', 'limit-fresh', '   warm: huge-page-advised memory / fresh memory')
        pop, pre = _get(summary, ck, 'warm', 'limit-populate'), _get(summary, ck, 'warm', 'limit-prefaulted')
        if pop and pre:  # faults (measured on all threads) plus the copy (measured on one, assumed to scale with the threads)
            T = max(1, THREADS[0])
            bound = 1 / (1 / pop['gbps'] + 1 / (T * pre['gbps']))
            add(ck, 'warm', f'   warm: owned-memory bound on {T} threads (populate, then copy) / pre-faulted readinto', bound / pre['gbps'])
            o = _get(summary, ck, 'warm', 'ours')
            if o: add(ck, 'warm', '   warm: ours GB/s / that owned-memory bound', o['gbps'] / bound)
        ratio(ck, 'warm', 'ours', 'hf', '   warm: ours GB/s / from_pretrained GB/s (ready time)')
        ratio(ck, 'warm', 'ours-mmap', 'hf', '   warm: ours mmap=True GB/s / from_pretrained GB/s')
        ratio(ck, 'cold', 'ours', 'limit-odirect', '2. cold: ours GB/s / O_DIRECT sequential read', '>=', 0.9)
        ratio(ck, 'cold', 'ours-mmap', 'limit-odirect', '2. cold: ours mmap=True GB/s (ready) / O_DIRECT', '>=', 0.9)
        ratio(ck, 'cold', 'limit-prefaulted', 'limit-odirect', '   cold profile: page-cache readinto into pre-faulted memory / O_DIRECT')
        ratio(ck, 'cold', 'limit-fresh', 'limit-odirect', '   cold profile: page-cache readinto into fresh memory / O_DIRECT')
        ratio(ck, 'cold', 'ours-1thread', 'limit-odirect', '   cold: ours with one thread / O_DIRECT')
        for cache in ('warm', 'cold'):
            o = _get(summary, ck, cache, 'ours')
            if o: add(ck, cache, '4. ours peak RSS above baseline / checkpoint bytes', o['rss_x_bytes'], '<=', 1.05)
        big = ck in ('SmolLM2-135M', 'Llama-synth-1.1B')
        e2e = 0.5 if ck == MOE_NAME else None
        ratio(ck, 'warm', 'e2e-ours', 'e2e-hf', '6. warm: load_model / from_pretrained, process start -> first logits', '<=', 1.0 if big else e2e, key='ready_s')
        ratio(ck, 'warm', 'e2e-ours-mmap', 'e2e-hf', '6. warm: load_model(mmap=True) / from_pretrained, start -> logits', '<=', 0.9 if big else e2e, key='ready_s')
        ratio(ck, 'cold', 'e2e-ours', 'e2e-hf', '6. cold: load_model / from_pretrained, start -> logits', '<=', 0.7 if big else e2e, key='ready_s')
        ratio(ck, 'cold', 'e2e-ours-mmap', 'e2e-hf', '6. cold: load_model(mmap=True) / from_pretrained, start -> logits', '<=', 0.7 if big else e2e, key='ready_s')
        for cache in ('warm', 'cold'):
            ratio(ck, cache, 'call-ours', 'call-hf', f'   {cache}: the call + forward alone, modules imported: load_model / from_pretrained', key='ready_s')
            ratio(ck, cache, 'call-ours-mmap', 'call-hf', f'   {cache}: the call + forward alone: load_model(mmap=True) / from_pretrained', key='ready_s')
            c = _get(summary, ck, cache, 'call-ours')
            if c and ck in ckpts:
                shard = ckpts[ck].get('max_shard', 0) / c['bytes']
                add(ck, cache, f'7. load_model peak RSS above baseline / checkpoint bytes (bound 1.05 + one shard, {shard:.2f})', c['rss_x_bytes'], '<=', round(1.05 + shard, 4))
            for peer in ('runai', 'fastsafetensors'):
                ratio(ck, cache, peer, 'ours', f'8. raw loader: {peer} ready time / ours', '>=', 1.2, key='ready_s')
            ratio(ck, cache, 'st-clone', 'ours', '8. raw loader: load_file + clone ready time / ours', '>=', 1.0, key='ready_s')
            ratio(ck, cache, 'st-load', 'ours', '   raw loader: load_file (mapped, touched) ready time / ours', key='ready_s')
            for peer in ('runai', 'fastsafetensors', 'st-clone'):
                ratio(ck, cache, 'ours', peer, f'8. raw loader: ours peak RSS / {peer} peak RSS (owned memory both)', '<=', 1.0, key='peak_rss')
        ratio(ck, 'warm', 'ours-cuda', 'h2d-pinned', "5. cuda: ours GB/s / pinned host-to-device GB/s", '>=', 0.8)
        ratio(ck, 'warm', 'ours-cuda', 'hf-cuda', "5. cuda: ours time / from_pretrained(device_map='cuda') time", '<=', 0.5, key='ready_s')
        ratio(ck, 'warm', 'instanttensor-cuda', 'ours-cuda', '   cuda: InstantTensor time / ours time', key='ready_s')
        oc = _get(summary, ck, 'warm', 'ours-cuda')
        if oc: add(ck, 'warm', '4. cuda: ours host peak RSS growth, MiB (bound: 2 staging chunks + 64 MiB)', oc['peak_rss']/MiB, '<=', (2*CHUNK + 64*MiB)/MiB)
        if ck == MANY_NAME:
            m = _get(summary, ck, 'warm', 'many-ours')
            if m: add(ck, 'warm', '3. ours us per tensor beyond building the module', m['us_per_tensor'], '<=', 20)
            ratio(ck, 'warm', 'many-st', 'many-ours', '   load_file + load_state_dict(assign) time / ours time', key='load_s')
        if ck == LLAMA20K_NAME:
            ratio(ck, 'warm', 'llama-hf', 'llama-ours', '   from_pretrained time / ours (build on meta + load) time', key='ready_s')
    return out

def table(summary: list[dict]) -> str:
    head = f"{'checkpoint':<24} {'cache':<5} {'method':<16} {'build s':>7} {'load s':>7} {'touch s':>7} {'ready s':>7} {'(min-max)':>13} {'GB/s':>6} {'us/tens':>7} {'peak MB':>8} {'x bytes':>7} {'anon MB':>8} {'file MB':>8} {'read MB':>8}"
    lines = [head, '-'*len(head)]
    f = lambda v, spec: format(v, spec) if v is not None else '-'
    for s in summary:
        lines.append(f"{s['ckpt']:<24} {s['cache']:<5} {s['method']:<16} {f(s['construct_s'], '7.3f'):>7} {s['load_s']:7.3f} {s['touch_s']:7.3f} {s['ready_s']:7.3f} "
                     f"{s['ready_min_s']:6.3f}-{s['ready_max_s']:<6.3f} {s['gbps']:6.2f} {s['us_per_tensor']:7.1f} {s['peak_rss']/1e6:8.0f} {s['rss_x_bytes']:7.2f} "
                     f"{f(s['anon_delta'] and s['anon_delta']/1e6, '8.0f'):>8} {f(s['file_delta'] and s['file_delta']/1e6, '8.0f'):>8} {f(s['rchar'] and s['rchar']/1e6, '8.0f'):>8}")
    return '\n'.join(lines)

def plot(summary: list[dict], ckpts: dict, path: Path):
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    big = [c for c in ckpts if c not in MANY_METHODS and c != MOE_NAME and any(s['ckpt'] == c for s in summary)]
    many = [s for s in summary if s['ckpt'] in MANY_METHODS]
    rows = len(big) + (1 if many else 0)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.8*rows), squeeze=False)
    for row, ck in zip(axes, big, strict=False):   # a last row for the many-tensor files
        methods = [m for m in CPU_METHODS + GPU_METHODS if m not in E2E_METHODS and (_get(summary, ck, 'warm', m) or _get(summary, ck, 'cold', m))]
        w = 0.38
        for off, cache, hatch in ((-w/2, 'warm', None), (w/2, 'cold', '//')):
            rs = [_get(summary, ck, cache, m) for m in methods]
            if not any(rs): continue
            xs = [i + off for i in range(len(methods))]
            row[0].bar(xs, [r['gbps'] if r else 0 for r in rs], w, color='tab:blue' if cache == 'warm' else 'tab:cyan', hatch=hatch, edgecolor='white', label=f'{cache} cache')
            row[1].bar(xs, [r['rss_x_bytes'] if r else 0 for r in rs], w, color='tab:green' if cache == 'warm' else 'tab:olive', hatch=hatch, edgecolor='white', label=f'{cache} cache')
        row[1].axhline(1.05, color='k', ls='--', lw=1, label='target for ours: 1.05')
        for ax, title in zip(row, ('GB/s on ready time (load + first touch), median', 'peak RSS above baseline / checkpoint bytes, median'), strict=True):
            ax.set_xticks(range(len(methods))); ax.set_xticklabels(methods, rotation=25, ha='right', fontsize=8)
            ax.set_title(f"{ck} ({ckpts[ck]['bytes']/1e9:.2f} GB, {ckpts[ck]['shards']} shards): {title}", fontsize=9)
            ax.legend(fontsize=7); ax.grid(axis='y', alpha=.3)
    if many:
        ax = axes[-1][0]
        ax.bar(range(len(many)), [s['us_per_tensor'] for s in many], color='tab:purple')
        ax.axhline(20, color='k', ls='--', lw=1, label='target for ours: 20 us')
        ax.set_xticks(range(len(many))); ax.set_xticklabels([f"{s['method']}" for s in many], rotation=25, ha='right', fontsize=8)
        ax.set_title('20,000 small tensors: load time per tensor, us (construction apart, except llama-hf)', fontsize=9)
        ax.legend(fontsize=7); ax.grid(axis='y', alpha=.3); ax.set_yscale('log')
        axes[-1][1].axis('off')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

# ----------------------------------------------------------------------------------------------------------------- main
def _env(gpu, repeats, cold_repeats, spawn):
    import torch
    import transformers
    import safetensors
    from mstar_utils.sources import default_threads
    return dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                safetensors=safetensors.__version__, cpus=os.cpu_count(), threads=default_threads(), mem_gb=round(psutil.virtual_memory().total/GB, 1),
                machine=platform.machine(), kernel=platform.release(), gpu=gpu, gpu_name=torch.cuda.get_device_name() if gpu else None,
                process='spawn' if spawn else 'fork', repeats=repeats, cold_repeats=cold_repeats, cache_drop='posix_fadvise(POSIX_FADV_DONTNEED) per file',
                bytecode=byte_compile())

@call_parse
def main(quick: bool = False,       # SmolLM2 and the 20,000-tensor file, one warm repeat
         repeats: int = 3,          # warm-cache runs per method and checkpoint
         cold_repeats: int = 3,     # cold-cache runs per method and checkpoint (0: none)
         no_synth: bool = False,    # skip the 2.2 GB synthetic checkpoint
         no_many: bool = False,     # skip the 20,000-tensor checkpoints
         no_moe: bool = False,      # skip the 64-expert MoE (end-to-end rows only)
         e2e_only: bool = False,    # only the end-to-end rows, the peers and ours (raw loader)
         gpu: bool = False,         # only the CUDA rows (warm, SmolLM2 and the synthetic checkpoint)
         methods: str = '',         # comma-separated subset of the methods (default: all; CUDA ones only with a GPU)
         spawn: bool = False,       # a new interpreter per run instead of a fork of an imported parent
         publish: bool = False,     # copy results to benchmarks/load_results.json and nbs/images/bench_load.png
         worker_spec: str = '',     # internal: run one measurement (JSON spec)
         build: str = '',           # internal: build one benchmark checkpoint
         ):
    "Benchmark loading HF safetensors checkpoints: mstar_utils against transformers, safetensors and the read limits."
    if worker_spec: _preimport(); print('RESULT ' + json.dumps(worker(json.loads(worker_spec)))); return
    if build: _build(build); return
    if quick: repeats, cold_repeats, no_synth = 1, 0, True
    if e2e_only: methods, no_many = methods or ','.join(['ours'] + PEER_METHODS + E2E_METHODS), True
    has_gpu = subprocess.run([sys.executable, '-c', 'import torch; print(torch.cuda.is_available())'], capture_output=True, text=True).stdout.strip() == 'True'
    if gpu:
        if not has_gpu: raise SystemExit('--gpu: no CUDA device')
        methods, cold_repeats, no_many = methods or ','.join(GPU_METHODS), 0, True
    ckpt_dirs = {}
    try: ckpt_dirs['SmolLM2-135M'] = built(SMOL_NAME)
    except Exception as e: print(f'SmolLM2 skipped: {type(e).__name__}: {e}')
    if not no_synth: ckpt_dirs['Llama-synth-1.1B'] = built(SYNTH_NAME)
    if not no_moe:
        from bench_moe_load import checkpoint as moe_checkpoint
        ckpt_dirs[MOE_NAME] = moe_checkpoint()
    if not no_many: ckpt_dirs[MANY_NAME], ckpt_dirs[LLAMA20K_NAME] = built(MANY_NAME), built(LLAMA20K_NAME)
    ckpts = {}
    for name, d in ckpt_dirs.items():
        ts = checkpoint_tensors(d)
        ckpts[name] = dict(path=str(d), bytes=sum(t['nbytes'] for t in ts), tensors=len(ts), shards=len({t['file'] for t in ts}),
                           max_shard=max(sum(t['nbytes'] for t in ts if t['file'] == f) for f in {t['file'] for t in ts}),
                           file_bytes=sum(p.stat().st_size for p in d.glob('*.safetensors')))
    wanted = [m for m in methods.split(',') if m] or ALL_METHODS
    unknown = set(wanted) - set(ALL_METHODS)
    if unknown: raise SystemExit(f'unknown methods {sorted(unknown)}; known: {ALL_METHODS}')
    if not has_gpu: wanted = [m for m in wanted if m not in GPU_METHODS]
    if 'instanttensor-cuda' in wanted and subprocess.run([sys.executable, '-c', 'import instanttensor'], capture_output=True).returncode:
        print('instanttensor-cuda skipped: instanttensor is not installed (pip install instanttensor==0.2.2)')
        wanted.remove('instanttensor-cuda')
    if not spawn: _preimport()
    env = _env(has_gpu, repeats, cold_repeats, spawn)
    THREADS[0] = env['threads']
    runs, t_start = [], time.time()
    def plan(name, cold, rep):
        "The methods of one round, in an order shuffled per round: on a VM that hands freed memory back to the host, a run's speed depends on what ran before it."
        ms = MOE_METHODS if name == MOE_NAME else MANY_METHODS.get(name, COLD_METHODS if cold else CPU_METHODS + GPU_METHODS)
        ms = [m for m in ms if m in wanted and not (cold and m in GPU_METHODS)]
        random.Random(rep).shuffle(ms)
        return ms

    def go(name, m, cold):
        spec = dict(method=m, ckpt=ckpts[name]['path'], ckpt_name=name, cold=cold)
        r = run_e2e(spec) if m in E2E_METHODS else run_one(spec, spawn)
        runs.append(r)
        print(f"  {name:<24} {'cold' if cold else 'warm'} {m:<16} load {r['load_s']:7.3f} s  touch {r['touch_s']:6.3f} s  peak +{r['peak_rss']/1e6:6.0f} MB", flush=True)
    for rep in range(repeats):
        print(f'warm page cache, round {rep + 1}/{repeats}', flush=True)
        for name in ckpts:
            read_files(sorted({t['file'] for t in checkpoint_tensors(Path(ckpts[name]['path']))}))
            for m in plan(name, False, rep):
                if rep == 0 or m not in ONCE: go(name, m, False)
    for rep in range(cold_repeats):
        print(f'cold page cache, round {rep + 1}/{cold_repeats}', flush=True)
        for name in ckpts:
            if name not in MANY_METHODS:
                for m in plan(name, True, rep): go(name, m, True)
    bad = verify(runs)
    summary = summarize(runs, ckpts)
    tg = targets(summary, ckpts)
    print(f"\n{env['cpus']} CPUs, {env['mem_gb']} GB; torch {env['torch']}, transformers {env['transformers']}, safetensors {env['safetensors']}; "
          f"ours with {env['threads']} reader threads; runs are fresh {env['process']}ed processes; {repeats} warm, {cold_repeats} cold repeats, medians")
    for name, c in ckpts.items(): print(f"{name}: {c['bytes']/1e6:.0f} MB of tensors in {c['shards']} shards, {c['tensors']} tensors")
    print('ready = load call + first touch of every page; GB/s = tensor bytes / ready; us/tens = load s / tensors; peak = RSS above the '
          'pre-load baseline; anon/file = growth of RssAnon/RssFile; read MB = bytes through read(2) (rchar)\n')
    print(table(summary))
    print('\ntargets and ratios (medians):')
    for t in tg:
        mark = '    ' if t['met'] is None else ('MET ' if t['met'] else 'MISS')
        lim = '' if t['limit'] is None else f"  ({t['op']} {t['limit']:g})"
        print(f"  {mark} {t['ckpt']:<24} {t['cache']:<5} {t['target']:<82} {t['value']:7.2f}{lim}")
    print('correctness: ' + ('every method holds the checkpoint bytes under every key' if not bad else 'MISMATCH ' + '; '.join(bad)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    for r in runs: r.pop('fingerprint', None)
    data = dict(env=env, checkpoints={k: {**v, 'path': Path(v['path']).name} for k, v in ckpts.items()}, labels=LABELS, summary=summary,
                targets=tg, verified=not bad, mismatches=bad, runs=runs, wall_s=round(time.time() - t_start, 1))
    (RESULTS/'load.json').write_text(json.dumps(data, indent=1))
    plot(summary, ckpts, RESULTS/'load.png')
    print(f'\nwrote {RESULTS/"load.json"} and {RESULTS/"load.png"} ({data["wall_s"]} s)')
    if publish:
        (HERE/'load_results.json').write_text(json.dumps({k: v for k, v in data.items() if k != 'runs'}, indent=1))
        img = HERE.parent/'nbs'/'images'; img.mkdir(exist_ok=True)
        shutil.copy(RESULTS/'load.png', img/'bench_load.png')
        print(f'published to {HERE/"load_results.json"} and {img/"bench_load.png"}')
    if bad: sys.exit(1)
