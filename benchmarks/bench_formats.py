#!/usr/bin/env python
"""Quantized-format load benchmark, ratios against the reference measured in the same run.

    python benchmarks/bench_formats.py                 # SmolLM2's Q4_1 GGUF vs transformers; 0.25 GB Q4_K and NVFP4
                                                       # vs bf16
    python benchmarks/bench_formats.py --q4k-gb 1.0    # the issue's 1 GB files (needs ~8 GB of memory and a few
                                                       # minutes)

Rows:
- GGUF SmolLM2: `load_model(file.gguf)` against `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`, both
  float32, best of `--repeat` for ours, one run of transformers (it takes tens of seconds); target >= 5x.
- Q4_K dequantizing load: `load_model(file.gguf, dtype=bfloat16)` on a synthetic Llama of random Q4_K codes, GB/s of the
  bf16 output bytes, against `load_model` of the same model saved as bf16 safetensors; target >= 0.5x.
- NVFP4 dequantizing load: the same for a synthetic Llama of random NVFP4 codes in compressed-tensors'
  `nvfp4-pack-quantized` layout (every `*_proj`; embeddings, norms and lm_head in bf16, a 4096-token vocabulary so that
  the codes dominate).
- GPTQ act-order, AWQ and bitsandbytes NF4 dequantizing loads (`--int_gb`, default 0.1 GB): the same rows for a
  synthetic Llama of random 4-bit codes in GPTQ's layout (groups of 128, a permuted `g_idx`) and AutoAWQ's GEMM layout,
  with the quantization_config `mstar_utils.testing.write_int4_checkpoint` writes; NF4 is bitsandbytes' own CPU
  quantization saved by transformers (`write_bnb_checkpoint`). No peer on the CPU: transformers dequantizes GPTQ/AWQ/bnb
  only in GPU kernels.
"""

from __future__ import annotations
import contextlib
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

import torch
from fastcore.script import call_parse


def best(fn, repeat: int) -> tuple:
    "(best seconds, last result) of `repeat` calls of `fn`."
    times, out = [], None
    for _ in range(repeat):
        out = None
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def nbytes(m) -> int:
    return sum(t.nbytes for t in m.state_dict().values())


def write_nvfp4(dest: Path, cfg, seed: int = 0) -> Path:
    """A Llama of random NVFP4 codes as compressed-tensors' `nvfp4-pack-quantized` stores it: uint8 codes, E4M3 group
    scales."""
    from safetensors.torch import save_file
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from mstar_utils.model import build_on_meta

    cls, g, out = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)], torch.Generator().manual_seed(seed), {}
    for k, t in build_on_meta(cfg, cls, torch.bfloat16).state_dict().items():
        if t.ndim == 2 and '_proj' in k:
            m, (rows, cols) = k[: -len('.weight')], t.shape
            out[m + '.weight_packed'] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
            out[m + '.weight_scale'] = (torch.rand(rows, cols // 16, generator=g) * 400 + 1).to(torch.float8_e4m3fn)
            out[m + '.weight_global_scale'] = torch.tensor([448 * 6 / 0.05])
        else:
            out[k] = (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
    weights = {'num_bits': 4, 'type': 'float', 'strategy': 'tensor_group', 'group_size': 16, 'symmetric': True}
    c = {
        **cfg.to_dict(),
        'architectures': [cls.__name__],
        'dtype': 'bfloat16',
        'quantization_config': {
            'quant_method': 'compressed-tensors',
            'format': 'nvfp4-pack-quantized',
            'ignore': ['lm_head'],
            'quantization_status': 'compressed',
            'config_groups': {'group_0': {'targets': ['Linear'], 'format': 'nvfp4-pack-quantized', 'weights': weights}},
        },
    }
    dest.mkdir(parents=True, exist_ok=True)
    (dest / 'config.json').write_text(json.dumps(c, indent=2))
    save_file(out, str(dest / 'model.safetensors'), metadata={'format': 'pt'})
    return dest


def dequantizing_row(name: str, load, tmp: Path, repeat: int) -> tuple:
    """The row of a dequantizing load `load()` against `load_model` of its result saved as bf16 safetensors, in GB/s
    of output."""
    from mstar_utils.model import load_model

    m = load()
    out_bytes = nbytes(m)
    with contextlib.redirect_stderr(io.StringIO()):
        m.save_pretrained(tmp / 'bf16')
    del m
    load_model(tmp / 'bf16')  # warm the page cache
    t_q, _ = best(load, repeat)
    t_b, _ = best(lambda: load_model(tmp / 'bf16'), repeat)
    shutil.rmtree(tmp / 'bf16')
    gq, gb = out_bytes / t_q / 1e9, out_bytes / t_b / 1e9
    return (
        f'{name} -> {out_bytes / 1e9:.2f} GB bf16 (GB/s of output)',
        f'{gq:.2f}',
        f'{gb:.2f} (bf16 safetensors load_model)',
        f'{gq / gb:.2f}x',
        '>= 0.5x',
    )


def write_int4(dest: Path, cfg, method: str, seed: int = 0) -> Path:
    "A Llama of random 4-bit codes in GPTQ's (act-order, groups of 128) or AWQ's GEMM layout, float16 elsewhere."
    from safetensors.torch import save_file
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from mstar_utils.model import build_on_meta

    cls, g, out = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)], torch.Generator().manual_seed(seed), {}

    def words(*shape):
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=g)

    for k, t in build_on_meta(cfg, cls, torch.float16).state_dict().items():
        if t.ndim == 2 and '_proj' in k:
            m, (N, K) = k[: -len('.weight')], t.shape
            out[m + '.scales'] = (torch.rand(K // 128, N, generator=g) * 0.01).half()
            if method == 'gptq':
                out[m + '.qweight'], out[m + '.qzeros'] = words(K // 8, N), words(K // 128, N // 8)
                out[m + '.g_idx'] = (torch.randperm(K, generator=g) // 128).int()
            else:
                out[m + '.qweight'], out[m + '.qzeros'] = words(K, N // 8), words(K // 128, N // 8)
        else:
            out[k] = (torch.randn(t.shape, generator=g) * 0.02).half()
    qc = (
        dict(quant_method='gptq', bits=4, group_size=128, sym=True, desc_act=True, checkpoint_format='gptq')
        if method == 'gptq'
        else dict(quant_method='awq', bits=4, group_size=128, zero_point=True, version='gemm')
    )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / 'config.json').write_text(
        json.dumps(
            {**cfg.to_dict(), 'architectures': [cls.__name__], 'dtype': 'float16', 'quantization_config': qc}, indent=2
        )
    )
    save_file(out, str(dest / 'model.safetensors'), metadata={'format': 'pt'})
    return dest


def int_rows(cfg, int_gb: float, tmp: Path, repeat: int) -> list:
    "The GPTQ act-order, AWQ and bitsandbytes NF4 rows, on Llamas of about `int_gb` GB of codes."
    from transformers import AutoModelForCausalLM
    from mstar_utils.model import load_model
    from mstar_utils.testing import write_bnb_checkpoint

    layer = (4 * 2048 * 2048 // 2 + 3 * 2048 * 5632) // 2  # half a byte a weight
    cfg.vocab_size, cfg.num_hidden_layers = 4096, max(1, round(int_gb * 1e9 / layer))
    rows = []
    for name, method in [('GPTQ act-order int4', 'gptq'), ('AWQ int4 (GEMM)', 'awq')]:
        d = write_int4(tmp / method, cfg, method)
        size = (d / 'model.safetensors').stat().st_size / 1e9
        rows.append(
            dequantizing_row(f'{name} {size:.2f} GB', lambda d=d: load_model(d, dtype=torch.bfloat16), tmp, repeat)
        )
        shutil.rmtree(d)
    torch.manual_seed(0)
    d = write_bnb_checkpoint(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), tmp / 'nf4', 'nf4')
    size = (d / 'model.safetensors').stat().st_size / 1e9
    rows.append(
        dequantizing_row(f'bitsandbytes NF4 {size:.2f} GB', lambda: load_model(d, dtype=torch.bfloat16), tmp, repeat)
    )
    return rows


def table(rows: list) -> None:
    "Print `rows` under the header, columns padded."
    w = [max(len(r[i]) for r in rows + [('row', 'ours', 'reference', 'ratio', 'target')]) for i in range(5)]
    for r in [('row', 'ours', 'reference', 'ratio', 'target')] + rows:
        print(' | '.join(c.ljust(n) for c, n in zip(r, w, strict=True)))
    print(f'torch threads: {torch.get_num_threads()}, cpus: {os.cpu_count()}')


@call_parse
def main(
    repeat: int = 3,  # runs of each of our loads (the best is kept)
    q4k_gb: float = 0.25,  # size of the synthetic Q4_K GGUF and NVFP4 files, in GB
    int_gb: float = 0.1,  # size of the GPTQ, AWQ and NF4 codes, in GB (0: skip those rows)
    only_int: bool = False,  # only the GPTQ, AWQ and NF4 rows
):
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging
    from mstar_utils.checkpoints import smollm2_gguf
    from mstar_utils.model import load_model
    from mstar_utils.testing import write_gguf_checkpoint

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    rows = []
    if only_int:
        with tempfile.TemporaryDirectory(dir=os.environ.get('MSTAR_BENCH_TMP')) as tmp:
            rows += int_rows(
                LlamaConfig(
                    hidden_size=2048,
                    intermediate_size=5632,
                    num_attention_heads=32,
                    num_key_value_heads=8,
                    head_dim=64,
                    max_position_embeddings=2048,
                    tie_word_embeddings=False,
                ),
                int_gb,
                Path(tmp),
                repeat,
            )
        return table(rows)
    f = smollm2_gguf()
    load_model(f)  # warm: imports, page cache
    ours, _ = best(lambda: load_model(f), repeat)
    t = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name)
    hf = time.perf_counter() - t
    rows.append(
        ('GGUF SmolLM2 Q4_1 load (s)', f'{ours:.2f}', f'{hf:.2f} (from_pretrained)', f'{hf / ours:.1f}x', '>= 5x')
    )
    # a synthetic Llama in Q4_K: layers of hidden 2048 / intermediate 5632, as many as the size asks
    layer_bytes = (
        (4 * 2048 * 2048 // 2 + 3 * 2048 * 5632) * 144 // 256
    )  # q, o, k+v (GQA 4:1) and the MLP, 144 bytes per 256
    layers = max(1, round(q4k_gb * 1e9 / layer_bytes))
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory(dir=os.environ.get('MSTAR_BENCH_TMP')) as tmp:
        tmp = Path(tmp)
        (tmp / 'q4k').mkdir()
        g = write_gguf_checkpoint(tmp / 'q4k' / 'synth.gguf', {}, 'Q4_K', cfg)
        rows.append(
            dequantizing_row(
                f'Q4_K GGUF {g.stat().st_size / 1e9:.2f} GB', lambda: load_model(g, dtype=torch.bfloat16), tmp, repeat
            )
        )
        g.unlink()
        nv_layer = (4 * 2048 * 2048 // 2 + 3 * 2048 * 5632) * 9 // 16  # half a byte a value, one E4M3 scale per 16
        cfg.vocab_size, cfg.num_hidden_layers = 4096, max(1, round(q4k_gb * 1e9 / nv_layer))
        d = write_nvfp4(tmp / 'nvfp4', cfg)
        size = (d / 'model.safetensors').stat().st_size / 1e9
        rows.append(
            dequantizing_row(
                f'NVFP4 (compressed-tensors) {size:.2f} GB', lambda: load_model(d, dtype=torch.bfloat16), tmp, repeat
            )
        )
        shutil.rmtree(d)
        if int_gb:
            rows += int_rows(cfg, int_gb, tmp, repeat)
    table(rows)
