"""The run form shared by the Compare and Prompt-set pages: model, dtypes, BOS, top-k, engine knobs."""

from __future__ import annotations

import streamlit as st

from core.prompts import SEED_TEXT
from core.spec import BOS_POLICIES, DTYPES, MAX_TOP_K, EngineSettings, RunSpec
from dashboard.state import dtype_reasons, engines_available

ATTENTION_BACKENDS = ["default", "FLEX_ATTENTION", "TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "CPU_ATTN"]
PRESETS = {
    "demo: SmolLM2-135M-Instruct (embedded, offline)": "demo",
    "facebook/opt-125m (Hub)": "facebook/opt-125m",
    "Other (Hub id or local folder)": None,
}


def spec_form(key: str, with_text: bool) -> tuple[RunSpec | None, bool]:
    """Render the form; return (spec, submitted). Texts are filled by the caller when with_text is False."""
    blocked = engines_available()
    reasons = dtype_reasons()
    with st.form(f"{key}-form"):
        c1, c2, c3 = st.columns([3, 2, 1])
        preset = c1.selectbox("Model", list(PRESETS), key=f"{key}-preset")
        custom = c1.text_input("Hub id or local folder", key=f"{key}-custom", placeholder="org/name or /path/to/model",
                               help="Used when the model above is 'Other'.")
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
        truncate = st.checkbox("Truncate prompts longer than the model's positions", False, key=f"{key}-truncate")
        st.caption("Backends: HF transformers and vLLM, on the same token ids.")
        with st.expander("Engine settings (recorded in the run id)"):
            e1, e2, e3 = st.columns(3)
            eager = e1.checkbox("vLLM enforce_eager", True, key=f"{key}-eager", help="skip torch.compile and graphs")
            prefix = e1.checkbox("vLLM prefix caching", False, key=f"{key}-prefix")
            chunked = e2.selectbox("vLLM chunked prefill", ["default", "on", "off"], key=f"{key}-chunked")
            mnbt = e2.number_input("max_num_batched_tokens (0 = default)", 0, 1 << 20, 0, key=f"{key}-mnbt")
            gmu = e3.number_input("gpu_memory_utilization (0 = auto)", 0.0, 0.95, 0.0, 0.05, key=f"{key}-gmu")
            seed = e3.number_input("seed", 0, 2**31 - 1, 0, key=f"{key}-seed")
            attn_b = e1.selectbox("vLLM attention_backend", ATTENTION_BACKENDS, key=f"{key}-attnb",
                                  help="FLEX_ATTENTION matched HF to 3e-5 in float32 on an H200; the CPU build has CPU_ATTN only")
            attn_i = e2.selectbox("HF attn_implementation", ["default", "sdpa", "eager"], key=f"{key}-attni")
            hf_comp = e2.checkbox("HF torch.compile", False, key=f"{key}-hfcomp",
                                  help="fuses HF's kernels: 63.5% vs 45.5% of the FLOP floor on an H200, the first run compiles (~1-2 min); moves bfloat16 HF by up to 0.6 nats")
            trust = e3.checkbox("trust_remote_code", False, key=f"{key}-trust", help="runs the model's own Python code")
            p1, p2, p3, p4, p5 = st.columns(5)
            tp = p1.number_input("vLLM tensor_parallel_size (0 = auto)", 0, 8, 0, key=f"{key}-tp",
                                 help="auto: the fewest GPUs that hold the model")
            pp = p2.number_input("vLLM pipeline_parallel_size (0 = 1)", 0, 8, 0, key=f"{key}-pp")
            hf_bs = p3.number_input("HF batch size", 1, 256, 1, key=f"{key}-hfbs",
                                    help="1: one sequence a forward pass, no padding; more is faster and adds batch effects")
            dmap = p4.selectbox("HF device_map", ["default", "auto"], key=f"{key}-dmap",
                                help="auto: accelerate spreads the model over the GPUs (default when it does not fit one)")
            dexec = p5.selectbox("vLLM executor", ["default", "mp", "ray"], key=f"{key}-dexec",
                                 help="ray: run across a Ray cluster's GPUs (README: Past one box)")
        submitted = st.form_submit_button("Run", type="primary", disabled=blocked is not None)
    if blocked:
        st.info(blocked)
    if trust:
        st.warning("trust_remote_code is ON: the model's own Python code will run on this server.")
    if not submitted:
        return None, False
    model = PRESETS[preset] if PRESETS[preset] is not None else (custom.strip() or None)
    if PRESETS[preset] is None and not custom.strip():
        st.error("Enter a Hub id or a local folder for 'Other'.")
        return None, False
    settings = EngineSettings(
        enforce_eager=eager,
        enable_prefix_caching=prefix,
        enable_chunked_prefill=None if chunked == "default" else chunked == "on",
        max_num_batched_tokens=int(mnbt) or None,
        gpu_memory_utilization=float(gmu) or None,
        seed=int(seed),
        attention_backend=None if attn_b == "default" else attn_b,
        attn_implementation=None if attn_i == "default" else attn_i,
        trust_remote_code=trust,
        tensor_parallel_size=int(tp) or None,
        pipeline_parallel_size=int(pp) or None,
        hf_batch_size=int(hf_bs),
        hf_device_map=None if dmap == "default" else dmap,
        hf_compile=hf_comp,
        distributed_executor_backend=None if dexec == "default" else dexec,
    )
    spec = RunSpec(
        texts=(text,) if with_text else (),
        model=model,
        revision=revision.strip() or None,
        dtypes=tuple(chosen),
        top_k=int(top_k),
        bos=bos,
        settings=settings,
        truncate=truncate,
    )
    return spec, True
