"""What the installed vLLM build can run, found by asking the build itself.

Why: options a device cannot run must be disabled with their reason before a run starts, not fail
with a raw kernel error after the engines have loaded ("_C::static_scaled_fp8_quant() expected at most
0 argument(s)" was FP8 on vLLM's CPU build). A list kept by hand drifts from the builds, so the reason
comes from the build's own kernels: vLLM's CPU wheel registers `_C::static_scaled_fp8_quant` as a stub
that takes no arguments, where a build with FP8 kernels takes the tensors to quantize.

The probe imports torch and vLLM's compiled ops, which takes seconds, so it runs in a child process
(this one never imports vLLM) once per installed vLLM and torch, and its answer is kept in the store
beside the runs.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from logprob_parity.env import versions
from logprob_parity.paths import store_root, write_text_atomic

# One probe a feature: a snippet that prints a JSON object {"ok": bool, "why": str}.
_FP8_PROBE = """
import json
try:
    import torch
    from vllm.platforms import current_platform
    # The compiled ops of this vLLM build, loaded the way the build's own platform loads them: the module
    # differs by build (vllm._C on the CPU build, vllm._C_stable_libtorch on CUDA builds since 0.26), and
    # a probe that imported vllm._C by name read vLLM 0.26.0's CUDA build as having no kernels at all.
    current_platform.import_kernels()
    op = getattr(torch.ops._C, "static_scaled_fp8_quant", None)
    args = len(op.default._schema.arguments) if op is not None else 0
    if op is None:
        print(json.dumps({"ok": False, "why": "this vLLM build has no FP8 quantization kernel"}))
    elif args == 0:
        print(json.dumps({"ok": False, "why": "this vLLM build registers its FP8 quantization kernel as an empty stub "
                                              "(vLLM's CPU build has none)"}))
    else:
        print(json.dumps({"ok": True, "why": ""}))
except Exception as exc:
    print(json.dumps({"ok": False, "why": f"this vLLM build's kernels could not be loaded ({type(exc).__name__}: {exc})"[:300]}))
"""
# What else decides whether a setting can take effect here, asked of this machine once: CUDA, vLLM's
# platform and the attention backends its build registers, and which optional packages are installed.
_FACTS_PROBE = """
import importlib.util, json
out = {"cuda": False, "platform": "unknown", "attention_backends": [], "flash_attn": False, "ray": False,
       "flashinfer": False}
try:
    import torch
    out["cuda"] = bool(torch.cuda.is_available())
except Exception:
    pass
for name in ("flash_attn", "ray", "flashinfer"):
    out[name] = importlib.util.find_spec(name) is not None
try:
    from vllm.platforms import current_platform
    out["platform"] = "cpu" if current_platform.is_cpu() else ("cuda" if current_platform.is_cuda() else "other")
except Exception as exc:
    out["platform_error"] = f"{type(exc).__name__}: {exc}"[:200]
if out["platform"] == "cpu":
    out["attention_backends"] = ["CPU_ATTN"]
elif out["platform"] == "cuda":
    out["attention_backends"] = ["FLASH_ATTN", "FLEX_ATTENTION", "TRITON_ATTN"] + (["FLASHINFER"] if out["flashinfer"] else [])
print(json.dumps({"ok": True, "why": "", "facts": out}))
"""
# What vLLM's CPU build can run depends on the processor too: it loads one of three kernel libraries
# (_C with AVX-512 BF16, _C_AVX512, _C_AVX2), and the AVX2 one lacks some kernels. Each probe asks vLLM's
# own code or its loaded kernels, never a list of CPU flags kept here: on an AMD EPYC with AVX2 only,
# vLLM 0.32 refused an FP8 KV cache at engine start and failed a GPTQ checkpoint at its first forward
# ("_C has no attribute 'cpu_gemm_wna16'"), both after the engines had loaded.
_KV_FP8_PROBE = """
import json
try:
    import torch
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        print(json.dumps({"ok": True, "why": ""}))
    else:
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        except ImportError:  # another vLLM: its engine's start says, and the frontier lists why
            print(json.dumps({"ok": True, "why": ""}))
        else:
            try:
                _get_attn_isa(torch.bfloat16, 128, 64, "fp8")
                print(json.dumps({"ok": True, "why": ""}))
            except NotImplementedError as exc:
                print(json.dumps({"ok": False, "why": f"vLLM's CPU attention refuses it on this processor ({exc})"}))
except Exception as exc:
    print(json.dumps({"ok": False, "why": f"this vLLM build's kernels could not be loaded ({type(exc).__name__}: {exc})"[:300]}))
"""
_WNA16_PROBE = """
import json
try:
    import torch
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        print(json.dumps({"ok": True, "why": ""}))
    else:
        current_platform.import_kernels()
        if hasattr(torch.ops._C, "cpu_gemm_wna16"):
            print(json.dumps({"ok": True, "why": ""}))
        else:
            print(json.dumps({"ok": False, "why": "the kernels vLLM's CPU build loads for this processor have no 4-bit "
                                                  "weight GEMM (cpu_gemm_wna16: built for AVX-512 only)"}))
except Exception as exc:
    print(json.dumps({"ok": False, "why": f"this vLLM build's kernels could not be loaded ({type(exc).__name__}: {exc})"[:300]}))
"""
# (setting, value): a setting of logprob_parity.inputs.settings; ("quant_method", m): a pre-quantized
# checkpoint's method (its config's quantization_config), which a frontier configuration can load
PROBES = {
    ("quantization", "fp8"): _FP8_PROBE,
    ("kv_cache_dtype", "fp8"): _KV_FP8_PROBE,
    ("quant_method", "gptq"): _WNA16_PROBE,
}
QUANT_METHOD = "quant_method"
CACHE_NAME = "build-checks.json"
FACTS = "facts"


# Bumped whenever a probe changes what it asks, so an answer stored by an older probe is asked again:
# revision 2 loads the kernels through vLLM's platform (the first read every CUDA build of vLLM 0.26 as
# unable to run FP8).
# 3 asks the processor's kernels too (FP8 KV cache, 4-bit weights), so the key names the processor.
PROBE_REVISION = 3


def _key() -> str:
    v = versions()
    return (
        f"{v.get('vllm_dist')}=={v.get('vllm')} torch=={v.get('torch')} python=={sys.version_info[:2]} probes=={PROBE_REVISION}"
        f" cpu=={_processor()}"
    )


def _processor() -> str:
    """This processor's model and instruction sets, hashed: a store that moves to another machine (or a
    home shared by machines) asks again where the CPU build's kernels differ."""
    import hashlib
    import platform

    seen: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in ("model name", "flags", "Features", "isa") and name not in seen:
                seen[name] = value.strip()
    except OSError:
        seen["machine"] = platform.machine() + " " + platform.processor()
    return hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()[:12]


# One child process answers every probe: each snippet runs in its own namespace and prints its answer,
# and vLLM is imported once. A process a probe (four, side by side) took over 30 s on a busy 2-core
# machine, where a page drawing the settings form asks when its store has no answer yet.
_RUNNER = """
import contextlib, io, json, sys
out = {}
for key, code in json.loads(sys.stdin.read()).items():
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(code, {"__name__": "__probe__"})
        out[key] = json.loads(buf.getvalue().strip().splitlines()[-1])
    except Exception as exc:
        out[key] = {"ok": False, "why": f"the check of this vLLM build failed ({type(exc).__name__}: {exc})"[:300]}
print(json.dumps(out))
"""


def _probe(codes: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each probe's answer ({"ok", "why", ...}), by key, from one child process."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _RUNNER], input=json.dumps(codes), capture_output=True, text=True, timeout=180, check=False
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        got = {}
        why = f"the check of this vLLM build did not answer ({type(exc).__name__})"
    else:
        why = "the check of this vLLM build did not answer"
    return {k: got.get(k) or {"ok": False, "why": why} for k in codes}


@functools.lru_cache(maxsize=1)
def unsupported() -> dict[tuple[str, Any], str]:
    """{(setting, value): why this vLLM build cannot run it}; empty where vLLM is not installed (then
    nothing runs at all, and the pages say so)."""
    if not versions().get("vllm"):
        return {}
    path = store_root() / CACHE_NAME
    key = _key()
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cached = {}
    found = cached.get(key)
    if not isinstance(found, dict) or FACTS not in found:
        found = _probe({**{f"{name}={value}": code for (name, value), code in PROBES.items()}, FACTS: _FACTS_PROBE})
        found[FACTS] = found[FACTS].get("facts") or {}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps({**cached, key: found}, indent=1))
        except OSError:
            pass  # a read-only store: probe again in the next process
    out = {}
    for (name, value), _ in PROBES.items():
        got = found.get(f"{name}={value}") or {}
        if not got.get("ok", False):
            out[(name, value)] = got.get("why") or "this vLLM build cannot run it"
    return {**out, **without_effect(found.get(FACTS) or {})}


def without_effect(facts: dict[str, Any]) -> dict[tuple[str, Any], str]:
    """{(setting, value): why} for the values that cannot take effect on this machine, from the probed
    facts: a run that records them as tested would credit a setting that never ran (issue 40: FLASH_ATTN
    on the CPU build gave the default's values bit for bit, and `diff` read a change into it)."""
    from logprob_parity.inputs.settings import ATTENTION_BACKENDS

    out: dict[tuple[str, Any], str] = {}
    platform, cuda = facts.get("platform"), bool(facts.get("cuda"))
    have = facts.get("attention_backends")
    if have:
        lacks = "vLLM's CPU build runs CPU_ATTN only" if platform == "cpu" else f"this vLLM build offers {', '.join(have)}"
        for b in ATTENTION_BACKENDS:
            if b not in have:
                out[("attention_backend", b)] = lacks
    if platform == "cpu":
        out[("enforce_eager", False)] = (
            "vLLM's CPU build has no CUDA graphs: off would only compile for minutes (106 s for the demo model here) and "
            "change nothing that runs"
        )
        out[("batch_invariant", True)] = "vLLM's batch-invariant kernels need an NVIDIA GPU; the CPU build fails to run them"
    if not cuda:
        out[("tf32", True)] = "TF32 is an NVIDIA GPU mode: on this machine (no CUDA GPU) float32 matmuls run as they are"
        out[("hf_cudnn_attention", True)] = "cuDNN attention needs an NVIDIA GPU: on this machine it cannot take effect"
        out[("hf_cudnn_attention", False)] = "cuDNN attention needs an NVIDIA GPU: on this machine it is never used anyway"
        out[("distributed_executor_backend", "ray")] = "vLLM's ray executor spreads an engine over GPUs: this machine has none"
    elif not facts.get("ray"):
        out[("distributed_executor_backend", "ray")] = "vLLM's ray executor needs Ray: pip install 'logprob-parity[ray]'"
    if facts and not facts.get("flash_attn"):
        out[("attn_implementation", "flash_attention_2")] = (
            "HF's flash_attention_2 needs the flash-attn package, which is not installed here"
        )
    return out


def refusal(settings: Any) -> str | None:
    """Why these engine settings cannot run, or cannot take effect, on this machine and vLLM build, in
    words, before any engine starts; None when they can."""
    for (name, value), why in unsupported().items():
        if getattr(settings, name, None) == value:
            return f"{name}={value} cannot take effect here: {why}"
    return None
