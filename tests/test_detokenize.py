"""Streaming detokenizers on real tokenizers: a corpus, hypothesis text and random ids, split streams, stop tokens, bad
ids, threads.

Every expected value comes from the tokenizer itself (`decode`, `encode`, `convert_tokens_to_ids`) or from the
rules the notebook states; nothing is a hand-typed byte string except where the issue fixes the text.

The corpus (`CORPUS`, >= 300 strings) is built deterministically:
1. `HAND`: hand-written strings, grouped by what they exercise (English, code with indentation and runs of spaces,
   CJK, Arabic, Hindi, emoji with ZWJ sequences and skin tones, combining marks, CRLF, control characters, cleanup
   traps);
2. every hand-written string again with a leading space and with a trailing newline (a word-initial space is a
   different token in both families, and a final newline often merges with the text before it);
3. 200 combinations drawn with `random.Random(20250311)`: two to four hand-written strings from different groups,
   joined by separators drawn from spaces, runs of spaces, tabs, "\\n", "\\r\\n" and U+3000.
Duplicates are dropped keeping the first occurrence, so the list and its order are the same on every run.
"""

import codecs
import functools
import json
import pickle
import random
import re
import shutil
import sys
import threading
import unicodedata

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tokenizers import decoders, pre_tokenizers

from mstar_utils.checkpoints import minilm_checkpoint, smollm2_checkpoint, tokenizer_folder
from mstar_utils.detokenize import (
    ByteLevelDetokenizer,
    SentencePieceDetokenizer,
    TextChunkDetokenizer,
    TextOutput,
    TextStream,
    drop_stop_tokens,
)
from mstar_utils.testing import clip_tokenizer_folder, metaspace_tokenizer, redecorated

# ---------------------------------------------------------------- corpus
HAND = {
    'english': [
        'Hello, world!',
        'The quick brown fox jumps over the lazy dog.',
        "Don't stop; it's fine, isn't it?",
        'Dear [Name], I hope this message finds you well.',
        'e.g. U.S.A. vs. U.K. -- 3.14159 and 1,000,000.',
        'Mr. Smith paid $42.50 (tax incl.) on 2024-02-29 at 11:59pm.',
        '"Quoted," she said. \'Single\' too.',
        'ALL CAPS AND lower case AND MiXeD CaSe',
        'hyphen-ated, en–dash, em—dash, ellipsis…',
        'a',
        ' ',
        '',
        'I',
        '?!',
        'The end.\n',
    ],
    'code': [
        'def f(x):\n    return x * 2\n',
        'if (a) {\n\tb();\n}',
        'a    b',
        'x  =  1;   y   =   2',
        'for i in range(10):\n        print(i)\n\n\n',
        '    indented\n        more\n            most',
        "{'a': 'search', 'b': 'replace'}",
        "d = {'key': 'value'}  # comment",
        '$ ls -la | grep "\\.py$"',
        'SELECT * FROM t WHERE x <> 0;',
        '<div class="x">&amp;</div>',
        '```python\nprint(1)\n```',
        'λx. x + 1',
        'let v: Vec<u8> = vec![0; 16];',
        '#include <stdio.h>\nint main(void) { return 0; }',
    ],
    'cjk': [
        '你好，世界',
        '北京欢迎你',
        '我爱自然语言处理',
        '机器学习和深度学习',
        '東京の天気は晴れです。',
        '今日は良い天気ですね',
        'カタカナとひらがな',
        '안녕하세요, 세계!',
        '北東爿',
        '龘靐齉爩',
        '中文English混合text',
        '「引用」と『二重引用』',
        '𠀀𠀁𪚥',
        '１２３ＡＢＣ',
        '漢字\u3000全角スペース',
    ],
    'arabic': [
        'مرحبا بالعالم',
        'السلام عليكم ورحمة الله',
        'اللغة العربية جميلة',
        'رقم ١٢٣ و 456',
        'كِتَابٌ مُشَكَّلٌ',
        'English then عربي then English',
    ],
    'hindi': [
        'नमस्ते दुनिया',
        'हिन्दी भाषा',
        'क्षत्रिय और ज्ञान',
        'मैं ठीक हूँ।',
        'संस्कृतम् ॐ',
        'Hindi हिन्दी mixed',
    ],
    'emoji': [
        '👍',
        '👍🏽',
        '👩‍💻',
        '👩🏽‍💻',
        '👨‍👩‍👧‍👦',
        '🏳️‍🌈',
        '❤️',
        '🇫🇷🇯🇵',
        '🧑🏿‍🤝‍🧑🏻',
        'Great job 👏🏼👏🏼!',
        '1️⃣ keycap',
        '😀😃😄😁',
        '🫠 new emoji 🪿',
    ],
    'combining': [
        'e\u0301',
        'cafe\u0301 vs café',
        'n\u0303 n\u0303\u0301',
        'Z\u0351\u0352\u0353a\u0354\u0355lgo',
        'a\u0308o\u0308u\u0308',
        'ṩ vs s\u0323\u0307',
        'Å vs A\u030a',
        '\u0915\u094d\u0937',
    ],
    'crlf': [
        'line one\r\nline two\r\n',
        '\r\n',
        'a\r\n\r\nb',
        'windows\r\nstyle\r\n  indented\r\n',
        'mixed\n\r\nends\r',
    ],
    'control': [
        'tab\there',
        'bell\x07 and null\x00 byte',
        'esc\x1b[31mred\x1b[0m',
        'form\x0cfeed and vt\x0b',
        'del\x7f char',
        'nbsp\u00a0here',
        'zwsp\u200bhere',
        'bom\ufeffhere',
        'soft\u00adhyphen',
        'c1\x85\x9ccontrols',
    ],
}
SEPARATORS = [' ', '', '\n', '\r\n', '\t', '    ', '  ', '\u3000', ' \n']


def build_corpus() -> list[str]:
    out = []
    for texts in HAND.values():
        out += texts
    for texts in HAND.values():
        out += [' ' + t for t in texts] + [t + '\n' for t in texts]
    rng, groups = random.Random(20250311), list(HAND)
    for _ in range(200):
        parts = [rng.choice(HAND[g]) for g in rng.sample(groups, rng.randint(2, 4))]
        out.append(''.join(p + rng.choice(SEPARATORS) for p in parts[:-1]) + parts[-1])
    return list(dict.fromkeys(out))


CORPUS = build_corpus()
BYTE_LEVEL = ['gpt2', 'whisper-multilingual', 'qwen', 'smollm2']
SENTENCEPIECE = ['mistral-v1', 'mistral-v3']


def test_corpus_covers_what_the_issue_asks():
    assert len(CORPUS) >= 300
    joined = ''.join(CORPUS)

    def has(pred):
        return any(pred(c) for c in joined)

    assert (
        has(lambda c: '\u4e00' <= c <= '\u9fff')
        and has(lambda c: '\u0600' <= c <= '\u06ff')
        and has(lambda c: '\u0900' <= c <= '\u097f')
    )
    assert '\u200d' in joined and has(lambda c: '\U0001f3fb' <= c <= '\U0001f3ff')  # ZWJ, skin tones
    assert has(lambda c: unicodedata.category(c) == 'Mn')  # combining marks
    assert '\r\n' in joined and 'a    b' in CORPUS and "{'a': 'search', 'b': 'replace'}" in CORPUS
    assert has(lambda c: unicodedata.category(c) == 'Cc' and c not in '\r\n\t')  # control characters
    assert build_corpus() == CORPUS  # deterministic


# ---------------------------------------------------------------- tokenizers (loaded once)
@functools.cache
def load(name):
    "The tokenizer `name` (one of BYTE_LEVEL + SENTENCEPIECE), loaded once per session."
    return AutoTokenizer.from_pretrained(smollm2_checkpoint() if name == 'smollm2' else tokenizer_folder(name))


class _Toks:
    def __getitem__(self, name):
        return load(name)


@pytest.fixture(scope='module')
def toks():
    return _Toks()


def strip1(s: str) -> str:
    "The notebook's SentencePiece rule: decode == our text less one leading space."
    return s[1:] if s.startswith(' ') else s


def random_split(ids, rng):
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1))) if len(ids) > 1 else []
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]


def check_stream(det, ids, rng, text=None, rounds: int = 3) -> int:
    """Any split into consecutive chunks joins to to_bytes(ids); a strict UTF-8 incremental decoder fed the chunks
    never raises and ends at `text`. Returns how many chunks ended inside a character."""
    whole, partial = det.to_bytes(ids), 0
    for _ in range(rounds):
        chunks = [det.to_bytes(c) for c in random_split(ids, rng)]
        assert b''.join(chunks) == whole
        if text is not None:
            dec, got = codecs.getincrementaldecoder('utf-8')('strict'), []
            for c in chunks:
                got.append(dec.decode(c))
                partial += bool(dec.getstate()[0])
            got.append(dec.decode(b'', final=True))
            assert ''.join(got) == text
    return partial


# ---------------------------------------------------------------- byte-level
@pytest.mark.parametrize('name', BYTE_LEVEL)
def test_byte_level_corpus(toks, name):
    tok = toks[name]
    plain, kept = ByteLevelDetokenizer(tok), ByteLevelDetokenizer(tok, keep_special=True)
    assert ByteLevelDetokenizer.is_byte_level(tok)
    specials = sorted(plain.special_ids)
    assert specials, name
    rng, partial = random.Random(name), 0
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        wrapped = [specials[0], *ids, specials[-1]]
        for det, keep in ((plain, False), (kept, True)):
            for seq in (ids, wrapped):
                got = det.to_bytes(seq)
                assert b''.join(det.token_bytes(i) for i in seq) == got
                assert got.decode() == tok.decode(seq, skip_special_tokens=not keep), (name, text, keep)
        partial += check_stream(plain, ids, rng, tok.decode(ids))
    assert partial > 50, partial  # the corpus really splits characters across chunks


@pytest.mark.parametrize('name', SENTENCEPIECE)
def test_sentencepiece_corpus(toks, name):
    tok = toks[name]
    sp = SentencePieceDetokenizer(json.loads((tokenizer_folder(name) / 'tokenizer.json').read_text()))
    chunk = TextChunkDetokenizer(tok)
    assert sp.model_type == 'BPE' and chunk.mode == 'sentencepiece'
    rng, partial, stripped = random.Random(name), 0, 0
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        wrapped = [tok.bos_token_id, *ids, tok.eos_token_id]
        ours = sp.to_bytes(ids).decode()
        assert b''.join(sp.piece_bytes(i) for i in ids) == sp.to_bytes(ids)
        assert strip1(ours) == tok.decode(ids, skip_special_tokens=True), (name, text)
        assert sp.to_bytes(wrapped) == sp.to_bytes(ids)  # special tokens give nothing
        assert strip1(chunk.to_bytes(wrapped).decode()) == tok.decode(wrapped)  # ... unless kept
        stripped += ours != tok.decode(ids, skip_special_tokens=True)
        partial += check_stream(sp, ids, rng, ours)
    assert partial > 20 and stripped > 100, (partial, stripped)


# ---------------------------------------------------------------- hypothesis: text and random ids
@pytest.mark.parametrize('name', BYTE_LEVEL + SENTENCEPIECE)
@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=40), seed=st.integers(0, 2**16))
def test_hypothesis_text(name, text, seed):
    tok = load(name)
    ids = tok.encode(text, add_special_tokens=False)
    det = _chunk(tok) if name in SENTENCEPIECE else _byte_level(tok)
    got = det.to_bytes(ids)
    try:
        ours = got.decode()
    except UnicodeDecodeError:
        # the vocabulary lacks a byte the text needs (SmolLM2 has no token for some lead bytes such as 0xF1), so
        # encode dropped it: the ids are not valid UTF-8 on their own, and decode shows U+FFFD where ours has raw bytes
        want = tok.decode(ids, skip_special_tokens=True)
        assert name not in SENTENCEPIECE and '\ufffd' in want and got.decode('utf-8', 'replace') == want
        return
    # the byte-level detokenizer drops special tokens (hypothesis also tries strings like '<|im_end|>'); TextChunk keeps
    # them
    if name in SENTENCEPIECE:
        assert strip1(ours) == tok.decode(ids)
    else:
        assert ours == tok.decode(ids, skip_special_tokens=True)
    check_stream(det, ids, random.Random(seed), ours)


_DETS = {}


def _byte_level(tok, keep_special=False):
    "One detokenizer per tokenizer for the hypothesis tests, so examples share a warm memo."
    key = ('bl', id(tok), keep_special)
    if key not in _DETS:
        _DETS[key] = ByteLevelDetokenizer(tok, keep_special=keep_special)
    return _DETS[key]


def _chunk(tok):
    key = ('chunk', id(tok))
    if key not in _DETS:
        _DETS[key] = TextChunkDetokenizer(tok)
    return _DETS[key]


def _ids_strategy(tok, byte_ids):
    "Random ids: anywhere in the vocabulary, byte tokens (which split characters), and the added tokens."
    return st.lists(
        st.one_of(
            st.integers(0, len(tok) - 1), st.sampled_from(byte_ids), st.sampled_from(sorted(tok.added_tokens_decoder))
        ),
        max_size=30,
    )


@pytest.mark.parametrize('name', BYTE_LEVEL)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_byte_level_random_ids(name, data):
    tok = load(name)
    byte_ids = tok.convert_tokens_to_ids([c for c in _byte_chars()])
    ids = data.draw(_ids_strategy(tok, byte_ids))
    for keep in (False, True):
        det = _byte_level(tok, keep)
        got = det.to_bytes(ids)
        # Python's 'replace' and Rust's from_utf8_lossy both substitute maximal subparts
        assert got.decode('utf-8', 'replace') == tok.decode(ids, skip_special_tokens=not keep)
        assert b''.join(det.to_bytes(c) for c in random_split(ids, random.Random(len(ids)))) == got


def _byte_chars():
    from mstar_utils.detokenizers import _BYTE_DECODER

    return list(_BYTE_DECODER)


@pytest.mark.parametrize('name', SENTENCEPIECE)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_sentencepiece_random_ids(name, data):
    tok = load(name)
    byte_ids = tok.convert_tokens_to_ids([f'<0x{b:02X}>' for b in range(256)])
    ids = data.draw(_ids_strategy(tok, byte_ids))
    det = _chunk(tok)
    got, want = det.to_bytes(ids), tok.decode(ids)
    try:
        text = got.decode()
    except UnicodeDecodeError:
        # ByteFallback writes an invalid byte run as one U+FFFD per byte; ours stays bytes for the client to judge
        assert '\ufffd' in want
    else:
        assert strip1(text) == want
    assert b''.join(det.to_bytes(c) for c in random_split(ids, random.Random(len(ids)))) == got


# ---------------------------------------------------------------- the cases the issue names
@pytest.mark.parametrize('name', ['smollm2', 'gpt2'])
def test_cjk_character_across_two_tokens(toks, name):
    tok = toks[name]
    ids = tok.encode('你', add_special_tokens=False)
    assert len(ids) == 2 and [tok.decode([i]) for i in ids] == ['\ufffd', '\ufffd']
    det = TextChunkDetokenizer(tok)
    first, second = det.token_bytes(ids[0]), det.token_bytes(ids[1])
    assert first + second == '你'.encode() and len(first) in (1, 2)
    client = codecs.getincrementaldecoder('utf-8')('strict')
    assert client.decode(first) == '' and client.decode(second) == '你'


@pytest.mark.parametrize('name', SENTENCEPIECE)
def test_sentencepiece_pieces_bei_dong_pan(toks, name):
    tok = toks[name]
    ids = tok.convert_tokens_to_ids(['▁', '北', '東', '<0xE7>', '<0x88>', '<0xBF>'])
    sp = SentencePieceDetokenizer(json.loads((tokenizer_folder(name) / 'tokenizer.json').read_text()))
    assert sp.to_bytes(ids).decode() == ' 北東爿' == ' ' + tok.decode(ids)
    assert [sp.piece_bytes(i) for i in ids[3:]] == [bytes([b]) for b in '爿'.encode()]


def test_qwen_chatml_stop(toks):
    qwen = toks['qwen']
    assert qwen.convert_tokens_to_ids('<|im_end|>') == 151645
    to = TextOutput(TextChunkDetokenizer(qwen), frozenset({151645}))
    ids = qwen.encode('Hello<|im_end|>', add_special_tokens=False)
    assert ids[-1] == 151645 and qwen.decode(ids[:-1]) == 'Hello'
    assert to.output_bytes(torch.tensor(ids)) == b'Hello'
    assert b''.join(to.step_bytes(torch.tensor([i])) for i in ids) == b'Hello'
    chunks = [to.step_bytes(torch.tensor([i]), {'ignore_eos': True}) for i in ids]
    assert chunks == [b'Hello', b'<|im_end|>'] and b''.join(chunks).decode() == qwen.decode(ids)


# ---------------------------------------------------------------- modes, added tokens, cleanup, slow, Unigram
def test_text_chunk_modes(toks):
    for n in BYTE_LEVEL:
        assert TextChunkDetokenizer(toks[n]).mode == 'byte_level'
    for n in SENTENCEPIECE:
        assert TextChunkDetokenizer(toks[n]).mode == 'sentencepiece'
    mini = AutoTokenizer.from_pretrained(minilm_checkpoint())
    assert TextChunkDetokenizer(mini).mode == 'wordpiece'
    # per-token decode is the fallback for a decoder whose token text depends on its neighbours (CTC merges repeats)
    ctc = redecorated(mini, decoder=decoders.CTC())
    det = TextChunkDetokenizer(ctc)
    assert det.mode == 'decode' and 'CTC' in det.reason and det.edges == ()
    ids = ctc.encode('Streaming tokenizers, one step at a time', add_special_tokens=True)
    assert [det.token_bytes(i) for i in ids] == [ctc.decode([i]).encode() for i in ids]
    assert det.to_bytes(ids) == ctc.decode(ids).encode()
    assert (
        TextChunkDetokenizer(ctc, keep_special=False).to_bytes(ids)
        == ctc.decode(ids, skip_special_tokens=True).encode()
    )
    with pytest.raises(ValueError, match="'WordPiece'"):
        SentencePieceDetokenizer(json.loads((minilm_checkpoint() / 'tokenizer.json').read_text()))


def test_word_spaces_survive_sentencepiece(toks):
    tok = toks['mistral-v3']
    ids = tok.encode('Dear [Name], I hope', add_special_tokens=False)
    per_step = ''.join(tok.decode([i]) for i in ids)
    assert per_step == 'Dear[Name],Ihope'  # what the contract's per-step decode streams
    det = TextChunkDetokenizer(tok)
    assert strip1(b''.join(det.token_bytes(i) for i in ids).decode()) == tok.decode(ids) == 'Dear [Name], I hope'


def test_added_tokens_are_text(toks):
    qwen = AutoTokenizer.from_pretrained(tokenizer_folder('qwen'))
    qwen.add_tokens(['<tool_call>\n', ' hi there', '\n</tool_call>'])
    qwen.add_special_tokens({'additional_special_tokens': ['<|tool sep|>\n']})
    text = 'x<tool_call>\n{"a": 1}\n</tool_call> hi there<|tool sep|>\nend'
    ids = qwen.encode(text, add_special_tokens=False)
    for keep in (False, True):
        det = ByteLevelDetokenizer(qwen, keep_special=keep)
        assert det.to_bytes(ids).decode() == qwen.decode(ids, skip_special_tokens=not keep)
    det = ByteLevelDetokenizer(qwen)
    sep = qwen.convert_tokens_to_ids('<|tool sep|>\n')
    assert det.token_bytes(qwen.convert_tokens_to_ids(' hi there')) == b' hi there' and det.token_bytes(sep) == b''
    assert ByteLevelDetokenizer(qwen, keep_special=True).token_bytes(sep) == b'<|tool sep|>\n'
    # an added token written only in byte-map characters is still its text: tokenizers' decode maps it through
    # the byte table ('café' -> b'caf\xe9', invalid UTF-8), the detokenizer gives what encode() matched
    qwen.add_tokens(['café'])
    cafe = qwen.convert_tokens_to_ids('café')
    assert (
        qwen.encode('café', add_special_tokens=False) == [cafe]
        and ByteLevelDetokenizer(qwen).token_bytes(cafe) == 'café'.encode()
    )


def test_no_cleanup_rewrite(toks):
    text = "{'a': 'search'} isn't it ?"
    on = AutoTokenizer.from_pretrained(smollm2_checkpoint(), clean_up_tokenization_spaces=True)
    ids = on.encode(text, add_special_tokens=False)
    # transformers 5 ignores the flag for BPE, so decode is unchanged and the tokenizer still counts as byte-level
    assert ByteLevelDetokenizer.is_byte_level(on) and on.decode(ids) == text
    assert TextChunkDetokenizer(on).to_bytes(ids).decode() == text
    forced = AutoTokenizer.from_pretrained(
        smollm2_checkpoint(),
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    assert forced.decode(ids) != text  # "':'search"
    assert not ByteLevelDetokenizer.is_byte_level(forced)
    with pytest.raises(ValueError, match='clean_up_tokenization_spaces'):
        ByteLevelDetokenizer(forced)
    # the chunks still stream the decoder's bytes: the rewrite works on whole texts, and the reason says it is not
    # applied
    chunk = TextChunkDetokenizer(forced)
    assert chunk.mode == 'byte_level' and 'clean_up_tokenization_spaces' in chunk.reason
    assert chunk.to_bytes(ids).decode() == text == forced.decode(ids, clean_up_tokenization_spaces=False)
    for n in BYTE_LEVEL:
        assert ByteLevelDetokenizer(toks[n]).to_bytes(toks[n].encode(text)).decode() == text


def _gpt2_slow(tmp_path, **kw):
    """A slow (Python) byte-level tokenizer over GPT-2's real vocabulary: ClvpTokenizer reads GPT-2's
    vocab.json/merges.txt format."""
    from transformers import ClvpTokenizer

    model = json.loads((tokenizer_folder('gpt2') / 'tokenizer.json').read_text())['model']
    (tmp_path / 'vocab.json').write_text(json.dumps(model['vocab']))
    merges = [m if isinstance(m, str) else ' '.join(m) for m in model['merges']]
    (tmp_path / 'merges.txt').write_text('#version: 0.2\n' + '\n'.join(merges) + '\n')
    return ClvpTokenizer(str(tmp_path / 'vocab.json'), str(tmp_path / 'merges.txt'), **kw)


def test_slow_byte_level_tokenizer(toks, tmp_path):
    slow = _gpt2_slow(tmp_path, clean_up_tokenization_spaces=False)
    assert not hasattr(slow, 'backend_tokenizer') and ByteLevelDetokenizer.is_byte_level(slow)
    fast = toks['gpt2']
    for keep in (False, True):
        det = ByteLevelDetokenizer(slow, keep_special=keep)
        for text in CORPUS[::7]:
            ids = [slow.bos_token_id, *fast.encode(text, add_special_tokens=False), slow.eos_token_id]
            assert det.to_bytes(ids).decode() == slow.decode(ids, skip_special_tokens=not keep), text
    assert not ByteLevelDetokenizer.is_byte_level(_gpt2_slow(tmp_path, clean_up_tokenization_spaces=True))


def _unigram_tokenizer():
    """A small SentencePiece-style Unigram tokenizer with byte fallback, built with HF tokenizers (no real Unigram
    vocabulary ships in a package we pin)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    words = ['▁', '▁the', '▁quick', '▁brown', '▁fox', '▁hello', '▁world', 'ing', 's', '▁a', '▁b', '北', '東', '▁你好']
    letters = sorted(set('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?\'"():;[]{}-_=#*'))
    vocab = [('<unk>', 0.0), ('<s>', 0.0), ('</s>', 0.0)] + [(f'<0x{b:02X}>', -20.0) for b in range(256)]
    vocab += [(w, -2.0 - 0.1 * k) for k, w in enumerate(words)] + [(c, -8.0) for c in letters]
    tk = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend('▁'), normalizers.Replace(' ', '▁')])
    tk.decoder = decoders.Sequence(
        [decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(' ', 1, 0)]
    )
    tk.add_special_tokens(['<unk>', '<s>', '</s>'])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token='<unk>', bos_token='<s>', eos_token='</s>')


def test_unigram_byte_fallback():
    tok = _unigram_tokenizer()
    sp = SentencePieceDetokenizer(json.loads(tok.backend_tokenizer.to_str()))
    det = TextChunkDetokenizer(tok)
    assert sp.model_type == 'Unigram' and det.mode == 'sentencepiece'
    fallback = 0
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        wrapped = [tok.bos_token_id, *ids, tok.eos_token_id]
        assert strip1(sp.to_bytes(wrapped).decode()) == tok.decode(wrapped, skip_special_tokens=True), text
        assert strip1(det.to_bytes(wrapped).decode()) == tok.decode(wrapped), text
        fallback += any(3 <= i < 259 for i in ids)
    assert fallback > 100


# ---------------------------------------------------------------- bad ids
@pytest.mark.parametrize('kind', ['byte_level', 'sentencepiece', 'chunk_sp', 'chunk_decode'])
def test_bad_ids(toks, kind):
    det = {
        'byte_level': lambda: ByteLevelDetokenizer(toks['smollm2']),
        'sentencepiece': lambda: SentencePieceDetokenizer(
            json.loads((tokenizer_folder('mistral-v1') / 'tokenizer.json').read_text())
        ),
        'chunk_sp': lambda: TextChunkDetokenizer(toks['mistral-v3']),
        'chunk_decode': lambda: TextChunkDetokenizer(AutoTokenizer.from_pretrained(minilm_checkpoint())),
    }[kind]()
    size = det.vocab_size
    det.token_bytes(1)
    det.token_bytes(size - 1)  # warm: equal floats and bools must still be refused
    for bad in (-1, size, size + 1, 10**12, 1.0, 1.5, True, float(size - 1), '3', None, torch.tensor(1)):
        with pytest.raises(ValueError) as e:
            det.token_bytes(bad)
        assert str(size) in str(e.value) and (repr(bad) in str(e.value) or str(bad) in str(e.value)), e.value
        with pytest.raises(ValueError):
            det.to_bytes([1, bad])
    assert det.token_bytes(np.int64(1)) == det.token_bytes(1)
    assert det.to_bytes(torch.tensor([1, size - 1])) == det.to_bytes([1, size - 1])
    with pytest.raises(ValueError, match=str(size)):
        TextOutput(det, frozenset()).step_bytes(torch.tensor([size]))


# ---------------------------------------------------------------- threads
@pytest.mark.parametrize('make', ['byte_level', 'sentencepiece'])
def test_memo_is_thread_safe(toks, make):
    tok = toks['qwen' if make == 'byte_level' else 'mistral-v1']
    ids = sorted({i for t in CORPUS for i in tok.encode(t, add_special_tokens=False)} | set(range(0, len(tok), 97)))
    reference = TextChunkDetokenizer(tok)
    want = {i: reference.token_bytes(i) for i in ids}
    det = TextChunkDetokenizer(tok)  # cold memo, shared by 8 threads
    barrier, results, errors = threading.Barrier(8), [None] * 8, []

    def work(k):
        try:
            order = ids[:]
            random.Random(k).shuffle(order)
            barrier.wait()
            got = {i: det.token_bytes(i) for i in order}
            for bad in (-1, len(tok)):
                try:
                    det.token_bytes(bad)
                except ValueError:
                    pass
                else:
                    errors.append(f'{bad} accepted')
            results[k] = got
        except Exception as e:
            errors.append(repr(e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    for got in results:
        assert got == want
    # one canonical object per id, whichever thread computed it
    assert all(all(r[i] is results[0][i] for r in results) for i in ids)
    assert len(det._memo) == len(ids)  # the one memo holds each id once, and no refused id


# ---------------------------------------------------------------- stop tokens and TextOutput
def test_drop_stop_tokens():
    out = torch.tensor([[[5, 2]], [[7, 9]]])
    # the reply ends at its first stop token: nothing after it, whatever the shape
    assert drop_stop_tokens(out, {2, 9}, None) == [5]
    assert drop_stop_tokens(out, frozenset({9}), {}) == [5, 2, 7]
    assert drop_stop_tokens(out, [2, 9], {'ignore_eos': False}) == [5]
    assert drop_stop_tokens(out, {2, 9}, {'ignore_eos': True}) == [5, 2, 7, 9]
    assert drop_stop_tokens(out, {2, 9}, {'ignore_eos': 1, 'temperature': 0}) == [5, 2, 7, 9]
    assert drop_stop_tokens(torch.tensor(2), {2}, None) == []
    assert drop_stop_tokens(torch.tensor([2, 2, 2]), {2}, None) == []
    assert drop_stop_tokens(torch.tensor([], dtype=torch.long), {2}, None) == []
    assert drop_stop_tokens(torch.tensor([3, 4], dtype=torch.int32), set(), None) == [3, 4]
    assert drop_stop_tokens([3, 2, 4], {2}, None) == [3]
    assert drop_stop_tokens((3, 4), {2}, None) == [3, 4] and drop_stop_tokens(range(3, 5), {4}, None) == [3]
    assert drop_stop_tokens(np.array([[3, 2]]), {2}, None) == [3]
    for bad, msg in [
        ('32', 'output is the str'),
        (b'3', 'output is the bytes'),
        ([3, 2.0], r'2\.0, a float'),
        ([3, True], 'True, a bool'),
        (np.array([1.0]), r'1\.0, a float'),
        (None, 'output is the NoneType'),
        (3, 'output is the int'),
    ]:
        with pytest.raises(ValueError, match=msg):
            drop_stop_tokens(bad, {2}, None)
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1 + 0j])):
        with pytest.raises(ValueError, match='integer tensor'):
            drop_stop_tokens(bad, {2}, None)


@pytest.mark.parametrize('name', ['smollm2', 'qwen', 'mistral-v1'])
def test_step_and_output_bytes_agree(toks, name):
    tok = toks[name]
    to = TextOutput(TextChunkDetokenizer(tok), frozenset({tok.eos_token_id}))
    for text in CORPUS[::5]:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        steps = b''.join(to.step_bytes(torch.tensor([[i]]), None) for i in ids)
        assert steps == to.output_bytes(torch.tensor(ids)) == to.detokenizer.to_bytes(ids[:-1])
        kept = b''.join(to.step_bytes(torch.tensor([i]), {'ignore_eos': True}) for i in ids)
        assert kept == to.detokenizer.to_bytes(ids)


def _checkpoint(folder, generation_config, tokenizer_source=None):
    """A checkpoint folder with this generation_config.json (a dict, or raw text; None for none) and, if given,
    `tokenizer_source`'s tokenizer files."""
    folder.mkdir()
    if tokenizer_source is not None:
        for f in ('tokenizer.json', 'tokenizer_config.json'):
            shutil.copy(tokenizer_source / f, folder / f)
    if generation_config is not None:
        raw = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
        (folder / 'generation_config.json').write_text(raw)
    return folder


def test_from_checkpoint(toks, tmp_path):
    to = TextOutput.from_checkpoint(smollm2_checkpoint(), tokenizer=toks['smollm2'])
    assert to.stop_token_ids == {2} and to.detokenizer.mode == 'byte_level'
    assert TextOutput.from_checkpoint(smollm2_checkpoint()).stop_token_ids == {2}  # loads the tokenizer itself
    mistral = TextOutput.from_checkpoint(
        _checkpoint(tmp_path / 'm', {'eos_token_id': 2}, tokenizer_folder('mistral-v1'))
    )
    assert mistral.detokenizer.mode == 'sentencepiece' and mistral.stop_token_ids == {2}
    # Llama-3-style list; Qwen's vocabulary (151646 ids) holds both ids, and its tokenizer's eos is <|endoftext|> 151643
    qwen = toks['qwen']

    def stops(name, cfg):
        return TextOutput.from_checkpoint(_checkpoint(tmp_path / name, cfg), tokenizer=qwen).stop_token_ids

    assert stops('a', {'eos_token_id': [128001, 128009]}) == {128001, 128009, 151643}
    assert stops('b', {'eos_token_id': 151645, 'bos_token_id': 151643}) == {151645, 151643}
    assert stops('c', None) == {151643} and stops('d', {'eos_token_id': None}) == {151643}
    for k, (cfg, msg) in enumerate(
        [
            ({'eos_token_id': 'x'}, 'eos_token_id must be an int'),
            ({'eos_token_id': [2, None]}, 'eos_token_id must be an int'),
            ({'eos_token_id': True}, 'eos_token_id must be an int'),
            ({'eos_token_id': 10**9}, 'eos_token_id is 1000000000, outside .*vocabulary size 151646'),
            ('{not json', 'generation_config.json: not valid JSON'),
            ('[1, 2]', 'generation_config.json: holds a JSON array, expected an object'),
        ]
    ):
        with pytest.raises(ValueError, match=msg) as e:
            stops(f'bad{k}', cfg)
        assert 'generation_config.json' in str(e.value)
    with pytest.raises(ValueError, match='no tokenizer loads from'):
        TextOutput.from_checkpoint(tmp_path / 'missing')


def test_pickle_round_trip(toks):
    to = TextOutput(TextChunkDetokenizer(toks['gpt2']), frozenset({50256}))
    ids = toks['gpt2'].encode('你好 pickle', add_special_tokens=False)
    back = pickle.loads(pickle.dumps(to))
    assert back.stop_token_ids == to.stop_token_ids and back.output_bytes(torch.tensor(ids)) == to.output_bytes(
        torch.tensor(ids)
    )
    assert back.detokenizer.token_bytes(ids[0]) == to.detokenizer.token_bytes(ids[0])


# ---------------------------------------------------------------- every decoder family, on real vocabularies
# Each family: how to build the tokenizer, the mode TextChunkDetokenizer must choose, and the edge rule its
# documentation states: 'lead' (decode lacks one leading space: Strip after Fuse, Metaspace first/always,
# WordPiece, no decoder), 'trail' (decode lacks one trailing space: an end-of-word suffix) or 'exact'.
# The reference is `tokenizer.decode`, except where the notebook says the vocabulary wins over the decoder
# (byte_fallback declared, a decoder without a ByteFallback step): there the same decoder with ByteFallback put first.
# With no decoder at all, decode itself is the reference: the notebook says the chunks follow it.


def _unigram_metaspace():
    "T5-style: a Unigram vocabulary with a Metaspace decoder (prepend_scheme always) and byte fallback in the model."
    tok = _unigram_tokenizer()
    return redecorated(
        tok,
        normalizer=None,
        pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme='always'),
        decoder=decoders.Metaspace(prepend_scheme='always'),
    )


FAMILIES = {  # name: (build, mode, edge)
    'gpt2': (lambda: load('gpt2'), 'byte_level', 'exact'),
    'whisper-multilingual': (lambda: load('whisper-multilingual'), 'byte_level', 'exact'),
    'qwen': (lambda: load('qwen'), 'byte_level', 'exact'),
    'smollm2': (lambda: load('smollm2'), 'byte_level', 'exact'),
    'mistral-v1': (lambda: load('mistral-v1'), 'sentencepiece', 'lead'),
    'mistral-v3': (lambda: load('mistral-v3'), 'sentencepiece', 'lead'),
    'minilm': (lambda: AutoTokenizer.from_pretrained(minilm_checkpoint()), 'wordpiece', 'lead'),
    'clip': (lambda: AutoTokenizer.from_pretrained(clip_tokenizer_folder()), 'bpe_suffix', 'trail'),
    # re-decorated: a real vocabulary with the decoder another conversion writes
    'metaspace-first': (lambda: metaspace_tokenizer('first'), 'metaspace', 'lead'),
    'metaspace-always': (lambda: metaspace_tokenizer('always'), 'metaspace', 'lead'),
    'metaspace-never': (lambda: metaspace_tokenizer('never'), 'metaspace', 'exact'),
    'metaspace-v1': (lambda: metaspace_tokenizer('first', 'mistral-v1'), 'metaspace', 'lead'),
    'wordpiece-no-cleanup': (
        lambda: redecorated(
            AutoTokenizer.from_pretrained(minilm_checkpoint()), decoder=decoders.WordPiece(cleanup=False)
        ),
        'wordpiece',
        'lead',
    ),
    'bpe-suffix': (
        lambda: redecorated(
            AutoTokenizer.from_pretrained(clip_tokenizer_folder()), decoder=decoders.BPEDecoder(suffix='</w>')
        ),
        'bpe_suffix',
        'trail',
    ),
    'byte-fallback-unigram': (lambda: _unigram_tokenizer(), 'sentencepiece', 'lead'),
    'metaspace-unigram': (_unigram_metaspace, 'metaspace', 'lead'),
    'no-decoder': (
        lambda: redecorated(AutoTokenizer.from_pretrained(minilm_checkpoint()), decoder=None),
        'joined',
        'lead',
    ),
    # no decoder over a byte_fallback vocabulary, and over one with an end-of-word suffix: decode joins the raw pieces
    # with spaces
    'no-decoder-byte-fallback': (lambda: redecorated(load('mistral-v1'), decoder=None), 'joined', 'lead'),
    'no-decoder-suffix': (
        lambda: redecorated(AutoTokenizer.from_pretrained(clip_tokenizer_folder()), decoder=None),
        'joined',
        'lead',
    ),
    # an empty Sequence joins the pieces as they are; the vocabulary's byte_fallback applies
    'empty-sequence': (
        lambda: redecorated(load('mistral-v1'), decoder=decoders.Sequence([])),
        'sentencepiece',
        'exact',
    ),
    # ByteLevel inside a Sequence, as tokenizer-training scripts write it
    'sequence-byte-level': (
        lambda: redecorated(load('gpt2'), decoder=decoders.Sequence([decoders.ByteLevel()])),
        'byte_level',
        'exact',
    ),
    'byte-level-fuse': (
        lambda: redecorated(load('qwen'), decoder=decoders.Sequence([decoders.ByteLevel(), decoders.Fuse()])),
        'byte_level',
        'exact',
    ),
    'byte-level-strip': (
        lambda: redecorated(
            load('smollm2'), decoder=decoders.Sequence([decoders.ByteLevel(), decoders.Strip(' ', 1, 0)])
        ),
        'byte_level',
        'lead',
    ),
    'byte-level-replace-1-byte': (
        lambda: redecorated(
            load('gpt2'), decoder=decoders.Sequence([decoders.ByteLevel(), decoders.Replace('\n', ' ')])
        ),
        'byte_level',
        'exact',
    ),
    # a one-byte Replace after ByteFallback and the join streams
    'byte-fallback-replace-1-byte': (
        lambda: redecorated(
            load('mistral-v3'),
            decoder=decoders.Sequence(
                [decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse(), decoders.Replace(' ', '_')]
            ),
        ),
        'sentencepiece',
        'exact',
    ),
}


@functools.cache
def family(name):
    "(tokenizer, reference tokenizer, TextChunkDetokenizer) for FAMILIES[name], built once."
    tok = FAMILIES[name][0]()
    ref, tj = tok, json.loads(tok.backend_tokenizer.to_str())
    steps = json.dumps(tj.get('decoder'))
    if (
        tj['model'].get('byte_fallback') and tj.get('decoder') is not None and '"ByteFallback"' not in steps
    ):  # the vocabulary wins: see the notebook
        ref = _Backend(
            tok.backend_tokenizer, decoders.Sequence([decoders.ByteFallback(), tok.backend_tokenizer.decoder])
        )
    return tok, ref, TextChunkDetokenizer(tok)


class _Backend:
    """A copy of a tokenizers.Tokenizer with another decoder, decoding as transformers does (special tokens kept by
    default)."""

    def __init__(self, backend, decoder):
        from tokenizers import Tokenizer

        self.tk = Tokenizer.from_str(backend.to_str())
        self.tk.decoder = decoder

    def decode(self, ids, skip_special_tokens=False):
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)


def edge_trim(s: str, edge: str) -> str:
    "What decode gives for a reply whose streamed text is `s`, when the reply opens and closes with ordinary words."
    if edge == 'lead':
        return s[1:] if s.startswith(' ') else s
    if edge == 'trail':
        return s[:-1] if s.endswith(' ') else s
    return s


def bare_rule(det, tok, ids, edge, mode) -> bytes:
    "The documented edge rule on the bare ids: what decode(ids) must be, from the streamed bytes."
    if not ids:
        return b''
    first, rest = det.token_bytes(ids[0]), det.to_bytes(ids[1:])
    if mode == 'metaspace' and edge == 'lead':
        return first.replace(b' ', b'') + rest  # every ▁ of the first token dropped
    if mode in ('wordpiece', 'joined'):
        return tok.decode([ids[0]]).encode() + rest  # the first token as decode writes it alone
    return edge_trim(det.to_bytes(ids).decode(), edge).encode()


@pytest.mark.parametrize('name', list(FAMILIES))
def test_decoder_family_corpus(name):
    tok, ref, det = family(name)
    _, mode, edge = FAMILIES[name]
    assert det.mode == mode, (det.mode, det.reason)
    assert (edge == 'exact') == (det.edges == ()), det.edges
    a, b = tok.encode('hello', add_special_tokens=False)[:1], tok.encode('world', add_special_tokens=False)[-1:]
    rng, partial, lead = random.Random(name), 0, 0
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        # in the middle of a reply: byte-exact
        whole = [*a, *ids, *b]
        ours = det.to_bytes(whole).decode()
        assert edge_trim(ours, edge) == ref.decode(whole), (name, text, ours)
        assert det.to_bytes(whole) == b''.join(det.token_bytes(i) for i in whole)
        # a bare reply: the documented rule at its edges
        try:
            want = ref.decode(ids).encode()
        except Exception:
            continue
        if '\ufffd' not in ref.decode(ids):
            assert bare_rule(det, ref, ids, edge, mode=mode) == want, (name, text)
        lead += det.to_bytes(ids) != want
        partial += check_stream(det, ids, rng, det.to_bytes(ids).decode(), rounds=1)
    assert edge == 'exact' or lead > 50, lead  # the edge rule is really exercised
    # and characters really split across chunks, where the vocabulary has byte pieces (WordPiece has none; a BPEDecoder
    # alone leaves CLIP's byte-map characters as they are, as decode does)
    assert (
        name
        in (
            'minilm',
            'wordpiece-no-cleanup',
            'no-decoder',
            'bpe-suffix',
            'no-decoder-byte-fallback',
            'no-decoder-suffix',
        )
        or partial > 0
    )


def test_metaspace_per_step_decode_loses_the_spaces():
    "The handed fault: per-token decode of a Metaspace tokenizer strips every word's space; the chunks keep them."
    tok, _, det = family('metaspace-first')
    ids = tok.encode("Hello! I'm an AI language model", add_special_tokens=False)
    assert ''.join(tok.decode([i]) for i in ids) == "Hello!I'manAIlanguagemodel"
    assert (
        b''.join(det.token_bytes(i) for i in ids).decode()
        == ' ' + tok.decode(ids)
        == " Hello! I'm an AI language model"
    )


def test_vocabulary_wins_over_decoder():
    """byte_fallback in the model but no ByteFallback step: decode shows <0xNN>, the stream the character; without
    the model's flag, the decoder wins."""
    tok, ref, det = family('metaspace-first')
    ids = tok.encode('爿', add_special_tokens=False)
    assert '<0xE7>' in tok.decode(ids) and det.to_bytes(ids).decode().strip() == '爿' == ref.decode(ids).strip()
    assert 'byte_fallback' in det.reason
    tj = json.loads(tok.backend_tokenizer.to_str())
    tj['model']['byte_fallback'] = False
    literal = TextChunkDetokenizer(redecorated(tok, model=tj['model']))
    assert literal.to_bytes(ids).decode() == ' ' + tok.decode(ids) and 'byte_fallback' not in literal.reason
    # CLIP: a ByteLevel decoder over a vocabulary that ends words with </w>
    clip = family('clip')[0]
    assert not ByteLevelDetokenizer.is_byte_level(clip) and "'</w>'" in family('clip')[2].reason
    with pytest.raises(ValueError, match='end_of_word_suffix'):
        ByteLevelDetokenizer(clip)


@pytest.mark.parametrize('name', ['minilm', 'metaspace-first', 'mistral-v3', 'clip', 'smollm2'])
def test_keep_special_false_matches_skip_special_tokens(name):
    tok, ref, _ = family(name)
    det = TextChunkDetokenizer(tok, keep_special=False)
    specials = sorted(det.special_ids)
    assert specials
    a, b = tok.encode('hello', add_special_tokens=False)[:1], tok.encode('world', add_special_tokens=False)[-1:]
    for text in CORPUS[::9]:
        whole = [specials[0], *a, *tok.encode(text, add_special_tokens=False), *b, specials[-1]]
        assert edge_trim(det.to_bytes(whole).decode(), FAMILIES[name][2]) == ref.decode(
            whole, skip_special_tokens=True
        ), text
    extra = TextChunkDetokenizer(tok, extra_skip_ids={a[0]})
    assert extra.token_bytes(a[0]) == b'' and extra.token_bytes(specials[0]) == TextChunkDetokenizer(tok).token_bytes(
        specials[0]
    )


@pytest.mark.parametrize(
    'name',
    [
        'minilm',
        'wordpiece-no-cleanup',
        'bpe-suffix',
        'clip',
        'metaspace-never',
        'no-decoder',
        'no-decoder-byte-fallback',
        'no-decoder-suffix',
        'empty-sequence',
        'sequence-byte-level',
        'byte-level-fuse',
        'byte-level-replace-1-byte',
        'byte-fallback-replace-1-byte',
    ],
)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_decoder_family_random_ids(name, data):
    """Any ids between two ordinary words: the stream is decode's text, up to the edge rule, wherever decode's text
    is valid UTF-8."""
    tok, ref, det = family(name)
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=25))
    a, b = tok.encode('hello', add_special_tokens=False)[:1], tok.encode('world', add_special_tokens=False)[-1:]
    whole = [*a, *ids, *b]
    got = det.to_bytes(whole)
    assert b''.join(det.to_bytes(c) for c in random_split(whole, random.Random(len(ids)))) == got
    try:
        ours = got.decode()
    except UnicodeDecodeError:
        assert '\ufffd' in ref.decode(whole)
        # ByteLevel decodes its joined bytes with from_utf8_lossy, which substitutes maximal subparts as Python's
        # 'replace' does
        if det.mode == 'byte_level':
            assert edge_trim(got.decode('utf-8', 'replace'), FAMILIES[name][2]) == ref.decode(whole)
        return
    assert edge_trim(ours, FAMILIES[name][2]) == ref.decode(whole)


# ---------------------------------------------------------------- a reply ends at its first stop token, even mid-step
def test_handed_multi_token_step(toks):
    smol = toks['smollm2']
    to = TextOutput.from_checkpoint(smollm2_checkpoint(), tokenizer=smol)
    step = smol.encode(' Paris.<|im_end|><|im_start|>user\nWhat', add_special_tokens=False)
    assert smol.convert_ids_to_tokens(step) == ['ĠParis', '.', '<|im_end|>', '<|im_start|>', 'user', 'Ċ', 'What']
    for out in (torch.tensor(step), torch.tensor([step]), step, tuple(step), np.array(step)):
        assert to.step_bytes(out) == b' Paris.' and to.output_bytes(out) == b' Paris.'
        assert to.step_bytes(out, {'ignore_eos': True}) == smol.decode(step).encode()
    # later steps: a TextStream remembers that the reply ended
    s = to.stream()
    assert [s.step(torch.tensor(step[:1])), s.step(torch.tensor(step[1:4])), s.step(torch.tensor(step[4:]))] == [
        b' Paris',
        b'.',
        b'',
    ]
    assert s.ended and s.step(torch.tensor([smol.encode('x')[0]])) == b''
    s = TextStream(to, {'ignore_eos': True})
    assert b''.join(s.step(torch.tensor([i])) for i in step) == smol.decode(step).encode() and not s.ended


def _one_token_steps_agree(to, fn, general, ids):
    "Every id as a one-token step, in each shape and integer dtype, with each kind of kwargs, cold then warm."
    for _ in range(2):  # cold, then warm
        for i in ids:
            for kw in (None, {}, {'ignore_eos': True}):
                for t in (
                    torch.tensor([i]),
                    torch.tensor(i),
                    torch.tensor([[i]]),
                    torch.tensor([i], dtype=torch.int32),
                ):
                    assert to.step_bytes(t, kw) == general(t, kw), (i, kw, t)
                    assert fn(t, kw) == general(t, kw), ('step_fn', i, kw, t)


def _multi_token_steps_agree(to, fn, general, ids, rng):
    "Steps of 2 and 3 random ids (a stop id anywhere), 1-d and 2-d, cold then warm."
    for _ in range(2):
        for k in (2, 3):
            for _ in range(200):
                step = [rng.choice(ids) for _ in range(k)]
                for t in (torch.tensor(step), torch.tensor([step]), torch.tensor(step, dtype=torch.int32)):
                    for kw in (None, {'ignore_eos': True}):
                        assert to.step_bytes(t, kw) == general(t, kw), (step, kw)
                        assert fn(t, kw) == general(t, kw), ('step_fn', step, kw)


def _bad_steps_raise(f, tok, ids):
    "`f` refuses floats, bools and ids out of range, in steps of several tokens and of one; the empty step gives b''."
    for bad in (
        torch.tensor([1.0, 2.0]),
        torch.tensor([True, False]),
        torch.tensor([ids[1], len(tok)]),
    ):  # ids[1]: no stop id
        with pytest.raises(ValueError):
            f(bad)
    for bad in (
        torch.tensor([1.0]),
        torch.tensor([True]),
        torch.tensor([len(tok)]),
        torch.tensor([-1]),
        torch.tensor([-1, 5, 6]),
    ):
        with pytest.raises(ValueError):
            f(bad)
    assert f(torch.tensor([], dtype=torch.long)) == b''


def _other_stop_sets_agree(to, other, tok, ids):
    "More stop ids, none, and a stop set that is no set: the short cut's stop checks, against the general path."
    for stops in (frozenset({tok.eos_token_id, ids[1], ids[-1]}), frozenset(), [tok.eos_token_id]):
        s_to = TextOutput(to.detokenizer, stops)
        s_fn = s_to.step_fn()
        for step in [[i] for i in ids[:50]] + [ids[j : j + k] for k in (2, 3, 5) for j in range(0, len(ids), 7)]:
            for kw in (None, {'ignore_eos': True}):
                want = b''.join(map(other.token_bytes, drop_stop_tokens(step, stops, kw)))
                assert s_fn(torch.tensor(step), kw) == s_to.step_bytes(torch.tensor(step), kw) == want, (
                    stops,
                    step,
                    kw,
                )


@pytest.mark.parametrize('name', ['smollm2', 'qwen', 'mistral-v3'])
def test_hot_step_path_agrees_with_general_path(toks, name):
    "The memo's short cut in step_bytes gives the general path's bytes, cold and warm, stop ids included."
    tok = toks[name]
    to = TextOutput(TextChunkDetokenizer(tok), frozenset({tok.eos_token_id}))
    other = TextChunkDetokenizer(tok)  # the general path, spelled out on a memo of its own
    fn = to.step_fn()  # the decode loop's function: the same short cut over the same memo

    def general(t, kw):
        return b''.join(map(other.token_bytes, drop_stop_tokens(t, to.stop_token_ids, kw)))

    ids = sorted({i for t in CORPUS[::3] for i in tok.encode(t, add_special_tokens=False)} | {tok.eos_token_id})
    _one_token_steps_agree(to, fn, general, ids)
    assert to.step_bytes(torch.tensor([tok.eos_token_id])) == b''
    # multi-token steps (speculative, MTP): 2 and 3 tokens, a stop id anywhere, cold then warm, 1-d and 2-d
    _multi_token_steps_agree(to, fn, general, ids, rng=random.Random(name))
    for f in (to.step_bytes, fn):
        _bad_steps_raise(f, tok, ids)
    # more stop ids, none, and a stop set that is no set: the short cut's stop checks, against the general path
    _other_stop_sets_agree(to, other, tok, ids)
    # copies give the same bytes: _replace, pickle
    for copy in (to._replace(stop_token_ids=frozenset()), pickle.loads(pickle.dumps(to))):
        j = next(i for i in ids if i != tok.eos_token_id)
        assert type(copy) is TextOutput and copy.step_bytes(torch.tensor([j])) == to.step_bytes(torch.tensor([j]))
    assert to._replace(stop_token_ids=frozenset()).step_bytes(torch.tensor([tok.eos_token_id])) == TextChunkDetokenizer(
        tok
    ).token_bytes(tok.eos_token_id)


def test_from_checkpoint_keep_special(toks, tmp_path):
    smol = toks['smollm2']
    chat = smol.encode('<|im_start|>assistant\nBonjour<|im_end|><|endoftext|>', add_special_tokens=False)
    kept = TextOutput.from_checkpoint(smollm2_checkpoint(), tokenizer=smol)
    plain = TextOutput.from_checkpoint(smollm2_checkpoint(), tokenizer=smol, keep_special=False)
    assert kept.output_bytes(chat, {'ignore_eos': True}).decode() == smol.decode(chat)
    assert plain.output_bytes(chat, {'ignore_eos': True}).decode() == smol.decode(chat, skip_special_tokens=True)
    assert plain.detokenizer.special_ids >= set(chat) - set(smol.encode('assistant\nBonjour', add_special_tokens=False))
    # a base model's <s> (Mistral) is special in tokenizer.json: dropped with keep_special=False
    folder = _checkpoint(tmp_path / 'm', {'eos_token_id': 2}, tokenizer_folder('mistral-v1'))
    m = toks['mistral-v1']
    ids = [m.bos_token_id, *m.encode('Hi there', add_special_tokens=False)]
    assert TextOutput.from_checkpoint(folder).output_bytes(ids).startswith(b'<s>')
    assert TextOutput.from_checkpoint(folder, keep_special=False).output_bytes(ids) == b' Hi there'
    skip = TextOutput.from_checkpoint(folder, extra_skip_ids=[ids[1]])
    assert skip.output_bytes(ids) == b'<s>' + skip.detokenizer.to_bytes(ids[2:])


# ---------------------------------------------------------------- ByteLevel inside a decoder Sequence
def test_sequence_with_byte_level_streams_or_says_why():
    """Every chain with a ByteLevel step builds and gives decode's text: byte-level modes per token, the others
    through per-token decode."""
    gpt2 = load('gpt2')
    # one ByteLevel step in a Sequence is the plain byte-level decoder: is_byte_level holds and ByteLevelDetokenizer
    # takes it
    seq = family('sequence-byte-level')[0]
    assert ByteLevelDetokenizer.is_byte_level(seq)
    ids = seq.encode('Hello 你好 world<|endoftext|>', add_special_tokens=False)
    assert ByteLevelDetokenizer(seq, keep_special=True).to_bytes(ids).decode() == seq.decode(ids)
    assert TextOutput(TextChunkDetokenizer(seq)).step_bytes(ids[:1]) == gpt2.decode(ids[:1]).encode()
    # a multi-byte Replace after ByteLevel can straddle two tokens, counted in bytes: per-token decode, and the reason
    # says so
    chains = {
        '▁ after ByteLevel': [decoders.ByteLevel(), decoders.Replace('▁', ' ')],
        'é after ByteLevel': [decoders.ByteLevel(), decoders.Replace('é', 'e')],
        'ab after ByteLevel': [decoders.ByteLevel(), decoders.Replace('ab', 'x')],
    }
    for name, chain in chains.items():
        tok = redecorated(gpt2, decoder=decoders.Sequence(chain))
        det = TextChunkDetokenizer(tok)
        assert det.mode == 'decode' and 'comes after its ByteLevel step' in det.reason and 'bytes)' in det.reason, (
            name,
            det.reason,
        )
        for text in CORPUS[::11] + ['x ▁ y', 'café é', 'abab']:
            ids = tok.encode(text, add_special_tokens=False)
            assert det.to_bytes(ids) == tok.decode(ids).encode(), (name, text)
            assert [det.token_bytes(i) for i in ids] == [tok.decode([i]).encode() for i in ids]
    # the split really happens: gpt2 spells ▁ (e2 96 81) in two tokens, and decode replaces it across them
    tok = redecorated(gpt2, decoder=decoders.Sequence(chains['▁ after ByteLevel']))
    ids = tok.encode('a▁b', add_special_tokens=False)
    assert len(ids) > 3 and tok.decode(ids) == 'a b'


def test_multi_byte_match_after_byte_fallback_falls_back():
    """ByteFallback turns a run of byte pieces into one token in decode: a later multi-byte match or a per-token
    Strip is refused."""
    m = load('mistral-v1')
    for chain, why in [
        (
            [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace('▁', ' ')],
            "Replace of '▁' (3 bytes) comes after its ByteFallback step",
        ),
        (
            [decoders.ByteFallback(), decoders.Replace('▁', ' '), decoders.Fuse()],
            "Replace of '▁' (3 bytes) comes after its ByteFallback step",
        ),
        ([decoders.ByteFallback(), decoders.Metaspace()], "Metaspace of '▁' (3 bytes)"),
        (
            [decoders.ByteFallback(), decoders.Strip(' ', 1, 0), decoders.Fuse()],
            'Strip step strips each token after its ByteFallback step',
        ),
    ]:
        tok = redecorated(m, decoder=decoders.Sequence(chain))
        det = TextChunkDetokenizer(tok)
        assert det.mode == 'decode' and why in det.reason, det.reason
        # ▁ spelled in byte pieces: decode joins them and replaces the character; per-token decode is the honest
        # fallback
        ids = m.convert_tokens_to_ids(['▁Hello', '<0xE2>', '<0x96>', '<0x81>', 'world'])
        assert det.to_bytes(ids) == tok.decode(ids).encode()


def test_added_tokens_under_byte_level_chains():
    """An added token is its content under any chain with ByteLevel: the steps after the join still apply to it, the
    byte map does not."""
    q = AutoTokenizer.from_pretrained(tokenizer_folder('qwen'))
    q.add_tokens(['<tool_call>\n', 'a\nb'])
    tok = redecorated(q, decoder=decoders.Sequence([decoders.ByteLevel(), decoders.Replace('\n', ' ')]))
    det = TextChunkDetokenizer(tok)
    assert det.mode == 'byte_level' and det.edges == ()
    ids = tok.encode('x<tool_call>\n{"a": 1}a\nb 你好<|im_end|>', add_special_tokens=False)
    assert tok.convert_tokens_to_ids('a\nb') in ids
    assert det.to_bytes(ids).decode() == tok.decode(ids)
    assert (
        det.token_bytes(tok.convert_tokens_to_ids('a\nb'))
        == tok.decode([tok.convert_tokens_to_ids('a\nb')]).encode()
        == b'a b'
    )


# ---------------------------------------------------------------- added tokens with normalized=True
def _llama2_style(name):
    """`name`'s SentencePiece vocabulary with Llama 2's normalizer (Prepend('▁'), Replace(' ', '▁')), and tokens
    added as fine-tunes add them."""
    from tokenizers import AddedToken, normalizers

    tok = redecorated(
        load(name), normalizer=normalizers.Sequence([normalizers.Prepend('▁'), normalizers.Replace(' ', '▁')])
    )
    tok.add_tokens(
        ['<tool>', 'Deniz', ' sp', 'a b', '▁x▁', '<0x41>', AddedToken('<raw>', normalized=False)]
    )  # add_tokens: normalized=True
    tok.add_special_tokens({'additional_special_tokens': [AddedToken('<|sep|>', special=True)]})
    return tok


def _mistral_added():
    """Mistral v1's own tokenizer.json (normalizer Replace(' ', '▁') and a leading ▁ doubled) with tokens added by
    add_tokens."""
    tok = AutoTokenizer.from_pretrained(tokenizer_folder('mistral-v1'))
    tok.add_tokens(['▁x▁', ' sp', 'Deniz', '<0x41>', '<0xE7>', '<tool>'])
    return tok


NORMALIZED = {
    'llama2-v1': functools.cache(lambda: _llama2_style('mistral-v1')),
    'llama2-v3': functools.cache(lambda: _llama2_style('mistral-v3')),
    'mistral-v1-added': functools.cache(_mistral_added),
}


def _with_added(tok, text, rng):
    "`text`'s ids with added tokens dropped in at random places, none inside a character's run of byte pieces."

    def byte(i):
        return re.fullmatch(r'<0x[0-9A-F]{2}>', tok.convert_ids_to_tokens(i) or '') is not None

    ids, added = (
        tok.encode(text, add_special_tokens=False),
        [i for i in sorted(tok.added_tokens_decoder) if not byte(i)],
    )
    for _ in range(rng.randint(1, 3)):
        places = [k for k in range(len(ids) + 1) if not (0 < k < len(ids) and byte(ids[k - 1]) and byte(ids[k]))]
        ids.insert(rng.choice(places), rng.choice(added))
    return ids


@pytest.mark.parametrize('name', list(NORMALIZED))
def test_normalized_added_tokens_corpus(name):
    """decode reads a normalized added token's normalized content (id_to_token); both SentencePiece paths stream it,
    up to the one leading space."""
    tok = NORMALIZED[name]()
    backend = tok.backend_tokenizer
    assert any(
        backend.id_to_token(i) != t.content for i, t in backend.get_added_tokens_decoder().items()
    )  # normalization really changes some
    chunk, sp = TextChunkDetokenizer(tok), SentencePieceDetokenizer(json.loads(backend.to_str()))
    plain = TextChunkDetokenizer(tok, keep_special=False)
    rng = random.Random(name)
    for text in CORPUS[::3] + ['Arthur met Deniz today and called <tool> twice', 'x a b y']:
        ids = _with_added(tok, text, rng)
        assert strip1(chunk.to_bytes(ids).decode()) == tok.decode(ids), (text, tok.convert_ids_to_tokens(ids))
        assert strip1(plain.to_bytes(ids).decode()) == tok.decode(ids, skip_special_tokens=True), text
        assert strip1(sp.to_bytes(ids).decode()) == tok.decode(ids, skip_special_tokens=True), text
        assert b''.join(map(chunk.token_bytes, ids)) == chunk.to_bytes(ids)
    # the handed case: every added word keeps its space
    ids = tok.encode('Arthur met Deniz today and called <tool> twice', add_special_tokens=False)
    assert tok.convert_tokens_to_ids('Deniz') in ids and strip1(sp.to_bytes(ids).decode()) == tok.decode(ids)


def test_normalized_special_token():
    """A special token added with normalized=True decodes from its normalized content too, when kept. (tokenizers'
    skip_special_tokens looks it up by that content and misses it; keep_special=False drops it by its flag, as the
    notebook says.)"""
    from tokenizers import AddedToken

    tok = _llama2_style('mistral-v1')
    tok.add_special_tokens({'additional_special_tokens': [AddedToken('<|nsep|>', normalized=True, special=True)]})
    nsep = tok.convert_tokens_to_ids('<|nsep|>')
    ids = [*tok.encode('Hello', add_special_tokens=False), nsep, *tok.encode('world', add_special_tokens=False)]
    assert (
        strip1(TextChunkDetokenizer(tok).to_bytes(ids).decode()) == tok.decode(ids) and tok.decode(ids).count(' ') == 2
    )
    assert TextChunkDetokenizer(tok, keep_special=False).token_bytes(nsep) == b''


@pytest.mark.parametrize('name', list(NORMALIZED))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_normalized_added_tokens_random_ids(name, data):
    tok = NORMALIZED[name]()
    byte_ids = tok.convert_tokens_to_ids([f'<0x{b:02X}>' for b in range(256)])
    ids = data.draw(_ids_strategy(tok, byte_ids))
    chunk, sp = _chunk(tok), _sp(tok)
    for det, want in ((chunk, tok.decode(ids)), (sp, tok.decode(ids, skip_special_tokens=True))):
        got = det.to_bytes(ids)
        try:
            text = got.decode()
        except UnicodeDecodeError:
            assert '\ufffd' in want  # ByteFallback writes an invalid run as U+FFFD per byte
        else:
            assert strip1(text) == want, (tok.convert_ids_to_tokens(ids), text, want)


def _sp(tok):
    key = ('sp', id(tok))
    if key not in _DETS:
        _DETS[key] = SentencePieceDetokenizer(json.loads(tok.backend_tokenizer.to_str()))
    return _DETS[key]


def test_normalized_added_tokens_byte_level():
    "Byte-level: an added token is text, and the text is its normalized content, as decode gives it."
    from tokenizers import normalizers

    for name in ('gpt2', 'smollm2'):
        tok = redecorated(load(name), normalizer=normalizers.Lowercase())
        tok.add_tokens(['<TOOL>', 'NOW'])
        ids = tok.encode('Call <TOOL> NOW, Über', add_special_tokens=False)
        tool = tok.convert_tokens_to_ids('<TOOL>')
        assert tool in ids and tok.backend_tokenizer.id_to_token(tool) == '<tool>'
        for det in (ByteLevelDetokenizer(tok), TextChunkDetokenizer(tok)):
            assert det.token_bytes(tool) == tok.decode([tool]).encode() == b'<tool>'
            assert det.to_bytes(ids).decode() == tok.decode(ids) == 'call <tool> now, über'


def test_sentencepiece_normalizer_errors():
    """A normalizer HF tokenizers cannot read is named, when an added token needs it; a file without normalized added
    tokens doesn't need it."""
    tj = json.loads(_mistral_added().backend_tokenizer.to_str())
    tj['normalizer'] = {'type': 'NoSuchNormalizer'}
    with pytest.raises(ValueError, match="tokenizer.json 'normalizer' is not one HF tokenizers reads"):
        SentencePieceDetokenizer(tj)
    tj['added_tokens'] = [t for t in tj['added_tokens'] if t['special']]
    ids = load('mistral-v1').encode('Hello world', add_special_tokens=False)
    assert strip1(SentencePieceDetokenizer(tj).to_bytes(ids).decode()) == load('mistral-v1').decode(ids)


# ---------------------------------------------------------------- Whisper's timestamp tokens
@functools.cache
def _whisper():
    from mstar_utils.checkpoints import whisper_checkpoint

    return AutoTokenizer.from_pretrained(whisper_checkpoint('tiny.en'))


def test_whisper_timestamps_follow_decode():
    """decode deletes timestamps with or without specials; so do both detokenizers by default, and keep_timestamps
    gives decode_with_timestamps."""
    from transformers import WhisperTokenizer

    tok = _whisper()
    assert isinstance(tok, WhisperTokenizer)
    ts = tok.timestamp_ids()  # transformers' own list, <|0.00|> ... <|30.00|>
    words = tok.encode(' And so my fellow Americans, ask not', add_special_tokens=False)
    ids = tok.convert_tokens_to_ids(['<|startoftranscript|>', '<|en|>', '<|transcribe|>']) + [
        ts[0],
        *words[:4],
        ts[100],
        ts[100],
        *words[4:],
        ts[250],
        tok.eos_token_id,
    ]
    bl, bl_kept = ByteLevelDetokenizer(tok), ByteLevelDetokenizer(tok, keep_special=True)
    assert ByteLevelDetokenizer.is_byte_level(tok) and bl.timestamp_ids == frozenset(ts)
    assert bl.to_bytes(ids).decode() == tok.decode(ids, skip_special_tokens=True)
    assert bl_kept.to_bytes(ids).decode() == tok.decode(ids)
    chunk, plain = TextChunkDetokenizer(tok), TextChunkDetokenizer(tok, keep_special=False)
    assert chunk.to_bytes(ids).decode() == tok.decode(ids) and 'timestamp' in chunk.reason
    assert plain.to_bytes(ids).decode() == tok.decode(ids, skip_special_tokens=True)
    # asked for: the timestamps' text, as decode_with_timestamps writes a reply within one window
    for det in (
        ByteLevelDetokenizer(tok, keep_timestamps=True),
        TextChunkDetokenizer(tok, keep_special=False, keep_timestamps=True),
    ):
        assert det.to_bytes(ids).decode() == tok.decode(ids, skip_special_tokens=True, decode_with_timestamps=True)
    assert TextChunkDetokenizer(tok, keep_timestamps=True).to_bytes(ids).decode() == tok.decode(
        ids, decode_with_timestamps=True
    )
    # pickling keeps the choice
    back = pickle.loads(pickle.dumps(TextChunkDetokenizer(tok, keep_timestamps=True)))
    assert back.keep_timestamps and back.token_bytes(ts[0]) == b'<|0.00|>'


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_whisper_random_ids(data):
    """Any ids, timestamps and specials among them: the joined bytes are decode's text (U+FFFD where a character is
    cut short)."""
    tok = _whisper()
    ts, specials = tok.timestamp_ids(), sorted(i for i in tok.added_tokens_decoder if i < tok.timestamp_ids()[0])
    ids = data.draw(
        st.lists(st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(ts), st.sampled_from(specials)), max_size=30)
    )
    # decode(skip_special_tokens=True) drops a previous-text prompt that opens the ids: not a reply's shape (see the
    # notebook)
    assume_not_prompt = not ids or ids[0] != tok.convert_tokens_to_ids('<|startofprev|>')
    for det, skip in ((_byte_level(tok), True), (_byte_level(tok, True), False), (_chunk(tok), False)):
        want = tok.decode(ids, skip_special_tokens=skip)
        if skip and not assume_not_prompt:
            continue
        assert det.to_bytes(ids).decode('utf-8', 'replace') == want, (tok.convert_ids_to_tokens(ids), want)


def test_whisper_from_checkpoint_and_other_tokenizers(tmp_path):
    """from_checkpoint drops timestamps unless asked; a tokenizer without Whisper's decode keeps a '<|1.00|>' token,
    as its decode does."""
    from mstar_utils.checkpoints import whisper_checkpoint

    tok = _whisper()
    ts = tok.timestamp_ids()
    ids = [ts[0], *tok.encode(' Ask not', add_special_tokens=False), ts[50], tok.eos_token_id, ts[60]]
    to = TextOutput.from_checkpoint(whisper_checkpoint('tiny.en'), tokenizer=tok)
    assert to.output_bytes(ids).decode() == tok.decode(ids[:-2]) and to.stop_token_ids == {tok.eos_token_id}
    assert b''.join(to.step_bytes([i]) for i in ids) == tok.decode(ids[:-2]).encode()
    kept = TextOutput.from_checkpoint(whisper_checkpoint('tiny.en'), tokenizer=tok, keep_timestamps=True)
    assert kept.output_bytes(ids).decode() == tok.decode(ids[:-2], decode_with_timestamps=True)
    gpt2 = AutoTokenizer.from_pretrained(tokenizer_folder('gpt2'))
    gpt2.add_tokens(['<|1.00|>'])
    ids = gpt2.encode('at <|1.00|> go', add_special_tokens=False)
    det = TextChunkDetokenizer(gpt2)
    assert det.timestamp_ids == frozenset() and det.to_bytes(ids).decode() == gpt2.decode(ids) == 'at <|1.00|> go'


# ---------------------------------------------------------------- no decoder, and the reason's words
def _no_decoder_byte_fallback():
    """What `Tokenizer(models.BPE(byte_fallback=True))` saves without a decoder: Mistral's pieces, here a few of
    them, in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers as pt

    m = load('mistral-v3')
    keep = ['<unk>', '<s>', '</s>', '▁', '▁the', '▁cat', 'at', '北', '東', *(f'<0x{b:02X}>' for b in range(256))]
    tk = Tokenizer(models.BPE({p: k for k, p in enumerate(keep)}, [], unk_token='<unk>', byte_fallback=True))
    tk.pre_tokenizer = pt.Metaspace(prepend_scheme='first', split=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token='<unk>'), m


def test_no_decoder_with_byte_fallback_follows_decode():
    """decode joins the raw pieces with spaces: the chunks do too, always valid UTF-8, and the mode and reason say
    there is no decoder."""
    tok, _ = _no_decoder_byte_fallback()
    det = TextChunkDetokenizer(tok)
    assert tok.backend_tokenizer.decoder is None
    assert det.mode == 'joined' and det.reason.startswith('it has no decoder') and 'ByteFallback' not in det.reason, (
        det.reason
    )
    for text in ['北東爿', 'the cat 爿 北', '你好', 'x\ny', '']:
        ids = tok.encode(text, add_special_tokens=False)
        assert strip1(det.to_bytes(ids).decode()) == tok.decode(ids), text
    ids = tok.encode('北東爿', add_special_tokens=False)
    assert [det.token_bytes(i) for i in ids[-3:]] == [(' ' + t).encode() for t in tok.convert_ids_to_tokens(ids[-3:])]
    # the real vocabulary, every id: valid UTF-8 and decode's pieces
    fam = family('no-decoder-byte-fallback')
    assert 'its decoder' not in fam[2].reason
    for i in range(0, len(fam[0]), 7):
        assert fam[2].token_bytes(i).decode() == ' ' + fam[0].decode([i])


def test_reason_names_the_decoders_own_steps():
    "A vocabulary rule is a note, never part of 'its decoder (...)'."
    ms = family('metaspace-first')[2]
    assert ms.reason.startswith('its decoder (Metaspace) works token by token') and 'byte_fallback' in ms.reason
    clip = family('clip')[2]
    assert clip.reason.startswith('its decoder (ByteLevel) works') and "'</w>'" in clip.reason
    empty = family('empty-sequence')[2]
    assert empty.reason.startswith('its decoder is an empty Sequence') and 'byte_fallback' in empty.reason


# ---------------------------------------------------------------- the vocabulary bound: largest id + 1, holes allowed
def _holey(decoder):
    """A WordLevel vocabulary with ids 0-9 and 20-29 (a hole of ten), built in-process, as trimmed vocabularies
    number theirs."""
    from tokenizers import Tokenizer, models

    vocab = {c: i for i, c in enumerate('abcdefghij')} | {c: 20 + i for i, c in enumerate('klmnopqrst')}
    tk = Tokenizer(models.WordLevel(vocab, unk_token='a'))
    tk.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token='t')


def _sparse_byte_level():
    "SmolLM2's byte-level pieces for a few texts, numbered 3 apart: a byte-level vocabulary with holes."
    from tokenizers import Tokenizer, models

    smol = load('smollm2')
    pieces = sorted(
        {p for t in CORPUS[:60] for p in smol.convert_ids_to_tokens(smol.encode(t, add_special_tokens=False))}
    )
    tk = Tokenizer(models.WordLevel({p: 3 * k for k, p in enumerate(pieces)}, unk_token=pieces[0]))
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def test_vocabulary_bound_is_largest_id_plus_one(tmp_path):
    tok = _holey(decoders.Fuse())
    assert len(tok) == 20 and tok.decode([25, 29]) == 'pt'
    det = TextChunkDetokenizer(tok)
    assert det.vocab_size == 30 == max(tok.get_vocab().values()) + 1
    for i in range(30):
        assert det.token_bytes(i) == tok.decode([i]).encode(), i  # a hole gives b'', as decode gives ''
    with pytest.raises(
        ValueError, match='token id 30 is outside .* ids run from 0 to 29 .*mask the logits of ids 30 and up'
    ):
        det.token_bytes(30)
    # the stop ids are checked against the same bound
    tok.save_pretrained(tmp_path / 'holey')
    (tmp_path / 'holey' / 'generation_config.json').write_text(json.dumps({'eos_token_id': [29, 15]}))
    to = TextOutput.from_checkpoint(tmp_path / 'holey')
    assert to.stop_token_ids == {29, 15} and to.output_bytes([25, 15, 26]) == tok.decode([25]).encode()
    (tmp_path / 'holey' / 'generation_config.json').write_text(json.dumps({'eos_token_id': 30}))
    with pytest.raises(ValueError, match='generation_config.json: eos_token_id is 30, outside .*ids run from 0 to 29'):
        TextOutput.from_checkpoint(tmp_path / 'holey')
    # byte-level
    sparse = _sparse_byte_level()
    bl = ByteLevelDetokenizer(sparse)
    assert bl.vocab_size == max(sparse.get_vocab().values()) + 1 > len(sparse)
    assert TextChunkDetokenizer(sparse).vocab_size == bl.vocab_size


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_vocabulary_with_holes_random_ids(data):
    for tok in (_holey_fuse(), _sparse_bl()):
        det = _chunk(tok)
        ids = data.draw(
            st.lists(st.integers(0, max(tok.get_vocab().values())), max_size=30)
        )  # every id decode knows, holes and past len(tok)
        assert det.to_bytes(ids).decode('utf-8', 'replace') == tok.decode(ids)
        if isinstance(tok.backend_tokenizer.decoder, decoders.ByteLevel):
            assert _byte_level(tok).to_bytes(ids).decode('utf-8', 'replace') == tok.decode(ids)


_holey_fuse, _sparse_bl = functools.cache(lambda: _holey(decoders.Fuse())), functools.cache(_sparse_byte_level)


def test_padded_embedding_ids_raise_clearly(toks):
    """Ids between the tokenizer's last id and a padded embedding: decode gives '' for them, the detokenizers refuse
    them with what to fix."""
    qwen = toks['qwen']
    assert qwen.decode([len(qwen)]) == ''
    for det in (TextChunkDetokenizer(qwen), ByteLevelDetokenizer(qwen)):
        for i in (len(qwen), len(qwen) + 289):
            with pytest.raises(
                ValueError, match=f'token id {i} is outside .*mask the logits of ids {len(qwen)} and up'
            ):
                det.token_bytes(i)
    with pytest.raises(ValueError) as e:
        TextChunkDetokenizer(qwen).token_bytes(-1)
    assert 'mask the logits' not in str(e.value)


def test_slow_tokenizer_bound(tmp_path):
    slow = _gpt2_slow(tmp_path, clean_up_tokenization_spaces=False)
    assert ByteLevelDetokenizer(slow).vocab_size == max(slow.get_vocab().values()) + 1 == len(slow)


# ------------------------------------------------ SentencePieceDetokenizer: byte-level files refused, added byte pieces
@pytest.mark.parametrize('name', ['gpt2', 'qwen', 'whisper-multilingual', 'smollm2', 'clip', 'sequence-byte-level'])
def test_sentencepiece_refuses_byte_level_json(name):
    tok = family(name)[0] if name in FAMILIES and name not in BYTE_LEVEL else load(name)
    tj = json.loads(tok.backend_tokenizer.to_str())
    with pytest.raises(
        ValueError,
        match=(
            r'byte-level BPE \(its (pre_tokenizer|decoder) has a ByteLevel step\).*use ByteLevelDetokenizer or '
            r'TextChunkDetokenizer'
        ),
    ):
        SentencePieceDetokenizer(tj)
    tj['pre_tokenizer'] = None  # the decoder alone says so too
    with pytest.raises(ValueError, match=r'its decoder has a ByteLevel step'):
        SentencePieceDetokenizer(tj)


def test_sentencepiece_added_byte_pieces():
    "An added token whose content is a byte piece is the byte, as decode's ByteFallback reads it."
    tok = _mistral_added()
    sp, chunk = SentencePieceDetokenizer(json.loads(tok.backend_tokenizer.to_str())), TextChunkDetokenizer(tok)
    a, e7 = tok.convert_tokens_to_ids(['<0x41>', '<0xE7>'])
    assert {a, e7} <= set(tok.added_tokens_decoder)
    ids = [1010, a, 1010, *tok.convert_tokens_to_ids(['▁', '<0xE7>', '<0x88>', '<0xBF>']), 1010]
    assert sp.token_bytes(a) == b'A' == tok.decode([a]).encode() and sp.token_bytes(e7) == b'\xe7'
    for det in (sp, chunk):
        assert strip1(det.to_bytes(ids).decode()) == tok.decode(ids)


def test_declared_skip_ids_past_the_vocabulary_give_no_text():
    """Ids the caller declares textless (extra_skip_ids) may lie past the tokenizer's ids: Whisper's timestamps,
    which older tokenizer files lack. Other ids past it still raise."""
    from transformers import AutoTokenizer
    from mstar_utils.checkpoints import tokenizer_folder
    from mstar_utils.detokenize import TextChunkDetokenizer, TextOutput

    tok = AutoTokenizer.from_pretrained(tokenizer_folder('gpt2'))
    past = len(tok) + 10
    det = TextChunkDetokenizer(tok, extra_skip_ids={past})
    ids = tok.encode('Hello world', add_special_tokens=False)
    assert det.token_bytes(past) == b''
    assert det.to_bytes(ids[:1] + [past] + ids[1:]).decode() == tok.decode(ids)
    out = TextOutput(det, stop_token_ids=frozenset())
    assert b''.join(out.step_bytes([i]) for i in ids[:1] + [past] + ids[1:]).decode() == tok.decode(ids)
    with pytest.raises(ValueError, match=rf'token id {past + 1} is outside the vocabulary'):
        det.token_bytes(past + 1)
