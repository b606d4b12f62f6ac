"""Where the exact KL's own cost goes on a GPU, without the engines: the transport of vLLM's rows.

    python benchmarks/kl_transport.py [--sequences 64] [--tokens 512] [--vocab 49152] [--repeats 3] [--out FILE]

`benchmarks/compare_speed.py` times a compare with the exact KL against one without it; this script
splits the difference that is not the engines' forward passes. Two processes stand in for the vLLM
host and the HF host and run logprob_parity.engines.fullvocab's own functions on random float32 rows of the
compare benchmark's shape (64 x 511 rows of 49,152 by default):
  - keep: each sequence's rows written where vLLM's capture writes them (`_rows_into`), then `keep`;
  - share: `share` (CUDA IPC handles) and the pipe to the other process;
  - open: `open_rows` in the other process (it maps each shared allocation);
  - sum: `kl_rows` over the rows in blocks of the HF engine's size (1 GiB of float32), as HF does;
  - release: `release` (the producer frees the rows and gives the memory back).
Each for the two ways of keeping rows: one tensor a sequence (the layout before this script), and
views of one tensor a batch (`_arena`, the layout now). The KL values of the two must be equal.

Then, in this process, the sum itself: `kl_rows` (float64 throughout, both rows normalised again)
against `fewer_passes`, the same sum with the normalisation taken out of the [rows, vocab] arrays
(KL = Σ p_HF (l_HF − l_vLLM) − (lse_HF − lse_vLLM), p_HF normalised), on one block, with the
largest difference between the two.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BLOCK_BYTES = 1 << 30  # logprob_parity.engines.backends.hf.HFEngine.CUDA_BLOCK_BYTES


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def producer(conn, n: int, length: int, vocab: int, repeats: int, device: str) -> None:
    import torch

    from logprob_parity.engines import fullvocab

    gen = torch.Generator(device=device).manual_seed(0)
    rows = [torch.log_softmax(torch.randn(length - 1, vocab, device=device, generator=gen), dim=-1) for _ in range(2)]
    seqs = [[i, *range(1, length)] for i in range(n)]  # distinct ids: one request each
    for layout in ("a tensor a sequence", "views of one tensor a batch"):
        for r in range(repeats):
            token = f"{layout[:5]}-{r}"
            _sync(torch)
            t = time.perf_counter()
            fullvocab.begin({"tensors": token, "rows": n * (length - 1) if layout.startswith("views") else None})
            for i, s in enumerate(seqs):
                fullvocab._STATE["files"][f"req-{i}"] = (tuple(s), None, None)
                fullvocab._store_rows(f"req-{i}", rows[i % 2], 0, vocab, rows[0])
            fullvocab.keep(token, seqs)
            _sync(torch)
            t_keep = time.perf_counter() - t
            t = time.perf_counter()
            shared = fullvocab.share(token)
            conn.send((layout, shared))
            got = conn.recv()  # the consumer's timings, once it has summed
            t_share_and_after = time.perf_counter() - t
            t = time.perf_counter()
            fullvocab.release(token)
            _sync(torch)
            t_release = time.perf_counter() - t
            conn.send({"keep": t_keep, "release": t_release, "round trip": t_share_and_after, **got})
    conn.send(None)


def consumer(conn, n: int, length: int, vocab: int, device: str) -> None:
    import torch

    from logprob_parity.engines import fullvocab
    from logprob_parity.engines.backends.hf import _rows_of

    gen = torch.Generator(device=device).manual_seed(1)
    lh = torch.log_softmax(torch.randn(length - 1, vocab, device=device, generator=gen), dim=-1)
    block = max(256, BLOCK_BYTES // (4 * vocab))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        _layout, shared = msg
        _sync(torch)
        t = time.perf_counter()
        opened = fullvocab.open_rows(shared)
        _sync(torch)
        t_open = time.perf_counter() - t
        t = time.perf_counter()
        total = n * (length - 1)
        hf_rows = lh.repeat(n, 1) if total * vocab * 4 <= 8 * BLOCK_BYTES else None
        kl = []
        for lo in range(0, total, block):
            hi = min(lo + block, total)
            ref = _rows_of(opened, lo, hi)
            mine = hf_rows[lo:hi] if hf_rows is not None else lh[: hi - lo]
            kl.append(fullvocab.kl_rows(mine, ref))
        kl_all = torch.cat(kl).cpu()
        _sync(torch)
        t_sum = time.perf_counter() - t
        del opened, ref
        conn.send({"open": t_open, "sum": t_sum, "kl_mean": float(kl_all.mean()), "kl_first": kl_all[:4].tolist()})


def fewer_passes(lh, ref):
    """kl_rows' value with fewer passes over [rows, vocab]: the candidate this script measures."""
    import torch

    a, b = lh.double(), ref.double()
    la, lb = torch.logsumexp(a, dim=-1, keepdim=True), torch.logsumexp(b, dim=-1, keepdim=True)
    p = (a - la).exp_()
    return p.mul_(a.sub_(b)).sum(dim=-1) - (la - lb)[:, 0]


def math_ab(vocab: int, device: str, repeats: int) -> list[str]:
    import torch

    from logprob_parity.engines import fullvocab

    rows = max(256, BLOCK_BYTES // (4 * vocab)) if device == "cuda" else 256
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(rows, vocab, device=device, generator=gen) * 3
    lh = torch.log_softmax(x, dim=-1)
    lv = torch.log_softmax(x + 0.05 * torch.randn(rows, vocab, device=device, generator=gen), dim=-1)
    out = {}
    for name, fn in (("kl_rows (now)", fullvocab.kl_rows), ("fewer_passes", fewer_passes)):
        fn(lh, lv)
        ts = []
        for _ in range(repeats + 2):
            _sync(torch)
            t = time.perf_counter()
            v = fn(lh, lv)
            _sync(torch)
            ts.append(time.perf_counter() - t)
        out[name] = (statistics.median(ts), v)
    diff = float((out["kl_rows (now)"][1] - out["fewer_passes"][1]).abs().max())
    mean = float(out["kl_rows (now)"][1].mean())
    return [
        "",
        f"One block of {rows:,} rows x {vocab:,}: "
        + "; ".join(f"{k} {t * 1000:.1f} ms" for k, (t, _) in out.items())
        + f"; largest difference {diff:.2e} (KL mean {mean:.4e})",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch
    import torch.multiprocessing as mp

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    other, mine = ctx.Pipe()
    p = ctx.Process(target=producer, args=(there, a.sequences, a.tokens, a.vocab, a.repeats, device))
    c = ctx.Process(target=consumer, args=(mine, a.sequences, a.tokens, a.vocab, device))
    p.start()
    c.start()
    results: dict[str, list[dict]] = {}
    while True:
        msg = here.recv()
        if msg is None:
            break
        layout, shared = msg
        other.send((layout, shared))
        got = other.recv()
        here.send(got)
        results.setdefault(layout, []).append(here.recv())
    other.send(None)
    p.join()
    c.join()
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    gib = a.sequences * (a.tokens - 1) * a.vocab * 4 / 2**30
    lines = [
        f"# The exact KL's transport, without the engines ({name}, torch {torch.__version__})",
        "",
        f"`python benchmarks/kl_transport.py {' '.join(sys.argv[1:])}`: {a.sequences} sequences x {a.tokens - 1} rows x "
        f"{a.vocab:,} float32 ({gib:.1f} GiB), median of {a.repeats} (the first repeat included)",
        "",
        "| layout | keep | share + pipe + open + sum (round trip) | of it: open | of it: sum | release | KL mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("keep", "round trip", "open", "sum", "release")}
        lines.append(
            f"| {layout} | {med['keep']:.3f} s | {med['round trip']:.3f} s | {med['open']:.3f} s | {med['sum']:.3f} s | "
            f"{med['release']:.3f} s | {rs[-1]['kl_mean']:.6e} |"
        )
    firsts = [rs[-1]["kl_first"] for rs in results.values()]
    lines += ["", f"The two layouts give the same KL values: {'yes' if all(f == firsts[0] for f in firsts) else 'NO'}"]
    lines += math_ab(a.vocab, device, a.repeats)
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
