"""vLLM: prompt_logprobs over the exact token ids (TokensPrompt), raw logprobs, ranks from vLLM itself."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from logprob_parity.engines.backends.base import Backend, apply_tf32
from logprob_parity.engines.memory import engine_share, kv_cache_bytes, sleeps_in_turn
from logprob_parity.engines.scores import TokenScores
from logprob_parity.inputs.spec import MAX_TOP_K, EngineSettings


def _is_moe(model_path: str, settings: EngineSettings) -> bool:
    from logprob_parity.engines.memory import text_config

    try:
        cfg = text_config(model_path, settings.trust_remote_code)
    except Exception:
        return False
    return bool(getattr(cfg, "num_experts_per_tok", None))


# what an engine's start imports past `import vllm`, imported by the zygote before it forks (prefork)
PREFORK_MODULES = (
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
)


def register_kernels_once() -> None:
    """vLLM's platform registers its stand-ins for Triton kernels (the CPU build: C++ ones) as each
    engine's worker starts (`register_triton_kernel_overrides`, from `init_worker`). Each call scans
    every loaded module's namespace for references to the kernels and replaces them with new wrappers
    of the same implementations: 0.1-0.2 s of a forked demo-model host's 2.3 s start on this 2-core CPU
    (benchmarks/results/zygote_first_score_cpu.md). Once a process has registered them, the kernels'
    own modules hold the wrappers, so a module imported later takes the wrappers too: once a process
    is all it needs. Here the platform's method runs once per process and returns at once after;
    prefork runs it in the zygote, so no forked host scans."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform.register_triton_kernel_overrides, "lpp_once", False):
        return
    original = platform.register_triton_kernel_overrides  # bound to the class: a classmethod
    done: list[bool] = []  # an entry once this process has registered them

    def once(cls: Any) -> None:
        if not done:
            original()
            done.append(True)

    once.lpp_once = True  # type: ignore[attr-defined]
    platform.register_triton_kernel_overrides = classmethod(once)  # type: ignore[method-assign,assignment]


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(self, model_path: str, dtype: str, device: str, settings: EngineSettings, max_model_len: int):
        super().__init__(model_path, dtype, device, settings, max_model_len)
        apply_tf32(settings)
        register_kernels_once()
        kwargs: dict[str, Any] = {
            "model": model_path,
            "tokenizer": model_path,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_logprobs": MAX_TOP_K,
            "logprobs_mode": "raw_logprobs",
            # every registered vLLM setting that is set, under its own name (logprob_parity.inputs.settings)
            **settings.passthrough("vllm"),
        }
        if settings.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        else:
            # Sized from the model, not from free memory: engines that start side by side cannot
            # misread each other's allocations, and the size does not depend on what else runs.
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(model_path, dtype, max_model_len, device, settings.trust_remote_code)
            if device != "cpu":  # vLLM still checks that this share of the card is free at start
                kwargs["gpu_memory_utilization"] = engine_share(model_path, dtype, max_model_len, settings)
        if device != "cpu" and "enable_return_routed_experts" not in kwargs and _is_moe(model_path, settings):
            # vLLM's own routed experts: bound before CUDA graphs are captured, so every forward is
            # seen (a router capture of ours would not run inside a replayed graph). CPU builds need
            # Model Runner V2 for it; there the capture of logprob_parity.engines.routing serves.
            kwargs["enable_return_routed_experts"] = True
        if sleeps_in_turn(device, settings):  # engines in turn: it sleeps while HF holds the card
            kwargs["enable_sleep_mode"] = True
        self.engine_kwargs = kwargs
        self.llm = LLM(**kwargs)

    @classmethod
    def prefork(cls) -> None:
        """vLLM ranks each scored token with a torch.compile'd function
        (vllm.v1.sample.ops.logprobs.batched_count_greater_than), which every new engine process traced
        and compiled on its first score: on this 2-core CPU the tiny Llama's first score took 1.9-2.9 s
        and the next 0.01 s; forked after this, its first takes 0.02-0.11 s, with the same values
        (benchmarks/zygote_first_score.py). Called on two vocabulary sizes with the batch dimension
        unbacked, as vLLM marks it, so that the compiled graph is dynamic in both and serves any model;
        only where OpenMP runs one thread, and without setting the count (why: below).

        Also imports what an engine's start imports past `import vllm` (PREFORK_MODULES: the CPU
        worker and its model runner, the model loader, the Llama code most families share): a forked
        host imported 715 modules as it started, 158 after this; the tiny Llama's start went from 1.27 s
        to 0.85 s on this CPU (the demo model's, weights and all, 2.89 s to 2.84 s)."""
        import importlib

        from vllm.v1.sample.ops.logprobs import batched_count_greater_than

        for name in PREFORK_MODULES:
            with contextlib.suppress(Exception):  # another vLLM build may keep them elsewhere: its hosts import them
                importlib.import_module(name)
        from vllm.platforms import current_platform

        register_kernels_once()
        current_platform.register_triton_kernel_overrides()  # after the imports above: their copies are rebound too

        if torch.get_num_threads() != 1:
            # A compiled kernel run on several threads leaves OpenMP's threads in the zygote, and a forked
            # child's first parallel region waits forever on threads it does not have. Nor may this set the
            # count: torch.set_num_threads here made every new thread of a forked host set it again, and two
            # of an HF host's loading threads doing so at once raced on the thread pool that fork had left
            # to be rebuilt ("Invalid thread pool!", seen once in three full test runs). So only where OpenMP
            # runs one thread anyway (OMP_NUM_THREADS=1, as the tests set); elsewhere hosts compile on first use.
            return
        with torch.inference_mode():  # as vLLM calls it: the grad mode is among the graph's guards
            for vocab in (7, 11):
                x = torch.randn(3, vocab)  # the logprobs, float32 [tokens, vocabulary]
                ranked = x.gather(-1, torch.zeros(3, 1, dtype=torch.int64))  # each token's own, as vLLM gathers it
                torch._dynamo.decorators.mark_unbacked(x, 0)
                torch._dynamo.decorators.mark_unbacked(ranked, 0)
                batched_count_greater_than(x, ranked)

    def sleep(self) -> bool:
        """vLLM's sleep mode, level 1: the weights move to host memory and the KV cache is dropped, so
        the card is free for HF; the engine, its compiled graphs and its process stay (verl and TRL's
        colocate mode do the same between rollouts). Only engines started with it (a GPU under a cap)."""
        if not self.engine_kwargs.get("enable_sleep_mode"):
            return False
        self.llm.sleep(level=1)
        return True

    def wake(self) -> None:
        self.llm.wake_up()

    def score(
        self,
        sequences: list[list[int]],
        top_k: int,
        gather_ids: list[np.ndarray] | None = None,
        batch_size: int | None = None,
        padding_side: str = "right",
        full: str | None = None,
    ) -> list[TokenScores]:
        """Default: every sequence in one generate call (vLLM batches them); batch_size=1 scores
        each alone, which the noise-floor diagnostics compare against. full: a folder where the
        same pass leaves each sequence's full-vocabulary logprobs (logprob_parity.engines.fullvocab): a
        folder, or {"tensors": token} to keep them on the device for `share_rows`."""
        params = SamplingParams(prompt_logprobs=top_k, max_tokens=1, temperature=0.0, detokenize=False, flat_logprobs=True)
        bs = batch_size or max(1, len(sequences))
        if full is not None:
            from logprob_parity.engines import fullvocab

            self.llm.collective_rpc(fullvocab.install)
            fullvocab.begin(full)
        results: list[TokenScores] = []
        try:
            for start in range(0, len(sequences), bs):
                chunk = sequences[start : start + bs]
                outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in chunk], params, use_tqdm=False)
                results.extend(self._parse(list(ids), out, top_k) for ids, out in zip(chunk, outputs))
        finally:
            if full is not None:
                fullvocab.end(full, [list(s) for s in sequences])
        return results

    def routes(self, sequences: list[list[int]]) -> list[np.ndarray] | str:
        """Each sequence's expert ids [tokens, MoE layers, k]: vLLM's own routed experts where this
        engine was started with them (an MoE model on a GPU), else a capture on the routers of this
        eager in-process engine (logprob_parity.engines.routing); a sentence for a dense model, a build
        without the hook, or a graph-replaying engine without vLLM's own option."""
        from logprob_parity.engines import routing

        way = routing.vllm_source(self.llm)
        if way.startswith("no:"):
            return f"vLLM {vllm.__version__}: {way[4:]}"
        try:
            got = (
                routing.own_routes(self.llm, sequences)
                if way == routing.VLLM_OWN
                else routing.captured_routes(self.llm, sequences)
            )
        except (ImportError, AttributeError) as exc:
            return f"vLLM {vllm.__version__} offers no router capture here ({exc})"
        return f"{got} (vLLM {vllm.__version__})" if isinstance(got, str) else got

    def layers(self, ids: list[int], variation: str = "alone", others: list[list[int]] | None = None) -> dict[str, Any] | str:
        """Every decoder layer's residual stream (vLLM's hidden_states and residual summed) and attention
        and MLP outputs for one text prefilled alone, kept on the engine's device by hooks on this
        in-process engine (logprob_parity.engines.layers) and shared with the HF host: a handle in
        "stack" (CUDA IPC on a GPU), freed by `release_layers`. A sentence where they cannot run."""
        from logprob_parity.engines import layers as lay

        if variation != "alone":
            return f"vLLM's side of the layer capture is one text alone (asked: {variation})"
        if not self.llm.llm_engine.vllm_config.model_config.enforce_eager:
            return "the layer capture needs an eager vLLM engine (enforce_eager): a compiled or graph-replaying forward runs no hooks"
        n_layers = int(self.llm.collective_rpc(lay.vllm_install)[0])
        if not n_layers:
            return f"vLLM {vllm.__version__}'s {self.model_path} has no decoder layers the capture recognises"
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.llm.reset_prefix_cache()  # a cached block is not computed again, so its layers would not run
        self.llm.collective_rpc(lay.vllm_begin, args=(n_layers, len(ids)))
        try:
            self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        except BaseException:
            got = self.llm.collective_rpc(lay.vllm_end)[0]  # hooks off, and the partial stack freed
            if got["token"] is not None:
                lay.release(got["token"])
            raise
        got = self.llm.collective_rpc(lay.vllm_end)[0]
        if got["missing"]:
            if got["token"] is not None:
                lay.release(got["token"])
            return f"vLLM {vllm.__version__} ran no hooked forward for {', '.join(got['missing'][:3])} of the text"
        return {
            "layers": n_layers,
            "pieces": got["pieces"],
            "variation": "alone",
            "n_tokens": len(ids),
            "eager": True,
            "token": got["token"],
            "stack": lay.share(got["token"]),
        }

    def release_layers(self, token: str) -> bool:
        from logprob_parity.engines import layers as lay

        return lay.release(token)

    def perturb(self, layer: int, block: str, factor: float) -> int:
        """Scale one block's weights of one layer inside the engine (a planted fault for tests)."""
        from logprob_parity.engines import layers as lay

        return int(self.llm.collective_rpc(lay.vllm_perturb, args=(layer, block, factor))[0])

    def restore(self) -> int:
        from logprob_parity.engines import layers as lay

        return int(self.llm.collective_rpc(lay.vllm_restore)[0])

    def bare_prefill(self, sequences: list[list[int]], top_k: int, flat: bool = True) -> float:
        """Seconds one plain `LLM.generate(prompt_logprobs=top_k)` of these ids takes on this engine,
        results unread: the yardstick the benchmarks hold our scoring against (same engine, same
        settings, no host round trip, no parsing)."""
        import time

        params = SamplingParams(prompt_logprobs=top_k, max_tokens=1, temperature=0.0, detokenize=False, flat_logprobs=flat)
        t = time.perf_counter()
        self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in sequences], params, use_tqdm=False)
        return time.perf_counter() - t

    def share_rows(self, token: str) -> dict[str, Any]:
        """Handles to the full rows a `score(..., full={"tensors": token})` kept (fullvocab.share)."""
        from logprob_parity.engines import fullvocab

        return fullvocab.share(token)

    def release_rows(self, token: str) -> None:
        from logprob_parity.engines import fullvocab

        fullvocab.release(token)

    def generate(self, sequences: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, min_tokens=max_new_tokens, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in sequences], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def sample(
        self, prompts: list[list[int]], seeds: list[int], sampling: dict[str, Any], modes: tuple[str, ...] = ("raw_logprobs",)
    ) -> list[dict[str, Any]]:
        """Rollout: one request per (prompt, seed), all submitted in one generate call as a rollout
        engine submits them (so they decode in one batch), each with logprobs=0: the sampled token's
        decode-time logprob. Each mode in `modes` ("raw_logprobs", "processed_logprobs") is one pass
        with the same seeds; the caller checks the passes sampled the same tokens.

        Why passes and not one: vLLM's logprobs_mode is an engine setting read by its sampler; we
        switch it on our own (in-process) worker between passes and switch it back after."""
        out: list[dict[str, Any]] = [{"completion_ids": None, "logprobs": {}} for _ in prompts]
        try:
            for mode in modes:
                self._logprobs_mode(mode)
                params = [self._sampling_params(sampling, seed) for seed in seeds]
                first = mode == modes[0]
                with self._decode_routes(first, out) as read_routes:
                    results = self.llm.generate(
                        [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts], params, use_tqdm=False
                    )
                read_routes(prompts, results)
                for slot, ids, res in zip(out, prompts, results):
                    if list(res.prompt_token_ids) != list(ids):
                        raise AssertionError("vLLM sampled from other prompt ids than it was given")
                    comp = res.outputs[0]
                    ids_out = [int(t) for t in comp.token_ids]
                    flat = comp.logprobs
                    # FlatLogprobs: one entry per position with logprobs=0, the sampled token's own
                    lp = [float(x) for x in flat.logprobs]
                    tid = [int(x) for x in flat.token_ids]
                    if tid != ids_out or len(lp) != len(ids_out):
                        raise AssertionError("vLLM's sample logprobs are not for the tokens it sampled")
                    if slot["completion_ids"] is None:
                        slot["completion_ids"] = ids_out
                    slot["logprobs"][mode] = lp
                    slot.setdefault("tokens_by_mode", {})[mode] = ids_out
                    slot["finish_reason"] = comp.finish_reason
        finally:
            self._logprobs_mode(self.engine_kwargs["logprobs_mode"])
        return out

    @contextlib.contextmanager
    def _decode_routes(self, on: bool, out: list[dict[str, Any]]) -> Any:
        """For an MoE model, the experts each forward of the rollout's own generate picked, prompt
        and decode steps: [prompt + completion - 1 tokens, MoE layers, k] in each slot's "routes"
        (the last sampled token is never forwarded), or a sentence in "routes_why". vLLM's own routed
        experts where the engine has them, else the router capture cut request by request."""
        from logprob_parity.engines import routing

        way = routing.vllm_source(self.llm) if on else None
        split = way == routing.VLLM_CAPTURE and bool(self.llm.collective_rpc(routing.install)[0])
        got: Any = None
        if way is not None and way != routing.VLLM_OWN and not split:
            way = None  # a dense model (no router the capture reaches), or an engine neither way reads
        if split:
            self.llm.collective_rpc(routing.begin_split)
        try:
            yield lambda prompts, results: self._put_routes(way, got, prompts, results, out)
        finally:
            if split:
                got = self.llm.collective_rpc(routing.take_split)[0]

    @staticmethod
    def _put_routes(way: str | None, got: Any, prompts: list[list[int]], results: Any, out: list[dict[str, Any]]) -> None:
        from logprob_parity.engines import routing

        if way is None:
            return
        for k, (slot, ids, res) in enumerate(zip(out, prompts, results)):
            n = len(ids) + len(res.outputs[0].token_ids) - 1  # every token but the last sampled one was forwarded
            if way == routing.VLLM_OWN:
                r = res.outputs[0].routed_experts
                arr = None if r is None else np.asarray(r).astype(np.int64)
            elif isinstance(got, list) and len(got) == len(prompts):
                arr = routing.stacked(got[k], n) if got[k] else None
            else:
                slot["routes_why"] = got if isinstance(got, str) else way
                continue
            if arr is None or len(arr) < n:
                slot["routes_why"] = f"vLLM returned routes for {0 if arr is None else len(arr)} of the {n} forwarded tokens"
                continue
            slot["routes"] = arr[:n]

    @staticmethod
    def _sampling_params(s: dict[str, Any], seed: int) -> SamplingParams:
        return SamplingParams(
            n=1,
            temperature=s["temperature"],
            top_p=s["top_p"],
            top_k=s["top_k"] if s["top_k"] > 0 else 0,
            max_tokens=s["max_tokens"],
            seed=seed,
            logprobs=0,
            ignore_eos=s.get("ignore_eos", False),
            detokenize=False,
            flat_logprobs=True,
        )

    def _logprobs_mode(self, mode: str) -> None:
        """Set the sampler's logprobs mode on our worker (the engine core runs in this process)."""

        def apply(worker: Any, mode: str = mode) -> str:
            # the sampler reads its mode when it runs (vLLM 0.26's GPU model runner and 0.32's CPU
            # one alike); the older sampler also keeps a copy in its top-k/top-p part
            sampler = worker.model_runner.sampler
            sampler.logprobs_mode = mode
            inner = getattr(sampler, "topk_topp_sampler", None)
            if inner is not None:
                inner.logprobs_mode = mode
            return type(sampler).__module__

        if mode != getattr(self, "_mode", self.engine_kwargs["logprobs_mode"]):
            self.llm.collective_rpc(apply)
            self._mode = mode

    @staticmethod
    def _parse(ids: list[int], out: Any, k: int) -> TokenScores:
        """FlatLogprobs: per position, the target first (with vLLM's own rank), then the top-k in rank order."""
        if list(out.prompt_token_ids) != ids:
            raise AssertionError(f"vLLM scored other ids than it was given: {list(out.prompt_token_ids)} != {ids}")
        flat = out.prompt_logprobs
        res = TokenScores.empty(ids, k)
        n = len(ids) - 1
        if n == 0:
            return res
        width = k + 1
        if len(flat.logprobs) != n * width:
            raise AssertionError(f"vLLM returned {len(flat.logprobs)} prompt logprobs for {n} positions x {width}")
        tid = np.asarray(flat.token_ids, dtype=np.int64).reshape(n, width)
        if not np.array_equal(tid[:, 0], ids[1:]):
            raise AssertionError("vLLM's prompt logprobs are not for the ids it was given")
        lp = np.asarray(flat.logprobs, dtype=np.float64).reshape(n, width)
        res.logprob[1:] = lp[:, 0]
        res.rank[1:] = np.asarray(flat.ranks, dtype=np.int64).reshape(n, width)[:, 0]
        res.topk_ids[1:] = tid[:, 1:]
        res.topk_logprobs[1:] = lp[:, 1:]
        return res

    def info(self) -> dict[str, Any]:
        from vllm.platforms import current_platform

        device = "cpu"
        if torch.cuda.is_available() and not current_platform.is_cpu():
            device = torch.cuda.get_device_name(0)
        cfg = self.llm.llm_engine.vllm_config
        return {
            "backend": "vllm",
            "device": device,
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "platform": type(current_platform).__name__,
            "dtype": str(cfg.model_config.dtype).replace("torch.", ""),
            "max_model_len": cfg.model_config.max_model_len,
            "enforce_eager": cfg.model_config.enforce_eager,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "engine_kwargs": {k: v for k, v in self.engine_kwargs.items() if k not in ("model", "tokenizer")},
            # what ran, not what was asked: a diff compares this (logprob_parity.analysis.diff)
            "attention_backend": self._attention_backend(),
            **self._memory(cfg),
        }

    def _attention_backend(self) -> str | None:
        """The attention backend(s) vLLM's model runner chose for its layers, by name; None where
        this vLLM does not say."""

        def names(worker: Any) -> list[str]:
            groups = getattr(worker.model_runner, "attn_groups", None) or []
            return sorted({g.backend.get_name() for gs in groups for g in gs})

        try:
            got = self.llm.collective_rpc(names)[0]
        except Exception:
            return None
        return ",".join(got) or None

    def _memory(self, cfg: Any) -> dict[str, Any]:
        """What this engine holds: its weights' bytes (as loaded: FP8 weights are 1 byte a value) and
        its KV cache's bytes per token (FP8 keys and values: 1 byte each) and in all."""

        def weights(worker: Any) -> int:
            # vLLM's CPU build moves a linear layer's weight into a oneDNN kernel where it can (float32 on an
            # AVX2 processor), leaving an empty parameter behind: that layer's weight is counted from its
            # sizes, or the demo model in float32 read 113 MB (its embedding alone) for 538 MB of weights
            model = worker.model_runner.model
            seen: set[int] = set()
            total = 0
            for module in model.modules():
                for name, t in module.named_parameters(recurse=False):
                    if t.numel() == 0 and name == "weight" and hasattr(module, "input_size_per_partition"):
                        total += module.input_size_per_partition * module.output_size_per_partition * t.element_size()
                    elif id(t) not in seen:  # a tied embedding is one tensor
                        seen.add(id(t))
                        total += t.numel() * t.element_size()
            return total

        try:
            w = int(self.llm.collective_rpc(weights)[0])
        except Exception:
            w = None
        kv_dtype = str(cfg.cache_config.cache_dtype)
        m = cfg.model_config
        try:
            per_elem = 1 if kv_dtype.startswith("fp8") else torch.empty(0, dtype=m.dtype).element_size()
            heads = m.get_num_kv_heads(cfg.parallel_config)
            per_token = 2 * m.get_num_layers(cfg.parallel_config) * heads * m.get_head_size() * per_elem
        except Exception:
            per_token = None
        return {
            "weights_bytes": w,
            "kv_cache_dtype": kv_dtype,
            "kv_bytes_per_token": per_token,
            "kv_cache_bytes": self.engine_kwargs.get("kv_cache_memory_bytes"),
        }

    def close(self) -> None:
        """Stop the engine core and drop vLLM's process-wide state (its distributed groups), so that a
        host can build the next engine in this process (a model swap)."""
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()  # (vLLM's cleanup_dist_env_and_memory, less its gc: the host collects once)
        destroy_distributed_environment()
