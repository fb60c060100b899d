"""The layer rules hold: the import-linter contracts of pyproject.toml pass (so a plain pytest
run enforces them, not only `make test`), and what they cannot see at run time holds too:
importing the registry reads nothing, and loading the bundled model and running a chunk loads
no training code or training data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> dict:
    """Run `code` in a fresh interpreter (nothing imported yet); it prints one JSON line last."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_contracts_hold():
    """`lint-imports` (the contracts in pyproject.toml) exits 0."""
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.is_file(), "import-linter is missing: pip install -e '.[dev]'"
    r = subprocess.run([str(exe), "--no-cache", "--no-logo"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


_WATCH = """
import json, os, sys
opened, scanned = [], []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        opened.append(os.fspath(args[0]))
    elif event == "os.scandir" and args and args[0] is not None:  # glob; imports use os.listdir
        scanned.append(os.fspath(args[0]))
sys.addaudithook(hook)
def loaded(*pkgs):
    return sorted(m for m in sys.modules if m.split(".")[:2] in [["avatarstream", p] for p in pkgs])
"""


def test_importing_the_registry_reads_nothing():
    """`import avatarstream.registry` loads no train/data module, opens no weights or
    config.json and lists no weights folder; the bundled models appear when first listed."""
    out = _python(_WATCH + """
import avatarstream.registry as registry
weights = str(registry.WEIGHTS_DIR)
r = {"modules": loaded("train", "data"),
     "opened": [p for p in opened if p.startswith(weights) and not p.endswith((".py", ".pyc"))],
     "scanned": [p for p in scanned if p.startswith(weights)]}
r["listed"] = registry.available_models()
print(json.dumps(r))
""")
    assert out["modules"] == [] and out["opened"] == [] and out["scanned"] == [], out
    assert {"tiny-random", "small-random"} <= set(out["listed"])
    if (ROOT / "src" / "avatarstream" / "weights" / "avatarstream-small" / "config.json").is_file():
        assert "avatarstream-small" in out["listed"]


def test_loading_and_running_the_bundled_model_loads_no_training_code():
    """`load_model("avatarstream-small")` and a 1 s Pipeline.run (1 step) leave no
    `avatarstream.train` or `avatarstream.data` module in sys.modules."""
    if not (ROOT / "src" / "avatarstream" / "weights" / "avatarstream-small" / "config.json").is_file():
        pytest.skip("no bundled model")
    out = _python(_WATCH + """
import dataclasses, torch
from avatarstream.engine.pipeline import Pipeline
from avatarstream.media.synthetic import face_image, speechlike
from avatarstream.registry import load_model

class Sink:
    durable_frames = 0
    frames = 0
    def open(self, width, height, fps, sample_rate): pass
    def write_video(self, chunk): Sink.frames += len(chunk.frames)
    def write_audio(self, chunk): pass
    def close(self): pass
    def abort(self): pass

models = load_model("avatarstream-small")
cfg = dataclasses.replace(models.config, steps=1)
ref = torch.from_numpy(face_image(cfg.hr_size)).permute(2, 0, 1)[None]  # [1, 3, H, W] uint8
audio = iter(torch.from_numpy(speechlike(1.0)).split(3200))
Pipeline(models, cfg).run(ref, audio, [Sink()])
print(json.dumps({"modules": loaded("train", "data"), "frames": Sink.frames}))
""")
    assert out["frames"] == 25
    assert out["modules"] == [], out


# -- the command users run (issue 37) -------------------------------------------------------------
FORBIDDEN_IN_GENERATE = ("train", "data", "bench", "eval")

_RUN_CLI = """
import atexit, json, runpy, sys
out = sys.argv.pop(1)
def dump():
    with open(out, "w") as f:
        json.dump(sorted(m for m in sys.modules if m.startswith("avatarstream")), f)
atexit.register(dump)
sys.argv[0] = "avatarstream"
runpy.run_module("avatarstream.cli", run_name="__main__", alter_sys=True)  # what `python -m` does
"""


def _cli_modules(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `avatarstream ARGS` as `python -X importtime -m avatarstream.cli` runs it; the
    avatarstream modules it imported: those -X importtime reports, and those in sys.modules at
    exit (importtime does not report a module loaded by importlib.import_module itself)."""
    listed = tmp_path / "modules.json"
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", _RUN_CLI, str(listed), *args],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    timed = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    return r, {m for m in timed if m.startswith("avatarstream")} | set(json.loads(listed.read_text()))


def _under(modules: set[str], *packages: str) -> list[str]:
    return sorted(m for m in modules if m.split(".")[:2] in [["avatarstream", p] for p in packages])


def test_generate_as_users_run_it_loads_no_training_data_benchmark_or_evaluation(tmp_path):
    """`python -X importtime -m avatarstream.cli generate` (the default model, a real 1 s run at a
    non-square size, 1 step) imports no avatarstream.train/data/bench/eval module; nor does
    `generate --help`."""
    from avatarstream.media.image import write_png
    from avatarstream.media.synthetic import face_image, speechlike
    from avatarstream.bench.inputs import write_wav

    ref, wav = write_png(tmp_path / "ref.png", face_image(128)), write_wav(tmp_path / "a.wav", speechlike(1.0))
    r, modules = _cli_modules(tmp_path, "generate", "--help")
    assert r.returncode == 0 and "--reference" in r.stdout, r.stderr[-2000:]
    assert "avatarstream.cli_generate" in modules and _under(modules, *FORBIDDEN_IN_GENERATE) == []
    r, modules = _cli_modules(tmp_path, "generate", "--reference", str(ref), "--audio", str(wav),
                              "--out", str(tmp_path / "o.mp4"), "--size", "64x32", "--steps", "1",
                              "--no-progress", "--json")
    assert r.returncode == 0, [ln for ln in r.stderr.splitlines() if not ln.startswith("import time:")][-20:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["frames"] == 25
    assert "avatarstream.engine.pipeline" in modules  # it did run the model here
    assert _under(modules, *FORBIDDEN_IN_GENERATE) == [], _under(modules, *FORBIDDEN_IN_GENERATE)


def test_help_imports_no_command_and_bench_one_benchmark(tmp_path):
    """`avatarstream --help` lists every command from static text (no command's module
    imported); `bench realtime --help` imports that benchmark's module and no other."""
    from avatarstream.bench import BENCHMARKS
    from avatarstream.cli import COMMANDS

    r, modules = _cli_modules(tmp_path, "--help")
    assert r.returncode == 0 and all(name in r.stdout for name in COMMANDS), r.stdout
    assert not {mod for mod, _, _ in COMMANDS.values()} & modules
    assert _under(modules, "train", "data", "bench", "eval", "serve", "engine") == []
    r, modules = _cli_modules(tmp_path, "bench", "realtime", "--help")
    assert r.returncode == 0 and "--size" in r.stdout
    assert _under(modules, "bench") == ["avatarstream.bench", BENCHMARKS["realtime"]]
    r, modules = _cli_modules(tmp_path, "bench", "--help")
    assert r.returncode == 0 and all(name in r.stdout for name in BENCHMARKS)
    assert _under(modules, "bench") == ["avatarstream.bench"]


# -- the house: no file over 450 lines, no import circle between files -----------------------------
MAX_LINES = 450


def test_no_source_file_is_over_450_lines():
    src = ROOT / "src" / "avatarstream"
    over = {str(p.relative_to(src)): n for p in sorted(src.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert over == {}, f"over {MAX_LINES} lines: {over}"


def _cycles_between_siblings() -> dict[str, list[list[str]]]:
    """Every import circle between the files (or subpackages) of one package, found on grimp's
    graph of avatarstream as import-linter builds it (TYPE_CHECKING imports count): package ->
    the strongly connected groups of its children with more than one member."""
    import grimp

    graph = grimp.build_graph("avatarstream", cache_dir=None)
    edges: dict[str, dict[str, set[str]]] = {}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = importer.split("."), imported.split(".")
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            if n == len(a) or n == len(b):  # a package and its own descendant: no sibling arrow
                continue
            package = ".".join(a[:n])
            edges.setdefault(package, {}).setdefault(".".join(a[:n + 1]), set()).add(".".join(b[:n + 1]))
    return {p: found for p, arrows in edges.items() if (found := _strongly_connected(arrows))}


def _strongly_connected(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's groups of more than one node of the graph `arrows` (node -> the nodes it points to)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(arrows.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected({"a": {"b"}, "b": {"c"}}) == []


def test_no_import_circle_between_the_files_of_any_package():
    """No two files (or subpackages) of one package import each other, directly or round a
    circle, counting imports inside functions and under TYPE_CHECKING."""
    assert _cycles_between_siblings() == {}
