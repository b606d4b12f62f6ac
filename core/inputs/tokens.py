"""Tokenize once, with the model's own tokenizer: these ids are the single source of truth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import UserError

# Incremental decoding is quadratic; past this many tokens fall back to per-token decoding.
_INCREMENTAL_DECODE_LIMIT = 4096


@dataclass(frozen=True)
class TokenizedText:
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]  # the tokenizer's own pieces (e.g. "Ġword"), as JSON reports them
    pieces: tuple[str, ...]  # the text each token adds when decoded in sequence, for display
    bos_added: bool  # we prepended the tokenizer's BOS
    cut_from: int | None = None  # the token count before `truncate` cut it


def load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    from core.env import from_transformers

    AutoTokenizer = from_transformers("AutoTokenizer")

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UserError(
                "this model's tokenizer needs custom code: turn on trust_remote_code only if you trust its authors"
            ) from exc
        raise UserError(f"could not load a tokenizer from {model_path}: {exc}") from exc
    except (OSError, TypeError, KeyError) as exc:
        raise UserError(f"could not load a tokenizer from {model_path}: {str(exc).splitlines()[0]}") from exc


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"]
    return bos is not None and len(ids) > 0 and ids[0] == bos


def tokenize(tokenizer: Any, text: str, bos: str = "auto") -> TokenizedText:
    """Encode `text` without special tokens, then apply the BOS policy.

    auto: prepend the tokenizer's BOS when it has one (whether or not its own call would add it, the
    ids are the same); add: the same but an error when it has none; none: never prepend.
    """
    body = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos_id = tokenizer.bos_token_id
    if bos == "add" and bos_id is None:
        raise UserError("BOS policy 'add' but this tokenizer has no BOS token; use --bos auto or none")
    bos_added = bos in ("auto", "add") and bos_id is not None
    ids = [bos_id] + body if bos_added else body
    if len(ids) < 2:
        raise UserError(
            f"{text!r} is {len(ids)} token(s) long: nothing to score (position 0 has no prediction); "
            "use a longer text or --bos add"
        )
    return TokenizedText(
        text=text,
        token_ids=tuple(int(i) for i in ids),
        tokens=tuple(tokenizer.convert_ids_to_tokens(ids)),
        pieces=tuple(decode_pieces(tokenizer, ids)),
        bos_added=bos_added,
    )


def decode_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """The text each token contributes, so joined pieces rebuild the decoded text faithfully
    (spaces, newlines and multi-byte characters split across byte-level tokens)."""
    if len(ids) > _INCREMENTAL_DECODE_LIMIT:
        return [tokenizer.decode([i]) for i in ids]
    pieces, prev = [], ""
    for n in range(1, len(ids) + 1):
        cur = tokenizer.decode(ids[:n])
        if cur.startswith(prev) and not cur.endswith("\ufffd"):
            pieces.append(cur[len(prev) :])
            prev = cur
        else:  # an incomplete multi-byte character: show it once it completes
            pieces.append("")
    if prev != tokenizer.decode(ids):
        pieces[-1] += tokenizer.decode(ids)[len(prev) :]
    return pieces


def truncate(tok: TokenizedText, limit: int) -> TokenizedText:
    """The first `limit` tokens; the text becomes what those tokens decode to."""
    if len(tok.token_ids) <= limit:
        return tok
    pieces = tok.pieces[:limit]
    return TokenizedText(
        text="".join(pieces[1:] if tok.bos_added else pieces),
        token_ids=tok.token_ids[:limit],
        tokens=tok.tokens[:limit],
        pieces=pieces,
        bos_added=tok.bos_added,
        cut_from=len(tok.token_ids),
    )


def decode_tail_pieces(tokenizer: Any, ids: list[int], start: int, window: int = 8) -> list[str]:
    """The pieces of ids[start:] (a completion after its prompt) in linear time: each token's text is
    read from a window of the `window` tokens before it, so a long rollout does not decode every
    prefix. A token that ends inside a multi-byte character adds "" and the token that completes it
    adds the character. Checked against decoding the whole: if the pieces do not join to the
    completion's text (an unusual tokenizer), the exact quadratic `decode_pieces` is used instead."""
    pieces: list[str | None] = []
    first = None  # the first token of a run that ends inside a character, not yet shown
    for t in range(start, len(ids)):
        since = t if first is None else first
        lo = max(0, since - window)
        before, now = tokenizer.decode(ids[lo:since]), tokenizer.decode(ids[lo : t + 1])
        if now.endswith("\ufffd"):
            pieces.append("")
            first = since
            continue
        pieces.append(now[len(before) :] if now.startswith(before) else None)
        first = None
    whole, head = tokenizer.decode(ids), tokenizer.decode(ids[:start])
    tail = whole[len(head) :]
    if None not in pieces and pieces and whole.startswith(head):
        joined = "".join(pieces)  # type: ignore[arg-type]
        if first is not None and tail.startswith(joined):  # it ends inside a character: as decode_pieces shows it
            pieces[-1] = (pieces[-1] or "") + tail[len(joined) :]
            joined = tail
        if joined == tail:
            return pieces  # type: ignore[return-value]
    return decode_pieces(tokenizer, ids)[start:]
