"""The method that runs is the documented one: no public method, property or other class attribute of the
detokenizers, `TextOutput`, `TextStream` or `Reply` is stood in for by an instance attribute of the same name, after
construction, after use (cold and warm), and in `_replace` and pickle copies. The decode loop's function,
`TextOutput.step_fn()`, is a class method's result, stored on nothing, and reads the detokenizer's one memo."""

import json
import pickle

import pytest
import torch
from transformers import AutoTokenizer

from mstar_utils.checkpoints import minilm_checkpoint, smollm2_checkpoint, tokenizer_folder
from mstar_utils.detokenize import ByteLevelDetokenizer, SentencePieceDetokenizer, TextChunkDetokenizer, TextOutput


def shadowed(obj) -> list[str]:
    "The public names of `type(obj)` that `obj`'s own attributes hide."
    own = getattr(obj, '__dict__', {})
    return sorted(n for n in dir(type(obj)) if not n.startswith('_') and n in own)


def tables(fn) -> list[dict]:
    "The dicts a function's closure holds."
    return [c.cell_contents for c in (getattr(fn, '__closure__', None) or ()) if isinstance(c.cell_contents, dict)]


@pytest.fixture(scope='module')
def tokenizers():
    return {
        'smollm2': AutoTokenizer.from_pretrained(smollm2_checkpoint()),
        'mistral': AutoTokenizer.from_pretrained(tokenizer_folder('mistral-v3')),
        'minilm': AutoTokenizer.from_pretrained(minilm_checkpoint()),
    }


def detokenizers(toks):
    "One of each class, and TextChunkDetokenizer in its byte-level, SentencePiece and per-token decode modes."
    sp_json = json.loads((tokenizer_folder('mistral-v1') / 'tokenizer.json').read_text())
    return {
        'byte_level': ByteLevelDetokenizer(toks['smollm2']),
        'sentencepiece': SentencePieceDetokenizer(sp_json),
        'chunk_byte_level': TextChunkDetokenizer(toks['smollm2']),
        'chunk_sentencepiece': TextChunkDetokenizer(toks['mistral']),
        'chunk_decode': TextChunkDetokenizer(toks['minilm']),
    }


def use(det, ids):
    "Every public path through `det` and a `TextOutput` over it, cold then warm; the objects it made."
    made = []
    for _ in range(2):
        for i in ids:
            det.token_bytes(i)
        det.to_bytes(ids)
        if isinstance(det, SentencePieceDetokenizer):
            [det.piece_bytes(i) for i in ids]
        to = TextOutput(det, frozenset({ids[-1]}))
        for k in (1, 2, 3):
            for j in range(0, len(ids), k):
                to.step_bytes(torch.tensor(ids[j : j + k])), to.step_bytes(ids[j : j + k], {'ignore_eos': True})
        fn = to.step_fn()
        for k in (1, 2, 3):
            for j in range(0, len(ids), k):
                fn(torch.tensor(ids[j : j + k])), fn(ids[j : j + k], {'ignore_eos': True})
        assert all(t is det._memo for t in tables(fn)), 'step_fn holds an id -> bytes table besides the memo'
        to.output_bytes(torch.tensor(ids)), to.token_ids(ids)
        stream, r = to.stream(), to.reply(stop=['zz'])
        for i in ids:
            stream.step(torch.tensor([i])), r.step(torch.tensor([i]))
        r.finish()
        made += [to, to._replace(stop_token_ids=frozenset()), pickle.loads(pickle.dumps(to)), stream, r]
    return made


@pytest.mark.parametrize(
    'kind', ['byte_level', 'sentencepiece', 'chunk_byte_level', 'chunk_sentencepiece', 'chunk_decode']
)
def test_no_public_name_is_shadowed(tokenizers, kind):
    det = detokenizers(tokenizers)[kind]
    assert shadowed(det) == [], f'{kind}: instance attributes hide these after construction'
    ids = [5, 17, 300, 1000, det.vocab_size - 1, 2]
    made = use(det, ids)
    assert shadowed(det) == [], f'{kind}: instance attributes hide these after use'
    assert shadowed(pickle.loads(pickle.dumps(det))) == [], f'{kind}: a pickled copy'
    for obj in made:
        assert shadowed(obj) == [], f'{kind}: a {type(obj).__name__} hides these'
    # and the bound methods are the class's functions
    for obj, names in (
        (det, ['token_bytes', 'to_bytes']),
        (made[0], ['step_bytes', 'step_fn', 'output_bytes', 'token_ids']),
    ):
        for n in names:
            assert getattr(obj, n).__func__ is getattr(type(obj), n), (type(obj).__name__, n)
    # step_fn: a fresh function each call, stored on nothing, over this detokenizer's memo (or step_bytes itself)
    for to in made[:3]:
        fn = to.step_fn()
        assert fn is not to.step_fn() and not hasattr(to, '__dict__'), type(to).__name__
        assert fn.__name__ in ('step', 'step_bytes') and all(t is to.detokenizer._memo for t in tables(fn))
        assert tables(fn) or fn.__func__ is type(to).step_bytes, 'step_fn over the memo, or step_bytes itself'
        assert all(getattr(to, n) is not fn for n in dir(type(to)) if not n.startswith('_'))


def test_shadowing_is_seen():
    "The check itself: an instance attribute that hides a method is reported."

    class A:
        def f(self):
            return 1

    a = A()
    assert shadowed(a) == []
    a.f = lambda: 2
    assert shadowed(a) == ['f']
    memo = {1: b'a'}
    copy = dict(memo)

    def two(i):
        return memo.get(i) or copy[i]

    assert tables(len) == [] and sorted(t is memo for t in tables(two)) == [
        False,
        True,
    ]  # a copy is seen, however equal
