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

from core.engines import parallel
from core.engines.memory import ELEM_BYTES
from core.engines.pool import POOL, EnginePool
from core.engines.records import LoadRequest
from core.env import dtype_support, resolve_device
from core.errors import UserError
from core.inputs.models import ResolvedModel, resolve_model
from core.inputs.spec import RunSpec
from core.inputs.tokens import TokenizedText, load_tokenizer, tokenize
from core.inputs.tokens import truncate as truncate_tokens
from core.results.store import Store

# on_event(stage, dtype or None, detail): stages are resolve, cache, tokenize, queue, load, score,
# compare, store, and each diagnostic's name.
EventFn = Callable[[str, "str | None", str], None]


def _noop(stage: str, dtype: str | None, detail: str) -> None:
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

    def emit(self, stage: str, dtype: str | None, detail: str) -> None:
        self.on_event(stage, dtype, detail)

    def waiter(self, dtype: str | None) -> Callable[[str], None]:
        """A pool wait callback that reports as a `queue` event."""
        return lambda message: self.emit("queue", dtype, message)

    @classmethod
    def of(cls, store: Store | None = None, on_event: EventFn | None = None, model_roots: list[str] | None = None,
           pool: EnginePool | None = None) -> "Context":
        return cls(store=store or Store(), model_roots=model_roots, on_event=on_event or _noop, pool=pool or POOL)


def model_max_len(longest: int, max_positions: int | None) -> int:
    """vLLM's max_model_len: a power of two above the longest sequence (so a warm engine serves
    later, slightly longer prompts), at least 256, never above the model's positions."""
    n = 256
    while n < longest + 1:
        n *= 2
    return min(n, max_positions) if max_positions else n


def check_lengths(toks: list[TokenizedText], model: ResolvedModel, top_k: int, truncate: bool = False) -> list[TokenizedText]:
    """Refuse (or, with truncate, cut) prompts longer than the model's positions allow: vLLM keeps
    one position for the token it must generate, so a prompt may use all but one."""
    limit = None if model.max_positions is None else model.max_positions - 1
    out = []
    for i, t in enumerate(toks):
        if limit is not None and len(t.token_ids) > limit:
            if not truncate:
                raise UserError(
                    f"prompt {i + 1} is {len(t.token_ids)} tokens but {model.name} has {model.max_positions} positions "
                    f"(vLLM keeps one for the token it generates). Shorten it, or tick 'Truncate prompts longer than the "
                    f"model's positions' (on the command line: --truncate) to keep its first {limit} tokens"
                )
            t = truncate_tokens(t, limit)
        out.append(t)
    vocab = model.vocab_size
    if vocab is not None and top_k > vocab:
        raise UserError(f"top-k {top_k} is above the vocabulary size {vocab}")
    return out


class Prepared:
    """A validated request: the resolved model and device, the spec with its parallel plan, and
    (on first use) the tokenizer and the token ids every engine scores."""

    def __init__(self, spec: RunSpec, ctx: Context, model: ResolvedModel, device: str) -> None:
        self.spec, self.ctx, self.model, self.device = spec, ctx, model, device

    @cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(self.model.path, self.spec.settings.trust_remote_code)

    @cached_property
    def toks(self) -> list[TokenizedText]:
        s = self.spec
        return check_lengths([tokenize(self.tokenizer, text, s.bos) for text in s.texts], self.model, s.top_k, s.truncate)

    @property
    def seqs(self) -> list[list[int]]:
        return [list(t.token_ids) for t in self.toks]

    @property
    def max_model_len(self) -> int:
        return model_max_len(max(len(t.token_ids) for t in self.toks), self.model.max_positions)

    @cached_property
    def decode(self) -> Callable[[int], str]:
        """Token id -> the text it decodes to alone (memoised: top-k lists repeat ids)."""
        cache: dict[int, str] = {}
        tokenizer = self.tokenizer

        def decode(i: int) -> str:
            if i not in cache:
                cache[i] = tokenizer.decode([i])
            return cache[i]

        return decode

    def load(self, backend: str, dtype: str, settings: Any = None, device: str | None = None) -> LoadRequest:
        """The engine for one backend and dtype (settings and device default to the request's)."""
        return LoadRequest(backend, self.model.path, dtype, device or self.device, settings or self.spec.settings,
                           self.max_model_len)


def prepare(spec: RunSpec, ctx: Context) -> Prepared:
    """Validate, resolve the model within ctx.model_roots, choose the device and parallel plan.
    Tokenizing happens on first use of `.toks`, so a request answered from the store never loads a
    tokenizer."""
    spec.validate()
    device = resolve_device(spec.device)
    for d in spec.dtypes:
        reason = dtype_support(d, device)
        if reason:
            raise UserError(f"{d} cannot run on this device: {reason}")
    ctx.emit("resolve", None, f"model {spec.model or 'demo'}")
    model = resolve_model(spec.model, spec.revision, spec.settings.trust_remote_code, ctx.model_roots)
    widest = max(spec.dtypes, key=ELEM_BYTES.__getitem__)  # one parallel plan for every dtype of the request
    spec = dataclasses.replace(spec, settings=parallel.resolve(spec.settings, model.path, widest, device))
    return Prepared(spec, ctx, model, device)
