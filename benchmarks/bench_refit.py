"""Refit benchmark: a trainer's weights written into a model `load_model` built, in place, against the floors measured
in the same run.

- routing: a Llama of 2,222 tiny layers (20,001 tensors); µs per tensor of `refit` beyond a plain loop that copies
  each tensor into its parameter by a dict look-up, and of `refit_plan` (made once).
- bf16: SmolLM2-135M; GB/s of `refit` against `copy_` of the same bytes into the same parameters.
- fp8 / NVFP4: SmolLM2 kept in block fp8 or compressed-tensors NVFP4 and re-quantized by the refit; GB/s of the
  bf16 bytes sent, against `copy_` of the same bytes into a bf16 SmolLM2.
- MoE: a Qwen3-MoE with 64 experts a layer and 8 layers, sent per expert and fused on the way; `refit` time against
  a `load_model` of the same weights.
- --gpu (tools/gpu-check): the bf16 rows on CUDA, SmolLM2 and the 2.2 GB synthetic Llama of bench_load.py, the trainer's
  tensors already on the device; GB/s of `refit` against a device-to-device `copy_` of the same bytes into the same
  parameters (target: >= 0.8x). Without CUDA it says so and exits 0.

Run: python benchmarks/bench_refit.py   (about two minutes on 2 cores; it writes its checkpoints to a temp folder)"""

from __future__ import annotations
import argparse
import tempfile
import time
from pathlib import Path

import torch


def best(fn, n: int = 3) -> float:
    "The fastest of `n` runs of `fn`, in seconds."
    return min(best_of({'fn': fn}, n)['fn'])


def best_of(fns: dict, n: int = 5, cuda: bool = False) -> dict:
    """{name: [seconds of each run]} of `n` rounds, the functions interleaved, so the machine's load hits each alike;
    `cuda`: each run timed from an idle device to the end of the work it queued."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            out[k].append(time.perf_counter() - t)
    return out


def plain_copy(model, plan, sent: dict):
    "The floor: each route's one tensor copied into its parameter, found by a dict look-up, no checks."
    params = dict(model.named_parameters())
    pairs = [(params[r.target].detach(), r.keys[0]) for r in plan.routes]

    def run():
        with torch.no_grad():
            for p, k in pairs:
                p.copy_(sent[k])

    return run


def routing(root: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from mstar_utils.model import load_model
    from mstar_utils.refit import refit, refit_plan
    from mstar_utils.testing import checkpoint_tensors

    cfg = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2222, num_attention_heads=1)
    cfg.update(num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = root / 'llama20k'
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(folder)
    model, sent = load_model(folder), checkpoint_tensors(folder)
    n = len(sent)
    t = time.perf_counter()
    plan = refit_plan(model, sent)
    t_plan = time.perf_counter() - t
    runs = best_of({'refit': lambda: refit(model, sent, plan), 'copy': plain_copy(model, plan, sent)})
    t_refit, t_copy = min(runs['refit']), min(runs['copy'])
    return dict(tensors=n, plan_us=t_plan / n * 1e6, refit_us=t_refit / n * 1e6, copy_us=t_copy / n * 1e6)


def bf16(root: Path, ck: Path | None = None, device: str = 'cpu', n: int = 9) -> dict:
    """GB/s of a bf16 refit of checkpoint `ck` (None: SmolLM2) on `device`, and of `copy_` of the same bytes, the
    trainer's tensors on `device` too."""
    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.model import load_model
    from mstar_utils.refit import refit, refit_plan
    from mstar_utils.testing import checkpoint_tensors

    ck = ck or smollm2_checkpoint()
    model, sent = load_model(ck, device=device), checkpoint_tensors(ck)
    sent = {k: v.to(device) * 1.01 for k, v in sent.items()}  # new values, the same bytes
    plan = refit_plan(model, sent)
    nbytes = sum(v.numel() * v.element_size() for v in sent.values())
    runs = best_of(
        {'refit': lambda: refit(model, sent, plan), 'copy': plain_copy(model, plan, sent)}, n, device != 'cpu'
    )
    t_refit, t_copy = min(runs['refit']), min(runs['copy'])
    return dict(bytes=nbytes, refit_gbs=nbytes / t_refit / 1e9, copy_gbs=nbytes / t_copy / 1e9)


def gpu_rows(root: Path):
    "The CUDA rows: bf16 refit GB/s beside a device-to-device copy_ of the same bytes, SmolLM2 and the 2.2 GB Llama."
    if not torch.cuda.is_available():
        print('refit on CUDA: skipped (no CUDA device); GPU figures unmeasured')
        return
    from bench_load import synth_checkpoint

    print(f'CUDA: {torch.cuda.get_device_name()}')
    for name, ck in (('SmolLM2', None), ('synthetic Llama', synth_checkpoint())):
        r = bf16(root, ck, 'cuda', 5)
        ratio = r['refit_gbs'] / r['copy_gbs']
        verdict = 'met' if ratio >= 0.8 else 'MISSED'
        print(
            f'bf16 {name} on CUDA ({r["bytes"] / 1e9:.2f} GB): refit {r["refit_gbs"]:.1f} GB/s, device-to-device '
            f'copy_ {r["copy_gbs"]:.1f} GB/s, ratio {ratio:.2f}x (target >= 0.8x: {verdict})'
        )
        torch.cuda.empty_cache()


def kept(root: Path, fmt: str) -> dict:
    """GB/s of a refit of SmolLM2 kept in `fmt` ('fp8': block fp8 as DeepSeek-V3 ships it, re-quantized by
    transformers' Fp8Quantize; 'nvfp4': compressed-tensors NVFP4A16, by its compressor), the trainer's bf16 tensors
    counted; beside `copy_` of the same bf16 bytes into a bf16 SmolLM2."""
    from transformers import AutoModelForCausalLM

    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.model import load_model
    from mstar_utils.refit import refit, refit_plan
    from mstar_utils.testing import checkpoint_tensors, write_ct_preset_checkpoint, write_fp8_checkpoint

    ck = smollm2_checkpoint()
    source = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    if fmt == 'fp8':
        folder = write_fp8_checkpoint(source, root / 'smol-fp8', block=(64, 64))
    else:
        folder = write_ct_preset_checkpoint(source, root / 'smol-nvfp4', 'NVFP4A16')
    served, plain = load_model(folder, quantized='keep'), load_model(ck)
    sent = {k: v * 1.01 for k, v in checkpoint_tensors(ck).items()}  # new values, bf16 as a trainer sends them
    plan, floor = refit_plan(served, sent), refit_plan(plain, sent)
    nbytes = sum(v.numel() * v.element_size() for v in sent.values())
    runs = best_of({'refit': lambda: refit(served, sent, plan), 'copy': plain_copy(plain, floor, sent)}, 3)
    return dict(bytes=nbytes, refit_gbs=nbytes / min(runs['refit']) / 1e9, copy_gbs=nbytes / min(runs['copy']) / 1e9)


def moe(root: Path) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mstar_utils.model import load_model
    from mstar_utils.refit import refit, refit_plan
    from mstar_utils.testing import checkpoint_tensors

    cfg = dict(vocab_size=4096, hidden_size=384, intermediate_size=1024, moe_intermediate_size=256)
    cfg.update(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=48, num_experts=64)
    cfg.update(num_experts_per_tok=4, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = root / 'moe64x8'
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16).save_pretrained(folder, max_shard_size='100MB')
    sent, model = checkpoint_tensors(folder), load_model(folder)
    t = time.perf_counter()
    plan = refit_plan(model, sent)
    t_plan = time.perf_counter() - t
    fused = {k: v.clone() for k, v in model.state_dict().items()}  # the same bytes, fused as the model holds them
    params = [(p.detach(), fused[n]) for n, p in model.named_parameters()]

    def copy():
        with torch.no_grad():
            for p, v in params:
                p.copy_(v)

    runs = best_of({'refit': lambda: refit(model, sent, plan), 'copy': copy, 'load': lambda: load_model(folder)}, 3)
    nbytes = sum(v.numel() * v.element_size() for v in sent.values())
    t_refit, t_copy, t_load = min(runs['refit']), min(runs['copy']), min(runs['load'])
    return dict(tensors=len(sent), bytes=nbytes, load_s=t_load, plan_s=t_plan, refit_s=t_refit, copy_s=t_copy)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--only', choices=['routing', 'bf16', 'moe', 'fp8', 'nvfp4'], default=None)
    p.add_argument('--gpu', action='store_true', help='only the CUDA rows (tools/gpu-check); skipped without CUDA')
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    scratch = tempfile.TemporaryDirectory(prefix='bench-refit-')  # the checkpoints it writes go with the run
    root = Path(scratch.name)
    print(f'torch threads: {torch.get_num_threads()}')
    if args.gpu:
        gpu_rows(root)
        return
    if args.only in (None, 'routing'):
        r = routing(root)
        print(
            f'routing, {r["tensors"]:,} tensors: refit {r["refit_us"]:.1f} µs/tensor, plain copy loop '
            f'{r["copy_us"]:.1f} µs/tensor, so routing {r["refit_us"] - r["copy_us"]:.1f} µs/tensor beyond the copy; '
            f'refit_plan (once) {r["plan_us"]:.1f} µs/tensor'
        )
    if args.only in (None, 'bf16'):
        r = bf16(root)
        print(
            f'bf16 SmolLM2 ({r["bytes"] / 1e6:.0f} MB): refit {r["refit_gbs"]:.2f} GB/s, '
            f'copy_ {r["copy_gbs"]:.2f} GB/s, '
            f'ratio {r["refit_gbs"] / r["copy_gbs"]:.2f}x'
        )
    if args.only in (None, 'moe'):
        r = moe(root)
        print(
            f'MoE 64 experts x 8 layers ({r["tensors"]:,} tensors, {r["bytes"] / 1e6:.0f} MB bf16): refit '
            f'{r["refit_s"]:.2f} s, load_model {r["load_s"]:.2f} s, ratio {r["refit_s"] / r["load_s"]:.2f}x; '
            f'copy_ of the fused bytes {r["copy_s"]:.2f} s (refit/copy {r["refit_s"] / r["copy_s"]:.2f}x); '
            f'refit_plan (once) {r["plan_s"]:.2f} s'
        )
    for fmt, what in (('fp8', 'fp8 blocks of 64 x 64'), ('nvfp4', 'compressed-tensors NVFP4A16')):
        if args.only in (None, fmt):
            r = kept(root, fmt)
            print(
                f'kept {what}, SmolLM2 re-quantized ({r["bytes"] / 1e6:.0f} MB bf16 sent): refit '
                f'{r["refit_gbs"]:.2f} GB/s, copy_ of the bf16 bytes {r["copy_gbs"]:.2f} GB/s, '
                f'ratio {r["refit_gbs"] / r["copy_gbs"]:.2f}x'
            )


if __name__ == '__main__':
    main()
