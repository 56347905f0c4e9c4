#!/usr/bin/env python
"""Where the end-to-end time goes: process start to first logits, split into phases, for `load_model` and
`from_pretrained`.

    python benchmarks/profile_e2e.py                          # SmolLM2, the 2.2 GB Llama and the 64-expert MoE, warm,
                                                              # 3 runs
    python benchmarks/profile_e2e.py --ckpts moe --repeats 5
    python benchmarks/profile_e2e.py --cold                   # drop the checkpoint's pages before each run

Each run is a new interpreter. The parent notes the wall clock just before it starts the child; the child stamps the
wall clock and its own CPU time (all threads) at each phase boundary. Hooks only wrap functions (a clock read before and
after), so the work measured is the work the benchmark's end-to-end rows time (`bench_load.py`'s `e2e-ours` and
`e2e-hf`):

- ours: interpreter start, `import torch`, `from mstar_utils import load_model`, then inside `load_model` the reads
  starting from config.json and the headers, the transformers import and its config, transformers' fusing rules asked,
  the model class imported and built on meta (`build_on_meta`), the weights placed and checked
  (`_read_weights`, which waits for the shards still being read), the rest of `load_model`, and a 4-token forward;
- transformers: interpreter start, `import torch`, `from transformers import AutoModelForCausalLM`, then inside
  `from_pretrained` the config, modeling import and construction (up to `_load_pretrained_model`), the weights
  (`_load_pretrained_model`), the rest of `from_pretrained`, and the forward, which faults the mapped pages in.

Medians over runs, per phase: wall seconds and CPU seconds (above 1.0 per wall second means more than one core was
busy). Writes benchmarks/results/profile_e2e.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

from _harness import byte_compile
from fastcore.script import call_parse

HERE = Path(__file__).resolve().parent
CKPTS = {'smollm2': 'SmolLM2-135M-Instruct-copy', 'synth': 'llama-synth-1.1b-bf16', 'moe': 'qwen3-moe-64x8-bf16'}


def _stamp(marks: list, name: str):
    "Note the wall clock and this process's CPU time at the end of phase `name`."
    marks.append((name, time.time(), time.process_time()))


def _timed(marks: list, owner, attr: str, before: str | None, after: str):
    "Wrap `owner.attr` so that a call ends phase `before` (if given) when it starts and phase `after` when it returns."
    f = getattr(owner, attr)

    def wrapper(*a, **k):
        if before:
            _stamp(marks, before)
        out = f(*a, **k)
        _stamp(marks, after)
        return out

    setattr(owner, attr, wrapper)


def _worker_ours(path: str, marks: list):
    "The e2e-ours run, stamped."
    import torch  # noqa: F401 (the import is the step stamped)

    _stamp(marks, 'import torch')
    from mstar_utils import load_model

    _stamp(marks, 'import mstar_utils')
    import mstar_utils.model as M

    _timed(marks, M, '_reads_before_config', 'load_model: entry', 'load_model: reads started (config.json, headers)')
    _timed(
        marks, M, '_keep_reads', 'load_model: import transformers, AutoConfig', "load_model: transformers' rules asked"
    )
    _timed(marks, M, 'build_on_meta', None, 'load_model: modeling import + build on meta')
    _timed(marks, M, '_read_weights', 'load_model: sources set up', 'load_model: weights placed (waits for reads)')
    model = load_model(path)
    _stamp(marks, 'load_model: rest (finalize, checks)')
    return model


def _worker_hf(path: str, marks: list):
    "The e2e-hf run, stamped."
    import torch  # noqa: F401 (the import is the step stamped)

    _stamp(marks, 'import torch')
    from transformers import AutoModelForCausalLM
    from transformers import PreTrainedModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    _stamp(marks, 'import transformers')
    _timed(
        marks,
        PreTrainedModel,
        '_load_pretrained_model',
        'from_pretrained: config, modeling import, build',
        'from_pretrained: weights',
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    _stamp(marks, 'from_pretrained: rest (finalize)')
    return model


def _worker(method: str, path: str, t_parent: float):
    "One run: stamps from interpreter start to the first logits, printed as one JSON line."
    marks = [('interpreter start', time.time(), time.process_time())]
    model = (_worker_ours if method == 'ours' else _worker_hf)(path, marks)
    import torch

    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]])).logits.float().sum().item()
    _stamp(marks, 'forward (first logits)')
    phases, (t_prev, c_prev) = [], (t_parent, 0.0)
    for name, t, c in marks:
        phases.append((name, t - t_prev, c - c_prev))
        t_prev, c_prev = t, c
    print('RESULT ' + json.dumps(dict(method=method, total_s=marks[-1][1] - t_parent, phases=phases)))


def _drop(path: Path):
    "Drop the checkpoint's pages from the page cache (posix_fadvise DONTNEED on each file)."
    for f in path.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _warm(path: Path):
    "Read every file of the checkpoint once, so that its pages are in the page cache."
    for f in path.iterdir():
        if f.is_file():
            with open(f, 'rb') as fh:
                while fh.read(64 << 20):
                    pass


def run_one(method: str, path: Path, cold: bool) -> dict:
    "One fresh interpreter's stamps."
    (_drop if cold else _warm)(path)
    t = time.time()
    p = subprocess.run(
        [sys.executable, __file__, '--worker', method, '--path', str(path), '--t_parent', repr(t)],
        capture_output=True,
        text=True,
    )
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith('RESULT ')), None)
    if p.returncode or line is None:
        raise RuntimeError(f'{method} on {path.name}: worker failed\n{p.stderr[-3000:]}')
    return json.loads(line[7:])


def summarize(runs: list) -> dict:
    "Median wall and CPU seconds per phase, and of the total."
    names = [n for n, _, _ in runs[0]['phases']]
    med = lambda i, n: statistics.median(dict((p[0], p[i]) for p in r['phases'])[n] for r in runs)  # noqa: E731
    return dict(
        total_s=statistics.median(r['total_s'] for r in runs), phases=[(n, med(1, n), med(2, n)) for n in names]
    )


@call_parse
def main(
    ckpts: str = 'smollm2,synth,moe',  # which checkpoints (smollm2, synth, moe), comma-separated
    repeats: int = 3,  # runs per method and checkpoint, alternating the order
    cold: bool = False,  # drop the checkpoint's pages before each run
    worker: str = '',  # internal: run one stamped measurement of this method
    path: str = '',  # internal: the checkpoint folder of the worker
    t_parent: float = 0.0,
):  # internal: the parent's wall clock before it started the worker
    "Print where the end-to-end time of `load_model` and of `from_pretrained` goes, phase by phase."
    if worker:
        return _worker(worker, path, t_parent)
    sys.path.insert(0, str(HERE))
    import bench_load
    import bench_moe_load

    print(byte_compile(), flush=True)
    out = {}
    for key in ckpts.split(','):
        ck = bench_moe_load.checkpoint() if key == 'moe' else bench_load.built(CKPTS[key])
        runs = {'ours': [], 'hf': []}
        for i in range(repeats):
            for m in ('ours', 'hf') if i % 2 == 0 else ('hf', 'ours'):
                runs[m].append(run_one(m, ck, cold))
        summ = {m: summarize(r) for m, r in runs.items()}
        out[key] = dict(checkpoint=ck.name, cold=cold, summary=summ, runs=runs)
        ratio = summ['ours']['total_s'] / summ['hf']['total_s']
        print(
            f"\n{ck.name}, {'cold' if cold else 'warm'} page cache, median of {repeats}: "
            f"load_model {summ['ours']['total_s']:.2f} s, from_pretrained {summ['hf']['total_s']:.2f} s ({ratio:.2f}x)"
        )
        for m, label in (('ours', 'load_model'), ('hf', 'from_pretrained')):
            print(f'  {label}')
            for n, w, c in summ[m]['phases']:
                print(f'    {n:<48} {w:6.3f} s wall {c:6.3f} s CPU')
    (HERE / 'results').mkdir(exist_ok=True)
    (HERE / 'results' / 'profile_e2e.json').write_text(json.dumps(out, indent=1))
