"""The package's style a linter does not check: lines of at most 120 characters, public docstrings of one line of at
most 100."""

import ast
import importlib
import re
import inspect
from pathlib import Path

import mstar_utils
from conftest import cells, notebooks, src

PKG = Path(mstar_utils.__file__).parent
MODULES = sorted(p.stem for p in PKG.glob('*.py') if p.stem not in ('_modidx', '__init__', '__main__'))


def test_no_package_line_over_120_characters():
    # nbdev writes each module's `__all__` itself, wrapping the names at 120 before its `__all__ = ` prefix
    long = [
        f'{m}.py:{n}'
        for m in MODULES
        for n, line in enumerate((PKG / f'{m}.py').read_text('utf-8').splitlines(), 1)
        if len(line) > 120 and not line.startswith('__all__ = [')
    ]
    assert long == [], long


# torch's tensor shape methods take their dims by position (`t.view(n, 8, 2, 1, 1)`): they are not counted
SHAPE_METHODS = {'view', 'reshape', 'permute', 'expand', 'repeat', 'new_zeros', 'new_empty'}


def test_no_call_passes_more_than_4_arguments_by_position():
    """Past the fourth, a call names its arguments (`Finding(..., fix=...)`), so a reader need not count; a starred
    argument is not counted, nor the dims of torch's tensor shape methods."""
    bad = []
    for p in sorted(PKG.glob('*.py')):
        if p.name == '_modidx.py':
            continue
        for n in ast.walk(ast.parse(p.read_text('utf-8'))):
            if not isinstance(n, ast.Call) or (isinstance(n.func, ast.Attribute) and n.func.attr in SHAPE_METHODS):
                continue
            if (k := sum(not isinstance(a, ast.Starred) for a in n.args)) > 4:
                bad.append(f'{p.name}:{n.lineno}: {ast.unparse(n.func)} gets {k} arguments by position')
    assert bad == [], '\n'.join(bad)


def public_docstrings():
    "(name, docstring) of every name in each module's `__all__`, and of the public methods of its classes."
    for m in MODULES:
        mod = importlib.import_module(f'mstar_utils.{m}')
        for name in getattr(mod, '__all__', []):
            obj = getattr(mod, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or getattr(obj, '__module__', '') != mod.__name__:
                continue
            yield f'{m}.{name}', inspect.getdoc(obj)
            if inspect.isclass(obj):
                for k, v in vars(obj).items():
                    if not k.startswith('_') and inspect.isfunction(v) and v.__doc__:
                        yield f'{m}.{name}.{k}', inspect.getdoc(v)


def test_public_docstrings_are_one_line_of_at_most_100_characters():
    bad = [(n, len(d)) for n, d in public_docstrings() if d and (len(d) > 100 or '\n' in d.strip())]
    assert bad == [], bad


# ---- notebook craft (the notebooks are the source): one function or class an exported cell, at most three in a row

EXPORTED = re.compile(r'\A(?:\s*#\|[^\n]*\n)*?\s*#\|\s*export[is]?\b')


def exported_cells(nb: Path) -> list:
    "(index, source or None) of every cell of notebook `nb`: None for a cell that is not an exported code cell."
    return [
        (i, s if c['cell_type'] == 'code' and EXPORTED.match(s) else None)
        for i, c in enumerate(cells(nb))
        for s in [src(c)]
    ]


def test_an_exported_cell_holds_one_function_or_class():
    bad = []
    for nb in notebooks():
        for i, s in exported_cells(nb):
            if s is None:
                continue
            tree = ast.parse('\n'.join(line for line in s.splitlines() if not line.lstrip().startswith('#|')))
            defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            if len(defs) > 1:
                bad.append(f'{nb.name} cell {i}: {defs}')
    assert bad == [], bad


def test_at_most_three_exported_cells_in_a_row():
    "Prose or an example comes after at most three exported cells."
    bad = []
    for nb in notebooks():
        run = []
        for i, s in [*exported_cells(nb), (None, None)]:
            if s is not None:
                run.append(i)
                continue
            if len(run) > 3:
                bad.append(f'{nb.name} cells {run[0]}-{run[-1]} ({len(run)} in a row)')
            run = []
    assert bad == [], bad


# ---- whole sentences: a docstring is one complete sentence, not the first line of a sentence a comment finishes

SENTENCE_END = re.compile(r'[.!?][)`\'"]*\s*\Z')


def docstrings_with_next_line(s: str):
    "(name, docstring, the first non-blank line after it) of every function and class an exported cell defines."
    lines = s.splitlines()
    for n in ast.walk(ast.parse(s)):
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = n.body[0] if n.body and isinstance(n.body[0], ast.Expr) else None
        if doc is None or not isinstance(doc.value, ast.Constant) or not isinstance(doc.value.value, str):
            continue
        yield n.name, doc.value.value, next((line.strip() for line in lines[doc.end_lineno :] if line.strip()), '')


def test_no_docstring_is_continued_in_a_comment():
    "A docstring that stops short of a sentence's end and goes on in a `#` comment fails: say it in one sentence."
    bad = []
    for nb in notebooks():
        for i, s in exported_cells(nb):
            for name, doc, after in docstrings_with_next_line(s or ''):
                if after.startswith('#') and not after.startswith('#|') and not SENTENCE_END.search(doc):
                    bad.append(f'{nb.name} cell {i}: {name}: {doc!r} / {after[:60]!r}')
    assert bad == [], '\n'.join(bad)


def test_no_shown_cell_uses_a_name_only_a_hidden_cell_defines():
    """A reader runs the cells the page shows; a name defined in a hidden cell (`#| hide`, `#| exporti`) is not
    defined for them, so a shown cell that uses one, or a shown function that calls one, fails in a fresh kernel
    (tests/test_visible_cells runs them). A helper a shown cell needs is shown (`#| export`)."""
    hidden_cell = re.compile(r'^\s*#\|\s*(hide|exporti)\b', re.M)
    bad = []
    for nb in notebooks():
        code = [src(c) for c in cells(nb) if c['cell_type'] == 'code']
        hidden = set()
        for s in filter(hidden_cell.search, code):
            for n in ast.parse(s).body:
                if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                    hidden.add(n.name)
                elif isinstance(n, ast.Assign):
                    hidden |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        for s in code:
            if hidden_cell.search(s):
                continue
            used = {n.id for n in ast.walk(ast.parse(s)) if isinstance(n, ast.Name)}
            bad += [f'{nb.name}: {n}' for n in sorted(used & hidden)]
    assert bad == [], bad


# ---- ceilings the pages have reached: lower each as pages are split, never raise it

LONG_CELL_LINES, LONG_CELLS = 40, 10  # the goal: at most 10 exported cells over 40 lines
LONG_PROSE_WORDS = 150


def test_few_exported_cells_run_past_40_lines():
    "Exported cells over 40 lines (non-blank, `#|` lines not counted) stay at or under the ceiling; 99_api is a list."
    long = [
        f'{nb.name} cell {i}: {n} lines'
        for nb in notebooks()
        if nb.name != '99_api.ipynb'
        for i, s in exported_cells(nb)
        if s is not None
        for n in [sum(1 for line in s.splitlines() if line.strip() and not line.lstrip().startswith('#|'))]
        if n > LONG_CELL_LINES
    ]
    assert len(long) <= LONG_CELLS, '\n'.join(long)


def prose_words(s: str) -> int:
    "Words of markdown `s` outside its tables and fenced code blocks: a table's rows and a block's lines are not prose."
    fenced, words = False, 0
    for line in s.splitlines():
        if line.lstrip().startswith('```'):
            fenced = not fenced
        elif not fenced and not line.lstrip().startswith('|'):
            words += len(line.split())
    return words


def test_no_markdown_cell_runs_past_150_words_of_prose():
    "A markdown cell holds at most 150 words of prose: a longer one becomes shorter cells, bullets or a table."
    long = [
        f'{nb.name} cell {i} ({c.get("id")}): {n} words'
        for nb in notebooks()
        for i, c in enumerate(cells(nb))
        if c['cell_type'] == 'markdown'
        for n in [prose_words(src(c))]
        if n > LONG_PROSE_WORDS
    ]
    assert long == [], '\n'.join(long)


def test_cell_ids_are_unique_in_each_notebook():
    "nbdev marks each exported cell by its notebook's cell id, and tools/nbtext refuses a page that repeats one."
    import collections
    import json

    repeated = {
        nb.name: ids
        for nb in notebooks()
        if (
            ids := [
                k
                for k, n in collections.Counter(c.get('id') for c in json.loads(nb.read_text())['cells']).items()
                if n > 1
            ]
        )
    }
    assert repeated == {}, repeated


# ---- each page opens with its one call: after its why, on a real checkpoint, before the machinery

# The public function or class a reader comes to each page for. A page with no call is exempt, with the reason.
ONE_CALL = {
    '00_checkpoints': 'smollm2_checkpoint',
    '00b_ct2_whisper': 'write_hf_whisper',
    '01_safetensors': 'checkpoint_source',
    '01b_io': 'read_direct',
    '01c_upstream': 'reach',
    '02_loading': 'load_from_source',
    '03_load_model': 'load_model',
    '03b_reconcile': 'checkpoint_dtype',
    '03c_refit': 'refit',
    '04_convert': 'converted_source',
    '05_mla': 'MLAAttention',
    '06_quantized': 'load_model',  # a quantized checkpoint, dequantized and kept
    '06b_gguf': 'load_model',  # a GGUF file
    '06c_float_formats': 'load_model',  # a checkpoint of the page's family: compressed-tensors
    '06d_int_formats': 'load_model',  # a checkpoint of the page's family: GPTQ
    '06e_gguf_blocks': 'dequantize_gguf',
    '07_tensor_parallel': 'load_model',  # at one rank of two
    '08_detokenize': 'TextOutput',
    '08b_detokenizers': 'TextChunkDetokenizer',
    '09_kv': 'kv_cache_pool',
    '09b_kv_figures': 'plot_kv',
    '09c_kv_pools': 'plan_kv_pools',
    '10_generation': 'load_generation_defaults',
    '10b_languages': 'base_language',
    '11_speech': 'transcribe',
    '12_report': 'checkpoint_report',
    '12b_explore': 'explore',
    '12c_explore_weights': 'weight_stats',
    '12d_explore_render': 'exploration_text',
    '14_cli': 'inspect',
    '98_testing': 'save_tiny',
    '98b_testing_formats': 'write_quantized_checkpoint',
    'index': 'load_model',  # the README's example
    '13_benchmarks': None,  # the published results of benchmarks/bench_load.py, read from its JSON: no call of ours
    '15_main': None,  # `python -m mstar_utils`: a command, run in a subprocess, and no function
    '99_api': None,  # the list of every public name: it exports the names, and calls none
}

HIDDEN_CELL = re.compile(r'^\s*#\|\s*(export[is]?|hide)\b', re.M)


def calls(s: str, name: str) -> bool:
    "Whether code `s` calls `name`: `name(...)`, `x.name(...)` or `name.method(...)`."
    code = '\n'.join(line for line in s.splitlines() if not line.lstrip().startswith(('#|', '%', '!')))
    for n in ast.walk(ast.parse(code)):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and f.attr == name:
            return True
        while isinstance(f, ast.Attribute):
            f = f.value
        if isinstance(f, ast.Name) and f.id == name:
            return True
    return False


def first_definition(nb: Path) -> int:
    "Index of the first exported cell of `nb` that defines something (the machinery), or its cell count if none."
    for i, s in exported_cells(nb):
        code = '\n'.join(line for line in (s or '').splitlines() if not line.lstrip().startswith('#|'))
        if s is not None and any(not isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.parse(code).body):
            return i
    return len(cells(nb))


def test_one_call_table_names_every_page():
    pages = {nb.stem for nb in notebooks()}
    assert (sorted(pages - set(ONE_CALL)), sorted(set(ONE_CALL) - pages)) == ([], []), (
        '(pages not listed, listed not pages)'
    )


def test_each_page_shows_its_one_call_within_its_first_quarter():
    """The first shown code cell that calls the page's one call comes within the first quarter of its cells, or, on a
    page whose title and imports alone fill that quarter, before its machinery (its first exported definition)."""
    bad = []
    for nb in notebooks():
        name = ONE_CALL.get(nb.stem)
        if name is None:
            continue
        cs = cells(nb)
        at = next(
            (
                i
                for i, c in enumerate(cs)
                if c['cell_type'] == 'code' and not HIDDEN_CELL.search(src(c)) and calls(src(c), name)
            ),
            None,
        )
        machinery = first_definition(nb)
        if at is None or (at > len(cs) / 4 and at > machinery):
            bad.append(
                f'{nb.name}: the first shown call of {name} is cell {at} of {len(cs)}: past the first quarter '
                f'(cell {len(cs) / 4:g}) and after the first exported definition (cell {machinery}); add an opening '
                'call cell after the imports'
            )
    assert bad == [], '\n'.join(bad)


def test_every_tool_answers_help_without_running():
    """Each script in tools/ prints its usage for `--help` and exits 0 at once: a newcomer's first try must not start
    the whole suite or build the engine's venv."""
    import subprocess
    import sys

    root = Path(mstar_utils.__file__).parent.parent
    tools = sorted(p for p in (root / 'tools').iterdir() if p.is_file() and p.suffix != '.txt')
    assert {'test', 'engine', 'window', 'nbrun', 'docs', 'readme'} <= {p.name for p in tools}
    for p in tools:
        cmd = (
            [sys.executable, str(p), '--help']
            if p.read_text().startswith('#!/usr/bin/env python')
            else [str(p), '--help']
        )
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=root)
        assert r.returncode == 0 and len(r.stdout.strip().splitlines()) >= 2, (p.name, r.returncode, r.stderr[-500:])
