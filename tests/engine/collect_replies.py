"""Record a few of vLLM's streamed replies for the normal suite: tests/engine/reply_figures.json.

Run in the engine venv (`tools/engine --collect-replies`). It starts the engines of the reply tests (SmolLM2 with its
real weights, the tiny dummy-weight Mistral with Mistral's vocabulary), runs their seeded random requests streamed
(`RequestOutputKind.DELTA`), and keeps those that show a rule: a stop string kept in the output (vLLM holds nothing
back), one cut from it (vLLM holds back the longest stop string less a character), a character split across tokens,
and a SentencePiece reply whose first space the prompt keeps. tests/test_reply.py feeds each step's ids to a `Reply`.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[2]), str(Path(__file__).parents[1])]  # this package; engine.cases
os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'
OUT = Path(__file__).with_name('reply_figures.json')


def record(model, p, ro, deltas) -> dict:
    "One streamed request as the normal suite reads it."
    o = ro.outputs[0]
    return dict(
        model=model,
        prompt_ids=list(ro.prompt_token_ids),
        stop=list(p.stop or ()),
        include_stop_str_in_output=p.include_stop_str_in_output,
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop_token_ids=list(p.stop_token_ids or ()),
        skip_special_tokens=p.skip_special_tokens,
        steps=[[list(d.token_ids), d.text] for d in deltas],
        text=o.text,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )


def pick(cases, streams, rules: dict, each: int = 2) -> list:
    "The first `each` cases that meet each rule (a predicate on (params, output, deltas))."
    out = []
    for rule in rules.values():
        hits = [k for k, ((p, ro), d) in enumerate(zip(cases, streams, strict=True)) if rule(p, ro.outputs[0], d)]
        out += [k for k in hits[:each] if k not in out]
    return out


def main():
    from engine.cases import MISTRAL_PROMPTS, make_cases, mistral_llm, smol_llm, stream, vllm_hold, write_mistral_folder

    recs = []
    llm = smol_llm()
    try:
        cases = make_cases(llm)
        streams = stream(llm, cases)
    finally:
        llm.llm_engine.engine_core.shutdown()
    rules = {
        'kept stop': lambda p, o, d: p.include_stop_str_in_output and isinstance(o.stop_reason, str),
        'cut stop': lambda p, o, d: not p.include_stop_str_in_output and isinstance(o.stop_reason, str),
        # a step that shows nothing though nothing is held for stops: part of a character (or a skipped token)
        'split character': lambda p, o, d: not vllm_hold(p) and any(not x.text and not x.finish_reason for x in d),
    }
    recs += [record('smollm2', *cases[k], streams[k]) for k in pick(cases, streams, rules)]
    with tempfile.TemporaryDirectory() as tmp:
        llm = mistral_llm(write_mistral_folder(Path(tmp)))
        try:
            cases = make_cases(llm, MISTRAL_PROMPTS)
            streams = stream(llm, cases)
        finally:
            llm.llm_engine.engine_core.shutdown()
    rules = {'first space': lambda p, o, d: o.text.startswith(' '), 'stop': lambda p, o, d: o.stop_reason is not None}
    recs += [record('mistral-v3', *cases[k], streams[k]) for k in pick(cases, streams, rules)]
    OUT.write_text(json.dumps(recs, ensure_ascii=False, indent=1) + '\n', encoding='utf-8')
    print(f'{len(recs)} streamed replies written to {OUT}')


if __name__ == '__main__':
    main()
