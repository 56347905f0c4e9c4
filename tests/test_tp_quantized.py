"""Tensor-parallel loading of quantized checkpoints: a parity matrix and the bytes each rank reads.

Models: tiny Llama, Qwen3-MoE (our recipe), OLMoE (transformers' rules), DeepSeek-V3 (MLA), gpt-oss and Llava,
built from their config classes. Formats where the architecture ships them: bf16, fp8 block, compressed-tensors
float and pack, MXFP4. Modes dequantize and keep; TP 1, 2 and 4, MoE models with and without expert parallelism (without
it no expert may be whole on every rank: transformers 5.25's plans name no experts, ours split them).
For each cell the logits equal `from_pretrained` of the checkpoint dequantized by the format's own reference
(float32, <= 1e-4), each rank's tensors equal the full tensor's slice, and the bytes summed over ranks stay within
1.01 x (checkpoint + (world_size - 1) x replicated) plus whole blocks at cuts.
A representative cut runs by default; the full matrix with MSTAR_UTILS_SLOW=1 (or MSTAR_SLOW=1).
"""

import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mstar_utils.tensor_parallel import Sharding, Slice, take, _dim_for, TP_STYLES, WHOLE
from mstar_utils.testing import (
    assert_tensors_equal,
    run_ranks,
    TP_VISION,
    tp_cells,
    tp_inputs as inputs,
    tp_model,
    write_fp8_checkpoint,
    write_mxfp4_checkpoint,
    write_compressed_tensors_checkpoint,
    write_ct_actorder_checkpoint,
    ct_actorder_reference,
    dequantized_reference,
    CT_FLOAT_GROUPS,
    CT_PACK_GROUPS,
)

SLOW = bool(os.environ.get('MSTAR_UTILS_SLOW') or os.environ.get('MSTAR_SLOW'))
FP8_BLOCK = (32, 32)
UNIT = {
    'bf16': 0,
    'fp8': FP8_BLOCK[0],
    'ct_float': 64,
    'ct_pack': 8,
    'ct_actorder': 8,
    'mxfp4': 1,
}  # stored indices a cut may widen to, per format


FORMATS = {
    'llama': ['bf16', 'fp8', 'ct_float', 'ct_pack', 'ct_actorder'],
    'qwen3_moe': ['bf16', 'fp8'],
    'olmoe': ['bf16', 'fp8'],
    'deepseek_v3': ['bf16', 'fp8'],
    'gpt_oss': ['bf16', 'mxfp4'],
    'llava': ['bf16', 'fp8'],
}
MOE = {'qwen3_moe', 'olmoe', 'deepseek_v3', 'gpt_oss'}
ALL = [
    (m, f, q, ws, ep)
    for m, fs in FORMATS.items()
    for f in fs
    for q in (('dequantize',) if f == 'bf16' else ('dequantize', 'keep'))
    for ws in (1, 2, 4)
    for ep in ((True, False) if m in MOE and ws > 1 else (m in MOE,))
]
FAST = [
    ('llama', 'fp8', 'dequantize', 2, False),
    ('llama', 'fp8', 'keep', 2, False),
    ('llama', 'ct_pack', 'keep', 2, False),
    ('llama', 'ct_actorder', 'keep', 2, False),  # weight_g_idx: a column cut reads every group's scales
    ('llama', 'ct_actorder', 'dequantize', 2, False),
    ('qwen3_moe', 'fp8', 'dequantize', 2, True),
    ('qwen3_moe', 'fp8', 'dequantize', 2, False),  # experts split by rows: transformers 5.25's plan names none
    ('olmoe', 'fp8', 'keep', 1, True),
    ('olmoe', 'fp8', 'keep', 2, True),
    ('deepseek_v3', 'fp8', 'keep', 2, True),
    ('deepseek_v3', 'fp8', 'keep', 2, False),  # experts kept one at a time, each layer cut by its rows
    ('gpt_oss', 'mxfp4', 'keep', 2, True),
    ('gpt_oss', 'mxfp4', 'keep', 2, False),  # [in, out] experts by columns, the down bias added once
    ('llava', 'bf16', 'dequantize', 2, False),
]
CELLS = ALL if SLOW else FAST
ONLY = os.environ.get('TPQ_ONLY')
if ONLY:
    CELLS = [c for c in CELLS if re.search(ONLY, '-'.join(map(str, c)))]


def write(name: str, fmt: str, dest: Path) -> Path:
    "The tiny `name` checkpoint in format `fmt`, by the format's writer (compressed-tensors' compressors for ct_*)."
    model = tp_model(name)
    if fmt == 'fp8':
        return write_fp8_checkpoint(model, dest, FP8_BLOCK)
    if fmt == 'mxfp4':
        return write_mxfp4_checkpoint(model, dest)
    if fmt == 'ct_actorder':
        return write_ct_actorder_checkpoint(model.to(torch.bfloat16), dest)
    if fmt in ('ct_float', 'ct_pack'):
        return write_compressed_tensors_checkpoint(
            model.to(torch.bfloat16), dest, CT_FLOAT_GROUPS if fmt == 'ct_float' else CT_PACK_GROUPS
        )
    with contextlib.redirect_stderr(io.StringIO()):
        model.to(torch.bfloat16).save_pretrained(dest)
    return Path(dest)


def reference(name: str, folder: Path, fmt: str, tmp: Path):
    "`from_pretrained` in float32 of `folder` dequantized by the format's reference, in eval mode."
    import transformers as tf

    if fmt == 'bf16':
        ref = folder
    elif fmt == 'ct_actorder':
        ref = ct_actorder_reference(folder, tmp / f'{folder.name}-ref')
    elif fmt.startswith('ct_'):
        ref = ct_reference(folder, tmp / f'{folder.name}-ref')
    else:
        ref = dequantized_reference(folder, tmp / f'{folder.name}-ref', torch.float32)
    cls = tf.LlavaForConditionalGeneration if name == 'llava' else tf.AutoModelForCausalLM
    with contextlib.redirect_stderr(io.StringIO()):
        return cls.from_pretrained(ref, dtype=torch.float32).eval()


def ct_reference(folder: Path, dest: Path) -> Path:
    "`folder` dequantized by compressed-tensors' own dequantizer, scales widened to float32 (it computes in theirs)."
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    sd = {k: v.float() if k.endswith('_scale') else v for k, v in load_file(str(folder / 'model.safetensors')).items()}
    out = CompressedTensorsDequantizer(folder, dtype=torch.float32).process(sd)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((folder / 'config.json').read_text())
    cfg.pop('quantization_config')
    cfg['dtype'] = 'float32'
    (dest / 'config.json').write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in out.items()}, str(dest / 'model.safetensors'), metadata={'format': 'pt'})
    return dest


def stored(folder: Path) -> dict:
    "{key: (shape, dtype)} of the checkpoint's tensors, from the header."
    with safe_open(str(folder / 'model.safetensors'), 'pt') as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 (keys(), no __iter__)


_BYTES = {'BF16': 2, 'F16': 2, 'F32': 4, 'F8_E4M3': 1, 'U8': 1, 'I32': 4, 'I64': 8, 'I8': 1}


def model_key(k: str) -> str:
    "The model tensor a stored key goes into: per-expert weights to fused experts, codes and scales to weights."
    k = re.sub(r'\.experts\.\d+\.(gate|up)_proj\.weight.*$', '.experts.gate_up_proj', k)
    k = re.sub(r'\.experts\.\d+\.down_proj\.weight.*$', '.experts.down_proj', k)
    k = re.sub(r'(_blocks|_scales)$', '', k)
    return re.sub(r'\.weight(_scale_inv|_scale|_packed|_shape|_zero_point|_g_idx)$', '.weight', k)


_LLAVA = [
    (r'^language_model\.model\.', 'model.language_model.'),
    (r'^language_model\.lm_head', 'lm_head'),
    (r'^(vision_tower|multi_modal_projector)\.', r'model.\1.'),
]


def renamed(k: str) -> str:
    "A stored key under the model's name: transformers renames Llava's legacy keys so."
    for a, b in _LLAVA:
        k = re.sub(a, b, k)
    return k


def expert_weight(ref_sd: dict, k: str) -> torch.Tensor:
    "Expert e's gate, up or down weight `k` (`...experts.e.gate_proj.weight`), cut from the reference's fused experts."
    head, e, proj = re.match(r'(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$', k).groups()
    if proj == 'down':
        return ref_sd[f'{head}.down_proj'][int(e)]
    gate_up = ref_sd[f'{head}.gate_up_proj'][int(e)]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == 'gate' else gate_up[half:]


def expert_rows(ref_sd: dict, k: str, sharding: Sharding) -> Slice:
    "The part of expert layer `k` a rank holds under a row split: its fused tensor's slice, less the expert dim."
    head, proj = re.match(r'(.*\.experts)\.\d+\.(gate|up|down)_proj\.weight$', k).groups()
    fused = f'{head}.down_proj' if proj == 'down' else f'{head}.gate_up_proj'
    sl = sharding.slice_for(fused, ref_sd[fused].shape)
    return Slice(sl.dim - 1, (sl.ranges[0],))  # gate and up: each packed part alike


def byte_bound(folder: Path, fmt: str, sharding: Sharding) -> tuple:
    "(checkpoint bytes, replicated bytes, whole blocks at cuts, expert keys whole) of `folder` under `sharding`'s plan."
    total = repl = blocks = 0
    copied = []
    ws = sharding.world_size
    for k, (shape, dt) in stored(folder).items():
        n = _BYTES[dt] * int(torch.Size(shape).numel())
        total += n
        mk = model_key(renamed(k))
        hit = sharding.style_of(mk)
        style = TP_STYLES[hit[1]] if hit else None
        dim = _dim_for(style, mk.rpartition('.')[2], max(len(shape), 2)) if style else None
        # activation order: a column cut reads every group's scales and zero points, and a row cut every g_idx
        whole = fmt == 'ct_actorder' and k.endswith(('_scale', '_zero_point', '_g_idx'))
        if dim is None or n <= 16 or whole:
            repl += n
            if '.experts.' in mk and not mk.endswith('down_proj_bias') and n > 16:  # gpt-oss: added on rank 0 alone
                copied.append(k)
            continue  # whole on every rank; per-tensor scales and shapes too
        if (
            UNIT[fmt] and len(shape) >= 2 and not style.uneven
        ):  # each cut may read one block more along the cut dim, per packed part
            parts = style.parts if mk == renamed(k) else 1  # per-expert keys are one part each
            blocks += (ws - 1) * parts * UNIT[fmt] * (n // shape[dim])
    return total, repl, blocks, copied


def _load(b: bytes) -> dict:
    return torch.load(io.BytesIO(b), weights_only=False)


@pytest.fixture(scope='module')
def matrix(tmp_path_factory):
    "Every cell's per-rank results, its checkpoint and its reference model: one spawn of `run_ranks` per world_size."
    tmp = tmp_path_factory.mktemp('tpq')
    folders, refs = {}, {}
    for m, f, *_ in CELLS:
        if (m, f) not in folders:
            folders[m, f] = write(m, f, tmp / f'{m}-{f}')
            refs[m, f] = reference(m, folders[m, f], f, tmp)
    results = {}
    for ws in sorted({c[3] for c in CELLS}):
        cells = [c for c in CELLS if c[3] == ws]
        jobs = [(folders[m, f], inputs(m), ep, q) for m, f, q, _, ep in cells]
        try:
            per_rank = run_ranks(tp_cells, ws, jobs, timeout=900)
        except RuntimeError as e:  # one failing cell fails the whole spawn: run the cells one by one to pin it down
            per_rank = None
            err = str(e)
        if per_rank is not None:
            for i, c in enumerate(cells):
                results[c] = [_load(r[i]) for r in per_rank]
            continue
        for c, job in zip(cells, jobs, strict=True):
            try:
                results[c] = [_load(r[0]) for r in run_ranks(tp_cells, ws, [job], timeout=600)]
            except RuntimeError as e:
                results[c] = RuntimeError(str(e)[-3000:])
        del err
    return folders, refs, results


@pytest.mark.parametrize('cell', CELLS, ids=lambda c: '-'.join(map(str, c)))
def test_cell(matrix, cell):
    name, fmt, quantized, ws, ep = cell
    folders, refs, results = matrix
    got = results[cell]
    if isinstance(got, Exception):
        raise got
    ref = refs[name, fmt]
    with torch.no_grad():
        ref_logits = ref(**inputs(name)).logits
    ref_sd = ref.state_dict()
    ckpt = folders[name, fmt]
    raw = {renamed(k): t for k, t in load_file(str(ckpt / 'model.safetensors')).items()}
    for r, res in enumerate(got):
        err = (res['logits'] - ref_logits).abs().max().item()
        assert err <= 1e-4, f'rank {r}: max |logits - from_pretrained of the dequantized reference| = {err:.2e}'
        sharding = Sharding(res['plan'], r, ws)
        for k, t in res['tensors'].items():
            if (
                k in res['pinned'] or k not in ref_sd or t.dtype != ref_sd[k].dtype
            ):  # kept codes and scales: the stored tensor's part
                want = take(raw[k], res['pinned'].get(k, WHOLE))
            else:
                want = take(ref_sd[k], sharding.slice_for(k, ref_sd[k].shape))
            assert_tensors_equal(t, want.to(t.dtype), f'rank {r}: {k}, the full tensor\'s slice')
        for k, w in res['dequantized'].items():  # a kept layer's weight: its slice of the reference weight
            if k not in ref_sd:
                want = expert_weight(ref_sd, k)  # one expert's layer: whole under EP, else its part of the rows
                if not ep:
                    want = take(want, expert_rows(ref_sd, k, sharding))
            else:
                want = take(ref_sd[k], sharding.slice_for(k, ref_sd[k].shape))
            assert torch.allclose(w, want, atol=1e-6, rtol=0), f'rank {r}: kept {k} differs from the reference slice'
        if quantized == 'keep' and fmt != 'bf16':
            assert any(k.endswith(('_scale_inv', '_scale', '_scales', '_packed')) for k in res['tensors']), (
                'keep held no scales'
            )
    total, repl, blocks, copied = byte_bound(ckpt, fmt, Sharding(got[0]['plan'], 0, ws))
    assert ws == 1 or copied == [], f'experts whole on every one of {ws} ranks: {copied[:4]}'
    for r, res in enumerate(got):
        assert res['planned_bytes'] == res['bytes_read'], (
            f"rank {r}: load_plan's total_bytes {res['planned_bytes']} != {res['bytes_read']} bytes the load read"
        )
    # every byte once, but pack-quantized `weight_shape`s twice: read to build the op, then loaded; a g_idx too, read
    # to check its groups
    again = sum(
        _BYTES[dt] * int(torch.Size(sh).numel())
        for k, (sh, dt) in stored(ckpt).items()
        if k.endswith(('_shape', '_g_idx'))
    )
    read = sum(res['bytes_read'] for res in got)
    bound = 1.01 * (total + (ws - 1) * repl) + blocks + ws * again
    assert read <= bound, (
        f'{ws} ranks read {read} bytes; bound {bound:.0f} '
        f'(checkpoint {total}, replicated {repl}, blocks at cuts {blocks}, read twice {again} a rank)'
    )
    if ws == 1:
        assert read == total + again, f'one device read {read} bytes of a {total}-byte checkpoint ({again} read twice)'


def test_kept_experts_renamed_then_fused(tmp_path):
    """fp8 experts stored as `block_sparse_moe.experts.N.w1`, renamed to `mlp.experts` and fused: by our recipe
    (Mixtral) or by transformers' rules after its renames (PhiMoE). Kept at 2 ranks with expert parallelism, each rank
    holds its experts' codes and scales as stored, its logits equal the dequantized reference's and load_plan plans its
    bytes."""
    from mstar_utils.testing import tiny_model

    ids = {'input_ids': torch.randint(3, 90, (1, 8), generator=torch.Generator().manual_seed(1))}
    names, jobs, refs = ('mixtral', 'phimoe'), [], []
    for name in names:
        folder = write_fp8_checkpoint(
            tiny_model(name), tmp_path / name, (16, 16), quantize=r'_proj|\.experts\.\d+\.w\d\.'
        )
        refs.append(reference(name, folder, 'fp8', tmp_path))
        jobs.append((folder, ids, True, 'keep'))
    per_rank = run_ranks(tp_cells, 2, jobs, timeout=600)
    for i, (name, (folder, _, _, _), ref) in enumerate(zip(names, jobs, refs, strict=True)):
        with torch.no_grad():
            want = ref(**ids).logits
        raw = load_file(str(folder / 'model.safetensors'))
        n = ref.config.num_local_experts
        for r in range(2):
            res = _load(per_rank[r][i])
            err = (res['logits'] - want).abs().max().item()
            assert err <= 1e-4, f'{name} rank {r}: max |logits - reference| = {err:.2e}'
            assert res['planned_bytes'] == res['bytes_read'] > 0, name
            held = {
                int(m.group(1))
                for k in res['tensors']
                if (m := re.search(r'layers\.0\.mlp\.experts\.(\d+)\.w1\.weight$', k))
            }
            assert held == set(range(r * n // 2, (r + 1) * n // 2)), f'{name} rank {r} holds experts {sorted(held)}'
            for k, t in res['tensors'].items():
                if '.experts.' in k and k.endswith(('.weight', '_scale_inv')):
                    stored = raw[k.replace('.mlp.experts.', '.block_sparse_moe.experts.')]
                    assert stored.dtype in (torch.float8_e4m3fn, torch.float32) and torch.equal(t, stored), k


def _fp32_model(name: str):
    "A tiny RWKV, T5 or BLIP-2 from its config class: their `_keep_in_fp32_modules` name parameters, modules or both."
    import transformers as tf

    torch.manual_seed(0)
    if name == 'rwkv':
        return tf.RwkvForCausalLM(
            tf.RwkvConfig(
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=2,
                attention_hidden_size=32,
                intermediate_size=64,
                context_length=16,
            )
        )
    if name == 't5':
        return tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
        )
    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)
    vision = dict(small, **TP_VISION)
    qformer = dict(small, vocab_size=64, encoder_hidden_size=32)
    text = tf.OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=48, word_embed_proj_dim=32
    )
    return tf.Blip2ForConditionalGeneration(
        tf.Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text.to_dict(), num_query_tokens=4)
    )


@pytest.mark.parametrize('name', ['rwkv', 't5', 'blip2'])
def test_keep_in_fp32_as_from_pretrained(tmp_path, name):
    "A float16 checkpoint: every tensor's dtype and value as `from_pretrained` gives them."
    from mstar_utils.model import load_model

    model = _fp32_model(name)
    with contextlib.redirect_stderr(io.StringIO()):
        model.to(torch.float16).save_pretrained(tmp_path)
        ref = type(model).from_pretrained(tmp_path, dtype=torch.float16).state_dict()
    ours = load_model(tmp_path, dtype=torch.float16).state_dict()
    assert set(ours) == set(ref)
    assert any(t.dtype == torch.float32 for t in ref.values())
    for k, t in ref.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k
