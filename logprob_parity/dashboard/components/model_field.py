"""The one model control every form shares: a preset list and a field to type any Hub id or folder.

Why typing wins: a person who types `org/name` into the field and presses Run means that model. The
earlier pair of controls ran the preset above and ignored the field unless the preset was "Other",
so a typo-free Hub id silently became a run of the demo model. Now a filled field is what runs, and
the status line names the model before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st

DEMO_LABEL = "demo: SmolLM2-135M-Instruct (embedded, offline)"
PRESETS = {
    DEMO_LABEL: "demo",
    "facebook/opt-125m (Hub)": "facebook/opt-125m",
}
FIELD_LABEL = "…or type a Hub id or local folder (used instead when filled)"
FIELD_HELP = "Leave empty to run the model picked above. Anything typed here is the model that runs: org/name, or a folder."


@st.cache_data(ttl=300, show_spinner=False)
def unavailable_presets() -> dict[str, str]:
    """Hub presets that cannot load here (label -> why): not cached and no Hub (checked every 5 minutes)."""
    from logprob_parity.inputs.models import hub_model_why_not

    out = {}
    for label, model in PRESETS.items():
        if model != "demo" and not Path(model).is_dir():
            why = hub_model_why_not(model)
            if why:
                out[label] = why
    return out


def model_inputs(container: Any, key: str, label: str = "Model") -> tuple[str, str]:
    """Draw the pair; returns (preset label, typed text). A Hub preset that cannot load here is not
    offered: it is named below the list, greyed, with the reason (a selectbox cannot grey one option)."""
    gone = unavailable_presets()
    offered = [p for p in PRESETS if p not in gone]
    if st.session_state.get(f"{key}-preset") not in offered:
        st.session_state[f"{key}-preset"] = offered[0]
    preset = container.selectbox(label, offered, key=f"{key}-preset")
    for name, why in gone.items():
        container.caption(f":material/block: :gray[{name}: not offered here, {why}.]")
    typed = container.text_input(FIELD_LABEL, key=f"{key}-custom", placeholder="org/name or /path/to/model", help=FIELD_HELP)
    return preset, typed


def chosen_model(preset: str, typed: str) -> str:
    """The model that runs: the typed Hub id or folder when there is one, else the preset's."""
    return typed.strip() or PRESETS.get(preset, "demo")


def model_state(key: str, asked: str) -> dict[str, Any]:
    """Widget state that shows `asked` (a stored run's model): its preset, or the field filled with it."""
    labels = {v: k for k, v in PRESETS.items() if k not in unavailable_presets()}
    if asked in labels:
        return {f"{key}-preset": labels[asked], f"{key}-custom": ""}
    return {f"{key}-preset": DEMO_LABEL, f"{key}-custom": asked}


def model_words(model: str | None) -> str:
    """The model in the status line, before anything starts."""
    if model in (None, "", "demo"):
        return "the embedded demo model (SmolLM2-135M-Instruct)"
    return f"`{model}`"
