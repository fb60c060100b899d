"""Shims that let SoulX-FlashHead's pipeline module be imported on a CPU without its GPU stack.

None of them changes the arithmetic of what the fixtures record:
- the package `__init__` files are skipped (`_common.skip_package_inits`);
- xfuser (multi-GPU) is replaced by a stand-in: the fixtures run one process, where the official
  code never calls it (`dist.is_initialized()` is false);
- the face-crop and colour-correction helpers (`flash_head/utils/utils.py`, `facecrop.py`, which
  need torchvision, pyloudnorm and mediapipe) are replaced: colour correction is off (strength 0)
  and no picture is read;
- `torch.cuda.synchronize` becomes a no-op (the generate loop calls it to time itself);
- `inference.py` reads `flash_head/configs/infer_params.yaml` relative to the working directory at
  import, so it is imported from the checkout's root.
"""
from __future__ import annotations

import contextlib
import os

import torch

import _common as C


def _unused(*_a, **_k):
    raise RuntimeError("a FlashHead helper the parity fixtures never call was called")


def import_flashhead(root):
    """(model module, pipeline module, inference module) of the official FlashHead code."""
    C.skip_package_inits(root, "flash_head")
    C.stub_module("xfuser")
    C.stub_module("xfuser.core")
    C.stub_module("xfuser.core.distributed", get_sequence_parallel_rank=_unused,
                  get_sequence_parallel_world_size=_unused, get_sp_group=_unused)
    C.stub_module("xfuser.core.long_ctx_attention", xFuserLongContextAttention=_unused)
    C.stub_module("flash_head.utils.utils", match_and_blend_colors_torch=_unused,
                  resize_and_centercrop=_unused)
    C.stub_module("flash_head.utils.facecrop", process_image=_unused)
    torch.cuda.synchronize = lambda *a, **k: None
    from flash_head.src.modules import flash_head_model as model_mod
    from flash_head.src.pipeline import flash_head_pipeline as pipe_mod
    with _cwd(root):
        import flash_head.inference as inf_mod
    return model_mod, pipe_mod, inf_mod


@contextlib.contextmanager
def _cwd(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def bare_pipeline(pipe_mod, device="cpu"):
    """A FlashHeadPipeline made without its checkpoint-loading constructor."""
    pipe = pipe_mod.FlashHeadPipeline.__new__(pipe_mod.FlashHeadPipeline)
    pipe.device = device
    pipe.param_dtype = torch.float32
    pipe.rank = 0
    pipe.use_usp = False
    pipe.num_timesteps = 1000
    pipe.use_timestep_transform = True
    return pipe
