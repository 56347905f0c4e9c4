#!/usr/bin/env python
"""Streamed weight statistics and the checkpoint diff of mstar_utils.explore, against the loader in the same run.

    python benchmarks/bench_explore.py            # the 2.2 GB synthetic Llama of bench_load.py (built once), warm
    python benchmarks/bench_explore.py --smol     # SmolLM2 instead (a minute)
    python benchmarks/bench_explore.py --ranks    # section 4 (bytes per rank) on SmolLM2, against every rank's full
                                                  # load_plan

Each measurement is a fresh process forked after the imports, with the checkpoint's files in the page cache (read once
before). Measured: (a) the loader, `build_on_meta` + `load_weights_from_hf_shards` (GB/s over the checkpoint's bytes);
(b) `weight_stats` (GB/s over the same bytes); (c) `diff_checkpoints` of the checkpoint against a copy with every tensor
perturbed, so that every tensor is compared numerically (GB/s over the bytes of both checkpoints). Peak RSS above the
process's baseline is sampled every millisecond (psutil) and set against the bound of the targets: the two largest
tensors of the checkpoint plus 64 MiB. Prints the table and the targets, writes benchmarks/results/explore.json.

--ranks times explore's section 4 (`rank_table`: for TP 1, 2, 4 and 8, `load_plan(detail=False)` at every rank, each
over a copy of one model built on meta), against the same totals with the model built afresh for each plan
(`built=None`) and against every rank's full `load_plan` (the per-tensor breakdown too); and, for the copy, building a
full-size DeepSeek-V3 (61 layers, 256 experts) on meta against copying it. Medians of 3, in this process after a
warm-up; writes benchmarks/results/explore_ranks.json.
"""

from __future__ import annotations
import argparse
import copy
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_load import RssSampler, synth_checkpoint, cache_root, _preimport  # noqa: E402

GB, MiB = 1e9, 1 << 20
TUNED = '-perturbed'  # suffix of the perturbed copy's folder


def _files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob('*.safetensors'))


def perturbed_copy(ckpt: Path) -> Path:
    """A copy of `ckpt` with every tensor perturbed by 1% of its std (a stand-in for a fine-tune), built once under
    the bench cache."""
    out = cache_root() / (ckpt.name + TUNED)
    if (out / '.complete').exists():
        return out
    import shutil
    import torch
    from safetensors.torch import load_file, save_file

    print(f'building {out.name} (once) ...', flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.suffix != '.safetensors' and f.is_file():
            shutil.copyfile(f, out / f.name)
    g = torch.Generator().manual_seed(1)
    for f in _files(ckpt):
        sd = load_file(str(f))
        for k, v in sd.items():
            x = v.float()
            sd[k] = (x + 0.01 * (x.std() if x.numel() > 1 else 1) * torch.randn(x.shape, generator=g)).to(v.dtype)
        save_file(sd, str(out / f.name), metadata={'format': 'pt'})
    (out / '.complete').touch()
    return out


def warm(paths):
    "Read the files once, so that every measurement reads from the page cache."
    for p in paths:
        with open(p, 'rb', buffering=0) as f:
            while f.read(64 << 20):
                pass


def _job(kind: str, a: str, b: str | None):
    "The timed call."
    if kind == 'loader':
        from transformers import AutoConfig
        from mstar_utils.model import build_on_meta
        from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards

        model = build_on_meta(AutoConfig.from_pretrained(a))
        load_weights_from_hf_shards(a, [ModuleAndPrefix(model)], progress=False)
        return model
    if kind == 'stats':
        from mstar_utils.explore import weight_stats

        return weight_stats(a)
    from mstar_utils.explore import diff_checkpoints

    return diff_checkpoints(a, b)


def _child(kind, a, b, conn):
    import gc
    import psutil

    gc.collect()
    base = psutil.Process().memory_info().rss
    with RssSampler() as s:
        t = time.perf_counter()
        r = _job(kind, a, b)
        dt = time.perf_counter() - t
    extra = {}
    if kind == 'diff':
        extra = {'changed': len(r.changed), 'tensors': len(r.tensors)}
    if kind == 'stats':
        extra = {'tensors': len(r.tensors)}
    conn.send({'kind': kind, 'seconds': dt, 'peak_above_baseline': s.peak - base, **extra})


def run(kind, a, b=None) -> dict:
    ctx = mp.get_context('fork')
    here, there = ctx.Pipe()
    p = ctx.Process(target=_child, args=(kind, str(a), str(b) if b else None, there))
    p.start()
    r = here.recv()
    p.join()
    return r


def _median_s(fn, n: int = 3) -> float:
    "Median wall seconds of `n` calls of `fn`."
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def ranks_bench():
    """Seconds of explore's section 4 on SmolLM2, against the plans without a shared meta model and the full plans;
    meta build against copy."""
    import torch
    from transformers import DeepseekV3Config
    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.model import build_on_meta, load_plan
    from mstar_utils.explore import _build, rank_table

    ckpt = smollm2_checkpoint()
    config, model = _build(ckpt, [])

    def every(**kw):
        return [load_plan(ckpt, r, ws, **kw) for ws in (1, 2, 4, 8) for r in range(ws)]

    rank_table(ckpt, config, model)  # warm: imports, headers in the page cache
    rows = {
        'section 4 (rank_table)': _median_s(lambda: rank_table(ckpt, config, model)),
        'totals, meta model built per plan': _median_s(lambda: every(detail=False)),
        'full load_plan per rank': _median_s(lambda: every()),
    }
    ds = DeepseekV3Config(
        num_hidden_layers=61, n_routed_experts=256, architectures=['DeepseekV3ForCausalLM']
    )  # the full-size shapes
    big = build_on_meta(ds, None, torch.bfloat16)
    meta = {
        'build DeepSeek-V3 on meta': _median_s(lambda: build_on_meta(ds, None, torch.bfloat16)),
        'copy it (built=)': _median_s(lambda: copy.deepcopy(big)),
    }
    print(f'{ckpt.name}: TP 1, 2, 4, 8 = 15 plans; medians of 3 (wall seconds)')
    for k, v in {**rows, **meta}.items():
        print(f'{k:36} {v:7.2f}')
    sec = rows['section 4 (rank_table)']
    print(f"{'full plans / section 4':36} {rows['full load_plan per rank'] / sec:7.1f}x")
    print(f"{'meta build / copy (per plan)':36} {meta['build DeepSeek-V3 on meta'] / meta['copy it (built=)']:7.1f}x")
    (HERE / 'results').mkdir(exist_ok=True)
    (HERE / 'results' / 'explore_ranks.json').write_text(
        json.dumps({'checkpoint': ckpt.name, 'seconds': rows, 'meta': meta}, indent=1)
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--smol', action='store_true', help='SmolLM2 instead of the 2.2 GB synthetic Llama')
    ap.add_argument('--quick', action='store_true', help='one run of each instead of three')
    ap.add_argument('--ranks', action='store_true', help="time explore's bytes-per-rank section instead")
    args = ap.parse_args()
    if args.ranks:
        return ranks_bench()
    smol, repeats = args.smol, 1 if args.quick else 3
    if smol:
        from mstar_utils.checkpoints import smollm2_checkpoint

        ckpt = smollm2_checkpoint()
    else:
        ckpt = synth_checkpoint()
    tuned = perturbed_copy(Path(ckpt))
    from mstar_utils.sources import read_header

    sizes = sorted((ti.end - ti.begin for f in _files(Path(ckpt)) for ti in read_header(f)[1].values()), reverse=True)
    nbytes, bound = sum(sizes), sizes[0] + sizes[1] + 64 * MiB
    _preimport()
    import mstar_utils.explore  # noqa: F401

    warm(_files(Path(ckpt)) + _files(tuned))
    rows = {k: [] for k in ('loader', 'stats', 'diff')}
    for _ in range(repeats):  # interleaved, so that a busy spell of the machine falls on every kind
        for kind in rows:
            rows[kind].append(run(kind, ckpt, tuned if kind == 'diff' else None))

    def med(k, f):
        return sorted(r[f] for r in rows[k])[len(rows[k]) // 2]

    gbps = {
        'loader': nbytes / GB / med('loader', 'seconds'),
        'stats': nbytes / GB / med('stats', 'seconds'),
        'diff': 2 * nbytes / GB / med('diff', 'seconds'),
    }
    peak = {k: max(r['peak_above_baseline'] for r in rows[k]) for k in rows}
    print(
        f'checkpoint {Path(ckpt).name}: {nbytes / GB:.2f} GB, '
        f'largest tensors {sizes[0] / MiB:.0f} + {sizes[1] / MiB:.0f} MiB, '
        f'memory bound {bound / MiB:.0f} MiB; {repeats} run(s) each, medians'
    )
    print(f"{'':8} {'seconds':>8} {'GB/s':>7} {'peak MiB':>9}")
    for k in rows:
        print(f'{k:8} {med(k, "seconds"):8.2f} {gbps[k]:7.2f} {peak[k] / MiB:9.0f}')
    targets = [
        ('stats GB/s / loader GB/s', gbps['stats'] / gbps['loader'], '>=', 0.5),
        ('diff GB/s (both checkpoints) / loader GB/s', gbps['diff'] / gbps['loader'], '>=', 0.4),
        ('stats peak RSS above baseline / bound', peak['stats'] / bound, '<=', 1.0),
        ('diff peak RSS above baseline / bound', peak['diff'] / bound, '<=', 1.0),
    ]
    for name, v, op, lim in targets:
        ok = v >= lim if op == '>=' else v <= lim
        print(f'{name:48} {v:6.2f}  target {op} {lim}: {"met" if ok else "MISSED"}')
    (HERE / 'results').mkdir(exist_ok=True)
    (HERE / 'results' / 'explore.json').write_text(
        json.dumps(
            {
                'checkpoint': Path(ckpt).name,
                'bytes': nbytes,
                'bound': bound,
                'runs': rows,
                'gbps': gbps,
                'peak': peak,
                'targets': targets,
            },
            indent=1,
        )
    )


if __name__ == '__main__':
    main()
