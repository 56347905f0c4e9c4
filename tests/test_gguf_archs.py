"""GGUF architectures whose tensors transformers reworks on load (Gemma 2/3, Nemotron, GPT-2, Bloom, Mamba, LFM2,
Qwen3.5 and Qwen3.5-MoE), MiniMax-M2's stacked experts, and those it reads as stored (Qwen2, Qwen3, Phi-3, Falcon,
StableLM, StarCoder2, Gemma 4): tiny files written by gguf-py in llama.cpp's layout against
from_pretrained(gguf_file=...), at one rank and at two; T5 and UMT5 files against its seq2seq load, their encoders
alone against the encoder class; gpt-oss, Deci and Mistral-named Llama files refused with the reason."""

import contextlib
import io
import os

import numpy as np
import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import gguf
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
from transformers.utils import logging as hf_logging

from mstar_utils.gguf import gguf_config, read_gguf
from mstar_utils.model import load_model, load_plan
from mstar_utils.testing import assert_state_dict_equal, assert_tensors_equal, tiny_gguf_config, write_gguf_checkpoint
from mstar_utils.cli import format_report
from mstar_utils.report import NotACheckpoint, check_can_answer, checkpoint_report
from mstar_utils.upstream import (
    gguf_config_mappings,
    gguf_converted_archs,
    gguf_tensor_processors,
    tied_weights_keys,
    transformers_version,
)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 17]])
ARCH = {
    'gemma3_text': 'gemma3',
    'gemma4_text': 'gemma4',
    'minimax_m2': 'minimax-m2',
    'qwen3_5_text': 'qwen35',
    'qwen3_5_moe_text': 'qwen35moe',
}  # llama.cpp's names, where not the model type
# read by transformers' plain GGUF path: its config table, no tensor processor, the values as the file stores them
# (Gemma 4's tiny file holds its per-layer embeddings at transformers' default size, which its GGUF table reads not)
PLAIN = ['qwen2', 'qwen3', 'phi3', 'falcon', 'stablelm', 'starcoder2', 'gemma4_text']
READ = [
    'gemma2',
    'gemma3_text',
    'nemotron',
    'gpt2',
    'bloom',
    'mamba',
    'lfm2',
    'minimax_m2',
    'qwen3_5_text',
    'qwen3_5_moe_text',
    *PLAIN,
]
# a mix of block types: K-quants, legacy quants, the Q8_0 default; rows not whole blocks are F32, as llama.cpp has them
# transformers 5.25 reads LFM2 through its newer GGUF reader, which refuses Q5_0, Q5_1 and some IQ types: none here
TYPES = {'ffn_down': 'Q4_K', 'attn_q': 'Q5_K', 'attn_qkv': 'Q4_1', 'ffn_up_exps': 'Q6_K', 'ssm_in': 'Q4_0'}
WITH_TP = ['gemma2', 'gemma3_text', 'nemotron', 'minimax_m2', 'qwen3_5_text', 'qwen3_5_moe_text']
WITH_TP += ['qwen2', 'qwen3', 'phi3', 'starcoder2', 'gemma4_text']
# transformers dequantizes Qwen3.5-MoE's joined gate_up_proj by one block type (5.19, 5.25): its gate and up share one
SAME_GATE_UP = {'ffn_gate_exps': 'Q6_K'}  # the others' configs declare no tensor-parallel plan


def reads(arch):
    "Whether the installed transformers reads GGUF architecture `arch`: a tensor processor, its newer path, or plain."
    plain = arch in {ARCH.get(mt, mt) for mt in PLAIN} and arch in gguf_config_mappings()[0]
    return plain or arch in gguf_tensor_processors() or arch in gguf_converted_archs()


def needs_processor(mt):
    "Skip where the installed transformers has no GGUF tensor processor for the architecture."
    arch = ARCH.get(mt, mt)
    if not reads(arch):
        pytest.skip(f'transformers {transformers_version()} has no GGUF tensor processor for {arch!r}')


def from_pretrained(f, **kw):
    with contextlib.redirect_stderr(io.StringIO()):
        return AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, **kw)


def logits(m):
    with torch.no_grad():
        return m(IDS).logits


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    out = {}
    for mt in READ + ['gpt_oss']:
        if reads(ARCH.get(mt, mt)) or mt == 'gpt_oss':
            d = tmp_path_factory.mktemp(mt)
            types = TYPES | SAME_GATE_UP if mt == 'qwen3_5_moe_text' else TYPES
            out[mt] = write_gguf_checkpoint(d / f'{mt}.gguf', types, config=tiny_gguf_config(mt))
    return out


@pytest.mark.parametrize('mt', READ)
def test_files_load_as_from_pretrained(mt, files):
    "Every parameter and the logits equal transformers' load of the file, and so does the config."
    needs_processor(mt)
    f = files[mt]
    ref = from_pretrained(f).eval()
    assert read_gguf(f).metadata['general.architecture'] == ARCH.get(mt, mt) and ref.config.model_type == mt
    for m in (load_model(f), load_model(f.parent)):
        assert_state_dict_equal(m, ref)
        assert_tensors_equal(logits(m), logits(ref))
    assert gguf_config(f, read_gguf(f)).to_dict() == AutoConfig.from_pretrained(f.parent, gguf_file=f.name).to_dict()
    assert m.bytes_read == sum(t.data.numel() for t in read_gguf(f).tensors.values())


@pytest.mark.parametrize(
    'mt, key, gguf_name',
    [
        ('gemma3_text', 'model.layers.0.self_attn.q_norm.weight', 'blk.0.attn_q_norm.weight'),
        ('nemotron', 'model.norm.weight', 'output_norm.weight'),
        ('gpt2', 'transformer.h.1.attn.c_attn.weight', 'blk.1.attn_qkv.weight'),
        ('bloom', 'transformer.h.0.self_attention.query_key_value.bias', 'blk.0.attn_qkv.bias'),
        ('mamba', 'backbone.layers.1.mixer.A_log', 'blk.1.ssm_a'),
        ('mamba', 'backbone.layers.0.mixer.conv1d.weight', 'blk.0.ssm_conv1d.weight'),
        ('lfm2', 'model.layers.2.conv.conv.weight', 'blk.2.shortconv.conv.weight'),
    ],
)
def test_reworked_tensor_is_transformers_processor_of_gguf_py(mt, key, gguf_name, files):
    "A reworked tensor: transformers' own processor applied to gguf-py's dequantization of the file's tensor."
    needs_processor(mt)
    f = files[mt]
    t = next(t for t in gguf.GGUFReader(f).tensors if t.name == gguf_name)
    cfg = {'n_head': 4, 'hidden_size': 256}  # what Bloom's processor reads
    want = gguf_tensor_processors()[ARCH.get(mt, mt)](cfg).process(
        gguf.quants.dequantize(t.data, t.tensor_type), gguf_name
    )
    got = load_model(f).state_dict()[key]
    assert_tensors_equal(got, torch.from_numpy(np.array(want.weights)))


@pytest.mark.parametrize('mt', ['gpt2', 'gemma2'])
def test_bfloat16_is_one_rounding_and_keep_leaves_reworked_weights(mt, files):
    "bfloat16: one rounding of the float32 values; keep: reworked weights (GPT-2's Conv1D) load as values."
    from mstar_utils.quantized import QuantizedLinear

    needs_processor(mt)
    f = files[mt]
    full = load_model(f).state_dict()
    half = load_model(f, dtype=torch.bfloat16).state_dict()
    for k in full:
        assert_tensors_equal(half[k], full[k].to(torch.bfloat16))
    kept = load_model(f, quantized='keep')
    q = [n for n, m in kept.named_modules() if isinstance(m, QuantizedLinear)]
    if mt == 'gemma2':
        assert 'model.layers.0.self_attn.q_proj' in q
        torch.testing.assert_close(logits(kept), logits(load_model(f)), atol=1e-4, rtol=0)
    else:  # Conv1D is no nn.Linear; the lm_head is
        assert q == []
        assert_tensors_equal(kept.transformer.h[0].attn.c_attn.weight, full['transformer.h.0.attn.c_attn.weight'])


def test_bloom_keep_leaves_the_regrouped_qkv(files):
    "Bloom's fused qkv, regrouped after dequantizing, is not kept as blocks; its dense layers are."
    from mstar_utils.quantized import QuantizedLinear

    needs_processor('bloom')
    f = files['bloom']
    kept = load_model(f, quantized='keep')
    attn = kept.transformer.h[0].self_attention
    assert not isinstance(attn.query_key_value, QuantizedLinear) and isinstance(attn.dense, QuantizedLinear)
    torch.testing.assert_close(logits(kept), logits(load_model(f)), atol=1e-4, rtol=0)


@pytest.mark.parametrize('mt', WITH_TP)
@pytest.mark.parametrize('expert_parallel', [False, True])
def test_ranks_are_slices_of_the_full_load(mt, expert_parallel, files):
    "At 2 ranks each tensor is its plan's slice of the whole load, and the plan counts the bytes the load reads."
    from mstar_utils.tensor_parallel import Sharding, take

    from mstar_utils.tensor_parallel import tp_plan

    needs_processor(mt)
    if expert_parallel and mt not in ('minimax_m2', 'qwen3_5_moe_text'):
        pytest.skip('expert parallelism: the MoE only')
    try:
        tp_plan(tiny_gguf_config(mt), 2)
    except ValueError as e:  # Nemotron's plan came after 5.19
        pytest.skip(f'transformers {transformers_version()}: {e}')
    f = files[mt]
    fsd, cut = load_model(f).state_dict(), 0
    for r in range(2):
        m = load_model(f, rank=r, world_size=2, expert_parallel=expert_parallel)
        values = Sharding(m.tp_sharding.plan, r, 2)
        for k, t in m.state_dict().items():
            assert_tensors_equal(t, take(fsd[k], values.slice_for(k, fsd[k].shape)))
            cut += t.shape != fsd[k].shape
        plan = load_plan(f, r, 2, expert_parallel=expert_parallel)
        assert m.tp_bytes_read == plan.total_bytes
        if mt in ('minimax_m2', 'qwen3_5_moe_text'):  # stacked experts: each rank reads half their bytes, by gguf-py
            stored = {w: 0 for w in ('gate', 'up', 'down')}
            for t in gguf.GGUFReader(f).tensors:
                if '_exps' in t.name:
                    stored[t.name.split('_')[1]] += int(t.n_bytes)
            read = {w: sum(t.bytes for t in plan.tensors if t.name.endswith(f'.{w}_proj')) for w in ('gate_up', 'down')}
            assert read == {'gate_up': (stored['gate'] + stored['up']) // 2, 'down': stored['down'] // 2}
    assert cut > 0
    if mt == 'minimax_m2':
        gu = m.model.layers[0].mlp.experts.gate_up_proj
        assert gu.shape == ((2, 1024, 256) if expert_parallel else (4, 512, 256))


@pytest.mark.parametrize('mt', ['gpt2', 'bloom', 'mamba', 'lfm2', 'falcon', 'stablelm'])
def test_no_plan_is_refused_as_for_safetensors(mt, files):
    "Architectures whose config declares no tensor-parallel plan are refused at 2 ranks, naming the config."
    needs_processor(mt)
    with pytest.raises(ValueError, match=r'declares no base_model_tp_plan; pass a plan'):
        load_model(files[mt], rank=0, world_size=2)


def test_gpt_oss_is_refused_because_transformers_loads_no_experts(files):
    "transformers reports a gpt-oss file's experts missing (newly initialized); load_model refuses, saying so."
    f = files['gpt_oss']
    _, info = from_pretrained(f, output_loading_info=True)
    assert {'model.layers.0.mlp.experts.gate_up_proj', 'model.layers.0.mlp.experts.down_proj'} <= set(
        info['missing_keys']
    )
    with pytest.raises(NotImplementedError, match=r"gpt_oss\.gguf: GGUF architecture 'gpt-oss' is not read: .*experts"):
        load_model(f)


def tiny_header_file(path, arch, name, **lists):
    "A one-layer file of GGUF architecture `arch` named `name`: gguf-py's writer, the keys llama.cpp writes."
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    for add, v in [('add_context_length', 512), ('add_embedding_length', 64), ('add_block_count', 1)]:
        getattr(w, add)(v)
    w.add_feed_forward_length(lists.get('ffn', 128))
    w.add_head_count(lists.get('heads', 2))
    w.add_key_length(32)
    w.add_vocab_size(100)
    w.add_tensor('token_embd.weight', np.zeros((100, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize('mt', ['t5', 'umt5'])
def test_t5_and_umt5_load_as_from_pretrained(mt, tmp_path):
    "A T5 or UMT5 file (a 't5' file, its name saying which) loads as transformers' seq2seq load: tensors, logits."
    f = write_gguf_checkpoint(tmp_path / f'{mt}.gguf', TYPES, config=tiny_gguf_config(mt))
    with contextlib.redirect_stderr(io.StringIO()):
        ref = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, gguf_file=f.name).eval()
    assert read_gguf(f).metadata['general.architecture'] == 't5' and ref.config.model_type == mt
    assert type(ref).__name__ == f'{mt.upper()}ForConditionalGeneration'
    dec = torch.tensor([[0, 4, 8, 15]])
    for m in (load_model(f), load_model(f.parent)):
        assert type(m) is type(ref)
        assert_state_dict_equal(m, ref)
        with torch.no_grad():
            got, want = (x(input_ids=IDS, decoder_input_ids=dec).logits for x in (m, ref))
        assert_tensors_equal(got, want)
    assert gguf_config(f, read_gguf(f)).to_dict() == AutoConfig.from_pretrained(f.parent, gguf_file=f.name).to_dict()
    assert m.bytes_read == sum(t.data.numel() for t in read_gguf(f).tensors.values())
    with pytest.raises(NotACheckpoint, match=rf'{type(ref).__name__} is not a causal language model'):
        check_can_answer(f)  # as for a T5 safetensors folder


@pytest.mark.parametrize('mt', ['t5', 'umt5'])
def test_t5_and_umt5_encoder_files_load_as_from_pretrained(mt, tmp_path):
    """A 't5encoder' file (an encoder alone, as diffusion pipelines ship T5-XXL and UMT5-XXL), which transformers reads
    as the encoder class its config names, loads as that class's from_pretrained: tensors, hidden states, bytes."""
    import transformers

    name = f'{mt.upper()}EncoderModel'
    f = write_gguf_checkpoint(tmp_path / f'{mt}-enc.gguf', TYPES, config=tiny_gguf_config(mt, architectures=[name]))
    assert read_gguf(f).metadata['general.architecture'] == 't5encoder'
    assert AutoConfig.from_pretrained(tmp_path, gguf_file=f.name).architectures == [name]
    with contextlib.redirect_stderr(io.StringIO()):
        ref = getattr(transformers, name).from_pretrained(tmp_path, gguf_file=f.name).eval()
    for m in (load_model(f), load_model(f.parent)):
        assert type(m) is type(ref)
        assert_state_dict_equal(m, ref)
        with torch.no_grad():
            got, want = (x(input_ids=IDS).last_hidden_state for x in (m, ref))
        assert_tensors_equal(got, want)
    assert m.bytes_read == sum(t.data.numel() for t in read_gguf(f).tensors.values())
    with pytest.raises(ValueError, match=r'declares no base_model_tp_plan; pass a plan'):
        load_model(f, rank=0, world_size=2)
    rep = checkpoint_report(f)  # the encoder's own ties, as transformers makes them: no head
    assert rep['architectures'] == [name] and rep['tied_weights'] == tied_weights_keys(ref)
    assert 'tied          encoder.embed_tokens.weight shares shared.weight' in format_report(rep).splitlines()
    with pytest.raises(NotACheckpoint, match=rf'{name} is not a causal language model'):
        check_can_answer(f)


def test_deci_is_refused_as_transformers_has_no_config_class(tmp_path):
    "A Deci file (per-layer heads and widths, as llama.cpp writes them) fails in transformers; load_model says why."
    f = tiny_header_file(tmp_path / 'deci.gguf', 'deci', 'tiny-deci', ffn=[128], heads=[2])
    with pytest.raises(ValueError, match=r'model type `deci` but Transformers does not recognize'):
        from_pretrained(f)
    with pytest.raises(
        NotImplementedError, match=r"deci\.gguf: GGUF architecture 'deci' is not read: .*no config class"
    ):
        load_model(f)


def test_mistral_named_llama_file_is_refused_as_transformers_fails(tmp_path):
    "A 'llama' file named 'mistral': transformers reads it as Mistral, which gguf-py maps no names of; both refuse."
    f = write_gguf_checkpoint(tmp_path / 'mistral.gguf', {}, config=tiny_gguf_config('mistral'))
    meta = read_gguf(f).metadata
    assert (meta['general.architecture'], meta['general.name']) == ('llama', 'mistral')
    assert AutoConfig.from_pretrained(tmp_path, gguf_file=f.name).model_type == 'mistral'
    with pytest.raises(NotImplementedError, match=r'Unknown gguf model_type: mistral'):
        from_pretrained(f)
    with pytest.raises(NotImplementedError, match=r"model_type 'mistral' \(a 'llama' file named 'mistral'"):
        load_model(f)
