"""Install xstage_dit. The pure-Python package installs anywhere; the CUDA extension in csrc/ is built only
where torch with CUDA and nvcc are available at build time (``pip install --no-build-isolation -e .``)."""
import glob
import os

from setuptools import find_packages, setup



def cuda_extensions() -> tuple[list, dict]:
    """Return (ext_modules, cmdclass) for csrc/, or nothing, with one line saying why, without CUDA (or with
    XSTAGE_SKIP_CUDA_EXT=1)."""
    if os.environ.get("XSTAGE_SKIP_CUDA_EXT") == "1":
        print("xstage_dit: XSTAGE_SKIP_CUDA_EXT=1; skipping the optional CUDA extension (csrc/)")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("xstage_dit: torch is not importable at build time; skipping the optional CUDA extension (csrc/)")
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print("xstage_dit: no CUDA toolkit for this torch build; skipping the optional CUDA extension (csrc/)")
        return [], {}
    sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    if not sources:
        return [], {}
    ext = CUDAExtension(
        "xstage_dit._C",
        sources,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-gencode=arch=compute_90a,code=sm_90a"]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()

setup(
    name="xstage_dit",
    version="0.1.0",
    description="Ulysses sequence-parallel inference for diffusers DiTs with X-Stage-aware fused kernels",
    packages=find_packages(include=["xstage_dit", "xstage_dit.*"]),
    package_data={"xstage_dit": ["calibrations/*.json"]},
    python_requires=">=3.10",
    # what the package imports; the diffusers range is the one the tests ran on
    install_requires=["torch>=2.5", "diffusers>=0.42.1,<0.43"],
    extras_require={
        "fused": ["triton>=3.6"],  # the fused backend's kernels (CUDA builds of torch usually bring it)
        "nvshmem": ["nvidia-nvshmem-cu13"],  # symmetric memory across GPUs
        "examples": ["transformers"],  # diffusers' pipeline classes import it
        # diffusers' export_to_video, for MP4 output; PyAV muxes an audio-video model's sound (LTX-2)
        "video": ["imageio", "imageio-ffmpeg", "av"],
        "bench": ["matplotlib"],
        # the generation service (python -m xstage_dit.serve); httptools: uvicorn's HTTP parser in C, not h11's Python
        # python-multipart: the edits endpoint's forms
        "serve": ["fastapi", "uvicorn", "httptools", "prometheus-client", "python-multipart"],
        # triton runs the kernels in its CPU interpreter without a GPU; that interpreter breaks on numpy >= 2.4
        # cache-dit: its caches are tested with xstage_dit, its parallelism (einops) refused
        # the video extra's packages: the MP4 outputs of the example and the service are tested too
        # openai: the service is checked with OpenAI's own client; setuptools: a test builds the wheel
        # torchao, gguf and bitsandbytes: quantized models under enable (tests/test_quantized.py), on the versions
        # tested
        # pytest-xdist: the suite runs on two workers (.ci/run), each taking whole test files
        "test": ["pytest", "pytest-xdist", "setuptools>=70.1", "transformers", "triton==3.6.0", "numpy<2.4", "peft",
                 "fastapi", "uvicorn", "httptools", "prometheus-client", "python-multipart", "openai", "httpx",
                 "cache-dit[parallelism]>=1.5,<1.6", "imageio", "imageio-ffmpeg", "av", "torchao>=0.18,<0.19",
                 "gguf>=0.19,<0.20", "bitsandbytes>=0.50,<0.51"],
    },
    license="MIT",
    license_files=["LICENSE"],
    entry_points={"console_scripts": ["xstage-dit=xstage_dit.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
