"""`Reply` against vLLM's own replies: greedy generations from vLLM on SmolLM2 with seeded random stop settings, our
`Reply` fed vLLM's token ids one step (one token) at a time, as vLLM's engine produces them without speculative
decoding. The text, finish reason and stop reason must equal vLLM's, byte for byte.

One difference is by design: a reply that ends (a length cut, a stop id) inside a character. vLLM's text holds only
whole characters, its incremental detokenizer keeping a partial one back; `Reply` streams bytes and leaves the partial
character's bytes to the client's incremental UTF-8 decoder, which holds them back too. So the text compared is what
that decoder shows, and the bytes past vLLM's text must be exactly one unfinished character.

Streamed, the same requests re-run through vLLM's `LLMEngine` with `RequestOutputKind.DELTA`, one engine step at a
time, each step's delta fed to a `Reply`. The deltas join to vLLM's final text, and to ours, byte for byte. Step by
step, where each side holds text back:

- stop strings cut from the output (`include_stop_str_in_output=False`): vLLM holds back the last
  `max(map(len, stop)) - 1` characters of its text, whatever they are (its detokenizer's `stop_buffer_length`), until
  the request finishes. `Reply` holds back only an end of the text that starts some stop string (in bytes), so it
  lets out as much or more: at every step vLLM's text so far is a prefix of ours;
- no stop strings, or stop strings kept: vLLM holds back no characters, and neither does `Reply`;
- a character split across tokens: vLLM's incremental detokenizer (tokenizers' `DecodeStream`) shows nothing of a
  token whose text ends inside a character, the text before that character included, until a later token completes
  it. `Reply` lets the bytes out as they come (within `min_tokens` it waits as vLLM does, since stop strings count
  from the completing token on), and a client's incremental UTF-8 decoder shows the split character at the same step
  as vLLM and the text before it a step sooner. So what is compared is what that decoder shows of our bytes, and
  vLLM's text so far must be its holding rules applied to the ids so far (`engine.cases.vllm_text_so_far`).

These tests use the session's SmolLM2 engine, so they run before test_replies_sentencepiece.py: an engine's shutdown
takes down vLLM's process-wide parallel groups, and an engine started before it cannot run after it."""

from engine.cases import CASES, check_replies, check_stream, stream


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


def test_deltas_equal_ours(smol_engine, smol_cases, smol_text_output):
    streams = stream(smol_engine, smol_cases)
    total = {'deltas': 0, 'equal': 0, 'held': 0}
    for (p, ro), deltas in zip(smol_cases, streams, strict=True):
        assert [i for d in deltas for i in d.token_ids] == list(ro.outputs[0].token_ids), p  # the same generation
        for k, v in check_stream(smol_text_output, p, ro, deltas).items():
            total[k] += v
    print(
        f"{len(streams)} streamed replies, {total['deltas']} deltas: {total['equal']} equal to ours step for step; "
        f"after {total['held']} vLLM had let out less than us"
    )
    assert total['held'] and total['equal'] < total['deltas']  # the cases do exercise vLLM's wider holdback
