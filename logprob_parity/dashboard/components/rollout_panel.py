"""The Rollout page's parts: its form (prompts, model, dtypes, sampling) and the display of stored
rollouts (verdict, coloured completions, ratio strip, histograms, three-way table, floors, export)."""

from __future__ import annotations

import dataclasses
from typing import Any

import streamlit as st

from logprob_parity.analysis.estimate import cold_engines, record, rollout_defaults, rollout_estimate
from logprob_parity.analysis.rollout import NOISE_SAMPLES, STEPS_PER_DTYPE, rollout
from logprob_parity.analysis.turns import in_turn_weights
from logprob_parity.analysis.verdict import Verdict
from logprob_parity.dashboard.components.alerts import into_view_once, show_error
from logprob_parity.dashboard.components.model_field import chosen_model, model_inputs
from logprob_parity.dashboard.components.run_view import verdict_cards
from logprob_parity.dashboard.components.runner import run_job
from logprob_parity.dashboard.components.settings_form import setting_input
from logprob_parity.dashboard.components.tables import picked_rows
from logprob_parity.dashboard.state import (
    device_here,
    dtype_reasons,
    engines_available,
    get_store,
    model_path_of,
    model_roots,
    query_int,
    set_query,
)
from logprob_parity.engines.pool import POOL
from logprob_parity.errors import UserError
from logprob_parity.inputs.settings import EngineSettings
from logprob_parity.inputs.spec import BOS_POLICIES, DTYPES, RunSpec
from logprob_parity.present.rollout_view import (
    SHORT,
    STRIP_SAMPLES,
    completion_html,
    delta_histogram,
    floors_table,
    metrics_table,
    ratio_histogram,
    ratio_strip,
    rollout_report_html,
    shown_pairs,
    strip_samples,
    token_frame,
)
from logprob_parity.results.rollout import PAIRS, Rollout, Sampling, sampling_words

KEY = "rollout"
PAIR_WORDS = {p: w for p, (_, _, w) in PAIRS.items()}

GLOSSARY = """
- **rollout**: text an RL system samples from the model with vLLM; the trainer then rescores the same tokens with its own
  model code (here: HF transformers). If the two disagree, the training signal is biased.
- **decode vs prefill**: vLLM computes a sampled token's probability while generating (*decode*, one token at a time,
  CUDA graphs, batches of requests) and can recompute it from the whole text at once (*prefill*). They use different code.
- **importance ratio**: the trainer's probability of a token divided by the rollout's. 1 is a perfect match; RL trainers
  clip it (TIS, at a cap) or mask tokens outside a band (MIS/IcePop).
- **effective sample size**: how many of the tokens still count once weighted by their ratios (100% when all ratios agree).
- **log(kept mass)**: with top-p or top-k, vLLM samples from the most likely tokens only and renormalises; a trainer
  that rescores without the cut sees probabilities lower by this much.
- **noise floor**: how much one side moves when only the batch or the way of scoring changes.
"""


def rollout_form() -> tuple[RunSpec | None, Sampling | None, bool]:
    """The form; (spec, sampling, floors) when Run was pressed with valid input, else (None, None, False).
    Its defaults are sized to the device (logprob_parity.analysis.estimate), and it says beforehand about
    how long a run will take here."""
    blocked = engines_available()
    reasons = dtype_reasons()
    device = device_here()
    gpu = device != "cpu"
    d = rollout_defaults(device)
    with st.form(f"{KEY}-form"):
        c1, c2 = st.columns([3, 2])
        preset, typed = model_inputs(c1, KEY)
        bos = c2.radio("BOS", BOS_POLICIES, key=f"{KEY}-bos", horizontal=True)
        text = st.text_area("Prompts, one a line", d.prompts, key=f"{KEY}-text", height=90)
        s1, s2, s3, s4, s5, s6 = st.columns(6)
        samples = s1.number_input("samples a prompt", 1, 64, d.samples, key=f"{KEY}-samples")
        max_tokens = s2.number_input("max new tokens", 1, 2048, d.max_tokens, key=f"{KEY}-max")
        temperature = s3.number_input("temperature", 0.05, 5.0, 1.0, step=0.1, key=f"{KEY}-temp")
        top_p = s4.number_input("top-p", 0.01, 1.0, 1.0, step=0.05, key=f"{KEY}-topp")
        top_k = s5.number_input("top-k (-1: all)", -1, 100_000, -1, key=f"{KEY}-topk")
        seed = s6.number_input("seed", 0, 2**31 - 1, 0, key=f"{KEY}-seed")
        st.markdown("**Dtypes**")
        chosen = [
            d
            for col, d in zip(st.columns(len(DTYPES)), DTYPES)
            if col.checkbox(
                d,
                value=d in ("bfloat16", "float32") and reasons.get(d) is None,
                key=f"{KEY}-dt-{d}",
                disabled=reasons.get(d) is not None,
                help=reasons.get(d) or f"roll out in {d}",
            )
        ]
        f1, f2 = st.columns(2)
        floors = f1.checkbox(
            "Measure the noise floors too" + ("" if gpu else " (slow on a CPU)"),
            d.floors,
            key=f"{KEY}-floors",
            help="How much each side moves when only the batch or the way of scoring changes: the verdict then "
            "judges the gap against them. Without them it says the noise is not yet measured.",
        )
        graphs = f2.checkbox(
            "CUDA graphs for decoding",
            gpu,
            key=f"{KEY}-graphs",
            disabled=not gpu,
            help=None if gpu else "GPUs only: a CPU always decodes eagerly",
        )
        if not gpu:
            f2.caption(":material/block: CUDA graphs: GPUs only; this CPU decodes eagerly.")
        cap = setting_input(st, "device_memory", KEY)
        submitted = st.form_submit_button("Run", type="primary", disabled=blocked is not None)
    n_prompts = len([line for line in text.splitlines() if line.strip()])
    eager = (not graphs) or not gpu
    run_settings = dataclasses.replace(EngineSettings(), enforce_eager=eager)
    wanted = [(b, x) for x in chosen for b in ("hf", "vllm")]
    cold = cold_engines(POOL, model_path_of(chosen_model(preset, typed)), wanted, run_settings)
    weights = in_turn_weights(chosen_model(preset, typed), chosen, cap, model_roots())
    seconds, words = rollout_estimate(device, n_prompts, int(samples), int(max_tokens), len(chosen), floors, cold, weights)
    st.session_state[f"{KEY}-estimate"] = seconds  # run_rollout says so when the run takes over twice this
    st.caption(":material/schedule: " + words)
    # One spot for this form's message. The run itself draws below the tabs, so without a placeholder
    # a refused run's error would stay on screen, faded, for the whole of the next (valid) run.
    say = st.empty()
    if blocked:
        say.info(blocked)
    if not submitted:
        return None, None, False
    model = chosen_model(preset, typed)
    prompts = tuple(line for line in text.splitlines() if line.strip())
    if not prompts:
        show_error("Enter at least one prompt: one a line, each a text the model continues.", say)
        return None, None, False
    sampling = Sampling(
        samples=int(samples),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        max_tokens=int(max_tokens),
        seed=int(seed),
    )
    try:
        sampling.validate()
        run_settings = dataclasses.replace(run_settings, device_memory=cap)
        spec = RunSpec(texts=prompts, model=model, dtypes=tuple(chosen), bos=bos, settings=run_settings)
        spec.validate()
    except UserError as exc:
        show_error(str(exc), say)
        return None, None, False
    return spec, sampling, floors


IMPORT_KEY = "rollout-import"


def import_form() -> tuple[Any, str, dict[str, str], RunSpec] | None:
    """Logged rollouts to rescore (logprob_parity.inputs.rollout_logs): an uploaded file within the server's size
    limit, or a path under the server's model-root rules (read a line at a time, not into memory);
    (its bytes or path, file name, field mapping, spec) when
    Rescore was pressed with usable input, else None (with the reason on the page)."""
    from pathlib import Path

    from logprob_parity.dashboard.state import model_roots
    from logprob_parity.inputs.models import check_allowed
    from logprob_parity.inputs.prompts import MAX_UPLOAD_BYTES
    from logprob_parity.inputs.rollout_logs import parse_mapping

    blocked = engines_available()
    reasons = dtype_reasons()
    with st.form(f"{IMPORT_KEY}-form"):
        st.markdown(
            "**Rescore rollouts you already have**: one sequence a record, with your rollout engine's logprobs "
            "(`prompt_token_ids` or `prompt`, `completion_token_ids`, `logprobs`; JSONL, Parquet, or this page's "
            "JSON download)"
        )
        upload = st.file_uploader(
            f"Rollouts file, up to {MAX_UPLOAD_BYTES >> 20} MiB", type=["jsonl", "parquet", "json"], key=f"{IMPORT_KEY}-file"
        )
        path = st.text_input("or a path on the server", key=f"{IMPORT_KEY}-path", placeholder="/data/rollouts/step-100.jsonl")
        c1, c2 = st.columns([3, 2])
        preset, typed = model_inputs(c1, IMPORT_KEY, "Model (the one that wrote them)")
        mapping = c2.text_input(
            "Other column names (FIELD=COLUMN, commas between)", key=f"{IMPORT_KEY}-map", placeholder="logprobs=rollout_log_probs"
        )
        chosen = [
            d
            for col, d in zip(st.columns(len(DTYPES)), DTYPES)
            if col.checkbox(
                d,
                value=d == "float32" and reasons.get(d) is None,
                key=f"{IMPORT_KEY}-dt-{d}",
                disabled=reasons.get(d) is not None,
                help=reasons.get(d) or f"rescore in {d}",
            )
        ]
        submitted = st.form_submit_button("Rescore", type="primary", disabled=blocked is not None, icon=":material/upload_file:")
    say = st.empty()  # cleared on every submit, like the Run form's
    if not submitted:
        return None
    try:
        if upload is not None:
            data, name = upload.getvalue(), upload.name
            if len(data) > MAX_UPLOAD_BYTES:
                raise UserError(f"{name} is {len(data) >> 20} MiB; the limit is {MAX_UPLOAD_BYTES >> 20} MiB")
        elif path.strip():
            p = Path(path.strip()).expanduser()
            check_allowed(str(p.resolve()), model_roots())  # the same rules as a model folder
            if not p.is_file():
                raise UserError(f"{p} is not a file on this server")
            data, name = p, p.name
        else:
            raise UserError("Upload a rollouts file or give a path on the server.")
        model = chosen_model(preset, typed)
        spec = RunSpec(texts=("logged rollouts",), model=model, dtypes=tuple(chosen))
        spec.validate()
        return data, name, parse_mapping(mapping), spec
    except UserError as exc:
        show_error(str(exc), say)
        return None


def run_rescore(data: Any, name: str, mapping: dict[str, str], spec: RunSpec) -> list[Rollout] | None:
    from logprob_parity.analysis.rescore import rescore

    return run_job(
        lambda ctx: rescore(data, name, spec, ctx, mapping=mapping),
        "Rescoring the logged rollouts",
        2 + 5 * max(1, len(spec.dtypes)),
        clear="rollout",
        progress_bar=True,
        dtypes=len(spec.dtypes),
        model=spec.model,
    )


def run_rollout(spec: RunSpec, sampling: Sampling, floors: bool = True) -> list[Rollout] | None:
    done = run_job(
        lambda ctx: rollout(spec, sampling, ctx, noise_samples=NOISE_SAMPLES if floors else 0),
        "Sampling and rescoring",
        2 + STEPS_PER_DTYPE * max(1, len(spec.dtypes)),
        clear="rollout",
        model=spec.model,
        estimate=("rollout", st.session_state.get(f"{KEY}-estimate") or 0.0),
    )
    device = device_here()
    units = len(spec.texts) * sampling.samples * sampling.max_tokens
    for r in done or []:  # this server's own rates, for the next estimate
        t = r.meta.timing or {}
        if not r.from_store and t.get("total_s"):
            record("rollout", device, t["total_s"] - t.get("load_s", 0.0) - t.get("noise_s", 0.0), units)
            if floors:
                record("rollout_floors", device, t.get("noise_s", 0.0), units)
    return done


@st.cache_resource(max_entries=32)
def load_rollout(rollout_id: str) -> Rollout:
    """Rollouts are content-addressed and immutable: one loaded copy serves every session."""
    return get_store().load_rollout(rollout_id)


def rollouts_from_query() -> list[Rollout]:
    out = []
    for rid in [r for r in st.query_params.get("rollout", "").split(",") if r][:4]:
        try:
            out.append(load_rollout(get_store().resolve_rollout_id(rid.strip())))
        except UserError as exc:
            st.warning(str(exc), icon=":material/warning:")
    return out


def _verdict(ro: Rollout) -> Verdict:
    v = ro.meta.verdict
    return Verdict(v.get("level", "differs"), v.get("headline", ""), tuple(v.get("reasons", ())), tuple(v.get("thresholds", ())))


COMPUTED = "lpp-rollouts-computed"  # rollout id -> seconds, for rollouts this browser session computed


def remember_computed(ros: list[Rollout]) -> None:
    done = st.session_state.setdefault(COMPUTED, {})
    for r in ros:
        if not r.from_store:
            done[r.rollout_id] = r.meta.timing.get("total_s")


def _provenance(r: Rollout) -> str:
    total = st.session_state.get(COMPUTED, {}).get(r.rollout_id, "stored")
    if total == "stored":
        return "from the store"
    return f"computed now, in {total:.1f} s" if isinstance(total, (int, float)) else "computed now"


GOTO = f"{KEY}-goto"  # the sample a click in the worst lists opens, for the number picker's next run


@st.cache_resource(max_entries=16, show_spinner=False)
def pair_views(rollout_id: str, pair: str, _r: Rollout) -> dict[str, Any]:
    """What the page shows of one rollout and pair that reads every token: the worst lists, the ratio
    strip and the histograms. A rollout is content-addressed, so (id, pair) names them, and a rerun
    (another sample, a click) reuses them instead of reading millions of tokens again."""
    worst = _r.worst_sequences(pair, max(20, STRIP_SAMPLES))
    shown, title = strip_samples(_r, worst)
    every = token_frame(_r, pair, pieces=False)
    summary = _r.meta.summary[pair]
    return {
        "seqs": worst.head(20),
        "toks": _r.worst_tokens(pair, 20),
        "strip": ratio_strip(token_frame(_r, pair, shown), title),
        "deltas": delta_histogram(every, _r.dtype),
        "ratios": ratio_histogram(every, _r.dtype, summary.get("tis_cap", 2.0), tuple(summary.get("mis_band", (0.5, 2.0)))),
    }


def worst_lists(r: Rollout, pair: str) -> None:
    """Where the importance ratio breaks most, worst first: sequences and tokens; clicking a row opens
    that sequence's coloured view above."""
    with st.expander(
        f"Where the ratio breaks most ({r.dtype}): the sequences and tokens furthest from 1, worst first",
        expanded=r.meta.sampling.get("source") == "logged",
        icon=":material/sort:",
    ):
        c1, c2 = st.columns(2)
        views = pair_views(r.rollout_id, pair, r)
        seqs = views["seqs"]
        seqs = seqs.assign(sample=seqs["sample"] + 1) if not seqs.empty else seqs  # numbered as the Sample list numbers them
        c1.caption("Sequences by their whole-sequence log ratio Σ log ρ (0 is a perfect match)")
        rows1 = picked_rows(
            seqs,
            f"{KEY}-worst-seq",
            where=c1,
            column_config={
                "seq_log_ratio": st.column_config.NumberColumn(format="%.3e"),
                "largest |Δ|": st.column_config.NumberColumn(format="%.3e"),
            },
        )
        toks = views["toks"]
        toks = toks.assign(sample=toks["sample"] + 1) if not toks.empty else toks
        c2.caption("Tokens by |Δ logp|; ratio = the trainer's probability / the rollout's")
        rows2 = picked_rows(
            toks,
            f"{KEY}-worst-tok",
            where=c2,
            column_config={
                k: st.column_config.NumberColumn(format="%.3e")
                for k in toks.columns
                if k not in ("sample", "position", "token_id", "token")
            },
        )
        # a click on any cell opens that row's sequence, as does the row's checkbox
        picked = [int(seqs.loc[i, "sample"]) - 1 for i in rows1] + [int(toks.loc[i, "sample"]) - 1 for i in rows2]
        if picked and picked[0] != query_int("sample", 0, 0, max(len(r.samples) - 1, 0)):
            set_query(sample=picked[0])
            st.session_state.pop(f"{KEY}-sample", None)  # the picker then starts from the query's sample
            st.session_state[GOTO] = picked[0]
            st.rerun()


PICK_LIMIT = 1000  # up to this many samples, a list to pick from; beyond, a number (the worst lists open the rest)


def sample_picker(r: Rollout) -> int:
    """Which sample's coloured view to show: a list of all (number and prompt) for a few hundred
    samples; a number for a rescore of thousands, whose list would be sent to the browser on every
    rerun."""
    n = len(r.samples)
    current = query_int("sample", 0, 0, max(n - 1, 0))
    if n <= PICK_LIMIT:
        return st.selectbox(
            "Sample", range(n), index=current, format_func=lambda i: f"{i + 1}: {r.prompt_of(i)[:60]}", key=f"{KEY}-sample"
        )
    key = f"{KEY}-sample-no"
    goto = st.session_state.pop(GOTO, None)  # a click in the worst lists: the browser keeps the number otherwise
    if goto is not None or key not in st.session_state:
        st.session_state[key] = min(goto if goto is not None else current, n - 1) + 1
    return int(st.number_input(f"Sample (1 to {n:,}; the lists below open the worst)", 1, n, key=key)) - 1


def json_text(r: Rollout) -> str:
    """The --json text of a rollout, for the download button (written a sample at a time)."""
    import io

    buf = io.StringIO()
    r.write_json(buf)
    return buf.getvalue()


def show_rollouts(ros: list[Rollout]) -> None:
    into_view_once("rollout:" + ",".join(r.rollout_id for r in ros))  # a new result, or a share link
    verdict_cards([_verdict(r) for r in ros])
    m = ros[0].meta
    st.caption(
        f"{m.model} · device {m.env.device} · torch {m.env.torch} · transformers {m.env.transformers} · "
        f"vLLM {m.env.vllm} · {sampling_words(m.sampling)} · "
        + " · ".join(f"{r.dtype}: rollout `{r.rollout_id}`, {_provenance(r)}" for r in ros)
    )
    pairs = shown_pairs(ros[0])
    pair = st.radio("Colour the tokens by", pairs, format_func=PAIR_WORDS.get, horizontal=True, key=f"{KEY}-pair")
    sample = sample_picker(ros[0])
    set_query(sample=sample)
    for r in ros:
        st.markdown(f"**{r.dtype}**")
        if sample < len(r.samples):
            st.html(completion_html(r, sample, pair))
    worst_lists(ros[0], pair)
    tabs = st.tabs([r.dtype for r in ros])
    for tab, r in zip(tabs, ros):
        with tab:
            views = pair_views(r.rollout_id, pair, r)
            st.altair_chart(views["strip"], width="stretch")
            c1, c2 = st.columns(2)
            c1.altair_chart(views["deltas"], width="stretch")
            c2.altair_chart(views["ratios"], width="stretch")
            st.markdown(
                "**Three-way comparison**: "
                + "; ".join(f"*{SHORT[p]}*: {PAIR_WORDS[p]}" for p in shown_pairs(r))
                + ". Δ = the first side − the second; ratio = the second's probability / the first's. The exact KL "
                "and the same-top share need both sides' whole distribution, so only the prefill-vs-HF column has "
                "them (a decode keeps its sampled token's logprob alone; "
                f"{r.meta.env.vllm_engine.get('kl_full', 'exact KL: not recorded in this rollout')})."
            )
            table = metrics_table(r)
            st.dataframe(table, hide_index=True, width="stretch", height=35 * (len(table) + 1) + 3)
            st.markdown("**Noise floors**: how much one side moves when only this changes")
            st.dataframe(floors_table(r), hide_index=True, width="stretch")
            d1, d2, d3 = st.columns(3)
            d1.download_button(
                "HTML report",
                lambda r=r: rollout_report_html(r),
                f"rollout-{r.rollout_id}.html",
                "text/html",
                icon=":material/download:",
                key=f"dl-html-{r.rollout_id}",
            )
            d2.download_button(
                "JSON",
                lambda r=r: json_text(r),
                f"rollout-{r.rollout_id}.json",
                "application/json",
                icon=":material/download:",
                key=f"dl-json-{r.rollout_id}",
            )
            d3.download_button(
                "Parquet",
                lambda r=r: r.to_frame().to_parquet(index=False),
                f"rollout-{r.rollout_id}.parquet",
                "application/octet-stream",
                icon=":material/download:",
                key=f"dl-pq-{r.rollout_id}",
            )
    with st.expander("What do these words mean?", icon=":material/help:"):
        st.markdown(GLOSSARY)
