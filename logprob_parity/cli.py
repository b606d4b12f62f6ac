"""The `logprob-parity` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from logprob_parity.errors import EngineError, UserError
from logprob_parity.inputs.settings import SETTINGS, EngineSettings, Setting, settings_class
from logprob_parity.inputs.spec import BOS_POLICIES, DEVICES, RunSpec

SUMMARY_ROWS = (
    ("n_tokens", "d"),
    ("max_abs_delta", "e"),
    ("mean_abs_delta", "e"),
    ("p50_abs_delta", "e"),
    ("p95_abs_delta", "e"),
    ("p99_abs_delta", "e"),
    ("mean_delta", "e"),
    ("max_prob_delta", "e"),
    ("mean_prob_delta", "e"),
    ("argmax_agreement", "f"),
    ("mean_kl_topk", "e"),
    ("pearson_prob", "f"),
    ("seq_logprob_delta", "e"),
    ("frac_ratio_outside_0.9_1.1", "f"),
    ("kl_full_mean", "e"),
    ("kl_full_p99", "e"),
    ("kl_full_max", "e"),
    ("same_top_p", "f"),
    ("dp_rms", "e"),
    ("ppl_ratio", "f"),
    ("hf_noise_mean", "e"),
    ("hf_noise_tail", "e"),
    ("vllm_noise_mean", "e"),
    ("noise_ratio", "f"),
    ("tokens_beyond_frac", "f"),
    ("tokens_above_noise_frac", "f"),
)
ROUTING_ROWS = (("routing_flip_frac", "f"), ("routing_tokens_flipped", "f"), ("routing_layers_flipped_mean", "f"))


def _fmt(value: Any, kind: str) -> str:
    """Display only: stored and JSON values keep full precision."""
    if value is None:
        return "-"
    if kind == "d":
        return str(int(value))
    if kind == "f":
        return f"{value:.4f}"
    return f"{value:.3e}"


def summary_table(runs: list[Any]) -> str:
    head = ["metric"] + [r.dtype for r in runs]
    moe = any(r.summary.get("routing_flip_frac") is not None for r in runs)  # an MoE model: its routing rows
    shown = SUMMARY_ROWS + (ROUTING_ROWS if moe else ())
    rows = [head] + [[k] + [_fmt(r.summary.get(k), kind) for r in runs] for k, kind in shown]
    if not moe and any((r.meta.routing or {}).get("why") for r in runs if hasattr(r, "meta")):
        rows.append(["routing"] + [(r.meta.routing or {}).get("why") or "-" for r in runs])
    rows.append(["run_id"] + [r.run_id for r in runs])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _settings(args: argparse.Namespace, registry: tuple[Setting, ...] = SETTINGS) -> Any:
    """EngineSettings from the flags that `add_setting_flags` made from the same registry."""
    cls = EngineSettings if registry is SETTINGS else settings_class(registry)
    return cls(**{s.name: getattr(args, s.name, s.default) for s in registry})


def add_setting_flags(
    parser: argparse.ArgumentParser,
    registry: tuple[Setting, ...] = SETTINGS,
    skip: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """One flag per registered engine setting: booleans as --name/--no-name, numbers and strings typed.
    skip: settings a command's own flags replace (a rollout's --seed is the sampling seed)."""
    group = parser.add_argument_group("engine settings (recorded in the run id)")
    for s in registry:
        if s.name in skip:
            continue
        where = {"vllm": "vLLM", "hf": "HF", "both": "both engines"}[s.backend]
        own = (defaults or {}).get(s.name, s.default)
        default = (defaults or {}).get(f"{s.name}_words") or ("engine default" if own is None else own)
        help_text = f"{s.help} [{where}; default: {default}]".replace("%", "%%")
        if s.kind is bool:
            group.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=own, help=help_text)
        else:
            ranged = s.kind in (int, float) and (s.minimum is not None or s.maximum is not None)
            kind = number(s.kind, s.minimum, s.maximum) if ranged else s.kind
            group.add_argument(s.flag, dest=s.name, type=kind, default=own, choices=s.choices, help=help_text)


def _spec_from_args(args: argparse.Namespace, rollout: bool = False) -> RunSpec:
    from logprob_parity.inputs.prompts import read_prompt_file

    if (args.prompt is None) == (args.prompts is None):
        raise UserError("give exactly one of --prompt TEXT or --prompts FILE")
    if args.prompts is not None:
        pset = read_prompt_file(args.prompts)
        for line in pset.skipped:
            print(f"warning: {args.prompts}: skipped {line}", file=sys.stderr)
        texts = pset.texts
    else:
        texts = (args.prompt,)
    dtypes = tuple(d.strip() for d in args.dtype.split(",") if d.strip())
    backends = tuple(b.strip() for b in getattr(args, "backends", "hf,vllm").split(",") if b.strip())
    spec = RunSpec(
        texts=tuple(texts),
        model=args.model,
        revision=args.revision,
        dtypes=dtypes,
        backends=backends,
        top_k=args.top_k if hasattr(args, "backends") else 5,  # rollout's --top-k is a sampling setting
        device=args.device,
        bos=args.bos,
        settings=_settings(args),
        truncate=args.truncate,
        noise_floor=not getattr(args, "no_noise_floor", False),
        null=bool(getattr(args, "null", False)),
    )
    if rollout:
        from logprob_parity.analysis.rollout import with_rollout_defaults

        spec = with_rollout_defaults(spec)
    spec.validate()
    return spec


class Reporter(NamedTuple):
    """What a long command reports through: words (on_event), tokens done (on_progress) and the
    numbers behind them (on_status: rate, time left, Ray workers alive)."""

    on_event: Any
    on_progress: Any
    on_status: Any

    def context(self, args: argparse.Namespace) -> Any:
        """A Context reporting here, on a Ray cluster when --ray asks for one."""
        from logprob_parity.analysis.request import Context

        return Context.of(on_event=self.on_event, on_progress=self.on_progress, on_status=self.on_status, ray=_ray_options(args))


def _ray_options(args: argparse.Namespace) -> Any:
    if getattr(args, "ray", None) is None:
        for flag in ("ray_workers", "ray_gpus_per_worker"):
            if getattr(args, flag, None) is not None:
                raise UserError(f"--{flag.replace('_', '-')} needs --ray")
        return None
    from logprob_parity.analysis.cluster import RayOptions

    if args.ray_workers is not None and args.ray_workers < 1:
        raise UserError("--ray-workers must be 1 or more")
    if args.ray_gpus_per_worker is not None and not 0 < args.ray_gpus_per_worker <= 8:
        raise UserError("--ray-gpus-per-worker must be above 0 (a fraction shares a card), at most 8")
    return RayOptions(address=args.ray, gpus_per_worker=args.ray_gpus_per_worker, workers=args.ray_workers)


@contextlib.contextmanager
def progress(args: argparse.Namespace, desc: str, steps: int | None, n_dtypes: int = 1) -> Iterator[Reporter]:
    """A Reporter for a long command, with a tqdm bar where a person watches a terminal: tokens scored
    over every dtype where the work reports them (its rate and time left are tokens/s and the rest;
    on a Ray cluster the workers alive too), else its steps. Each event is also a line on stderr, the
    only output when piped (CI, logs); --quiet silences both. --events FILE writes every event and
    every progress report as a JSON line, for a machine to follow."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    bar = tqdm(total=steps, desc=desc, unit="step", file=sys.stderr, smoothing=0.1, disable=args.quiet or not sys.stderr.isatty())
    done: dict[str, int] = {}
    by_tokens = False
    events = open(args.events, "a", encoding="utf-8") if getattr(args, "events", None) else None  # noqa: SIM115 - closed below

    def log(record: dict[str, Any]) -> None:
        if events is not None:
            events.write(json.dumps({"t": round(time.perf_counter() - t0, 3), "command": desc, **record}) + "\n")
            events.flush()

    def on_event(stage: str, dtype: str | None, detail: str) -> None:
        log({"event": stage, "dtype": dtype, "detail": detail})
        if args.quiet:
            return
        bar.set_description(f"{stage}{f' [{dtype}]' if dtype else ''}")
        bar.write(f"[{time.perf_counter() - t0:7.1f}s] {stage}{f' [{dtype}]' if dtype else ''}: {detail}", file=sys.stderr)
        if not by_tokens and (bar.total is None or bar.n < bar.total):
            bar.update(1)

    def on_progress(dtype: str | None, n: int, total: int) -> None:
        nonlocal by_tokens
        if not by_tokens:  # the work reports tokens: count those instead of steps
            by_tokens = True
            bar.reset(total=total * n_dtypes)
            bar.unit, bar.unit_scale = "tok", True
        done[dtype or ""] = n
        bar.update(sum(done.values()) - bar.n)

    def on_status(dtype: str | None, numbers: dict[str, Any]) -> None:
        log({"event": "progress", "dtype": dtype, **numbers})
        if "workers" in numbers:
            bar.set_postfix_str(f"{numbers['workers_alive']}/{numbers['workers']} Ray workers alive", refresh=True)

    try:
        yield Reporter(on_event, on_progress, on_status)
    finally:
        bar.close()
        if events is not None:
            events.close()


def cmd_compare(args: argparse.Namespace) -> int:
    from logprob_parity.analysis.compare import compare

    spec = _spec_from_args(args)
    t0 = time.perf_counter()
    with progress(args, "compare", 2 + 6 * len(spec.dtypes), len(spec.dtypes)) as rep:
        runs = compare(spec, rep.context(args), use_cache=not args.no_cache)
    from logprob_parity.analysis.verdict import run_verdicts
    from logprob_parity.results.store import Store

    for v in run_verdicts(runs, Store().diagnostics_for_run(runs[0].run_id)):
        print(f"[{v.title.upper()}] {v.headline}")
        print("\n".join(f"  - {r}" for r in v.reasons))
    print(summary_table(runs))
    for r in runs:
        src = "from the store (no engine started)" if r.from_store else "computed"
        print(f"{r.dtype}: run {r.run_id} {src}")
    print(f"elapsed {time.perf_counter() - t0:.2f} s")
    if args.json:
        write_json(args.json, runs)
        print(f"wrote {args.json}")
    if args.check:
        return _run_check(args, runs)
    return 0


def number(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False, also: tuple = ()) -> Any:
    """An argparse type that reads `kind` and refuses a value out of range in words (exit 2, before
    any engine starts): at least `low` (more than it with `above`), at most `high`, or one of `also`."""

    def read(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if v in also:
            return v
        if isinstance(v, float) and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        bad = (low is not None and (v <= low if above else v < low)) or (high is not None and v > high)
        if bad:
            lo = "" if low is None else (f"more than {low:g}" if above else f"at least {low:g}")
            hi = "" if high is None else f"at most {high:g}"
            either = " or ".join(f"{a:g}" for a in also)
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: it must be {' and '.join(x for x in (lo, hi) if x)}"
                + (f" (or {either})" if either else "")
            )
        return v

    read.__name__ = kind.__name__  # argparse names the type in its messages
    return read


NONNEG = number(float, 0)
SHARE = number(float, 0, 1)
COUNT = number(int, 1)


def add_check_flags(c: argparse.ArgumentParser) -> None:
    """The parity gate's bounds (logprob_parity.analysis.check), for `check` and `compare --check`."""
    g = c.add_argument_group("parity gate (exit 1 when a bound fails)")
    g.add_argument("--max-mean-abs-delta", type=NONNEG, default=None, help="largest mean |Δ logp| allowed")
    g.add_argument("--max-abs-delta", type=NONNEG, default=None, help="largest |Δ logp| of any token allowed")
    g.add_argument("--max-kl-mean", type=NONNEG, default=None, help="largest mean exact KL allowed")
    g.add_argument("--min-argmax-agreement", type=SHARE, default=None, help="least share of positions whose top token agrees")
    g.add_argument(
        "--max-routing-flip-frac",
        type=SHARE,
        default=None,
        help="an MoE model: largest share of (token, layer) routers whose experts differ between vLLM and HF",
    )
    g.add_argument(
        "--baseline", default=None, metavar="RUN_ID", help="an earlier run of the same model and texts to hold these to"
    )
    g.add_argument(
        "--max-worsening",
        type=number(float, 0, above=True),
        default=1.5,
        help="how many times the baseline's gap a run may have (default 1.5)",
    )
    g.add_argument("--junit", default=None, metavar="FILE", help="write JUnit XML (one test case a bound)")
    g.add_argument("--markdown", default=None, metavar="FILE", help="write a Markdown summary a CI can post")


def _run_check(args: argparse.Namespace, runs: list[Any]) -> int:
    from logprob_parity.analysis.check import Bounds, check
    from logprob_parity.paths import write_text_atomic
    from logprob_parity.present.check_view import junit_xml, markdown
    from logprob_parity.results.store import Store

    bounds = Bounds(
        args.max_mean_abs_delta,
        args.max_abs_delta,
        args.max_kl_mean,
        args.min_argmax_agreement,
        max_routing_flip_frac=args.max_routing_flip_frac,
        max_worsening=args.max_worsening,
    )
    baseline = Store().load(args.baseline) if args.baseline else None
    result = check(runs, bounds, baseline)
    print("\n".join(result.lines()))
    if args.junit:
        write_text_atomic(args.junit, junit_xml(result))
        print(f"wrote {args.junit}")
    if args.markdown:
        write_text_atomic(args.markdown, markdown(result))
        print(f"wrote {args.markdown}")
    print("parity holds" if result.passed else "parity check FAILED")
    return result.exit_code


def cmd_check(args: argparse.Namespace) -> int:
    from logprob_parity.results.store import Store

    store = Store()
    return _run_check(args, [store.load(r) for r in args.run_ids])


def cmd_diff(args: argparse.Namespace) -> int:
    from logprob_parity.analysis.diff import diff_runs, diff_text
    from logprob_parity.results.store import Store

    store = Store()
    d = diff_runs(store.load(args.a), store.load(args.b), store=store)
    print(diff_text(d))
    if args.json:
        from logprob_parity.paths import write_text_atomic

        write_text_atomic(args.json, json.dumps(d.to_dict(), indent=1, allow_nan=False))
        print(f"wrote {args.json}")
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from logprob_parity.analysis.diagnostics import PARTS, diagnose
    from logprob_parity.present.diagnostics_view import diagnostics_text

    spec = _spec_from_args(args)
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip()) if args.parts != "all" else PARTS
    if args.parquet and "layers" not in parts:  # said before any engine starts
        raise UserError("--parquet writes the layer part's table: add layers to --parts")
    with progress(args, "diagnose", (3 + 4 * len(parts)) * len(spec.dtypes)) as rep:
        result = diagnose(
            spec,
            parts=parts,
            gen_tokens=args.gen_tokens,
            slow_knobs=args.slow_knobs,
            layer_text=args.layer_text - 1,
            on_event=rep.on_event,
        )
    print(diagnostics_text(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1, allow_nan=False))
        print(f"wrote {args.json}")
    if args.parquet:
        frame = result.layers_frame()
        frame.to_parquet(args.parquet, index=False)
        print(f"wrote {args.parquet} ({len(frame):,} rows: dtype, layer, block, token)")
    return 0


ROLLOUT_ROWS = (
    ("n_tokens", "d"),
    ("mean_abs_delta", "e"),
    ("max_abs_delta", "e"),
    ("p99_abs_delta", "e"),
    ("mean_delta", "e"),
    ("kl", "e"),
    ("k2_kl", "e"),
    ("k3_kl", "e"),
    ("chi2_token", "e"),
    ("chi2_seq", "e"),
    ("rollout_is_mean", "f"),
    ("rollout_is_min", "f"),
    ("rollout_is_max", "f"),
    ("rollout_is_eff_sample_size", "f"),
    ("frac_ratio_outside_0.8_1.25", "f"),
    ("frac_ratio_outside_0.5_2", "f"),
    ("seq_log_ratio_mean", "e"),
    ("seq_log_ratio_min", "e"),
    ("seq_log_ratio_max", "e"),
    ("ppl_ratio", "f"),
    ("token_mult_prob_error", "f"),
    ("tis_clip_fraction", "f"),
    ("mis_mask_fraction", "f"),
)


def rollout_text(ro: Any) -> str:
    """A rollout in words and tables: verdict (an MoE model's routing among its reasons), the three-way
    metrics, the noise floors."""
    from logprob_parity.results.rollout import PAIRS

    m = ro.meta
    v = m.verdict
    lines = [f"[{v.get('level', '').upper()}] {v.get('headline', '')}"] + [f"  - {r}" for r in v.get("reasons", ())]
    pairs = [p for p in PAIRS if p != "processed_vs_trainer" or m.processed.startswith("vLLM's own")]
    head = ["metric"] + pairs
    rows = [head] + [[k] + [_fmt(m.summary[p].get(k), kind) for p in pairs] for k, kind in ROLLOUT_ROWS]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    lines += [
        "",
        f"{m.dtype}: rollout {m.rollout_id} ({'from the store' if ro.from_store else 'computed'}); "
        f"{len(ro.samples)} samples; decode_processed: {m.processed}",
        *table,
        "",
        "noise floors (|Δ logp| when only this changes):",
    ]
    for name, f in m.floors.items():
        extra = f", same tokens {f['same_tokens']}/{f['of']}" if "same_tokens" in f else ""
        lines.append(
            f"  {name:15s} mean {_fmt(f.get('mean'), 'e')}  max {_fmt(f.get('max'), 'e')}  n {f.get('n')}{extra}  ({f['what']})"
        )
    return "\n".join(lines)


def _print_rollouts(args: argparse.Namespace, ros: list[Any], t0: float) -> int:
    """Rollouts (sampled or rescored) in words and tables, and their --json."""
    for ro in ros:
        print(rollout_text(ro))
        print()
    print(f"elapsed {time.perf_counter() - t0:.2f} s")
    if args.json:
        write_json(args.json, list(ros))
        print(f"wrote {args.json}")
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    from logprob_parity.analysis.rollout import STEPS_PER_DTYPE, rollout
    from logprob_parity.results.rollout import Sampling

    spec = _spec_from_args(args, rollout=True)
    sampling = Sampling(
        samples=args.samples,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    sampling.validate()
    t0 = time.perf_counter()
    with progress(args, "rollout", 2 + STEPS_PER_DTYPE * len(spec.dtypes), len(spec.dtypes)) as rep:
        ctx = rep.context(args)
        ros = rollout(spec, sampling, ctx, use_cache=not args.no_cache, noise_samples=args.noise_samples)
    return _print_rollouts(args, ros, t0)


def cmd_rescore(args: argparse.Namespace) -> int:
    from logprob_parity.analysis.rescore import rescore
    from logprob_parity.inputs.rollout_logs import parse_mapping

    path = Path(args.rollouts)
    if path.is_dir():
        raise UserError(f"{str(path)!r} is a folder: give a rollouts file in it (.jsonl or .parquet)")
    if not path.is_file():
        raise UserError(f"rollouts file {str(path)!r} does not exist")
    args.prompt, args.prompts = "logged rollouts", None  # the prompts come from the file
    spec = _spec_from_args(args)
    t0 = time.perf_counter()
    with progress(args, "rescore", 2 + 5 * len(spec.dtypes), len(spec.dtypes)) as rep:
        ctx = rep.context(args)
        ros = rescore(path, path.name, spec, ctx, mapping=parse_mapping(args.map), use_cache=not args.no_cache)
    return _print_rollouts(args, ros, t0)


def cmd_frontier(args: argparse.Namespace) -> int:
    from logprob_parity.analysis.frontier import default_grid, frontier, frontier_text, parse_configs
    from logprob_parity.env import resolve_device

    args.dtype = "float32"  # each configuration names its own dtype
    spec = _spec_from_args(args)
    configs = parse_configs(args.configs) if args.configs else default_grid(resolve_device(args.device))
    t0 = time.perf_counter()
    load = None
    if args.speed_load:
        try:
            n, length = (int(x) for x in args.speed_load.lower().split("x"))
        except ValueError:
            raise UserError(f"--speed-load takes SEQUENCESxTOKENS, e.g. 64x512 (got {args.speed_load!r})") from None
        if n < 1 or length < 8:
            raise UserError("--speed-load needs at least 1 sequence of at least 8 tokens")
        load = (n, length)
    if args.repeats < 3:
        raise UserError("--repeats must be at least 3: a speed needs a spread that means something")
    with progress(args, "frontier", 2 + len(configs)) as rep:
        ctx = rep.context(args)
        result = frontier(spec, configs, ctx, tolerance=args.tolerance, speed_load=load, repeats=args.repeats)
    print(frontier_text(result))
    print(f"elapsed {time.perf_counter() - t0:.2f} s")
    if args.json:
        from logprob_parity.paths import write_text_atomic

        write_text_atomic(args.json, json.dumps(result.to_dict(), indent=1, allow_nan=False))
        print(f"wrote {args.json}")
    return 0


def write_json(path: str | os.PathLike, runs: list[Any]) -> None:
    """One object per run: a single object for one run, a list for several. Comparison runs and
    rollouts are written a sequence or sample at a time (their write_json), so a large prompt set's
    or rescore's JSON never sits whole in memory; the file is renamed into place when complete."""
    from logprob_parity.analysis.verdict import with_verdict

    runs = [with_verdict(r) for r in runs]
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            if len(runs) > 1:
                f.write("[\n")
            for i, r in enumerate(runs):
                if i:
                    f.write(",\n")
                if hasattr(r, "write_json"):  # runs and rollouts: a sequence or sample at a time
                    r.write_json(f)
                else:
                    f.write(json.dumps(r.to_json_dict(), indent=1, allow_nan=False))
            if len(runs) > 1:
                f.write("\n]")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cmd_runs(args: argparse.Namespace) -> int:
    from logprob_parity.results.store import Store

    store = Store()
    df = store.list_runs()
    if df.empty:
        print("no stored runs")
    else:
        from logprob_parity.present.labels import settings_words

        df["created"] = df["created"].dt.strftime("%Y-%m-%d %H:%M")
        df["settings"] = df["settings"].map(settings_words)  # those that differ from the defaults, as on the Runs page
        print(df.to_string(index=False, formatters={"max_abs_delta": "{:.3e}".format, "mean_abs_delta": "{:.3e}".format}))
    ros = store.list_rollouts()
    if not ros.empty:
        ros["created"] = ros["created"].dt.strftime("%Y-%m-%d %H:%M")
        print("\nrollouts (gap: vLLM decode vs HF):")
        print(ros.to_string(index=False, formatters={"max_abs_delta": "{:.3e}".format, "mean_abs_delta": "{:.3e}".format}))
    diags = store.list_diagnostics()
    if not diags.empty:
        diags["created"] = diags["created"].dt.strftime("%Y-%m-%d %H:%M")
        print("\ndiagnostics:")
        print(diags.drop(columns=["run_ids"]).to_string(index=False))
    frs = store.list_frontiers()
    if not frs.empty:
        frs["created"] = frs["created"].dt.strftime("%Y-%m-%d %H:%M")
        frs["recommendation"] = frs["recommendation"].fillna("none within the tolerance")
        print("\nfrontiers:")
        print(frs.to_string(index=False))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from logprob_parity.results.store import Store

    store = Store()
    if store.is_frontier(args.run_id):
        from logprob_parity.analysis.frontier import frontier_text

        result = store.load_frontier(store.resolve_frontier_id(args.run_id))
        print(json.dumps(result.to_dict(), indent=1, allow_nan=False) if args.json else frontier_text(result))
        return 0
    if store.is_rollout(args.run_id):
        ro = store.load_rollout(args.run_id)
        print(json.dumps(ro.to_json_dict(), indent=1, allow_nan=False) if args.json else rollout_text(ro))
        return 0
    run = store.load(args.run_id)
    if args.json:
        from logprob_parity.analysis.verdict import with_verdict

        print(json.dumps(with_verdict(run).to_json_dict(), indent=1, allow_nan=False))
        return 0
    m = run.meta
    print(f"run {run.run_id}  model {m.model}  dtype {m.dtype}  device {m.env.device}")
    print(f"torch {m.env.torch}  transformers {m.env.transformers}  vllm {m.env.vllm}  created {m.created}")
    from logprob_parity.analysis.verdict import run_verdicts

    (v,) = run_verdicts([run], store.diagnostics_for_run(run.run_id))  # the pages' verdict, the same words
    print(f"[{v.title.upper()}] {v.headline}")
    print("\n".join(f"  - {r}" for r in v.reasons))
    print(summary_table([run]))
    df = run.to_frame()
    # the token as the pages show it (its decoded piece: "の", " capital"), not the tokenizer's byte-level form;
    # its band, the colour the pages give it (noise, tolerance, beyond)
    from logprob_parity.present.labels import token_shown

    worst = df[df["scored"]].nlargest(10, "abs_delta")[
        ["seq", "index", "token_id", "piece", "token", "hf_logprob", "vllm_logprob", "delta", "band"]
    ]
    shown = [token_shown(p, t) for p, t in zip(worst["piece"], worst["token"])]  # a partial character: its bytes
    worst = worst.drop(columns=["token"]).assign(seq=worst["seq"] + 1, piece=shown)
    worst = worst.rename(columns={"seq": "prompt", "index": "position", "piece": "token"})
    print("\nworst tokens:")
    print(worst.to_string(index=False))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from logprob_parity.results.store import Store

    store = Store()
    out = Path(args.output)
    if store.is_frontier(args.run_id):
        from logprob_parity.present.frontier_view import write_frontier_report

        write_frontier_report(store.load_frontier(store.resolve_frontier_id(args.run_id)), out)
        print(f"wrote {out}")
        return 0
    if store.is_rollout(args.run_id):
        from logprob_parity.present.rollout_view import write_rollout_report

        write_rollout_report(store.load_rollout(args.run_id), out)
        print(f"wrote {out}")
        return 0
    run = store.load(args.run_id)
    if out.suffix.lower() == ".json":
        write_json(out, [run])
    elif out.suffix.lower() in (".html", ".htm"):
        from logprob_parity.present.report import write_html_report

        write_html_report(run, out, store.diagnostics_for_run(run.run_id))
    else:
        raise UserError(f"report output must end in .html or .json (got {out.name})")
    print(f"wrote {out}")
    return 0


def cmd_demo_model(args: argparse.Namespace) -> int:
    from logprob_parity.inputs.demo import build_demo_model

    path = build_demo_model(args.out_dir, force=args.force)
    print(path)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Become the Streamlit server process (exec, not a child: logprob_parity.dashboard.serve runs Streamlit in
    process): SIGTERM and SIGINT reach Streamlit itself, whose shutdown stops every engine host
    (logprob_parity.engines.pool), so nothing outlives the command. The default engines start warming at once
    unless --no-prewarm (or LPP_PREWARM=0)."""
    root = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable,
        "-m",
        "logprob_parity.dashboard.serve",
        "--server.address",
        args.address,
        "--server.port",
        str(args.port),
    ]
    if args.headless:
        cmd += ["--server.headless", "true"]
    if args.no_prewarm:
        os.environ["LPP_PREWARM"] = "0"
    os.chdir(root)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)  # noqa: S606 - becomes this interpreter running our own module
    return 0  # not reached


def _add_spec_args(
    c: argparse.ArgumentParser, registry: tuple[Setting, ...] = SETTINGS, rollout: bool = False, texts: bool = True
) -> None:
    """The flags every analysis shares; a rollout's --top-k is its sampling cut, not a top-k list."""
    c.add_argument("--model", default=None, help="hub id or local folder (default: the embedded demo model)")
    c.add_argument("--revision", default=None)
    c.add_argument("--dtype", default="float32", help="float16, bfloat16, float32, comma-separated")
    if texts:
        c.add_argument("--prompt", default=None)
        c.add_argument("--prompts", default=None, help=".txt (a prompt a line), .jsonl ({'text': ...}) or .csv (text column)")
    if not rollout and texts:
        c.add_argument("--backends", default="hf,vllm")
        c.add_argument("--top-k", type=int, default=5)  # RunSpec says what is wrong with it, in its words
    c.add_argument("--device", choices=DEVICES, default="auto")
    c.add_argument("--bos", choices=BOS_POLICIES, default="auto")
    c.add_argument("--json", default=None, metavar="OUT")
    c.add_argument("--no-cache", action="store_true", help="recompute even if the store has this run")
    c.add_argument("--truncate", action="store_true", help="keep the first positions of prompts longer than the model allows")
    c.add_argument("--quiet", action="store_true", help="no progress output")
    c.add_argument("--events", default=None, metavar="FILE", help="append every progress event to FILE, a JSON object a line")
    if rollout:  # a rollout engine decodes with CUDA graphs unless told otherwise (logprob_parity.analysis.rollout)
        add_setting_flags(
            c,
            registry,
            skip=("seed",),
            defaults={"enforce_eager": None, "enforce_eager_words": "off on a GPU (CUDA graphs), on on a CPU"},
        )
    else:
        add_setting_flags(c, registry)


def version_line() -> str:
    """`--version`: ours, then the engines' libraries as installed (read from package metadata, so
    nothing heavy is imported)."""
    from logprob_parity import __version__
    from logprob_parity.env import versions

    found = versions()
    libs = [
        f"{dist} {found[key]}"
        for key, dist in (("vllm", found.get("vllm_dist") or "vllm"), ("transformers", "transformers"), ("torch", "torch"))
        if found.get(key)
    ]
    return f"logprob-parity {__version__}" + (
        f" ({', '.join(libs)})" if libs else " (vLLM, transformers and torch not installed)"
    )


def _add_ray_args(c: argparse.ArgumentParser) -> None:
    """Past one machine: the batches (of texts, prompts or logged sequences) on a Ray cluster's workers
    (logprob_parity.analysis.cluster)."""
    g = c.add_argument_group("on a Ray cluster (pip install 'logprob-parity[ray]')")
    g.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="score the batches on Ray workers, each with its own warm engines: no ADDRESS starts Ray here, "
        "'auto' joins the cluster running here (ray start --head), host:port joins that one",
    )
    g.add_argument(
        "--ray-workers",
        type=COUNT,
        default=None,
        metavar="N",
        help="workers to start (default: one a GPU, or one a node on CPUs)",
    )
    g.add_argument(
        "--ray-gpus-per-worker",
        type=number(float, 0, above=True),
        default=None,
        metavar="G",
        help="GPUs each worker asks Ray for (default 1 on a GPU; 0.5 puts two workers on one card)",
    )


def build_parser(registry: tuple[Setting, ...] = SETTINGS) -> argparse.ArgumentParser:
    """registry: the engine settings to make flags for (tests pass an extended one)."""
    p = argparse.ArgumentParser(prog="logprob-parity", description=__doc__)
    p.add_argument(
        "--version",
        action="version",
        version=version_line(),
        help="print this package's version and those of vLLM, transformers and torch where installed",
    )
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compare", help="score text with HF and vLLM and compare token by token")
    _add_spec_args(c, registry)
    c.add_argument(
        "--no-noise-floor",
        action="store_true",
        help="skip measuring each engine's own noise beside the gap (then the verdict says it is not yet measured)",
    )
    c.add_argument(
        "--null",
        action="store_true",
        help="what noise looks like: HF against itself in vLLM's place (each text alone against a padded micro-batch "
        "of other texts), shown and judged exactly as a comparison",
    )
    c.add_argument(
        "--check", action="store_true", help="then gate the runs on the bounds below, as `check` does (exit 1 on a failure)"
    )
    add_check_flags(c)

    k = sub.add_parser("check", help="a parity gate for CI: exit 0 when every bound holds, 1 when one fails, 2 for bad input")
    k.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    add_check_flags(k)
    k.set_defaults(func=cmd_check)

    df = sub.add_parser("diff", help="two runs of the same model and token ids side by side: what changed, how the gap moved")
    df.add_argument("a", metavar="RUN_A")
    df.add_argument("b", metavar="RUN_B")
    df.add_argument("--json", default=None, metavar="OUT")
    df.set_defaults(func=cmd_diff)
    _add_ray_args(c)
    c.set_defaults(func=cmd_compare)

    g = sub.add_parser("diagnose", help="noise floor, knob ablation, float64 reference, downstream impact, verdict")
    _add_spec_args(g, registry)
    g.add_argument(
        "--parts",
        default="noise,reference,downstream",
        help="noise,reference,downstream,ablation,layers or 'all' (layers: where in the network the engines part)",
    )
    g.add_argument("--layer-text", type=COUNT, default=1, help="which text (1 = the first) the layers part captures")
    g.add_argument(
        "--parquet", default=None, metavar="OUT", help="the layer part's table: a row per dtype, layer, block and token"
    )
    g.add_argument("--gen-tokens", type=COUNT, default=16, help="greedy tokens to generate for the downstream check")
    g.add_argument("--slow-knobs", action="store_true", help="also ablate knobs that are slow here (torch.compile on CPU)")
    g.set_defaults(func=cmd_diagnose)

    ro = sub.add_parser("rollout", help="sample with vLLM's decode path; rescore with vLLM prefill and HF (the trainer)")
    _add_spec_args(ro, registry, rollout=True)
    ro.add_argument("--samples", type=COUNT, default=1, help="completions per prompt (each its own seed: seed + its index)")
    ro.add_argument("--max-tokens", type=COUNT, default=32, help="new tokens per completion at most")
    ro.add_argument("--temperature", type=NONNEG, default=1.0)
    ro.add_argument("--top-p", type=number(float, 0, 1, above=True), default=1.0)
    ro.add_argument("--top-k", type=number(int, 1, also=(-1,)), default=-1, help="sampling cut: -1 keeps the whole vocabulary")
    ro.add_argument(
        "--seed",
        dest="sampling_seed",
        type=int,
        default=0,
        help="sampling seed: sample k of the run uses seed + k, so each is reproducible alone",
    )
    ro.add_argument("--ignore-eos", action="store_true", help="always sample --max-tokens tokens (benchmarks)")
    ro.add_argument(
        "--noise-samples", type=number(int, 0), default=2, help="samples re-decoded alone and rescored in chunks (noise floors)"
    )
    _add_ray_args(ro)
    ro.set_defaults(func=cmd_rollout)

    rs = sub.add_parser(
        "rescore", help="rescore logged rollouts (their engine's logprobs) with vLLM prefill and HF, as rollout does"
    )
    rs.add_argument(
        "--rollouts",
        required=True,
        metavar="FILE",
        help="JSONL or Parquet, one sequence a record (prompt_token_ids or prompt, completion_token_ids, logprobs; "
        "optional temperature, top_p, top_k, step, id), or `rollout --json` output",
    )
    rs.add_argument(
        "--map",
        default=None,
        metavar="FIELD=COLUMN,...",
        help="read a field from another column, e.g. logprobs=rollout_log_probs,completion_token_ids=responses",
    )
    _add_spec_args(rs, registry, texts=False)
    _add_ray_args(rs)
    rs.set_defaults(func=cmd_rescore)

    fr = sub.add_parser("frontier", help="accuracy against speed over dtypes, kernels and quantization, against HF float64")
    _add_spec_args(fr, registry)
    fr.add_argument(
        "--configs",
        default=None,
        help="configurations separated by ';', each a dtype and setting=value pairs, e.g. "
        "'float32; bfloat16 kv_cache_dtype=fp8; float32 attention_backend=FLEX_ATTENTION' "
        "(default: the grid this platform can run)",
    )
    fr.add_argument(
        "--tolerance",
        type=number(float, 0, above=True),
        default=None,
        help="largest mean |Δ logp| to the float64 reference a recommendation may have "
        "(default: HF's own float32 gap to it, measured)",
    )
    fr.add_argument(
        "--speed-load",
        default=None,
        metavar="NxL",
        help="what each configuration's speed is timed on: N sequences of L tokens of this model "
        "(default: 64x512 on a GPU, 4x128 on a CPU); accuracy is measured on the texts",
    )
    fr.add_argument(
        "--repeats", type=number(int, 3), default=3, help="timed repeats of each speed (median and spread are reported)"
    )
    fr.set_defaults(func=cmd_frontier)

    sub.add_parser("runs", help="list stored runs").set_defaults(func=cmd_runs)

    s = sub.add_parser("show", help="print a stored run, rollout or frontier")
    s.add_argument("run_id")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_show)

    r = sub.add_parser("report", help="write a stored run, rollout or frontier as a report (.html or .json)")
    r.add_argument("run_id")
    r.add_argument("-o", "--output", required=True)
    r.set_defaults(func=cmd_report)

    d = sub.add_parser("dashboard", help="start the Streamlit dashboard")
    d.add_argument("--address", default="localhost")
    d.add_argument("--port", type=number(int, 1, 65535), default=8501)
    d.add_argument("--headless", action="store_true")
    d.add_argument(
        "--no-prewarm",
        action="store_true",
        help="do not start the default model's engines when the server starts (also: LPP_PREWARM=0)",
    )
    d.set_defaults(func=cmd_dashboard)

    m = sub.add_parser("demo-model", help="build the offline SmolLM2-135M-Instruct folder")
    m.add_argument("out_dir", nargs="?", default=None)
    m.add_argument("--force", action="store_true")
    m.set_defaults(func=cmd_demo_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        first, _, rest = str(exc).partition("\n")
        print(f"error: {first}", file=sys.stderr)
        if rest and os.environ.get("LPP_DEBUG"):
            print(rest, file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
