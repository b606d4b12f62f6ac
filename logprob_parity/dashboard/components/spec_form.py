"""The run form shared by the Compare and Prompt-set pages: model, dtypes, BOS, top-k, engine knobs."""

from __future__ import annotations

import streamlit as st

from logprob_parity.dashboard.components.alerts import show_error
from logprob_parity.dashboard.components.model_field import PRESETS, chosen_model, model_inputs, model_state
from logprob_parity.dashboard.components.settings_form import settings_inputs, widget_state
from logprob_parity.dashboard.state import dtype_reasons, engines_available
from logprob_parity.errors import UserError
from logprob_parity.inputs.prompts import SEED_TEXT
from logprob_parity.inputs.settings import EngineSettings
from logprob_parity.inputs.spec import BOS_POLICIES, DTYPES, MAX_TOP_K, RunSpec

SHOWN_KEY = "{key}-form-shows"  # the run ids the form was last filled from


def follow_view(key: str, runs: list, with_text: bool) -> None:
    """Make the form show what the view shows: when the runs on screen are not the ones the form was
    last filled from (a share link, a run opened from the Runs page), fill text, model, dtypes, BOS,
    top-k, truncation and engine settings from them, so pressing Run recomputes what is on screen.
    Call before `spec_form` draws its widgets."""
    ids = ",".join(r.run_id for r in runs)
    marker = SHOWN_KEY.format(key=key)
    if not runs or st.session_state.get(marker) == ids:
        return
    st.session_state[marker] = ids
    m = runs[0].meta
    asked = "demo" if m.model.split(":")[0] == "demo" else m.model  # the demo model is named "demo:<name>" in runs
    preset = asked in PRESETS.values()
    state = {
        **model_state(key, asked),
        f"{key}-revision": m.revision if not preset and m.revision and not asked.startswith("/") else "",
        f"{key}-bos": m.bos,
        f"{key}-topk": int(m.top_k),
        f"{key}-truncate": any(s.cut_from for s in m.sequences),
        f"{key}-noise": m.summary.get("hf_noise_mean") is not None,
        f"{key}-null": is_null(m),
    }
    if with_text and m.sequences:
        state[f"{key}-text"] = m.sequences[0].text
    shown = {r.dtype for r in runs}
    state.update({f"{key}-dt-{d}": d in shown for d in DTYPES})
    settings = {k: v for k, v in m.settings.items() if k != "max_model_len"}
    state.update(widget_state(key, settings))
    for k, v in state.items():
        st.session_state[k] = v


def mark_shown(key: str, runs: list) -> None:
    """The form already shows these runs (they were just computed from it): nothing to fill."""
    st.session_state[SHOWN_KEY.format(key=key)] = ",".join(r.run_id for r in runs)


def spec_form(
    key: str, with_text: bool, noise_choice: bool = True, run_now: bool = False, null_choice: bool = True
) -> tuple[RunSpec | None, bool]:
    """Render the form; return (spec, submitted). Texts are filled by the caller when with_text is False.
    `noise_choice`: offer the comparison's own noise floor (Diagnostics has its own noise check instead).
    `null_choice`: offer HF against itself in vLLM's place (a comparison's control; Diagnostics explains
    vLLM's gap, and with no vLLM there is no gap to explain).
    `run_now`: submitted as if Run were pressed, with the form's values as they stand (a one-click sample)."""
    blocked = engines_available()
    reasons = dtype_reasons()
    with st.form(f"{key}-form"):
        c1, c2, c3 = st.columns([3, 2, 1])
        preset, typed = model_inputs(c1, key)
        revision = c2.text_input("Revision (Hub only)", key=f"{key}-revision", placeholder="main")
        bos = c3.radio("BOS", BOS_POLICIES, key=f"{key}-bos", help="auto: prepend the tokenizer's BOS when it has one")
        text = st.text_area("Text", SEED_TEXT, key=f"{key}-text", height=110) if with_text else ""
        st.markdown("**Dtypes**")
        dcols = st.columns(len(DTYPES) + 1)
        chosen = []
        for col, d in zip(dcols, DTYPES):
            why = reasons.get(d)
            default = d in ("bfloat16", "float32") and why is None
            if col.checkbox(d, value=default, key=f"{key}-dt-{d}", disabled=why is not None, help=why or f"compare in {d}"):
                chosen.append(d)
        top_k = dcols[-1].number_input("top-k", 1, MAX_TOP_K, 5, key=f"{key}-topk")
        c4, c5 = st.columns(2)
        truncate = c4.checkbox("Truncate prompts longer than the model's positions", False, key=f"{key}-truncate")
        noise = (
            c5.checkbox(
                "Measure HF's own noise floor too",
                True,
                key=f"{key}-noise",
                help="HF against itself when its micro-batch, padding side, packing or chunking through its KV cache "
                "changes (what a trainer changes from step to step), on the first texts; and vLLM alone against "
                "batched. The verdict then says whether the gap is more than that noise, and which change set it. "
                "It costs about a tenth more on a GPU at scale; on a CPU, about a second a dtype for a short text.",
            )
            if noise_choice
            else True  # Diagnostics: always, as before; its page offers the wider noise check as a part
        )
        null = (
            st.checkbox(
                "Show what noise looks like: HF against itself instead of vLLM",
                False,
                key=f"{key}-null",
                help="A control: HF scores the same ids twice, once a text at a time and once in a padded batch "
                "with other texts, as a trainer's micro-batch changes. The page then shows HF's own noise in the same "
                "colours and with the same verdict, so you can see what a gap that is only noise looks like.",
            )
            if with_text and null_choice
            else False
        )
        st.caption(
            "Backends: HF transformers against itself (what noise looks like)."
            if null
            else "Backends: HF transformers and vLLM, on the same token ids."
        )
        with st.expander("Engine settings (recorded in the run id)"):
            values = settings_inputs(key)
        submitted = st.form_submit_button("Run", type="primary", disabled=blocked is not None)
        submitted = submitted or (run_now and blocked is None)
    if blocked:
        st.info(blocked)
    if values["trust_remote_code"]:
        st.warning("trust_remote_code is ON: the model's own Python code will run on this server.")
    if not submitted:
        return None, False
    model = chosen_model(preset, typed)
    try:
        settings = EngineSettings(**values)
        settings.validate()
    except UserError as exc:
        show_error(str(exc))
        return None, False
    spec = RunSpec(
        texts=(text,) if with_text else (),
        model=model,
        revision=revision.strip() or None,
        dtypes=tuple(chosen),
        top_k=int(top_k),
        bos=bos,
        settings=settings,
        truncate=truncate,
        noise_floor=noise,
        null=null,
    )
    return spec, True


def is_null(meta: object) -> bool:
    """A null comparison's run: HF against itself in vLLM's place (analysis.compare.NULL_BACKEND)."""
    return "hf_null" in tuple(getattr(meta, "backends", ()))
