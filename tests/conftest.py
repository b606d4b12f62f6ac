"""Shared fixtures. Engine tests share warm workers through logprob_parity.engines' pool (one process)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from builders import CACHE, REPO, build_tiny_gptq, build_tiny_llama

pytest_plugins = ("pytester",)  # a test runs two tests in one session (engine sharing)

# Demo model and other built models live here across test runs (CI builds them once per run).
MODELS_HOME = CACHE / "home"
os.environ.setdefault("LOGPROB_PARITY_HOME", str(MODELS_HOME))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


# Read off the processor, not asked of vLLM: vLLM's CPU build runs an FP8 KV cache and 4-bit (GPTQ)
# weights only with AVX-512 or AMX (it loads its AVX2 kernels elsewhere, which lack them), so the tests
# that measure those expect them measured here and listed as skipped, with vLLM's reason, elsewhere.
AVX512 = bool({"avx512f", "amx_tile"} & _cpu_flags())

# Every engine load of the session, in this process and in the CLIs and servers it starts (inherited).
START_LOG = CACHE / "engine-starts.jsonl"
os.environ.setdefault("LPP_ENGINE_START_LOG", str(START_LOG))


def start_rows() -> list[dict]:
    """The session's engine loads so far (START_LOG), one dict a load, oldest first."""
    import json

    if not START_LOG.exists():
        return []
    return [json.loads(line) for line in START_LOG.read_text().splitlines() if line.strip()]


ZYGOTE = None  # the session's engine zygote (logprob_parity.engines.zygote), where it started one
# The processes that run tests (this one, or each pytest-xdist worker): a load in one of them is a
# load "in the test process" at the end of the run; any other pid is a CLI or server a test started.
TEST_PIDS = CACHE / "test-pids"


def _on_workers(config) -> bool:
    """Whether this session's tests run on several pytest-xdist processes (asked in any of them)."""
    workers = config.getoption("numprocesses", None)
    return hasattr(config, "workerinput") or (isinstance(workers, int) and workers > 1)


def pytest_configure(config):
    """On several processes (pytest-xdist's `-n`), each gets its share of the cores for torch's and
    OpenMP's threads: two workers on a 2-core machine, each spinning two threads, fight for cores
    they think are theirs (CI on `-n 2`: user CPU 45 min in one process, 34 min on two, at one
    thread a worker). Set before the workers start, so they and every host they start inherit it;
    a value the caller set is kept."""
    if _on_workers(config) and not hasattr(config, "workerinput"):  # the controller, before its workers start
        workers = config.getoption("numprocesses")
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        # whole modules go out in the order pytest_collection_modifyitems gives them (the longest
        # first), not xdist's default of the most tests first
        config.option.loadscopereorder = False


def pytest_sessionstart(session):
    """The session's engine hosts are forked from one zygote that imported the engines once: in this
    process, in pytest-xdist's workers, and in every CLI and dashboard a test starts (they inherit
    its address). `LPP_TEST_ZYGOTE=0` starts every host the ordinary way, as the product does."""
    global ZYGOTE
    from logprob_parity.engines.host import host_env
    from logprob_parity.engines.pool import POOL
    from logprob_parity.engines.zygote import ZYGOTE_ENV, Zygote

    controller = session.config.getoption("numprocesses", None) and not hasattr(session.config, "workerinput")
    if os.environ.get("LPP_TEST_ZYGOTE", "1") == "1" and not os.environ.get(ZYGOTE_ENV) and not controller:
        ZYGOTE = Zygote().start(host_env({}))  # pytest-xdist's controller runs no test: each worker starts its own

    START_LOG.parent.mkdir(parents=True, exist_ok=True)
    _demo_from_setup()  # before any test, CLI or dashboard of the session looks for the demo model
    if not hasattr(session.config, "workerinput"):  # the session's own process, not a pytest-xdist worker
        START_LOG.unlink(missing_ok=True)
        TEST_PIDS.unlink(missing_ok=True)
    if not controller:
        with TEST_PIDS.open("a") as f:
            f.write(f"{os.getpid()}\n")
    # the session's engines are shared across tests by key (the pool keeps them warm); a new key loads
    # into a spare that has done its imports, or swaps into a host stopped for room
    POOL.keep_spares = True


def pytest_sessionfinish(session):
    """The pool's hosts stop before the zygote that forked them (it reports their exits)."""
    if ZYGOTE is not None:
        from logprob_parity.engines.pool import POOL

        POOL.shutdown()
        ZYGOTE.stop()


@pytest.fixture()
def cold_start(monkeypatch):
    """For a test about a real cold start (imports, start limits, spares, the processes a server
    starts): hosts start as new processes, not forked from the session's zygote."""
    from logprob_parity.engines.zygote import ZYGOTE_ENV, ZYGOTE_KEY_ENV

    monkeypatch.delenv(ZYGOTE_ENV, raising=False)
    monkeypatch.delenv(ZYGOTE_KEY_ENV, raising=False)


def pytest_terminal_summary(terminalreporter):
    """How many engines the session loaded, where, and what they cost: the suite's largest cost."""
    from collections import Counter

    if not START_LOG.exists():
        return
    rows = start_rows()
    testers = {int(p) for p in TEST_PIDS.read_text().split()} if TEST_PIDS.exists() else {os.getpid()}
    here = [r for r in rows if r["pid"] in testers]
    keys = Counter((r["pid"], r["key"]) for r in here)
    by_test = Counter(r["test"].split("::")[0] for r in rows)
    tr = terminalreporter
    tr.section("engine loads")
    tr.write_line(
        f"{len(rows)} engine loads, {sum(r['wall_s'] for r in rows):.0f} s in all; {len(here)} in the "
        f"{len(testers)} test process{'es' if len(testers) > 1 else ''} "
        f"({len(keys)} keys, {sum(n - 1 for n in keys.values())} loaded again after being stopped), "
        f"{len(rows) - len(here)} in CLIs and servers it started; {sum(1 for r in rows if r.get('swapped'))} swaps, "
        f"{sum(1 for r in rows if r.get('forked'))} forked from the zygote; "
        f"{sum(r.get('import_s', 0) for r in rows):.0f} s of imports"
    )
    refused = Counter(r["fork_refused"] for r in rows if r.get("fork_refused"))
    for why, n in refused.most_common(5):
        tr.write_line(f"  not forked ({n}): {why}")
    for test, n in by_test.most_common(15):
        tr.write_line(f"  {n:3d}  {test}")


def _module_rank(items) -> dict[str, int]:
    """Per test module: 0 without real engines or a browser, 1 with real engines, 2 with a browser."""
    rank: dict[str, int] = {}
    for item in items:
        r = 2 if "browser" in item.keywords else 1 if "engine" in item.keywords else 0
        rank[item.module.__name__] = max(rank.get(item.module.__name__, 0), r)
    return rank


def pytest_collection_modifyitems(config, items):
    """The fast modules first, so a failure there shows in seconds; then those that drive the real
    engines, then the browser's (whole modules move, in their own order: a module's shared engines and
    fixtures are set up once). On several processes the slow modules go longest first instead, by
    their seconds in a measured run (tests/durations.json): a long module handed out last would keep
    one process busy while the other has nothing left. GPU tests need CUDA, multi-GPU tests two GPUs;
    skip them (with the reason) elsewhere."""
    from durations import module_seconds

    from logprob_parity.engines.memory import gpus
    from logprob_parity.env import cuda_present

    rank = _module_rank(items)
    if _on_workers(config):
        seconds = module_seconds()

        def order(item) -> tuple:
            name = item.module.__name__
            return (rank[name] > 0, name not in seconds, -seconds.get(name, 0.0), rank[name], name)

        items.sort(key=order)  # stable: each module keeps its own order
    else:
        items.sort(key=lambda item: rank[item.module.__name__])

    cuda = cuda_present()
    many = cuda and len(gpus()) >= 2
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA); CI has none"))
        elif "multigpu" in item.keywords and not many:
            item.add_marker(pytest.mark.skip(reason="needs two or more NVIDIA GPUs"))


@pytest.fixture()
def vllm_in_this_process():
    """For a test that builds a vLLM engine in the test process itself (an independent check through
    vLLM's own API). vLLM's CPU platform writes LD_PRELOAD, NUMEXPR_MAX_THREADS, LOCAL_WORLD_SIZE and
    more into os.environ as it configures an engine; left there, every later host of the session would
    inherit them, so the zygote would refuse to fork it (a cold start, imports and all: about 110 hosts
    and 10 minutes of a CI run) and a fresh one would start with tcmalloc preloaded. Put back after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_bos() -> Path:
    """Tiny Llama whose tokenizer adds <s> itself."""
    return build_tiny_llama("tiny-llama-bos", adds_bos=True)


@pytest.fixture(scope="session")
def tiny_gptq() -> tuple[Path, Path]:
    """(a GPTQ 4-bit checkpoint of tiny_bos, an HF folder of its weights dequantized)."""
    return build_tiny_gptq()


@pytest.fixture(scope="session")
def tiny_nobos() -> Path:
    """Tiny Llama whose tokenizer has <s> but does not add it."""
    return build_tiny_llama("tiny-llama-nobos", adds_bos=False)


DEMO = MODELS_HOME / "models" / "smollm2-135m-instruct"


def _demo_from_setup() -> None:
    """The demo model's folder for the tests, copied from the one `scripts/setup.sh` has just built
    in the default store (the same GGUF converted by the same packages): a fresh clone then converts
    it once, not twice (20 s of CPU on the 2-core machine). Where there is none, build_demo_model
    converts it on first use, as before."""
    from logprob_parity.inputs.demo import build_demo_model, built
    from logprob_parity.paths import store_root

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LOGPROB_PARITY_HOME", raising=False)
        setup = store_root() / "models" / DEMO.name
    if setup.resolve() != DEMO.resolve() and built(setup):
        build_demo_model(DEMO, copy_of=setup)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from logprob_parity.inputs.demo import build_demo_model

    return build_demo_model(DEMO)


@pytest.fixture(scope="session")
def gpu_model() -> str:
    """The demo model for GPU runs: the GPU machine's converted copy (LPP_GPU_MODEL), else built here."""
    path = os.environ.get("LPP_GPU_MODEL", "/tmp/models/smollm2-135m")
    if not Path(path, "config.json").is_file():
        from logprob_parity.inputs.demo import build_demo_model

        return str(build_demo_model())
    return path


@pytest.fixture(scope="session")
def build_answer() -> bytes:
    """What this machine's vLLM build can run (logprob_parity.engines.build), asked once: the probe
    imports vLLM in a child process (about 14 s), and every CLI and dashboard a test starts on a new
    store would ask again. Kept in MODELS_HOME, keyed by the versions, like any store keeps it."""
    from logprob_parity.engines.build import CACHE_NAME, unsupported

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGPROB_PARITY_HOME", str(MODELS_HOME))
        unsupported.cache_clear()
        unsupported()
    unsupported.cache_clear()
    path = MODELS_HOME / CACHE_NAME
    return path.read_bytes() if path.exists() else b""


@pytest.fixture()
def home(tmp_path, monkeypatch, build_answer) -> Path:
    """An empty store root for one test, sharing the built demo model (no 30 s rebuild) and the build's
    answer (no 8 s probe in each process the test starts; test_build_checks asks it afresh)."""
    from logprob_parity.engines.build import CACHE_NAME

    root = tmp_path / "home"
    root.mkdir()
    (MODELS_HOME / "models").mkdir(parents=True, exist_ok=True)
    (root / "models").symlink_to(MODELS_HOME / "models")
    if build_answer:
        (root / CACHE_NAME).write_bytes(build_answer)
    monkeypatch.setenv("LOGPROB_PARITY_HOME", str(root))
    return root


def cli_env(home: Path) -> dict[str, str]:
    env = dict(os.environ, LOGPROB_PARITY_HOME=str(home), PYTHONPATH=str(REPO))
    return env


def kill_after_parts(cmd: list[str], env: dict[str, str], home: Path, parts: int, timeout: float = 300) -> int:
    """Start the CLI command, SIGKILL it (its whole process group, engine hosts included) once
    `parts` finished batches are stored, and return how many were stored by then."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    partial = home / "partial"
    deadline = time.monotonic() + timeout
    found: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(partial.glob("*/part-*.arrow")) if partial.exists() else []
        if len(found) >= parts:
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(found) >= parts, f"the command did not store {parts} batches in time"
    return len(list(partial.glob("*/part-*.arrow")))


def run_files(home: Path) -> list[str]:
    """Everything in the store's runs folder (temp files included)."""
    d = home / "runs"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


__all__ = ["cli_env", "kill_after_parts", "run_files", "shutil"]
