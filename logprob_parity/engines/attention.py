"""Which attention kernel HF runs for a model, where transformers' default would score another model.

Why: Gemma 2 soft-caps its attention logits (attn_logit_softcapping). vLLM applies the cap; HF's SDPA
attention, transformers' default, leaves it out without a word, and only its eager attention applies
it. Left to the default, a Gemma 2 comparison would blame vLLM for 0.65 nats (a tiny Gemma 2 here)
that is HF's omission. So the HF engine runs eager for such a model unless the user chose a kernel,
and says why in its engine record (`attn_implementation_why`); Diagnostics' "other attention" row
then runs SDPA beside it.
"""

from __future__ import annotations

EAGER_FOR_SOFTCAP = (
    "eager, chosen for this model: it soft-caps its attention logits (attn_logit_softcapping), which "
    "vLLM applies and HF's SDPA attention leaves out without a word (0.65 nats apart on a tiny Gemma 2)"
)


def soft_caps_attention(model_path: str, trust_remote_code: bool) -> bool:
    """Whether the model soft-caps its attention logits (its config's attn_logit_softcapping)."""
    from logprob_parity.engines.memory import text_config

    try:
        return bool(getattr(text_config(model_path, trust_remote_code), "attn_logit_softcapping", None))
    except Exception:
        return False
