"""The layer part's cost (`diagnose --parts layers`) against a compare of the same text.

    python benchmarks/layers_cost.py [--model demo|PATH] [--tokens 512] [--dtype bfloat16] [--device auto]
                                     [--repeats 3] [--out FILE]

Issue 44's target: on one text, the layer part costs at most 2x a compare of it. Both are timed with
their engines warm (a first compare starts vLLM and HF; a first layer part is reported apart). The
compare is timed without the store's cache; the layer part's diagnosis reads the comparison it is built
on from the store, so its time is the capture on every side (vLLM kept on its device, then in the HF
engine: HF alone, HF's two noise variations and the float64 reference, each compared as it runs) and
the profile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help="demo (SmolLM2-135M) or a model folder")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from benchmarks.engines import prompts_of
    from logprob_parity.analysis.compare import compare
    from logprob_parity.analysis.diagnostics import diagnose
    from logprob_parity.env import device_name, versions
    from logprob_parity.inputs.models import resolve_model
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    model = resolve_model(None if a.model == "demo" else a.model)
    tok = AutoTokenizer.from_pretrained(model.path)
    (ids,) = prompts_of(tok, 1, a.tokens)
    text = tok.decode(ids[1:] if ids and ids[0] == tok.bos_token_id else ids)
    store = Store(tempfile.mkdtemp(prefix="lpp-layers-bench-"))
    spec = RunSpec(texts=(text,), model=model.path, dtypes=(a.dtype,), device=a.device)

    t = time.perf_counter()
    compare(spec, store=store, use_cache=False)
    first_compare = time.perf_counter() - t
    t = time.perf_counter()
    diag = diagnose(spec, store=store, parts=("layers",))
    first_layers = time.perf_counter() - t
    comp, lay = [], []
    for _ in range(a.repeats):
        t = time.perf_counter()
        compare(spec, store=store, use_cache=False)
        comp.append(time.perf_counter() - t)
        t = time.perf_counter()
        diag = diagnose(spec, store=store, parts=("layers",))
        lay.append(time.perf_counter() - t)
    prof = diag.dtypes[a.dtype].layers
    c, m = statistics.median(comp), statistics.median(lay)
    v = versions()
    lines = [
        f"# The layer part's cost: {Path(model.path).name}, one {prof['n_tokens']:,}-token text, {a.dtype}",
        "",
        f"{device_name(spec.device if spec.device != 'auto' else 'cpu')} · vLLM {v.get('vllm')} · torch {v.get('torch')} · "
        f"transformers {v.get('transformers')} · {prof['layers']} layers · median of {a.repeats}, engines warm",
        "",
        "| what | seconds (median) | runs |",
        "|---|---|---|",
        f"| compare (no cache) | {c:.2f} | {', '.join(f'{x:.2f}' for x in comp)} |",
        f"| layer part (`diagnose --parts layers`) | {m:.2f} | {', '.join(f'{x:.2f}' for x in lay)} |",
        f"| **ratio** | **{m / c:.2f}x** (target at most 2x) | |",
        f"| first compare, with both engines' starts | {first_compare:.2f} | |",
        f"| first layer part | {first_layers:.2f} | |",
        "",
        "HF's captures, seconds (last run): " + ", ".join(f"{k} {v:.2f}" for k, v in prof["hf_seconds"].items()),
        "",
        f"Words: {prof['words']}",
    ]
    out = "\n".join(lines) + "\n"
    print(out)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(out)


if __name__ == "__main__":
    main()
