#!/usr/bin/env bash
# Installs the pinned torch into the virtual environment: `scripts/install-torch.sh PYTHON VERSION [PIP ARGS…]`.
#
# With pip arguments (TORCH_PIP_ARGS in the Makefile) they decide. Without them, on Linux without an
# NVIDIA GPU the CPU build is taken from PyTorch's CPU index (about 200 MB, where PyPI's default
# Linux wheel is the CUDA build and pulls several GB of CUDA libraries). When that index cannot be
# reached within a few seconds (a machine whose pip only reaches a mirror), the configured index is
# used and this says so.
set -euo pipefail
python="$1"
version="$2"
shift 2
cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

if [ "$#" -gt 0 ]; then
    exec "$python" -m pip install "$@" "torch==$version"
fi
has_nvidia_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]
}
if [ "$(uname -s)" = "Linux" ] && ! has_nvidia_gpu; then
    if "$python" - "$cpu_index/torch/" <<'EOF' 2>/dev/null; then
import sys
import urllib.request

urllib.request.urlopen(sys.argv[1], timeout=8).close()
EOF
        echo "no NVIDIA GPU: installing the CPU build of torch $version from $cpu_index" >&2
        exec "$python" -m pip install --index-url "$cpu_index" --extra-index-url https://pypi.org/simple "torch==$version"
    fi
    echo "no NVIDIA GPU, but $cpu_index cannot be reached: installing torch $version from the configured index" \
        "(on PyPI that is the CUDA build; TORCH_PIP_ARGS=\"--index-url $cpu_index\" picks the CPU build)" >&2
fi
exec "$python" -m pip install "torch==$version"
