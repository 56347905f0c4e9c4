"""The documentation site, as a reader gets it: `tools/docs` builds it into _docs/, a local HTTP server serves it,
and headless Chromium (Debian's `chromium`, driven by Playwright) opens every page.

Checks: every notebook in nbs/ has a page and a sidebar entry; every page loads with no console error, no failed
or 4xx/5xx request and no request to another host; every module page shows the `show_doc` entry of each public
function and class of its module; at least one plot is shown and every image loads; every local link resolves
(links into the published site, `website.site-url`, are checked against the local copy) and lands on its anchor.
A screenshot of the loading page, at its first API entry, goes to screenshots/ (git-ignored).

Needs /usr/bin/chromium (`apt-get install -y chromium`, which tools/test does) and playwright (a dev requirement;
never `playwright install`: the browser is Debian's). The README check needs neither.
"""

import functools
import http.server
import inspect
import importlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urldefrag, urlsplit

import pytest
import yaml
from conftest import cells, notebooks, src

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / '_docs'
NBS = ROOT / 'nbs'
SHOTS = ROOT / 'screenshots'
CHROMIUM = os.environ.get('MSTAR_CHROMIUM', '/usr/bin/chromium')
FLAGS = [
    '--headless',
    '--no-sandbox',
    '--disable-gpu',
    '--disable-background-networking',
    '--no-first-run',
    '--disable-quic',
    '--disable-component-update',
    '--disable-sync',
]
SITE_URL = yaml.safe_load((ROOT / '_quarto.yml').read_text())['website']['site-url'].rstrip('/') + '/'
LOADING_NB = '02_loading.ipynb'  # the page the screenshot shows
EXPLORE_NB = '12b_explore.ipynb'  # explore's HTML: screenshot, and its tree collapses


def page_of(nb: Path) -> str:
    "The page nbdev gives a notebook (`02_loading.ipynb` -> `loading.html`), the name its links point at."
    from nbdev.doclinks import _nbpath2html

    return _nbpath2html(nb.relative_to(NBS)).as_posix()


def module_of(nb: Path) -> str | None:
    "The module a notebook exports to, from its `#| default_exp`."
    for c in cells(nb):
        m = re.search(r'^#\|\s*default_exp\s+(\S+)', src(c), re.M) if c['cell_type'] == 'code' else None
        if m:
            return f'mstar_utils.{m[1]}'
    return None


def public_api(module: str) -> list[str]:
    "The functions and classes a module defines and exports: each gets a `show_doc` entry on its page."
    mod = importlib.import_module(module)
    return [
        n
        for n in getattr(mod, '__all__', [])
        if (inspect.isfunction(o := getattr(mod, n)) or inspect.isclass(o))
        and getattr(o, '__module__', None) == module
        and getattr(o, '__qualname__', None) == n
    ]


# ---------------------------------------------------------------- checks that need no browser


def test_site_url_matches_settings():
    "nbdev writes its links from settings.ini's doc_host + doc_baseurl; the site's own address must be the same."
    from nbdev.config import get_config

    cfg = get_config(path=ROOT)
    assert (cfg.doc_host.rstrip('/') + '/' + cfg.doc_baseurl.strip('/') + '/') == SITE_URL, (
        cfg.doc_host,
        cfg.doc_baseurl,
        SITE_URL,
    )


def test_readme_in_sync():
    "README.md is what tools/readme makes of nbs/index.ipynb."
    r = subprocess.run(
        [sys.executable, str(ROOT / 'tools' / 'readme'), '--check'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_readme_reaches_its_first_command_soon():
    "A reader meets the first command within 400 words: the set-up, the example and the features come after it."
    words = len((ROOT / 'README.md').read_text(encoding='utf-8').split('```')[0].split())
    assert words <= 400, f'README.md has {words} words before its first code block; 400 at most'


def test_ci_runs_the_readme_test_command():
    "`.ci/run` runs the README's test command verbatim, so the command a reader copies is the one CI proves."
    ci = (ROOT / '.ci' / 'run').read_text(encoding='utf-8').strip().splitlines()[-1]
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    assert f'```sh\n{ci}\n```' in readme, f'.ci/run runs {ci!r}, which README.md does not show as its own block'


def test_notebooks_saved_with_outputs():
    "The pages show saved results, so a notebook with code is committed executed (tools/nbrun), outputs kept."
    bare = [
        nb.name
        for nb in notebooks()
        if any(c['cell_type'] == 'code' and src(c).strip() for c in cells(nb))
        and not any(c.get('outputs') for c in cells(nb) if c['cell_type'] == 'code')
    ]
    assert not bare, f'saved without outputs (run tools/nbrun on them): {bare}'


# ---------------------------------------------------------------- the site in a browser


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    "A local server that stays silent when the browser drops a connection it no longer needs (a cancelled request)."

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture(scope='module')
def site():
    "Build the site with tools/docs, serve _docs/ on 127.0.0.1 for this module's tests, then stop the server."
    t = time.time()
    r = subprocess.run(
        [sys.executable, str(ROOT / 'tools' / 'docs')], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if r.returncode:
        pytest.fail(f'tools/docs failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}', pytrace=False)
    print(f'tools/docs: {time.time() - t:.0f} s')
    server = _Server(('127.0.0.1', 0), functools.partial(_Quiet, directory=str(DOCS)))
    server.timeout = 5
    thread = threading.Thread(target=server.serve_forever, kwargs={'poll_interval': 0.1}, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{server.server_address[1]}/'
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


PAGE_JS = """() => {
  const api = [...document.querySelectorAll('.cell-output-markdown')]
    .filter(d => d.querySelector('h2,h3,h4') && d.querySelector('pre'));
  const imgs = [...document.images].map(i => ({src: i.src.slice(0, 60),
      ok: i.complete && i.naturalWidth > 0 && i.naturalHeight > 0,
      w: i.naturalWidth, h: i.naturalHeight, output: !!i.closest('.cell-output')}));
  return {
    title: document.title,
    ids: [...document.querySelectorAll('[id],a[name]')].map(e => e.id || e.name),
    hrefs: [...document.querySelectorAll('a[href]')].map(a => a.href),
    sidebar: [...document.querySelectorAll('#quarto-sidebar a.sidebar-link')].map(a => a.href),
    api: api.map(d => d.querySelector('h2,h3,h4').textContent.trim()),
    outputs: document.querySelectorAll('.cell-output').length,
    imgs,
  };
}"""


@pytest.fixture(scope='module')
def crawl(site):
    "Open every page of the site in headless Chromium; collect what each page did and holds."
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail('playwright is not installed: pip install -e ".[dev]" (never `playwright install`)', pytrace=False)
    if not Path(CHROMIUM).exists():
        pytest.fail(f'no Chromium at {CHROMIUM}: apt-get install -y chromium (tools/test does this)', pytrace=False)
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob('*.html') if 'site_libs' not in p.parts)
    local = urlsplit(site).netloc
    out = {}
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, timeout=60_000)
        try:
            ctx = browser.new_context(viewport={'width': 1280, 'height': 900})
            current: dict = {}

            def route(r):
                if urlsplit(r.request.url).netloc == local:
                    r.continue_()
                else:
                    current['external'].append(r.request.url)
                    r.abort()

            ctx.route('**/*', route)
            for name in pages:
                current = {'console': [], 'errors': [], 'failed': [], 'bad': [], 'external': []}
                page = ctx.new_page()
                page.on(
                    'console',
                    lambda m, c=current: (
                        m.type == 'error' and c['console'].append(f'{m.text} at {m.location.get("url")}')
                    ),
                )
                page.on('pageerror', lambda e, c=current: c['errors'].append(str(e)))
                page.on(
                    'requestfailed',
                    lambda r, c=current: (
                        urlsplit(r.url).netloc == local and c['failed'].append(f'{r.url} ({r.failure})')
                    ),
                )
                page.on('response', lambda r, c=current: r.status >= 400 and c['bad'].append(f'{r.status} {r.url}'))
                resp = page.goto(site + name, wait_until='load', timeout=30_000)
                page.wait_for_timeout(200)  # deferred scripts, and any error they log
                current.update(status=resp.status if resp else None, **page.evaluate(PAGE_JS))
                if name == page_of(NBS / LOADING_NB):
                    entry = page.locator('.cell-output-markdown:has(h3)').first
                    if entry.count():
                        entry.evaluate('e => window.scrollTo(0, e.getBoundingClientRect().top + window.scrollY - 140)')
                        page.wait_for_timeout(200)
                    page.screenshot(path=str(SHOTS / 'docs_loading.png'))
                if name == page_of(NBS / EXPLORE_NB):
                    current['explore'] = _explore_check(page)
                out[name] = current
                page.close()
        finally:
            browser.close()
    return site, out


def _explore_check(page) -> dict:
    """Screenshot explore's first output at its module tree; click the tree's root row and say whether it closed, and
    opened again."""
    root = page.locator('.mstar-explore details details').first  # inside section 1, the tree's first level (open)
    out = {'outputs': page.locator('.mstar-explore').count(), 'rows': page.locator('.mstar-explore details').count()}
    if not root.count():
        return out
    root.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / 'docs_explore.png'))
    summary = root.locator('summary').first
    out['open'] = [root.evaluate('e => e.open')]
    summary.click()
    out['open'].append(root.evaluate('e => e.open'))
    out['hidden_after_close'] = not root.locator('details').first.is_visible()
    summary.click()
    out['open'].append(root.evaluate('e => e.open'))
    return out


def test_explore_page_tree_collapses(crawl):
    """explore's HTML renders on its page (SmolLM2, Whisper, the fp8 MoE), and a click on a tree row closes it and
    opens it again."""
    _, pages = crawl
    ex = pages[page_of(NBS / EXPLORE_NB)].get('explore') or {}
    assert ex.get('outputs', 0) >= 3 and ex.get('rows', 0) > 20, ex
    assert ex.get('open') == [True, False, True] and ex.get('hidden_after_close'), ex
    shot = SHOTS / 'docs_explore.png'
    assert shot.is_file() and shot.stat().st_size > 20_000, f'{shot} missing or blank'


def test_every_notebook_has_a_page_in_the_sidebar(crawl):
    site, pages = crawl
    want = {page_of(nb) for nb in notebooks()}
    assert want <= set(pages), f'notebooks with no page: {sorted(want - set(pages))}'
    for name, p in pages.items():
        listed = {h.removeprefix(site) for h in p['sidebar']}
        assert want <= listed, f'{name}: the sidebar misses {sorted(want - listed)}'


def test_pages_load_without_console_errors(crawl):
    site, pages = crawl
    problems = {
        n: {k: p[k] for k in ('console', 'errors', 'failed', 'bad', 'external') if p[k]}
        | ({'status': p['status']} if p['status'] != 200 else {})
        for n, p in pages.items()
    }
    problems = {n: v for n, v in problems.items() if v}
    assert not problems, json.dumps(problems, indent=1)


def test_api_entries_present(crawl):
    "Each module's page shows a `show_doc` entry (heading, signature, docstring) for each public function and class."
    _, pages = crawl
    missing, checked = {}, 0
    for nb in notebooks():
        if not (mod := module_of(nb)):
            continue
        shown, want = pages[page_of(nb)]['api'], public_api(mod)
        if not want:
            continue  # a module of re-exports only, such as the package's __init__
        assert shown, f'{page_of(nb)} (from {nb.name}, module {mod}) shows no API entry'
        if lost := [n for n in want if n not in shown]:
            missing[page_of(nb)] = lost
        checked += 1
    assert checked, 'no notebook exports a module'
    assert not missing, f'public functions/classes with no show_doc entry on their page: {missing}'


def test_a_plot_is_shown_and_every_image_loads(crawl):
    _, pages = crawl
    broken = {n: [i for i in p['imgs'] if not i['ok']] for n, p in pages.items()}
    assert not {n: b for n, b in broken.items() if b}, f'images that did not load: {broken}'
    plots = {n: sum(i['output'] for i in p['imgs']) for n, p in pages.items()}
    assert sum(plots.values()) >= 1, f'no page shows a plot (an image in a cell output): {plots}'


def local_links(crawl) -> list[tuple[str, str, str, str]]:
    "Each link to this site, relative or into `site-url`: (page it is on, href as found, local url, anchor)."
    site, pages = crawl
    out = []
    for name, p in pages.items():
        for href in sorted(set(p['hrefs'])):
            url, frag = urldefrag(href)
            if url.startswith(SITE_URL):
                url = site + url[len(SITE_URL) :]
            elif not url.startswith(site):
                continue
            out.append((name, href, url, frag))
    return out


def test_local_links_resolve(crawl):
    "Every link to this site, relative or into `site-url`, answers 200 from the local copy: no 404."
    status: dict[str, int] = {}
    bad = []
    for name, href, url, _ in local_links(crawl):
        if url not in status:
            try:
                with urllib.request.urlopen(url, timeout=10) as r:
                    status[url] = r.status
            except urllib.error.HTTPError as e:
                status[url] = e.code
        if status[url] != 200:
            bad.append(f'{name}: {href} -> {status[url]}')
    assert status, 'no local links found'
    assert not bad, '\n'.join(bad)


def test_link_anchors_exist(crawl):
    "A link to `page.html#name` lands on an element with that id (nbdev links names in backticks to their API entry)."
    site, pages = crawl
    bad = []
    for name, href, url, frag in local_links(crawl):
        path = url[len(site) :].split('?')[0]
        path = path + 'index.html' if path == '' or path.endswith('/') else path
        if frag and path in pages and frag not in pages[path]['ids']:
            bad.append(f'{name}: {href} -> no id {frag!r} on {path}')
    assert not bad, '\n'.join(bad)


def test_screenshot_of_loading_page(crawl):
    _, pages = crawl
    name = page_of(NBS / LOADING_NB)
    assert name in pages, f'no page {name} from nbs/{LOADING_NB}'
    assert pages[name]['api'], f'{name} shows no API entry'
    shot = SHOTS / 'docs_loading.png'
    assert shot.is_file() and shot.stat().st_size > 20_000, f'{shot} missing or blank'


def test_links_inside_the_site_are_relative(crawl):
    "No page links into the published site by its absolute address: the local copy is browsable on its own."
    _, pages = crawl
    absolute = {n: sorted({h for h in p['hrefs'] if h.startswith(SITE_URL)}) for n, p in pages.items()}
    absolute = {n: h[:5] for n, h in absolute.items() if h}
    assert not absolute, absolute


def test_no_page_shows_a_build_machine_path():
    "Outputs print names, never the paths of the machine that built the docs (home, cache, temp, checkout)."
    machine = [
        str(Path.home()),
        str(ROOT),
        '/tmp/',
        '/work/',
        '/root/',
        os.environ.get('MSTAR_UTILS_CACHE', '/nonexistent-cache'),
    ]
    found = {}
    for nb in notebooks():
        for c in cells(nb):
            for o in c.get('outputs', []):
                text = ''.join(o.get('text', '')) + ''.join(
                    ''.join(v) for k, v in o.get('data', {}).items() if k.startswith('text/')
                )
                hits = sorted({m for m in machine if m and m in text})
                if hits:
                    found.setdefault(nb.name, []).extend(hits)
    assert not found, found


ISSUE_REF = re.compile(r'(?<![\w/])(issues?\s*#?\d+|#\d{1,4}\b)', re.I)


def test_no_project_text_mentions_issue_numbers():
    "Notebooks, modules, tests, tools and the README speak of what the code does, not of tracker numbers."
    files = [
        *NBS.glob('*.ipynb'),
        *(ROOT / 'mstar_utils').glob('*.py'),
        *(ROOT / 'tests').glob('*.py'),
        *(ROOT / 'tools').iterdir(),
        *(ROOT / 'benchmarks').glob('*.py'),
        ROOT / 'README.md',
        *(ROOT / 'benchmarks').glob('*.md'),
    ]
    hits = {}
    for f in files:
        if not f.is_file() or f.name == Path(__file__).name:
            continue
        text = re.sub(r'https?://\S+', '', f.read_text(encoding='utf-8', errors='replace'))
        text = re.sub(r'"(image/png|image/jpeg)": "[^"]*"', '', text)  # base64 images
        found = sorted({m.group(0) for m in ISSUE_REF.finditer(text)} - {'#0'})
        if found:
            hits[f.name] = found[:5]
    assert not hits, hits
