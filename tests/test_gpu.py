"""The CUDA path: both engines on one GPU, every dtype, and the attention backends in float32.

Runs only where CUDA is present (`-m gpu`); prints a markdown table and writes it to
$LPP_GPU_RESULTS (default: a file in the temp folder; copy a run worth keeping into benchmarks/results/ by hand).
"""

import os
import tempfile
from pathlib import Path

import pytest

from core.analysis.compare import compare
from core.env import dtype_support
from core.inputs.spec import DTYPES, EngineSettings, RunSpec
from core.results.store import Store

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

SENTENCES = (Path(__file__).resolve().parent.parent / "core" / "data" / "sentences.txt").read_text().splitlines()
# Never a tracked file: a GPU run must not rewrite benchmarks/results/ behind the reader's back.
RESULTS = Path(os.environ.get("LPP_GPU_RESULTS") or Path(tempfile.gettempdir()) / "logprob-parity-gpu.md")
ROWS: list[str] = []


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store(tmp_path_factory.mktemp("gpu-store"))


def _row(label, run):
    s = run.summary
    env = run.meta.to_dict()["env"]
    ROWS.append(
        f"| {label} | {run.dtype} | {env['vllm_engine'].get('dtype')} | {s['n_tokens']} | {s['max_abs_delta']:.3e} | "
        f"{s['mean_abs_delta']:.3e} | {s['argmax_agreement']:.4f} | {run.meta.timing['vllm_load_s']:.1f} |"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    head = [
        f"GPU: {env['device']} · torch {env['torch']} · transformers {env['transformers']} · vLLM {env['vllm']}",
        "",
        "| configuration | dtype | vLLM dtype | tokens | max abs Δ | mean abs Δ | argmax agreement | vLLM load s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    RESULTS.write_text("\n".join(head + ROWS) + "\n")
    print(ROWS[-1])


def test_the_card_runs_every_dtype():
    import torch

    major, minor = torch.cuda.get_device_capability()
    for d in DTYPES:
        reason = dtype_support(d, "cuda")
        assert (reason is None) == (d != "bfloat16" or major >= 8), (d, reason)


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_engines_on_cuda(gpu_model, store, dtype):
    (run,) = compare(RunSpec(texts=tuple(SENTENCES), model=gpu_model, dtypes=(dtype,), device="cuda"), store=store)
    assert run.meta.env.hf_engine["device"] != "cpu" and run.meta.env.vllm_engine["device"] != "cpu"
    assert run.summary["n_tokens"] > 150
    _row("default", run)
    if dtype == "float32":
        assert run.summary["max_abs_delta"] < 0.05


def test_float32_attention_backends(gpu_model, store):
    """Report the float32 gap per attention backend; at least one configuration reaches 1e-4."""
    best = None
    for backend in (None, "TRITON_ATTN", "FLEX_ATTENTION"):  # the image has no flashinfer
        for hf_attn in (None, "eager"):
            settings = EngineSettings(attention_backend=backend, attn_implementation=hf_attn)
            label = f"vLLM {backend or 'default'} · HF {hf_attn or 'sdpa'}"
            try:
                (run,) = compare(RunSpec(texts=tuple(SENTENCES), model=gpu_model, dtypes=("float32",), device="cuda", settings=settings),
                                 store=store)
            except Exception as exc:  # noqa: BLE001 - a backend this card or build refuses is reported
                ROWS.append(f"| {label} | float32 | - | - | failed: {str(exc).splitlines()[0][:120]} | | | |")
                continue
            _row(label, run)
            best = min(best or 1.0, run.summary["max_abs_delta"])
    assert best is not None and best <= 1e-4, best
