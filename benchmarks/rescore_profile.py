"""Where a large rescore spends its time besides the engines: reading the file, the parts, the finish, its --json.

    python benchmarks/rescore_profile.py [--model PATH] [--sequences 20000] [--prompt 8] [--completion 24] [--profile]

No engine runs: each sequence's scorings are random arrays of the shape the engines return, so the
figures are this process's own work on a rescore of that size (logprob_parity.analysis.rescore: the records
read, checked and staged; each batch's part built and stored; `finish`, the summary from the parts
and the stored file; the Rollout read back; Rollout.write_json). With --profile, the 15 costliest functions of each
phase (cProfile, cumulative). Default model: the tiny test Llama (its tokenizer; nothing is loaded
but the tokenizer).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from benchmarks.prompt_set import report, rss_peak  # noqa: E402 - importable once the repo is on the path
from benchmarks.rescore_scale import logged_lines, scale_args  # noqa: E402

RID = "0123456789abcdef0123456789abcdef"  # the profiled rollout's id in its throwaway store


def main() -> None:
    ap = argparse.ArgumentParser()
    scale_args(ap)
    ap.add_argument("--profile", action="store_true", help="print each phase's costliest functions")
    ap.add_argument("--page", action="store_true", help="also open the stored rollout on the Rollout page (Streamlit AppTest)")
    a = ap.parse_args()
    import os

    import numpy as np

    home = Path(tempfile.mkdtemp(prefix="lpp-rescore-profile-"))
    os.environ["LOGPROB_PARITY_HOME"] = str(home / "store")
    data = "".join(logged_lines(a)).encode()  # sets a.model when not given
    from types import SimpleNamespace

    from logprob_parity.analysis.request import Context, prepare
    from logprob_parity.analysis.rescore import _batches, _samples, finish
    from logprob_parity.inputs.rollout_logs import stage_logged
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.rollout import sample_table
    from logprob_parity.results.store import Store

    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(1)  # the scorings' stand-ins
    store = Store(home / "store")
    ctx = Context.of(store=store)
    p = prepare(RunSpec(texts=("logged rollouts",), model=a.model, dtypes=("float32",), device="cpu"), ctx)
    phases: list[tuple[str, float]] = []
    profiles: list[tuple[str, str]] = []

    def phase(name: str, fn):  # type: ignore[no-untyped-def]
        prof = cProfile.Profile() if a.profile else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        out = fn()
        if prof:
            prof.disable()
        phases.append((name, time.perf_counter() - t))
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(15)
            profiles.append((name, s.getvalue()))
        return out

    _ = p.tokenizer  # loaded before the phases: its import is not theirs
    src = home / "logged.jsonl"
    src.write_bytes(data)
    del data
    logged = phase(
        "read, check and stage the records",
        lambda: stage_logged(src, src.name, {}, p.tokenizer, p.spec.bos, vocab, home / "staged.arrow"),
    )
    batches = _batches(logged, vocab, "cpu")

    def scorings(seqs):  # type: ignore[no-untyped-def]
        pre, got = [], []
        for s in seqs:
            n0, n = len(s.prompt_token_ids), len(s.completion_token_ids)
            ids = np.asarray([*s.prompt_token_ids, *s.completion_token_ids])
            pre.append(
                SimpleNamespace(token_ids=ids, logprob=-rng.random(n0 + n) * 4, topk_ids=rng.integers(0, vocab, (n0 + n, 1)))
            )
            got.append(
                {
                    "logprob": -rng.random(n) * 4,
                    "tempered": -rng.random(n) * 4,
                    "log_kept_mass": np.zeros(n),
                    "top_id": rng.integers(0, vocab, n),
                    "kl_full": rng.random(n) * 1e-3,
                }
            )
        return pre, got

    def parts() -> None:
        for b, (_, idx) in enumerate(batches):
            seqs = logged.read(idx)
            store.save_part(RID, b, sample_table(_samples(p.tokenizer, seqs, idx, *scorings(seqs)), idx), {"idx": idx})

    phase(f"each batch's part built and stored (pieces, prompts; {len(batches)} batches)", parts)
    phase(
        "finish: the summary from the parts (two passes), the verdict, the stored file",
        lambda: finish(p, logged, batches, "float32", RID, 256, {}, {}, {"hf": {}, "vllm": {}}, time.perf_counter()),
    )
    ro = phase("read it back from the store (its samples stay in the file)", lambda: store.load_rollout(RID))
    with open(home / "out.json", "w") as f:
        phase("--json, written a chunk of samples at a time", lambda: ro.write_json(f))
    if a.page:
        from streamlit.testing.v1 import AppTest

        at = AppTest.from_file(str(REPO / "logprob_parity" / "dashboard" / "app.py"), default_timeout=600)
        at.switch_page("views/rollout.py")
        at.query_params.update({"rollout": RID})
        phase("the Rollout page opens it (its script, first run: the store read included)", at.run)
        if at.exception:
            raise SystemExit(f"the page failed: {at.exception[0].value}")
        phase("the Rollout page again (another sample's view)", lambda: (at.query_params.update({"sample": "7"}), at.run()))
        sent = {
            kind: sum(e.proto.ByteSize() for e in at.get(kind)) for kind in ("vega_lite_chart", "html", "selectbox", "dataframe")
        }
    tokens = a.sequences * a.completion
    rows = [(f"{name} ({a.sequences:,} sequences, {tokens:,} completion tokens)", f"{took:.1f} s") for name, took in phases]
    rows.append(("--json", f"{(home / 'out.json').stat().st_size / 2**20:.0f} MiB"))
    if a.page:
        rows.append(("what the page sends the browser", ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sent.items())))
    rows.append(("peak memory of this process", f"{rss_peak(os.getpid()) / 2**30:.2f} GB"))
    report(f"A rescore of {a.sequences:,} logged sequences after its engines, on this CPU", a.model, rows, a.out)
    for name, text in profiles:
        print(f"\n## {name}\n{text}")


if __name__ == "__main__":
    main()
