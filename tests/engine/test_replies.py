"""`Reply` against vLLM's own replies: greedy generations from vLLM on SmolLM2 with seeded random stop settings, our
`Reply` fed vLLM's token ids one step (one token) at a time, as vLLM's engine produces them without speculative
decoding. The text, finish reason and stop reason must equal vLLM's, byte for byte.

One difference is by design: a reply that ends (a length cut, a stop id) inside a character. vLLM's text holds only
whole characters, its incremental detokenizer keeping a partial one back; `Reply` streams bytes and leaves the partial
character's bytes to the client's incremental UTF-8 decoder, which holds them back too. So the text compared is what
that decoder shows, and the bytes past vLLM's text must be exactly one unfinished character."""

from engine.cases import CASES, check_replies


def test_replies_equal_vllm(smol_cases, smol_text_output):
    bad, partial = check_replies(smol_text_output, smol_cases)
    assert not bad, f'{len(bad)} of {len(smol_cases)} differ: {bad[:5]}'
    print(f'{len(smol_cases)} replies equal to vLLM; {partial} end inside a character')
    assert len(smol_cases) == CASES


def test_cases_cover_the_rules(smol_cases):
    "The random cases exercise every rule: ties, stops kept or not, min_tokens, stop ids, EOS ignored, length cuts."
    cases = [(p, ro.outputs[0]) for p, ro in smol_cases]
    reasons = [o.stop_reason for _, o in cases]
    assert any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons)
    assert any(o.finish_reason == 'length' for _, o in cases)
    assert any(p.include_stop_str_in_output and isinstance(o.stop_reason, str) for p, o in cases)
    assert any(p.min_tokens and isinstance(o.stop_reason, str) for p, o in cases)
    tied = [
        p
        for p, o in cases
        if isinstance(o.stop_reason, str) and any(s != o.stop_reason and o.stop_reason.endswith(s) for s in p.stop)
    ]
    assert tied, 'no case stopped where a tie was possible'
