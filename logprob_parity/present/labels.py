"""Words for the numbers: what each summary key is called wherever people read it (the prompt-set
table, the HTML report), so `max_abs_delta` never reaches a page."""

from __future__ import annotations

# The summary keys (logprob_parity.results.metrics.summarize) in words, for tables people read.
SUMMARY_LABELS = {
    "n_tokens": "tokens compared",
    "max_abs_delta": "largest gap |Δ logp|",
    "mean_abs_delta": "mean gap |Δ logp|",
    "p50_abs_delta": "median gap |Δ logp|",
    "p95_abs_delta": "95% of gaps below",
    "p99_abs_delta": "99% of gaps below",
    "mean_delta": "mean signed Δ logp (vLLM − HF)",
    "max_prob_delta": "largest gap in probability |Δp|",
    "mean_prob_delta": "mean gap in probability |Δp|",
    "argmax_agreement": "same top token (share of positions)",
    "mean_kl_topk": "mean top-k KL",
    "pearson_prob": "correlation of probabilities",
    "seq_logprob_delta": "whole-text Δ logp (sum)",
    "frac_ratio_outside_0.9_1.1": "share of tokens whose probability differs by >10%",
    "kl_full_mean": "mean exact KL (whole vocabulary)",
    "kl_full_mean_err": "± its standard error",
    "kl_full_max": "largest exact KL",
    "kl_full_p99_9": "exact KL, 99.9th percentile",
    "kl_full_p99": "exact KL, 99th percentile",
    "kl_full_p95": "exact KL, 95th percentile",
    "kl_full_p90": "exact KL, 90th percentile",
    "kl_full_p50": "exact KL, median",
    "kl_full_p10": "exact KL, 10th percentile",
    "kl_full_p5": "exact KL, 5th percentile",
    "kl_full_p1": "exact KL, 1st percentile",
    "kl_full_p0_1": "exact KL, 0.1th percentile",
    "same_top_p": "same top token (llama.cpp's 'same top p')",
    "same_top_p_err": "± its binomial error",
    "dp_mean": "mean Δp (vLLM − HF probability of the token)",
    "dp_rms": "RMS Δp",
    "ppl_ratio": "perplexity ratio PPL(vLLM) / PPL(HF)",
    "hf_noise_mean": "HF's own noise floor, mean |Δ logp| (the largest of its variations)",
    "hf_noise_max": "HF's own noise, largest |Δ logp| (any variation)",
    "hf_noise_tail": "HF's own noise tail: 99.5th percentile of how far HF moves a token against itself",
    "tokens_beyond_frac": "share of tokens beyond both HF's noise tail and vLLM's tolerance (red)",
    "tokens_above_noise_frac": "share of tokens beyond HF's noise tail (amber, orange or red)",
    "vllm_noise_mean": "vLLM's own noise, mean |Δ logp| (vLLM alone against batched)",
    "vllm_noise_max": "vLLM's own noise, largest |Δ logp|",
    "noise_ratio": "the gap as a multiple of HF's own noise",
    "noise_tokens": "tokens the noise was measured on",
    "noise_texts": "texts the noise was measured on",
    "noise_set_by": "the variation that set HF's floor",
    "noise_words": "HF's floor in words",
    "noise_measured": "variations of HF's floor measured",
    "routing_flip_frac": "MoE: share of (token, layer) routers whose experts differ",
    "routing_tokens_flipped": "MoE: share of tokens with a layer routed differently",
    "routing_layers_flipped_mean": "MoE: layers routed differently, per token",
}


def summary_label(key: str) -> str:
    return SUMMARY_LABELS.get(key, key.replace("_", " "))


SHARE_KEYS = (
    "argmax_agreement",
    "frac_ratio_outside_0.9_1.1",
    "same_top_p",
    "same_top_p_err",
    "routing_flip_frac",
    "routing_tokens_flipped",
)


def summary_value(key: str, v: object) -> str:
    """One summary figure as people read it: counts whole, shares as percentages, gaps in e-notation."""
    if v is None:
        return "–"
    if isinstance(v, str):
        return v.replace("_", " ") if key in ("noise_set_by", "noise_measured") else v
    if key in ("n_tokens", "noise_tokens", "noise_texts"):
        return f"{int(v):,}"
    if key == "noise_ratio":
        return f"{float(v):.3g}x"
    if key in SHARE_KEYS:
        return f"{float(v):.2%}"
    if key == "routing_layers_flipped_mean":
        return f"{float(v):.3g}"
    if key == "pearson_prob":
        return f"{float(v):.6f}"
    return f"{float(v):.3e}"


def cell_text(column: str, v: object) -> str:
    """A table cell of the diagnostics tables as people read it, the same on the page, in the report
    and in the CLI: shares (columns named 'share ...') as percentages, ratios ('÷') as N×, other
    numbers in e-notation, nothing as a dash."""
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, (bool, int)):
        return str(v)
    if isinstance(v, float) and column.startswith("share"):
        return f"{v:.1%}"
    if isinstance(v, float) and "÷" in column:
        return f"{v:.3g}×"
    if isinstance(v, float):
        return f"{v:.3e}"
    return str(v)


def quantized_words(settings: dict) -> str | None:
    """What a run's vLLM side serves quantized, in words, or None: HF is then the unquantized
    reference, and every page and report that shows the run says so."""
    parts = []
    if settings.get("quantization"):
        parts.append(f"{settings['quantization']} weights")
    if settings.get("kv_cache_dtype") not in (None, "auto"):
        parts.append(f"{settings['kv_cache_dtype']} KV cache")
    if not parts:
        return None
    return f"vLLM serves this model quantized ({', '.join(parts)}); HF is the unquantized reference it is measured against."


def token_shown(piece: str, raw: str) -> str:
    """A token in a table, as the pages show it: the text it adds (quoted, so spaces show), or, for a
    token that holds only part of a character (it adds no text until a later token completes it), the
    tokenizer's own spelling of its bytes, e.g. "part of a character: <0xE3>" (it printed as '')."""
    return repr(piece) if piece != "" else f"part of a character: {raw}"


def settings_words(settings: dict) -> str:
    """The engine settings of a run that differ from the defaults, as `name=value` pairs ("defaults"
    when none does): what tells apart runs of one text, model and dtype on the Runs page."""
    from logprob_parity.inputs.settings import SETTINGS

    default = {s.name: s.default for s in SETTINGS}
    changed = [f"{k}={v}" for k, v in sorted((settings or {}).items()) if k in default and v != default[k]]
    return ", ".join(changed) or "defaults"


def isolated(text: str) -> str:
    """A person's text inside a sentence of ours, between Unicode's first-strong isolate and its pop
    (invisible): a right-to-left text (Arabic, Hebrew) then cannot carry our commas and brackets after
    it to its own side."""
    return f"\u2068{text}\u2069"


def short_text(text: str, n: int = 48) -> str:
    """`text` cut to at most n characters at a word's end, with "…" where it was cut (never mid-word
    unless one word is longer than n)."""
    text = " ".join(str(text).split())
    if len(text) <= n:
        return text
    cut = text[: n - 1].rsplit(" ", 1)[0] if " " in text[: n - 1] else text[: n - 1]
    return cut.rstrip(" ,.;:") + "…"
