"""Shared fixtures. Engine tests share warm workers through logprob_parity.engines' pool (one process)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from builders import CACHE, REPO, build_tiny_gptq, build_tiny_llama

# Demo model and other built models live here across test runs (CI builds them once per run).
MODELS_HOME = CACHE / "home"
os.environ.setdefault("LOGPROB_PARITY_HOME", str(MODELS_HOME))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """GPU tests need CUDA, multi-GPU tests two GPUs; skip them (with the reason) elsewhere."""
    from logprob_parity.engines.memory import gpus
    from logprob_parity.env import cuda_present

    cuda = cuda_present()
    many = cuda and len(gpus()) >= 2
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA); CI has none"))
        elif "multigpu" in item.keywords and not many:
            item.add_marker(pytest.mark.skip(reason="needs two or more NVIDIA GPUs"))


@pytest.fixture(scope="session")
def tiny_bos() -> Path:
    """Tiny Llama whose tokenizer adds <s> itself."""
    return build_tiny_llama("tiny-llama-bos", adds_bos=True)


@pytest.fixture(scope="session")
def tiny_gptq() -> tuple[Path, Path]:
    """(a GPTQ 4-bit checkpoint of tiny_bos, an HF folder of its weights dequantized)."""
    return build_tiny_gptq()


@pytest.fixture(scope="session")
def tiny_nobos() -> Path:
    """Tiny Llama whose tokenizer has <s> but does not add it."""
    return build_tiny_llama("tiny-llama-nobos", adds_bos=False)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from logprob_parity.inputs.demo import build_demo_model

    return build_demo_model(MODELS_HOME / "models" / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gpu_model() -> str:
    """The demo model for GPU runs: the GPU machine's converted copy (LPP_GPU_MODEL), else built here."""
    path = os.environ.get("LPP_GPU_MODEL", "/tmp/models/smollm2-135m")
    if not Path(path, "config.json").is_file():
        from logprob_parity.inputs.demo import build_demo_model

        return str(build_demo_model())
    return path


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    """An empty store root for one test, sharing the built demo model (no 30 s rebuild)."""
    root = tmp_path / "home"
    root.mkdir()
    (MODELS_HOME / "models").mkdir(parents=True, exist_ok=True)
    (root / "models").symlink_to(MODELS_HOME / "models")
    monkeypatch.setenv("LOGPROB_PARITY_HOME", str(root))
    return root


def cli_env(home: Path) -> dict[str, str]:
    env = dict(os.environ, LOGPROB_PARITY_HOME=str(home), PYTHONPATH=str(REPO))
    return env


def kill_after_parts(cmd: list[str], env: dict[str, str], home: Path, parts: int, timeout: float = 300) -> int:
    """Start the CLI command, SIGKILL it (its whole process group, engine hosts included) once
    `parts` finished batches are stored, and return how many were stored by then."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    partial = home / "partial"
    deadline = time.monotonic() + timeout
    found: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(partial.glob("*/part-*.arrow")) if partial.exists() else []
        if len(found) >= parts:
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(found) >= parts, f"the command did not store {parts} batches in time"
    return len(list(partial.glob("*/part-*.arrow")))


def run_files(home: Path) -> list[str]:
    """Everything in the store's runs folder (temp files included)."""
    d = home / "runs"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


__all__ = ["cli_env", "kill_after_parts", "run_files", "shutil"]
