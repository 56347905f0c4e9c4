"""Seeded random requests for the engine tier's reply and stream tests: vLLM's greedy outputs under random stop
settings, and our `Reply` fed the same ids."""

import codecs
import json
import os
import random
import shutil

PROMPTS = [
    'The capital of France is',
    'Write one sentence in Chinese about Tokyo: 東京は',
    'List three fruits, separated by commas:',
    '<|im_start|>user\nSay hello in Japanese.<|im_end|>\n<|im_start|>assistant\n',
    'Emoji for a party: 🎉 and for thumbs up:',
    'def fibonacci(n):',
]
MISTRAL_PROMPTS = [
    'The capital of France is',
    'Write one sentence in Chinese about Tokyo: 東京は',
    '[INST] Say hello in Japanese. [/INST]',
    'Emoji for a party: 🎉 and for thumbs up:',
    'def fibonacci(n):',
]
MISTRAL_CONFIG = dict(  # Mistral's architecture at toy size; the vocabulary is the tokenizer's, 32,768
    architectures=['MistralForCausalLM'],
    model_type='mistral',
    vocab_size=32768,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # the CPU attention backend takes no head_dim 16
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


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


def make_cases(engine, prompts=PROMPTS, n=CASES, seed=41) -> list:
    "(SamplingParams, vLLM's RequestOutput) for `n` random requests over `prompts`, generated in one batch."
    from vllm import SamplingParams

    base = engine.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, skip_special_tokens=False),
        use_tqdm=False,
    )
    texts = [o.outputs[0].text for o in base]
    ids = [list(o.outputs[0].token_ids) for o in base]
    rng = random.Random(seed)
    chosen, params = [], []
    for _ in range(n):
        k = rng.randrange(len(prompts))
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
        chosen.append(prompts[k])
    outs = engine.generate(chosen, params, use_tqdm=False)
    return list(zip(params, outs, strict=True))


def vllm_stop_reason(reply, ignore_eos):
    "Our stop reason as vLLM reports it: None for the model's EOS (its `check_stop` sets none), else the id or string."
    r = reply.stop_reason
    if isinstance(r, int) and not ignore_eos and r in reply.text_output.stop_token_ids:
        return None
    return r


def our_reply(text_output, p, prompt_ids=()):
    "Our `Reply` with the request's stop settings, continuing `prompt_ids`; `text_output(keep_special)` gives ours."
    return text_output(not p.skip_special_tokens).reply(
        stop=p.stop or (),
        include_stop_str_in_output=p.include_stop_str_in_output,
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop_token_ids=p.stop_token_ids or (),
        prompt_ids=prompt_ids,
    )


def ours(text_output, p, token_ids, prompt_ids=()):
    "(text bytes, finish reason, stop reason) from our Reply fed the ids one token a step."
    r = our_reply(text_output, p, prompt_ids)
    out = b''.join(r.step([i]) for i in token_ids) + r.finish()
    return out, ('stop' if r.stopped else 'length'), vllm_stop_reason(r, p.ignore_eos)


def shown(b: bytes) -> bytes:
    "What a client's incremental UTF-8 decoder shows of `b`: all but an unfinished last character."
    return codecs.getincrementaldecoder('utf-8')().decode(b).encode()


def check_replies(text_output, cases) -> tuple[list, int]:
    "The cases whose text, finish reason or stop reason differ from vLLM's, and how many end inside a character."
    # The text compared is what a client's UTF-8 decoder shows: vLLM keeps an unfinished last character back.
    bad, partial = [], 0
    for p, ro in cases:
        o = ro.outputs[0]
        raw, finish, reason = ours(text_output, p, list(o.token_ids), ro.prompt_token_ids)
        want = (o.text.encode(), o.finish_reason, o.stop_reason)
        if (shown(raw), finish, reason) != want:
            bad.append((p.stop, p.include_stop_str_in_output, p.min_tokens, p.ignore_eos, (raw, finish, reason), want))
        partial += shown(raw) != raw
    return bad, partial


def stream(engine, cases) -> list[list]:
    "vLLM's streamed outputs (`RequestOutputKind.DELTA`) for each case, re-run through its `LLMEngine` step by step."
    from vllm.sampling_params import RequestOutputKind

    eng = engine.llm_engine
    for k, (p, ro) in enumerate(cases):
        q = p.clone()
        q.output_kind = RequestOutputKind.DELTA
        eng.add_request(f'stream-{k}', ro.prompt, q)
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got.setdefault(out.request_id, []).append(out.outputs[0])
    return [got[f'stream-{k}'] for k in range(len(cases))]


def vllm_hold(p) -> int:
    "The characters vLLM's detokenizer holds back while a request runs: the longest stop string's less one, if cut."
    return max(map(len, p.stop)) - 1 if p.stop and not p.include_stop_str_in_output else 0


def vllm_text_so_far(det, ids, hold: int) -> str:
    "What vLLM has let out of a running request after `ids`: the text to its last whole character, less `hold` chars."
    # tokenizers' DecodeStream shows nothing of a token whose text ends inside a character (the text before the split
    # character included) until a later token completes it; the detokenizer then holds back `hold` characters
    for j in range(len(ids), -1, -1):
        b = det.to_bytes(ids[:j])
        if shown(b) == b:
            break
    t = b.decode()
    return t[: max(0, len(t) - hold)]


def vllm_slow_deltas(tokenizer, prompt_ids, ids, skip_special_tokens: bool) -> list[str]:
    """The text vLLM's detokenizer for a tokenizer without tokenizer.json (its SlowIncrementalDetokenizer) adds at each
    of `ids` after `prompt_ids`, its rule in plain Python."""
    # It starts on the tokens of the prompt's last 7 ids (special ones dropped when skipped), the window reaching 5
    # back from their end. At each id it joins the tokens from the window's start, and lets out what that adds to the
    # text of the window's tokens before the new ones, unless it adds nothing or ends in U+FFFD; then the window moves
    # on to the tokens it let out. An added token is its own piece of text, pieces joined by a space.
    added = set(tokenizer.get_added_vocab())
    special = set(tokenizer.all_special_tokens) if skip_special_tokens else set()

    def text(tokens):
        if not added:
            return tokenizer.convert_tokens_to_string(tokens)
        pieces, run = [], []
        for t in tokens:
            if t in special:
                continue
            if t in added:
                pieces += [tokenizer.convert_tokens_to_string(run)] if run else []
                pieces, run = pieces + [t], []
            else:
                run.append(t)
        return ' '.join(pieces + ([tokenizer.convert_tokens_to_string(run)] if run else []))

    def tokens_of(some):
        return [t or '' for t in tokenizer.convert_ids_to_tokens(some, skip_special_tokens=skip_special_tokens)]

    tokens = tokens_of(list(prompt_ids)[-7:])
    read = len(tokens)
    start, out = max(read - 5, 0), []
    for i in ids:
        tokens += tokens_of([i])
        before, now = text(tokens[start:read]), text(tokens[start:])
        if len(now) <= len(before) or now.endswith('\ufffd'):
            out.append('')
            continue
        out.append(now[len(before) :])
        start, read = read, len(tokens)
    return out


def check_stream(text_output, p, ro, deltas) -> dict:
    "Our `Reply` fed each delta's ids against vLLM's deltas; counts of the deltas equal to ours and held by vLLM."
    # vLLM's text so far must be a prefix of what a client's decoder shows of ours, and equal to its holding rules
    # (`vllm_text_so_far`) applied to the text of the ids so far.
    r, dec = our_reply(text_output, p, ro.prompt_token_ids), codecs.getincrementaldecoder('utf-8')()
    det, hold = text_output(not p.skip_special_tokens).detokenizer, vllm_hold(p)
    mine, theirs, seen, n = '', '', [], {'deltas': 0, 'equal': 0, 'held': 0}
    for d in deltas:
        assert len(d.token_ids) == 1, d  # one token a step: no speculative decoding
        last = d.finish_reason is not None
        b = r.step(list(d.token_ids)) + (r.finish() if last else b'')
        step = dec.decode(b)  # an unfinished last character stays held, as vLLM holds it
        mine, theirs, seen = mine + step, theirs + d.text, seen + list(d.token_ids)
        assert mine.startswith(theirs), (p, mine, theirs)
        if not last:
            assert theirs == vllm_text_so_far(det, seen, hold), (p, theirs, hold)
        n['deltas'] += 1
        n['equal'] += step == d.text
        n['held'] += mine != theirs
    assert mine == theirs == ro.outputs[0].text, (p, mine, theirs, ro.outputs[0].text)
    assert (d.finish_reason, d.stop_reason) == (ro.outputs[0].finish_reason, ro.outputs[0].stop_reason)
    return n


def smol_llm():
    "vLLM's engine on SmolLM2-135M-Instruct in float32 (its real weights), in this process."
    os.environ.setdefault('VLLM_ENABLE_V1_MULTIPROCESSING', '0')
    from vllm import LLM

    from mstar_utils.checkpoints import smollm2_checkpoint

    return LLM(
        str(smollm2_checkpoint()),
        dtype='float32',
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=2**28,
        max_num_seqs=64,
        seed=0,
    )


def write_mistral_folder(out, mode: str = 'auto'):
    "`out` as a checkpoint folder without weights: `MISTRAL_CONFIG` and Mistral's v3 vocabulary for `tokenizer_mode`."
    # 'auto': transformers' tokenizer.json conversion; 'mistral': mistral-common's own tokenizer.model.v3
    from mstar_utils.checkpoints import TOKENIZERS, extract_member, tokenizer_folder

    if mode == 'mistral':
        extract_member(TOKENIZERS['mistral-v3'].package, TOKENIZERS['mistral-v3'].member, out / 'tokenizer.model.v3')
    else:
        for name in ('tokenizer.json', 'tokenizer_config.json'):
            shutil.copy(tokenizer_folder('mistral-v3') / name, out / name)
    (out / 'config.json').write_text(json.dumps(MISTRAL_CONFIG), encoding='utf-8')
    return out


def mistral_llm(folder, mode: str = 'auto'):
    "vLLM's engine on the tiny Mistral in `folder`, its weights dummy (vLLM's random ones, seeded)."
    os.environ.setdefault('VLLM_ENABLE_V1_MULTIPROCESSING', '0')
    from vllm import LLM

    return LLM(
        str(folder),
        tokenizer_mode=mode,
        load_format='dummy',
        dtype='float32',
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=2**27,
        max_num_seqs=64,
        seed=0,
    )


def mistral_text_output(keep_special: bool):
    "Our text output for Mistral's v3 vocabulary: transformers' tokenizer.json conversion, eos </s> as in the config."
    from transformers import AutoTokenizer

    from mstar_utils.checkpoints import tokenizer_folder
    from mstar_utils.detokenize import TextChunkDetokenizer, TextOutput

    t = AutoTokenizer.from_pretrained(tokenizer_folder('mistral-v3'))
    return TextOutput(TextChunkDetokenizer(t, keep_special=keep_special), frozenset({MISTRAL_CONFIG['eos_token_id']}))
