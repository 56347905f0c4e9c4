"""Packaging for mstar_utils. Every setting lives in settings.ini (nbdev 2 layout); this file only reads it."""

import shlex
from configparser import ConfigParser
from pathlib import Path

import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']
for key in ['lib_name', 'version', 'description', 'author', 'author_email', 'min_python', 'license']:
    if key not in cfg:
        raise SystemExit(f'settings.ini: missing setting {key!r}')


def _reqs(key):
    return shlex.split(cfg.get(key, ''))


checkpoints = _reqs('checkpoint_requirements')
readme = Path('README.md')
setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    author=cfg['author'],
    author_email=cfg['author_email'],
    keywords=cfg['keywords'],
    license='Apache-2.0',
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=[cfg['lib_path'], cfg['lib_path'] + '.*']),
    include_package_data=True,
    zip_safe=False,
    python_requires='>=' + cfg['min_python'],
    install_requires=_reqs('requirements'),
    extras_require={
        'checkpoints': checkpoints,
        'dev': checkpoints + _reqs('dev_requirements'),
        'bench': checkpoints + _reqs('bench_requirements'),
    },
    long_description=readme.read_text(encoding='utf-8') if readme.exists() else '',
    long_description_content_type='text/markdown',
    entry_points={
        'console_scripts': cfg.get('console_scripts', '').split(),
        'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
)
