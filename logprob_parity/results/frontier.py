"""What a frontier is when stored: configurations measured against one float64 reference, with the
recommendation (logprob_parity.analysis.frontier computes it; the store reads and writes this record)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FrontierResult:
    """One frontier: configurations measured against one float64 reference (the `--json` shape)."""

    frontier_id: str
    model: str
    device: str
    versions: dict[str, Any]
    texts: tuple[str, ...]
    n_tokens: int
    tolerance: dict[str, Any]  # {"value", "source"}
    configs: tuple[dict[str, Any], ...]
    recommendation: dict[str, Any]
    created: str = ""
    created_ts: float = 0.0
    speed: dict[str, Any] | None = None  # {"load": "64 x 512 tokens", "repeats", "gen_tokens"}; None in older frontiers

    def to_pandas(self) -> Any:
        """One row a configuration (logprob_parity.analysis.frontier.frontier_table's columns, flattened here)."""
        import pandas as pd

        rows = []
        for c in self.configs:
            g, h, t, m = c.get("ref_gap") or {}, c.get("hf_ref_gap") or {}, c.get("tokens_per_s") or {}, c.get("memory") or {}
            rows.append(
                {
                    "configuration": c["name"],
                    "gap_mean": g.get("mean"),
                    "gap_max": g.get("max"),
                    "kl_mean": g.get("kl_mean"),
                    "hf_gap_mean": h.get("mean"),
                    "prefill_tokens_per_s": t.get("prefill"),
                    "generate_tokens_per_s": t.get("generate"),
                    "weights_bytes": m.get("weights_bytes"),
                    "kv_bytes_per_token": m.get("kv_bytes_per_token"),
                    "on_front": c.get("pareto", False),
                    "skipped": c.get("skipped"),
                }
            )
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["texts"], d["configs"] = list(self.texts), list(self.configs)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FrontierResult:
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in data.items() if k in names}
        d["texts"], d["configs"] = tuple(d.get("texts", ())), tuple(d.get("configs", ()))
        return cls(**d)
