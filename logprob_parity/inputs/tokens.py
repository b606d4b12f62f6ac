"""Tokenize once, with the model's own tokenizer: these ids are the single source of truth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from logprob_parity.errors import UserError


@dataclass(frozen=True)
class TokenizedText:
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]  # the tokenizer's own pieces (e.g. "Ġword"), as JSON reports them
    pieces: tuple[str, ...]  # the text each token adds when decoded in sequence, for display
    bos_added: bool  # we prepended the tokenizer's BOS
    cut_from: int | None = None  # the token count before `truncate` cut it


_TOKENIZERS: dict[tuple[str, bool, float], Any] = {}


def load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer, loaded once per folder (and its config's modification time) in this
    process: loading one takes longer than tokenizing a 64 x 512-token request. Encoding with the
    same settings and decoding change no state, so one copy serves every request."""
    import os

    try:
        stamp = os.stat(os.path.join(model_path, "tokenizer_config.json")).st_mtime
    except OSError:
        stamp = -1.0
    key = (str(model_path), bool(trust_remote_code), stamp)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _load_tokenizer(model_path, trust_remote_code)
    return _TOKENIZERS[key]


def _load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    from logprob_parity.env import from_transformers

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


def encode_texts(tokenizer: Any, texts: list[str] | tuple[str, ...], bos: str = "auto") -> tuple[list[list[int]], bool]:
    """Every text's ids under the BOS policy (see `tokenize`), encoded in one batch call (the fast
    tokenizers encode a batch in parallel, in Rust): a 10,000-prompt set costs one call, not 10,000."""
    bos_id = tokenizer.bos_token_id
    if bos == "add" and bos_id is None:
        raise UserError("BOS policy 'add' but this tokenizer has no BOS token; use --bos auto or none")
    bos_added = bos in ("auto", "add") and bos_id is not None
    bodies = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for text, body in zip(texts, bodies):
        ids = [int(bos_id)] + [int(i) for i in body] if bos_added else [int(i) for i in body]
        if len(ids) < 2:
            raise UserError(
                f"{text!r} is {len(ids)} token(s) long: nothing to score (position 0 has no prediction); "
                "use a longer text or --bos add"
            )
        out.append(ids)
    return out, bos_added


def describe(tokenizer: Any, text: str, ids: list[int], bos_added: bool) -> TokenizedText:
    """The display side of one text's ids: the tokenizer's own token names and the pieces."""
    return TokenizedText(
        text=text,
        token_ids=tuple(int(i) for i in ids),
        tokens=tuple(tokenizer.convert_ids_to_tokens(list(ids))),
        pieces=tuple(decode_pieces(tokenizer, list(ids))),
        bos_added=bos_added,
    )


def tokenize(tokenizer: Any, text: str, bos: str = "auto") -> TokenizedText:
    """Encode `text` without special tokens, then apply the BOS policy.

    auto: prepend the tokenizer's BOS when it has one (whether or not its own call would add it, the
    ids are the same); add: the same but an error when it has none; none: never prepend.
    """
    (ids,), bos_added = encode_texts(tokenizer, [text], bos)
    return describe(tokenizer, text, ids, bos_added)


def batch_decoder(tokenizer: Any) -> Decoder:
    """A function decoding many id lists at once, equal to `raw_decode` on each (see `Decoder`)."""
    return Decoder(tokenizer)


class Decoder:
    """Many id lists -> their texts in one call, equal to `raw_decode` on each; and one token's text
    looked up for a whole array of ids (`texts_of_ids`, the top-k columns).

    transformers' `decode` spends most of its time converting arguments in Python (it checks every
    id); the Rust tokenizer behind a fast tokenizer decodes a whole batch in one call. That path is
    used only when it gives the very strings `raw_decode` gives (checked on the first call's first
    few items; a slow tokenizer keeps `raw_decode`). One token's text is decoded once per process and
    tokenizer (`_Singles`): the top-k columns of every run hold the same ids again and again, and a
    64 x 512-token batch has 327,680 top-k slots."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        rust = getattr(tokenizer, "_tokenizer", None)
        self._rust = rust if rust is not None and hasattr(rust, "decode_batch") else None
        self._ok: bool | None = None  # the Rust path gives raw_decode's strings (None: not checked yet)
        singles = tokenizer.__dict__.get("_lpp_singles")
        if singles is None:  # made once a tokenizer (decode_pieces builds a Decoder a text)
            singles = tokenizer.__dict__.setdefault("_lpp_singles", _Singles())
        self._singles: _Singles = singles
        # the top-k candidates' texts are kept apart: a partial character reads as its bytes there
        self._candidates: _Singles = tokenizer.__dict__.setdefault("_lpp_candidates", _Singles())

    def _slow(self, seqs: list[list[int]]) -> list[str]:
        return [raw_decode(self._tokenizer, list(s)) for s in seqs]

    def _texts(self, seqs: list[list[int]]) -> list[str]:
        if self._rust is None:
            return self._slow(seqs)
        fast = self._rust.decode_batch(seqs, skip_special_tokens=False)
        if self._ok is None:
            probe = [s for s in seqs[:16] if s]
            self._ok = self._slow(probe) == [f for s, f in zip(seqs[:16], fast) if s]
        return fast if self._ok else self._slow(seqs)

    def __call__(self, seqs: list[list[int]]) -> list[str]:
        if seqs and all(len(s) == 1 for s in seqs):
            return self._singles.texts(self._texts, [int(s[0]) for s in seqs])
        return self._texts([list(map(int, s)) for s in seqs])

    def texts_of_ids(self, ids: Any) -> Any:
        """An array of ids (any shape) -> one token's text each, as a list of candidates shows it, flat,
        as an Arrow string array ("" where an id is negative: no id there)."""
        return self._candidates.column(self._candidate_texts, ids)

    def _candidate_texts(self, seqs: list[list[int]]) -> list[str]:
        """Each single token's text, or its bytes ("<0xE3><0x81>") when it holds part of a character.
        Why: such a token decodes alone to "\ufffd", so five emoji or CJK candidates all read "\ufffd" and
        cannot be told apart in the hover's top-k list."""
        texts = self._texts(seqs)
        return [
            (token_bytes_words(self._tokenizer, s[0]) or t) if "\ufffd" in t and len(s) == 1 else t for s, t in zip(seqs, texts)
        ]


class _Singles:
    """One token's text by id, kept on the tokenizer: a numpy array indexed by id, grown as new ids
    come, and its Arrow copy for lookups (`take`) without a Python object a slot."""

    def __init__(self) -> None:
        import threading

        import numpy as np

        self._lock = threading.Lock()
        self._known = np.zeros(0, dtype=bool)
        self._values = np.empty(0, dtype=object)
        self._arrow: Any = None  # the values, then one "" (the text of "no id"), as Arrow strings

    def _learn(self, texts: Callable[[list[list[int]]], list[str]], ids: Any) -> None:
        import numpy as np

        if ids.size == 0:
            return
        top = int(ids.max()) + 1
        if top > len(self._known):
            grow = top - len(self._known)
            self._known = np.concatenate([self._known, np.zeros(grow, dtype=bool)])
            self._values = np.concatenate([self._values, np.full(grow, "", dtype=object)])
        missing = ids[~self._known[ids]]
        if missing.size:
            new = np.unique(missing)
            self._values[new] = texts([[i] for i in new.tolist()])
            self._known[new] = True
            self._arrow = None

    def texts(self, texts: Callable[[list[list[int]]], list[str]], keys: list[int]) -> list[str]:
        import numpy as np

        ids = np.asarray(keys, dtype=np.int64)
        with self._lock:
            self._learn(texts, ids)
            return self._values[ids].tolist()

    def column(self, texts: Callable[[list[list[int]]], list[str]], ids: Any) -> Any:
        import numpy as np
        import pyarrow as pa

        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        valid = flat >= 0
        with self._lock:
            self._learn(texts, flat[valid])
            if self._arrow is None:
                self._arrow = pa.array(np.append(self._values, ""), pa.string())
            where = np.where(valid, flat, len(self._values))
            return self._arrow.take(pa.array(where))


def raw_decode(tokenizer: Any, ids: list[int]) -> str:
    """`tokenizer.decode` without its clean-up of spaces before punctuation (" ." -> "."), which some
    tokenizers (and transformers versions) apply: a token shows its own text, and the pieces of a
    text join to what its tokens hold."""
    return tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)


def decode_pieces(tokenizer: Any, ids: list[int], window: int = 8) -> list[str]:
    """The text each token contributes, so joined pieces rebuild the decoded text faithfully
    (spaces, newlines and multi-byte characters split across byte-level tokens): token t's piece is
    what it adds to the `window` tokens before it, all decoded in one batch call (linear time).
    A token that ends inside a multi-byte character adds "" and the token that completes it adds
    the character. If the pieces do not join to the whole text (an unusual tokenizer), every
    prefix is decoded instead (`exact_pieces`)."""
    ids = [int(i) for i in ids]
    n = len(ids)
    if n == 0:
        return []
    fast = _byte_level_pieces(tokenizer, ids)
    if fast is not None and "".join(fast) == tokenizer._tokenizer.decode(ids, skip_special_tokens=False):
        return fast
    dec = batch_decoder(tokenizer)
    los = [max(0, t - window) for t in range(n)]
    texts = dec([ids[lo : t + 1] for t, lo in enumerate(los)] + [ids[lo:t] for t, lo in enumerate(los)] + [ids])
    now, before, whole = texts[:n], texts[n : 2 * n], texts[-1]
    pieces: list[str | None] = []
    first = None  # the first token of a run that ends inside a character, not yet shown
    for t in range(n):
        if first is None:
            b, c = before[t], now[t]
        else:
            lo = max(0, first - window)
            b, c = dec([ids[lo:first], ids[lo : t + 1]])
        if c.endswith("\ufffd"):
            pieces.append("")
            first = t if first is None else first
            continue
        pieces.append(c[len(b) :] if c.startswith(b) else None)
        first = None
    if None not in pieces:
        joined = "".join(pieces)  # type: ignore[arg-type]
        if first is not None and whole.startswith(joined):  # it ends inside a character: shown on the last token
            pieces[-1] = (pieces[-1] or "") + whole[len(joined) :]
            joined = whole
        if joined == whole:
            return pieces  # type: ignore[return-value]
    return exact_pieces(tokenizer, ids)


def token_bytes_words(tokenizer: Any, token_id: int) -> str | None:
    """A token's bytes in the notation SentencePiece's byte tokens use ("<0xE3><0x81>"): from its
    byte-level name (GPT-2's alphabet), or its own name where that is already a byte token; None when
    neither applies."""
    rust = getattr(tokenizer, "_tokenizer", None)
    name = rust.id_to_token(int(token_id)) if rust is not None else None
    if not name:
        return None
    if name.startswith("<0x") and name.endswith(">"):
        return name
    if _decodes_bytes(tokenizer, rust) and all(c in _BYTE_OF for c in name):
        return "".join(f"<0x{_BYTE_OF[c]:02X}>" for c in name)
    return None


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> the byte it stands for (the ByteLevel decoder's map)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF = _byte_table()


def _decodes_bytes(tokenizer: Any, rust: Any) -> bool:
    """Whether the decoder is ByteLevel, alone or inside a Sequence (transformers' GGUF conversion
    writes a Sequence); kept on the tokenizer, as reading it serialises the whole tokenizer."""
    known = tokenizer.__dict__.get("_lpp_byte_level")
    if known is None:
        import json

        try:
            dec = json.loads(rust.to_str()).get("decoder") or {}
        except Exception:
            dec = {}
        parts = dec.get("decoders") or [] if dec.get("type") == "Sequence" else [dec]
        known = tokenizer.__dict__["_lpp_byte_level"] = any(d.get("type") == "ByteLevel" for d in parts)
    return bool(known)


def _byte_level_pieces(tokenizer: Any, ids: list[int]) -> list[str] | None:
    """Pieces without decoding any text, for byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM, Qwen):
    each token is a fixed run of bytes, so the text each one adds is what an incremental UTF-8 decoder
    yields on its bytes ("" while a character is incomplete, the character on the token completing it).
    None when the tokenizer's decoder has no byte-level step; the caller checks the pieces join to its
    decode (a decoder that also replaces or strips text fails that check and takes the slow path)."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is None or not _decodes_bytes(tokenizer, rust):
        return None
    import codecs

    special = getattr(tokenizer, "_lpp_added", None)
    if special is None:  # the added tokens (<s>, <|im_start|>, ...) are plain text, not byte runs
        special = {int(i): t for t, i in tokenizer.get_added_vocab().items()}
        tokenizer._lpp_added = special
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    out, carry = [], ""  # carry: text of tokens that ended inside a character, shown with the one completing it
    for i in ids:
        t = special.get(i) or rust.id_to_token(i)
        if t is None:
            return None
        try:
            raw = bytes(_BYTE_OF[c] for c in t) if i not in special else t.encode("utf-8")
        except KeyError:
            raw = t.encode("utf-8")
        carry += dec.decode(raw)
        if dec.getstate()[0]:  # bytes of an unfinished character wait in the decoder
            out.append("")
        else:
            out.append(carry)
            carry = ""
    rest = carry + dec.decode(b"", final=True)
    if rest:
        out[-1] += rest
    return out


def exact_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """`decode_pieces` by decoding every prefix (quadratic): the definition the fast one must meet."""
    pieces, prev = [], ""
    for n in range(1, len(ids) + 1):
        cur = raw_decode(tokenizer, ids[:n])
        if cur.startswith(prev) and not cur.endswith("\ufffd"):
            pieces.append(cur[len(prev) :])
            prev = cur
        else:  # an incomplete multi-byte character: show it once it completes
            pieces.append("")
    whole = raw_decode(tokenizer, ids)
    if prev != whole:
        pieces[-1] += whole[len(prev) :]
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


def decode_tail_pieces(tokenizer: Any, ids: list[int], start: int) -> list[str]:
    """The pieces of ids[start:] (a completion after its prompt): `decode_pieces` is linear, so a long
    rollout does not decode every prefix, and a character split across the prompt's end is shown
    on the completion token that completes it, as in the whole text's pieces."""
    return decode_pieces(tokenizer, ids)[start:]
