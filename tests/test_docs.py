"""The documentation is part of the test suite.

- Every ```python fence whose first line is ``# migration-test: tool=NAME expected=LITERAL``
  (in ``docs/**/*.md`` and ``README.md``) runs in a fresh interpreter; its ``RESULT`` must
  equal the literal. Fences whose tool is not importable are skipped, with the reason.
  The site shows them without that scaffolding, with the output they print
  (``docs/gen_examples.py``, which owns the fence format; checked here and in the browser).
- ``mkdocs build --strict`` must succeed: no broken link, no missing API object.
- The errors page, generated from ``torchlens.errors``, must list every error class.

Fences run two at a time in background threads (each in its own interpreter), started
when the first fence test asks for its result, so the file costs about half the sum of
the fences rather than all of it.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE_TIMEOUT = 180


def _load_hook(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLES = _load_hook("gen_examples")  # the fence format, how the site shows a fence, how an example runs

# Executed in the child interpreter: run the example, print its RESULT as JSON.
CHILD = textwrap.dedent(
    """
    import json, runpy, sys
    ns = runpy.run_path(sys.argv[1], run_name="__main__")
    if "RESULT" not in ns:
        sys.exit("the example did not set RESULT")
    def norm(v):
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {str(k): norm(x) for k, x in v.items()}
        if hasattr(v, "item") and callable(v.item):
            try:
                return v.item()
            except Exception:
                pass
        return v
    print("__RESULT__" + json.dumps(norm(ns["RESULT"]), default=repr))
    """
)


@dataclasses.dataclass(frozen=True)
class Fence:
    """One tested example: where it is, what it needs, what it must produce."""

    path: pathlib.Path
    line: int
    tool: str
    expected: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def collect_fences(paths: list[pathlib.Path]) -> list[Fence]:
    """Every migration-test fence in the given Markdown files, in file order."""
    found = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for match, tool, code in EXAMPLES.fences(text):
            line = text.count("\n", 0, match.start()) + 1
            expected = EXAMPLES.HEADER.match(code.split("\n", 1)[0]).group(2).strip()
            found.append(Fence(path, line, tool, expected, code))
    return found


def doc_files() -> list[pathlib.Path]:
    files = sorted(DOCS.rglob("*.md"))
    readme = ROOT / "README.md"
    return files + ([readme] if readme.exists() else [])


def norm(value):
    """Tuples and lists compare alike, as in JSON."""
    if isinstance(value, (list, tuple)):
        return [norm(v) for v in value]
    if isinstance(value, dict):
        return {str(k): norm(v) for k, v in value.items()}
    return value


tool_available = EXAMPLES.tool_available


@dataclasses.dataclass
class Outcome:
    returncode: int
    result: object
    output: str
    seconds: float


def run_fence(fence: Fence, workdir: pathlib.Path) -> Outcome:
    """Run one fence in a fresh interpreter (this one's executable) and parse its RESULT."""
    import time

    stem = re.sub(r"\W", "_", fence.id)
    script = workdir / f"{stem}.py"
    script.write_text(fence.code, encoding="utf-8")
    runner = workdir / "_run_fence.py"
    if not runner.exists():
        runner.write_text(CHILD, encoding="utf-8")
    env = EXAMPLES.example_env(fence.tool)  # offline, one thread, a stand-in on the path (baukit)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(runner), str(script)], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=FENCE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return Outcome(-1, None, f"timed out after {FENCE_TIMEOUT}s", FENCE_TIMEOUT)
    seconds = time.perf_counter() - start
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("__RESULT__"):
            result = json.loads(line[len("__RESULT__"):])
    return Outcome(proc.returncode, result, (proc.stderr or proc.stdout)[-4000:], seconds)


FENCES = collect_fences(doc_files())


@pytest.fixture(scope="session")
def fence_pool(request, tmp_path_factory):
    """Start every selected, runnable fence at once; tests collect their own result."""
    here = sys.modules[__name__]
    selected = {item.callspec.params["fence"].id for item in request.session.items
                if getattr(item, "module", None) is here and getattr(item, "originalname", None) == "test_fence"}
    workdir = tmp_path_factory.mktemp("fences")
    workers = max(1, min(2, os.cpu_count() or 1))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    futures = {f.id: pool.submit(run_fence, f, workdir) for f in FENCES
               if f.id in selected and tool_available(f.tool)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("fence", FENCES, ids=[f.id for f in FENCES])
def test_fence(fence: Fence, fence_pool) -> None:
    if not tool_available(fence.tool):
        pytest.skip(f"{fence.id}: {fence.tool} is not importable here, so this example was not run")
    outcome = fence_pool[fence.id].result()
    want = norm(ast.literal_eval(fence.expected))
    assert outcome.returncode == 0, f"{fence.id} failed to run:\n{outcome.output}"
    assert outcome.result == want, (
        f"{fence.id}: RESULT was {outcome.result!r}, the page promises {want!r}\n{outcome.output}"
    )


def test_fences_were_found() -> None:
    """Guard the collector itself: the migration pages hold tested examples."""
    pages = {f.path.name for f in FENCES}
    for page in ("index.md", "coming-from-nnsight.md", "coming-from-baukit.md",
                 "coming-from-transformerlens.md", "intervention_explainers.md"):
        assert page in pages, f"no migration-test fence found in docs/{page}"


def test_fence_headers_are_valid() -> None:
    """A typo in an expected literal must fail loudly, not skip."""
    for fence in FENCES:
        ast.literal_eval(fence.expected)
        assert "RESULT" in fence.code, f"{fence.id} never sets RESULT"


# -- what the site shows of an example ------------------------------------------------------------


def test_the_site_shows_every_example_without_its_scaffolding() -> None:
    for fence in FENCES:
        shown = EXAMPLES.shown_code(fence.code)  # parses, or raises
        assert "migration-test" not in shown and "RESULT" not in shown, f"{fence.id} shows its test scaffolding"
        assert shown.strip(), f"{fence.id} shows nothing"


def test_shown_code_drops_the_header_the_result_and_what_only_held_it() -> None:
    code = textwrap.dedent("""\
        # migration-test: tool=torchlens expected=(1, 2)
        import torch
        x = torch.ones(2)
        print(x.sum())
        with torch.no_grad():
            RESULT = (1,
                      2)
        if True:
            y = 3
            RESULT = (y, 2)
        """)
    assert EXAMPLES.shown_code(code) == "import torch\nx = torch.ones(2)\nprint(x.sum())\nif True:\n    y = 3\n"
    tail = "# migration-test: tool=torchlens expected=1\nx = 1\nprint(x)\n# checks: the reference\nRESULT = x\n"
    assert EXAMPLES.shown_code(tail) == "x = 1\nprint(x)\n"
    with pytest.raises(SyntaxError):
        EXAMPLES.shown_code("# migration-test: tool=torchlens expected=1\nif True:\n# checks\n    RESULT = 1\n")


# -- what the pages say TorchLens has ------------------------------------------------------------


def _table_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]


def test_api_page_documents_patching_and_the_logit_lens() -> None:
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    import torchlens as tl

    for name in tl.patching.__all__:
        if name not in ("KINDS", "BATCHED_TOKENS", "CAUSAL_BATCHED_TOKENS", "logit_lens"):  # (in docs/patching.md)
            assert f"::: torchlens.patching.{name}\n" in api, f"tl.patching.{name} is missing from docs/api.md"
    assert "::: torchlens.logit_lens\n" in api


def test_transformerlens_page_maps_the_patching_grids_and_accumulated_resid() -> None:
    import torchlens as tl

    page = (DOCS / "coming-from-transformerlens.md").read_text(encoding="utf-8")
    rows = {row[0]: row[1] for row in _table_rows(page) if len(row) == 3}
    ours = {first: second for first, second in rows.items() if "get_act_patch" in first or "accumulated_resid" in first}
    assert any("get_act_patch_resid_pre" in k for k in ours) and any("accumulated_resid" in k for k in ours)
    for theirs, mapped in ours.items():
        assert mapped != "No equivalent", f"{theirs} has an equivalent: {mapped}"
    for name in re.findall(r"tl\.patching\.(\w+)", page):  # every name the page uses exists
        assert hasattr(tl.patching, name), f"the TransformerLens page names tl.patching.{name}, which does not exist"
    lacks = page.split("## What TransformerLens does that TorchLens does not", 1)[1].split("\n## ", 1)[0]
    assert "accumulated_resid" not in lacks and "the patching grids" not in lacks
    assert "get_act_patch_resid_pre" not in lacks  # the grids TorchLens has are not listed as missing


def _table_namespace() -> dict:
    """What the TransformerLens table's TorchLens calls name: a 4-block GPT-2, its traces, a tokenizer."""
    import torch
    import transformers
    from test_text_inputs import gpt2_style_tokenizer

    import torchlens as tl

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    trace = tl.trace(model, tokens)
    return {
        "tl": tl, "torch": torch, "model": model, "tokens": tokens, "trace": trace, "tok": gpt2_style_tokenizer(),
        "text": "The city of Paris is in France", "clean_trace": trace,
        "corrupted_trace": tl.trace(model, torch.tensor([[1, 2, 9, 4, 5, 6]])),
        "metric": tl.patching.logit_diff(3, 4), "a": 3, "b": 4, "i": 3, "k": 2,
        "site": tl.module("transformer.h.0.mlp"), "edit": tl.zero_ablate(), "attn_path": "transformer.h.0.attn",
        "stack": tl.decompose_resid(trace),
    }


def _resolves(code: str, roots: dict) -> bool | None:
    """Whether every attribute chain from a known root (``tl.patching.x``, ``trace.str_tokens``)
    exists; None when the code names no root."""
    import dataclasses as dc

    seen = False
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, ast.Attribute):
            continue
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in roots:
            continue
        seen, obj = True, roots[base.id]
        for attr in chain:
            fields = {f.name for f in dc.fields(obj)} if dc.is_dataclass(obj) else set()
            if not (hasattr(obj, attr) or attr in fields or attr in getattr(obj, "__annotations__", {})):
                return False
            obj = getattr(obj, attr, None)
            if obj is None:
                break
    return seen or None


def test_transformerlens_table_calls_run_or_resolve() -> None:
    """Every row of the TransformerLens table names a TorchLens call that runs (on a 4-block GPT-2)
    or, where it holds ``...`` or names the reader's own objects, whose every name exists."""
    import torchlens as tl

    page = (DOCS / "coming-from-transformerlens.md").read_text(encoding="utf-8")
    table = page.split("## Translation table", 1)[1].split("\n#", 1)[0]
    rows = [row for row in _table_rows(table) if len(row) == 3 and row[0] != "TransformerLens"]
    assert len(rows) >= 35
    namespace = _table_namespace()
    roots = {"tl": tl, "torchlens": tl, "trace": tl.Trace, "ctx": tl.EditContext}
    ran = 0
    for theirs, ours, notes in rows:
        checked = []
        for column, cell in ((0, ours), (1, notes)):
            for code in re.findall(r"`([^`]+)`", cell):
                try:
                    tree = ast.parse(code)
                except SyntaxError:
                    continue  # a fragment such as `.logits` or `fn(activation, *, ctx)`
                names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                if not names & roots.keys():
                    continue
                has_ellipsis = any(isinstance(n, ast.Constant) and n.value is Ellipsis for n in ast.walk(tree))
                if not has_ellipsis and names <= namespace.keys():
                    try:
                        exec(compile(tree, "<table>", "exec"), dict(namespace))
                    except Exception as err:  # noqa: BLE001 - the row's call must run
                        raise AssertionError(f"row {theirs}: {code} raised {type(err).__name__}: {err}") from err
                    ran += 1
                    checked.append(column)
                else:
                    assert _resolves(code, roots) is not False, f"row {theirs}: {code} names something missing"
                    checked.append(column)
        assert 0 in checked, f"row {theirs}: no TorchLens call in {ours!r} runs or resolves"
    assert ran >= 30, f"only {ran} of the table's calls ran"


# -- the seed examples are on the migration pages, verbatim ---------------------------------

SEEDS = ROOT.parent / "shared" / "acceptance" / "seed_fences"


def _seed_code(path: pathlib.Path) -> str:
    """The seed file without its '# Source:' provenance line, as it appears on a page."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("# Source:"))


@pytest.mark.skipif(not SEEDS.is_dir(), reason="no ../shared/acceptance/seed_fences beside the repository")
@pytest.mark.parametrize("seed", sorted(SEEDS.glob("*.py")) if SEEDS.is_dir() else [], ids=lambda p: p.name)
def test_seed_fence_is_on_a_page(seed: pathlib.Path) -> None:
    codes = {f.code for f in FENCES}
    assert _seed_code(seed) in codes, f"{seed.name} does not appear verbatim as a fence in docs/"


# -- the errors page cannot drift from the code -------------------------------------------------


def _gen_errors():
    return _load_hook("gen_errors")


def test_errors_page_lists_every_error_class() -> None:
    from torchlens.errors import all_error_classes

    text = _gen_errors().render(include_shims=False)
    for cls in all_error_classes():
        assert f"### {cls.__name__}\n" in text, f"{cls.__name__} is missing from the errors page"
        if cls.remedy:
            assert cls.remedy in text, f"the remedy of {cls.__name__} is missing from the errors page"


def test_errors_page_picks_up_a_new_class() -> None:
    """A class added to torchlens.errors appears without anyone touching the page."""
    import gc

    from torchlens import errors

    new = type("BrandNewError", (errors.EditError,), {
        "__doc__": "Raised by a feature written after this page.",
        "__module__": errors.__name__,
        "remedy": "Do the new thing instead.",
    })
    try:
        text = _gen_errors().render(include_shims=False)
        assert "### BrandNewError\n" in text and "Do the new thing instead." in text
    finally:
        del new  # drop the class so later all_error_classes() calls do not see it
        gc.collect()
    assert "BrandNewError" not in {c.__name__ for c in errors.all_error_classes()}


def test_errors_marker_is_on_the_page() -> None:
    assert _gen_errors().MARKER in (DOCS / "errors.md").read_text(encoding="utf-8")


# -- the site builds strictly ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_site():
    if not tool_available("mkdocs") or not tool_available("mkdocstrings_handlers"):
        pytest.skip("mkdocs / mkdocstrings-python are not installed (the docs extra)")
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", out],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        yield proc, pathlib.Path(out)


def test_mkdocs_build_strict(built_site) -> None:
    proc, _ = built_site
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"


def test_built_errors_page_has_every_class(built_site) -> None:
    from torchlens.errors import all_error_classes

    proc, site = built_site
    if proc.returncode != 0:
        pytest.skip("the site did not build; test_mkdocs_build_strict says why")
    html = (site / "errors" / "index.html").read_text(encoding="utf-8")
    for cls in all_error_classes():
        assert f'id="{cls.__name__.lower()}"' in html, f"{cls.__name__} has no section on the built errors page"
    assert 'id="errors-the-shims-add"' in html, "the shims' errors are missing from the errors page"
    assert "could not be imported while building this page" not in html, "a shim failed to import during the build"


def test_built_pages_show_no_scaffolding_and_the_printed_output(built_site) -> None:
    proc, site = built_site
    if proc.returncode != 0:
        pytest.skip("the site did not build; test_mkdocs_build_strict says why")
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 10
    for page in pages:
        html = page.read_text(encoding="utf-8")
        assert "migration-test" not in html, f"{page.relative_to(site)} shows a test marker"
        assert "RESULT" not in html, f"{page.relative_to(site)} shows an example's RESULT"
    tl_page = (site / "coming-from-transformerlens" / "index.html").read_text(encoding="utf-8")
    assert tl_page.count('<span class="filename">Output</span>') >= 2, "the TransformerLens page shows no output"
    assert "final_post" in tl_page.split('<span class="filename">Output</span>', 1)[1]  # printed labels


def test_built_api_page_documents_the_entry_points(built_site) -> None:
    proc, site = built_site
    if proc.returncode != 0:
        pytest.skip("the site did not build; test_mkdocs_build_strict says why")
    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("torchlens.trace", "torchlens.extract", "torchlens.Trace", "torchlens.Fork",
                 "torchlens.when", "torchlens.validate", "torchlens.patching.activation_patching",
                 "torchlens.patching.causal_trace", "torchlens.patching.attribution_patching",
                 "torchlens.patching.PatchingResult", "torchlens.logit_lens"):
        assert f'id="{name}"' in html, f"{name} is missing from the API reference"
