"""Display one comparison (one Run per dtype): cards, token view, charts, worst tokens, export, share."""

from __future__ import annotations

import io
import json
from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from logprob_parity.analysis.verdict import BEYOND_WORDS, Verdict, hf_noise_of, prompt_verdicts, run_verdicts
from logprob_parity.dashboard.components.alerts import into_view_once
from logprob_parity.dashboard.state import query_float, query_int, query_metric, set_query
from logprob_parity.present.charts import CHARTS, chart_frame, worst_tokens
from logprob_parity.present.render import ROUTING_METRIC, SCALES, token_view_html, windows
from logprob_parity.present.report import report_html
from logprob_parity.results.records import DiagnosticsResult
from logprob_parity.results.run import Run

METRIC_LABELS = {k: s.label for k, s in SCALES.items()}
SCALE_MAXES = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
THRESHOLDS = [0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 2e-2, 5e-2, 1e-1, 0.5, 1.0]
WINDOW = 512  # positions drawn at once: a long text stays fast, worst part first

# One line of plain words for each term the page shows (the glossary in docs/architecture.md is longer).
HELP = {
    "routing_tokens": "An MoE model: the share of tokens that at least one layer's router sent to other experts "
    "in vLLM than in HF. Other experts mean other weights: such a token's gap has a cause.",
    "routing_flip": "An MoE model: the share of (token, layer) routers whose expert sets differ between vLLM and HF.",
    "max": "The largest difference between the engines' log probability of one token. "
    "0.01 means that token's probability differs by about 1% between vLLM and HF.",
    "mean": "The average difference per token (mean |Δ logp|). RL trainers accept up to 0.1 between trainer and rollout.",
    "p95": "95% of tokens differ by less than this.",
    "argmax": "Share of positions where both engines rank the same token first: what greedy generation would pick.",
    "kl": "How different the two engines' top-k next-token choices are (KL divergence over the top-k tokens). 0 = identical.",
    "kl_full": "How different the two engines' whole next-token distributions are, over every vocabulary entry "
    "(exact KL(HF‖vLLM), llama.cpp's measure). 0 = identical; tiny negative values are float32 rounding.",
    "seq": "Difference in the log probability of the whole text (the sum over its tokens): what an evaluation harness compares.",
}
GLOSSARY = """
- **logprob (log probability)**: the log of the probability a model gives the next token. 0 is certain; -2.3 is 10%.
- **|Δ logp|**: how far apart vLLM's and HF's logprob of the same token are. It is measured in *nats* (natural-log units):
  0.01 nats means the probability differs by about 1%, 0.69 nats by 2x.
- **dtype**: the number format the model computes in. float32 is precise; bfloat16 and float16 are faster and rounder.
- **noise floor**: how much HF disagrees with itself when only what a trainer changes from step to step changes:
  its micro-batch, the padding side, packing, chunking through its KV cache. A gap inside the noise is not a real
  difference. (HF's other attention kernel is measured beside the floor, not in it.)
- **vLLM's test tolerance**: vLLM's own tests accept up to 0.01 (tight) to 0.02 (loose) per token between engines.
- **systematic**: within tolerance but far above the noise floor: a consistent difference, with a cause (a setting, a kernel).
- **same top token (argmax)**: whether both engines would pick the same next token greedily.
- **top-k KL**: how different the two engines' lists of the k most likely next tokens are; 0 = identical.
- **exact KL (whole vocabulary)**: the same over every possible next token, as llama.cpp measures quantized models;
  the top-k KL is a lower bound of it.
- **float64 reference**: HF run in double precision on the CPU; whichever engine is closer to it is closer to the exact answer.
"""


def card_number(v: object, pct: bool = False) -> str:
    """A number short enough for a metric card to show whole (at most 7 characters: three dtypes side
    by side cut "1.769e-02" to "1.769…", and float32 read as worse than bfloat16): two significant
    digits, a power of ten below 0.001 ("1.3e-05"); a share to a tenth of a percent, never rounded up
    to 100%. The exact value is in the card's help."""
    if v is None:
        return "–"
    x = float(v)  # type: ignore[arg-type]
    if pct:
        return ">99.9%" if 0.999 < x < 1 else f"{x:.1%}"
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:.2g}" if abs(x) < 10 else f"{x:.0f}"
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e):+03d}"


def _exact(v: object) -> str:
    return "" if v is None else f" Exactly: {v!r}."


def metric_cards(runs: list[Run], seq: int | None = None) -> None:
    """The numbers of each run: the whole run's, or one prompt's own (`seq`) from its stored summary."""
    cols = st.columns(len(runs))
    for col, r in zip(cols, runs):
        s = r.summary if seq is None else r.meta.sequences[seq].summary
        with col.container(border=True):
            st.markdown(f"**{r.dtype}** · {s['n_tokens']} tokens")
            a, b = st.columns(2)
            a.metric(
                "largest gap, |Δ logp|", card_number(s.get("max_abs_delta")), help=HELP["max"] + _exact(s.get("max_abs_delta"))
            )
            b.metric(
                "mean gap, |Δ logp|", card_number(s.get("mean_abs_delta")), help=HELP["mean"] + _exact(s.get("mean_abs_delta"))
            )
            a.metric(
                "95% of tokens below", card_number(s.get("p95_abs_delta")), help=HELP["p95"] + _exact(s.get("p95_abs_delta"))
            )
            b.metric(
                "same top token",
                card_number(s.get("argmax_agreement"), pct=True),
                help=HELP["argmax"] + _exact(s.get("argmax_agreement")),
            )
            if s.get("kl_full_mean") is not None:
                a.metric(
                    "KL, whole vocabulary (mean)",
                    card_number(s["kl_full_mean"]),
                    help=HELP["kl_full"] + _exact(s["kl_full_mean"]),
                )
            else:
                a.metric("top-k KL (mean)", card_number(s.get("mean_kl_topk")), help=HELP["kl"] + _exact(s.get("mean_kl_topk")))
            b.metric(
                "whole-text Δ logp",
                card_number(s.get("seq_logprob_delta")),
                help=HELP["seq"] + _exact(s.get("seq_logprob_delta")),
            )
            if s.get("routing_flip_frac") is not None:
                a.metric(
                    "tokens routed differently",
                    card_number(s["routing_tokens_flipped"], pct=True),
                    help=HELP["routing_tokens"] + _exact(s["routing_tokens_flipped"]),
                )
                b.metric(
                    "routers that differ",
                    card_number(s["routing_flip_frac"], pct=True),
                    help=HELP["routing_flip"] + _exact(s["routing_flip_frac"]),
                )
            elif seq is None and r.meta.routing.get("why"):
                st.caption(f"Experts: {r.meta.routing['why']}.")


VERDICT_BOX = {
    "match": (st.success, ":material/check_circle:"),
    "unmeasured": (st.info, ":material/help:"),
    "systematic": (st.warning, ":material/insights:"),
    "close": (st.warning, ":material/warning:"),
    "differs": (st.error, ":material/error:"),
}


def verdict_cards(verdicts: list[Verdict]) -> None:
    """The verdict in words, first: one box per dtype, in the level's colour, with the evidence under it."""
    cols = st.columns(len(verdicts))
    for col, v in zip(cols, verdicts):
        box, icon = VERDICT_BOX.get(v.level, (st.info, ":material/info:"))
        # where those tokens are: on a page, the red ones of the token view (the CLI's words have no view to point to)
        beyond = [" They are red in the token view." if r.startswith(BEYOND_WORDS) else "" for r in v.reasons]
        with col:
            box(f"**{v.title}.** {v.headline}\n\n" + "\n".join(f"- {r}{b}" for r, b in zip(v.reasons, beyond)), icon=icon)
    if verdicts:
        st.caption("Thresholds: " + "; ".join(verdicts[0].thresholds))


def _layers(runs: list[Run]) -> float:
    """The routing scale's default top: the MoE layers of the model, as one of the slider's stops."""
    n = max((r.meta.routing.get("layers") or 0) for r in runs)
    return float(next((x for x in (1.0, 2.0, 4.0, 8.0, 16.0, 48.0, 100.0, 1000.0) if x >= n), 1000.0))


def floor_caption(d: str, floors: dict) -> str:
    """One dtype's floor in words: its value, where it was measured, the variation that set it, and the gap against it."""
    r, words = floors["ratios"].get(d), floors["words"].get(d)
    head = (
        f"{d}: the gap is {r:.3g}× HF's own floor of {floors['hf'][d]:.2g}"
        if r is not None
        else (f"{d}: HF's own floor measured {floors['hf'][d]:.2g}")
    )
    return head + f" ({floors['source'][d]}" + (f"; {words}" if words else "") + ")"


def noise_floors(runs: list[Run], found: DiagnosticsResult | None) -> dict | None:
    """HF's own noise per dtype: from diagnostics stored for these runs, else the comparison's own."""
    got = hf_noise_of(runs, found)
    if not got:
        return None
    return {
        "hf": {d: x["floor"] for d, x in got.items()},
        "tail": {d: x.get("tail") for d, x in got.items()},
        "tail_words": {d: x.get("tail_words") for d, x in got.items()},
        "ratios": {d: x["ratio"] for d, x in got.items()},
        "source": {d: x["source"] for d, x in got.items()},
        "words": {d: x.get("words") for d, x in got.items()},
    }


def _provenance(run: Run) -> str:
    """Where the numbers on screen came from, in words."""
    from logprob_parity.dashboard.state import COMPUTED_KEY

    computed = st.session_state.get(COMPUTED_KEY, {})
    if run.run_id not in computed and run.from_store:
        return "from the store"
    total = computed.get(run.run_id, run.meta.timing.get("total_s"))
    return f"computed now, in {total:.1f} s" if isinstance(total, (int, float)) else "computed now"


def _header(runs: list[Run]) -> None:
    m = runs[0].meta
    from logprob_parity.present.labels import quantized_words

    quantized = quantized_words(m.settings)
    if quantized:
        st.info(quantized, icon=":material/compress:")
    for r in runs:  # a model too large for both engines at once: they took turns on the device
        t = r.meta.timing
        if t.get("engines") == "in turn":
            kl = r.meta.env.vllm_engine.get("kl_full", "")
            st.info(
                f"{r.dtype}: the engines took turns on the device ({t.get('turns')} turns). {t.get('engines_why', '')}."
                + (f" The whole-vocabulary KL is {kl}." if "sample" in kl else ""),
                icon=":material/swap_horiz:",
            )
    env = m.env
    st.caption(
        f"device {env.device} · torch {env.torch} · transformers {env.transformers} · vLLM {env.vllm} · "
        f"top-k {m.top_k} · BOS {m.bos} · " + " · ".join(f"{r.dtype}: run `{r.run_id}`, {_provenance(r)}" for r in runs)
    )


def _share(runs: list[Run], seq: int, metric: str, thr: float | None, page: str, raw: bool = False) -> None:
    params = {"runs": ",".join(r.run_id for r in runs), "seq": seq, "metric": metric}
    if raw:
        params["scale"] = "raw"
    if thr:
        params["thr"] = thr
    base = (st.context.url or "").split("?")[0] if hasattr(st, "context") else ""
    st.text_input(
        "Share this view (anyone on this server opens it without recomputing)", f"{base}?{urlencode(params)}", key=f"share-{page}"
    )


def _window(runs: list[Run], seq: int, page: str) -> tuple[int, int] | None:
    """For a long text, the part to draw (worst part first); None draws everything."""
    n = min(len(r.sequences[seq].token_ids) for r in runs)
    if n <= WINDOW:
        return None
    parts = windows(runs, seq, WINDOW)
    pick = st.selectbox(
        f"This text has {n:,} tokens: it is shown {WINDOW} at a time, the part with the largest gap first",
        range(len(parts)),
        key=f"{page}-window-{seq}",
        format_func=lambda i: f"tokens {parts[i][0]:,}–{parts[i][1] - 1:,} (largest gap {parts[i][2]:.2e})",
    )
    return parts[pick][0], parts[pick][1]


def _cut_notice(runs: list[Run], seq: int) -> None:
    info = runs[0].meta.sequences[seq] if seq < len(runs[0].meta.sequences) else None
    if info is not None and info.cut_from:
        st.warning(
            f"This text was cut from {info.cut_from:,} to {info.n_positions:,} tokens to fit the model "
            "('Truncate prompts longer than the model's positions' was ticked); only the first part was compared.",
            icon=":material/content_cut:",
        )


def show_runs(runs: list[Run], page: str = "compare", seq_fixed: int | None = None, into_view: bool = True) -> None:
    """The result: verdicts, numbers and the token view. `into_view`: bring it on screen the first time
    it is drawn (the Prompt set page brings its set's table instead when the set is new)."""
    from logprob_parity.dashboard.state import get_store

    diag = get_store().diagnostics_for_run(runs[0].run_id)  # once per render: verdict, noise band, report
    n_seq = min(len(r.sequences) for r in runs)
    one_prompt = seq_fixed is not None and n_seq > 1  # a prompt of a set: its own verdict and numbers
    dtypes = ", ".join(r.dtype for r in runs)
    # a new result, or a share link, comes on screen; with into_view False it is noted as shown (the page
    # brought its set on screen), so only a later change of prompt scrolls here
    into_view_once(f"{page}:" + ",".join(r.run_id for r in runs) + f":{seq_fixed}", scroll=into_view)
    if one_prompt:
        st.subheader(f"Prompt {seq_fixed + 1} of {n_seq:,}: {runs[0].meta.model}, {dtypes}")
        st.caption("This prompt's own verdict and numbers, judged against the same noise floor as the whole set.")
        verdict_cards(prompt_verdicts(runs, seq_fixed, diag))
    else:
        st.subheader(f"Result: {runs[0].meta.model}, {dtypes}" + (f" (all {n_seq:,} texts)" if n_seq > 1 else ""))
        verdict_cards(run_verdicts(runs, diag))
    _header(runs)
    metric_cards(runs, seq_fixed if one_prompt else None)
    with st.expander("What do these words mean?", icon=":material/help:"):
        st.markdown(GLOSSARY)
    c1, c2, c3, c4 = st.columns([2, 3, 2, 3])
    if seq_fixed is None and n_seq > 1:  # numbered from 1 for people; the URL keeps the stored index
        shown = c1.number_input("Text", 1, n_seq, query_int("seq", 0, 0, n_seq - 1) + 1, key=f"{page}-seq")
        seq = int(shown) - 1
    else:
        seq = seq_fixed if seq_fixed is not None else 0
    # the routing metric only where the runs hold routes (an MoE model)
    metrics = [k for k in METRIC_LABELS if k != ROUTING_METRIC or any(r.meta.routing.get("measured") for r in runs)]
    metric = c2.selectbox(
        "Colour by",
        metrics,
        metrics.index(query_metric()) if query_metric() in metrics else 0,
        format_func=METRIC_LABELS.get,
        key=f"{page}-metric",
        help="|Δ logp|: the gap in log probability. |Δp|: the gap in probability. top-k KL: how different "
        "the lists of likely next tokens are. rank change: how many places the token moved. MoE layers routed "
        "differently (an MoE model): at how many layers the router picked other experts in vLLM than in HF.",
    )
    raw = False
    hi = None
    if metric == "abs_delta":
        raw = c3.toggle(
            "Raw scale",
            value=st.query_params.get("scale") == "raw",
            key=f"{page}-raw",
            help="Off: colour by meaning (grey within the noise floor, red beyond vLLM's tolerance). "
            "On: a plain light-to-dark scale you can stretch.",
        )
    if metric != "abs_delta" or raw:
        hi = c3.select_slider(
            "Scale max",
            SCALE_MAXES if metric not in ("rank_change", ROUTING_METRIC) else [1.0, 2.0, 4.0, 8.0, 16.0, 48.0, 100.0, 1000.0],
            value=_layers(runs) if metric == ROUTING_METRIC else SCALES[metric].hi,
            key=f"{page}-hi-{metric}",
        )
    thr_q = query_float("thr", 0.0) or 0.0
    thr = c4.select_slider(
        "Outline tokens above",
        THRESHOLDS,
        value=min(THRESHOLDS, key=lambda t: abs(t - thr_q)),
        key=f"{page}-thr",
        format_func=lambda v: "off" if v == 0 else f"{v:g}",
    )
    set_query(runs=",".join(r.run_id for r in runs), seq=seq, metric=metric, thr=thr or None, scale="raw" if raw else None)

    _cut_notice(runs, int(seq))
    window = _window(runs, int(seq), page)
    floors = noise_floors(runs, diag)
    st.caption(
        (
            "Each token is coloured by how many of its MoE layers picked other experts in vLLM than in HF. "
            if metric == ROUTING_METRIC
            else "Each token is coloured by how far apart the engines are. "
        )
        + "Hover a token for both engines' values, ranks and their five most likely tokens (shown in a panel at the "
        "lower right)."
    )
    st.html(
        token_view_html(
            runs,
            int(seq),
            metric,
            thr or None,
            hi,
            raw=raw,
            floors=floors["tail"] if floors else None,
            floor_words=floors["tail_words"] if floors else None,
            window=window,
            layers={d: o.layers for d, o in diag.dtypes.items() if o.layers} if diag else None,
        )
    )

    if floors:
        st.caption("Noise floor: " + " · ".join(floor_caption(d, floors) for d in floors["hf"]))
    df = chart_frame(runs, int(seq))
    tabs = st.tabs(
        [
            "How big the gaps are",
            "vLLM against HF",
            "Gap along the text",
            "Gap against probability",
            "Worst 20 tokens",
            "All prompts",
        ]
    )
    for tab, (name, make) in zip(tabs[:4], CHARTS.items()):
        with tab:
            if df.empty:
                st.info("No scored tokens.")
            elif name == "by_position" and floors:
                st.altair_chart(make(df, floors["hf"]), width="stretch")
            else:
                st.altair_chart(make(df), width="stretch")
    with tabs[4]:
        worst = worst_tokens(runs, 20, int(seq))
        st.dataframe(worst, hide_index=True, width="stretch", column_config=sci_columns(worst))
    with tabs[5]:
        st.caption("Worst 20 tokens over every prompt of these runs")
        worst_all = worst_tokens(runs, 20)
        st.dataframe(worst_all, hide_index=True, width="stretch", column_config=sci_columns(worst_all))

    _downloads(runs, page, diag)
    _share(runs, int(seq), metric, thr or None, page, raw)


def sci_columns(df: pd.DataFrame, skip: tuple[str, ...] = ("prompt", "position", "token_id")) -> dict:
    """Small numbers in e-notation (4.000e-06, not 0.000004), as everywhere else in the app."""
    return {c: st.column_config.NumberColumn(format="%.3e") for c in df.select_dtypes("number").columns if c not in skip}


@st.cache_data(max_entries=16, show_spinner=False)
def _report_bytes(run_ids: tuple[str, ...], diag_id: str | None) -> bytes:
    from logprob_parity.dashboard.state import get_store, load_run

    diag = get_store().load_diagnostics(diag_id) if diag_id else None
    return report_html([load_run(r) for r in run_ids], diag).encode("utf-8")


def _downloads(runs: list[Run], page: str, diag: DiagnosticsResult | None) -> None:
    """Files are made when their button is clicked (deferred data), not on every render: the HTML
    report draws its charts as SVG, which alone took seconds of each rerun."""
    ids = tuple(r.run_id for r in runs)
    stem = f"logprob-parity-{'-'.join(i[:8] for i in ids)}"
    diag_id = diag.diagnostics_id if diag else None

    def as_json() -> str:
        data = [r.to_json_dict() for r in runs]
        return json.dumps(data if len(data) > 1 else data[0], allow_nan=False)

    def as_parquet() -> bytes:
        buf = io.BytesIO()
        pd.concat([r.to_frame().assign(dtype=r.dtype, run_id=r.run_id) for r in runs]).to_parquet(buf, index=False)
        return buf.getvalue()

    c1, c2, c3 = st.columns(3)
    c1.download_button(
        "HTML report",
        lambda: _report_bytes(ids, diag_id),
        f"{stem}.html",
        "text/html",
        key=f"{page}-dl-html",
        icon=":material/description:",
        on_click="ignore",
    )
    c2.download_button(
        "JSON",
        as_json,
        f"{stem}.json",
        "application/json",
        key=f"{page}-dl-json",
        icon=":material/data_object:",
        on_click="ignore",
    )
    c3.download_button(
        "Parquet",
        as_parquet,
        f"{stem}.parquet",
        "application/octet-stream",
        key=f"{page}-dl-parquet",
        icon=":material/table:",
        on_click="ignore",
    )
