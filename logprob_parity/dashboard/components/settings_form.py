"""The Engine settings inputs, generated from the settings registry (logprob_parity.inputs.settings.SETTINGS).

Each registered setting becomes one widget: a checkbox for an on/off setting with a fixed default,
a choice with "default" for optional or enumerated ones, a number input (0 = the engine's default)
for optional numbers. Nothing here names a setting, so a new registry entry appears by itself.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from logprob_parity.engines.build import unsupported
from logprob_parity.inputs.settings import SETTINGS, Setting

DEFAULT = "default"
ON_OFF = {"on": True, "off": False}
NUMBER_MAX = 1 << 20


def _widget(container: Any, s: Setting, key: str, initial: Any, refused: dict[Any, str]) -> Any:
    """Draw one setting's input; return its value (None: the engine's default). `refused`: the values
    this vLLM build cannot run, with why: they are not offered, and the reason shows under the input."""
    label = s.label or s.name
    wkey = f"{key}-set-{s.name}"
    if s.kind is bool and not s.optional:
        got = container.checkbox(label, bool(initial), key=wkey, help=s.help)
        for value, why in refused.items():  # the run is refused in these words before any engine starts
            container.caption(f":material/block: {s.name} {'on' if value else 'off'} cannot take effect here: {why}.")
        return got
    if s.kind is bool or s.choices is not None:
        allowed = [c for c in (s.choices or ()) if c not in refused]
        options = [DEFAULT] + (list(ON_OFF) if s.kind is bool else [str(c) for c in allowed])
        shown = DEFAULT if initial is None else ({True: "on", False: "off"}[initial] if s.kind is bool else str(initial))
        picked = container.selectbox(
            label,
            options,
            index=options.index(shown) if shown in options else 0,
            key=wkey,
            help=s.help,
            disabled=len(options) == 1,
        )
        for value, why in refused.items():
            container.caption(f":material/block: {s.name}={value} is not offered here: {why}.")
        if picked == DEFAULT:
            return None
        return ON_OFF[picked] if s.kind is bool else s.kind(picked)
    if s.kind in (int, float):
        lo = 0 if s.optional else (s.minimum if s.minimum is not None else 0)
        hi = s.maximum if s.maximum is not None else NUMBER_MAX
        lo, hi = s.kind(lo), s.kind(hi)
        value = s.kind(initial) if initial is not None else s.kind(0)
        step = 0.05 if s.kind is float else 1
        shown_label = f"{label} (0 = engine default)" if s.optional else label
        got = container.number_input(shown_label, lo, hi, value, step, key=wkey, help=s.help)
        return None if s.optional and got == 0 else s.kind(got)
    text = container.text_input(label, "" if initial is None else str(initial), key=wkey, help=s.help)
    return text.strip() or (None if s.optional else s.default)


def widget_state(key: str, values: dict[str, Any], registry: tuple[Setting, ...] = SETTINGS) -> dict[str, Any]:
    """The widget values that show these settings (session-state keys of `settings_inputs`), so a form
    can be made to show a stored run's settings: the inverse of what `_widget` returns."""
    out = {}
    for s in registry:
        v = values.get(s.name, s.default)
        wkey = f"{key}-set-{s.name}"
        if s.kind is bool and not s.optional:
            out[wkey] = bool(v)
        elif s.kind is bool or s.choices is not None:
            out[wkey] = DEFAULT if v is None else ({True: "on", False: "off"}[v] if s.kind is bool else str(v))
        elif s.kind in (int, float):
            out[wkey] = s.kind(v) if v is not None else s.kind(0)
        else:
            out[wkey] = "" if v is None else str(v)
    return out


def setting_input(container: Any, name: str, key: str) -> Any:
    """One registered setting's input alone (the Rollout and Frontier forms show only the memory cap);
    its value, None for the engine's default."""
    (s,) = [x for x in SETTINGS if x.name == name]
    return _widget(container, s, key, s.default, {})


def settings_inputs(key: str, initial: dict[str, Any] | None = None, registry: tuple[Setting, ...] = SETTINGS) -> dict[str, Any]:
    """One input per registered setting, in three columns (vLLM, HF, both engines); returns
    {name: value}. `initial` pre-fills the inputs (a run opened from a link shows its settings)."""
    initial = initial or {}
    cols = st.columns(3)
    where = {"vllm": 0, "hf": 1, "both": 2}
    for i, title in enumerate(("vLLM", "HF transformers", "Both engines")):
        cols[i].caption(title)
    refused = unsupported()
    return {
        s.name: _widget(
            cols[where[s.backend]],
            s,
            key,
            initial.get(s.name, s.default),
            {v: why for (n, v), why in refused.items() if n == s.name},
        )
        for s in registry
    }
