"""The package's rooms: no import cycle among mstar_utils modules (lazy imports inside functions included), and no
module imports another module's private names."""

import ast
import inspect
import json
import re
from pathlib import Path

import mstar_utils

PKG = Path(mstar_utils.__file__).parent


def imports(path: Path) -> list[tuple[str, list[str]]]:
    "(mstar_utils module imported, names taken from it) for every import in `path`, at any depth."
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ''
            if node.level == 1 and mod:
                out.append((mod.split('.')[0], [a.name for a in node.names]))
            elif node.level == 1:
                out += [(a.name, []) for a in node.names]
            elif mod.startswith('mstar_utils.'):
                out.append((mod.split('.')[1], [a.name for a in node.names]))
            elif mod == 'mstar_utils':
                out += [(a.name, []) for a in node.names if (PKG / f'{a.name}.py').exists()]
        elif isinstance(node, ast.Import):
            out += [(a.name.split('.')[1], []) for a in node.names if a.name.startswith('mstar_utils.')]
    return out


# The core of the quantized formats loads its format families at its very end, once every name they import from it
# exists: their records fill its registry, and their names import from it too. These edges alone close a loop.
FAMILIES = {'quantized': {'quant_float', 'quant_int'}}


def graph() -> dict[str, set[str]]:
    mods = {p.stem: p for p in PKG.glob('*.py') if p.stem not in ('_modidx', '__init__', '__main__')}
    g = {m: {d for d, _ in imports(p) if d in mods and d != m} for m, p in mods.items()}
    return {m: deps - FAMILIES.get(m, set()) for m, deps in g.items()}


def test_the_quantized_core_loads_its_families_last():
    "The core's family imports are its last statements, the families stand on the core, and nothing else loops."
    tree = ast.parse((PKG / 'quantized.py').read_text(encoding='utf-8'))
    tail = [n.module for n in tree.body[-len(FAMILIES['quantized']) :] if isinstance(n, ast.ImportFrom)]
    assert set(tail) == FAMILIES['quantized'], tail
    assert sum(isinstance(n, ast.ImportFrom) and n.module in tail for n in tree.body) == len(tail)
    g = graph()
    for fam in FAMILIES['quantized']:
        assert 'quantized' in g[fam] and not {'quant_float', 'quant_int', 'gguf'} & g[fam], (fam, g[fam])


def test_a_new_format_touches_only_the_registry():
    """A toy format registered with one record is found by `quantized_tensors`, loads through its op, and is described
    by `explore.describe_format` with no edit anywhere else."""
    from dataclasses import dataclass
    from typing import ClassVar

    import torch

    from mstar_utils import quantized
    from mstar_utils.explore import describe_format
    from mstar_utils.sources import DictSource

    @dataclass(frozen=True)
    class Tenth(quantized.Dequantize):
        target_dtype: torch.dtype = torch.float32
        suffixes: ClassVar[tuple] = ('',)
        codes: ClassVar[tuple] = (torch.int8,)

        def out_shape(self, shapes):
            return tuple(shapes[0])

        def _one(self, ts):
            return ts[0].float() / 10

        def describe(self, dtypes):
            return f'tenths in {dtypes[0]}'

    def tenth_tensors(src, qc, dtype, what, names):
        return [quantized.quantized_unit(src, k, Tenth(dtype), what) for k in src.keys() if src.dtype(k) == torch.int8]  # noqa: SIM118

    codes = torch.arange(-3, 3, dtype=torch.int8).view(2, 3)
    src, config = DictSource({'m.weight': codes}), {'quantization_config': {'quant_method': 'tenth'}}
    before = dict(quantized._FORMATS)
    try:
        quantized.register_format(quantized.QuantFormat('tenth', tenth_tensors, (Tenth,), 'int8 codes, a tenth each'))
        (u,) = quantized.quantized_tensors(src, config, torch.float32)
        assert (u.target, type(u.op), u.dtypes) == ('m.weight', Tenth, [torch.int8])
        assert describe_format(u.op, u.dtypes) == 'tenths in torch.int8'
        (rule,) = quantized.quantized_conversions(src, config, torch.float32)
        assert torch.equal(rule.operations[0].apply([codes]), codes.float() / 10)
    finally:
        quantized._FORMATS.clear()
        quantized._FORMATS.update(before)
    try:
        quantized.quantized_tensors(src, config)
    except NotImplementedError as e:  # unregistered again: refused, naming the formats there are
        assert "quant_method 'tenth' is not supported ('fp8', " in str(e) and "'bitsandbytes'" in str(e), e
    else:
        raise AssertionError('an unregistered quant_method loaded')
    assert '__name__' not in inspect.getsource(describe_format)  # the op describes itself: no class names compared


def test_no_import_cycle():
    g, state, cycles = graph(), {}, []

    def visit(m, path):
        state[m] = 'open'
        for d in sorted(g[m]):
            if state.get(d) == 'open':
                cycles.append(path[path.index(d) :] + [d] if d in path else path + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 'done'

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == [], cycles
    assert 'io' in g and g['io'] == set()  # the reader engine stands on its own, at the bottom
    assert 'sources' in g and g['sources'] == {'io'}  # the safetensors room stands on the engine alone


def test_no_module_imports_another_modules_private_names():
    bad = [
        f'{p.name}: {n} from {d}'
        for p in PKG.glob('*.py')
        if p.stem != '_modidx'
        for d, names in imports(p)
        for n in names
        if n.startswith('_') and not n.startswith('__')
    ]
    assert bad == [], bad


def test_the_cli_only_formats():
    "cli.py defines no loading, converting or planning of its own: its imports from the package are the rooms that do."
    deps = {d for d, _ in imports(PKG / 'cli.py')}
    assert deps <= {'report', 'speech', 'kv_figures', 'checkpoints', 'explore', '__init__'}, deps
    src = (PKG / 'cli.py').read_text(encoding='utf-8')
    for word in ('load_weights', 'read_header', 'init_empty_weights', 'WeightConverter', 'plan_kv_pools'):
        assert word not in src, word


def test_one_concept_rooms_stand_in_layers():
    """The rooms split out of a larger one sit below or beside it, never above: the language codes stand on their
    own, the CTranslate2 converter on the safetensors room alone (for `read_json`), the checkpoint cache builds on the
    converter, the KV figures on the KV planner; the detokenizers and the KV pools on no room, below the streaming
    and KV rooms; GGUF's block decoders on the quantized core and the page handling alone, below the GGUF room;
    what settles a checkpoint that disagrees with its config below `load_model`."""
    g = graph()
    assert g['ct2_whisper'] == {'sources'} and g['languages'] == set(), (g['ct2_whisper'], g['languages'])
    assert g['checkpoints'] == {'ct2_whisper'}, g['checkpoints']
    assert g['kv_figures'] == {'kv'} and 'kv_figures' not in g['kv'], (g['kv_figures'], g['kv'])
    assert not {'languages', 'kv_figures'} & g['generation'], g['generation']
    assert g['detokenizers'] == set() and 'detokenizers' in g['detokenize'], (g['detokenizers'], g['detokenize'])
    assert g['kv_pools'] == set() and 'kv_pools' in g['kv'], (g['kv_pools'], g['kv'])
    assert g['gguf_blocks'] == {'quantized', 'io'} and 'gguf_blocks' in g['gguf'], (g['gguf_blocks'], g['gguf'])
    assert 'model' not in g['reconcile'] and 'reconcile' in g['model'], (g['reconcile'], g['model'])


def test_explore_rooms_stand_in_layers():
    """explore's three rooms: the rendering knows no section (it stands on `convert` alone, for `listed`), the files
    and weights room builds on it, and explore on both; neither room below imports explore."""
    g = graph()
    assert g['explore_render'] == {'convert'}, g['explore_render']
    assert 'explore_render' in g['explore_weights'] and 'explore' not in g['explore_weights'], g['explore_weights']
    assert {'explore_weights', 'explore_render'} <= g['explore'], g['explore']


# the one function that parses a checkpoint's JSON files
JSON_READERS = {('io', 'read_json')}


def own_nodes(fn):
    "The nodes of function `fn`, without those of the functions defined inside it."
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += ast.iter_child_nodes(n)


def reads_a_file(node) -> bool:
    "Whether expression `node` reads a file: `.read_text()`, `.read_bytes()` or `open()`."
    return node is not None and any(
        isinstance(c, ast.Call)
        and (
            isinstance(c.func, ast.Attribute)
            and c.func.attr in ('read_text', 'read_bytes')
            or ast.unparse(c.func) == 'open'
        )
        for c in ast.walk(node)
    )


def from_file(node, read: set) -> bool:
    "Whether expression `node` reads a file, or uses a name in `read` (one that holds what a file read gave)."
    return reads_a_file(node) or any(isinstance(x, ast.Name) and x.id in read for x in ast.walk(node))


def json_file_parses(path: Path) -> list[tuple[str, int]]:
    "(function, line) of each `json.load` in `path`, and each `json.loads` of what a file read gave in that function."
    out = []
    for fn in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        nodes = sorted((n for n in own_nodes(fn) if hasattr(n, 'lineno')), key=lambda n: (n.lineno, n.col_offset))
        read = set()  # the names holding a file's contents, or what was made of them (`raw.decode()`)
        for n in nodes:
            if isinstance(n, ast.Assign) and from_file(n.value, read):
                read |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            parse = isinstance(n, ast.Call) and ast.unparse(n.func) in ('json.load', 'json.loads')
            if parse and (n.func.attr == 'load' or (n.args and from_file(n.args[0], read))):
                out.append((getattr(fn, 'name', '<lambda>'), n.lineno))
    return out


def test_a_checkpoints_json_files_are_read_by_read_json():
    """No module parses a JSON file it reads itself: config, generation, tokenizer and index files all go through
    `io.read_json` (which `sources` re-exports), so a broken one is named with the same reasons wherever it is read."""
    bad = [
        f'{p.name}:{line} ({fn})'
        for p in sorted(PKG.glob('*.py'))
        if p.stem != '_modidx'
        for fn, line in json_file_parses(p)
        if (p.stem, fn) not in JSON_READERS
    ]
    assert bad == [], bad
    assert [fn for fn, _ in json_file_parses(PKG / 'io.py')] == ['read_json']  # the check sees the one reader


INTERNAL = re.compile(
    r'(?:from|import)\s+transformers\.(?:integrations|core_model_loading|conversion_mapping|cache_utils|initialization'
    r'|modeling_gguf_pytorch_utils|modeling_utils)\b'
    r'|from\s+transformers[\w.]*\s+import\s+\(?\s*_\w'
    r'|\.(?:_get_dtype_plan|base_model_tp_plan|base_model_ep_plan|_dequantize_fp8_weight|_from_config'
    r'|all_tied_weights_keys|_is_hf_initialized|_is_expert_parallel|_model_mapping|_name_or_path)\b'
    r"|'(?:_keys_to_ignore_on_load_unexpected|_decode_special_floats|_detect_timestamp_from_logprob|_from_config"
    r"|_is_hf_initialized|all_tied_weights_keys)'"
    r'|\.past_key_values\b'  # the cache's name out of a forward changed in 5.25 (`output_cache`)
)


def code_of(path: Path) -> str:
    "A Python file's text, or a notebook's code cells joined."
    if path.suffix != '.ipynb':
        return path.read_text(encoding='utf-8')
    cells = json.loads(path.read_text(encoding='utf-8'))['cells']
    return '\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'code')


def test_transformers_internals_only_through_upstream():
    """Every private or version-dependent transformers name goes through `mstar_utils.upstream` (nbs/01c_upstream),
    so that a release that moves one fails there, by name, at both ends of the supported window."""
    root = PKG.parent
    files = [*PKG.glob('*.py'), *(root / 'tests').rglob('*.py'), *(root / 'nbs').glob('*.ipynb')]
    files += [*(root / 'benchmarks').glob('*.py')]
    door = {PKG / 'upstream.py', root / 'nbs' / '01c_upstream.ipynb', Path(__file__)}
    bad = [f'{p.relative_to(root)}: {m[0]}' for p in files if p not in door for m in INTERNAL.finditer(code_of(p))]
    assert bad == [], bad


SOURCE_MEMBERS = 'read_many|get_slice|maps|mmap|reads_slices|bytes_read|threads|stored_in|resolve|borrowed|what'


def test_every_tensor_source_is_a_source_and_nobody_probes_one():
    """The loaders trust the `Source` protocol: every class of the package that serves tensors (has `get`, `shape`
    and `dtype`) is a `Source`, and no module asks a source whether it has one of the protocol's members."""
    import importlib
    import inspect

    from mstar_utils.sources import Source

    servers = []
    for f in sorted(PKG.glob('*.py')):
        if f.stem.startswith('_'):
            continue
        mod = importlib.import_module(f'mstar_utils.{f.stem}')
        for _, c in inspect.getmembers(mod, inspect.isclass):
            if c.__module__ == mod.__name__ and all(callable(getattr(c, m, None)) for m in ('get', 'shape', 'dtype')):
                servers.append(c)
    assert len(servers) >= 10, [c.__name__ for c in servers]
    assert [c.__qualname__ for c in servers if not issubclass(c, Source)] == []
    probe = re.compile(rf"(getattr|hasattr)\([^,()]+,\s*'({SOURCE_MEMBERS})'")
    found = [
        f'{f.name}:{i}'
        for f in PKG.glob('*.py')
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert found == [], found


def test_wrapper_stacks_reach_the_batched_reads(smol_ckpt):
    """A batched read through every kind of wrapper (renamed, converted, a rank's slices) ends in one `read_many` of
    the file source at the bottom, and gives the file's tensors."""
    import torch
    from safetensors import safe_open

    from mstar_utils.convert import converted_source
    from mstar_utils.sources import FileSource, RenamedSource, checkpoint_source
    from mstar_utils.tensor_parallel import ShardedSource, Sharding

    calls = []
    plain = FileSource.read_many

    def counted(self, pairs, progress=None, **kw):
        calls.append(len(pairs))
        return plain(self, pairs, progress, **kw)

    key = 'model.norm.weight'
    shard = json.loads((smol_ckpt / 'model.safetensors.index.json').read_text())['weight_map'][key]
    with safe_open(str(smol_ckpt / shard), framework='pt') as f:
        want = f.get_tensor(key)
    FileSource.read_many = counted
    try:
        bottom = checkpoint_source(smol_ckpt)
        stack = RenamedSource(ShardedSource(converted_source(bottom, []), Sharding({}, 0, 2)), {key: 'norm'})
        out = torch.empty_like(want)
        stack.read_many([('norm', out)])
        assert stack.bytes_read == bottom.bytes_read > 0 and stack.threads == bottom.threads
    finally:
        FileSource.read_many = plain
        bottom.close()
    assert calls == [1] and torch.equal(out, want), calls
