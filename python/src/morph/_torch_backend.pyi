"""morph's torch.distributed backend (python/src/torch_backend.cc; morph.distributed uses it)."""
from torch._C._distributed_c10d import Backend

class MorphBackend(Backend):
    def invalidate(self) -> None: ...

def create(comm_address: int, name: str, timeout_ms: int) -> MorphBackend: ...
