"""Display one comparison (one Run per dtype): cards, token view, charts, worst tokens, export, share."""

from __future__ import annotations

import io
import json
from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from core.present.charts import CHARTS, chart_frame, worst_tokens
from core.present.render import SCALES, token_view_html
from core.present.report import report_html
from core.results.records import DiagnosticsResult
from core.results.run import Run
from core.analysis.verdict import run_verdicts
from dashboard.state import query_float, query_int, query_metric, set_query

METRIC_LABELS = {k: s.label for k, s in SCALES.items()}
SCALE_MAXES = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
THRESHOLDS = [0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 2e-2, 5e-2, 1e-1, 0.5, 1.0]


def _fmt(v: object, pct: bool = False) -> str:
    if v is None:
        return "–"
    return f"{v:.2%}" if pct else f"{v:.3e}"


def metric_cards(runs: list[Run]) -> None:
    cols = st.columns(len(runs))
    for col, r in zip(cols, runs):
        s = r.summary
        with col.container(border=True):
            st.markdown(f"**{r.dtype}** · {s['n_tokens']} tokens")
            a, b = st.columns(2)
            a.metric("max |Δ logp|", _fmt(s["max_abs_delta"]))
            b.metric("mean |Δ logp|", _fmt(s["mean_abs_delta"]))
            a.metric("p95 |Δ logp|", _fmt(s["p95_abs_delta"]))
            b.metric("argmax agreement", _fmt(s["argmax_agreement"], pct=True))
            a.metric("mean top-k KL", _fmt(s["mean_kl_topk"]))
            b.metric("seq Δ logp", _fmt(s["seq_logprob_delta"]))


def verdict_cards(verdicts: list[dict]) -> None:
    """Plain language for people who do not read the numbers."""
    show = {"match": st.success, "close": st.warning, "differs": st.error}
    cols = st.columns(len(verdicts))
    for col, v in zip(cols, verdicts):
        with col:
            show.get(v["level"], st.info)(v["headline"] + "\n\n" + "\n".join(f"- {r}" for r in v["reasons"]))
    st.caption("Thresholds: " + "; ".join(verdicts[0]["thresholds"]))


def noise_floors(runs: list[Run], found: DiagnosticsResult | None) -> dict | None:
    """HF's own noise per dtype, from diagnostics stored for these runs (if any were run)."""
    if not found:
        return None
    outs = {d: o for d, o in found.dtypes.items() if o.run_id in {r.run_id for r in runs} and o.floor is not None}
    if not outs:
        return None
    return {"hf": {d: o.floor["hf"] for d, o in outs.items()}, "ratios": {d: o.ratio_to_hf_noise for d, o in outs.items()}}


def _provenance(run: Run) -> str:
    """Where the numbers on screen came from, in words."""
    from dashboard.state import COMPUTED_KEY

    computed = st.session_state.get(COMPUTED_KEY, {})
    if run.run_id not in computed and run.from_store:
        return "from the store"
    total = computed.get(run.run_id, run.meta.timing.get("total_s"))
    return f"computed now, in {total:.1f} s" if isinstance(total, (int, float)) else "computed now"


def _header(runs: list[Run]) -> None:
    m = runs[0].meta
    env = m.env
    st.subheader(f"{m.model}")
    st.caption(
        f"device {env.device} · torch {env.torch} · transformers {env.transformers} · vLLM {env.vllm} · "
        f"top-k {m.top_k} · BOS {m.bos} · "
        + " · ".join(f"{r.dtype}: run `{r.run_id}`, {_provenance(r)}" for r in runs)
    )


def _share(runs: list[Run], seq: int, metric: str, thr: float | None, page: str) -> None:
    params = {"runs": ",".join(r.run_id for r in runs), "seq": seq, "metric": metric}
    if thr:
        params["thr"] = thr
    base = (st.context.url or "").split("?")[0] if hasattr(st, "context") else ""
    st.text_input("Share this view (anyone on this server opens it without recomputing)", f"{base}?{urlencode(params)}", key=f"share-{page}")


def show_runs(runs: list[Run], page: str = "compare", seq_fixed: int | None = None) -> None:
    _header(runs)
    from dashboard.state import get_store

    diag = get_store().diagnostics_for_run(runs[0].run_id)  # once per render: verdict, noise band, report
    verdict_cards([v.to_dict() for v in run_verdicts(runs, diag)])
    metric_cards(runs)
    n_seq = min(len(r.sequences) for r in runs)
    c1, c2, c3, c4 = st.columns([2, 2, 2, 3])
    if seq_fixed is None and n_seq > 1:
        seq = c1.number_input("Prompt", 0, n_seq - 1, query_int("seq", 0, 0, n_seq - 1), key=f"{page}-seq")
    else:
        seq = seq_fixed if seq_fixed is not None else 0
    metrics = list(METRIC_LABELS)
    metric = c2.selectbox("Colour by", metrics, metrics.index(query_metric()), format_func=METRIC_LABELS.get, key=f"{page}-metric")
    default_hi = SCALES[metric].hi
    hi = c3.select_slider("Scale max", SCALE_MAXES if metric != "rank_change" else [1.0, 5.0, 10.0, 100.0, 1000.0],
                          value=default_hi, key=f"{page}-hi-{metric}")
    thr_q = query_float("thr", 0.0) or 0.0
    thr = c4.select_slider("Outline tokens above", THRESHOLDS, value=min(THRESHOLDS, key=lambda t: abs(t - thr_q)), key=f"{page}-thr",
                           format_func=lambda v: "off" if v == 0 else f"{v:g}")
    set_query(runs=",".join(r.run_id for r in runs), seq=seq, metric=metric, thr=thr or None)

    st.html(token_view_html(runs, int(seq), metric, thr or None, hi))

    floors = noise_floors(runs, diag)
    if floors:
        st.caption("Noise floor from stored diagnostics: " + " · ".join(
            f"{d}: gap = {r:.3g}× HF's own noise (batching, padding, attention)" for d, r in floors["ratios"].items() if r is not None))
    df = chart_frame(runs, int(seq))
    tabs = st.tabs(["|Δ| histogram", "vLLM vs HF", "|Δ| by position", "|Δ| vs probability", "Worst 20", "All prompts"])
    for tab, (name, make) in zip(tabs[:4], CHARTS.items()):
        with tab:
            if df.empty:
                st.info("No scored tokens.")
            elif name == "by_position" and floors:
                st.altair_chart(make(df, floors["hf"]), width="stretch")
            else:
                st.altair_chart(make(df), width="stretch")
    with tabs[4]:
        st.dataframe(worst_tokens(runs, 20, int(seq)), hide_index=True, width="stretch")
    with tabs[5]:
        st.caption("Worst 20 tokens over every prompt of these runs")
        st.dataframe(worst_tokens(runs, 20), hide_index=True, width="stretch")

    _downloads(runs, page, diag)
    _share(runs, int(seq), metric, thr or None, page)


@st.cache_data(max_entries=16, show_spinner=False)
def _report_bytes(run_ids: tuple[str, ...], diag_id: str | None) -> bytes:
    from dashboard.state import get_store, load_run

    diag = get_store().load_diagnostics(diag_id) if diag_id else None
    return report_html([load_run(r) for r in run_ids], diag).encode("utf-8")


def _downloads(runs: list[Run], page: str, diag: DiagnosticsResult | None) -> None:
    ids = tuple(r.run_id for r in runs)
    stem = f"logprob-parity-{'-'.join(i[:8] for i in ids)}"
    c1, c2, c3 = st.columns(3)
    c1.download_button("HTML report", _report_bytes(ids, diag.diagnostics_id if diag else None), f"{stem}.html", "text/html",
                       key=f"{page}-dl-html")
    data = [r.to_json_dict() for r in runs]
    c2.download_button("JSON", json.dumps(data if len(data) > 1 else data[0], allow_nan=False), f"{stem}.json",
                       "application/json", key=f"{page}-dl-json")
    buf = io.BytesIO()
    pd.concat([r.to_frame().assign(dtype=r.dtype, run_id=r.run_id) for r in runs]).to_parquet(buf, index=False)
    c3.download_button("Parquet", buf.getvalue(), f"{stem}.parquet", "application/octet-stream", key=f"{page}-dl-parquet")
