"""LoRA adapters: PEFT checkpoints served beside the base model, several in one batch.

A request names an adapter with a `LoRARequest` (vLLM's: `lora_name`, `lora_int_id`,
`lora_path`; the server's `--lora-modules NAME=PATH` and a request's `model` field). The runner's
`LoRAManager` loads an adapter the first time a request uses it (at most `max_cpu_loras` kept,
least recently used dropped), checks it against the model, and adds each adapted projection's
low-rank update to the rows of the requests that use it: y[rows] += s * (x[rows] A^T) B^T, with
s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), for each adapter in the step. Fused
projections (q/k/v, gate/up) take each part's update in its slice of the output.

In bf16 on the CPU the one-call native decoder stack adds the updates inside its call
(`NativeDecoder.adapted`, pagoda/csrc/decoder.cpp: the same roundings, products in fp32);
for a step it does not take, they run as forward hooks on the base projections, layer by layer
in torch. Prefix-cache blocks are named with the adapter (its id, name and
folder), so requests share cached KV only with requests of the same adapter. Under tensor
parallelism each rank holds its slice (B's rows of a column-parallel projection's output; A's
columns of a row-parallel one's input, whose x A^T is summed over the group before B), and
under pipeline parallelism each stage its layers' updates; the workers load an adapter
together and refuse it together (worker.py). Not served: adapters on embeddings or the LM head,
DoRA, biases, per-module rank or alpha patterns (each refused with its reason).
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from pagoda.config import LoRAConfig
from pagoda.distributed.group import ParallelGroup
from pagoda.layers.tensor_parallel import RowParallelLinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
SMALL_UPDATE_ROWS = 256  # NOTE: steps under this many adapted rows run the updates on one thread


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("A LoRA adapter needs a name.")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}.")

    @property
    def cache_key(self) -> str:
        """What names this adapter's prefix-cache blocks (block_manager.py): its folder too, so
        that an adapter reloaded in place from a new folder reuses none of the old one's KV."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}"


@dataclass
class LoRAUpdate:
    """One projection's update as two products in float32 (torch's bf16 products of rank
    8-64 ran 10-40x slower than float32's on the CPU): x's rows times the A of every adapted
    part, stacked, transposed and scaled ([in, parts x r]), times the parts' B transposed into
    one block-diagonal [parts x r, end - start] (one product and one add for q/k/v, not three),
    added to the projection's output columns [start, end)."""

    a_t: torch.Tensor
    b_t: torch.Tensor
    start: int
    reduce: ParallelGroup | None = None  # NOTE: a row-parallel shard's: x . A^T summed over the group

    @classmethod
    def of(cls, parts: list[tuple[torch.Tensor, torch.Tensor, int]], scaling: float,
           device: torch.device, reduce: ParallelGroup | None = None) -> LoRAUpdate:
        """From each adapted part's (A [r, in], B [out part, r], where the part starts), on
        the model's device."""
        rank = parts[0][0].shape[0]
        start = min(offset for _, _, offset in parts)
        end = max(offset + b.shape[0] for _, b, offset in parts)
        b_t = torch.zeros(rank * len(parts), end - start)
        for i, (_, b, offset) in enumerate(parts):
            b_t[i * rank:(i + 1) * rank, offset - start:offset - start + b.shape[0]] = b.T
        a_t = (torch.cat([a for a, _, _ in parts]) * scaling).T.contiguous()
        return cls(a_t.to(device), b_t.to(device), start, reduce)

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: slice | torch.Tensor) -> None:
        """y[rows] += x[rows]'s update (rows: a slice, or the row indices)."""
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        mid = xs.float() @ self.a_t
        if self.reduce is not None:
            mid = self.reduce.all_reduce(mid)
        delta = (mid @ self.b_t).to(y.dtype)
        out = y[:, self.start:self.start + self.b_t.shape[1]]
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)


@dataclass
class LoRAAdapter:
    """A loaded adapter: its update of each adapted projection (the model's module names)."""

    request: LoRARequest
    rank: int
    scaling: float
    updates: dict[str, LoRAUpdate] = field(default_factory=dict)
    # NOTE: the native decoder stack's view of `updates` (models/native_decoder.py), made by it
    # at the adapter's first step there; dropped with the adapter.
    native: Any = field(default=None, repr=False, compare=False)


class LoRAError(ValueError):
    """An adapter that cannot be served on this model (the request's 400)."""


def read_adapter_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise LoRAError(f"No {ADAPTER_CONFIG} in the LoRA adapter folder {path!r}.")
    with open(config_path, encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "modules_to_save": "adapters that replace whole modules (modules_to_save) are not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise LoRAError(f"LoRA adapter {path!r}: {why}.")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {path!r}: adapter biases (bias={config['bias']!r}) are not supported.")
    if config.get("fan_in_fan_out"):
        raise LoRAError(f"LoRA adapter {path!r}: fan_in_fan_out weights are not supported.")
    return config


def read_adapter_weights(path: str) -> dict[str, torch.Tensor]:
    for name in ADAPTER_WEIGHTS:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return load_file(file)
                weights: dict[str, torch.Tensor] = torch.load(file, map_location="cpu", weights_only=True)
                return weights
            except Exception as e:  # noqa: BLE001 - a damaged file is the adapter's error, said plainly
                raise LoRAError(f"Cannot read the LoRA adapter's {file}: {type(e).__name__}: {e}") from e
    raise LoRAError(f"No {' or '.join(ADAPTER_WEIGHTS)} in the LoRA adapter folder {path!r}.")


def module_name(key: str) -> tuple[str, str]:
    """A PEFT tensor name -> (the base module's name in the checkpoint, "lora_A" or "lora_B")."""
    stem, _, kind = key.removesuffix(".weight").rpartition(".")
    if kind not in ("lora_A", "lora_B"):
        raise LoRAError(f"Unexpected tensor {key!r} in a LoRA adapter (only lora_A/lora_B weights).")
    for prefix in ("base_model.model.", "model."):
        stem = stem.removeprefix(prefix)
    return stem, kind


def check_adapter(request: LoRARequest, max_rank: int) -> tuple[dict[str, Any], int]:
    """`request`'s adapter config and rank, refused as `load_adapter` would refuse them, without
    reading its weights or needing the model (the server checks --lora-modules before loading)."""
    config = read_adapter_config(request.lora_path)
    rank = int(config.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"LoRA adapter {request.lora_name!r} has rank {rank}; this server takes "
                        f"ranks 1-{max_rank} (--max-lora-rank).")
    if not any(os.path.isfile(os.path.join(request.lora_path, name)) for name in ADAPTER_WEIGHTS):
        raise LoRAError(f"No {' or '.join(ADAPTER_WEIGHTS)} in the LoRA adapter folder {request.lora_path!r}.")
    return config, rank


def load_adapter(request: LoRARequest, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """Reads `request`'s PEFT folder and maps its updates onto `model`'s projections (this
    rank's shard of them under tensor parallelism; this stage's layers under pipeline
    parallelism)."""
    config, rank = check_adapter(request, max_rank)
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in read_adapter_weights(request.lora_path).items():
        stem, kind = module_name(key)
        pairs.setdefault(stem, {})[kind] = tensor
    if not pairs:
        raise LoRAError(f"LoRA adapter {request.lora_name!r} holds no lora_A/lora_B weights.")
    adapter = LoRAAdapter(request, rank, scaling)
    found: dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
    modules = dict(model.named_modules())
    for stem, pair in sorted(pairs.items()):
        placed = _place(request, stem, pair, rank, model, modules)
        if placed is not None:
            target, a, b, offset = placed
            found.setdefault(target, []).append((a.float(), b.float(), offset))
    device = next(model.parameters()).device
    for target, parts in found.items():
        module = modules[target]
        tp = getattr(module, "tp", None)
        # NOTE: a row-parallel projection's x . A^T is a partial sum on each rank: summed over the group.
        reduce = tp if isinstance(module, RowParallelLinear) and tp is not None and tp.size > 1 else None
        adapter.updates[target] = LoRAUpdate.of(parts, scaling, device, reduce)
    return adapter


def _place(request: LoRARequest, stem: str, pair: dict[str, torch.Tensor], rank: int, model: nn.Module,
           modules: dict[str, nn.Module]) -> tuple[str, torch.Tensor, torch.Tensor, int] | None:
    """Where one adapted projection's A and B land: (the model's module, A and B as this rank
    holds them, the part's first output column); None for a layer another pipeline stage runs."""
    from pagoda.models.llama import MissingLayer

    if pair.keys() != {"lora_A", "lora_B"}:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {stem} lacks its "
                        f"{'lora_B' if 'lora_A' in pair else 'lora_A'} weight.")
    names = stem.split(".")
    if any(isinstance(modules.get(".".join(names[:i])), MissingLayer) for i in range(1, len(names))):
        return None
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    parent, _, leaf = stem.rpartition(".")
    fused, shard = packed.get(leaf, (leaf, None))
    target = f"{parent}.{fused}" if parent else fused
    module: Any = modules.get(target)
    if module is None or not hasattr(module, "in_features"):
        raise LoRAError(f"LoRA adapter {request.lora_name!r} adapts {stem}, which this model "
                        "does not have as a projection (embeddings and the LM head are not adapted).")
    sizes = getattr(module, "output_sizes", [module.out_features])
    part = 0 if shard is None else shard
    tp = getattr(module, "tp", None)
    ranks = tp.size if tp is not None else 1
    row_parallel = isinstance(module, RowParallelLinear)
    # NOTE: the checkpoint's whole projection: this rank holds a slice of its input (row-parallel)
    # or of each part's output (column-parallel).
    width, height = module.in_features * (ranks if row_parallel else 1), sizes[part] * (1 if row_parallel else ranks)
    a, b = pair["lora_A"], pair["lora_B"]
    if a.shape != (rank, width) or b.shape != (height, rank):
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {stem}'s A {tuple(a.shape)} and B "
                        f"{tuple(b.shape)} do not fit rank {rank} and the model's [{height}, {width}] projection.")
    if ranks > 1 and row_parallel:
        a = a.narrow(1, module.shard_start, module.in_features)
    elif ranks > 1:
        assert tp is not None
        b = b.narrow(0, tp.rank * sizes[part], sizes[part])
    return target, a, b, sum(sizes[:part])


class LoRAManager:
    """The adapters a runner serves, and the hooks that add their updates in a step.

    Args:
        model: the model (this rank's shard and stage under tensor or pipeline parallelism).
        config: the engine's LoRA settings.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        self.model = model
        self.config = config
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.modules = dict(model.named_modules())
        self._hooked: set[str] = set()
        self._step: list[tuple[LoRAAdapter, slice | torch.Tensor]] = []

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of `request` (loaded now if it is not; the least recently used
        one dropped past `max_cpu_loras`)."""
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is not None and adapter.request != request:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already {adapter.request.lora_name!r} "
                            f"({adapter.request.lora_path}); each adapter needs its own id.")
        if adapter is None:
            adapter = load_adapter(request, self.model, self.config.max_lora_rank)
            self.adapters[request.lora_int_id] = adapter
            while len(self.adapters) > self.config.max_cpu_loras:
                self.adapters.popitem(last=False)
            for target in adapter.updates:
                self._hook(target)
        self.adapters.move_to_end(request.lora_int_id)
        return adapter

    def _hook(self, target: str) -> None:
        if target not in self._hooked:
            self.modules[target].register_forward_hook(partial(self._add_updates, target))
            self._hooked.add(target)

    @contextmanager
    def step(self, rows: list[tuple[LoRARequest, int, int]], device: torch.device) -> Iterator[None]:
        """Within it, the projections add the updates of `rows`' adapters ((adapter, first row,
        row count) in the step's flattened batch)."""
        by_adapter: dict[int, list[int]] = {}
        for request, first, count in rows:
            by_adapter.setdefault(request.lora_int_id, []).extend(range(first, first + count))
        self._step = [(self.adapter(request), row_selection(by_adapter.pop(request.lora_int_id), device))
                      for request, _, _ in rows if request.lora_int_id in by_adapter]
        # NOTE: the updates' products are small: torch's second thread, woken (passively) for
        # each of a decode step's ~300 of them, cost more than it saved (SmolLM2, 16 rows).
        threads = torch.get_num_threads()
        if sum(count for _, _, count in rows) < SMALL_UPDATE_ROWS:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            self._step = []
            torch.set_num_threads(threads)

    def _add_updates(self, target: str, module: nn.Module, args: tuple[torch.Tensor, ...],
                     y: torch.Tensor) -> torch.Tensor:
        for adapter, rows in self._step:
            update = adapter.updates.get(target)
            if update is not None:
                update.add_to(y, args[0], rows)
        return y


def row_selection(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice where the rows run contiguously (a view: no gather), else their indices."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)
