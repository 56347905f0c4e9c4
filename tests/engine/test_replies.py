"""`Reply` against vLLM's own replies: greedy generations from vLLM on SmolLM2 with seeded random stop settings, our
`Reply` fed vLLM's token ids one step (one token) at a time, as vLLM's engine produces them without speculative
decoding. The text, finish reason and stop reason must equal vLLM's, byte for byte.

One difference is by design: a reply that ends (a length cut, a stop id) inside a character. vLLM's text holds only
whole characters, its incremental detokenizer keeping a partial one back; `Reply` streams bytes and leaves the partial
character's bytes to the client's incremental UTF-8 decoder, which holds them back too. So the text compared is what
that decoder shows, and the bytes past vLLM's text must be exactly one unfinished character."""

import codecs
import random

import pytest

from mstar_utils.checkpoints import smollm2_checkpoint
from mstar_utils.detokenize import TextOutput

PROMPTS = [
    'The capital of France is',
    'Write one sentence in Chinese about Tokyo: 東京は',
    'List three fruits, separated by commas:',
    '<|im_start|>user\nSay hello in Japanese.<|im_end|>\n<|im_start|>assistant\n',
    'Emoji for a party: 🎉 and for thumbs up:',
    'def fibonacci(n):',
]
CASES = 120  # requests, each with its own random stop settings
MAX_TOKENS = 40


def stops_from(text: str, rng: random.Random) -> list[str]:
    "Stop strings drawn from the text: slices, overlapping and tied pairs, parts of multi-byte runs, and misses."
    out = []
    for _ in range(rng.randint(1, 4)):
        if not text or rng.random() < 0.15:
            out.append(rng.choice(['zzq', '∰', 'Paris', '\n\n', '.', ' the', '<|im_end|>', 'im_end', '|>']))
            continue
        a = rng.randrange(len(text))
        s = text[a : a + rng.randint(1, 6)]
        kind = rng.random()
        if kind < 0.25 and len(s) > 1:
            out += [s, s[1:]]  # end together: a tie the stop list's order breaks
        elif kind < 0.4 and len(s) > 1:
            out += [s, s[:-1]]  # one a prefix of the other: the shorter ends first
        elif kind < 0.5:
            out += [s[-1:], s]  # a tie, the shorter listed first
        else:
            out.append(s)
    rng.shuffle(out)
    return out


def vllm_stop_reason(reply, request_ids, ignore_eos):
    "Our stop reason as vLLM reports it: None for the model's EOS (its `check_stop` sets none), else the id or string."
    r = reply.stop_reason
    if isinstance(r, int) and not ignore_eos and r in reply.text_output.stop_token_ids:
        return None
    return r


@pytest.fixture(scope='module')
def cases(smol_engine):
    "(SamplingParams, vLLM's output) for each random case, generated in one batch."
    from vllm import SamplingParams

    base = smol_engine.generate(
        PROMPTS,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, skip_special_tokens=False),
        use_tqdm=False,
    )
    texts = [o.outputs[0].text for o in base]
    ids = [list(o.outputs[0].token_ids) for o in base]
    rng = random.Random(41)
    prompts, params = [], []
    for _ in range(CASES):
        k = rng.randrange(len(PROMPTS))
        stop_ids = rng.sample(ids[k], rng.randint(1, 2)) if rng.random() < 0.2 else []
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=rng.choice([MAX_TOKENS, 12]),
                stop=stops_from(texts[k], rng),
                include_stop_str_in_output=rng.random() < 0.5,
                min_tokens=rng.choice([0, 0, 1, 3, 8]),
                stop_token_ids=stop_ids,
                ignore_eos=rng.random() < 0.5,
                skip_special_tokens=rng.random() < 0.5,
            )
        )
        prompts.append(PROMPTS[k])
    outs = smol_engine.generate(prompts, params, use_tqdm=False)
    return list(zip(params, [o.outputs[0] for o in outs], strict=True))


def ours(p, token_ids):
    "(text bytes, finish reason, stop reason) from our Reply fed the ids one token a step."
    to = TextOutput.from_checkpoint(smollm2_checkpoint(), keep_special=not p.skip_special_tokens)
    r = to.reply(
        stop=p.stop or (),
        include_stop_str_in_output=p.include_stop_str_in_output,
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop_token_ids=p.stop_token_ids or (),
    )
    out = b''.join(r.step([i]) for i in token_ids) + r.finish()
    return out, ('stop' if r.stopped else 'length'), vllm_stop_reason(r, p.stop_token_ids, p.ignore_eos)


def shown(b: bytes) -> bytes:
    "What a client's incremental UTF-8 decoder shows of `b`: all but an unfinished last character."
    return codecs.getincrementaldecoder('utf-8')().decode(b).encode()


def test_replies_equal_vllm(cases):
    bad, partial = [], 0
    for p, o in cases:
        raw, finish, reason = ours(p, list(o.token_ids))
        want = (o.text.encode(), o.finish_reason, o.stop_reason)
        if (shown(raw), finish, reason) != want:
            bad.append((p.stop, p.include_stop_str_in_output, p.min_tokens, p.ignore_eos, (raw, finish, reason), want))
        tail = raw[len(want[0]) :]
        assert raw.startswith(want[0]) and len(tail) < 4 and shown(tail) == b'', (raw, want)  # one unfinished char
        partial += bool(tail)
    assert not bad, f'{len(bad)} of {len(cases)} differ: {bad[:5]}'
    print(f'{len(cases)} replies equal to vLLM; {partial} end inside a character')
    assert len(cases) == CASES


def test_cases_cover_the_rules(cases):
    "The random cases exercise every rule: ties, stops kept or not, min_tokens, stop ids, EOS ignored, length cuts."
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
