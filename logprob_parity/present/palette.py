"""One palette for the whole product: each dtype has one distinct colour in the dashboard's token
view and charts, the Diagnostics page and the HTML report; each verdict level has one colour.

Why: the dashboard drew float32 and bfloat16 in two similar blues while the report drew them in
orange and blue, so the same dtype changed colour between the page and the file shared from it.
The dtype colours are Okabe–Ito (distinct for colour-blind readers too).
"""

from __future__ import annotations

from typing import Any

DTYPE_COLOURS = {
    "float16": "#E69F00",  # orange
    "bfloat16": "#CC79A7",  # reddish purple
    "float32": "#0072B2",  # blue
    "float64": "#009E73",  # green
}
OTHER = "#6b7280"

# verdict level -> (background, text), as in the dashboard's success / warning / error boxes
LEVEL_COLOURS = {
    "match": ("#ecfdf5", "#065f46"),
    "unmeasured": ("#eff6ff", "#1e3a8a"),
    "systematic": ("#fffbeb", "#92400e"),
    "close": ("#fffbeb", "#92400e"),
    "differs": ("#fef2f2", "#991b1b"),
}


def dtype_colour(dtype: str) -> str:
    return DTYPE_COLOURS.get(dtype, OTHER)


def dtype_color_encoding(dtypes: Any, field: str = "dtype", title: str | None = "dtype") -> Any:
    """An Altair colour encoding that gives each dtype shown its palette colour (legend: those shown only)."""
    import altair as alt

    shown = set(dtypes)
    domain = [d for d in DTYPE_COLOURS if d in shown] + sorted(shown - set(DTYPE_COLOURS))
    return alt.Color(f"{field}:N", title=title, scale=alt.Scale(domain=domain, range=[dtype_colour(d) for d in domain]))
