"""What every benchmark script shares: the set-up that makes its fresh processes fair."""
from pathlib import Path


def byte_compile() -> str:
    "Write mstar_utils' .pyc files as `pip install` does, so a fresh process imports it as it imports transformers."
    import compileall

    import mstar_utils
    pkg = Path(mstar_utils.__file__).parent
    compileall.compile_dir(pkg, quiet=1)   # writes even under PYTHONDONTWRITEBYTECODE, which would leave us compiling per run
    return f'{pkg.name} byte-compiled before the runs (transformers: by pip at install)'
