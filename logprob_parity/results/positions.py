"""A batch of scored sequences as one Arrow table, a row per position, built from flat arrays.

Why: building one Python object per sequence and then a pandas frame of Python lists per column
cost more than the engines themselves on a 64 x 512-token comparison. Here every column is one numpy
concatenation over the batch turned into an Arrow array without copying, the metrics are computed
once over the whole batch, and each distinct top-k id is decoded once (a batch holds far fewer
distinct ids than top-k slots). The table is exactly what the store writes (`logprob_parity.results.store`)
and what `SequenceResult.from_columns` reads back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from logprob_parity.engines.scores import TokenScores
from logprob_parity.errors import TokenMismatchError
from logprob_parity.results.metrics import TokenMetrics, summarize_each, token_metrics
from logprob_parity.results.records import SequenceInfo

SIDES = ("hf", "vllm")


def _check_ids(i: int, ids: np.ndarray, hf: TokenScores, vllm: TokenScores) -> None:
    for side, sc in (("hf", hf), ("vllm", vllm)):
        if not np.array_equal(sc.token_ids, ids):
            raise TokenMismatchError(
                f"{side} scored ids {sc.token_ids.tolist()} but sequence {i} of the run has {ids.tolist()}: "
                "the engines did not score the same tokens, so nothing is compared"
            )


def _fixed_list(values: np.ndarray) -> Any:
    """[rows, k] numpy -> an Arrow fixed-size list column (one zero-copy flat array underneath)."""
    import pyarrow as pa

    k = values.shape[1]
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(values).reshape(-1)), k)


def _text_lists(ids: np.ndarray, decode_many: Callable[[list[list[int]]], list[str]] | None) -> Any:
    """[rows, k] top-k ids -> their texts as a fixed-size list of strings ("" where there is no id),
    looked up by id (logprob_parity.inputs.tokens.Decoder.texts_of_ids) when the decoder can, else each
    distinct id decoded once."""
    import pyarrow as pa

    flat = ids.reshape(-1)
    k = max(ids.shape[1], 1)
    if decode_many is None:
        return pa.FixedSizeListArray.from_arrays(pa.array([""] * len(flat), pa.string()), k)
    lookup = getattr(decode_many, "texts_of_ids", None)
    if lookup is not None:
        return pa.FixedSizeListArray.from_arrays(lookup(flat), k)
    uniq = np.unique(flat[flat >= 0])
    texts = decode_many([[i] for i in uniq.tolist()]) + [""]
    where = np.searchsorted(uniq, flat)
    where = np.where(flat >= 0, where, len(uniq)).astype(np.int32)
    strings = pa.array(texts, pa.string()).take(pa.array(where))
    return pa.FixedSizeListArray.from_arrays(strings, k)


def batch_table(
    toks: Sequence[Any],
    hf: Sequence[TokenScores],
    vllm: Sequence[TokenScores],
    decode_many: Callable[[list[list[int]]], list[str]] | None,
    seq_offset: int = 0,
) -> tuple[Any, list[SequenceInfo], TokenMetrics]:
    """The Arrow table of a batch (rows in sequence order, `seq` counted from seq_offset), each
    sequence's SequenceInfo with its summary, and the batch's metrics (for the run's summary).

    toks: TokenizedText-like (text, token_ids, tokens, pieces, bos_added, cut_from); hf and vllm:
    each side's scores of the same ids, in the same order. Refuses scores of other ids."""
    import pyarrow as pa

    lengths = [len(t.token_ids) for t in toks]
    ids = np.concatenate([np.asarray(t.token_ids, dtype=np.int64) for t in toks])
    at = 0
    for i, (_t, h, v) in enumerate(zip(toks, hf, vllm)):
        _check_ids(seq_offset + i, ids[at : at + lengths[i]], h, v)
        at += lengths[i]
    if not (len(toks) == len(hf) == len(vllm)):
        raise TokenMismatchError(f"{len(toks)} sequences but hf scored {len(hf)} and vllm {len(vllm)}")

    def cat(side: Sequence[TokenScores], name: str) -> np.ndarray:
        return np.concatenate([getattr(s, name) for s in side])

    k = hf[0].topk_ids.shape[1]
    hf_lp, v_lp = cat(hf, "logprob"), cat(vllm, "logprob")
    hf_top, v_top = cat(hf, "topk_ids"), cat(vllm, "topk_ids")
    v_top_lp = cat(vllm, "topk_logprobs")
    gathered = np.concatenate(
        [s.gathered_logprobs if s.gathered_logprobs is not None else np.full((len(s.logprob), k), np.nan) for s in hf]
    )
    kl_full = np.concatenate([s.kl_full if s.kl_full is not None else np.full(len(s.logprob), np.nan) for s in hf])
    m = token_metrics(hf_lp, v_lp, hf_top[:, 0], v_top[:, 0], v_top_lp, gathered, kl_full)

    infos = [
        SequenceInfo(t.text, bool(t.bos_added), n, summary, getattr(t, "cut_from", None))
        for t, n, summary in zip(toks, lengths, summarize_each(m, lengths))
    ]
    seq = np.repeat(np.arange(seq_offset, seq_offset + len(toks), dtype=np.int64), lengths)
    index = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    strings = lambda name: pa.array(list(itertools.chain.from_iterable(getattr(t, name) for t in toks)), pa.string())  # noqa: E731
    table = pa.table(
        {
            "seq": seq,
            "index": index,
            "token_id": ids,
            "token": strings("tokens"),
            "piece": strings("pieces"),
            "scored": m.scored,
            "hf_logprob": hf_lp,
            "vllm_logprob": v_lp,
            "hf_rank": cat(hf, "rank"),
            "vllm_rank": cat(vllm, "rank"),
            "hf_prob": m.hf_prob,
            "vllm_prob": m.vllm_prob,
            "delta": m.delta,
            "abs_delta": m.abs_delta,
            "prob_delta": m.prob_delta,
            "kl_topk": m.kl_topk,
            "kl_full": m.kl_full,
            "argmax_agree": m.argmax_agree,
            "hf_topk_ids": _fixed_list(hf_top),
            "hf_topk_logprobs": _fixed_list(cat(hf, "topk_logprobs")),
            "vllm_topk_ids": _fixed_list(v_top),
            "vllm_topk_logprobs": _fixed_list(v_top_lp),
            "hf_at_vllm_topk": _fixed_list(gathered),
            "hf_topk_text": _text_lists(hf_top, decode_many),
            "vllm_topk_text": _text_lists(v_top, decode_many),
        }
    )
    return table, infos, m


# The per-position columns a run-level summary needs (read back from stored parts, not the lists).
METRIC_COLUMNS = tuple(f.name for f in fields(TokenMetrics))


def metrics_of(table: Any) -> TokenMetrics:
    """A stored table's metric columns as TokenMetrics (for the summary over several parts)."""
    return TokenMetrics(
        *(
            table.column(name).to_numpy(zero_copy_only=False) if name in table.column_names else np.full(table.num_rows, np.nan)
            for name in METRIC_COLUMNS
        )
    )
