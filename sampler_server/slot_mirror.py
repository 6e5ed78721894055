"""The engine process's own copy of the adapter slots, on its device (CUDA).

On the CPU the engine process reads the slots where the server process writes them (`SlotPool(shared=True)`).
A GPU cannot read that memory in its kernels, and sharing device memory between the two processes would need
CUDA in the server process before the fork, which poisons the forked child. So the engine process keeps the
slots on its device and copies one in when a request naming it arrives and the slot's generation moved (a new
version was written there): the server writes a slot only while no sequence holds it and sends the request
through the pipe after the write, so the copy sees the whole version, and no running sequence reads the slot
while it is being copied. A load costs one host-to-device copy of the version's modules, not one per request.
"""

from __future__ import annotations

import torch

from opentinker.sampler_server.slot_pool import SlotPool, SlotTensors


class SlotMirror:
    def __init__(self, pool: SlotPool, device: torch.device) -> None:
        self.pool = pool
        shared = pool.tensors
        # A and B of every slot on the device, zero (slot 0, and slots never loaded, add nothing); B keeps the
        # pool's layout (a transposed view of [n_slots, r_max, d_out] storage), which the kernels expect.
        a = {m: torch.zeros(t.shape, dtype=t.dtype, device=device) for m, t in shared.a.items()}
        b = {
            m: torch.zeros(t.transpose(1, 2).shape, dtype=t.dtype, device=device).transpose(1, 2)
            for m, t in shared.b.items()
        }
        scaling = torch.zeros(shared.scaling.shape, dtype=shared.scaling.dtype, device=device)
        # ranks and unembed are read on the host by the engine: host copies, apart from the server's.
        self.tensors = SlotTensors(a, b, scaling, shared.ranks.clone(), shared.unembed.clone())
        self._seen = [0] * len(pool.slots)  # the generation each slot was last copied at
        self._written = [0] * len(pool.slots)  # the module bits each copy holds

    def sync(self, slot: int) -> bool:
        """Copies `slot` from the shared pool if a version was written there since the last copy; True if it
        copied. Called on the engine process's reader thread before the request reaches the engine."""
        generation = int(self.pool.generation[slot])
        if slot == 0 or generation == self._seen[slot]:
            return False
        shared, own = self.pool.tensors, self.tensors
        bits = int(self.pool.written_bits[slot])
        with torch.no_grad():
            for i, module in enumerate(shared.a):
                # The modules this version wrote, and those the previous one wrote (zero in the pool now); the
                # others were never written in either copy and are not read, so their pages stay uncommitted.
                if (bits | self._written[slot]) >> i & 1:
                    own.a[module][slot].copy_(shared.a[module][slot])
                    own.b[module][slot].copy_(shared.b[module][slot])
            own.scaling[slot] = shared.scaling[slot]
            own.ranks[slot] = shared.ranks[slot]
            own.unembed[slot] = shared.unembed[slot]
        self._seen[slot], self._written[slot] = generation, bits
        return True
