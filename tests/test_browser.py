"""Browser checks (issue 59): headless Chromium, driven by Playwright, opens a tiny run's report and the built
documentation site as a reader would. The report: no console error, no request but the file itself, every curve
drawn, and the samples table's filters showing exactly the rows they choose. The site: no console error on its
pages, and its search finds a setting by name on the settings reference. Each check leaves a screenshot in the
folder ``$PURERL_SCREENSHOTS`` names (default: a pytest temp folder).

Skipped, with the reason, where no ``chromium`` is on PATH (``.ci/run`` installs Debian's) or Playwright is not
installed: Playwright drives that Chromium (it downloads no browser of its own). The site is built once with
``mkdocs build`` into a temp folder (or read from the folder ``$PURERL_SITE`` names) and served on 127.0.0.1:
the search's worker needs http, not file://."""

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urldefrag, urlsplit

import pytest

from purerl.report import write_report
from purerl.report.charts import CHARTS, series
from purerl.report.page import PHASES, right
from purerl.report.run_files import read_run

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("no chromium on PATH (Debian: apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra has it)")

ROOT = Path(__file__).resolve().parents[1]
VIEWPORT = {"width": 1280, "height": 800}
SETTINGS_PAGE = "reference/settings/"
"""The generated settings reference, relative to the site's root (mkdocs' directory URLs)."""


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("PURERL_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def opened(browser, allowed):
    """A page in a fresh context, and the list of what went wrong in it: console errors, uncaught exceptions,
    dialogs (dismissed) and requests whose URL ``allowed`` refuses (aborted). Every request is routed."""
    context = browser.new_context(viewport=VIEWPORT)
    problems: list[str] = []

    def route(handle):
        if allowed(handle.request.url):
            handle.continue_()
        else:
            problems.append(f"request for {handle.request.url} (refused: a page of ours fetches nothing from outside)")
            handle.abort()

    def console(message):
        if message.type == "error":
            where = message.location
            problems.append(f"console error: {message.text} ({where.get('url')}:{where.get('lineNumber')})")

    def dialog(box):
        problems.append(f"{box.type} dialog: {box.message}")
        box.dismiss()

    context.route("**/*", route)
    page = context.new_page()
    page.on("console", console)
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.on("dialog", dialog)
    try:
        yield page, problems
    finally:
        context.close()


# --- the report ------------------------------------------------------------------------------------------------

CURVES = """() => [...document.querySelectorAll('.charts svg')].map(svg => {
  const box = svg.getBoundingClientRect(), lines = [...svg.querySelectorAll('polyline')];
  return {title: svg.getAttribute('aria-label'), width: box.width, height: box.height,
          lines: lines.map(l => { const b = l.getBBox(); return [l.points.numberOfItems, b.width + b.height]; })};
})"""
VISIBLE_ROWS = """() => [...document.querySelectorAll('#samples tbody tr')].filter(tr => tr.checkVisibility())
  .map(tr => [...tr.cells].map(td => td.textContent))"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A run of the tiny model: 3 steps of a few samples, held-out evaluations before and after; its report."""
    from tests.jobs import SMALL, run_job

    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    run_job(["--tiny", "--steps", "3", *SMALL, "--eval-every", "3", "--checkpoint-every", "0",
             "--out-dir", str(run_dir)])
    write_report(run_dir)
    return run_dir


def _expected_charts(run_dir: Path) -> list[str]:
    files = read_run(run_dir)
    rows = ([{"step": 0, **files.baseline}] if files.baseline else []) + files.metrics
    return [chart.title for chart in CHARTS if any(series(rows, key) for key in chart.keys)]


def _check_filters(page, samples: list[dict]) -> None:
    """Each choice of the step, phase and answer filters, made in the page, shows exactly the rows of
    ``samples.jsonl`` it selects, in file order (their step, phase and mark cells as the table shows them), and
    the count line says so; some choice narrows the table without emptying it."""
    rows = [(str(row["step"]), str(row["phase"]), "1" if right(row) else "0") for row in samples]
    steps = sorted({step for step, _, _ in rows}, key=int)
    assert page.eval_on_selector_all("#f-step option", "os => os.map(o => o.value)") == ["", *steps]
    choices = [{"f-step": steps[1]}, {"f-phase": "eval"}, {"f-phase": "train"}, {"f-right": "1"}, {"f-right": "0"},
               {"f-step": steps[-1], "f-phase": "eval"}, {"f-step": steps[0], "f-right": "1"}, {}]
    narrowed = False
    for choice in choices:
        for control in ("f-step", "f-phase", "f-right"):
            page.select_option(f"#{control}", choice.get(control, ""))
        wanted = [(step, phase, ok) for step, phase, ok in rows
                  if choice.get("f-step", step) == step and choice.get("f-phase", phase) == phase
                  and choice.get("f-right", ok) == ok]
        shown = [(cells[0], cells[1], cells[6]) for cells in page.evaluate(VISIBLE_ROWS)]
        assert shown == [(step, PHASES.get(phase, phase), "✓" if ok == "1" else "✗") for step, phase, ok in wanted], \
            choice
        assert page.inner_text("#f-count") == f"{len(wanted)} of {len(rows)} rows", choice
        narrowed |= 0 < len(wanted) < len(rows)
    assert narrowed


@pytest.mark.slow
def test_a_tiny_runs_report_draws_its_curves_and_filters_its_samples(browser, tiny_run, screenshots):
    url = (tiny_run / "report.html").as_uri()
    requested: list[str] = []
    with opened(browser, allowed=lambda address: address.startswith("file:")) as (page, problems):
        page.on("request", lambda request: requested.append(request.url))
        page.goto(url)
        curves = page.evaluate(CURVES)
        assert [curve["title"] for curve in curves] == _expected_charts(tiny_run)
        for curve in curves:  # laid out, and each line of 2 points or more drawn over some extent
            assert curve["width"] > 300 and curve["height"] > 150 and curve["lines"], curve
            assert all(points >= 1 and (points == 1 or extent > 0) for points, extent in curve["lines"]), curve
        page.screenshot(path=screenshots / "report.png", full_page=True, clip={"x": 0, "y": 0, "width": 1280,
                                                                               "height": 1400})
        _check_filters(page, read_run(tiny_run).samples)
        page.select_option("#f-phase", "train")
        page.evaluate("document.querySelector('.filters').scrollIntoView(); window.scrollBy(0, -60)")
        page.screenshot(path=screenshots / "report_samples.png")
    assert not problems, "\n".join(dict.fromkeys(problems))
    assert requested == [url]  # the page fetches nothing: no style, script, font or image of its own


def test_the_answer_filter_separates_right_from_wrong_and_a_response_runs_no_script(browser, tmp_path):
    from tests.test_report import _run_folder  # held-out rows right and wrong, a response holding <script>

    run_dir = _run_folder(tmp_path / "run")
    url = write_report(run_dir).as_uri()
    with opened(browser, allowed=lambda address: address == url) as (page, problems):
        page.goto(url)
        _check_filters(page, read_run(run_dir).samples)
        assert "<script>alert('x')</script>" in page.inner_text("#samples")  # shown as text
    assert not problems, "\n".join(dict.fromkeys(problems))  # no alert among them


# --- the site --------------------------------------------------------------------------------------------------


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site served on 127.0.0.1: its root URL."""
    folder = os.environ.get("PURERL_SITE")
    if not folder:
        if not (ROOT / "mkdocs.yml").is_file():
            pytest.skip("no mkdocs.yml: no site to build")
        pytest.importorskip("material", reason="mkdocs-material is not installed")
        folder = tmp_path_factory.mktemp("site")
        done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "--no-strict", "--site-dir",
                               str(folder)],  # strictness is tests/test_docs.py's to check
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"mkdocs build failed:\n{done.stdout}{done.stderr}"
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _search(page, query: str) -> list[str]:
    """The links the site's search box lists for ``query``, typed into it as a whole."""
    box, meta = page.locator(".md-search__input"), page.locator(".md-search-result__meta")
    box.click()
    box.fill("")  # first emptied, so that the last query's results are not mistaken for this one's
    box.press("End")  # a key: its keyup runs the search
    meta.filter(has_text=re.compile("^Type to start")).wait_for(timeout=15_000)
    box.fill(query)
    box.press("End")
    meta.filter(has_text=re.compile("matching")).wait_for(timeout=15_000)  # "N matching documents", or none
    return page.locator(".md-search-result a").evaluate_all("links => links.map(a => a.href)")


@pytest.mark.slow
def test_the_sites_search_finds_a_setting_by_name(browser, site, screenshots):
    """A setting's short name and its whole name each find the setting's own entry on the settings reference
    (a short name is found where the search splits words at dots: mkdocs.yml's search separator)."""
    settings = urlsplit(site + SETTINGS_PAGE).path
    with opened(browser, allowed=lambda address: address.startswith(site)) as (page, problems):
        page.goto(site, wait_until="networkidle")
        for name in ("clip_high", "max_new_tokens", "actor.clip_high"):
            found = [urlsplit(link) for link in _search(page, name)]
            assert any(link.path == settings and link.fragment.endswith(name.rpartition(".")[2]) for link in found), \
                (f"searching {name} finds no link to its entry on {SETTINGS_PAGE} (does the search separator split "
                 f"at dots?): {[link.geturl() for link in found]}")
        page.screenshot(path=screenshots / "site.png")  # the whole name's results over the home page
    assert not problems, "\n".join(dict.fromkeys(problems))


FIRST_PAGES = """() => [...document.querySelectorAll('.md-nav--primary > .md-nav__list > .md-nav__item')]
  .map(item => item.querySelector('a.md-nav__link[href]')).filter(link => link).map(link => link.href)"""
"""The first page of each top-level entry of the site's navigation."""


@pytest.mark.slow
def test_the_sites_pages_open_without_console_errors(browser, site):
    """The first page of each section of the navigation, and the settings reference (the whole site takes half a
    minute more: the API reference alone is 2.5 MB)."""
    with opened(browser, allowed=lambda address: address.startswith(site)) as (page, problems):
        page.goto(site)
        pages = list(dict.fromkeys([*(urldefrag(link).url for link in page.evaluate(FIRST_PAGES)),
                                    site + SETTINGS_PAGE]))
        assert len(pages) > 3, pages
        for address in pages:
            response = page.goto(address)
            assert response is not None and response.ok and page.locator("article").count() == 1, address
            if address == site + SETTINGS_PAGE:
                assert "actor.clip_high" in page.inner_text("article")
    assert not problems, "\n".join(dict.fromkeys(problems))
