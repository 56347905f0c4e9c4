"""GGUF: the block decoders against gguf-py, tiny files written by gguf-py against transformers'
from_pretrained(gguf_file=...), SmolLM2's real Q4_1 file, refusals."""

import os
import re
import shutil

import numpy as np
import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from mstar_utils.checkpoints import smollm2_gguf
from mstar_utils.gguf import GGUF_TYPES, dequantize_gguf, gguf_config, gguf_file, read_gguf, unpermute_rows
from mstar_utils.model import load_gguf_model
from mstar_utils.model import load_model
from mstar_utils.testing import (
    assert_state_dict_equal,
    assert_tensors_equal,
    tiny_llama_gguf_config,
    tiny_moe_gguf_config,
    write_gguf_checkpoint,
)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 17]])
SCALE_AT = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.MXFP4: [-1],  # its E8M0 exponent, byte 0: bit 6 cleared, below 2^64
    T.NVFP4: [],
    T.TQ1_0: [52],
    T.TQ2_0: [64],
    T.IQ2_XXS: [0],
    T.IQ2_XS: [0],
    T.IQ2_S: [0],
    T.IQ3_XXS: [0],
    T.IQ3_S: [0],
    T.IQ1_S: [0],
    T.IQ1_M: [54],  # its float16's high nibbles: the top bits of the four 16-bit words at 48-55
}
ALL_TYPES = {
    'attn_q': 'Q4_0',
    'attn_k': 'Q4_1',
    'attn_v': 'Q5_0',
    'attn_output': 'Q5_1',
    'ffn_gate': 'Q2_K',
    'ffn_up': 'Q3_K',
    'ffn_down': 'Q4_K',
    'token_embd': 'Q5_K',
    'output': 'Q6_K',
}
LATER_TYPES = {  # gguf-py quantizes MXFP4, TQ1_0 and TQ2_0; the others are random codes of finite scales
    'attn_q': 'IQ4_NL',
    'attn_k': 'IQ4_XS',
    'attn_v': 'MXFP4',
    'attn_output': 'TQ1_0',
    'ffn_gate': 'TQ2_0',
    'ffn_up': 'IQ2_XXS',
    'ffn_down': 'IQ3_S',
    'token_embd': 'NVFP4',
    'output': 'IQ1_M',
}
GRID_TYPES = {
    'attn_q': 'IQ2_XS',
    'attn_k': 'IQ2_S',
    'attn_v': 'IQ3_XXS',
    'attn_output': 'IQ1_S',
    'ffn_gate': 'IQ1_M',
    'ffn_up': 'IQ4_XS',
    'ffn_down': 'IQ2_XXS',
    'token_embd': 'IQ4_NL',
    'output': 'IQ3_S',
}


def logits(m):
    with torch.no_grad():
        return m(IDS).logits


def random_blocks(rng, qtype, shape):
    "Random bytes of a tensor of `shape` (the last axis counted in blocks), float16 scales kept finite."
    b = rng.integers(0, 256, (*shape, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in SCALE_AT[qtype]:
        b[..., at + 1] &= 0xBF
    return b.reshape(*shape[:-1], -1)


@pytest.mark.parametrize('qtype', list(SCALE_AT), ids=lambda q: q.name)
@pytest.mark.parametrize('shape', [(1, 1), (7, 3), (33, 2), (3, 5, 1)])
def test_block_decoders_equal_gguf_py(qtype, shape):
    b = random_blocks(np.random.default_rng(int(qtype) * 100 + sum(shape)), qtype, shape)
    assert_tensors_equal(
        dequantize_gguf(torch.from_numpy(b), qtype), torch.from_numpy(gguf.quants.dequantize(b, qtype))
    )


@pytest.mark.parametrize(
    'qtype',
    [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4, T.TQ1_0, T.TQ2_0],
    ids=lambda q: q.name,
)
def test_gguf_py_quantized_values_decode_as_gguf_py(qtype):
    "Every type gguf-py quantizes: its codes of real values decode as gguf-py decodes them."
    x = np.random.default_rng(1).standard_normal((13, 768)).astype(np.float32) * 3
    q = gguf.quants.quantize(x, qtype)
    assert_tensors_equal(
        dequantize_gguf(torch.from_numpy(q.view(np.uint8).copy()), qtype),
        torch.from_numpy(gguf.quants.dequantize(q, qtype).astype(np.float32)),
    )


def test_out_and_refusals():
    b = random_blocks(np.random.default_rng(2), T.Q4_K, (4, 2))
    out = torch.empty(4, 512)
    assert dequantize_gguf(torch.from_numpy(b), T.Q4_K, out) is out
    with pytest.raises(ValueError, match='a row of 35 bytes is not a whole number of 34-byte blocks'):
        dequantize_gguf(torch.zeros(2, 35, dtype=torch.uint8), T.Q8_0)
    with pytest.raises(NotImplementedError, match='Q8_K is not decoded'):
        dequantize_gguf(torch.zeros(2, 292, dtype=torch.uint8), T.Q8_K)
    assert T.Q4_K in GGUF_TYPES and T.Q8_K not in GGUF_TYPES


def test_every_type_gguf_py_dequantizes_is_decoded():
    "The block types are gguf-py's: each one it dequantizes (F32 and F16 besides), none else."
    from gguf.quants import _type_traits

    assert set(GGUF_TYPES) == {T.F32, T.F16, *_type_traits}


@pytest.mark.parametrize('qtype', [T.IQ4_XS, T.TQ1_0, T.IQ2_S, T.IQ1_M], ids=lambda q: q.name)
def test_chunks_of_later_types_decode_as_gguf_py(qtype):
    "Over 2048 blocks a tensor decodes in several pieces on torch's threads, and still equals gguf-py."
    b = random_blocks(np.random.default_rng(int(qtype)), qtype, (9, 600))
    assert_tensors_equal(
        dequantize_gguf(torch.from_numpy(b), qtype), torch.from_numpy(gguf.quants.dequantize(b, qtype))
    )


@pytest.mark.parametrize('qtype', [T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize('heads', [None, 4])
def test_fresh_and_resident_outputs_decode_alike(qtype, heads):
    "Into fresh memory one thread decodes while another faults the output in; into resident memory, all threads decode."
    from mstar_utils.gguf_blocks import _resident
    import mmap

    rows = 64  # 16M values in all: 64 MB of float32, in pieces of several rows
    n = (1 << 24) // rows // GGML_QUANT_SIZES[qtype][0]
    b = torch.from_numpy(random_blocks(np.random.default_rng(int(qtype)), qtype, (rows, n)))
    ref = torch.from_numpy(gguf.quants.dequantize(b.numpy(), qtype))
    if heads:
        ref = unpermute_rows(ref, heads)
    # a new anonymous mapping has no page in memory yet, whatever earlier tests left in malloc's free lists
    buf = mmap.mmap(-1, rows * n * GGML_QUANT_SIZES[qtype][0] * 4)
    fresh = torch.frombuffer(buf, dtype=torch.float32).view(rows, -1)
    assert not _resident(fresh)
    assert_tensors_equal(dequantize_gguf(b, qtype, fresh, heads), ref)
    assert _resident(fresh)
    fresh.zero_()
    assert_tensors_equal(dequantize_gguf(b, qtype, fresh, heads), ref)  # resident now: the other path


def test_unpermute_undoes_llamacpp_and_matches_transformers():
    from mstar_utils.upstream import gguf_reverse_permute

    w = torch.randn(24, 5)
    assert_tensors_equal(unpermute_rows(w, 3), torch.from_numpy(gguf_reverse_permute(w.numpy(), 3, 3)))


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp('gguf')
    out = {}
    for name, qt, tie in [
        ('all_types', ALL_TYPES, False),
        ('plain_tied', {'token_embd': 'F16', 'ffn': 'BF16', 'attn': 'F32'}, True),
        ('q8_0', {}, False),
        ('later_types', LATER_TYPES, False),
        ('grid_types', GRID_TYPES, True),
    ]:
        (root / name).mkdir()
        out[name] = write_gguf_checkpoint(
            root / name / 'tiny.gguf', qt, config=tiny_llama_gguf_config(tie_word_embeddings=tie)
        )
    return out


@pytest.mark.parametrize('name', ['all_types', 'plain_tied', 'q8_0', 'later_types', 'grid_types'])
def test_tiny_files_load_as_from_pretrained(name, tiny):
    f = tiny[name]
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name).eval()
    for m in (load_model(f), load_model(f.parent)):
        assert_state_dict_equal(m, ref)
        assert_tensors_equal(logits(m), logits(ref))
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == (
            ref.lm_head.weight is ref.model.embed_tokens.weight
        )


def test_dtype_is_one_rounding_of_the_float32_values(tiny):
    f = tiny['all_types']
    m32, m16 = load_gguf_model(f), load_gguf_model(f, dtype=torch.bfloat16)
    assert_tensors_equal(
        m16.model.layers[0].mlp.down_proj.weight, m32.model.layers[0].mlp.down_proj.weight.to(torch.bfloat16)
    )


def test_header_and_config_equal_gguf_py_and_transformers(tiny):
    f = tiny['all_types']
    h, r = read_gguf(f), gguf.GGUFReader(f)
    assert list(h.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        mine = h.tensors[t.name]
        assert (mine.qtype, mine.shape) == (T(t.tensor_type), tuple(int(d) for d in reversed(t.shape)))
        assert_tensors_equal(mine.data, torch.from_numpy(t.data.view(np.uint8).reshape(-1).copy()))
    assert gguf_config(f, h).to_dict() == AutoConfig.from_pretrained(f.parent, gguf_file=f.name).to_dict()


def test_smollm2_q4_1_equals_from_pretrained():
    f = smollm2_gguf()
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name).eval()
    m = load_model(f)
    assert len(m.state_dict()) > 200
    assert_state_dict_equal(m, ref)
    assert_tensors_equal(logits(m), logits(ref))
    h = read_gguf(f)
    assert gguf_config(f, h).to_dict() == AutoConfig.from_pretrained(f.parent, gguf_file=f.name).to_dict()
    assert {t.qtype.name for t in h.tensors.values()} == {'Q4_1', 'Q8_0', 'F32'}


def test_refusals_name_the_file(tiny, tmp_path):
    f = tiny['q8_0']
    bad = tmp_path / 'cut.gguf'
    bad.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor '.*' ends at byte \d+, past the end of the file"):
        read_gguf(bad)
    (tmp_path / 'x.gguf').write_bytes(b'GGML' + b'\0' * 20)
    with pytest.raises(ValueError, match=r"x\.gguf: not a GGUF file"):
        read_gguf(tmp_path / 'x.gguf')
    two = tmp_path / 'two'
    two.mkdir()
    for n in ('a.gguf', 'b.gguf'):
        shutil.copy(f, two / n)
    with pytest.raises(ValueError, match=r'holds 2 GGUF files \(a\.gguf, b\.gguf\); give the file to load'):
        load_model(two)
    assert gguf_file(tmp_path / 'nothing') is None


def test_keep_holds_the_blocks_and_equals_the_dequantized_load(tmp_path, monkeypatch):
    """keep_gguf's QuantizedLinear layers hold the file's Q8_0 and Q4_K bytes and give the logits of the dequantizing
    load."""
    import mstar_utils.gguf as G
    from mstar_utils.quantized import QuantizedLinear

    (tmp_path / 'k').mkdir()
    f = write_gguf_checkpoint(
        tmp_path / 'k' / 'tiny.gguf', {'attn': 'Q8_0', 'ffn': 'Q4_K', 'output': 'Q4_K', 'token_embd': 'Q8_0'}
    )
    ref, h = load_model(f), read_gguf(f)
    kept = []
    keep = G.keep_gguf
    monkeypatch.setattr(G, 'keep_gguf', lambda *a, **k: kept.extend(keep(*a, **k)) or kept)  # to see what it kept
    m = load_model(f, quantized='keep')
    assert (
        len(kept) == 7 * 2 + 1 and 'model.embed_tokens.weight' not in kept
    )  # q k v o gate up down a layer, and lm_head
    q = m.model.layers[1].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.op.qtype == T.Q8_0 and q.op.heads == m.config.num_attention_heads
    assert torch.equal(q.weight, h.tensors['blk.1.attn_q.weight'].data.reshape(q.weight.shape))  # the file's bytes
    assert m.model.layers[0].mlp.down_proj.op.qtype == T.Q4_K and m.lm_head.weight.dtype == torch.uint8
    assert_tensors_equal(q.dequantized_weight(), ref.model.layers[1].self_attn.q_proj.weight)
    torch.testing.assert_close(logits(m), logits(ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize('qtype', [T.Q4_K, T.Q5_K, T.Q8_0], ids=lambda q: q.name)
def test_unaligned_bytes_decode_as_gguf_py(qtype):
    "Bytes at an odd address (copied before the decoders view them as wider words) and aligned ones decode alike."
    b = random_blocks(np.random.default_rng(5), qtype, (9, 2))
    buf = torch.zeros(b.size + 8, dtype=torch.uint8)
    for at in (0, 1, 3):
        src = buf[at : at + b.size].view(b.shape)
        src.copy_(torch.from_numpy(b))
        assert_tensors_equal(dequantize_gguf(src, qtype), torch.from_numpy(gguf.quants.dequantize(b, qtype)))
        assert_tensors_equal(
            dequantize_gguf(
                src,
                qtype,
                torch.empty(
                    9, b.shape[1] // GGML_QUANT_SIZES[qtype][1] * GGML_QUANT_SIZES[qtype][0], dtype=torch.bfloat16
                ),
            ),
            torch.from_numpy(gguf.quants.dequantize(b, qtype)).to(torch.bfloat16),
        )


# ---- tensor parallelism: a rank reads its rows, or its columns' whole blocks, through the one pipeline


def straddled(f, config) -> int:
    "Bytes a cut may read on both of its sides: a block in every row, or a head of a Llama q or k."
    # llama.cpp's converter permuted each head's rows of q and k, so they are cut on whole heads
    heads = {'.attn_q.': config.num_attention_heads, '.attn_k.': config.num_key_value_heads}
    return sum(
        t.shape[0] * GGML_QUANT_SIZES[t.qtype][1]
        + max([t.data.numel() // n for part, n in heads.items() if part in t.name], default=0)
        for t in read_gguf(f).tensors.values()
        if len(t.shape) == 2
    )


def check_ranks(f, ws, keys=None, quantized='dequantize'):
    "Each rank's tensors are slices of the whole load, its plan says what it read, and the ranks read the bound."
    # kept: a kept layer's dequantized weight is the slice of the whole dequantizing load's weight
    from mstar_utils.model import load_plan
    from mstar_utils.quantized import QuantizedLinear
    from mstar_utils.tensor_parallel import Sharding, take

    full = load_model(f)
    fsd, read = full.state_dict(), 0
    assert (
        full.bytes_read
        == load_plan(f, detail=False).total_bytes
        == sum(t.data.numel() for t in read_gguf(f).tensors.values())
    )
    for r in range(ws):
        m = load_model(f, rank=r, world_size=ws, quantized=quantized)
        values = Sharding(m.tp_sharding.plan, r, ws)  # the plan's slices of the values, not the kept bytes' pins
        kept = {f'{n}.weight': q for n, q in m.named_modules() if isinstance(q, QuantizedLinear)}
        assert (quantized == 'keep') == bool(kept), sorted(kept)
        sd = m.state_dict()
        for k in keys or sd:
            got = kept[k].dequantized_weight() if k in kept else sd[k]
            assert_tensors_equal(got, take(fsd[k], values.slice_for(k, fsd[k].shape)))
        plan = load_plan(f, r, ws, quantized=quantized)
        assert m.tp_bytes_read == plan.total_bytes
        read += m.tp_bytes_read
        replicated = sum(t.bytes for t in plan.tensors if t.slice is None)  # the same on every rank
    assert read <= 1.01 * (full.bytes_read + (ws - 1) * replicated) + (ws - 1) * straddled(f, full.config), (
        read,
        full.bytes_read,
        replicated,
    )


@pytest.mark.parametrize('name', ['all_types', 'plain_tied', 'q8_0', 'later_types', 'grid_types'])
@pytest.mark.parametrize('ws', [2, 4])
def test_ranks_are_slices_of_the_full_load(name, ws, tiny):
    check_ranks(tiny[name], ws)


@pytest.mark.parametrize('name', ['later_types', 'grid_types'])
def test_later_types_kept_under_tensor_parallelism(name, tiny):
    "Kept IQ, MXFP4, NVFP4 and ternary layers at 2 ranks: each rank's blocks dequantize to its slice of the full load."
    check_ranks(tiny[name], 2, quantized='keep')


@pytest.mark.parametrize('quantized', ['dequantize', 'keep'])
def test_smollm2_q4_1_ranks_are_slices_of_the_full_load(quantized):
    "The real Q4_1 file at two ranks, whose 9 heads and 3 key-value heads don't divide by 2."
    check_ranks(
        smollm2_gguf(),
        2,
        [
            'model.layers.3.self_attn.q_proj.weight',
            'model.layers.3.self_attn.k_proj.weight',
            'model.layers.3.self_attn.o_proj.weight',
            'model.layers.3.mlp.down_proj.weight',
            'model.embed_tokens.weight',
        ],
        quantized=quantized,
    )


@pytest.mark.parametrize('ws', [2, 4])
def test_keep_under_tensor_parallelism_cuts_the_blocks(ws, tmp_path):
    "Kept Q8_0 and Q4_K layers at 2 and 4 ranks: rows (whole heads of the permuted q and k) or whole blocks of columns."
    (tmp_path / 'k').mkdir()
    f = write_gguf_checkpoint(
        tmp_path / 'k' / 'tiny.gguf', {'attn': 'Q8_0', 'ffn': 'Q4_K', 'output': 'Q4_K', 'token_embd': 'Q8_0'}
    )
    check_ranks(f, ws, quantized='keep')


@pytest.mark.skipif(not os.environ.get('MSTAR_UTILS_SLOW'), reason='spawns two ranks: set MSTAR_UTILS_SLOW=1')
def test_keep_under_tensor_parallelism_gives_the_logits(tmp_path):
    "Two ranks with their collectives, Q8_0 and Q4_K kept: each rank's logits equal the whole dequantizing load's."
    import io
    from mstar_utils.testing import run_ranks, tp_cells

    (tmp_path / 'k').mkdir()
    f = write_gguf_checkpoint(
        tmp_path / 'k' / 'tiny.gguf', {'attn': 'Q8_0', 'ffn': 'Q4_K', 'output': 'Q4_K', 'token_embd': 'Q8_0'}
    )
    want = logits(load_model(f))  # large (about 1e4): the ranks' sums in another order differ in the last float32 bits
    for r, res in enumerate(run_ranks(tp_cells, 2, [(f, {'input_ids': IDS}, False, 'keep')], timeout=600)):
        torch.testing.assert_close(
            torch.load(io.BytesIO(res[0]), weights_only=False)['logits'],
            want,
            atol=1e-4,
            rtol=1e-6,
            msg=lambda m, r=r: f'rank {r}: {m}',
        )


def test_a_gguf_folder_is_named_where_only_safetensors_are_read(tmp_path):
    "A folder of one GGUF file, where a safetensors folder is wanted, says so, naming the file and what reads it."
    from mstar_utils.sources import checkpoint_dir

    write_gguf_checkpoint(tmp_path / 'tiny.gguf', {})
    with pytest.raises(
        FileNotFoundError,
        match=r'holds GGUF tiny\.gguf, which load_model, load_plan, inspect, explore, diff and TextOutput read',
    ):
        checkpoint_dir(tmp_path)


# ---- a GGUF file, or a folder of one, is a whole checkpoint for text: the tokenizer and stop ids from its metadata


@pytest.fixture(scope='module')
def smol_gguf_tokenizer():
    from transformers import AutoTokenizer, GenerationConfig

    f = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
    gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(f.parent, gguf_file=f.name))
    return f, tok, gen


@pytest.mark.parametrize('where', ['file', 'folder'])
def test_gguf_text_output_is_the_transformers_tokenizer(where, smol_gguf_tokenizer):
    "Token for token the text transformers' tokenizer of the file decodes; its eos ids and the tokenizer's stop."
    from mstar_utils.detokenize import TextOutput

    f, tok, gen = smol_gguf_tokenizer
    to = TextOutput.from_checkpoint(f if where == 'file' else f.parent)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert to.stop_token_ids == {*eos, tok.eos_token_id} == {2}
    chat = [{'role': 'user', 'content': 'Ça va? 🙂 Écris «naïve» en 日本語.'}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert to.output_bytes(ids, {'ignore_eos': True}).decode() == tok.decode(ids)
    for text in ['Hello world', '  leading spaces\n\ttabs', 'émoji 🙂🙃 and 中文', '<|im_start|>assistant\nOk']:
        ids = tok.encode(text, add_special_tokens=False)
        steps = b''.join(to.detokenizer.token_bytes(i) for i in ids)
        assert steps.decode() == tok.decode(ids) == text


def test_gguf_reply_stops_at_its_eos(smol_gguf_tokenizer):
    "`reply` on a GGUF folder: token by token, the text before the file's eos, stopped by it."
    from mstar_utils.detokenize import TextOutput

    f, tok, _ = smol_gguf_tokenizer
    answer = tok.encode('Oui, très bien! 🙂', add_special_tokens=False)
    r = TextOutput.from_checkpoint(f.parent).reply()
    out = b''.join(r.step([i]) for i in [*answer, tok.eos_token_id, *answer]) + r.finish()
    assert out.decode() == tok.decode(answer) and r.stopped and r.stop_reason == tok.eos_token_id


def test_a_gguf_beside_tokenizer_files_reads_the_files(tmp_path, smol_gguf_tokenizer):
    "A folder with tokenizer files beside its GGUF reads the files, as AutoTokenizer.from_pretrained(folder) does."
    from mstar_utils.detokenize import TextOutput

    f, tok, _ = smol_gguf_tokenizer
    (tmp_path / 'm.gguf').symlink_to(f)
    tok.save_pretrained(tmp_path)
    to = TextOutput.from_checkpoint(tmp_path)
    assert to.stop_token_ids == {tok.eos_token_id}
    two = tmp_path / 'two'
    two.mkdir()
    for n in ('a.gguf', 'b.gguf'):
        (two / n).symlink_to(f)
    with pytest.raises(ValueError, match=r'holds 2 GGUF files \(a\.gguf, b\.gguf\); give the file to load'):
        TextOutput.from_checkpoint(two)


# ---- inspect: a GGUF file, or a folder of one, reported from its header


def test_gguf_report_equals_transformers_and_gguf_py(smol_gguf_tokenizer):
    "The report of the file and of its folder: transformers' model and tokenizer counts, gguf-py's tensor types."
    from collections import Counter
    from mstar_utils.kv import read_model_config
    from mstar_utils.report import checkpoint_report
    from mstar_utils.upstream import tied_weights_keys

    f, tok, gen = smol_gguf_tokenizer
    rep = checkpoint_report(f.parent)
    assert rep == checkpoint_report(f)
    cfg = AutoConfig.from_pretrained(f.parent, gguf_file=f.name)
    with torch.device('meta'):
        ref = AutoModelForCausalLM.from_config(cfg)
    assert (rep['architectures'], rep['model_type']) == ([type(ref).__name__], cfg.model_type)
    assert rep['parameters'] == sum(p.numel() for p in ref.parameters())
    assert rep['tensors'] == len(gguf.GGUFReader(f).tensors) and rep['shards'][0]['bytes'] == f.stat().st_size
    assert rep['dtypes'] == dict(Counter(T(t.tensor_type).name for t in gguf.GGUFReader(f).tensors))
    assert rep['tokenizer'] == {'kind': 'byte-level BPE', 'vocab_size': len(tok)}
    assert rep['stop_token_ids'] == [tok.eos_token_id] and rep['generation_config'] == gen.to_diff_dict()
    assert rep['tie_word_embeddings'] is cfg.tie_word_embeddings is True and rep['problems'] == []
    assert rep['tied_weights'] == tied_weights_keys(ref) == {'lm_head.weight': 'model.embed_tokens.weight'}
    assert read_model_config(f.parent).to_dict() == read_model_config(f).to_dict() == cfg.to_dict()


def test_gguf_reply_equals_transformers_greedy(smol_gguf_tokenizer):
    "generate_reply on the file: the greedy ids transformers generates from from_pretrained(gguf_file=...)."
    import io
    from mstar_utils.report import _prompt_ids, check_can_answer, generate_reply

    f, tok, _ = smol_gguf_tokenizer
    assert check_can_answer(f.parent).__name__ == 'LlamaForCausalLM'
    buf = io.BytesIO()
    ids = generate_reply(f.parent, 'What is the capital of France?', max_new_tokens=8, out=buf)
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name).eval()
    prompt = _prompt_ids(tok, 'What is the capital of France?')
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1] :].tolist()
    reply = want[: want.index(tok.eos_token_id)] if tok.eos_token_id in want else want  # the stop id ends it
    assert ids == reply and buf.getvalue().decode() == tok.decode(reply)


def test_inspect_takes_a_gguf_folder(capsys):
    "mstar-utils inspect on SmolLM2's GGUF folder: the report, exit 0."
    from mstar_utils.cli import inspect

    f = smollm2_gguf()
    assert inspect(str(f.parent)) == 0
    out = capsys.readouterr().out
    assert f'  {f.name}' in out and 'Q4_1 (210 tensors)' in out and 'byte-level BPE, vocab size 49152' in out


# ---- MoE files with stacked experts: gate and up joined into gate_up_proj, as transformers' Qwen2MoeTensorProcessor

MOE_TYPES = {'ffn_gate_exps': 'Q4_K', 'ffn_up_exps': 'Q5_0', 'ffn_down_exps': 'Q8_0', 'shexp': 'Q6_K', 'attn': 'Q4_1'}


@pytest.fixture(scope='module')
def moe(tmp_path_factory):
    out = {}
    for mt in ('qwen2_moe', 'qwen3_moe'):
        d = tmp_path_factory.mktemp(mt)
        out[mt] = write_gguf_checkpoint(d / 'moe.gguf', MOE_TYPES, config=tiny_moe_gguf_config(mt))
    return out


@pytest.mark.parametrize('mt', ['qwen2_moe', 'qwen3_moe'])
def test_moe_files_load_as_from_pretrained(mt, moe):
    "Every parameter, stacked experts and Qwen2-MoE's 1-d shared-expert gate included, and the logits, exactly."
    f = moe[mt]
    assert {'blk.0.ffn_gate_exps.weight', 'blk.0.ffn_up_exps.weight'} <= set(read_gguf(f).tensors)
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name).eval()
    assert ref.config.model_type == mt
    for m in (load_model(f), load_model(f.parent)):
        assert_state_dict_equal(m, ref)
        assert_tensors_equal(logits(m), logits(ref))
    assert m.bytes_read == sum(t.data.numel() for t in read_gguf(f).tensors.values())


@pytest.mark.parametrize('mt', ['qwen2_moe', 'qwen3_moe'])
def test_moe_bfloat16_and_keep(mt, moe):
    "bfloat16: one rounding of the float32 load; keep: the Linear layers hold blocks, the experts their values."
    from mstar_utils.quantized import QuantizedLinear

    f = moe[mt]
    full = load_model(f).state_dict()
    half = load_model(f, dtype=torch.bfloat16).state_dict()
    for k in full:
        assert_tensors_equal(half[k], full[k].to(torch.bfloat16))
    kept = load_model(f, quantized='keep')
    assert isinstance(kept.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert_tensors_equal(kept.model.layers[0].mlp.experts.gate_up_proj, full['model.layers.0.mlp.experts.gate_up_proj'])


@pytest.mark.parametrize('mt', ['qwen2_moe', 'qwen3_moe'])
def test_moe_ranks_are_slices_of_the_full_load(mt, moe):
    "At 2 ranks each tensor is the plan's slice of the whole load, and the plan counts the bytes the load reads."
    from mstar_utils.model import load_plan
    from mstar_utils.tensor_parallel import Sharding, take

    f = moe[mt]
    fsd = load_model(f).state_dict()
    for r in range(2):
        m = load_model(f, rank=r, world_size=2)
        values = Sharding(m.tp_sharding.plan, r, 2)
        for k, t in m.state_dict().items():
            assert_tensors_equal(t, take(fsd[k], values.slice_for(k, fsd[k].shape)))
        plan = load_plan(f, r, 2)
        assert m.tp_bytes_read == plan.total_bytes
        gu = next(t for t in plan.tensors if t.name == 'model.layers.0.mlp.experts.gate_up_proj')
        assert gu.keys == ['blk.0.ffn_gate_exps.weight', 'blk.0.ffn_up_exps.weight']


@pytest.mark.parametrize('expert_parallel', [False, True])
@pytest.mark.parametrize('down', ['Q8_0', 'Q4_K'])
def test_moe_ranks_read_their_share_of_the_stacked_experts(expert_parallel, down, tmp_path):
    "Each of 2 ranks reads half the stacked experts' bytes (a Q4_K down cut mid-block: 2 of its 3 blocks a row)."
    from mstar_utils.model import load_plan
    from mstar_utils.tensor_parallel import Sharding, take

    types = {**MOE_TYPES, 'ffn_down_exps': down}
    f = write_gguf_checkpoint(tmp_path / 'moe.gguf', types, config=tiny_moe_gguf_config('qwen3_moe'))
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name).state_dict()
    stored = {w: 0 for w in ('gate', 'up', 'down')}  # the file's bytes of each stacked part, by gguf-py's reader
    for t in gguf.GGUFReader(f).tensors:
        if '_exps' in t.name:
            stored[t.name.split('_')[1]] += int(t.n_bytes)
    assert stored['down'] and list(ref['model.layers.0.mlp.experts.down_proj'].shape) == [4, 256, 768]
    # the down cut at column 384: a row's 3 Q4_K blocks of 256, the middle one read by both ranks
    down_share = 2 / 3 if down == 'Q4_K' and not expert_parallel else 1 / 2
    for r in range(2):
        m = load_model(f, rank=r, world_size=2, expert_parallel=expert_parallel)
        values = Sharding(m.tp_sharding.plan, r, 2)
        for k, t in m.state_dict().items():
            assert_tensors_equal(t, take(ref[k], values.slice_for(k, ref[k].shape)), k)
        plan = load_plan(f, r, 2, expert_parallel=expert_parallel)
        assert m.tp_bytes_read == plan.total_bytes
        read = {
            w: sum(t.bytes for t in plan.tensors if t.name.endswith(f'experts.{w}_proj')) for w in ('gate_up', 'down')
        }
        assert read == {'gate_up': (stored['gate'] + stored['up']) // 2, 'down': int(stored['down'] * down_share)}


def test_every_architecture_transformers_reworks_is_read_or_refused():
    "Each architecture with its own TensorProcessor in transformers: read (Llama, T5, stacked, reworked) or refused."
    from mstar_utils.gguf import _REFUSED, _REWORKED, _STACKED
    from mstar_utils.upstream import gguf_converted_archs, gguf_tensor_processors

    # T5's processor (a 't5encoder' file's too) only notes a tensor's block, its values as stored
    # (tests/test_gguf_archs.py loads T5, UMT5 and their encoders alone)
    assert set(gguf_tensor_processors()) <= {'llama', 't5', 't5encoder', *_STACKED, *_REWORKED, *_REFUSED}
    assert not ({*_STACKED} | {*_REWORKED}) & set(_REFUSED)
    # transformers' newer conversion path (5.25 on) reworks its architectures' tensors too
    assert set(gguf_converted_archs()) <= {*_REWORKED, *_REFUSED}


# ---- explore, inspect --stats and diff on a GGUF file: tensors under the model's names, their block types


def test_explore_a_gguf_file_against_gguf_py(moe):
    "Structure, formats and bytes from gguf-py's reader; no load error; rank 1 reads every tensor's bytes."
    from mstar_utils.explore import explore

    for f in (smollm2_gguf(), moe['qwen2_moe']):
        r = gguf.GGUFReader(f)
        e = explore(f, stats=False)
        assert e.checkpoint == f.name and not [x for x in e.findings if x.level == 'error']
        assert e.tree.params == sum(int(np.prod(t.shape)) for t in r.tensors)
        assert sum(x.stored_bytes for x in e.formats) == sum(int(t.n_bytes) for t in r.tensors)
        named = {n for x in e.formats for n in re.findall(r'(?:GGUF | \+ )(\w+)', x.format)}
        assert named == {T(t.tensor_type).name for t in r.tensors}
        assert e.ranks[0].world_size == 1 and e.ranks[0].read_bytes == [sum(int(t.n_bytes) for t in r.tensors)]
    gu = next(x for x in e.formats if x.family.endswith('experts.gate_up_proj'))
    assert gu.format.startswith('GGUF Q4_K, 256 weights in 144 bytes a block + Q5_0')


def test_diff_of_a_gguf_and_its_bfloat16_folder_equals_torch():
    "SmolLM2's bfloat16 folder is transformers' load of the Q4_1 file rounded: diff's numbers, recomputed in torch."
    from safetensors.torch import load_file
    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.explore import diff_checkpoints

    f, folder = smollm2_gguf(), smollm2_checkpoint()
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name).state_dict()
    sb = {k: v for shard in sorted(folder.glob('*.safetensors')) for k, v in load_file(shard).items()}
    d = diff_checkpoints(f, folder)
    equal = sorted(
        k for k in sb if torch.equal(ref[k].to(torch.bfloat16), sb[k]) and torch.equal(ref[k], sb[k].float())
    )
    assert sorted(t.key for t in d.retyped) == equal
    for t in d.changed[:5]:
        assert t.max_abs == pytest.approx((ref[t.key] - sb[t.key].float()).abs().max().item(), rel=1e-6)
    assert d.added == [] and d.removed == []


def test_cli_inspect_stats_and_diff_take_a_gguf_file(capsys):
    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.cli import diff, inspect

    f = smollm2_gguf()
    assert inspect(str(f), stats=True) == 0
    out = capsys.readouterr().out
    assert 'GGUF Q4_1, 32 weights in 20 bytes a block' in out and '4. Bytes per rank' in out
    assert diff(str(f), str(smollm2_checkpoint())) == 0
    assert f'{f.name} → ' in capsys.readouterr().out


def test_explore_a_folder_of_two_ggufs_is_a_finding(tmp_path):
    f = smollm2_gguf()
    for n in ('a.gguf', 'b.gguf'):
        (tmp_path / n).symlink_to(f)
    from mstar_utils.explore import explore

    e = explore(tmp_path, stats=False)
    assert any('a.gguf' in x.what for x in e.of('files'))
