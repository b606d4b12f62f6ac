"""The one request path: every analysis (compare, diagnostics, and later ones) starts here.

`prepare` resolves the model within the caller's allowed roots, picks the device and the parallel
plan, tokenizes once, and plans the engines as LoadRequests. A `Context` carries what every step
needs from its caller: the store, the allowed model roots, the progress callback and the pool.
Why one path: a page that built its own request once skipped the model-root rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from logprob_parity.engines import build, parallel
from logprob_parity.engines.memory import ELEM_BYTES
from logprob_parity.engines.pool import POOL, EnginePool
from logprob_parity.engines.records import LoadRequest
from logprob_parity.env import dtype_support, resolve_device
from logprob_parity.errors import UserError
from logprob_parity.inputs.models import ResolvedModel, resolve_model
from logprob_parity.inputs.spec import RunSpec
from logprob_parity.inputs.tokens import TokenizedText, batch_decoder, describe, encode_texts, load_tokenizer
from logprob_parity.inputs.tokens import truncate as truncate_tokens
from logprob_parity.results.store import Store

# on_event(stage, dtype or None, detail): stages are resolve, cache, tokenize, queue, load, score,
# compare, store, and each diagnostic's name.
EventFn = Callable[[str, "str | None", str], None]
# on_progress(dtype, tokens done, tokens in all): the numbers behind a long job's "batch" events, for
# a progress bar (the words go to on_event).
ProgressFn = Callable[["str | None", int, int], None]
# on_status(dtype, numbers): a long job's progress as numbers (done, total, unit, per_s, seconds_left,
# and on a Ray cluster workers_alive and workers), for the CLI's bar and its --events file.
StatusFn = Callable[["str | None", dict], None]


def _noop(stage: str, dtype: str | None, detail: str) -> None:
    pass


def _no_progress(dtype: str | None, done: int, total: int) -> None:
    pass


def _no_status(dtype: str | None, numbers: dict) -> None:
    pass


@dataclass(frozen=True)
class Context:
    """What a request needs from its caller.

    model_roots: the folders local models may come from; None lets them come from anywhere (the CLI
    on one's own machine, or LPP_MODEL_ROOTS when set); [] allows none (a dashboard served beyond
    localhost with no roots configured).
    """

    store: Store = field(default_factory=Store)
    model_roots: list[str] | None = None
    on_event: EventFn = _noop
    pool: EnginePool = POOL
    on_progress: ProgressFn = _no_progress
    on_status: StatusFn = _no_status
    # prompt sets and logged rollouts on a Ray cluster: what RayOptions.of takes (logprob_parity.analysis.cluster); None: here
    ray: Any = None

    def emit(self, stage: str, dtype: str | None, detail: str) -> None:
        self.on_event(stage, dtype, detail)

    def waiter(self, dtype: str | None) -> Callable[[str], None]:
        """A pool wait callback that reports as a `queue` event."""
        return lambda message: self.emit("queue", dtype, message)

    @classmethod
    def of(
        cls,
        store: Store | None = None,
        on_event: EventFn | None = None,
        model_roots: list[str] | None = None,
        pool: EnginePool | None = None,
        on_progress: ProgressFn | None = None,
        on_status: StatusFn | None = None,
        ray: Any = None,
    ) -> Context:
        return cls(
            store=store or Store(),
            model_roots=model_roots,
            on_event=on_event or _noop,
            pool=pool or POOL,
            on_progress=on_progress or _no_progress,
            on_status=on_status or _no_status,
            ray=ray,
        )


def say_loading(ctx: Context, dtype: str | None, lease: Any, request: LoadRequest, device: str) -> None:
    """A `load` event: the engine is warm, or starting (how long that takes here; it stays warm)."""
    from logprob_parity.engines.host import start_words

    ctx.emit(
        "load",
        dtype,
        f"{request.backend}: warm engine"
        if lease.warm(request)
        else f"{request.backend}: starting the engine ({start_words(request.backend, device)}; it stays warm for the next run)",
    )


def model_max_len(longest: int, max_positions: int | None) -> int:
    """vLLM's max_model_len: a power of two above the longest sequence (so a warm engine serves
    later, slightly longer prompts), at least 256, never above the model's positions."""
    n = 256
    while n < longest + 1:
        n *= 2
    return min(n, max_positions) if max_positions else n


def length_limit(lengths: list[int], model: ResolvedModel, top_k: int, truncate: bool = False) -> int | None:
    """Refuse prompts longer than the model's positions allow (or, with truncate, return the length
    to cut them to): vLLM keeps one position for the token it must generate, so a prompt may use
    all but one. None: nothing to cut."""
    limit = None if model.max_positions is None else model.max_positions - 1
    vocab = model.vocab_size
    if limit is not None:
        for i, n in enumerate(lengths):
            if n > limit and not truncate:
                raise UserError(
                    f"prompt {i + 1} is {n} tokens but {model.name} has {model.max_positions} positions "
                    f"(vLLM keeps one for the token it generates). Shorten it, or tick 'Truncate prompts longer than the "
                    f"model's positions' (on the command line: --truncate) to keep its first {limit} tokens"
                )
    if vocab is not None and top_k > vocab:
        raise UserError(f"top-k {top_k} is above the vocabulary size {vocab}")
    return limit if limit is not None and any(n > limit for n in lengths) else None


def check_lengths(toks: list[TokenizedText], model: ResolvedModel, top_k: int, truncate: bool = False) -> list[TokenizedText]:
    """`length_limit` on tokenized texts: each one as it is, or cut to the limit."""
    limit = length_limit([len(t.token_ids) for t in toks], model, top_k, truncate)
    return [truncate_tokens(t, limit) if limit is not None else t for t in toks]


class Prepared:
    """A validated request: the resolved model and device, the spec with its parallel plan, and
    (on first use) the tokenizer and the token ids every engine scores."""

    def __init__(self, spec: RunSpec, ctx: Context, model: ResolvedModel, device: str) -> None:
        self.spec, self.ctx, self.model, self.device = spec, ctx, model, device

    @cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(self.model.path, self.spec.settings.trust_remote_code)

    def provenance(self, dtype: str, hf_engine: dict[str, Any], vllm_engine: dict[str, Any]) -> dict[str, Any]:
        """The fields every stored record (a run, a rollout, a rescore) opens with: when, which model,
        which dtype and device, and the versions and engine reports the numbers came from."""
        import datetime as dt

        from logprob_parity.env import device_name, versions
        from logprob_parity.results.records import RunEnv

        now = dt.datetime.now(dt.timezone.utc)
        v = versions()
        m = self.model
        return {
            "created": now.isoformat(timespec="seconds"),
            "created_ts": now.timestamp(),
            "model": m.name,
            "model_path": m.path,
            "revision": m.revision,
            "model_identity": m.identity,
            "dtype": dtype,
            "device": self.device,
            "env": RunEnv(
                device=device_name(self.device),
                torch=v["torch"],
                transformers=v["transformers"],
                vllm=v["vllm"],
                vllm_dist=v["vllm_dist"],
                hf_engine=hf_engine,
                vllm_engine=vllm_engine,
            ),
        }

    @cached_property
    def _encoded(self) -> tuple[list[list[int]], bool, int | None]:
        """(every text's ids as scored, whether a BOS was prepended, the length they were cut to or
        None): one batch call of the tokenizer, so a 10,000-prompt set tokenizes in seconds and bad
        input fails before any engine starts."""
        s = self.spec
        ids, bos_added = encode_texts(self.tokenizer, s.texts, s.bos)
        limit = length_limit([len(x) for x in ids], self.model, s.top_k, s.truncate)
        return ids, bos_added, limit

    @cached_property
    def seqs(self) -> list[list[int]]:
        """The token ids every engine scores, one list a text (cut where `truncate` cuts)."""
        ids, _, limit = self._encoded
        return ids if limit is None else [x[:limit] for x in ids]

    def tokenized(self, i: int) -> TokenizedText:
        """Text i with its token names and pieces (made when needed: a batch at a time for a large set)."""
        ids, bos_added, limit = self._encoded
        tok = describe(self.tokenizer, self.spec.texts[i], ids[i], bos_added)
        return truncate_tokens(tok, limit) if limit is not None else tok

    @cached_property
    def texts(self) -> list[str]:
        """Each text as scored: a cut text is what its kept tokens decode to."""
        ids, _, limit = self._encoded
        return [
            self.tokenized(i).text if limit is not None and len(x) > limit else t
            for i, (t, x) in enumerate(zip(self.spec.texts, ids))
        ]

    @cached_property
    def toks(self) -> list[TokenizedText]:
        return [self.tokenized(i) for i in range(len(self.spec.texts))]

    @property
    def max_model_len(self) -> int:
        return model_max_len(max(len(x) for x in self.seqs), self.model.max_positions)

    @cached_property
    def decode(self) -> Callable[[int], str]:
        """Token id -> the text it decodes to alone (memoised per process: top-k lists repeat ids)."""
        many = self.decode_many
        return lambda i: many([[int(i)]])[0]

    @cached_property
    def decode_many(self) -> Callable[[list[list[int]]], list[str]]:
        """Many id lists -> their texts in one call (logprob_parity.inputs.tokens.batch_decoder)."""
        return batch_decoder(self.tokenizer)

    def load(self, backend: str, dtype: str, settings: Any = None, device: str | None = None) -> LoadRequest:
        """The engine for one backend and dtype (settings and device default to the request's)."""
        return LoadRequest(
            backend, self.model.path, dtype, device or self.device, settings or self.spec.settings, self.max_model_len
        )


def prepare(spec: RunSpec, ctx: Context) -> Prepared:
    """Validate, resolve the model within ctx.model_roots, choose the device and parallel plan.
    Tokenizing happens on first use of `.seqs` or `.toks`, so a request answered from the store never loads a
    tokenizer."""
    spec.validate()
    device = resolve_device(spec.device)
    for d in spec.dtypes:
        reason = dtype_support(d, device)
        if reason:
            raise UserError(f"{d} cannot run on this device: {reason}")
    refused = build.refusal(spec.settings)  # before any engine starts, not as a kernel error after
    if refused:
        raise UserError(refused)
    ctx.emit("resolve", None, f"model {spec.model or 'demo'}")
    model = resolve_model(spec.model, spec.revision, spec.settings.trust_remote_code, ctx.model_roots)
    widest = max(spec.dtypes, key=ELEM_BYTES.__getitem__)  # one parallel plan for every dtype of the request
    spec = dataclasses.replace(spec, settings=parallel.resolve(spec.settings, model.path, widest, device))
    return Prepared(spec, ctx, model, device)
