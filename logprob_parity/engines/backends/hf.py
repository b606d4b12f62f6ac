"""Hugging Face transformers: teacher-forced forward passes (one sequence each by default), log_softmax in float32."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from functools import partial
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

from logprob_parity.engines import fullvocab
from logprob_parity.engines.attention import EAGER_FOR_SOFTCAP, soft_caps_attention
from logprob_parity.engines.backends.base import Backend, apply_tf32
from logprob_parity.engines.hostcopy import HostCopy, host_copy_room
from logprob_parity.engines.scores import TokenScores
from logprob_parity.inputs.sizes import consecutive
from logprob_parity.inputs.spec import EngineSettings


class HFBackend(Backend):
    name = "hf"
    # Rows (positions) per float32 log_softmax block: [rows, vocab] float32 is never held whole.
    ROW_CHUNK = 256
    CUDA_BLOCK_BYTES = 1 << 30  # on a GPU, blocks of up to 1 GiB of float32: fewer, larger kernels

    def __init__(self, model_path: str, dtype: str, device: str, settings: EngineSettings, max_model_len: int):
        super().__init__(model_path, dtype, device, settings, max_model_len)
        apply_tf32(settings)
        if settings.hf_cudnn_attention is not None and device.startswith("cuda"):
            torch.backends.cuda.enable_cudnn_sdp(bool(settings.hf_cudnn_attention))
        # every registered HF setting that is set, under its own name (logprob_parity.inputs.settings)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), **settings.passthrough("hf")}
        if dtype == "float64":  # the MoE experts' default kernel (grouped_mm) has no float64: the loop over experts has
            kwargs.setdefault("experts_implementation", "eager")
        self.attn_why = None
        if "attn_implementation" not in kwargs and soft_caps_attention(model_path, settings.trust_remote_code):
            kwargs["attn_implementation"] = "eager"
            self.attn_why = EAGER_FOR_SOFTCAP
        if settings.hf_device_map:  # accelerate spreads the layers over every visible GPU
            self.model = AutoModelForCausalLM.from_pretrained(model_path, device_map=settings.hf_device_map, **kwargs).eval()
            self.device = str(self.model.get_input_embeddings().weight.device)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(device).eval()
        self.batch_size = settings.hf_batch_size
        self._host_copy = HostCopy()  # the weights while the engine sleeps (engines in turn on a GPU)
        cuda_alone = self.device.startswith("cuda") and not settings.hf_device_map
        if cuda_alone and settings.device_memory and host_copy_room(self.model, self.device):
            self._host_copy.prepare(self.model)
        # hf_compile: inductor fuses the forward's norms, rotary and activations, and the block's
        # float32 log_softmax, gathers and rank count into a few kernels (no float32 [rows, vocab]
        # array); dynamic shapes so new lengths do not recompile. Compiles on the first call.
        fuse = partial(torch.compile, dynamic=True) if settings.hf_compile else (lambda f: f)
        self._forward_model, self._block_stats = fuse(self.model), fuse(_block_stats)
        if self.device.startswith("cuda"):
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self.ROW_CHUNK = max(self.ROW_CHUNK, self.CUDA_BLOCK_BYTES // (4 * vocab))

    def sleep(self) -> bool:
        """The model's weights move to host memory and the card's cache is emptied (engines in turn);
        a model spread over GPUs by device_map stays where accelerate put it (False: stop it instead)."""
        if not self.device.startswith("cuda") or self.settings.hf_device_map:
            return False
        self._host_copy.sleep(self.model)
        gc.collect()
        torch.cuda.empty_cache()
        return True

    def wake(self) -> None:
        """Back on the card. The host copy stays for the next sleep (which then copies nothing) while
        host memory keeps room beside it for vLLM's own sleeping weights, about as large."""
        from logprob_parity.engines.memory import free_bytes

        copy = self._host_copy
        copy.wake(self.model, self.device, keep=free_bytes("cpu") > copy.nbytes * 11 // 10)

    @torch.inference_mode()
    def score(
        self,
        sequences: list[list[int]],
        top_k: int,
        gather_ids: list[np.ndarray] | None = None,
        batch_size: int | None = None,
        padding_side: str = "right",
        full: str | None = None,
    ) -> list[TokenScores]:
        """Sequences in forward passes of `batch_size` (default: the hf_batch_size setting, 1 = one
        sequence a pass, so no padding and no batch shape can change a value). Batches group sequences
        of similar length and pad on `padding_side` with correct position ids. full: the folder where
        vLLM left its full-vocabulary logprobs of the same sequences: each position gains kl_full."""
        bs = batch_size or self.batch_size
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i])) if bs > 1 else list(range(len(sequences)))
        out: list[TokenScores | None] = [None] * len(sequences)
        clock = _Clock(self.device)
        rows = None if full is None else fullvocab.open_rows(full)
        sample = fullvocab.sample_in(full)  # engines in turn past the spool's bound: a sample of the rows
        clock.lap("open_rows")
        for start in range(0, len(order), bs):
            idx = order[start : start + bs]
            chunk = [sequences[i] for i in idx]
            gathers = None if gather_ids is None else [np.asarray(gather_ids[i]) for i in idx]
            refs = None if rows is None else [rows[i] for i in idx]
            logits = self._forward(chunk, padding_side)
            clock.lap("forward")
            for i, res in zip(idx, self._from_rows(chunk, logits, top_k, gathers, refs, clock, sample)):
                out[i] = res
        clock.report("score", sum(len(s) - 1 for s in sequences))
        return out  # type: ignore[return-value]

    def _forward(self, chunk: list[list[int]], padding_side: str) -> list[torch.Tensor]:
        """Each sequence's logits rows (row t-1 predicts token t)."""
        if len(chunk) == 1:
            x = torch.tensor(chunk, dtype=torch.long, device=self.device)
            return [self._forward_model(input_ids=x, use_cache=False).logits[0, :-1]]
        width = max(map(len, chunk))
        x = torch.zeros((len(chunk), width), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(x)
        for b, ids in enumerate(chunk):
            sl = slice(0, len(ids)) if padding_side == "right" else slice(width - len(ids), width)
            x[b, sl] = torch.tensor(ids, device=self.device)
            mask[b, sl] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        if bool(mask.all()):  # equal lengths: no mask, so the kernels are those of an unpadded batch
            logits = self._forward_model(input_ids=x, position_ids=pos, use_cache=False).logits
        else:
            logits = self._forward_model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False).logits
        rows = []
        for b, ids in enumerate(chunk):
            lo = 0 if padding_side == "right" else width - len(ids)
            rows.append(logits[b, lo : lo + len(ids) - 1])
        return rows

    @torch.inference_mode()
    def score_packed(self, sequences: list[list[int]], row_positions: int) -> list[TokenScores] | str:
        """The sequences packed whole into rows of up to `row_positions` tokens, each row one forward
        with position ids that restart at every sequence and no attention mask: padding-free
        training's way (TRL, verl), which transformers turns into a block-diagonal causal mask. A
        sentence (str) says why not when this model's HF code does not read packed position ids."""
        why = packing_unsupported(self.model)
        if why:
            return why
        out: list[TokenScores | None] = [None] * len(sequences)
        for idx in _packs([len(s) for s in sequences], row_positions):
            chunk = [sequences[i] for i in idx]
            x = torch.tensor([[t for ids in chunk for t in ids]], dtype=torch.long, device=self.device)
            pos = torch.cat([torch.arange(len(ids), device=self.device) for ids in chunk])[None]
            logits = self._forward_model(input_ids=x, position_ids=pos, use_cache=False).logits[0]
            rows, at = [], 0
            for ids in chunk:
                rows.append(logits[at : at + len(ids) - 1])
                at += len(ids)
            for i, res in zip(idx, self._from_rows(chunk, rows, 1, None)):
                out[i] = res
        return out  # type: ignore[return-value]

    def routes(self, sequences: list[list[int]]) -> list[np.ndarray] | str:
        """Each sequence's expert ids [tokens, MoE layers, k], one sequence a forward, from the MoE
        layers' router logits (logprob_parity.engines.routing); a sentence for a dense model."""
        from logprob_parity.engines import routing

        out = []
        for ids in sequences:
            try:
                got = routing.hf_routes(self.model, list(ids), self.device)
            except (TypeError, ValueError, AttributeError, RuntimeError) as exc:  # a model whose forward has no router output
                return f"HF's {type(self.model).__name__} does not return its router logits ({type(exc).__name__}: {exc})"
            if got is None:
                return routing.NOT_MOE
            out.append(got)
        return out

    def _capture(self, ids: list[int], variation: str, others: list[list[int]] | None, sink: Any) -> None:
        """One forward (or several) of one text with every decoder layer's blocks sent to `sink`
        (logprob_parity.engines.layers). variation: "alone" (one forward), "batched" (beside `others`,
        left-padded: the floor's micro-batch and padding variations at once), "packed" (after `others`
        in one row, position ids restarting at each text: the floor's padding-free variation),
        "chunked" (through the KV cache a chunk at a time, as the null comparison feeds it) or "float64"
        (the reference: the model's own weights in float64, one layer at a time, eager attention)."""
        from logprob_parity.engines import layers as lay

        if variation not in ("alone", "batched", "packed", "chunked", "float64"):
            raise ValueError(f"unknown layer capture variation {variation!r}")
        dev, model = self.device, self.model
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        if variation == "batched" and others:
            batch = [ids] + [list(o) for o in others]
            width = max(map(len, batch))
            x = torch.zeros((len(batch), width), dtype=torch.long, device=dev)
            mask = torch.zeros_like(x)
            for b, seq in enumerate(batch):
                x[b, width - len(seq) :] = torch.tensor(seq, device=dev)
                mask[b, width - len(seq) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            lo, nb = width - len(ids), len(batch)
            with lay.capturing(model, sink, lambda t: t.reshape(nb, width, t.shape[-1])[0, lo:], stop=True):
                model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False)
            return
        if variation == "packed" and others:
            texts = [list(o) for o in others] + [ids]
            x = torch.tensor([[t for seq in texts for t in seq]], dtype=torch.long, device=dev)
            pos = torch.cat([torch.arange(len(seq), device=dev) for seq in texts])[None]
            with lay.capturing(model, sink, lambda t: t.reshape(-1, t.shape[-1])[-len(ids) :], stop=True):
                model(input_ids=x, position_ids=pos, use_cache=False)
            return
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        if variation == "chunked" and len(ids) > 1:
            with lay.capturing(model, sink, flat):
                step, past = null_chunk(len(ids) + 1), None
                for lo in range(0, len(ids), step):
                    hi = min(lo + step, len(ids))
                    pos = torch.arange(lo, hi, device=dev)[None]
                    past = model(input_ids=x[:, lo:hi], position_ids=pos, past_key_values=past, use_cache=True).past_key_values
        elif variation == "float64":
            with lay.float64_layers(model), lay.capturing(model, sink, flat, stop=True):
                model(inputs_embeds=lay.float64_embeddings(model, x), use_cache=False)
        else:
            with lay.capturing(model, sink, flat, stop=True):
                model(input_ids=x, use_cache=False)

    def _moe_layers(self) -> list[int]:
        from logprob_parity.engines import layers as lay

        return [i for i, layer in enumerate(lay.decoder_layers(self.model)) if _is_moe_layer(layer)]

    @torch.inference_mode()
    def layers(self, ids: list[int], variation: str = "alone", others: list[list[int]] | None = None) -> dict[str, Any]:
        """Every decoder layer's residual stream and attention and MLP outputs for one text, kept as a
        stack and shared (a handle in "stack"; `release_layers` frees it): HF in vLLM's place, the null."""
        from logprob_parity.engines import layers as lay

        ids = [int(t) for t in ids]
        sink = lay.Sink(len(lay.decoder_layers(self.model)), len(ids), keep=True)
        self._capture(ids, variation, others, sink)
        token = lay.keep(sink.stack)
        return {
            "layers": sink.n_layers,
            "pieces": sink.pieces,
            "variation": variation,
            "n_tokens": len(ids),
            "moe_layers": self._moe_layers(),
            "token": token,
            "stack": lay.share(token),
        }

    def release_layers(self, token: str) -> bool:
        from logprob_parity.engines import layers as lay

        return lay.release(token)

    @torch.inference_mode()
    def layer_errors(self, ids: list[int], other: dict[str, Any], others: list[list[int]] | None = None) -> dict[str, Any]:
        """The layer part's figures for one text, computed here where HF's vectors are: against the
        other engine's kept stack (`other`: its `layers` record, its "stack" handle opened, not copied),
        HF's own stack of the text alone, and, compared as they run and dropped, HF beside other texts,
        HF packed after them (where the model reads packed position ids; "skipped" says why not), HF in
        chunks and the float64 reference. Each comparison's relative errors per (layer, block,
        token), [layers, blocks, tokens] float64 in "errors" (logprob_parity.analysis.layers names them)."""
        from logprob_parity.engines import layers as lay

        ids = [int(t) for t in ids]
        n, t = len(lay.decoder_layers(self.model)), len(ids)
        if int(other["layers"]) != n:
            raise ValueError(f"the engines' layers do not line up: the other engine has {other['layers']}, HF {n}")
        v = lay.open_stack(other["stack"])
        plan = (
            ("alone", True, lambda h: (("vllm_vs_hf", v, True),)),
            ("batched", False, lambda h: (("batched", h, False),)),
            ("packed", False, lambda h: (("packed", h, False),)),
            ("chunked", False, lambda h: (("chunked", h, False),)),
            ("float64", False, lambda h: (("vllm_vs_ref", v, True), ("hf_vs_ref", h, True))),
        )
        skipped = {"packed": packing_unsupported(self.model) or ("" if others else "no other texts to pack beside it")}
        errors: dict[str, Any] = {}
        seconds: dict[str, float] = {}
        h = None
        for variation, keep, against in plan:
            if skipped.get(variation):
                continue
            sink = lay.Sink(n, t, keep=keep, against=against(h))
            start = time.perf_counter()
            self._capture(ids, variation, others, sink)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds[variation] = time.perf_counter() - start
            if sink.missing():
                raise RuntimeError(f"HF's {variation} layer capture left out {', '.join(sink.missing()[:3])}")
            if variation == "float64" and sink.dtypes != {torch.float64}:
                raise RuntimeError(
                    f"HF's {type(self.model).__name__} casts the stream to {sorted(map(str, sink.dtypes))} inside its "
                    "forward: its float64 reference cannot run one layer at a time"
                )
            h = sink.stack if keep else h
            errors.update(sink.arrays())
        return {
            "layers": n,
            "n_tokens": t,
            "moe_layers": self._moe_layers(),
            "errors": errors,
            "seconds": seconds,
            "skipped": {k: why for k, why in skipped.items() if why},
        }

    def perturb(self, layer: int, block: str, factor: float) -> int:
        """Scale one block's weights of one layer (a planted fault for tests; `restore` undoes it)."""
        from logprob_parity.engines import layers as lay

        return lay.perturb_module(self.model, layer, block, factor)

    def restore(self) -> int:
        from logprob_parity.engines import layers as lay

        return lay.restore_module(self.model)

    @torch.inference_mode()
    def replay_score(self, sequences: list[list[int]], routes: list[np.ndarray]) -> list[np.ndarray]:
        """Each sequence's logprobs (float32 log_softmax, NaN at position 0) with its MoE routers
        forced to `routes` ([tokens, MoE layers, k], e.g. vLLM's): routing replay
        (logprob_parity.engines.routing.Replay), one sequence a forward."""
        from logprob_parity.engines import routing

        out = []
        for ids, r in zip(sequences, routes):
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            with routing.Replay(self.model, np.asarray(r)):
                logits = self.model(input_ids=x, use_cache=False).logits[0, :-1]
            lp = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
            got = lp.gather(1, x[0, 1:, None])[:, 0].double().cpu().numpy()
            out.append(np.concatenate([[np.nan], got]))
        return out

    @torch.inference_mode()
    def bare_forward(self, sequences: list[list[int]], batch_size: int, top_k: int) -> float:
        """Seconds a plain forward pass over these ids takes, `batch_size` sequences a pass (right-
        padded with a mask when lengths differ), with the least a comparison needs from it: float32
        log_softmax, the target's logprob and the top k. The benchmarks' yardstick for HF."""
        import time

        dev = self.device
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        for lo in range(0, len(sequences), batch_size):
            chunk = sequences[lo : lo + batch_size]
            width = max(map(len, chunk))
            x = torch.zeros((len(chunk), width), dtype=torch.long, device=dev)
            mask = torch.zeros_like(x)
            for b, ids in enumerate(chunk):
                x[b, : len(ids)] = torch.as_tensor(ids, device=dev)
                mask[b, : len(ids)] = 1
            logits = self.model(input_ids=x, attention_mask=None if bool(mask.all()) else mask, use_cache=False).logits[:, :-1]
            logits.topk(top_k, dim=-1)
            for b in range(len(chunk)):  # a [batch, T, vocab] float32 copy at once would not fit for large models
                torch.log_softmax(logits[b].float(), dim=-1).gather(1, x[b, 1:, None])
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t

    @torch.inference_mode()
    def generate(self, sequences: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each sequence, one at a time (no padding)."""
        out = []
        for ids in sequences:
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            y = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                min_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            out.append(y[0, len(ids) :].tolist())
        return out

    def _from_rows(
        self,
        chunk: list[list[int]],
        rows: list[torch.Tensor],
        k: int,
        gathers: list[np.ndarray] | None,
        refs: list[np.ndarray] | None = None,
        clock: _Clock | None = None,
        sample: tuple[int, int] | None = None,
    ) -> list[TokenScores]:
        """The batch's rows, stacked, in blocks of ROW_CHUNK: float32 log_softmax is row-wise, so
        blocking changes no value, and the float32 [positions, vocab] array is never held whole.
        sample: vLLM kept only these rows of each sequence (fullvocab.sampled); the KL of the others is NaN."""
        logits = rows[0] if len(rows) == 1 else torch.cat(rows)
        dev = logits.device
        target = torch.tensor([t for ids in chunk for t in ids[1:]], dtype=torch.long, device=dev)
        g_all = (
            None if gathers is None else torch.as_tensor(np.concatenate([g[1:] for g in gathers]), dtype=torch.long, device=dev)
        )
        n = logits.shape[0]
        lp_t = torch.empty(n, dtype=torch.float64, device=dev)
        rank = torch.empty(n, dtype=torch.long, device=dev)
        top_lp = torch.empty((n, k), dtype=torch.float64, device=dev)
        top_ids = torch.empty((n, k), dtype=torch.long, device=dev)
        full = None if g_all is None else torch.empty(g_all.shape, dtype=torch.float64, device=dev)
        kl = None if refs is None else torch.empty(n, dtype=torch.float64, device=dev)
        spans = np.cumsum([0] + [len(ids) - 1 for ids in chunk])
        keep = None if sample is None else np.concatenate([fullvocab.sampled(len(ids) - 1, sample) for ids in chunk])
        clock = clock or _Clock(dev.type)
        for lo in range(0, n, self.ROW_CHUNK):
            hi = min(lo + self.ROW_CHUNK, n)
            block = logits[lo:hi]
            # top-k ids from the model-dtype logits (half the bytes to select over; log_softmax is
            # monotone, so the same values), values read from the float32 log_softmax
            cols = block.topk(k, dim=-1).indices
            top_ids[lo:hi] = cols
            if full is not None:
                g = g_all[lo:hi]
                cols = torch.cat([cols, g.clamp(min=0)], dim=1)
            lp_t[lo:hi], rank[lo:hi], vals = self._block_stats(block, target[lo:hi], cols)
            top_lp[lo:hi] = vals[:, :k]
            if full is not None:
                vals = vals[:, k:].double()
                vals[g < 0] = float("nan")
                full[lo:hi] = vals
            clock.lap("logprobs, top k, gathers")
            if kl is not None and keep is not None:  # only the sampled rows: the others were never kept
                sel = np.flatnonzero(keep[lo:hi])
                kl[lo:hi] = float("nan")
                if len(sel):
                    ref = _ref_rows(refs, spans, lo, hi, sel)
                    rows_sel = block[torch.as_tensor(sel, device=dev)]
                    kl[lo + torch.as_tensor(sel, device=dev)] = fullvocab.kl_rows(
                        torch.log_softmax(rows_sel if rows_sel.dtype == torch.float64 else rows_sel.float(), dim=-1), ref
                    )
                clock.lap("exact KL: sampled rows")
            elif kl is not None:
                ref = _ref_rows(refs, spans, lo, hi)
                clock.lap("exact KL: vLLM's rows")
                kl[lo:hi] = fullvocab.kl_rows(
                    torch.log_softmax(block if block.dtype == torch.float64 else block.float(), dim=-1), ref
                )
                clock.lap("exact KL: sum")
        arrays = [a.cpu().numpy() for a in (lp_t, rank, top_lp, top_ids)]
        full_np = None if full is None else full.cpu().numpy()
        kl_np = None if kl is None else kl.cpu().numpy()
        clock.lap("read back")
        out, at = [], 0
        for ids in chunk:
            m = len(ids) - 1
            res = TokenScores.empty(ids, k)
            sl = slice(at, at + m)
            res.logprob[1:], res.rank[1:], res.topk_logprobs[1:], res.topk_ids[1:] = (a[sl] for a in arrays)
            if full_np is not None:
                g = np.full((len(ids), full_np.shape[1]), np.nan)
                g[1:] = full_np[sl]
                res = dataclasses.replace(res, gathered_logprobs=g)
            if kl_np is not None:
                kl_seq = np.full(len(ids), np.nan)
                kl_seq[1:] = kl_np[sl]
                res = dataclasses.replace(res, kl_full=kl_seq)
            out.append(res)
            at += m
        return out

    @torch.inference_mode()
    def write_full(self, sequences: list[list[int]], folder: str) -> int:
        """Leave each sequence's full float32 logprobs (row t-1: the distribution of token t) in
        `folder` (logprob_parity.engines.fullvocab.path_of), for another engine to take its exact KL against."""
        for i, ids in enumerate(sequences):
            (rows,) = self._forward([ids], "right")
            out = np.lib.format.open_memmap(fullvocab.path_of(folder, i), mode="w+", dtype=np.float32, shape=tuple(rows.shape))
            for lo in range(0, rows.shape[0], self.ROW_CHUNK):
                out[lo : lo + self.ROW_CHUNK] = torch.log_softmax(rows[lo : lo + self.ROW_CHUNK].float(), dim=-1).cpu().numpy()
            out.flush()
        return len(sequences)

    @torch.inference_mode()
    def rollout_score(
        self,
        sequences: list[list[int]],
        starts: list[int],
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        chunk: int | None = None,
        full: Any = None,
        tail: int | None = None,
    ) -> list[dict[str, np.ndarray]]:
        """The trainer's side of a rollout: teacher-forced logprobs of tokens [start, end) of each
        sequence (the completion), in passes of hf_batch_size sequences (default 1: no padding).

        Per token: `logprob` (log_softmax of the logits, float32, as everywhere), `tempered` (of the
        logits divided by the sampling temperature, as an RL trainer scores its rollouts) and
        `log_kept_mass` (log of the probability mass that vLLM's top-k then top-p keep at that
        temperature; 0 when nothing is cut), computed from the full distribution.

        chunk: feed each sequence `chunk` tokens at a time through the KV cache (1 = a per-token
        incremental loop), for the trainer-side noise floors; only `logprob` is returned then, from the
        completion's start or, with `tail`, for its last `tail` tokens (and `first`, where they start).

        full: the folder where vLLM's prefill left each sequence's full logprobs
        (logprob_parity.engines.fullvocab); then also `kl_full`, the exact KL(HF || vLLM prefill) at each
        completion token. `top_id` is HF's most likely token there, always."""
        if chunk is not None:
            return [self._incremental(ids, start, chunk, tail) for ids, start in zip(sequences, starts)]
        bs = self.batch_size  # the hf_batch_size setting: 1 (default) = one sequence a pass, no padding
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i])) if bs > 1 else list(range(len(sequences)))
        cut = top_k > 0 or top_p < 1.0
        clock = _Clock(self.device)
        vrows = None if full is None else fullvocab.open_rows(full)
        sample = fullvocab.sample_in(full)  # engines in turn past the spool's bound: vLLM kept a sample of the rows
        clock.lap("open_rows")
        got: list[torch.Tensor] = []  # per pass: [rows, 5] float64 on the device, read back once at the end
        for lo in range(0, len(order), bs):
            idx = order[lo : lo + bs]
            rows = self._forward([sequences[i] for i in idx], "right")
            clock.lap("forward")
            block = torch.cat([r[starts[i] - 1 :] for i, r in zip(idx, rows)])
            target = torch.tensor([t for i in idx for t in sequences[i][starts[i] :]], dtype=torch.long, device=block.device)
            # vLLM's rows of the same positions (row t-1 predicts token t on both sides)
            refs = None if vrows is None else [vrows[i][starts[i] - 1 :] for i in idx]
            keep = (
                None
                if refs is None or sample is None
                else np.concatenate([fullvocab.sampled(len(sequences[i]) - 1, sample)[starts[i] - 1 :] for i in idx])
            )
            for a in range(0, block.shape[0], self.ROW_CHUNK):  # float32 [rows, vocab] a block at a time
                f32 = block[a : a + self.ROW_CHUNK]
                f32 = f32 if f32.dtype == torch.float64 else f32.float()
                tgt = target[a : a + self.ROW_CHUNK, None]
                lp = torch.log_softmax(f32, dim=-1)
                scaled = lp if temperature == 1.0 else torch.log_softmax(f32 / temperature, dim=-1)
                kept = (
                    _log_kept_mass(scaled, top_k, top_p)
                    if cut and (top_p < 1.0 or top_k < lp.shape[-1])
                    else torch.zeros(lp.shape[0], device=lp.device)
                )
                if refs is None or keep is not None:
                    kl = torch.full((lp.shape[0],), float("nan"), dtype=torch.float64, device=lp.device)
                    sel = None if keep is None else np.flatnonzero(keep[a : a + lp.shape[0]])
                    if sel is not None and len(sel):  # only the sampled rows: the others were never kept
                        at = torch.as_tensor(sel, device=lp.device)
                        kl[at] = fullvocab.kl_rows(lp[at], _rows_of(refs, a, a + lp.shape[0], sel))
                else:
                    kl = fullvocab.kl_rows(lp, _rows_of(refs, a, a + lp.shape[0]))
                got.append(
                    torch.stack(
                        [
                            lp.gather(1, tgt)[:, 0].double(),
                            scaled.gather(1, tgt)[:, 0].double(),
                            kept.double(),
                            kl,
                            lp.argmax(dim=-1).double(),
                        ],
                        1,
                    )
                )
            clock.lap("logprobs and KL")
        flat = torch.cat(got).cpu().numpy() if got else np.zeros((0, 5))
        clock.lap("read back")
        clock.report("rollout_score", sum(len(sequences[i]) - starts[i] for i in order))
        out: list[dict[str, np.ndarray] | None] = [None] * len(sequences)
        at = 0
        for i in order:
            n = len(sequences[i]) - starts[i]
            part = flat[at : at + n]
            out[i] = {
                "logprob": part[:, 0],
                "tempered": part[:, 1],
                "log_kept_mass": part[:, 2],
                "top_id": part[:, 4].astype(np.int64),
            }
            if full is not None:
                out[i]["kl_full"] = part[:, 3]
            at += n
        return out  # type: ignore[return-value]

    def _incremental(self, ids: list[int], start: int, chunk: int, tail: int | None = None) -> dict[str, np.ndarray]:
        """Teacher-forced logprobs of ids[first:] fed `chunk` tokens a forward through the KV cache,
        first = start, or with `tail` the last `tail` tokens only (what comes before them is fed in
        one forward, which fills the cache as a trainer's prefix would): a per-token loop over a
        whole long completion would cost more than the rollout it is the floor of."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        first = start if tail is None else max(start, len(ids) - tail)
        got, past = [], None
        # chunks of `chunk` from position 0, or with a tail: the prefix [0, first) at once, then chunks
        bounds = list(range(0, len(ids), chunk)) if tail is None else [0, *range(first, len(ids), chunk)]
        bounds = sorted(set(bounds)) + [len(ids)]
        for lo, hi in itertools.pairwise(bounds):
            pos = torch.arange(lo, hi, device=self.device)[None]
            res = self.model(input_ids=x[:, lo:hi], position_ids=pos, past_key_values=past, use_cache=True)
            past = res.past_key_values
            # each chunk's rows [a, b) (row t-1 predicts token t) as they come: float32 log_softmax is
            # row-wise, so the values are those of the whole text's rows at once, and a 32,000-token
            # text of a 128k vocabulary never holds its [rows, vocab] float32 copy (15 GiB) at once
            a, b = max(lo, first - 1), min(hi, len(ids) - 1)
            if a < b:
                block = res.logits[0, a - lo : b - lo]
                block = block if block.dtype == torch.float64 else block.float()
                got.append(torch.log_softmax(block, dim=-1).gather(1, x[0, a + 1 : b + 1, None])[:, 0].double())
            del res
        return {
            "logprob": torch.cat(got).cpu().numpy() if got else np.zeros(0),
            "first": np.asarray(first),
        }

    def info(self) -> dict[str, Any]:
        dev = torch.cuda.get_device_name(self.device) if self.device.startswith("cuda") else "cpu"
        return {
            "backend": "hf",
            "device": dev,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            **({"attn_implementation_why": self.attn_why} if self.attn_why else {}),
            "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled() if self.device.startswith("cuda") else None,
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
        }


def packing_unsupported(model: Any) -> str | None:
    """Why this model cannot score packed sequences, or None: transformers reads restarting position
    ids as sequence boundaries in its masking utilities, which a model's code must call."""
    import sys

    mod = sys.modules.get(type(model).__module__)
    if mod is None or not any(hasattr(mod, f) for f in ("create_causal_mask", "create_sliding_window_causal_mask")):
        return f"{type(model).__name__}'s HF code does not build its mask from packed position ids"
    return None


def _packs(lengths: list[int], row: int) -> list[list[int]]:
    """Indices packed in order into rows of up to `row` tokens (a longer sequence gets a row alone)."""
    return consecutive(lengths, row)


class _Clock:
    """Where one call's time goes, by phase (the GPU synchronised at each lap), printed to the host's
    log when LPP_HF_TIMING=1; nothing is measured otherwise."""

    def __init__(self, device: str) -> None:
        import os
        import time

        self.on = os.environ.get("LPP_HF_TIMING") == "1"
        self.cuda = device.startswith("cuda")
        self.spent: dict[str, float] = {}
        self._time = time.perf_counter
        self.t = self._time()

    def lap(self, name: str) -> None:
        if not self.on:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = self._time()
        self.spent[name] = self.spent.get(name, 0.0) + now - self.t
        self.t = now

    def report(self, what: str, tokens: int) -> None:
        if self.on:
            print(
                f"[lpp-timing] {what} {tokens} tokens: " + ", ".join(f"{k} {v:.3f} s" for k, v in self.spent.items()), flush=True
            )


def _rows_of(parts: list[Any], a: int, b: int, sel: np.ndarray | None = None) -> Any:
    """Rows [a, b) of the parts stacked end to end, reading only those rows (parts are memory maps,
    or tensors another process shares); sel: only these of them (offsets from a, ascending)."""
    out, at = [], 0
    for part in parts:
        lo, hi = max(a, at), min(b, at + len(part))
        if lo < hi and sel is None:
            out.append(part[lo - at : hi - at])
        elif lo < hi:
            mine = sel[(sel + a >= lo) & (sel + a < hi)] + a - at
            if len(mine):
                out.append(part[mine])
        at += len(part)
    return _joined(out)


def _joined(parts: list[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    return np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0])


def _block_stats(block: torch.Tensor, target: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block of logits rows -> the target's logprob, its rank and the logprobs at `cols`, from a
    float32 log_softmax as vLLM computes it (a float64 reference model keeps float64)."""
    lp = torch.log_softmax(block if block.dtype == torch.float64 else block.float(), dim=-1)
    t_lp = lp.gather(1, target[:, None])[:, 0]
    # vLLM's rule: rank = number of vocabulary entries >= the target's logprob.
    return t_lp, (lp >= t_lp[:, None]).sum(dim=-1), lp.gather(1, cols)


def _log_kept_mass(lp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """log of the mass vLLM's sampler keeps of each row of logprobs `lp` [n, V]: top-k first (ties
    at the k-th value kept), then top-p over the renormalised rest (ascending cumulative sums <= 1-p
    are cut; the most likely token always stays), as vllm.v1.sample.ops.topk_topp_sampler does."""
    keep = torch.ones_like(lp, dtype=torch.bool)
    if 0 < top_k < lp.shape[-1]:
        kth = lp.topk(top_k, dim=-1).values[:, -1:]
        keep &= lp >= kth
    if top_p < 1.0:
        masked = lp.masked_fill(~keep, float("-inf"))
        probs_sort, idx = torch.softmax(masked, dim=-1).sort(dim=-1, descending=False)
        cut = probs_sort.cumsum(dim=-1) <= 1 - top_p
        cut[:, -1] = False
        keep &= ~torch.zeros_like(keep).scatter(1, idx, cut)
    return torch.logsumexp(lp.masked_fill(~keep, float("-inf")), dim=-1)


def _ref_rows(refs: list[Any], spans: np.ndarray, lo: int, hi: int, sel: np.ndarray | None = None) -> Any:
    """Rows [lo, hi) of the batch's concatenated positions, from each sequence's memory-mapped
    vLLM logprobs (sequence j holds rows [spans[j], spans[j+1])); sel: only these of them (offsets
    from lo, ascending), read alone from the maps."""
    parts = []
    for j, ref in enumerate(refs):
        a, b = int(spans[j]), int(spans[j + 1])
        if b <= lo or a >= hi:
            continue
        if ref.shape[0] != b - a:
            raise ValueError(f"vLLM's full logprobs hold {ref.shape[0]} positions, HF scored {b - a}")
        if sel is None:
            parts.append(ref[max(lo, a) - a : min(hi, b) - a])
        else:
            mine = sel[(sel + lo >= a) & (sel + lo < b)] + lo - a
            if len(mine):
                parts.append(ref[mine])
    return _joined(parts)


class HFNullBackend(HFBackend):
    """HF against itself, in vLLM's place: what noise looks like, drawn in the same view with the same
    colours and judged by the same verdict (`compare --null`, the Compare page's control).

    Where the HF side scores each text in one forward, this side feeds the same ids through HF's KV
    cache a chunk at a time (NULL_CHUNK tokens a forward, at most half the text, so every text takes at
    least two): the noise floor's chunked_kv variation (logprob_parity.analysis.floors) on every text,
    how trainers that score in chunks move HF's values, and the largest of the floor's variations for
    the demo model on a CPU. Everything else (model, dtype, kernels) is HF's own, so every gap it
    shows is HF's noise and nothing else."""

    name = "hf_null"

    @torch.inference_mode()
    def score(
        self,
        sequences: list[list[int]],
        top_k: int,
        gather_ids: list[np.ndarray] | None = None,
        batch_size: int | None = None,
        padding_side: str = "right",
        full: str | None = None,
    ) -> list[TokenScores]:
        out: list[TokenScores] = []
        for ids in sequences:
            if len(ids) < 2:
                out.extend(super().score([ids], top_k))
                continue
            chunk = null_chunk(len(ids))
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            rows, past = [], None
            for lo in range(0, len(ids) - 1, chunk):
                hi = min(lo + chunk, len(ids) - 1)
                pos = torch.arange(lo, hi, device=self.device)[None]
                res = self.model(input_ids=x[:, lo:hi], position_ids=pos, past_key_values=past, use_cache=True)
                past = res.past_key_values
                rows.append(res.logits[0])
            out.extend(self._from_rows([list(ids)], [torch.cat(rows)], top_k, None))
        return out

    def layers(self, ids: list[int], variation: str = "alone", others: list[list[int]] | None = None) -> dict[str, Any]:
        """In vLLM's place, the same ids fed through the KV cache in chunks, as `score` feeds them."""
        return super().layers(ids, "chunked" if variation == "alone" else variation, others)

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "backend": "hf_null",
            "null": f"HF itself, each text fed through its KV cache {NULL_CHUNK} tokens a forward (at most half the text)",
        }


def _is_moe_layer(layer: Any) -> bool:
    """A decoder layer whose MLP is a mixture of experts (it holds experts and a router)."""
    from logprob_parity.engines import layers as lay

    block = lay.block_module_of(layer)
    return block is not None and hasattr(block, "experts")


NULL_CHUNK = 64  # the floor's chunk (analysis.floors.CHUNK)


def null_chunk(n: int) -> int:
    """A null comparison's chunk for a text of n tokens: NULL_CHUNK, at most half the text, at least 1."""
    return max(1, min(NULL_CHUNK, (n - 1) // 2))
