#!/usr/bin/env python
"""Load-time benchmark: fill a HuggingFace causal LM from its safetensors shards with transformers, safetensors and
`mstar_utils.loading`, against the limit of reading the same bytes into preallocated tensors.

    python benchmarks/bench_load.py              # full run: SmolLM2 + a >= 2 GB synthetic Llama, warm and cold page cache
    python benchmarks/bench_load.py --quick      # SmolLM2 only, one repeat, warm only (about a minute)
    python benchmarks/bench_load.py --publish    # also copy the results to benchmarks/load_results.json and nbs/images/bench_load.png

Each run is a fresh process (forked from a parent that has only imported the libraries, since importing torch and
transformers takes ~10 s here and belongs to no method; `--spawn` starts a new interpreter per run instead).
Prints the table and the targets of issue 7, writes benchmarks/results/load.json and benchmarks/results/load.png.
"""
from __future__ import annotations
import gc, json, mmap, os, platform, shutil, statistics, subprocess, sys, threading, time, traceback
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

import psutil
from fastcore.script import call_parse

HERE = Path(__file__).resolve().parent
RESULTS = HERE/'results'
GB = 1e9

# Synthetic checkpoint: TinyLlama-shaped (1.1 B parameters, 2.2 GB in bf16), random init, untied lm_head.
SYNTH_NAME = 'llama-synth-1.1b-bf16'
SYNTH_CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                    num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5)
SYNTH_SHARD = '400MB'

CPU_METHODS = ['hf', 'st-mmap', 'st-pread', 'ours', 'ours-mmap', 'ours-subset', 'limit-readinto', 'limit-prefaulted', 'limit-mmap']
GPU_METHODS = ['hf-cuda', 'ours-cuda', 'h2d-pageable', 'h2d-pinned']
LABELS = {'hf': '(a) transformers from_pretrained', 'st-mmap': '(b) safetensors load_file (mmap) + assign',
          'st-pread': "(b') safetensors load_file(backend='pread') + assign", 'ours': '(c) ours: load_weights_from_hf_shards', 'ours-mmap': "(c') ours, mmap=True",
          'ours-subset': '(c) ours, one ModuleAndPrefix ~10% of weights', 'limit-readinto': '(d) limit: readinto preallocated',
          'limit-prefaulted': "(d'') readinto preallocated, pages faulted in before the clock: copy bandwidth alone",
          'limit-mmap': "(d') limit: mmap + copy into preallocated", 'hf-cuda': "(a) from_pretrained(device_map='cuda')",
          'ours-cuda': "(c) ours device='cuda'", 'h2d-pageable': 'limit: host->device copy, pageable',
          'h2d-pinned': 'limit: host->device copy, pinned'}

# ----------------------------------------------------------------------------------------------------------- checkpoints
def cache_root() -> Path:
    from mstar_utils.checkpoints import cache_dir
    return cache_dir()/'bench'

def synth_checkpoint(build: bool = True) -> Path:
    "Folder of the synthetic Llama checkpoint (built once, in a child interpreter, under `cache_dir()/'bench'`)."
    out = cache_root()/SYNTH_NAME
    if (out/'.complete').exists() or not build: return out
    print(f'building the synthetic checkpoint in {out} (once; about a minute) ...', flush=True)
    subprocess.run([sys.executable, __file__, '--build_synth'], check=True)
    return out

def _build_synth():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from mstar_utils.checkpoints import cached_folder  # build into a temporary folder, rename into place when complete
    def write(tmp):
        torch.manual_seed(0)
        config = LlamaConfig(**SYNTH_CONFIG, dtype='bfloat16')
        LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).save_pretrained(tmp, max_shard_size=SYNTH_SHARD)
    cached_folder('bench', SYNTH_NAME, write)

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

def read_files(ckpt: Path):
    "Read every shard once so the page cache holds it."
    for p in sorted(ckpt.glob('*.safetensors')):
        with open(p, 'rb', buffering=0) as f:
            while f.read(64 << 20): pass

def drop_caches() -> str | None:
    "Write back dirty pages and drop the page cache; the error text when this process may not."
    try:
        os.sync()
        with open('/proc/sys/vm/drop_caches', 'w') as f: f.write('3\n')
        return None
    except OSError as e: return f'{type(e).__name__}: {e}'

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
    import torch, transformers, accelerate, safetensors.torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import mstar_utils.loading  # noqa: F401

def _meta_model(ckpt, config=None):
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    config = config or AutoConfig.from_pretrained(ckpt)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.tie_weights()
    return model

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

def worker(spec: dict) -> dict:
    "One measured load in this (fresh) process; returns the metrics."
    import torch
    from safetensors.torch import load_file
    from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards, check_loaded
    method, ckpt, cold = spec['method'], Path(spec['ckpt']), spec['cold']
    tensors = checkpoint_tensors(ckpt)
    dt = {'BF16': torch.bfloat16, 'F16': torch.float16, 'F32': torch.float32}
    res = dict(method=method, ckpt=spec['ckpt_name'], cold=cold, construct_s=None, subset_bytes=None)
    cuda = method in GPU_METHODS
    if cuda:
        torch.cuda.init(); torch.empty(1, device='cuda'); torch.cuda.synchronize()  # the CUDA context is not part of a load
    # ---- construction (timed on its own, never part of the load phase)
    t0 = time.perf_counter()
    model = sub = dests = None
    if method in ('st-mmap', 'st-pread', 'ours', 'ours-mmap', 'ours-subset', 'ours-cuda'):
        model = _meta_model(ckpt)
        if method == 'ours-subset':
            layers = model.model.layers
            per_layer = {}
            for t in tensors:
                parts = t['key'].split('.')
                if t['key'].startswith('model.layers.'): per_layer[int(parts[2])] = per_layer.get(int(parts[2]), 0) + t['nbytes']
            total = sum(t['nbytes'] for t in tensors)
            k = max(1, round(0.10*total/per_layer[0]))
            sub = torch.nn.ModuleList(list(layers[:k]))  # names 0.self_attn..., 1.mlp...: the checkpoint's under 'model.layers.'
            res['subset_layers'] = k
            res['subset_bytes'] = sum(per_layer[i] for i in range(k))
    elif method in ('limit-readinto', 'limit-prefaulted', 'limit-mmap', 'h2d-pageable', 'h2d-pinned'):
        pin = method == 'h2d-pinned'
        dests = [torch.empty(t['shape'], dtype=dt[t['dtype']], pin_memory=pin) for t in tensors]
        if method == 'limit-prefaulted':  # every page of the destination already mapped: only the copy is left to time
            for d in dests: d.view(-1).view(torch.uint8).fill_(0)
        if method.startswith('h2d'):  # host side filled before the clock starts: this measures the copy alone
            for d in dests: d.view(-1).view(torch.uint8).fill_(1)
            host_dests, dests = dests, [torch.empty(t['shape'], dtype=dt[t['dtype']], device='cuda') for t in tensors]
    res['construct_s'] = time.perf_counter() - t0 if method not in ('hf', 'hf-cuda') else None
    gc.collect()
    if cold:
        err = drop_caches()
        if err: raise RuntimeError(f'cannot drop the page cache: {err}')
    # ---- load phase
    proc = psutil.Process()
    io0, st0 = proc.io_counters(), _status()
    res['hwm_reset'] = _reset_hwm()
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        if method in ('hf', 'hf-cuda'):
            from transformers import AutoModelForCausalLM
            kw = dict(device_map='cuda') if cuda else {}
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, **kw)
        elif method in ('st-mmap', 'st-pread'):
            sd = {}
            for f in sorted({t['file'] for t in tensors}): sd.update(load_file(f, backend='mmap' if method == 'st-mmap' else 'pread'))
            r = model.load_state_dict(sd, assign=True, strict=False)
            model.tie_weights()  # assign replaced the embedding the tied lm_head pointed at
            del sd
            if r.unexpected_keys: raise RuntimeError(f'unexpected keys {r.unexpected_keys[:3]}')
        elif method in ('ours', 'ours-cuda'):
            loaded = load_weights_from_hf_shards(ckpt, [ModuleAndPrefix(model)], device='cuda' if cuda else 'cpu', progress=False)
        elif method == 'ours-mmap':
            loaded = load_weights_from_hf_shards(ckpt, [ModuleAndPrefix(model)], progress=False, mmap=True)
        elif method == 'ours-subset':
            loaded = load_weights_from_hf_shards(ckpt, [ModuleAndPrefix(sub, 'model.layers.')], progress=False)
        elif method in ('limit-readinto', 'limit-prefaulted'):
            files = {}
            for t, d in zip(tensors, dests):
                f = files.get(t['file']) or files.setdefault(t['file'], open(t['file'], 'rb', buffering=0))
                f.seek(t['offset'])
                view, got = memoryview(d.view(-1).view(torch.uint8).numpy()), 0
                while got < t['nbytes']: got += f.readinto(view[got:])
            for f in files.values(): f.close()
        elif method == 'limit-mmap':
            maps = {}
            for t, d in zip(tensors, dests):
                m = maps.get(t['file'])
                if m is None:
                    with open(t['file'], 'rb') as f: m = maps[t['file']] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                src = torch.frombuffer(m, dtype=torch.uint8, count=t['nbytes'], offset=t['offset'])
                d.view(-1).view(torch.uint8).copy_(src)
                del src
            for m in maps.values(): m.close()
        elif method.startswith('h2d'):
            for h, d in zip(host_dests, dests): d.copy_(h, non_blocking=True)
        if cuda: torch.cuda.synchronize()
        res['load_s'] = time.perf_counter() - t0
        t0 = time.perf_counter()
        owned = dests if dests is not None else list((sub or model).state_dict().values())
        _touch(owned)
        res['touch_s'] = time.perf_counter() - t0
    io1, st1 = proc.io_counters(), _status()
    res['cached_after'] = cached_bytes(sorted({t['file'] for t in tensors})) if cold else None  # what the load pulled in from the disk
    res['ready_s'] = res['load_s'] + res['touch_s']
    base = st0['VmRSS']
    res.update(baseline_rss=base, peak_sampled=sampler.peak - base, peak_hwm=st1['VmHWM'] - base if res['hwm_reset'] else None,
               anon_delta=st1['RssAnon'] - st0['RssAnon'], file_delta=st1['RssFile'] - st0['RssFile'],
               rchar=io1.read_chars - io0.read_chars, read_bytes=io1.read_bytes - io0.read_bytes)
    res['peak_rss'] = max(res['peak_sampled'], res['peak_hwm'] or 0)
    # ---- correctness: every method must hold the checkpoint's bytes under the checkpoint's keys
    if method in ('ours', 'ours-mmap', 'ours-cuda'): check_loaded(model, loaded[0], method)
    if method == 'ours-subset': check_loaded(sub, loaded[0], method)
    if model is not None and method != 'ours-subset': _no_meta(model, method)
    if method.startswith('h2d'): res['fingerprint'] = None
    elif dests is not None: res['fingerprint'] = {t['key']: _fingerprint(d) for t, d in zip(tensors, dests)}
    else:
        sd = sub.state_dict() if sub is not None else model.state_dict()
        pre = 'model.layers.' if sub is not None else ''
        res['fingerprint'] = {pre + k: _fingerprint(v.cpu()) for k, v in sd.items() if pre + k in {t['key'] for t in tensors}}
    return res

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
def _med(rows, k):
    vals = [r[k] for r in rows if r.get(k) is not None]
    return statistics.median(vals) if vals else None

def summarize(runs: list[dict], ckpts: dict) -> list[dict]:
    out = []
    keys = sorted({(r['ckpt'], r['cold'], r['method']) for r in runs}, key=lambda k: (list(ckpts).index(k[0]), k[1], (CPU_METHODS + GPU_METHODS).index(k[2])))
    for ck, cold, m in keys:
        rows = [r for r in runs if (r['ckpt'], r['cold'], r['method']) == (ck, cold, m)]
        nbytes = rows[0]['subset_bytes'] or ckpts[ck]['bytes']
        s = dict(ckpt=ck, cache='cold' if cold else 'warm', method=m, label=LABELS[m], n=len(rows), bytes=nbytes)
        for k in ('construct_s', 'load_s', 'touch_s', 'ready_s', 'peak_rss', 'peak_sampled', 'peak_hwm', 'anon_delta', 'file_delta', 'rchar', 'read_bytes', 'cached_after'):
            s[k] = _med(rows, k)
        s['ready_min_s'], s['ready_max_s'] = min(r['ready_s'] for r in rows), max(r['ready_s'] for r in rows)
        s['gbps'] = nbytes/GB/s['ready_s']
        s['rss_x_bytes'] = s['peak_rss']/nbytes
        out.append(s)
    return out

def verify(runs: list[dict]) -> list[str]:
    "Methods whose bytes differ from the readinto limit's for some key (the limit reads exactly the file's bytes)."
    bad = []
    for r in runs:
        if not r.get('fingerprint'): continue
        ref = next((x['fingerprint'] for x in runs if x['ckpt'] == r['ckpt'] and x['method'] == 'limit-readinto'), None)
        if ref is None: continue
        if r['method'] != 'ours-subset' and set(r['fingerprint']) != set(ref):
            bad.append(f"{r['ckpt']}/{r['method']}: keys differ from the checkpoint's"); continue
        diff = [k for k, v in r['fingerprint'].items() if ref.get(k) != v]
        if diff: bad.append(f"{r['ckpt']}/{r['method']}: bytes differ for {diff[:3]}")
    return bad

def _get(summary, ck, cache, m): return next((s for s in summary if (s['ckpt'], s['cache'], s['method']) == (ck, cache, m)), None)

def targets(summary: list[dict], ckpts: dict) -> list[dict]:
    "The targets of issue 7, per checkpoint and cache state, on ready time (load + first touch of every page)."
    out = []
    def add(ck, cache, name, value, limit, ok):
        out.append(dict(ckpt=ck, cache=cache, target=name, value=value, limit=limit, met=bool(ok)))
    for ck in ckpts:
        for cache in ('warm', 'cold'):
            ours = _get(summary, ck, cache, 'ours')
            if ours is None: continue
            for m, lim, name in (('hf', 0.5, 'ours / (a) transformers'), ('st-mmap', 1.0, 'ours / (b) safetensors mmap'),
                                 ('st-pread', 1.0, "ours / (b') safetensors pread")):
                o = _get(summary, ck, cache, m)
                if o: r = ours['ready_s']/o['ready_s']; add(ck, cache, name + ' time', r, lim, r <= lim)
            add(ck, cache, 'ours peak RSS above baseline / checkpoint bytes', ours['rss_x_bytes'], 1.1, ours['rss_x_bytes'] <= 1.1)
            d = _get(summary, ck, cache, 'limit-readinto')
            if d: r = d['gbps']/ours['gbps']; add(ck, cache, '(d) limit GB/s / ours GB/s', r, 1.5, r <= 1.5)
            om = _get(summary, ck, cache, 'ours-mmap')
            if om:
                for m, lim, name in (('hf', 0.5, "ours mmap=True / (a) transformers"), ('st-mmap', 1.0, "ours mmap=True / (b) safetensors mmap")):
                    o = _get(summary, ck, cache, m)
                    if o: r = om['ready_s']/o['ready_s']; add(ck, cache, name + ' time', r, lim, r <= lim)
                add(ck, cache, 'ours mmap=True peak RSS above baseline / checkpoint bytes', om['rss_x_bytes'], 1.1, om['rss_x_bytes'] <= 1.1)
            sub = _get(summary, ck, cache, 'ours-subset')
            if sub:
                r = sub['ready_s']/ours['ready_s']; add(ck, cache, f"subset ({sub['bytes']/ckpts[ck]['bytes']:.0%} of bytes) time / full", r, 0.2, r <= 0.2)
                # rchar: bytes the loader asked read(2) for (headers included); read_bytes: bytes the kernel fetched from the disk
                # for this process (cold cache only), which adds readahead and what safe_open's validation maps in
                r = sub['rchar']/sub['bytes']; add(ck, cache, 'subset bytes requested (rchar) / subset bytes', r, 1.1, r <= 1.1)
                if cache == 'cold': r = sub['cached_after']/sub['bytes']; add(ck, cache, 'subset: shard bytes in page cache after (mincore) / subset bytes', r, 1.1, r <= 1.1)
        for m, lim in (('hf-cuda', 0.5),):
            o, ours = _get(summary, ck, 'warm', m), _get(summary, ck, 'warm', 'ours-cuda')
            if o and ours: r = ours['ready_s']/o['ready_s']; add(ck, 'warm', 'cuda: ours / (a) device_map=cuda time', r, lim, r <= lim)
            h = _get(summary, ck, 'warm', 'h2d-pageable')
            if h and ours: r = h['gbps']/ours['gbps']; add(ck, 'warm', 'cuda: pageable H2D GB/s / ours GB/s', r, 1.5, r <= 1.5)
    return out

def table(summary: list[dict]) -> str:
    head = f"{'checkpoint':<22} {'cache':<5} {'method':<15} {'build s':>7} {'load s':>7} {'touch s':>7} {'ready s':>7} {'(min-max)':>13} {'GB/s':>6} {'peak MB':>8} {'x bytes':>7} {'anon MB':>8} {'file MB':>8} {'read MB':>8} {'disk MB':>8}"
    lines = [head, '-'*len(head)]
    f = lambda v, spec: format(v, spec) if v is not None else '-'
    for s in summary:
        lines.append(f"{s['ckpt']:<22} {s['cache']:<5} {s['method']:<15} {f(s['construct_s'], '7.3f'):>7} {s['load_s']:7.3f} {s['touch_s']:7.3f} {s['ready_s']:7.3f} "
                     f"{s['ready_min_s']:6.3f}-{s['ready_max_s']:<6.3f} {s['gbps']:6.2f} {s['peak_rss']/1e6:8.0f} {s['rss_x_bytes']:7.2f} "
                     f"{s['anon_delta']/1e6:8.0f} {s['file_delta']/1e6:8.0f} {s['rchar']/1e6:8.0f} {f(s['cached_after'] and s['cached_after']/1e6, '8.0f'):>8}")
    return '\n'.join(lines)

def plot(summary: list[dict], ckpts: dict, path: Path):
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    cks = [c for c in ckpts if any(s['ckpt'] == c for s in summary)]
    fig, axes = plt.subplots(len(cks), 2, figsize=(13, 3.6*len(cks)), squeeze=False)
    for row, ck in zip(axes, cks):
        methods = [m for m in CPU_METHODS + GPU_METHODS if _get(summary, ck, 'warm', m)]
        x = range(len(methods))
        w = 0.38
        for off, cache, hatch in ((-w/2, 'warm', None), (w/2, 'cold', '//')):
            rows = [_get(summary, ck, cache, m) for m in methods]
            if not any(rows): continue
            load = [r['load_s'] if r else 0 for r in rows]; touch = [r['touch_s'] if r else 0 for r in rows]
            xs = [i + off for i in x]
            row[0].bar(xs, load, w, color='tab:blue', hatch=hatch, edgecolor='white', label=f'{cache}: load call')
            row[0].bar(xs, touch, w, bottom=load, color='tab:orange', hatch=hatch, edgecolor='white', label=f'{cache}: first touch of every page')
            row[1].bar(xs, [r['peak_rss']/1e6 if r else 0 for r in rows], w, color='tab:green' if cache == 'warm' else 'tab:olive',
                       hatch=hatch, edgecolor='white', label=f'{cache} cache')
        row[1].axhline(ckpts[ck]['bytes']/1e6, color='k', ls='--', lw=1, label='checkpoint bytes')
        for ax, title in zip(row, ('load time, s (median)', 'peak RSS above baseline, MB (median)')):
            ax.set_xticks(list(x)); ax.set_xticklabels(methods, rotation=25, ha='right', fontsize=8)
            ax.set_title(f"{ck} ({ckpts[ck]['bytes']/1e9:.2f} GB, {ckpts[ck]['shards']} shards): {title}", fontsize=9)
            if ax.get_legend_handles_labels()[0]: ax.legend(fontsize=7)
            ax.grid(axis='y', alpha=.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

# ----------------------------------------------------------------------------------------------------------------- main
@call_parse
def main(quick: bool = False,       # SmolLM2 only, one repeat, warm cache only
         repeats: int = 3,          # warm-cache runs per method and checkpoint
         cold_repeats: int = 3,     # cold-cache runs per method and checkpoint (0: none)
         no_synth: bool = False,    # skip the >= 2 GB synthetic checkpoint
         methods: str = '',         # comma-separated subset of the methods (default: all; CUDA ones only with a GPU)
         spawn: bool = False,       # a new interpreter per run instead of a fork of an imported parent
         publish: bool = False,     # copy results to benchmarks/load_results.json and nbs/images/bench_load.png
         worker_spec: str = '',     # internal: run one measurement (JSON spec)
         build_synth: bool = False, # internal: build the synthetic checkpoint
         ):
    "Benchmark loading HF safetensors checkpoints: transformers, safetensors, mstar_utils, and the read limit."
    if worker_spec: _preimport(); print('RESULT ' + json.dumps(worker(json.loads(worker_spec)))); return
    if build_synth: _build_synth(); return
    if quick: repeats, cold_repeats, no_synth = 1, 0, True
    from mstar_utils.checkpoints import smollm2_checkpoint
    ckpt_dirs = {'SmolLM2-135M': smollm2_checkpoint()}
    if not no_synth: ckpt_dirs['Llama-synth-1.1B'] = synth_checkpoint()
    ckpts = {}
    for name, d in ckpt_dirs.items():
        ts = checkpoint_tensors(d)
        ckpts[name] = dict(path=str(d), bytes=sum(t['nbytes'] for t in ts), tensors=len(ts), shards=len({t['file'] for t in ts}),
                           file_bytes=sum(p.stat().st_size for p in d.glob('*.safetensors')))
    gpu = subprocess.run([sys.executable, '-c', 'import torch; print(torch.cuda.is_available())'], capture_output=True, text=True).stdout.strip() == 'True'
    wanted = [m for m in methods.split(',') if m] or CPU_METHODS + (GPU_METHODS if gpu else [])
    unknown = set(wanted) - set(CPU_METHODS + GPU_METHODS)
    if unknown: raise SystemExit(f'unknown methods {sorted(unknown)}; known: {CPU_METHODS + GPU_METHODS}')
    if not gpu: wanted = [m for m in wanted if m not in GPU_METHODS]
    cold_error = drop_caches() if cold_repeats else 'not requested'
    if cold_error: print(f'cold-cache runs skipped: {cold_error}')
    if not spawn: _preimport()
    import torch, transformers, safetensors
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               safetensors=safetensors.__version__, cpus=os.cpu_count(), mem_gb=round(psutil.virtual_memory().total/GB, 1),
               machine=platform.machine(), kernel=platform.release(), gpu=gpu, process='spawn' if spawn else 'fork',
               cold_cache=cold_error is None, cold_error=cold_error, repeats=repeats, cold_repeats=cold_repeats if cold_error is None else 0)
    runs, t_start = [], time.time()
    def go(name, m, cold):
        spec = dict(method=m, ckpt=ckpts[name]['path'], ckpt_name=name, cold=cold)
        r = run_one(spec, spawn)
        runs.append(r)
        print(f"  {name:<18} {'cold' if cold else 'warm'} {m:<15} load {r['load_s']:6.3f} s  touch {r['touch_s']:6.3f} s  peak +{r['peak_rss']/1e6:6.0f} MB", flush=True)
    for rep in range(repeats):
        print(f'warm page cache, round {rep + 1}/{repeats}', flush=True)
        for name in ckpts:
            read_files(Path(ckpts[name]['path']))
            for m in wanted: go(name, m, False)
    if cold_error is None:
        for rep in range(cold_repeats):
            print(f'cold page cache, round {rep + 1}/{cold_repeats}', flush=True)
            for name in ckpts:
                for m in [m for m in wanted if not m.startswith('h2d')]: go(name, m, True)
    bad = verify(runs)
    summary = summarize(runs, ckpts)
    tg = targets(summary, ckpts)
    print(f"\n{env['cpus']} CPUs, {env['mem_gb']} GB; torch {env['torch']}, transformers {env['transformers']}, safetensors {env['safetensors']}; "
          f"runs are fresh {env['process']}ed processes; {repeats} warm" + (f", {cold_repeats} cold" if cold_error is None else '') + ' repeats, medians')
    for name, c in ckpts.items(): print(f"{name}: {c['bytes']/1e6:.0f} MB of tensors in {c['shards']} shards, {c['tensors']} tensors ({c['path']})")
    print('ready = load call + first touch of every page (mmap-backed tensors are read from the page cache or disk only then); '
          'GB/s = tensor bytes / ready; peak = RSS above the pre-load baseline; anon/file = growth of RssAnon/RssFile; '
          'read MB = bytes through read(2) (rchar); disk MB = checkpoint bytes in the page cache after a cold load (mincore)\n')
    print(table(summary))
    print('\ntargets (ours = (c)):')
    for t in tg: print(f"  {'MET ' if t['met'] else 'MISS'} {t['ckpt']:<18} {t['cache']:<5} {t['target']:<66} {t['value']:6.2f}  (<= {t['limit']})")
    print('correctness: ' + ('every method holds the checkpoint bytes under every key' if not bad else 'MISMATCH ' + '; '.join(bad)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    for r in runs: r.pop('fingerprint', None)
    data = dict(env=env, checkpoints=ckpts, labels=LABELS, summary=summary, targets=tg, verified=not bad, mismatches=bad, runs=runs,
                wall_s=round(time.time() - t_start, 1))
    (RESULTS/'load.json').write_text(json.dumps(data, indent=1))
    plot(summary, ckpts, RESULTS/'load.png')
    print(f'\nwrote {RESULTS/"load.json"} and {RESULTS/"load.png"} ({data["wall_s"]} s)')
    if publish:
        (HERE/'load_results.json').write_text(json.dumps({k: v for k, v in data.items() if k != 'runs'}, indent=1))
        img = HERE.parent/'nbs'/'images'; img.mkdir(exist_ok=True)
        shutil.copy(RESULTS/'load.png', img/'bench_load.png')
        print(f'published to {HERE/"load_results.json"} and {img/"bench_load.png"}')
    if bad: sys.exit(1)
