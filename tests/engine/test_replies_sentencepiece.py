"""`Reply` against vLLM on a SentencePiece vocabulary: Mistral's (mistral-common's tokenizer.model.v3, as transformers
converts it to tokenizer.json: `▁` for spaces, `<0xNN>` byte pieces, a decoder that strips the text's first space)
on a tiny Mistral model that vLLM builds with dummy weights. The weights only pick the tokens; the rules under test
are the tokenizer's and the stop settings'. The seeded random requests, streamed too, are those of test_replies.py
over prompts of this vocabulary; vLLM's text, finish reason and stop reason must equal ours byte for byte.

vLLM primes its detokenizer with the prompt, so the reply's first space is kept (`" Paris"`, where `decode` of the
reply alone gives `"Paris"`): `Reply` is given the prompt's ids."""

import json
import os
import shutil

import pytest

from engine.cases import CASES, check_replies, check_stream, make_cases, stream

PROMPTS = [
    'The capital of France is',
    'Write one sentence in Chinese about Tokyo: 東京は',
    '[INST] Say hello in Japanese. [/INST]',
    'Emoji for a party: 🎉 and for thumbs up:',
    'def fibonacci(n):',
]
CONFIG = dict(  # Mistral's architecture at toy size; the vocabulary is the tokenizer's, 32,768
    architectures=['MistralForCausalLM'],
    model_type='mistral',
    vocab_size=32768,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


@pytest.fixture(scope='module')
def mistral_folder(tmp_path_factory):
    "A checkpoint folder without weights: the tiny config and Mistral's tokenizer files."
    from mstar_utils.checkpoints import tokenizer_folder

    out = tmp_path_factory.mktemp('mistral-tiny')
    for name in ('tokenizer.json', 'tokenizer_config.json'):
        shutil.copy(tokenizer_folder('mistral-v3') / name, out / name)
    (out / 'config.json').write_text(json.dumps(CONFIG), encoding='utf-8')
    return out


@pytest.fixture(scope='module')
def mistral_cases(mistral_folder):
    "The seeded random requests on the dummy-weight model, and its engine for the streamed run."
    os.environ.setdefault('VLLM_ENABLE_V1_MULTIPROCESSING', '0')
    from vllm import LLM

    llm = LLM(
        str(mistral_folder),
        load_format='dummy',
        dtype='float32',
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=2**27,
        max_num_seqs=64,
        seed=0,
    )
    try:
        cases = make_cases(llm, PROMPTS)
        yield cases, stream(llm, cases)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope='module')
def mistral_text_output(mistral_folder):
    import functools

    from mstar_utils.detokenize import TextOutput

    return functools.cache(lambda keep: TextOutput.from_checkpoint(mistral_folder, keep_special=keep))


def test_sentencepiece_replies_equal_vllm(mistral_cases, mistral_text_output):
    cases, _ = mistral_cases
    assert mistral_text_output(True).detokenizer.mode == 'sentencepiece'
    bad, partial = check_replies(mistral_text_output, cases)
    assert not bad, f'{len(bad)} of {len(cases)} differ: {bad[:5]}'
    texts = ''.join(ro.outputs[0].text for _, ro in cases)
    print(f'{len(cases)} SentencePiece replies equal to vLLM; {partial} end inside a character; text: {texts[:200]!r}')
    assert len(cases) == CASES


def test_sentencepiece_deltas_equal_ours(mistral_cases, mistral_text_output):
    cases, streams = mistral_cases
    total = {'deltas': 0, 'equal': 0, 'held': 0}
    for (p, ro), deltas in zip(cases, streams, strict=True):
        assert [i for d in deltas for i in d.token_ids] == list(ro.outputs[0].token_ids), p
        for k, v in check_stream(mistral_text_output, p, ro, deltas).items():
            total[k] += v
    print(f"{len(streams)} streamed SentencePiece replies, {total['deltas']} deltas, {total['equal']} equal to ours")


def test_sentencepiece_cases_cover_the_rules(mistral_cases):
    "Stops by string and by id, length cuts, and replies that open with a space the prompt keeps."
    cases, _ = mistral_cases
    reasons = [ro.outputs[0].stop_reason for _, ro in cases]
    assert any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons)
    assert any(ro.outputs[0].finish_reason == 'length' for _, ro in cases)
    assert any(ro.outputs[0].text.startswith(' ') for _, ro in cases)
