"""Tables a person clicks to open what a row stands for.

Why one helper: every list of stored work (runs, rollouts, frontiers, diagnostics, a set's prompts, a
rollout's worst sequences and tokens) opens a row the same way: a click on its box or on any of its
cells picks it, so nobody has to find the narrow checkbox column.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st


def picked_rows(
    table: pd.DataFrame, key: str, many: bool = False, where: Any = None, column_config: dict[str, Any] | None = None
) -> list[int]:
    """Draw `table` (in `where`, else here) and return the positions of its picked rows: those whose
    box is ticked, then those with a clicked cell, each once. many: several rows at once (in order)."""
    event = (where or st).dataframe(
        table,
        hide_index=True,
        width="stretch",
        on_select="rerun",
        selection_mode=["multi-row" if many else "single-row", "single-cell"],
        key=key,
        column_config=column_config,
    )
    if not event:
        return []
    rows = list(dict.fromkeys([*event.selection.rows, *(c[0] for c in event.selection.cells)]))
    return sorted(rows) if many else rows
