"""Start the default model's engines when the dashboard server starts, so the first Run of a demo
finds them warm (seconds, not the minute a cold start takes on a CPU).

Why here and not on the first page view: Streamlit runs the app script only when a browser
connects, so a server started before a demo would still be cold. `logprob_parity.dashboard.serve` calls `start()`
in the server process, before Streamlit's own loop; the pages read `status()` to say, in words,
whether engines are still starting. It goes through the same request path and the same engine pool
as a comparison (model-root rules, memory policy, leases), and LPP_PREWARM=0 (or
`logprob-parity dashboard --no-prewarm`) turns it off.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

ENV = "LPP_PREWARM"
DEFAULT_DTYPES = ("bfloat16", "float32")  # the Compare form's default dtypes


@dataclass(frozen=True)
class PrewarmStatus:
    state: str  # "off", "starting", "ready", "failed"
    started: float = 0.0  # time.monotonic() when it began
    finished: float | None = None
    engines: tuple[str, ...] = ()
    error: str | None = None
    device: str = "cpu"

    def words(self, now: float | None = None) -> str | None:
        """One sentence for the page, or None when there is nothing to say."""
        now = time.monotonic() if now is None else now
        if self.state == "starting":
            from logprob_parity.engines.host import start_words

            return (
                f"Starting the demo model's {len(self.engines) or 'default'} engines in the background "
                f"({', '.join(self.engines) or 'finding the model'}): {now - self.started:.0f} s so far "
                f"(each: {start_words('vllm', self.device)}; they start side by side). "
                "A Run pressed now waits for them, then takes seconds."
            )
        if self.state == "failed":
            return f"The demo model's engines could not be started in the background ({self.error}); a Run starts them."
        return None


_status = PrewarmStatus("off")
_lock = threading.Lock()


def status() -> PrewarmStatus:
    return _status


def _set(**changes: Any) -> None:
    global _status
    with _lock:
        _status = PrewarmStatus(**{**_status.__dict__, **changes})


def enabled() -> bool:
    """On unless LPP_PREWARM says no, and only where engines can run (not in viewer mode, where
    torch, transformers or vLLM is missing and a warm-up could only fail)."""
    import importlib.util

    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "vllm"))


def default_dtypes(device: str) -> tuple[str, ...]:
    from logprob_parity.env import dtype_support

    return tuple(d for d in DEFAULT_DTYPES if dtype_support(d, device) is None)


def warm_defaults(ctx: Any = None, model: str | None = None) -> tuple[str, ...]:
    """Load the default model's engines (HF and vLLM, each default dtype) into the pool, run one
    warm-up pass on each and score the noise floor's bundled texts on HF's (floors.BUNDLED: a short
    text's first floor then costs its own passes only), then leave them warm. `model`: another model than the demo (benchmarks).
    Returns the engines' labels."""
    from logprob_parity.analysis import floors
    from logprob_parity.analysis.request import Context, prepare
    from logprob_parity.env import resolve_device
    from logprob_parity.inputs.models import model_roots_from_env
    from logprob_parity.inputs.prompts import SEED_TEXT
    from logprob_parity.inputs.spec import RunSpec

    ctx = ctx or Context.of(model_roots=model_roots_from_env())
    spec = RunSpec(texts=(SEED_TEXT,), model=model, dtypes=default_dtypes(resolve_device("auto")))
    p = prepare(spec, ctx)
    requests = [p.load(b, d) for d in spec.dtypes for b in ("hf", "vllm")]
    labels = tuple(r.label for r in requests)
    _set(engines=labels, device=p.device)
    with ctx.pool.lease(requests) as lease:
        for r in requests:
            host = lease.host(r)
            # one scoring pass: an engine's first request pays one-time costs (about 2 s for vLLM on a
            # CPU) that the first Run of a demo should not
            with ctx.pool.device_turn(what="warming up"):
                host.score(p.seqs, spec.top_k, None)
                if r.backend == "hf":  # the floor's bundled texts, which every short text's floor adds
                    floors.BUNDLED.warm(host, floors.other_prompts(p.tokenizer, spec.bos, r.max_model_len, p.device))
    return labels


def start() -> threading.Thread | None:
    """Begin warming in a daemon thread (no-op when LPP_PREWARM=0)."""
    if not enabled():
        _set(state="off")
        return None
    _set(state="starting", started=time.monotonic(), finished=None, error=None)

    def run() -> None:
        try:
            warm_defaults()
            _set(state="ready", finished=time.monotonic())
        except Exception as exc:
            _set(
                state="failed",
                finished=time.monotonic(),
                error=str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
            )

    t = threading.Thread(target=run, name="lpp-prewarm", daemon=True)
    t.start()
    return t
