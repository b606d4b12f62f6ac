"""The one model control every form shares: a preset list and a field to type any Hub id or folder.

Why typing wins: a person who types `org/name` into the field and presses Run means that model. The
earlier pair of controls ran the preset above and ignored the field unless the preset was "Other",
so a typo-free Hub id silently became a run of the demo model. Now a filled field is what runs, and
the status line names the model before anything starts.
"""

from __future__ import annotations

from typing import Any

DEMO_LABEL = "demo: SmolLM2-135M-Instruct (embedded, offline)"
PRESETS = {
    DEMO_LABEL: "demo",
    "facebook/opt-125m (Hub)": "facebook/opt-125m",
}
FIELD_LABEL = "…or type a Hub id or local folder (used instead when filled)"
FIELD_HELP = "Leave empty to run the model picked above. Anything typed here is the model that runs: org/name, or a folder."


def model_inputs(container: Any, key: str, label: str = "Model") -> tuple[str, str]:
    """Draw the pair; returns (preset label, typed text)."""
    preset = container.selectbox(label, list(PRESETS), key=f"{key}-preset")
    typed = container.text_input(FIELD_LABEL, key=f"{key}-custom", placeholder="org/name or /path/to/model", help=FIELD_HELP)
    return preset, typed


def chosen_model(preset: str, typed: str) -> str:
    """The model that runs: the typed Hub id or folder when there is one, else the preset's."""
    return typed.strip() or PRESETS.get(preset, "demo")


def model_state(key: str, asked: str) -> dict[str, Any]:
    """Widget state that shows `asked` (a stored run's model): its preset, or the field filled with it."""
    labels = {v: k for k, v in PRESETS.items()}
    if asked in labels:
        return {f"{key}-preset": labels[asked], f"{key}-custom": ""}
    return {f"{key}-preset": DEMO_LABEL, f"{key}-custom": asked}


def model_words(model: str | None) -> str:
    """The model in the status line, before anything starts."""
    if model in (None, "", "demo"):
        return "the embedded demo model (SmolLM2-135M-Instruct)"
    return f"`{model}`"
