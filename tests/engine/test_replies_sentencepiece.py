"""`Reply` against vLLM on a SentencePiece vocabulary: Mistral's (mistral-common's tokenizer.model.v3) on a tiny
Mistral model that vLLM builds with dummy weights, its tokenizer read two ways: transformers' tokenizer.json conversion
(`▁` for spaces, `<0xNN>` byte pieces, a decoder that strips the text's first space; vLLM's fast incremental
detokenizer) and mistral-common's own (`tokenizer_mode='mistral'`; vLLM's slow incremental detokenizer). The weights
only pick the tokens; the rules under test are the tokenizer's and the stop settings'. The seeded random requests,
streamed too, are those of test_replies.py over prompts of this vocabulary; vLLM's text, finish reason and stop reason
must equal ours, from the tokenizer.json in both modes, byte for byte.

vLLM primes its detokenizer with the prompt, so the reply's first space is kept (`" Paris"`, where `decode` of the
reply alone gives `"Paris"`): `Reply` is given the prompt's ids."""

import functools

import pytest

from engine.cases import (
    CASES,
    MISTRAL_PROMPTS,
    check_replies,
    check_stream,
    make_cases,
    mistral_llm,
    mistral_text_output,
    ours,
    stream,
    write_mistral_folder,
)


@pytest.fixture(scope='module', params=['auto', 'mistral'])
def mistral_cases(request, tmp_path_factory):
    "The seeded random requests on the dummy-weight model, and their streamed run, for each `tokenizer_mode`."
    # 'auto': vLLM reads transformers' tokenizer.json; 'mistral': mistral-common's tokenizer.model.v3, the same ids
    llm = mistral_llm(write_mistral_folder(tmp_path_factory.mktemp('mistral-tiny'), request.param), request.param)
    try:
        cases = make_cases(llm, MISTRAL_PROMPTS)
        yield cases, stream(llm, cases)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope='module')
def text_output():
    "Ours, from transformers' tokenizer.json in both modes: `text_output(keep_special)`."
    return functools.cache(mistral_text_output)


def test_sentencepiece_replies_equal_vllm(mistral_cases, text_output):
    cases, _ = mistral_cases
    assert text_output(True).detokenizer.mode == 'sentencepiece'
    bad, partial = check_replies(text_output, cases)
    assert not bad, f'{len(bad)} of {len(cases)} differ: {bad[:5]}'
    texts = ''.join(ro.outputs[0].text for _, ro in cases)
    print(f'{len(cases)} SentencePiece replies equal to vLLM; {partial} end inside a character; text: {texts[:80]!r}')
    assert len(cases) == CASES


def test_sentencepiece_deltas_equal_ours(mistral_cases, text_output):
    cases, streams = mistral_cases
    total = {'deltas': 0, 'equal': 0, 'held': 0}
    for (p, ro), deltas in zip(cases, streams, strict=True):
        assert [i for d in deltas for i in d.token_ids] == list(ro.outputs[0].token_ids), p
        for k, v in check_stream(text_output, p, ro, deltas).items():
            total[k] += v
    print(f"{len(streams)} streamed SentencePiece replies, {total['deltas']} deltas, {total['equal']} equal to ours")


def test_sentencepiece_cases_cover_the_rules(mistral_cases):
    "Stops by string and by id, length cuts, and replies that open with a space the prompt keeps."
    cases, _ = mistral_cases
    reasons = [ro.outputs[0].stop_reason for _, ro in cases]
    assert any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons)
    assert any(ro.outputs[0].finish_reason == 'length' for _, ro in cases)
    assert any(ro.outputs[0].text.startswith(' ') for _, ro in cases)


def test_sentencepiece_prompt_matters(mistral_cases, text_output):
    "Without the prompt's ids some replies differ from vLLM's: the first space, which `decode` of the reply drops."
    cases, _ = mistral_cases
    alone = [ours(text_output, p, list(ro.outputs[0].token_ids))[0] for p, ro in cases]
    differ = [
        (a, ro.outputs[0].text) for a, (_, ro) in zip(alone, cases, strict=True) if a != ro.outputs[0].text.encode()
    ]
    print(f'{len(differ)} of {len(cases)} replies differ from vLLM without prompt_ids, e.g. {differ[:2]}')
    assert differ and all(t.startswith(' ') for _, t in differ)
