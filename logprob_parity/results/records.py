"""Typed records of what a run and a diagnosis were: frozen dataclasses with `to_dict`/`from_dict`.

Why: metadata was a string-keyed dict read by key in five modules, and readers drifted apart.
The dict form (`to_dict`) is exactly what the store and `--json` have always written, so runs and
diagnostics stored by earlier versions still open (`from_dict` fills keys they lacked).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


def _pick(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class RunEnv:
    """Where the numbers came from: device name, library versions, and what each engine reported."""

    device: str
    torch: str | None
    transformers: str | None
    vllm: str | None
    vllm_dist: str | None = None
    hf_engine: dict[str, Any] = field(default_factory=dict)
    vllm_engine: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunEnv:
        return cls(**_pick(cls, {"device": "", "torch": None, "transformers": None, "vllm": None, **data}))


@dataclass(frozen=True)
class SequenceInfo:
    """Per-sequence metadata kept beside the positions: the text, the BOS choice and its summary."""

    text: str
    bos_added: bool
    n_positions: int
    summary: dict[str, Any]
    cut_from: int | None = None  # the prompt's token count before truncation cut it to n_positions
    # an MoE model's routing against HF's (logprob_parity.engines.routing.compare_routes): layers that
    # differ at each token and the flips; None when not measured (a dense model, or beyond the sample)
    routing: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SequenceInfo:
        return cls(**_pick(cls, {"n_positions": 0, "summary": {}, **data}))


@dataclass(frozen=True)
class RunMeta:
    """Everything about one run but its per-position data."""

    run_id: str
    created: str
    created_ts: float
    model: str
    model_path: str
    revision: str | None
    model_identity: dict[str, Any]
    dtype: str
    backends: tuple[str, ...]
    settings: dict[str, Any]  # the engine settings as run, plus max_model_len
    top_k: int
    bos: str
    device: str
    env: RunEnv
    timing: dict[str, Any]
    summary: dict[str, Any]
    sequences: tuple[SequenceInfo, ...]
    # the noise floor as measured (logprob_parity.analysis.floors.measure): each variation's gap and
    # words, what was skipped and why; its summary figures are in `summary`. Empty: not measured.
    noise: dict[str, Any] = field(default_factory=dict)
    # an MoE model's routing against HF's (logprob_parity.analysis.compare._measure_routing): what was
    # measured, on how many texts, or {"measured": False, "why": "not an MoE model"}. Empty: runs before it.
    routing: dict[str, Any] = field(default_factory=dict)
    # the comparison's own verdict (level, headline, reasons: analysis.verdict.run_verdicts), as made;
    # empty for runs stored before it (the CLI and pages make it again from the summary)
    verdict: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """What dataclasses.asdict gives, built field by field: asdict copies every value of every
        sequence's summary recursively, which took longer than writing a 10,000-prompt run."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["env"] = asdict(self.env)
        d["backends"] = list(self.backends)
        d["settings"], d["timing"], d["summary"] = dict(self.settings), dict(self.timing), dict(self.summary)
        d["model_identity"] = dict(self.model_identity)
        d["noise"] = json.loads(json.dumps(self.noise))
        d["routing"] = dict(self.routing)
        d["verdict"] = json.loads(json.dumps(self.verdict))
        names = [f.name for f in fields(SequenceInfo)]
        d["sequences"] = [{**{n: getattr(s, n) for n in names}, "summary": dict(s.summary)} for s in self.sequences]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunMeta:
        d = _pick(cls, data)
        d.setdefault("created", "")
        d.setdefault("created_ts", 0.0)
        d.setdefault("model_path", "")
        d.setdefault("model_identity", {})
        d.setdefault("device", "")
        d.setdefault("timing", {})
        d["backends"] = tuple(d.get("backends", ()))
        d["env"] = RunEnv.from_dict(data.get("env", {}))
        d["sequences"] = tuple(SequenceInfo.from_dict(s) for s in data.get("sequences", ()))
        return cls(**d)


@dataclass(frozen=True)
class DtypeDiagnosis:
    """The diagnostics of one dtype. Sub-objects are the documented JSON shapes (README: Diagnostics)."""

    run_id: str
    gap: dict[str, Any]  # {"mean", "max"} of |Δ logp| between the engines
    verdict: dict[str, Any]
    noise: dict[str, Any] | None = None  # source -> {"mean", "max", "n"}
    floor: dict[str, Any] | None = None  # {"hf", "vllm"}: each engine's own largest mean noise
    ratio_to_hf_noise: float | None = None
    ratio_to_vllm_noise: float | None = None
    reference: dict[str, Any] | None = None
    greedy: dict[str, Any] | None = None
    mcq: dict[str, Any] | None = None
    # where in the network the engines part (logprob_parity.analysis.layers): per layer and block
    layers: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Only the parts that ran, as earlier versions wrote them (the noise ratios whenever the
        noise part ran, even when a ratio has no value)."""
        ratios = ("ratio_to_hf_noise", "ratio_to_vllm_noise") if self.noise is not None else ()
        return {k: v for k, v in asdict(self).items() if v is not None or k in ratios}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DtypeDiagnosis:
        return cls(**_pick(cls, data))


@dataclass(frozen=True)
class DiagnosticsResult:
    """One diagnosis: noise floors, the float64 reference, downstream answers and the knob
    ablation, for every dtype of one request, with the comparison runs it was built on."""

    diagnostics_id: str
    model: str
    device: str
    versions: dict[str, Any]
    texts: tuple[str, ...]
    parts: tuple[str, ...]
    run_ids: dict[str, str]
    dtypes: dict[str, DtypeDiagnosis]
    ablation: tuple[dict[str, Any], ...] = ()
    mcq_dtype_flips: dict[str, int] | None = None
    created: str = ""
    created_ts: float = 0.0

    def layers_frame(self) -> Any:
        """The layer parts as one table, a row per (dtype, layer, block, token): vLLM's relative error
        against HF there, the (layer, block)'s floor, and whether the token is beyond it; what
        `diagnose --parquet` writes. Empty where no layer part ran."""
        import pandas as pd

        rows = []
        for d, out in self.dtypes.items():
            prof = out.layers or {}
            floors = {(r["layer"], r["block"]): r["floor"] for r in prof.get("per_layer", [])}
            for block, per_layer in (prof.get("vllm_vs_hf") or {}).items():
                for layer, errs in enumerate(per_layer):
                    f = floors[(layer, block)]
                    rows += [
                        {
                            "dtype": d,
                            "text": prof.get("text", 0),
                            "layer": layer,
                            "block": block,
                            "token": t,
                            "relative_error": e,
                            "floor": f,
                            "beyond": e > f,
                        }
                        for t, e in enumerate(errs)
                    ]
        cols = ["dtype", "text", "layer", "block", "token", "relative_error", "floor", "beyond"]
        return pd.DataFrame(rows, columns=cols)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "diagnostics_id": self.diagnostics_id,
            "model": self.model,
            "device": self.device,
            "versions": self.versions,
            "texts": list(self.texts),
            "parts": list(self.parts),
            "run_ids": self.run_ids,
            "dtypes": {k: v.to_dict() for k, v in self.dtypes.items()},
            "ablation": list(self.ablation),
            "created": self.created,
            "created_ts": self.created_ts,
        }
        if self.mcq_dtype_flips is not None:
            d["mcq_dtype_flips"] = self.mcq_dtype_flips
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DiagnosticsResult:
        d = _pick(cls, data)
        d["texts"] = tuple(d.get("texts", ()))
        d["parts"] = tuple(d.get("parts", ()))
        d["ablation"] = tuple(d.get("ablation", ()))
        d["dtypes"] = {k: DtypeDiagnosis.from_dict(v) for k, v in data.get("dtypes", {}).items()}
        return cls(**d)
