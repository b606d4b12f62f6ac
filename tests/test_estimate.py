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
    assert "4 engines to start, 4 at a time (a typical start, 40 s)" in cold and "noise floors" in cold
    assert cold.startswith("About 48 s")  # side by side: one start of 40 s, and 64 x (26 + 102) ms
    estimate.record("rollout", "cpu", 6.4, 64)  # this server's own run: 0.1 s a token
    assert "100 ms each (this server's last run)" in estimate.rollout_words("cpu", 2, 1, 16, 2, False, 0)
    monkeypatch.setattr(estimate, "LAST_START", {("vllm", "cpu"): 30.0})
    assert "the last start here took 30 s" in estimate.frontier_words("cpu", 2, 3)


def test_a_running_engine_with_other_settings_is_counted_as_a_start():
    """Item 3 of the first hour: the Rollout page said "About 2 s" and took 18.7 s. Its vLLM engine
    runs with its own settings; the Compare page's warm engine of the same model and dtype is not it."""
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import canonical_json

    mine, other = EngineSettings(), EngineSettings(enforce_eager=not EngineSettings().enforce_eager)
    keys = [
        {"backend": "hf", "model_path": "/m", "dtype": "float32", "settings": json.loads(canonical_json(mine.hf_part()))},
        {"backend": "vllm", "model_path": "/m", "dtype": "float32", "settings": json.loads(canonical_json(other.vllm_part()))},
    ]
    wanted = [("hf", "float32"), ("vllm", "float32")]
    assert estimate.cold_engines(Pool(keys), "/m", wanted) == 0  # settings not asked: both count as running
    assert estimate.cold_engines(Pool(keys), "/m", wanted, mine) == 1  # vLLM runs with other settings: a start
    assert estimate.cold_engines(Pool(keys), "/m", wanted, other) == 0  # enforce_eager is vLLM's: HF's part is the same
    assert estimate.cold_engines(Pool(keys[1:]), "/m", wanted, other) == 1  # no HF engine: one start


def test_a_run_over_twice_its_estimate_says_so_and_the_next_estimate_learns_it(monkeypatch):
    monkeypatch.setattr(estimate, "_RATES", {})
    monkeypatch.setattr(estimate, "_SLOWER", {})
    monkeypatch.setattr(estimate, "LAST_START", {})
    seconds, words = estimate.frontier_estimate("cpu", 2, 0)
    assert words.startswith(f"About {seconds:.0f} s here") and "timed 3 times" in words
    assert estimate.judged("frontier", "cpu", seconds, seconds * 1.9) is None  # within 2x: nothing to say
    said = estimate.judged("frontier", "cpu", seconds, seconds * 13)
    assert said is not None and "13.0x the" in said and "next estimate here counts it" in said
    again, words = estimate.frontier_estimate("cpu", 2, 0)
    assert again == seconds * 13 and "took 13.0x its estimate" in words
    assert estimate.judged("frontier", "cpu", again, again * 1.1) is None  # the learned estimate held
    assert estimate.frontier_estimate("cpu", 2, 0)[0] == seconds * 13  # and is kept
    assert estimate.judged("frontier", "cpu", again, seconds * 1.0) is None  # back to the plain one: unlearned
    assert estimate.frontier_estimate("cpu", 2, 0)[0] == seconds
    assert estimate.rollout_estimate("cpu", 2, 1, 16, 2, False, 0)[0] == 2 * 16 * 2 * estimate.MEASURED[("rollout", "cpu")]
