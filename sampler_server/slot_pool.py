"""Resident adapter versions in stacked tensors, one pair per target module:
A[n_slots, r_max, d_in], B[n_slots, d_out, r_max] (a view of [n_slots, r_max, d_out] storage), scaling[n_slots].
Slot 0 is "no adapter" (zeros).

Every token of a batch carries a slot index, so one forward serves any mix of versions. Smaller ranks are
zero-padded to r_max (exact). A slot is keyed by an exact (adapter, version): reloading a name never
reuses stale weights. Requests hold a reference on their slot from admission to finish; idle slots are
evicted LRU when a new version needs room; pinned slots are never evicted; an unloaded slot with running
requests is freed when its last request ends.

A pin is charged to the user tenant that asked for it (`Slot.pin_tenant`, bounded per tenant by the service's
--max-pinned-per-tenant); a tenant's pins are counted from the slots themselves (`pinned_by`), so the count drops
exactly once whichever way a pin ends: UnloadAdapter, a hot reload unloading the version, or the slot being freed.

The tensors a forward reads (`SlotTensors`: A, B, scaling, rank per slot) are apart from the bookkeeping, so
that they can live in shared memory (`shared=True`) and be read by an engine process while this process loads
versions: a slot is only written while no sequence holds it.
"""

from __future__ import annotations

import math
import mmap
import threading
import time
from dataclasses import dataclass, field

import torch

from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.weights.base_model import UNEMBED_MODULE

VersionKey = tuple[str, int]  # (adapter, version)


def default_tenant_pins(max_slots: int) -> int:
    """--max-pinned-per-tenant's default: an eighth of the slots (at least 1), so that pins of one tenant never
    take the slots every other tenant's adapters load into."""
    return max(1, max_slots // 8)


@dataclass(frozen=True, slots=True)
class SlotTensors:
    """What the LoRA kernels read of the resident versions, indexed by slot."""

    a: dict[str, torch.Tensor]  # module -> [n_slots, r_max, d_in]
    b: dict[str, torch.Tensor]  # module -> [n_slots, d_out, r_max], a view of [n_slots, r_max, d_out] storage
    scaling: torch.Tensor  # [n_slots] float32; 0 for a free slot, so rows that still point there add nothing
    ranks: torch.Tensor  # [n_slots] int32; the rank each slot was loaded with
    # [n_slots] int8; 1 where the slot's version has a LoRA on lm_head: the engine leaves the others out of the
    # vocabulary-wide delta (their zeros would cost ~8% of the LM head's own matmul).
    unembed: torch.Tensor


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, shared: bool) -> torch.Tensor:
    """shared: in an anonymous shared mapping, which a process forked later maps too. Its pages are zeroes from the
    kernel, so no torch op runs (an op on a large tensor would start OpenMP's thread team, which a forked engine
    process inherits broken: its first parallel op hangs), and it is not a /dev/shm file (64 MiB in a default
    container)."""
    if not shared:
        return torch.zeros(shape, device=device, dtype=dtype)
    if device.type != "cpu":
        raise ValueError("shared slot tensors are CPU tensors")
    count = math.prod(shape)
    mapping = mmap.mmap(-1, count * dtype.itemsize)  # MAP_SHARED | MAP_ANONYMOUS; the tensor keeps it alive
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


@dataclass(slots=True)
class Slot:
    index: int
    key: VersionKey | None = None
    rank: int = 0
    scaling: float = 0.0
    refs: int = 0
    pinned: bool = False
    # The user tenant the pin counts against (--max-pinned-per-tenant); None: unpinned, or pinned by an admin (or
    # by a caller of a sampler without tokens), which no limit counts.
    pin_tenant: str | None = None
    retiring: bool = False  # unloaded while in use: freed when refs reach 0
    loading: bool = False  # reserved, tensors being written: invisible to lookups
    load_time: float = 0.0
    last_used: float = field(default_factory=time.monotonic)
    artifact_sha256: str = ""
    # Modules whose rows of this slot may be non-zero (an earlier occupant wrote them). The others are never
    # touched: the shared mapping's pages stay uncommitted, so a slot costs the memory of what its versions use
    # (lm_head's vocabulary-wide rows only for versions that train it).
    written: set[str] = field(default_factory=set)


class SlotPool:
    def __init__(
        self,
        shapes: dict[str, tuple[int, int]],
        *,
        max_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        shared: bool = False,
    ) -> None:
        """shared: the tensors live in shared memory, for an engine process forked after this (CPU only)."""
        count = max_slots + 1  # + slot 0
        self.max_rank = max_rank
        self.shared = shared
        self.a = {m: _zeros((count, max_rank, d_in), dtype, device, shared) for m, (d_in, _) in shapes.items()}
        # B is stored transposed, [n_slots, r_max, d_out] contiguous, and exposed as its [n_slots, d_out, r_max]
        # view: the expand step h @ B^T then streams long contiguous rows of d_out (a third of the time of
        # the 16-wide rows of [d_out, r_max] on CPU), and slicing a rank prefix keeps each slot's block contiguous.
        self.b = {
            m: _zeros((count, max_rank, d_out), dtype, device, shared).transpose(1, 2)
            for m, (_, d_out) in shapes.items()
        }
        self.scaling = _zeros((count,), torch.float32, device, shared)
        cpu = torch.device("cpu")
        self.tensors = SlotTensors(
            self.a,
            self.b,
            self.scaling,
            _zeros((count,), torch.int32, cpu, shared),
            _zeros((count,), torch.int8, cpu, shared),
        )
        # For an engine process that keeps its own copy of the slots on its device (`SlotMirror`): per slot, how
        # many times a version was written into it, and which modules it wrote (bit i: self.modules[i]). Bumped by
        # fill() once the slot's tensors are complete, before any request can name the slot.
        self.generation = _zeros((count,), torch.int64, cpu, shared)
        self.written_bits = _zeros((count,), torch.int64, cpu, shared)
        self.slots = [Slot(i) for i in range(count)]
        self.by_key: dict[VersionKey, int] = {}
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def modules(self) -> list[str]:
        return list(self.a)

    @property
    def capacity(self) -> int:
        return len(self.slots) - 1

    def used(self) -> int:
        return sum(1 for s in self.slots[1:] if s.key is not None)

    def ranks(self) -> list[int]:
        return [int(r) for r in self.tensors.ranks.tolist()]

    def lookup(self, key: VersionKey) -> int | None:
        with self._lock:
            index = self.by_key.get(key)
            if index is None or self.slots[index].retiring or self.slots[index].loading:
                return None
            return index

    def reserve(self, key: VersionKey) -> int:
        """Claims a free slot (or the least recently used idle one) for key; raises if every slot is busy."""
        with self._lock:
            free = [s for s in self.slots[1:] if s.key is None]
            if free:
                slot = free[0]
            else:
                idle = [s for s in self.slots[1:] if s.refs == 0 and not s.pinned and not s.loading]
                if not idle:
                    raise ResourceExhausted(
                        f"all {self.capacity} adapter slots are pinned or serving requests", reason="NO_FREE_SLOT"
                    )
                slot = min(idle, key=lambda s: s.last_used)
                assert slot.key is not None
                if self.by_key.get(slot.key) == slot.index:  # a duplicate load of the key may own the entry
                    del self.by_key[slot.key]
                self.evictions += 1
            slot.key, slot.rank, slot.refs, slot.pinned, slot.retiring, slot.loading = key, 0, 0, False, False, True
            slot.pin_tenant = None  # a pin belongs to a version: the slot's next occupant starts unpinned
            slot.scaling = 0.0
            slot.last_used = time.monotonic()  # LRU age starts at load, not at the previous occupant's last use
            self.scaling[slot.index] = 0.0
            self.tensors.ranks[slot.index] = 0
            self.tensors.unembed[slot.index] = 0
            return slot.index

    def fill(
        self,
        index: int,
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
        *,
        rank: int,
        scaling: float,
        artifact_sha256: str,
    ) -> None:
        """Copies one version's tensors into a reserved slot, then makes it visible to lookups."""
        slot = self.slots[index]
        with torch.no_grad():
            for module in slot.written:
                self.a[module][index].zero_()
                self.b[module][index].zero_()
            slot.written = set(weights)
            for module, (a, b) in weights.items():
                self.a[module][index, :rank].copy_(a)  # a: [r, d_in]
                self.b[module][index, :, :rank].copy_(b)  # b: [d_out, r]
            self.scaling[index] = scaling
            self.tensors.ranks[index] = rank
            self.tensors.unembed[index] = int(UNEMBED_MODULE in weights)
            self.written_bits[index] = sum(1 << i for i, module in enumerate(self.a) if module in weights)
            self.generation[index] += 1
        with self._lock:
            assert slot.key is not None
            slot.rank, slot.scaling, slot.loading = rank, scaling, False
            slot.load_time = time.time()
            slot.artifact_sha256 = artifact_sha256
            self.by_key[slot.key] = index

    def abandon(self, index: int) -> None:
        """A reserved slot whose load failed goes back to the free list."""
        with self._lock:
            self._free(self.slots[index])

    def acquire(self, index: int) -> None:
        if index == 0:
            return  # the base model needs no pin
        with self._lock:
            slot = self.slots[index]
            slot.refs += 1
            slot.last_used = time.monotonic()

    def release(self, index: int) -> None:
        if index == 0:
            return
        with self._lock:
            slot = self.slots[index]
            slot.refs -= 1
            assert slot.refs >= 0, f"slot {index} released more often than acquired"
            slot.last_used = time.monotonic()
            if slot.refs == 0 and slot.retiring:
                self._free(slot)

    def set_pinned(self, index: int, pinned: bool) -> None:
        """An uncounted pin (an admin's), or no pin at all."""
        with self._lock:
            slot = self.slots[index]
            slot.pinned, slot.pin_tenant = pinned, None

    def pin(self, index: int, tenant: str | None) -> None:
        """Pins a slot against eviction, counted against `tenant` (None: counted against no one). A slot already
        pinned keeps its pin and the tenant it counts against: pinning a version again counts it once."""
        with self._lock:
            slot = self.slots[index]
            if not slot.pinned:
                slot.pinned, slot.pin_tenant = True, tenant

    def pinned_by(self, tenant: str) -> set[VersionKey]:
        """The versions whose pins count against `tenant`."""
        with self._lock:
            return {s.key for s in self.slots[1:] if s.pinned and s.pin_tenant == tenant and s.key is not None}

    def unload(self, key: VersionKey) -> bool | None:
        """None if not resident; True if freed now; False if freed when its running requests end."""
        with self._lock:
            index = self.by_key.get(key)
            if index is None:
                return None
            slot = self.slots[index]
            slot.pinned, slot.pin_tenant = False, None  # released now, even while its last requests still run
            if slot.refs == 0:
                self._free(slot)
                return True
            slot.retiring = True
            return False

    def _free(self, slot: Slot) -> None:
        if slot.key is not None and self.by_key.get(slot.key) == slot.index:
            del self.by_key[slot.key]
        slot.key, slot.rank, slot.refs, slot.pinned, slot.scaling = None, 0, 0, False, 0.0
        slot.pin_tenant = None
        slot.retiring = slot.loading = False
        self.scaling[slot.index] = 0.0  # rows that still point here add nothing
        self.tensors.ranks[slot.index] = 0
        self.tensors.unembed[slot.index] = 0

    def total_refs(self) -> int:
        with self._lock:
            return sum(s.refs for s in self.slots)
