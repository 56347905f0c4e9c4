"""vLLM's streamed replies (`RequestOutputKind.DELTA`) against our `Reply`: the seeded random requests of
test_replies.py re-run through vLLM's `LLMEngine` one engine step at a time, each step's delta fed to a `Reply`.

The deltas join to vLLM's final text, and to ours, byte for byte. Step by step, where each side holds text back:

- stop strings cut from the output (`include_stop_str_in_output=False`): vLLM holds back the last
  `max(map(len, stop)) - 1` characters of its text, whatever they are (its detokenizer's `stop_buffer_length`), until
  the request finishes. `Reply` holds back only an end of the text that starts some stop string (in bytes), so it
  lets out as much or more: at every step vLLM's text so far is a prefix of ours;
- no stop strings, or stop strings kept: neither holds anything back, and each step's delta equals ours;
- a character split across tokens: vLLM's incremental detokenizer (tokenizers' `DecodeStream`) shows it with the token
  that completes it. `Reply` lets its bytes out as they come (within `min_tokens`, with the completing token), and a
  client's incremental UTF-8 decoder shows the character at the same step as vLLM. So what is compared per step is
  what that decoder shows of our bytes.
"""

from engine.cases import check_stream, stream


def test_deltas_equal_ours(smol_engine, smol_cases, smol_text_output):
    streams = stream(smol_engine, smol_cases)
    total = {'deltas': 0, 'equal': 0, 'held': 0}
    for (p, ro), deltas in zip(smol_cases, streams, strict=True):
        assert [i for d in deltas for i in d.token_ids] == list(ro.outputs[0].token_ids), p  # the same generation
        for k, v in check_stream(smol_text_output, p, ro, deltas).items():
            total[k] += v
    print(
        f"{len(streams)} streamed replies, {total['deltas']} deltas: {total['equal']} equal to ours step for step; "
        f"at {total['held']} vLLM had let out less than us"
    )
    assert total['held'] and total['equal'] < total['deltas']  # the cases do exercise vLLM's wider holdback
