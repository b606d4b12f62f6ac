"""Find the model's files and pin exactly which weights a run used."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logprob_parity.errors import UserError
from logprob_parity.inputs.demo import DEMO_NAME, build_demo_model, is_demo
from logprob_parity.paths import store_root

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja"]
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user asked for (hub id, folder, or demo:...)
    path: str  # a local folder both engines load
    revision: str | None  # the hub commit, when it came from the hub
    identity: dict[str, Any] = field(default_factory=dict)  # what the run id hashes
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def max_positions(self) -> int | None:
        cfg = self.config.get("text_config") or self.config
        for key in _POSITION_KEYS:
            if isinstance(cfg.get(key), int):
                return cfg[key]
        return None

    @property
    def vocab_size(self) -> int | None:
        cfg = self.config.get("text_config") or self.config
        return cfg.get("vocab_size")


ROOTS_ENV = "LPP_MODEL_ROOTS"


def model_roots_from_env() -> list[str] | None:
    """`LPP_MODEL_ROOTS` (os.pathsep-separated): the only folders local models may come from."""
    raw = os.environ.get(ROOTS_ENV)
    return None if raw is None else [r for r in raw.split(os.pathsep) if r]


def check_allowed(path: str, roots: list[str] | None) -> None:
    if roots is None:
        return
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(os.path.expanduser(root))
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            return
    allowed = ", ".join(roots) if roots else f"none (set {ROOTS_ENV})"
    raise UserError(f"local model folders are limited on this server; allowed roots: {allowed}")


def resolve_model(
    model: str | None, revision: str | None = None, trust_remote_code: bool = False, roots: list[str] | None = None
) -> ResolvedModel:
    """roots: None lets local folders come from anywhere (also when LPP_MODEL_ROOTS is unset)."""
    if is_demo(model):
        path = build_demo_model()
        return _local(str(path), f"demo:{DEMO_NAME}", None, trust_remote_code)
    assert model is not None
    roots = roots if roots is not None else model_roots_from_env()
    expanded = os.path.expanduser(model)
    if model.startswith((".", "/", "~")) or os.path.isdir(expanded):
        check_allowed(expanded, roots)
    if os.path.isdir(expanded):
        return _local(os.path.abspath(expanded), model, None, trust_remote_code)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise UserError(f"model folder {model!r} does not exist")
    return _from_hub(model, revision, trust_remote_code)


def hub_model_why_not(repo_id: str, timeout: float = 2.0) -> str | None:
    """None when a Hub model can load here (its config is in the local Hugging Face cache, or the Hub
    answers), else why not, in words: a form offers a Hub preset only where it can load."""
    import os

    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return "huggingface_hub is not installed"
    got = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(got, str):
        return None  # cached: loads with no network
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "not in this machine's Hugging Face cache, and HF_HUB_OFFLINE is set"
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    if not endpoint.startswith(("https://", "http://")):
        return f"HF_ENDPOINT {endpoint!r} is not an http(s) address"
    try:
        ask = urllib.request.Request(f"{endpoint}/api/models/{repo_id}", method="HEAD")  # noqa: S310 - http(s)
        urllib.request.urlopen(ask, timeout=timeout)  # noqa: S310 - an http(s) endpoint, checked above
    except Exception as exc:
        if getattr(exc, "code", None) is not None and exc.code < 500:  # type: ignore[attr-defined]
            return None if exc.code in (401, 403) else f"the Hub does not know it ({exc.code})"  # type: ignore[attr-defined]
        return "not in this machine's Hugging Face cache, and the Hub cannot be reached from here"
    return None


def _from_hub(repo_id: str, revision: str | None, trust_remote_code: bool) -> ResolvedModel:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as exc:  # pragma: no cover - huggingface_hub comes with transformers
        raise UserError("huggingface_hub is needed for hub models: pip install huggingface_hub") from exc
    try:
        path = snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=_HUB_PATTERNS)
    except GatedRepoError as exc:
        raise UserError(f"model {repo_id!r} is gated: accept its terms on the Hub and set HF_TOKEN") from exc
    except RevisionNotFoundError as exc:
        raise UserError(f"model {repo_id!r} has no revision {revision!r}") from exc
    except RepositoryNotFoundError as exc:
        raise UserError(f"unknown model {repo_id!r}: no such repository on the Hugging Face Hub") from exc
    except HFValidationError as exc:
        raise UserError(f"{repo_id!r} is neither a local folder nor a valid Hub model id") from exc
    except LocalEntryNotFoundError as exc:
        raise UserError(
            f"unknown model {repo_id!r}: not a local folder, and the Hugging Face Hub is unreachable "
            "with no cached copy (pass a local folder, or 'demo' for the embedded model)"
        ) from exc
    except OSError as exc:
        raise UserError(f"could not fetch model {repo_id!r} from the Hub: {str(exc).splitlines()[0]}") from exc
    commit = Path(path).name  # snapshot folders are named by the resolved commit
    return _local(path, repo_id, commit, trust_remote_code, hub=True)


def _local(path: str, name: str, commit: str | None, trust_remote_code: bool, hub: bool = False) -> ResolvedModel:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{cfg_path} is not valid JSON: {exc}") from exc
    if config.get("auto_map") and not trust_remote_code:
        raise UserError(
            f"model {name!r} ships custom code (auto_map in config.json); trust_remote_code is off: "
            "turn it on only if you trust its authors"
        )
    if hub:
        identity = {"hub_id": name, "commit": commit}
    else:
        identity = {"files": folder_fingerprint(Path(path))}
    return ResolvedModel(name=name, path=path, revision=commit, identity=identity, config=config)


def folder_fingerprint(folder: Path) -> dict[str, str]:
    """sha256 of every file in the folder (weights, config, tokenizer), cached by size and mtime."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return {p.name: _file_hash(p) for p in files}


def _file_hash(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    db_path = store_root() / "file-hashes.sqlite"
    db = None
    try:
        db_path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(db_path, timeout=30)
        db.execute("CREATE TABLE IF NOT EXISTS h (path TEXT, size INT, mtime INT, sha256 TEXT, PRIMARY KEY(path, size, mtime))")
        row = db.execute("SELECT sha256 FROM h WHERE path=? AND size=? AND mtime=?", key).fetchone()
        if row:
            return row[0]
    except sqlite3.Error:
        db = None  # an unwritable cache only costs time
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    value = digest.hexdigest()
    if db is not None:
        try:
            with db:
                db.execute("INSERT OR REPLACE INTO h VALUES (?,?,?,?)", (*key, value))
        except sqlite3.Error:
            pass
        db.close()
    return value


def family_of(model_path: str) -> str:
    """The model's family in words, from its config.json: "codegen (CodeGenForCausalLM)"; "" when
    the folder has no readable config (messages then name the folder alone)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    kind = str(cfg.get("model_type") or "")
    arch = ", ".join(cfg.get("architectures") or ())
    return f"{kind} ({arch})" if kind and arch else kind or arch
