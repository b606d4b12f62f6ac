"""The forms' time estimates (logprob_parity.analysis.estimate): engine starts plus work, from what
this process measured, else from the benchmark's measured rates, each named in the words."""

from __future__ import annotations

import json

from logprob_parity.analysis import estimate


class Pool:
    def __init__(self, keys):
        self._keys = [json.dumps(k) for k in keys]

    def engine_keys(self):
        return self._keys


def test_running_engines_of_the_model_are_not_counted_as_starts():
    pool = Pool(
        [{"backend": "hf", "model_path": "/m", "dtype": "float32"}, {"backend": "vllm", "model_path": "/x", "dtype": "float32"}]
    )
    wanted = [("hf", "float32"), ("vllm", "float32")]
    assert estimate.cold_engines(pool, "/m", wanted) == 1  # vLLM runs for another model
    assert estimate.cold_engines(pool, None, wanted) == 2  # a Hub id: not known before it resolves


def test_the_words_add_starts_and_work_and_name_where_each_rate_comes_from(monkeypatch):
    monkeypatch.setattr(estimate, "_RATES", {})
    monkeypatch.setattr(estimate, "LAST_START", {})
    warm = estimate.rollout_words("cpu", 2, 1, 16, 2, False, 0)
    rate = estimate.MEASURED[("rollout", "cpu")]
    assert warm.startswith(f"About {2 * 16 * 2 * rate:.0f} s here") and estimate.SOURCE in warm and "already running" in warm
    cold = estimate.rollout_words("cpu", 2, 1, 16, 2, True, 4)
    assert "4 engines to start (a typical start)" in cold and "noise floors" in cold
    estimate.record("rollout", "cpu", 6.4, 64)  # this server's own run: 0.1 s a token
    assert "100 ms each (this server's last run)" in estimate.rollout_words("cpu", 2, 1, 16, 2, False, 0)
    monkeypatch.setattr(estimate, "LAST_START", {("vllm", "cpu"): 30.0})
    assert "the last start here took 30 s" in estimate.frontier_words("cpu", 2, 3)
