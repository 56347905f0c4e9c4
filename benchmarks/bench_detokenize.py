#!/usr/bin/env python
"""Per-token streaming cost: `token_bytes` (memo warm) and the whole step path as a server calls it, the function
`TextOutput.step_fn()` returns (it gives what `step_bytes` gives; one-token and k-token tensors), against tokenizers'
`DecodeStream.step` and per-step `decode([id])`, on SmolLM2-135M-Instruct's byte-level tokenizer and about 10k tokens
of mixed text. The rows keep the key `step_bytes`.

    python benchmarks/bench_detokenize.py                 # 10k tokens, best of 7 passes
    python benchmarks/bench_detokenize.py --tokens 50000 --repeats 11
    python benchmarks/bench_detokenize.py --strict        # also exit 1 when a target is missed
    python benchmarks/bench_detokenize.py --publish       # also write benchmarks/detokenize_results.json (committed)

All methods run in the same process on the same ids, each pass a plain `for` loop over the ids (or the steps) calling
one bound method or function, so loop overhead is the same for every row. The ids are timed in blocks of 256 whose
inputs are made just before, untimed: the step rows get fresh tensors, as a server's sampler makes each step's tensor.
Each round runs every method twice, in turn, and times the second pass (caches warm again after the method before); the
best round of each is reported, so load from other processes weighs on all rows alike. Also checks that each
method's joined output is byte-exact against `tokenizer.decode(ids)`. Exits 1 when token_bytes, step_bytes or
DecodeStream is not byte-exact. Writes benchmarks/results/detokenize.json.

The `Reply` rows stream the same ids through `text_output.reply(...)`, one reply per pass (its memo, shared by the
replies with the same stop strings, warm from the pass before, as a server's is after its first requests): with no
stop strings, and with the 4 in `STOPS`, which never occur in the text but whose first bytes often do, so the stream
holds back and lets go again. The reply's own output is checked against `tokenizer.decode(ids)` too. Then the
4-stop reply of `--long` tokens is timed per token on the 256 tokens from token 256 and from token 32,768.

Targets: token_bytes >= 10x faster than DecodeStream.step; step_bytes on a one-token tensor <= 0.5x DecodeStream.step
per token; a step of k tokens (k = 2, 4, 8) <= k times that; a reply without stop strings <= 1.3x step_bytes per step;
a reply with 4 stop strings <= 0.7x DecodeStream.step per token; the same at token 32,768 <= 1.3x its cost at 256.
"""

from __future__ import annotations
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

from fastcore.script import call_parse, store_true

RESULTS = Path(__file__).resolve().parent / 'results'
TARGET = 10.0  # token_bytes at least this many times faster than DecodeStream.step
STEP_TARGET = 0.5  # step_bytes on a one-token tensor at most this fraction of DecodeStream.step per token
KS = (2, 4, 8)  # multi-token steps timed: each at most k x STEP_TARGET x DecodeStream.step
REPLY_TARGET = 1.3  # a Reply without stop strings at most this many times step_bytes per step
STOP_TARGET = 0.7  # a Reply with the 4 STOPS at most this fraction of DecodeStream.step per token
FLAT_TARGET = 1.3  # its cost per token at token 32,768 at most this many times the cost at token 256
STOPS = ['The answer is', '\n\nUser:', '你好世界!', 'Results: 42']  # never in the text; their first bytes often are
AT = (256, 32_768)  # where the long reply is timed, 256 tokens each

# Fragments of the mixed text; sampled with a fixed seed, so every run times the same ids.
FRAGMENTS = {
    'english': [
        'The quick brown fox jumps over the lazy dog.',
        "It's a streaming server; it doesn't wait for the end.",
        'Dear [Name], I hope this message finds you well.',
        'Results: 3.14, 2.72 and 1,000,000 (approx.).',
    ],
    'code': [
        'def step(self, x):\n    return self.proj(x) + x\n',
        'for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}\n',
        "cfg = {'name': 'search', 'top_k': 50}\n",
        'x    =    y  # aligned\n',
    ],
    'cjk': [
        '你好，世界！',
        '北京欢迎你。',
        '我爱自然语言处理和机器学习。',
        '東京の天気は晴れです。',
        '안녕하세요, 세계!',
    ],
    'arabic': ['مرحبا بالعالم', 'اللغة العربية جميلة جدا'],
    'hindi': ['नमस्ते दुनिया', 'हिन्दी भाषा बहुत सुंदर है'],
    'emoji': ['👍🏽 great', '👩🏽‍💻 coding', '👨‍👩‍👧‍👦 family', '🏳️‍🌈', '🇫🇷🇯🇵', '😀😃😄'],
}
SEPARATORS = [' ', '\n', '\r\n', '  ', '\t', '']


def mixed_ids(tok, n_tokens: int, seed: int = 0) -> list[int]:
    """About `n_tokens` ids of mixed text (all fragment groups in turn, shuffled within), with a fixed seed; cut
    where a character ends."""
    rng, groups, parts, ids = random.Random(seed), list(FRAGMENTS), [], []
    while len(ids) < n_tokens + 16:
        for _ in range(200):
            g = rng.choice(groups)
            parts.append(rng.choice(FRAGMENTS[g]) + rng.choice(SEPARATORS))
        ids = tok.encode(''.join(parts), add_special_tokens=False)
    n = n_tokens
    while tok.decode(ids[:n]).endswith('\ufffd'):
        n += 1  # never end inside a character: decode would show U+FFFD
    return ids[:n]


BLOCK = 256  # tokens timed at a time, their inputs made just before, as a server's sampler makes each step's tensor


def timed_pass(prep, start, n: int) -> int:
    """ns for one pass over n tokens: `start()` gives the method's runner for the pass, `prep(lo, hi)` its inputs for
    a block (untimed)."""
    run, total = start(), 0
    for lo in range(0, n, BLOCK):
        x = prep(lo, min(lo + BLOCK, n))
        t0 = time.perf_counter_ns()
        run(x)
        total += time.perf_counter_ns() - t0
    return total


def best_ns(methods: dict, n: int, repeats: int) -> dict:
    """Best ns/token of each method (prep, start) over `repeats` rounds; a round runs every method twice and times
    the second pass."""
    best = dict.fromkeys(methods, float('inf'))
    for _ in range(repeats):
        for key, (prep, start) in methods.items():
            timed_pass(prep, start, n)  # untimed: caches warm again after the method before it
            best[key] = min(best[key], timed_pass(prep, start, n))
    return {key: ns / n for key, ns in best.items()}


def reply_at(to, ids: list[int], repeats: int) -> dict[int, float]:
    """Best ns/token of a 4-stop Reply over the BLOCK tokens from each of AT, stepping untimed up to there; one reply
    per round."""
    import torch

    steps = [torch.tensor([i]) for i in ids]
    best = dict.fromkeys(AT, float('inf'))
    for _ in range(repeats):
        step, pos = to.reply(stop=STOPS).step, 0
        for at in AT:
            for t in steps[pos:at]:
                step(t)
            block = steps[at : at + BLOCK]
            t0 = time.perf_counter_ns()
            for t in block:
                step(t)
            best[at] = min(best[at], (time.perf_counter_ns() - t0) / len(block))
            pos = at + BLOCK
    return best


# each method: (prep(lo, hi) -> the block's inputs, start() -> a runner for one pass)
def each(f):
    "A runner for one pass: `f(x)` for each input of a block."

    def run(block):
        for x in block:
            f(x)

    return run


def decode_stream_runner(DecodeStream, backend):
    "A runner for one pass of a fresh `DecodeStream` over the tokenizer `backend`."
    step, ds = DecodeStream(skip_special_tokens=False).step, backend

    def run(block):
        for i in block:
            step(ds, i)

    return run


def step_block(ids, k):
    "prep of the step rows: what a model hands over, a fresh tensor of k ids per step (speculative / MTP for k > 1)."
    import torch

    return lambda lo, hi: [torch.tensor(ids[j : min(j + k, hi)]) for j in range(lo, hi, k)]


def step_bytes_runner(to):
    "A runner for one pass of the function `to.step_fn()` returns."
    step_bytes = to.step_fn()  # what a server's decode loop calls: step_bytes' short cut, its lookups done once

    def run(block):
        for t in block:
            step_bytes(t, None)

    return run


def reply_runner(to, stop):
    "start() of the reply rows: a runner for one pass of a new reply with the stop strings `stop`."

    def start():
        step = to.reply(stop=stop).step

        def run(block):
            for t in block:
                step(t)

        return run

    return start


def method_rows(tok, to, ids, DecodeStream) -> list:
    "(key, label, (prep, start)) of every method timed."
    backend, token_bytes = tok.backend_tokenizer, to.detokenizer.token_bytes

    def id_block(lo, hi):
        return ids[lo:hi]

    def decode_one(i):
        return tok.decode([i])

    def backend_one(i):
        return backend.decode([i])

    one_step = step_block(ids, 1)
    return [
        ('token_bytes', 'TextChunkDetokenizer.token_bytes (memo warm)', (id_block, lambda: each(token_bytes))),
        (
            'DecodeStream.step',
            'tokenizers DecodeStream.step',
            (id_block, lambda: decode_stream_runner(DecodeStream, backend)),
        ),
        ('decode([id])', 'transformers tokenizer.decode([id])', (id_block, lambda: each(decode_one))),
        ('Tokenizer.decode([id])', 'tokenizers Tokenizer.decode([id])', (id_block, lambda: each(backend_one))),
        (
            'step_bytes',
            'TextOutput.step_fn()(tensor([id])) (whole step path)',
            (one_step, lambda: step_bytes_runner(to)),
        ),
        *[
            (
                f'step_bytes_k{k}',
                f'TextOutput.step_fn(), {k}-token steps (per token)',
                (step_block(ids, k), lambda: step_bytes_runner(to)),
            )
            for k in KS
        ],
        ('reply', 'Reply.step(tensor([id])), no stop strings', (one_step, reply_runner(to, ()))),
        ('reply_stop4', 'Reply.step(tensor([id])), 4 stop strings', (one_step, reply_runner(to, STOPS))),
    ]


def joined_outputs(tok, to, ids, DecodeStream) -> dict:
    "Each method's outputs over `ids`, joined, for the byte-exactness check."

    def reply_bytes(stop, steps):
        r = to.reply(stop=stop)
        return b''.join(r.step(t) for t in steps) + r.finish()

    backend, token_bytes = tok.backend_tokenizer, to.detokenizer.token_bytes
    steps = step_block(ids, 1)(0, len(ids))
    k_steps = {k: step_block(ids, k)(0, len(ids)) for k in KS}
    ds = DecodeStream(skip_special_tokens=False)
    return {
        'token_bytes': b''.join(token_bytes(i) for i in ids),
        'DecodeStream.step': ''.join(c for c in (ds.step(backend, i) for i in ids) if c is not None).encode(),
        'decode([id])': ''.join(tok.decode([i]) for i in ids).encode(),
        'Tokenizer.decode([id])': ''.join(backend.decode([i]) for i in ids).encode(),
        'step_bytes': b''.join(map(to.step_fn(), steps)),
        **{f'step_bytes_k{k}': b''.join(map(to.step_fn(), k_steps[k])) for k in KS},
        'reply': reply_bytes((), steps),
        'reply_stop4': reply_bytes(STOPS, steps),
    }


def print_table(rows: list, ns: dict, joined: dict, want: bytes) -> dict:
    "Print a line a method (ns/token, its ratio to token_bytes, whether byte-exact); the same figures, by key."
    print(f"{'method':<56}{'ns/token':>10}{'x token_bytes':>15}  byte-exact")
    results = {}
    for key, label, _ in rows:
        exact = joined[key] == want
        note = 'yes' if exact else f"no ({joined[key].decode('utf-8', 'replace').count(chr(0xFFFD))} U+FFFD)"
        print(f'{label:<56}{ns[key]:>10.1f}{ns[key] / ns["token_bytes"]:>14.1f}x  {note}')
        results[key] = dict(
            label=label, ns_per_token=ns[key], ratio_to_token_bytes=ns[key] / ns['token_bytes'], byte_exact=exact
        )
    return results


def targets(ns: dict, at: dict) -> list:
    "(target, met, measured) of every target, from the methods' ns/token and the long reply's at AT."
    ds = ns['DecodeStream.step']
    speedup = ds / ns['token_bytes']
    checks = [
        (f'token_bytes >= {TARGET:.0f}x faster than DecodeStream.step', speedup >= TARGET, f'{speedup:.1f}x'),
        (
            f'step_bytes on a one-token tensor <= {STEP_TARGET}x DecodeStream.step',
            ns['step_bytes'] <= STEP_TARGET * ds,
            f"{ns['step_bytes'] / ds:.2f}x",
        ),
    ]
    # a k-token step costs <= k x (STEP_TARGET x DecodeStream.step): per token, the same bound
    checks += [
        (
            f'a {k}-token step <= {k} x {STEP_TARGET}x DecodeStream.step',
            ns[f'step_bytes_k{k}'] <= STEP_TARGET * ds,
            f"{ns[f'step_bytes_k{k}'] * k / ds:.2f}x per step = {k} x {ns[f'step_bytes_k{k}'] / ds:.2f}x",
        )
        for k in KS
    ]
    flat = at[AT[-1]] / at[AT[0]]
    checks += [
        (
            f'a reply without stop strings <= {REPLY_TARGET}x step_bytes per step',
            ns['reply'] <= REPLY_TARGET * ns['step_bytes'],
            f"{ns['reply'] / ns['step_bytes']:.2f}x",
        ),
        (
            f'a reply with 4 stop strings <= {STOP_TARGET}x DecodeStream.step per token',
            ns['reply_stop4'] <= STOP_TARGET * ds,
            f"{ns['reply_stop4'] / ds:.2f}x",
        ),
        (
            f'4 stop strings at token {AT[-1]:,} <= {FLAT_TARGET}x the cost at token {AT[0]}',
            flat <= FLAT_TARGET,
            f'{flat:.2f}x',
        ),
    ]
    return checks


@call_parse
def main(
    tokens: int = 10_000,  # how many tokens of mixed text
    repeats: int = 7,  # passes per method; the best is reported
    strict: store_true = False,  # exit 1 when a target is missed
    long: int = 33_024,  # tokens of the long reply timed at AT
    publish: store_true = False,  # also write benchmarks/detokenize_results.json, which benchmarks/README.md quotes
):
    import tokenizers
    import transformers
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer
    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.detokenize import TextChunkDetokenizer, TextOutput

    tok = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    ids = mixed_ids(tok, tokens)
    reference = tok.decode(ids)
    to = TextOutput(TextChunkDetokenizer(tok), frozenset({tok.eos_token_id}))
    det = to.detokenizer
    assert det.mode == 'byte_level', det.mode
    token_bytes = det.token_bytes
    for i in ids:
        token_bytes(i)  # warm the memo: a server's memo is warm after its first requests

    joined = joined_outputs(tok, to, ids, DecodeStream)
    rows = method_rows(tok, to, ids, DecodeStream)
    ns = best_ns({key: method for key, _, method in rows}, len(ids), repeats)

    print(
        f'SmolLM2-135M-Instruct tokenizer (byte-level BPE, vocab {len(tok)}), {len(ids)} tokens of mixed text '
        f'({len(reference)} characters), best of {repeats} passes'
    )
    print(
        f'python {platform.python_version()}, tokenizers {tokenizers.__version__}, '
        f'transformers {transformers.__version__}\n'
    )
    results = print_table(rows, ns, joined, reference.encode())
    ds = ns['DecodeStream.step']
    speedup = ds / ns['token_bytes']
    at = reply_at(to, mixed_ids(tok, max(long, AT[-1] + BLOCK)), repeats)
    for k, v in at.items():
        print(f'Reply.step, 4 stop strings, tokens {k}-{k + BLOCK - 1}: {v:.1f} ns/token')
    flat = at[AT[-1]] / at[AT[0]]
    checks = targets(ns, at)
    print()
    for what, ok, got in checks:
        print(f"target: {what}: {'met' if ok else 'NOT met'} ({got})")
    met = all(ok for _, ok, _ in checks)

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = json.dumps(
        dict(
            tokens=len(ids),
            characters=len(reference),
            repeats=repeats,
            python=platform.python_version(),
            tokenizers=tokenizers.__version__,
            transformers=transformers.__version__,
            target=TARGET,
            speedup_vs_decode_stream=speedup,
            step_bytes_vs_decode_stream=ns['step_bytes'] / ds,
            reply_vs_step_bytes=ns['reply'] / ns['step_bytes'],
            reply_stop4_vs_decode_stream=ns['reply_stop4'] / ds,
            reply_stop4_at={str(k): v for k, v in at.items()},
            reply_stop4_flat=flat,
            targets={what: ok for what, ok, _ in checks},
            results=results,
        ),
        indent=1,
    )
    (RESULTS / 'detokenize.json').write_text(out)
    if publish:
        (RESULTS.parent / 'detokenize_results.json').write_text(out + '\n')
    exact = (
        'token_bytes',
        'DecodeStream.step',
        'step_bytes',
        *[f'step_bytes_k{k}' for k in KS],
        'reply',
        'reply_stop4',
    )
    if not all(results[k]['byte_exact'] for k in exact):
        sys.exit(1)
    if strict and not met:
        sys.exit(1)
