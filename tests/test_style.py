"The package's style a linter does not check: lines of at most 120 characters, public docstrings of one line of at most 100."
import importlib
import inspect
from pathlib import Path

import mstar_utils

PKG = Path(mstar_utils.__file__).parent
MODULES = sorted(p.stem for p in PKG.glob('*.py') if p.stem not in ('_modidx', '__init__', '__main__'))


def test_no_package_line_over_120_characters():
    # nbdev writes each module's `__all__` itself, wrapping the names at 120 before its `__all__ = ` prefix
    long = [f'{m}.py:{n}' for m in MODULES for n, line in enumerate((PKG/f'{m}.py').read_text('utf-8').splitlines(), 1)
            if len(line) > 120 and not line.startswith('__all__ = [')]
    assert long == [], long


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
