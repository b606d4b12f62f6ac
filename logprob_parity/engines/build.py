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
from typing import Any

from logprob_parity.env import versions
from logprob_parity.paths import store_root, write_text_atomic

# One probe a feature: a snippet that prints a JSON object {"ok": bool, "why": str}.
_FP8_PROBE = """
import json
try:
    import torch
    import vllm._C  # noqa: F401  the compiled ops of this vLLM build
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
PROBES = {("quantization", "fp8"): _FP8_PROBE}
CACHE_NAME = "build-checks.json"


def _key() -> str:
    v = versions()
    return f"{v.get('vllm_dist')}=={v.get('vllm')} torch=={v.get('torch')} python=={sys.version_info[:2]}"


def _probe(code: str) -> dict[str, Any]:
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        return {"ok": False, "why": f"the check of this vLLM build did not answer ({type(exc).__name__})"}


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
    if not isinstance(found, dict):
        found = {f"{name}={value}": _probe(code) for (name, value), code in PROBES.items()}
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
    return out


def refusal(settings: Any) -> str | None:
    """Why these engine settings cannot run on this vLLM build, in words; None when they can."""
    for (name, value), why in unsupported().items():
        if getattr(settings, name, None) == value:
            return f"{name}={value} cannot run here: {why}"
    return None
