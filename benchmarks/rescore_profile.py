"""Where a large rescore spends its time after the engines: building the Rollout, storing it, its --json.

    python benchmarks/rescore_profile.py [--model PATH] [--sequences 20000] [--prompt 8] [--completion 24] [--profile]

No engine runs: each sequence's scorings are random arrays of the shape the engines return, so the
figures are this process's own work on a rescore of that size (core.analysis.rescore.assemble, the
store's write and read back, Rollout.write_json). With --profile, the 15 costliest functions of each
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

from benchmarks.prompt_set import report, rss_peak
from benchmarks.rescore_scale import logged_lines, scale_args

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
    from core.analysis.request import Context, prepare
    from core.analysis.rescore import _COLUMNS, assemble
    from core.inputs.rollout_logs import read_logged
    from core.inputs.spec import RunSpec
    from core.results.store import Store

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

    p.tokenizer  # loaded before the phases: its import is not theirs
    logged = phase("read and check the records", lambda: read_logged(data, "logged.jsonl", {}, p.tokenizer, p.spec.bos, vocab))
    n = a.completion
    scored = [{c: (rng.integers(0, vocab, n) if c.endswith("_top") else -rng.random(n) * 4) for c in _COLUMNS}
              for _ in logged.sequences]
    ro = phase("assemble the Rollout (pieces, metrics, verdict)", lambda: assemble(
        p, logged, scored, "float32", RID, 256, {}, {}, {"hf": {}, "vllm": {}}, time.perf_counter()))
    phase("store it (Parquet, a few thousand samples at a time)", lambda: store.save_rollout(ro))
    phase("read it back from the store", lambda: store.load_rollout(RID))
    with open(home / "out.json", "w") as f:
        phase("--json, written a sample at a time", lambda: ro.write_json(f))
    if a.page:
        from streamlit.testing.v1 import AppTest

        at = AppTest.from_file(str(REPO / "dashboard" / "app.py"), default_timeout=600)
        at.switch_page("views/rollout.py")
        at.query_params.update({"rollout": RID})
        phase("the Rollout page opens it (its script, first run: the store read included)", at.run)
        if at.exception:
            raise SystemExit(f"the page failed: {at.exception[0].value}")
        phase("the Rollout page again (another sample's view)", lambda: (at.query_params.update({"sample": "7"}), at.run()))
        sent = {kind: sum(e.proto.ByteSize() for e in at.get(kind)) for kind in ("vega_lite_chart", "html", "selectbox",
                                                                                   "dataframe")}
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
