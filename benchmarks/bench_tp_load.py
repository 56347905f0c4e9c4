#!/usr/bin/env python
"""Tensor-parallel load benchmark: every rank of a torch.distributed group loads only its slices of a checkpoint.

    torchrun --nproc-per-node 2 benchmarks/bench_tp_load.py --quick    # SmolLM2-135M (269 MB), about 30 s on 2 cores
    torchrun --nproc-per-node 4 benchmarks/bench_tp_load.py --quick
    torchrun --nproc-per-node 2 benchmarks/bench_tp_load.py            # the 2.2 GB synthetic Llama of bench_load.py

On every rank: build the model on meta in the checkpoint's dtype, cut it to this rank's slices with the config's tp_plan
(`mstar_utils.tensor_parallel.tp_plan`: attention and MLP projections colwise/rowwise), load the slices with
`load_weights_sharded` while measuring the bytes read (/proc/self/io rchar, and the loader's own count) and the peak RSS
above the pre-load RSS (a 1 ms psutil sampler and VmHWM, as bench_load.py), with the page cache warm; then cast to
float32, run a forward pass with the all-reduce after each rowwise layer, and compare the logits with the unsharded
float32 model (`load_model`, on rank 0). Anchor: rank 0 then times `load_weights_from_hf_shards` of the whole model in
bf16. gloo on CPUs, NCCL when CUDA is available. Rank 0 prints a table and the targets; the last line is one JSON
object. Results also go to benchmarks/results/tp_load_<checkpoint>_<world_size>.json.
"""

from __future__ import annotations
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

import psutil
from fastcore.script import call_parse

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness  # noqa: E402  the RSS sampler and counters
import bench_load  # noqa: E402  the synthetic checkpoint and the header walk are shared with it


def load_slices(ckpt: Path, config, sharding) -> tuple:
    "(model, per-rank measurements): build on meta, cut, load this rank's slices under the byte and memory probes."
    from mstar_utils.loading import ModuleAndPrefix, check_loaded
    from mstar_utils.model import build_on_meta
    from mstar_utils.tensor_parallel import load_weights_sharded, shard_module

    model = build_on_meta(config)  # the checkpoint's dtype: what is read is what is held
    shard_module(model, sharding)
    gc.collect()
    proc = psutil.Process()
    io0, st0, hwm = proc.io_counters(), _harness.proc_status(), _harness.reset_hwm()
    t0 = time.perf_counter()
    with _harness.RssSampler() as sampler:
        res = load_weights_sharded(ckpt, [ModuleAndPrefix(model)], sharding)
    seconds = time.perf_counter() - t0
    io1, st1 = proc.io_counters(), _harness.proc_status()
    check_loaded(model, res[0], f'rank {sharding.rank}')
    peak = max(sampler.peak, st1['VmHWM'] if hwm else 0) - st0['VmRSS']
    return model, dict(
        rank=sharding.rank,
        rchar=io1.read_chars - io0.read_chars,
        loader_bytes=res.bytes_read,
        peak_rss=peak,
        load_s=seconds,
    )


def whole_load_seconds(ckpt: Path, config) -> float:
    """The anchor: seconds for `load_weights_from_hf_shards` to fill the whole model, in the same process and
    page-cache state."""
    from mstar_utils.loading import ModuleAndPrefix, load_weights_from_hf_shards
    from mstar_utils.model import build_on_meta

    model = build_on_meta(config)
    t0 = time.perf_counter()
    load_weights_from_hf_shards(ckpt, [ModuleAndPrefix(model)])
    seconds = time.perf_counter() - t0
    del model
    gc.collect()
    return seconds


def reference_logits(ckpt: Path, ids, device):
    "Logits of the unsharded float32 model."
    import torch
    from mstar_utils.model import load_model

    model = load_model(ckpt, dtype=torch.float32, device=device)
    with torch.no_grad():
        out = model(ids).logits.float()
    del model
    gc.collect()
    return out


def checkpoint_split(ckpt: Path, sharding) -> tuple[int, int]:
    "(tensor bytes of the checkpoint, bytes of the tensors the plan leaves whole: every rank reads them)."
    tensors = bench_load.checkpoint_tensors(ckpt)
    whole = sum(t['nbytes'] for t in tensors if sharding.slice_for(t['key'], t['shape']).dim is None)
    return sum(t['nbytes'] for t in tensors), whole


def report(name: str, ws: int, stats: list, ckpt_bytes: int, replicated: int, diff: float, backend: str) -> dict:
    "Print the per-rank table and the targets; the result dict."
    print(
        f'\n{name}: {ckpt_bytes / 1e6:.1f} MB of tensors, {replicated / 1e6:.1f} MB of them read whole by every rank; '
        f'world_size {ws} ({backend})'
    )
    print(
        f"{'rank':>4} {'rchar MB':>9} {'loader MB':>9} {'peak RSS MB':>11} {'peak/read':>9} {'load s':>7} "
        f"{'forward s':>9}"
    )
    for s in stats:
        print(
            f"{s['rank']:>4} {s['rchar'] / 1e6:9.1f} {s['loader_bytes'] / 1e6:9.1f} {s['peak_rss'] / 1e6:11.1f} "
            f"{s['peak_rss'] / s['rchar']:9.3f} "
            f"{s['load_s']:7.2f} {s['forward_s']:9.2f}"
        )
    limit = ckpt_bytes + (ws - 1) * replicated
    total = sum(s['rchar'] for s in stats)
    targets = {
        'sum of bytes read / (checkpoint + (world_size-1) x replicated) <= 1.01': (
            total / limit,
            total <= 1.01 * limit,
        ),
        'max |logits - unsharded fp32| <= 1e-4': (diff, diff <= 1e-4),
        'max over ranks of peak RSS above baseline / own bytes read <= 1.1': (
            max(s['peak_rss'] / s['rchar'] for s in stats),
            all(s['peak_rss'] <= 1.1 * s['rchar'] for s in stats),
        ),
    }
    print('targets:')
    for k, (v, ok) in targets.items():
        print(f"  {'MET ' if ok else 'MISS'} {k}: {v:.3g}")
    slowest, whole = max(s['load_s'] for s in stats), stats[0]['whole_load_s']
    print(
        f'slowest rank load {slowest:.2f} s; the whole model by load_weights_from_hf_shards on rank 0 afterwards '
        f'{whole:.2f} s '
        f'(ratio {slowest / whole:.2f}; ranks share the cores, so this is an anchor, not a target)'
    )
    return dict(
        world_size=ws,
        bytes_read_per_rank=[s['rchar'] for s in stats],
        checkpoint_bytes=ckpt_bytes,
        replicated_bytes=replicated,
        max_logit_diff=diff,
        seconds=round(max(s['load_s'] for s in stats), 3),
        checkpoint=name,
        backend=backend,
        loader_bytes_per_rank=[s['loader_bytes'] for s in stats],
        peak_rss_above_baseline_per_rank=[s['peak_rss'] for s in stats],
        forward_seconds=round(max(s['forward_s'] for s in stats), 3),
        whole_load_seconds=round(stats[0]['whole_load_s'], 3),
        targets_met={k: ok for k, (v, ok) in targets.items()},
    )


@call_parse
def main(
    quick: bool = False,  # SmolLM2-135M instead of the 2.2 GB synthetic checkpoint
    tokens: int = 16,  # prompt length of the forward pass
):
    "Each rank loads only its slices; bytes read, peak RSS and logits against the unsharded model."
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig
    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.tensor_parallel import Sharding, tp_plan

    cuda = torch.cuda.is_available()
    backend, local = ('nccl' if cuda else 'gloo'), int(os.environ.get('LOCAL_RANK', 0))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device(f'cuda:{local}' if cuda else 'cpu')
    dist.init_process_group(backend)
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
    name, ckpt = (
        ('SmolLM2-135M', smollm2_checkpoint())
        if quick
        else ('Llama-synth-1.1B', bench_load.synth_checkpoint(build=False))
    )
    if rank == 0:
        if not quick:
            bench_load.synth_checkpoint()  # built once, by one rank
        bench_load.read_files(ckpt)  # warm page cache, as bench_load's warm runs
    dist.barrier()
    config = AutoConfig.from_pretrained(ckpt)
    sharding = Sharding(tp_plan(config, ws), rank, ws)
    model, stats = load_slices(ckpt, config, sharding)
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    model = model.float().to(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(ids).logits.float()
    stats['forward_s'] = time.perf_counter() - t0
    del model
    gc.collect()
    if rank == 0:
        stats['whole_load_s'] = whole_load_seconds(ckpt, config)
    ref = reference_logits(ckpt, ids, device) if rank == 0 else torch.empty_like(logits)
    dist.broadcast(ref, src=0)
    diff = (logits - ref).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    everyone = [None] * ws
    dist.all_gather_object(everyone, stats)
    if rank == 0:
        ckpt_bytes, replicated = checkpoint_split(ckpt, sharding)
        out = report(name, ws, everyone, ckpt_bytes, replicated, diff.item(), backend)
        (HERE / 'results').mkdir(exist_ok=True)
        (HERE / 'results' / f'tp_load_{name}_{ws}.json').write_text(json.dumps(out, indent=1))
        print(json.dumps(out))
    dist.destroy_process_group()
