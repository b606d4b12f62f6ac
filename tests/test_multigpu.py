"""Tensor parallelism's effect on the gap: the same comparison with TP=1 and TP=2 (`-m multigpu`).

Needs two or more GPUs; writes a markdown table to $LPP_MULTIGPU_RESULTS
(default: a file in the temp folder; copy a run worth keeping into benchmarks/results/ by hand).
"""

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from logprob_parity.analysis.compare import compare
from logprob_parity.engines.memory import gpus
from logprob_parity.inputs.spec import EngineSettings, RunSpec
from logprob_parity.results.store import Store

pytestmark = [pytest.mark.multigpu, pytest.mark.gpu, pytest.mark.engine]

SENTENCES = (Path(__file__).resolve().parent.parent / "logprob_parity" / "data" / "sentences.txt").read_text().splitlines()
# Never a tracked file: a GPU run must not rewrite benchmarks/results/ behind the reader's back.
RESULTS = Path(os.environ.get("LPP_MULTIGPU_RESULTS") or Path(tempfile.gettempdir()) / "logprob-parity-multigpu.md")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tensor_parallel_two_against_one(gpu_model, tmp_path, dtype):
    store = Store(tmp_path)
    runs = {}
    for tp in (1, 2):
        settings = EngineSettings(tensor_parallel_size=tp)
        (runs[tp],) = compare(
            RunSpec(texts=tuple(SENTENCES), model=gpu_model, dtypes=(dtype,), device="cuda", settings=settings), store=store
        )
        assert runs[tp].meta.settings["tensor_parallel_size"] == tp
    assert runs[1].run_id != runs[2].run_id  # TP is in the run id
    one, two = (np.concatenate([s.vllm.logprob[1:] for s in runs[tp].sequences]) for tp in (1, 2))
    hf_one, hf_two = (np.concatenate([s.hf.logprob[1:] for s in runs[tp].sequences]) for tp in (1, 2))
    np.testing.assert_array_equal(hf_one, hf_two)  # the HF side does not change with vLLM's TP
    tp_effect = float(np.max(np.abs(two - one)))
    lines = [
        (
            f"| {dtype} | {runs[1].summary['max_abs_delta']:.3e} | {runs[2].summary['max_abs_delta']:.3e} | "
            f"{runs[1].summary['mean_abs_delta']:.3e} | {runs[2].summary['mean_abs_delta']:.3e} | {tp_effect:.3e} |"
        )
    ]
    head = [
        f"GPUs: {len(gpus())} x {gpus()[0].name}",
        "",
        "| dtype | max \\|Δ\\| TP=1 | max \\|Δ\\| TP=2 | mean \\|Δ\\| TP=1 | mean \\|Δ\\| TP=2 | max \\|vLLM TP=2 − TP=1\\| |",
        "|---|---|---|---|---|---|",
    ]
    old = RESULTS.read_text().splitlines()[len(head) :] if RESULTS.is_file() else []
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(head + [ln for ln in old if not ln.startswith(f"| {dtype} ")] + lines) + "\n")
    if dtype == "float32":
        assert runs[2].summary["max_abs_delta"] < 0.05


def test_hf_device_map_auto_spreads_the_model(gpu_model, tmp_path):
    settings = EngineSettings(hf_device_map="auto")
    (run,) = compare(
        RunSpec(texts=tuple(SENTENCES[:2]), model=gpu_model, dtypes=("float32",), device="cuda", settings=settings),
        store=Store(tmp_path),
    )
    assert run.meta.settings["hf_device_map"] == "auto"
    assert run.summary["argmax_agreement"] == 1.0
