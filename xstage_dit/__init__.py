"""xstage_dit: Ulysses sequence-parallel inference for diffusers Diffusion Transformers.

    pipe = xstage_dit.enable(pipe)   # under torchrun: every rank runs its share of the sequence
"""
from .api import cuda_graph_use, disable, enable, installed_layers, is_main_process
from .config import XStageConfig
from .runtime.distributed import local_device
from .sp.attention.backends import available_backends

__all__ = ["enable", "disable", "installed_layers", "is_main_process", "cuda_graph_use", "local_device",
           "available_backends", "XStageConfig"]
__version__ = "0.1.0"
