"""The parity gate: `check RUN_ID` against bounds or a baseline, exit codes 0/1/2, JUnit XML and Markdown."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from test_store import make_run

from logprob_parity.cli import main
from logprob_parity.results.store import Store


def _stored(home, run_id, scale=1.0, texts=("a <b>", "c\\nd")):
    """A stored run whose vLLM side is off by `scale` times the made-up run's gap."""
    import dataclasses

    import numpy as np

    from logprob_parity.results.metrics import concat, summarize
    from logprob_parity.results.run import SequenceResult

    base = make_run(run_id, texts=texts)
    seqs = []
    for s in base.sequences:
        v = dataclasses.replace(s.vllm, logprob=s.hf.logprob + (s.vllm.logprob - s.hf.logprob) * scale)
        tok = type("T", (), {"text": s.text, "token_ids": s.token_ids, "tokens": s.tokens, "pieces": s.pieces, "bos_added": True})
        seqs.append(SequenceResult.build(tok, s.hf, v))
    summary = summarize(concat([x.metrics for x in seqs]))
    meta = dataclasses.replace(
        base.meta,
        summary=summary,
        sequences=tuple(dataclasses.replace(i, summary=x.summary) for i, x in zip(base.meta.sequences, seqs)),
    )
    run = type(base)(meta=meta, sequences=tuple(seqs))
    Store(home).save(run)
    assert np.isfinite(summary["mean_abs_delta"])
    return run


def test_bounds_pass_and_fail_with_one_line_each_and_junit_xml(home, tmp_path, capsys):
    run = _stored(home, "c0ffee01")
    mean = run.summary["mean_abs_delta"]
    junit, md = tmp_path / "r.xml", tmp_path / "r.md"
    rc = main(
        [
            "check",
            "c0ffee01",
            "--max-mean-abs-delta",
            str(mean * 2),
            "--max-abs-delta",
            "1",
            "--junit",
            str(junit),
            "--markdown",
            str(md),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.count("PASS ") == 2 and "parity holds" in out
    suite = ET.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("tests") == "2" and suite.get("failures") == "0"
    assert "parity holds" in md.read_text() and "| ✅ |" in md.read_text()
    assert "\\|Δ logp\\|" in md.read_text() and "/Δ logp/" not in md.read_text()  # the bars kept, escaped for the table
    rc = main(["check", "c0ffee01", "--max-mean-abs-delta", str(mean / 2), "--max-abs-delta", "1", "--junit", str(junit)])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL float32" in out and "PASS float32" in out and "parity check FAILED" in out
    # each line states what is true: a failed bound is ">" the limit, never a false "<="
    fail = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert f"{mean:.3e} > {mean / 2:.3e}, above the bound" in fail, fail
    assert "<= 1.000e+00, within the bound" in next(line for line in out.splitlines() if line.startswith("PASS"))
    suite = ET.parse(junit).getroot()
    failed = [c for c in suite.iter("testcase") if c.find("failure") is not None]
    assert suite.get("failures") == "1" and len(failed) == 1 and "mean |Δ logp|" in failed[0].find("failure").get("message")


def test_a_bound_that_was_not_measured_fails_and_says_so(home, capsys):
    _stored(home, "c0ffee02")
    rc = main(["check", "c0ffee02", "--max-kl-mean", "1"])  # made-up runs have no exact KL
    assert rc == 1 and "mean exact KL is not measured in this run" in capsys.readouterr().out


def test_a_baseline_holds_a_run_to_its_own_gap_times_the_worsening(home, capsys):
    _stored(home, "ba5e0001")
    _stored(home, "ba5e0002", scale=1.2)
    _stored(home, "ba5e0003", scale=3.0)
    assert main(["check", "ba5e0002", "--baseline", "ba5e0001"]) == 0
    out = capsys.readouterr().out
    assert "baseline ba5e0001" in out and "x 1.5" in out
    assert main(["check", "ba5e0003", "--baseline", "ba5e0001"]) == 1
    assert main(["check", "ba5e0003", "--baseline", "ba5e0001", "--max-worsening", "4"]) == 0


def test_bad_input_exits_2_with_the_reason(home, capsys):
    _stored(home, "bad00001")
    _stored(home, "bad00002", texts=("other text", "and more"))
    assert main(["check", "bad00001"]) == 2
    assert "no bound given" in capsys.readouterr().err
    assert main(["check", "feedfeed", "--max-abs-delta", "1"]) == 2
    assert "no stored run" in capsys.readouterr().err
    assert main(["check", "bad00002", "--baseline", "bad00001"]) == 2
    assert "compared different texts" in capsys.readouterr().err
    assert main(["check", "bad00001", "--baseline", "bad00001", "--max-worsening", "0.5"]) == 2


@pytest.mark.engine
def test_compare_with_check_gates_real_runs_in_one_step(tiny_bos, home, tmp_path, capsys):
    """compare --check on the real engines: float32 holds a tight bound, bfloat16 does not."""
    junit = tmp_path / "gate.xml"
    args = [
        "compare",
        "--model",
        str(tiny_bos),
        "--prompt",
        "Shall I compare thee to a summer's day?",
        "--device",
        "cpu",
        "--check",
        "--max-abs-delta",
        "1e-3",
        "--junit",
        str(junit),
        "--quiet",
    ]
    assert main(args + ["--dtype", "float32"]) == 0
    assert ET.parse(junit).getroot().get("failures") == "0"
    assert main(args + ["--dtype", "bfloat16"]) == 1
    out = capsys.readouterr().out
    assert "FAIL bfloat16" in out and ET.parse(junit).getroot().get("failures") == "1"
