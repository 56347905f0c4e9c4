#!/usr/bin/env python
"""Per-token streaming cost: `token_bytes` (memo warm) against tokenizers' `DecodeStream.step` and per-step
`decode([id])`, on SmolLM2-135M-Instruct's byte-level tokenizer and about 10k tokens of mixed text.

    python benchmarks/bench_detokenize.py                 # 10k tokens, best of 7 passes
    python benchmarks/bench_detokenize.py --tokens 50000 --repeats 11
    python benchmarks/bench_detokenize.py --strict        # also exit 1 when the 10x target is missed

All methods run in the same process on the same ids, each pass a plain `for` loop over the ids calling one bound
method, so loop overhead is the same for every row; the best pass is reported. Also checks that each method's joined
output is byte-exact against `tokenizer.decode(ids)`. Exits 1 when token_bytes or DecodeStream is not byte-exact.
Writes benchmarks/results/detokenize.json.
"""
from __future__ import annotations
import json, os, platform, random, sys, time
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

from fastcore.script import call_parse, store_true

RESULTS = Path(__file__).resolve().parent/'results'
TARGET = 10.0  # token_bytes at least this many times faster than DecodeStream.step

# Fragments of the mixed text; sampled with a fixed seed, so every run times the same ids.
FRAGMENTS = {
    'english': ['The quick brown fox jumps over the lazy dog.', "It's a streaming server; it doesn't wait for the end.",
                'Dear [Name], I hope this message finds you well.', 'Results: 3.14, 2.72 and 1,000,000 (approx.).'],
    'code': ['def step(self, x):\n    return self.proj(x) + x\n', 'for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}\n',
             "cfg = {'name': 'search', 'top_k': 50}\n", 'x    =    y  # aligned\n'],
    'cjk': ['你好，世界！', '北京欢迎你。', '我爱自然语言处理和机器学习。', '東京の天気は晴れです。', '안녕하세요, 세계!'],
    'arabic': ['مرحبا بالعالم', 'اللغة العربية جميلة جدا'],
    'hindi': ['नमस्ते दुनिया', 'हिन्दी भाषा बहुत सुंदर है'],
    'emoji': ['👍🏽 great', '👩🏽‍💻 coding', '👨‍👩‍👧‍👦 family', '🏳️‍🌈', '🇫🇷🇯🇵', '😀😃😄'],
}
SEPARATORS = [' ', '\n', '\r\n', '  ', '\t', '']


def mixed_ids(tok, n_tokens: int, seed: int = 0) -> list[int]:
    "Exactly `n_tokens` ids of mixed text (all fragment groups in turn, shuffled within), with a fixed seed."
    rng, groups, parts, ids = random.Random(seed), list(FRAGMENTS), [], []
    while len(ids) < n_tokens:
        for _ in range(200):
            g = rng.choice(groups)
            parts.append(rng.choice(FRAGMENTS[g]) + rng.choice(SEPARATORS))
        ids = tok.encode(''.join(parts), add_special_tokens=False)
    return ids[:n_tokens]


def best_ns(run, ids, repeats: int) -> float:
    "Best ns/token over `repeats` passes of `run(ids)`."
    best = float('inf')
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        run(ids)
        best = min(best, time.perf_counter_ns() - t0)
    return best/len(ids)


@call_parse
def main(tokens: int = 10_000,  # how many tokens of mixed text
         repeats: int = 7,  # passes per method; the best is reported
         strict: store_true = False,  # exit 1 when token_bytes is not TARGET times faster than DecodeStream.step
        ):
    import tokenizers, torch, transformers
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer
    from mstar_utils.checkpoints import smollm2_checkpoint
    from mstar_utils.detokenize import TextChunkDetokenizer, TextOutput

    tok = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    backend = tok.backend_tokenizer
    ids = mixed_ids(tok, tokens)
    reference = tok.decode(ids)
    to = TextOutput(TextChunkDetokenizer(tok), frozenset({tok.eos_token_id}))
    det = to.detokenizer
    assert det.mode == 'byte_level', det.mode
    token_bytes = det.token_bytes
    for i in ids: token_bytes(i)  # warm the memo: a server's memo is warm after its first requests

    def run_token_bytes(ids):
        for i in ids: token_bytes(i)

    def run_decode_stream(ids):
        step = DecodeStream(skip_special_tokens=False).step
        for i in ids: step(backend, i)

    def run_decode(ids):
        decode = tok.decode
        for i in ids: decode([i])

    def run_backend_decode(ids):
        decode = backend.decode
        for i in ids: decode([i])

    steps = [torch.tensor([i]) for i in ids]  # what a model hands over per step
    def run_step_bytes(ids):
        step_bytes = to.step_bytes
        for t in steps: step_bytes(t, None)

    # outputs, joined, for the byte-exactness check
    want = reference.encode()
    ds = DecodeStream(skip_special_tokens=False)
    joined = {
        'token_bytes': b''.join(token_bytes(i) for i in ids),
        'DecodeStream.step': ''.join(c for c in (ds.step(backend, i) for i in ids) if c is not None).encode(),
        'decode([id])': ''.join(tok.decode([i]) for i in ids).encode(),
        'Tokenizer.decode([id])': ''.join(backend.decode([i]) for i in ids).encode(),
        'step_bytes': b''.join(to.step_bytes(t, None) for t in steps),
    }
    rows = [('token_bytes', 'TextChunkDetokenizer.token_bytes (memo warm)', run_token_bytes),
            ('DecodeStream.step', 'tokenizers DecodeStream.step', run_decode_stream),
            ('decode([id])', 'transformers tokenizer.decode([id])', run_decode),
            ('Tokenizer.decode([id])', 'tokenizers Tokenizer.decode([id])', run_backend_decode),
            ('step_bytes', 'TextOutput.step_bytes(tensor([id])) (whole step path)', run_step_bytes)]
    ns = {key: best_ns(run, ids, repeats) for key, _, run in rows}

    print(f'SmolLM2-135M-Instruct tokenizer (byte-level BPE, vocab {len(tok)}), {len(ids)} tokens of mixed text '
          f'({len(reference)} characters), best of {repeats} passes')
    print(f'python {platform.python_version()}, tokenizers {tokenizers.__version__}, transformers {transformers.__version__}\n')
    print(f"{'method':<56}{'ns/token':>10}{'x token_bytes':>15}  byte-exact")
    results = {}
    for key, label, _ in rows:
        exact = joined[key] == want
        note = 'yes' if exact else f"no ({joined[key].decode('utf-8', 'replace').count(chr(0xFFFD))} U+FFFD)"
        print(f'{label:<56}{ns[key]:>10.1f}{ns[key]/ns["token_bytes"]:>14.1f}x  {note}')
        results[key] = dict(label=label, ns_per_token=ns[key], ratio_to_token_bytes=ns[key]/ns['token_bytes'], byte_exact=exact)
    speedup = ns['DecodeStream.step']/ns['token_bytes']
    met = speedup >= TARGET
    print(f'\ntarget: token_bytes >= {TARGET:.0f}x faster than DecodeStream.step and byte-exact: '
          f"{'met' if met and results['token_bytes']['byte_exact'] else 'NOT met'} ({speedup:.1f}x)")

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS/'detokenize.json').write_text(json.dumps(dict(
        tokens=len(ids), characters=len(reference), repeats=repeats, python=platform.python_version(),
        tokenizers=tokenizers.__version__, transformers=transformers.__version__, target=TARGET,
        speedup_vs_decode_stream=speedup, results=results), indent=1))
    if not (results['token_bytes']['byte_exact'] and results['DecodeStream.step']['byte_exact']): sys.exit(1)
    if strict and not met: sys.exit(1)
