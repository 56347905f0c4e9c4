"""Threads: loaders running at the same time on one checkpoint, and one detokenizer shared by 8 streams.

Every thread waits on a barrier before its first call, so the calls overlap (the loaders' reads and torch's copies
release the GIL; the detokenizer memo starts empty, so threads race to fill it). Modules are built on meta with
`meta_module`, which holds a process lock around accelerate's process-wide patch of `nn.Module.register_parameter`."""

import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn
from mstar_utils.model import meta_module
from transformers import AutoConfig, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from mstar_utils.checkpoints import smollm2_checkpoint, tokenizer_folder
from mstar_utils.detokenize import ByteLevelDetokenizer, SentencePieceDetokenizer
from mstar_utils.loading import ModuleAndPrefix, check_loaded, load_weights_from_hf_shards
from mstar_utils.testing import assert_state_dict_equal


def run_together(fns: list):
    "Run each of `fns` in its own thread, all released at once; their results in order (an exception in any is raised)."
    barrier = threading.Barrier(len(fns))

    def go(fn):
        barrier.wait(timeout=30)
        return fn()

    with ThreadPoolExecutor(len(fns)) as ex:
        return [f.result(timeout=120) for f in [ex.submit(go, fn) for fn in fns]]


# ---------------------------------------------------------------- loaders


def layers(lo=0, hi=None):
    cfg = AutoConfig.from_pretrained(smollm2_checkpoint())
    hi = cfg.num_hidden_layers if hi is None else hi
    return meta_module(lambda: nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(lo, hi)), torch.bfloat16)


def embeddings():
    cfg = AutoConfig.from_pretrained(smollm2_checkpoint())
    return meta_module(lambda: nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16))


def load(module, prefix):
    [names] = load_weights_from_hf_shards(smollm2_checkpoint(), [ModuleAndPrefix(module, prefix)], progress=False)
    check_loaded(module, names, prefix)
    return module


@pytest.fixture(scope='module')
def serial():
    "The decoder layers and the embeddings of SmolLM2, loaded one after the other."
    return {
        'layers': load(layers(), 'model.layers.').state_dict(),
        'embed': load(embeddings(), 'model.embed_tokens.').state_dict(),
    }


def test_decoder_layers_and_embeddings_at_once(serial):
    """Two threads load different modules (three shards' decoder layers; the embedding in shard 1) from one
    checkpoint at once."""
    for _ in range(2):
        ls, emb = layers(), embeddings()
        got_layers, got_embed = run_together(
            [lambda ls=ls: load(ls, 'model.layers.'), lambda emb=emb: load(emb, 'model.embed_tokens.')]
        )
        assert_state_dict_equal(got_layers, serial['layers'])
        assert_state_dict_equal(got_embed, serial['embed'])


class _Slice(nn.Module):
    """Decoder layers lo..hi-1 under their own numbers, so that the prefix 'model.layers.' fills them and their names
    match the full stack's."""

    def __init__(self, lo, hi):
        super().__init__()
        for i, layer in zip(range(lo, hi), layers(lo, hi), strict=True):
            self.add_module(str(i), layer)


def test_four_threads_split_the_decoder_layers(smol_config, serial):
    "Four threads fill quarters of the layer stack, from the same shards at once."
    n = smol_config.num_hidden_layers
    cuts = [0, n // 4, n // 2, 3 * n // 4, n]
    slices = [_Slice(lo, hi) for lo, hi in zip(cuts, cuts[1:], strict=False)]
    parts = run_together([lambda m=m: load(m, 'model.layers.') for m in slices])
    got = {k: v for m in parts for k, v in m.state_dict().items()}
    assert_state_dict_equal(got, serial['layers'])


# ---------------------------------------------------------------- one detokenizer, 8 streams

TEXTS = [
    'Hello, world! The capital of France is Paris.',
    'naïve café, crème brûlée',
    'Grüße aus Köln: Straße, Maß',
    '日本語のテキストと漢字',
    '中文：你好，世界！',
    'Ελληνικά και русский текст',
    'emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵',
    'code:\n\tdef f(x):\n\t\treturn x ** 2  # ✓',
    'عربي مع أرقام ١٢٣',
    'हिन्दी पाठ',
    '  leading and trailing spaces  ',
    '\u200bzero\u00a0width',
]


def _streams(detok, ids_per_text, order):
    "One thread's stream: every text, one token at a time, in `order`; the bytes per text."
    return {i: b''.join(detok.token_bytes(t) for t in ids_per_text[i]) for i in order}


@pytest.mark.parametrize('name', ['smollm2', 'qwen'])
def test_eight_streams_byte_level(smol_ckpt, name):
    tok = AutoTokenizer.from_pretrained(smol_ckpt if name == 'smollm2' else tokenizer_folder(name))
    ids = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    assert [tok.decode(i) for i in ids] == TEXTS  # the reference: these texts round-trip through the tokenizer
    d = ByteLevelDetokenizer(tok)  # fresh: empty memo
    orders = [list(range(len(TEXTS)))[k:] + list(range(len(TEXTS)))[:k] for k in range(8)]
    for got in run_together([lambda o=o: _streams(d, ids, o) for o in orders]):
        assert got == {i: t.encode('utf-8') for i, t in enumerate(TEXTS)}


def test_eight_streams_sentencepiece():
    "A SentencePiece vocabulary with byte fallback: 8 threads on one fresh detokenizer give what one thread gets alone."
    folder = tokenizer_folder('mistral-v3')
    tok = AutoTokenizer.from_pretrained(folder)
    tj = json.loads((folder / 'tokenizer.json').read_text(encoding='utf-8'))
    ids = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    alone = _streams(SentencePieceDetokenizer(tj), ids, range(len(TEXTS)))
    assert b'\xf0\x9f\x99\x82' in alone[6]  # byte fallback pieces (the emoji) are in play
    d = SentencePieceDetokenizer(tj)
    orders = [list(range(len(TEXTS)))[k:] + list(range(len(TEXTS)))[:k] for k in range(8)]
    for got in run_together([lambda o=o: _streams(d, ids, o) for o in orders]):
        assert got == alone
