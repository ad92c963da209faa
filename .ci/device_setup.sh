# Sourced by the device scripts (.ci/device.sh, .ci/multi_gpu.sh) from the repository root: the environment every
# process needs, and the install (offline machine: wheels from .whl, the project built without build isolation;
# setuptools and torch come from the image; csrc/ is compiled unless XSTAGE_SKIP_CUDA_EXT=1). Leaves the shell in
# /tmp with REPO, OUT and PYTHONPATH set, importing the installed package (built with csrc/'s xstage_dit._C).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$PWD; OUT=${OUT:-$REPO/out}; mkdir -p "$OUT"
export XSTAGE_CALIBRATION_DIR=${XSTAGE_CALIBRATION_DIR:-$OUT/calibration}
rm -rf /tmp/site  # a warm machine keeps the last call's install: pip --target would not replace it
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || exit 1
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . > "$OUT/install.log" 2>&1; then
  # a broken csrc/ build must not cost the rest of the run: report it, install without the probes
  grep -E "error|Error" "$OUT/install.log" | head -20
  XSTAGE_SKIP_CUDA_EXT=1 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
    >> "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site
cd /tmp  # import the installed package, which has the compiled xstage_dit._C; the checkout has not
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/gpu.txt"
