"""LoRA adapters in PEFT's format, served many at once on one base model.

Where an adapter lives, from fast to slow:

- a *device slot*: `max_loras` slots per projection (engine/models/linear.py `LoRASlots`),
  zero-padded to `max_lora_rank`; one step's batch uses at most `max_loras` adapters, each
  in a slot (the scheduler sees to that), and a slot is refilled by a plain copy;
- the *CPU cache*: parsed, checked adapters, at most `max_cpu_loras` of them kept beyond
  those that queued or running requests use (those are pinned), least recently used
  dropped first;
- disk: `adapter_config.json` + `adapter_model.safetensors`, read again on demand.

Reading an adapter from disk happens outside the step loop: `LLM` reads before queueing,
`AsyncEngine` on a worker thread (`load`), and a request whose adapter is not in the CPU
cache yet waits in the queue (`is_ready`) instead of stalling the running batch.

PEFT's computation, reproduced: for a target layer y = base(x) + scaling * B(A(x)), with
A = lora_A.weight [r, in], B = lora_B.weight [out, r] and scaling = lora_alpha / r
(lora_alpha / sqrt(r) when `use_rslora`). Per-layer ranks (`rank_pattern`) follow from the
tensors' shapes; `alpha_pattern`, DoRA, bias training, `modules_to_save` and embedding or
lm_head adapters are refused with an error naming the field.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lockgate.engine.errors import AdapterInUse, LoRAError
from lockgate.engine.lora_files import Adapter, LoRARequest, read_adapter
from lockgate.engine.models.linear import LinearBase, LoRABatch, LoRASlots
from lockgate.engine.stats import LoRAStats

logger = logging.getLogger(__name__)


def _cut(module: LinearBase, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A [r, in] and B [out, r] of one layer (all of them with one rank)."""
    split = module.split
    if split is None:
        return a, b
    column, row = split.column(part), split.row()
    if column is not None:
        return a, b[column[0]: column[0] + column[1]]
    return (a, b) if row is None else (a[:, row[0]: row[0] + row[1]], b)


def _bound_slots(module: LinearBase) -> LoRASlots:
    """The device slots `bind` gave `module`."""
    if module.lora is None:
        raise RuntimeError(f"{type(module).__name__} has no LoRA slots: the model is not bound")
    return module.lora


class LoRAManager:
    """Adapters for one model: device slots, the CPU cache and loading off the step loop."""

    def __init__(
        self,
        projections: dict[str, tuple[LinearBase, int]],
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # shapes to check adapters against (the model's, or its storage-less skeleton's)
        self.projections = projections
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch()
        self.scales = [0.0] * max_loras
        self.modules: list[LinearBase] = []
        self.live: dict[str, tuple[LinearBase, int]] = {}    # the loaded model's projections
        elem = torch.tensor([], dtype=dtype).element_size()
        self.slot_bytes = sum(
            max_loras * len(m.out_sizes) * max_lora_rank * (m.in_features + m.out_features) * elem
            for m in {id(m): m for m, _ in projections.values()}.values()
        )
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # adapter id -> slot, LRU first
        self._lock = threading.Lock()
        self._cpu: OrderedDict[int, Adapter] = OrderedDict()    # LRU first
        self._refs: Counter[int] = Counter()
        self._known: dict[int, LoRARequest] = {}
        self._loading: dict[int, Future] = {}
        self._failed: dict[int, Exception] = {}
        self._removed: set[int] = set()    # slots to clear on the step loop's thread
        self._executor: ThreadPoolExecutor | None = None
        self.num_slot_loads = 0
        self.num_disk_loads = 0
        # with tensor parallelism: the same slot change on every other rank (each cuts the
        # adapter to its own slice); None with one rank
        self.remote: Callable[..., object] | None = None
        # told of each adapter removed (any thread): the engine drops its cached KV blocks
        self.on_remove: Callable[[int], None] | None = None

    def bind(self, projections: dict[str, tuple[LinearBase, int]]) -> None:
        """Give a loaded model's projections their (empty) device slots."""
        self.live = projections
        self.modules = []
        width = self.max_lora_rank
        for module, _ in projections.values():
            if module.lora is None:
                self.modules.append(module)
                w = len(module.out_sizes) * width
                module.lora = LoRASlots(
                    lora_a=torch.zeros(self.max_loras, w, module.in_features, dtype=self.dtype, device=self.device),
                    lora_bt=torch.zeros(self.max_loras, w, module.out_features, dtype=self.dtype, device=self.device),
                    scales=self.scales,
                    targeted=set(),
                    batch=self.batch,
                )
        self.slot_of.clear()
        self.scales[:] = [0.0] * self.max_loras
        self.batch.active = False

    def unbind(self) -> None:
        """The model is offloaded: its slots go with it; adapters stay in the CPU cache."""
        for module in self.modules:
            module.lora = None
        self.modules, self.live = [], {}
        self.slot_of.clear()
        self.batch.active = False

    # -- host side ------------------------------------------------------------------------
    def check_request(self, req: LoRARequest) -> None:
        """One id, one adapter: the same id with another name or path is an error."""
        if not isinstance(req, LoRARequest):
            raise LoRAError(f"lora_request: expected LoRARequest, got {type(req).__name__}",
                            field="lora_request")
        known = self._known.get(req.lora_int_id)
        if known is not None and known != req:
            raise LoRAError(
                f"lora_request: id {req.lora_int_id} is already adapter {known.lora_name!r} at "
                f"{known.lora_path!r}; give each adapter its own id", field="lora_request"
            )

    def load(self, req: LoRARequest) -> Adapter:
        """Read (or find in the CPU cache) and check an adapter. Blocking: call it outside
        the step loop. Raises LoRAError."""
        self.check_request(req)
        with self._lock:
            hit = self._cpu.get(req.lora_int_id)
            if hit is not None:
                self._cpu.move_to_end(req.lora_int_id)
                return hit
        adapter = read_adapter(req, self.projections, self.max_lora_rank, self.dtype)
        with self._lock:
            self.num_disk_loads += 1
            self._known[req.lora_int_id] = req
            self._failed.pop(req.lora_int_id, None)
            self._cpu[req.lora_int_id] = adapter
            self._cpu.move_to_end(req.lora_int_id)
            self._trim()
        return adapter

    def _trim(self) -> None:
        """Drop least recently used adapters that no request holds, down to max_cpu_loras."""
        excess = len(self._cpu) - self.max_cpu_loras
        for aid in list(self._cpu):
            if excess <= 0:
                break
            if self._refs[aid] == 0 and aid not in self.slot_of:
                del self._cpu[aid]
                excess -= 1

    def acquire(self, req: LoRARequest) -> None:
        """A request of this adapter entered the engine: pin it in the CPU cache, reading it
        on a worker thread if it is not there."""
        with self._lock:
            self._refs[req.lora_int_id] += 1
            self._known.setdefault(req.lora_int_id, req)
            if req.lora_int_id in self._cpu or req.lora_int_id in self._loading:
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="lockgate-lora")
            self._failed.pop(req.lora_int_id, None)
            self._loading[req.lora_int_id] = self._executor.submit(self._load_async, req)

    def _load_async(self, req: LoRARequest) -> None:
        try:
            self.load(req)
        except Exception as exc:  # noqa: BLE001 - any failure is kept and raised to the requests that wait on it
            logger.warning("adapter %s could not be loaded: %s", req.lora_name, exc)
            with self._lock:
                self._failed[req.lora_int_id] = exc
        finally:
            with self._lock:
                self._loading.pop(req.lora_int_id, None)

    def release(self, req: LoRARequest) -> None:
        with self._lock:
            self._refs[req.lora_int_id] -= 1
            if self._refs[req.lora_int_id] <= 0:
                del self._refs[req.lora_int_id]
                self._trim()

    def is_ready(self, adapter_id: int) -> bool:
        return adapter_id in self._cpu

    def take_failures(self) -> dict[int, Exception]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def remove(self, adapter_id: int) -> bool:
        """Forget an adapter (vLLM's remove_lora): out of the CPU cache now, out of its device
        slot at the next step. Refused while requests use it. Safe from any thread."""
        with self._lock:
            if self._refs[adapter_id] > 0:
                raise AdapterInUse(f"adapter {adapter_id}: {self._refs[adapter_id]} requests still use it")
            found = self._cpu.pop(adapter_id, None) is not None
            self._known.pop(adapter_id, None)
            if adapter_id in self.slot_of:
                self._removed.add(adapter_id)
                found = True
        if found and self.on_remove is not None:   # its cached KV blocks go too
            self.on_remove(adapter_id)
        return found

    # -- device side (the step loop's thread) -------------------------------------------------
    def activate(self, adapter_ids: list[int]) -> dict[int, int]:
        """Put each adapter in a device slot (at most max_loras of them), refilling the least
        recently used slots no adapter of this step holds. Returns id -> slot."""
        if len(adapter_ids) > self.max_loras:
            raise RuntimeError(f"{len(adapter_ids)} adapters in one step; max_loras is {self.max_loras}")
        if self._removed:
            with self._lock:
                removed, self._removed = self._removed, set()
            for aid in removed:
                slot = self.slot_of.pop(aid, None)
                if slot is not None:
                    self.clear_slot(slot)
                    if self.remote is not None:
                        self.remote("lora_clear", slot=slot)
        for aid in adapter_ids:
            if aid in self.slot_of:
                self.slot_of.move_to_end(aid)
        for aid in adapter_ids:
            if aid in self.slot_of:
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(a for a in self.slot_of if a not in adapter_ids)
                slot = self.slot_of.pop(victim)
            with self._lock:
                adapter = self._cpu[aid]
            self.fill_slot(slot, adapter)
            if self.remote is not None:
                self.remote("lora_fill", slot=slot, adapter=adapter)
            self.slot_of[aid] = slot
        return {aid: self.slot_of[aid] for aid in adapter_ids}

    def fill_slot(self, slot: int, adapter: Adapter) -> None:
        """Copy an adapter into a device slot: this rank's cut of it where the model is split
        (engine/parallel/shard.py): a column-parallel projection keeps all of A and its output
        rows of B, a row-parallel one its input columns of A and all of B, its partial delta
        summed with the base output's by the layer's one all-reduce."""
        self.clear_slot(slot)
        # one scaling per slot: every layer of an adapter has the same rank unless
        # rank_pattern says otherwise, and then B is pre-scaled to the shared factor
        self.scales[slot] = scale = adapter.scaling(adapter.rank)
        rm = self.max_lora_rank
        for layer, (a, b) in adapter.weights.items():
            module, part = self.live[layer]
            lora = _bound_slots(module)
            a, b = _cut(module, part, a, b)
            r, lo = a.shape[0], module.offsets[part]
            lora.lora_a[slot, part * rm: part * rm + r].copy_(a)
            b_dst = lora.lora_bt[slot, part * rm: part * rm + r, lo: lo + module.out_sizes[part]]
            b_dst.copy_(b.T)
            if r != adapter.rank:
                b_dst.mul_(adapter.scaling(r) / scale)
            lora.targeted.add(slot)
        self.num_slot_loads += 1

    def clear_slot(self, slot: int) -> None:
        for module in self.modules:
            lora = _bound_slots(module)
            if slot in lora.targeted:
                lora.lora_a[slot].zero_()
                lora.lora_bt[slot].zero_()
                lora.targeted.discard(slot)
        self.scales[slot] = 0.0

    # at most this many tokens in a step: the masked form (all slots at once) is used
    MASKED_MAX_TOKENS = 64

    def set_batch(self, seg_starts: list[int], seg_slots: list[int]) -> None:
        b = self.batch
        b.seg_starts, b.seg_slots = seg_starts, seg_slots
        b.slots = frozenset(s for s in seg_slots if s >= 0)
        b.active = bool(b.slots)
        b.masked = seg_starts[-1] <= self.MASKED_MAX_TOKENS and len(b.slots) > 1
        b.scales = self.scales
        b.masks = {}

    def clear_batch(self) -> None:
        self.batch.active = False

    def stats(self) -> LoRAStats:
        with self._lock:
            cpu = list(self._cpu)
            refs = dict(self._refs)
        names = {aid: req.lora_name for aid, req in self._known.items()}
        return LoRAStats(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            slot_bytes=self.slot_bytes,
            in_slots={names.get(a, str(a)): s for a, s in self.slot_of.items()},
            in_cpu=[names.get(a, str(a)) for a in cpu],
            requests={names.get(a, str(a)): n for a, n in refs.items()},
            slot_loads=self.num_slot_loads,
            disk_loads=self.num_disk_loads,
        )

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
