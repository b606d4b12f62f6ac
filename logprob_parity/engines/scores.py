"""What one backend returns for one sequence: plain numpy arrays, position-aligned with the token ids."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class TokenScores:
    """Per position t: log p(token t | tokens < t) and the k most likely tokens there.

    Unscored positions (position 0) hold NaN logprobs and -1 ranks/ids. Values are the engines'
    float32 log_softmax outputs widened to float64 losslessly, so comparisons never round.
    """

    token_ids: np.ndarray  # int64 [T]: the ids this backend actually scored (checked against the input)
    logprob: np.ndarray  # float64 [T]
    rank: np.ndarray  # int64 [T], 1 = most likely
    topk_ids: np.ndarray  # int64 [T, k]
    topk_logprobs: np.ndarray  # float64 [T, k]
    # HF only: HF's logprob of each id in the other side's top-k at each position (for kl_topk).
    gathered_logprobs: np.ndarray | None = None  # float64 [T, k]
    # HF only: the exact KL(HF || vLLM) over the whole vocabulary at each position (NaN at 0)
    kl_full: np.ndarray | None = None  # float64 [T]

    @classmethod
    def empty(cls, token_ids: list[int], k: int) -> TokenScores:
        n = len(token_ids)
        return cls(
            token_ids=np.asarray(token_ids, dtype=np.int64),
            logprob=np.full(n, np.nan),
            rank=np.full(n, -1, dtype=np.int64),
            topk_ids=np.full((n, k), -1, dtype=np.int64),
            topk_logprobs=np.full((n, k), np.nan),
        )
