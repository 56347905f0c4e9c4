"""`Reply`: stop strings, stop ids, `min_tokens` and `'decode'`-mode tokenizers, on real tokenizers.

Every expected value comes from the tokenizer's own `decode` plus the cut the notebook documents (`reference` below,
written apart from the code under test: it decodes the whole reply and searches it with `bytes.find`). The
cases follow the behaviour vLLM's stop-string tests describe (stop strings split across tokens, cut before or after the
stop string, the stop token's text kept or not, `min_tokens` with a stop string that occurs early), on our own texts.
Hypothesis property tests check the contract on every step over byte-level BPE (Qwen, SmolLM2), SentencePiece with byte
fallback (Mistral v1), Metaspace, WordPiece (MiniLM), CTC (wav2vec2's character vocabulary) and a SentencePiece model
without tokenizer.json. `MSTAR_SLOW=1` runs more examples.
"""

import codecs
import functools
import json
import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st
from transformers import AutoTokenizer

from mstar_utils.checkpoints import minilm_checkpoint, smollm2_checkpoint, tokenizer_folder
from mstar_utils.detokenize import TextChunkDetokenizer, TextOutput
from mstar_utils.testing import ctc_tokenizer, metaspace_tokenizer, sentencepiece_model_tokenizer

from engine.cases import (  # tests/engine: vLLM's holding rules, in plain Python
    mistral_text_output,
    vllm_slow_deltas,
    vllm_text_so_far,
)

SLOW = bool(os.environ.get('MSTAR_SLOW'))
EXAMPLES = 120 if SLOW else 12
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def tok(name):
    "The real tokenizers of the property tests, by family."
    if name == 'qwen':
        return AutoTokenizer.from_pretrained(tokenizer_folder('qwen'))
    if name == 'smollm2':
        return AutoTokenizer.from_pretrained(smollm2_checkpoint())
    if name == 'mistral':
        return AutoTokenizer.from_pretrained(tokenizer_folder('mistral-v1'))
    if name == 'metaspace':
        return metaspace_tokenizer('first')
    if name == 'wordpiece':
        return AutoTokenizer.from_pretrained(minilm_checkpoint())
    if name == 'ctc':
        return ctc_tokenizer()
    if name == 'spm':
        return sentencepiece_model_tokenizer()
    raise KeyError(name)


MODES = {
    'qwen': 'byte_level',
    'smollm2': 'byte_level',
    'mistral': 'sentencepiece',
    'metaspace': 'metaspace',
    'wordpiece': 'wordpiece',
    'ctc': 'decode',
    'spm': 'decode',
}


def eos(name) -> int:
    "The id that ends a reply: the tokenizer's eos, or [SEP] for MiniLM's WordPiece, which has none."
    t = tok(name)
    return t.eos_token_id if t.eos_token_id is not None else t.sep_token_id


@functools.cache
def text_output(name):
    return TextOutput(TextChunkDetokenizer(tok(name)), frozenset({eos(name)}))


def decode(t, ids) -> bytes:
    "The reference text: the tokenizer's own decode, special tokens kept (TextChunkDetokenizer's default)."
    return t.decode(ids, skip_special_tokens=False).encode()


def common(a: bytes, b: bytes) -> int:
    "Length of the common prefix of a and b."
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def reference(t, ids, stop=(), include=False, min_tokens=0, stop_ids=()):
    "(final reply, stop reason, number of ids used) by the documented cut, from decode of the whole reply."
    k = next((k for k, i in enumerate(ids) if i in stop_ids and k + 1 >= min_tokens), None)
    used = ids if k is None else ids[: k + 1] if include else ids[:k]
    text = decode(t, used)
    # stop strings must end past the first min_tokens
    # as vLLM's detokenizer shows them: the ids up to the last of the first min_tokens that ends a character
    shown = max(j for j in range(min(min_tokens, len(ids)) + 1) if not t.decode(ids[:j]).endswith('\ufffd'))
    floor = common(decode(t, ids[:shown]), text) if min_tokens else 0
    best = None
    for s in dict.fromkeys(stop):
        b = s.encode()
        j = text.find(b, max(0, floor - len(b) + 1))
        if j >= 0 and (best is None or j + len(b) < best[0] + len(best[1])):  # a tie: the first listed
            best = (j, b, s)
    if best is not None:
        j, b, s = best
        return text[: j + len(b) if include else j], s, None
    return text, (ids[k] if k is not None else None), None


def run(reply, steps):
    "Step through `steps` (lists of ids), as one-token or k-token tensors; the emitted bytes after each step."
    out, emitted = b'', []
    for s in steps:
        out += reply.step(torch.tensor(s)) if s else reply.step(s)
        emitted.append(out)
    return out, emitted


def check_contract(t, reply, steps, stop, include, min_tokens, stop_ids):
    "Each step's output prefixes the final reply; it holds back less than the longest stop, none if kept."
    ids = [i for s in steps for i in s]
    final, reason, _ = reference(t, ids, stop, include, min_tokens=min_tokens, stop_ids=stop_ids)
    hold = 0 if include else max((len(s.encode()) for s in stop), default=1) - 1  # a kept stop: nothing held, as vLLM
    out, seen = b'', []
    for s in steps:
        out += reply.step(torch.tensor(s))
        seen.extend(s)
        assert final.startswith(out), (out, final)
        if not reply.stopped:
            # the part of the final reply these ids already fix; within the first min_tokens, up to the last id that
            # ends a character (a token ending inside one waits for the one that completes it, as vLLM shows it)
            j = len(seen)
            if j <= min_tokens:
                j = max(j for j in range(j + 1) if not t.decode(seen[:j]).endswith('\ufffd'))
            known = common(decode(t, seen[:j]), final)
            assert len(out) >= known - hold, (out, final, known, hold)
    out += reply.finish()
    assert out == final, (out, final, steps)
    assert reply.stop_reason == reason and reply.stopped == (reason is not None)


# ---------------------------------------------------------------- cases after vLLM's stop-string tests


def test_families_take_their_paths():
    "Which path each tokenizer takes: per-token bytes for tokenizer.json families, decode windows for CTC and SPM-only."
    for name, mode in MODES.items():
        assert text_output(name).detokenizer.mode == mode, name


@pytest.mark.parametrize('name', ['qwen', 'mistral', 'wordpiece', 'ctc', 'spm'])
@pytest.mark.parametrize('include', [False, True])
def test_stop_string_split_across_tokens(name, include):
    t = tok(name)
    text = 'THE CAT SAT ON THE MAT' if name == 'ctc' else 'The cat sat on the mat and then it slept.'
    stop = 'SAT ON' if name == 'ctc' else 'sat on'
    ids = ctc_frames(t, text) if name == 'ctc' else t.encode(text, add_special_tokens=False)
    want, reason, _ = reference(t, ids, [stop], include)
    tail = (b'CAT SAT ON' if name == 'ctc' else b'cat sat on') if include else b''
    assert reason == stop and want.endswith(tail)
    r = text_output(name).reply(stop=[stop], include_stop_str_in_output=include)
    out, _ = run(r, [[i] for i in ids])
    assert out == want and r.stopped and r.stop_reason == stop and r.finish() == b''
    assert r.step(torch.tensor(ids[:1])) == b''  # stays stopped


def test_stop_token_kept_or_not():
    "vLLM: the stop token's text is in the output only with include_stop_str_in_output."
    t = tok('mistral')
    enc = functools.partial(t.encode, add_special_tokens=False)
    ids = [*enc('Hello there'), t.eos_token_id, *enc(' more')]
    for include in (False, True):
        r = text_output('mistral').reply(include_stop_str_in_output=include)
        out, _ = run(r, [ids[:2], ids[2:]])
        assert (
            out == reference(t, ids, (), include, min_tokens=0, stop_ids={t.eos_token_id})[0]
            and r.stop_reason == t.eos_token_id
        )
    assert out.endswith(t.eos_token.encode())
    r = text_output('mistral').reply(ignore_eos=True)
    assert run(r, [ids])[0] + r.finish() == decode(t, ids) and not r.stopped
    # the request's own stop ids still stop it
    r = text_output('mistral').reply(ignore_eos=True, stop_token_ids=[ids[1]])
    assert run(r, [ids])[0] == decode(t, ids[:1]) and r.stop_reason == ids[1]
    for _ in range(2):  # a reply under ignore_eos warms its memo with the EOS id; a later reply still stops there
        r = text_output('mistral').reply(ignore_eos=True)
        assert run(r, [[i] for i in ids])[0] + r.finish() == decode(t, ids)
        r = text_output('mistral').reply()
        assert run(r, [[i] for i in ids])[0] == decode(t, ids[: ids.index(t.eos_token_id)])
        assert r.stop_reason == t.eos_token_id


def test_multi_token_step_ends_mid_step():
    t = tok('qwen')
    ids = t.encode('alpha beta gamma delta', add_special_tokens=False)
    for stop, stop_ids in ((['gamma'], ()), ((), {ids[2]})):
        r = text_output('qwen').reply(stop=stop, stop_token_ids=stop_ids)
        out = r.step(torch.tensor(ids))
        assert out == reference(t, ids, stop, False, min_tokens=0, stop_ids=stop_ids)[0] and r.stopped


def test_ties_broken_by_list_order():
    "vLLM's test_ties_broken_by_list_order on a real tokenizer: of two stop strings ending together, the first listed."
    t = tok('qwen')
    assert reference(t, t.encode('ab', add_special_tokens=False), ['b', 'ab'])[:2] == (b'a', 'b')
    for text in ('ab', 'xab yab', 'yxab'):
        ids = t.encode(text, add_special_tokens=False)
        for stop in (['b', 'ab'], ['ab', 'b'], ['xab', 'b'], ['b', 'xab'], ['y', 'yx']):
            want = reference(t, ids, stop)[:2]
            for steps in ([ids], [[i] for i in ids]):
                r = text_output('qwen').reply(stop=stop)
                assert (run(r, steps)[0] + r.finish(), r.stop_reason) == want, (text, stop)
    r = text_output('qwen').reply(stop=['b', 'ab'], include_stop_str_in_output=True)
    assert (r.step([t.encode('ab', add_special_tokens=False)[0]]), r.stop_reason) == (b'ab', 'b')


def test_min_tokens_with_stop_string():
    "vLLM PR 22014's case on our text: matches that end in the first min_tokens tokens don't count."
    t = tok('qwen')
    ids = t.encode(" is Lee, and I'm a student in the college of engineering", add_special_tokens=False)
    for m in (0, 2, 5, 9):
        r = text_output('qwen').reply(stop=['e'], min_tokens=m)
        out, _ = run(r, [[i] for i in ids])
        assert out == reference(t, ids, ['e'], False, min_tokens=m)[0], m
    assert out.startswith(b' is Lee, and I')


def test_min_tokens_with_stop_id():
    "A stop id at token k ends the reply when k >= min_tokens (vLLM's check_stop)."
    t = tok('qwen')
    ids = t.encode('one two three', add_special_tokens=False)
    eos = t.eos_token_id
    seq = [ids[0], eos, ids[1], eos, ids[2]]
    for m in range(6):
        r = text_output('qwen').reply(min_tokens=m)
        out = run(r, [[i] for i in seq])[0] + r.finish()
        assert out == reference(t, seq, (), False, min_tokens=m, stop_ids={eos})[0], m
        assert r.stopped == (m <= 4)


def test_cjk_stop_split_inside_a_character():
    "SmolLM2 splits 你 and 好 across two tokens each; a stop string 好 is matched on bytes, its first bytes held."
    t = tok('smollm2')
    ids = t.encode('Bonjour 你好 world', add_special_tokens=False)
    pieces = [t.convert_ids_to_tokens(i) for i in ids]
    assert len(ids) > len(['Bonjour', '你好', 'world']) + 2, pieces
    r = text_output('smollm2').reply(stop=['好'])
    out, emitted = run(r, [[i] for i in ids])
    assert out == 'Bonjour 你'.encode() and r.stop_reason == '好'


def test_bad_arguments():
    to = text_output('qwen')
    for kw, msg in (
        ({'stop': ['']}, 'non-empty'),
        ({'stop': [3]}, 'non-empty strings'),
        ({'min_tokens': -1}, 'min_tokens'),
        ({'stop_token_ids': ['x']}, 'stop_token_ids'),
    ):
        with pytest.raises(ValueError, match=msg):
            to.reply(**kw)
    r = to.reply()
    r.finish()
    with pytest.raises(ValueError, match='finish'):
        r.step([1])
    with pytest.raises(ValueError, match='outside the vocabulary'):
        to.reply().step([10**9])


def test_warm_path_matches_the_general_path():
    "The memo's answers equal the general path's on the same reply, tensors and lists, one and k tokens per step."
    t = tok('qwen')
    ids = t.encode(
        'Thought: look it up.\nObservation: 42\n\nThought: look it up.\nObservation: 42', add_special_tokens=False
    )
    want = reference(t, ids + ids, ['Observation: 4', '\n\nT'], False)[0]
    to = text_output('qwen')
    for k in (1, 2, 3):
        for _ in range(2):  # the second pass runs warm
            r = to.reply(stop=['Observation: 4', '\n\nT'])
            steps = [ids[j : j + k] for j in range(0, len(ids), k)]
            assert run(r, steps)[0] == want[: len(run(to.reply(stop=['Observation: 4', '\n\nT']), steps)[0])]
            r = to.reply(stop=['Observation: 4', '\n\nT'])
            assert b''.join(r.step(s) for s in steps) + r.finish() == reference(t, ids, ['Observation: 4', '\n\nT'])[0]


# ---------------------------------------------------------------- CTC


def ctc_frames(t, text, rng=None):
    "CTC frames for `text`: each character one to three frames, a pad between two equal characters, '|' for a space."
    rng, vocab, out = rng or random.Random(0), t.get_vocab(), []
    prev = None
    for c in text:
        tokid = vocab[t.word_delimiter_token if c == ' ' else c]
        if tokid == prev:
            out.append(t.pad_token_id)
        out += [tokid] * rng.randint(1, 3)
        if rng.random() < 0.2:
            out.append(t.pad_token_id)
        prev = out[-1]
    return out


def test_ctc_collapses_repeats_across_steps():
    t = tok('ctc')
    ids = ctc_frames(t, 'HELLO WORLD')
    assert t.decode(ids) == 'HELLO WORLD'
    r = text_output('ctc').reply()
    out, emitted = run(r, [[i] for i in ids])
    assert out + r.finish() == b'HELLO WORLD'
    per_token = b''.join(text_output('ctc').detokenizer.token_bytes(i) for i in ids)
    assert per_token != b'HELLO WORLD'  # what streaming per token gives: repeats and pads


def test_sentencepiece_model_keeps_word_spaces():
    t = tok('spm')
    ids = t.encode('Hello here, this is a simple test', add_special_tokens=False)
    r = text_output('spm').reply()
    assert run(r, [[i] for i in ids])[0] + r.finish() == decode(t, ids)
    assert b''.join(map(text_output('spm').detokenizer.token_bytes, ids)) == b'Hellohere,thisisasimpletest'


# ---------------------------------------------------------------- properties

ALPHABET = st.sampled_from(
    list("abcdefg xyz.,!?\n") + list('你好世界東京') + ['é', 'ß', '👍', '🏽', '🎉', '\u0301', 'Ω']
)
TEXT = st.text(ALPHABET, min_size=1, max_size=40)


@PROPERTY
@given(prompt=TEXT, reply=TEXT, bos=st.booleans(), keep_special=st.booleans())
@example(prompt=' ', reply='?', bos=True, keep_special=True)  # '▁▁' after <s>: decode keeps its spaces, vLLM not
def test_sentencepiece_model_reply_after_a_prompt_as_vllm(prompt, reply, bos, keep_special):
    "'decode' mode with `prompt_ids`: each step's text so far and the whole reply equal vLLM's slow detokenizer's."
    t = tok('spm')
    p = [t.bos_token_id] * bos + t.encode(prompt, add_special_tokens=False)
    ids = t.encode(reply, add_special_tokens=False)
    to = TextOutput(TextChunkDetokenizer(t, keep_special=keep_special), frozenset({eos('spm')}))
    r = to.reply(prompt_ids=p)
    theirs = vllm_slow_deltas(t, p, ids, skip_special_tokens=not keep_special)
    mine, so_far = b'', ''
    for i, delta in zip(ids, theirs, strict=True):
        mine, so_far = mine + r.step([i]), so_far + delta
        assert mine.decode(errors='replace').startswith(so_far), (mine, so_far)
    mine += r.finish()
    assert mine.decode() == so_far or so_far.endswith('\ufffd'), (mine, so_far)
    # a window of the prompt's last ids with no added token in it: the text is the tokenizer's own of the window and
    # the reply, less the window's (with one, vLLM converts the runs between added tokens apart)
    window = [i for i in p[-7:] if keep_special or i != t.bos_token_id][-5:]
    if not set(t.convert_ids_to_tokens(window)) & set(t.get_added_vocab()):
        whole, before = (t.convert_tokens_to_string(t.convert_ids_to_tokens(w)) for w in (window + ids, window))
        assert so_far == whole[len(before) :] or so_far.endswith('\ufffd'), (so_far, whole, before)


@st.composite
def stop_strings(draw, text):
    "Stop strings: slices of the text (often split across tokens, multi-byte ones included) and ones that never occur."
    out = []
    for _ in range(draw(st.integers(0, 4))):
        if text and draw(st.booleans()):
            a = draw(st.integers(0, len(text) - 1))
            out.append(text[a : a + draw(st.integers(1, 6))])
        else:
            out.append(draw(st.text(ALPHABET, min_size=1, max_size=5)) + draw(st.sampled_from(['', '∰', 'ZQ'])))
    return out


@st.composite
def case(draw, name):
    t = tok(name)
    if name == 'ctc':
        text = draw(st.text(st.sampled_from(list("HELO WRDAB'")), min_size=1, max_size=30))
        ids = ctc_frames(t, text, random.Random(draw(st.integers(0, 2**16))))
    else:
        text = draw(TEXT)
        ids = t.encode(text, add_special_tokens=False)
        # the metaspace fixture lacks a ByteFallback decoder: decode writes <0xNN> pieces as text, we as bytes
        if name == 'metaspace':
            assume(not any(p.startswith('<0x') for p in t.convert_ids_to_tokens(ids)))
    stop = draw(stop_strings(text))
    # a stop id, where a character ends (inside one, decode shows U+FFFD where the bytes stop)
    if ids and draw(st.booleans()):
        at = [p for p in range(len(ids) + 1) if not t.decode(ids[:p]).endswith('\ufffd')]
        ids.insert(draw(st.sampled_from(at)), eos(name))
    sizes, steps, j = draw(st.lists(st.integers(1, 4), min_size=1, max_size=8)), [], 0
    while j < len(ids):
        k = sizes[len(steps) % len(sizes)]
        steps.append(ids[j : j + k])
        j += k
    return steps, stop, draw(st.booleans()), draw(st.integers(0, 4))


@pytest.mark.parametrize('name', list(MODES))
def test_contract_property(name):
    @PROPERTY
    @given(case(name))
    def prop(c):
        steps, stop, include, min_tokens = c
        r = text_output(name).reply(stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens)
        check_contract(
            tok(name), r, steps, stop, include=include, min_tokens=min_tokens, stop_ids=text_output(name).stop_token_ids
        )

    prop()


# ---------------------------------------------------------------- the published benchmark figures


def test_published_reply_figures():
    "benchmarks/README.md quotes the Reply rows of benchmarks/detokenize_results.json (bench_detokenize --publish)."
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / 'benchmarks' / 'detokenize_results.json').read_text(encoding='utf-8'))
    text = (root / 'benchmarks' / 'README.md').read_text(encoding='utf-8')
    sec = text[text.index('### Replies: `Reply.step`') : text.index('## Checkpoint loading')]
    ns = {k: v['ns_per_token'] for k, v in res['results'].items()}
    rows = {
        'tokenizers `DecodeStream.step`': ns['DecodeStream.step'],
        '`TextOutput.step_bytes`, one-token tensor': ns['step_bytes'],
        '`Reply.step`, no stop strings': ns['reply'],
        '`Reply.step`, 4 stop strings': ns['reply_stop4'],
        '`Reply.step`, 4 stop strings, tokens 256-511': res['reply_stop4_at']['256'],
        '`Reply.step`, 4 stop strings, tokens 32,768-33,023': res['reply_stop4_at']['32768'],
    }
    for label, v in rows.items():
        assert f'| {label} | {v:.1f} |' in sec, label
    assert f"{res['reply_vs_step_bytes']:.2f}x `step_bytes`" in sec and res['reply_vs_step_bytes'] <= 1.3
    stop4 = res['reply_stop4_vs_decode_stream']
    assert f'{stop4:.2f}x `DecodeStream.step`' in sec and stop4 <= 0.7
    assert f"{res['reply_stop4_flat']:.2f}x tokens 256-511" in sec and res['reply_stop4_flat'] <= 1.3
    assert all(res['results'][k]['byte_exact'] for k in ('reply', 'reply_stop4'))
    ours = [v for k, v in res['targets'].items() if 'reply' in k or 'stop strings' in k]
    assert len(ours) == 3 and ('All three targets met' in sec) == all(ours)


# ---------------------------------------------------------------- vLLM's own streams, recorded by the engine tier

VLLM_STREAMS = json.loads(
    (Path(__file__).parent / 'engine' / 'reply_figures.json').read_text(encoding='utf-8')
)  # tools/engine --collect-replies: vLLM 0.32's streamed (DELTA) replies, token ids and text per step


@functools.cache
def vllm_text_output(model, keep_special):
    "Our text output for a recorded model: SmolLM2's checkpoint, or Mistral's v3 vocabulary (eos </s>, as its config)."
    if model == 'smollm2':
        return TextOutput.from_checkpoint(smollm2_checkpoint(), keep_special=keep_special)
    return mistral_text_output(keep_special)


@pytest.mark.parametrize('rec', VLLM_STREAMS, ids=lambda r: f"{r['model']}-{'-'.join(r['stop'])[:20]}")
def test_vllm_streams(rec):
    "Each step's ids through `Reply`: ours shows all vLLM showed so far, and the whole reply equals vLLM's."
    # vLLM's text so far is what its holding rules leave of the ids' text (tests/engine/test_replies.py says which);
    # ours, what a client's UTF-8 decoder shows of our bytes.
    to = vllm_text_output(rec['model'], not rec['skip_special_tokens'])
    r = to.reply(
        stop=rec['stop'],
        include_stop_str_in_output=rec['include_stop_str_in_output'],
        min_tokens=rec['min_tokens'],
        ignore_eos=rec['ignore_eos'],
        stop_token_ids=rec['stop_token_ids'],
        prompt_ids=rec['prompt_ids'],
    )
    hold = max(map(len, rec['stop'])) - 1 if rec['stop'] and not rec['include_stop_str_in_output'] else 0
    dec, mine, theirs, seen = codecs.getincrementaldecoder('utf-8')(), '', '', []
    for ids, text in rec['steps'][:-1]:
        mine, theirs, seen = mine + dec.decode(r.step(ids)), theirs + text, seen + ids
        assert mine.startswith(theirs) and theirs == vllm_text_so_far(to.detokenizer, seen, hold), (ids, mine, text)
    mine += dec.decode(r.step(rec['steps'][-1][0]) + r.finish())
    reason = None if r.stop_reason == to.detokenizer.tokenizer.eos_token_id and not rec['ignore_eos'] else r.stop_reason
    assert (mine, 'stop' if r.stopped else 'length', reason) == (rec['text'], rec['finish_reason'], rec['stop_reason'])
