"""`accelerate launch` target of tests/test_fsdp.py: `fsdp_cpu_shim.py train_accelerate.py ARGS` runs the trainer
under FSDP2 on CPU processes (gloo).

accelerate (1.15) turns an FSDP config into FSDP only for accelerator process groups (MULTI_GPU, MULTI_XPU, ...):
with ACCELERATE_USE_CPU=true the group is MULTI_CPU and the FSDP plugin is dropped without a word, so the run is
plain DDP. torch's fully_shard itself runs on CPU with gloo; this lifts that one gate (MULTI_CPU with an FSDP
plugin becomes FSDP, as MULTI_GPU would) and then runs the trainer unchanged, as its own __main__.
"""

import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_accelerator_state_init = AcceleratorState.__init__


def _init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _accelerator_state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as accelerate does for GPUs


AcceleratorState.__init__ = _init_with_cpu_fsdp
sys.argv = sys.argv[1:]  # the trainer's path, then its arguments
runpy.run_path(sys.argv[0], run_name="__main__")
