#!/usr/bin/env python
"""MoE load benchmark: a Qwen3-MoE-shaped checkpoint with 64 experts per layer and 8 layers, stored per expert as
transformers' `save_pretrained` writes it, loaded into the fused `gate_up_proj`/`down_proj` layout two ways in the same
run:

  (a) transformers `AutoModelForCausalLM.from_pretrained` (its own WeightConverter rules);
  (b) ours: `load_model`, which builds the model on meta from config.json and fills it through the Qwen3-MoE recipes;
  (c) ours on a dense twin: the same tensors stored already fused (written once from (b)'s state_dict), loaded by
      `load_model` with nothing to convert, so (b)'s GB/s over (c)'s is what the conversion costs per byte.

    python benchmarks/bench_moe_load.py               # 3 runs per method
    python benchmarks/bench_moe_load.py --repeats 1

The checkpoint is built once and cached under `mstar_utils.checkpoints.cache_dir()/'bench'`. Each run is a new
interpreter; the clock and the RSS baseline start after the imports (the model's
modeling module included). Peak RSS is the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs before
the clock), so no sampling thread competes with the loaders for the interpreter lock. Both methods'
state_dicts are fingerprinted (crc32 of every tensor's bytes) and must agree. Prints a table with ratios ours /
transformers and writes benchmarks/results/moe_load.json.
"""

from __future__ import annotations
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

from _harness import proc_status  # VmRSS and VmHWM, as the dense benchmark reads them
from fastcore.script import call_parse

HERE = Path(__file__).resolve().parent
RESULTS = HERE / 'results'
NAME = 'qwen3-moe-64x8-bf16'
CONFIG = dict(
    vocab_size=4096,
    hidden_size=384,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=48,
    num_experts=64,
    num_experts_per_tok=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
SHARD = '100MB'
METHODS = {
    'hf': '(a) transformers from_pretrained',
    'ours': '(b) ours: load_model, per-expert keys fused on load',
    'dense': '(c) ours: load_model, the same bytes stored fused',
}


def checkpoint(build: bool = True) -> Path:
    "The cached checkpoint folder, built (in a child interpreter) when missing."
    from mstar_utils.checkpoints import cache_dir

    out = cache_dir() / 'bench' / NAME
    if (out / '.complete').exists() or not build:
        return out
    print(f'building {NAME} in {out} (once) ...', flush=True)
    subprocess.run([sys.executable, __file__, '--build'], check=True)
    return out


def dense_checkpoint() -> Path:
    "The fused twin of the checkpoint: config.json and the loaded state_dict in shards of about SHARD, with an index."
    from mstar_utils.checkpoints import cache_dir, cached_folder

    out = cache_dir() / 'bench' / (NAME + '-fused')
    if (out / '.complete').exists():
        return out
    import shutil
    import torch
    from safetensors.torch import save_file
    from mstar_utils.model import load_model

    sd = load_model(checkpoint(), dtype=torch.bfloat16).state_dict()

    def write(tmp):
        shutil.copy(checkpoint() / 'config.json', tmp / 'config.json')
        shards, cur, size, cap = [], {}, 0, int(SHARD.rstrip('MB')) * 10**6
        for k, t in sd.items():
            if cur and size + t.numel() * t.element_size() > cap:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = t.contiguous()
            size += t.numel() * t.element_size()
        shards.append(cur)
        wm = {}
        for i, part in enumerate(shards):
            name = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
            save_file(part, str(tmp / name), metadata={'format': 'pt'})
            wm.update(dict.fromkeys(part, name))
        (tmp / 'model.safetensors.index.json').write_text(json.dumps({'metadata': {}, 'weight_map': wm}))

    return cached_folder('bench', NAME + '-fused', write)


def _build():
    import torch
    from transformers import Qwen3MoeConfig, AutoModelForCausalLM
    from mstar_utils.checkpoints import cached_folder  # build into a temporary folder, rename into place when complete

    def write(tmp):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3MoeConfig(**CONFIG), dtype=torch.bfloat16).save_pretrained(
            tmp, max_shard_size=SHARD
        )

    cached_folder('bench', NAME, write)


def measure(method: str) -> dict:
    import gc
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    from mstar_utils.model import load_model

    # the model's code is imported before the clock, for both methods
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    ckpt = checkpoint(build=False)
    torch.set_num_threads(os.cpu_count() or 1)
    dense = dense_checkpoint() if method == 'dense' else None
    gc.collect()
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # VmHWM from here
    base = proc_status()['VmRSS']
    t0 = time.perf_counter()
    if method == 'hf':
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    elif method == 'ours':
        model = load_model(ckpt, dtype=torch.bfloat16)  # picks the Qwen3-MoE recipes, checks, finalizes
    else:
        model = load_model(dense, dtype=torch.bfloat16)  # the same tensors, nothing to fuse
    load_s = time.perf_counter() - t0
    peak = proc_status()['VmHWM']
    sd = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    fp = {k: zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) for k, t in sd.items()}
    return dict(
        method=method,
        load_s=load_s,
        peak_above_base=peak - base,
        base_rss=base,
        model_bytes=nbytes,
        fingerprint=zlib.crc32(json.dumps(sorted(fp.items())).encode()),
        n_tensors=len(sd),
    )


def run_one(method: str) -> dict:
    p = subprocess.run([sys.executable, __file__, '--worker', method], capture_output=True, text=True)
    line = next((out_line for out_line in reversed(p.stdout.splitlines()) if out_line.startswith('RESULT ')), None)
    if p.returncode or line is None:
        raise RuntimeError(f'{method}: worker failed\n{p.stderr[-3000:]}')
    return json.loads(line[7:])


@call_parse
def main(
    repeats: int = 3,  # runs per method, each in a new interpreter
    worker: str = '',  # internal: run one measurement of this method
    build: bool = False,
):  # internal: build the checkpoint
    """Load a 64-expert, 8-layer MoE checkpoint with transformers and with mstar_utils; print time and peak RSS with
    ratios."""
    if worker:
        print('RESULT ' + json.dumps(measure(worker)))
        return
    if build:
        _build()
        return
    ckpt = checkpoint()
    subprocess.run(
        [
            sys.executable,
            '-c',
            f'import sys; sys.path.insert(0, {str(HERE)!r}); import bench_moe_load as b; b.dense_checkpoint()',
        ],
        check=True,
    )
    files = sorted(ckpt.glob('*.safetensors'))
    ck_bytes = sum(f.stat().st_size for f in files)
    print(
        f'checkpoint {NAME}: {ck_bytes / 1e6:.0f} MB in {len(files)} shards, 64 experts x 8 layers, per-expert keys; '
        f'{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}',
        flush=True,
    )
    runs = []
    for i in range(repeats):
        for m in (
            ('hf', 'ours', 'dense') if i % 2 == 0 else ('dense', 'ours', 'hf')
        ):  # alternate to spread page cache and thermal effects
            r = run_one(m)
            runs.append(r)
            print(
                f'  run {i + 1}/{repeats} {m:<5} {r["load_s"]:.3f} s, peak RSS +{r["peak_above_base"] / 1e6:.0f} MB',
                flush=True,
            )
    fps = {r['fingerprint'] for r in runs}
    if len(fps) != 1:
        raise SystemExit(f'state_dicts differ between methods: fingerprints {fps}')
    summ = {}
    for m in METHODS:
        rows = [r for r in runs if r['method'] == m]
        summ[m] = dict(
            load_s=statistics.median(r['load_s'] for r in rows),
            load_min_s=min(r['load_s'] for r in rows),
            load_max_s=max(r['load_s'] for r in rows),
            peak_mb=statistics.median(r['peak_above_base'] for r in rows) / 1e6,
            model_mb=rows[0]['model_bytes'] / 1e6,
        )
    head = f"{'method':<62} {'load s (median)':>15} {'min-max':>13} {'peak RSS MB':>11} {'x model':>7}"
    print('\n' + head + '\n' + '-' * len(head))
    for m, label in METHODS.items():
        s = summ[m]
        print(
            f"{label:<62} {s['load_s']:15.3f} {s['load_min_s']:6.3f}-{s['load_max_s']:<6.3f} {s['peak_mb']:11.0f} "
            f"{s['peak_mb'] / s['model_mb']:7.2f}"
        )
    t, r = summ['ours']['load_s'] / summ['hf']['load_s'], summ['ours']['peak_mb'] / summ['hf']['peak_mb']
    gbs = {m: summ[m]['model_mb'] / 1e3 / summ[m]['load_s'] for m in ('ours', 'dense')}
    conv_vs_dense = gbs['ours'] / gbs['dense']
    print(
        f"converted load {gbs['ours']:.2f} GB/s, dense load of the same bytes {gbs['dense']:.2f} GB/s: "
        f"{conv_vs_dense:.2f}x"
    )
    print(
        f"\nours / transformers: time {t:.2f}x, peak RSS {r:.2f}x   (model {summ['hf']['model_mb']:.0f} MB, "
        "state_dicts identical: "
        f"{runs[0]['n_tensors']} tensors, one fingerprint)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / 'moe_load.json').write_text(
        json.dumps(
            dict(
                checkpoint=NAME,
                bytes=ck_bytes,
                config=CONFIG,
                summary=summ,
                ratio_time=t,
                ratio_peak_rss=r,
                converted_vs_dense_gbs=conv_vs_dense,
                runs=runs,
                cpus=os.cpu_count(),
            ),
            indent=1,
        )
    )
