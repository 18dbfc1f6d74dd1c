#!/bin/bash
# The kernel packages the GPU check's %%ddp section needs on the device machine, which has no
# IPython, ipykernel or jupyter_client and can download nothing: their wheels for its Python
# (3.12, x86-64 manylinux), without the packages its image already has (psutil, pygments,
# packaging, python-dateutil, six, typing-extensions), into .whl/ at the repository's root,
# which .gitignore ignores and the device tool's carry=['.whl'] takes along.
#
#   bash benchmarks/gpu_wheels.sh        # then: du -sh .whl (about 14 MiB; the limit is 64 MiB)
#
# The versions are the dev environment's (the ones nbddp's tests run with).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
git check-ignore -q .whl/ || { echo "add /.whl/ to .gitignore first" >&2; exit 1; }
mkdir -p .whl
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl \
    ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 parso==0.8.7 \
    matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53 \
    wcwidth==0.9.4 stack_data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 \
    traitlets==5.16.1 ipykernel==7.4.0 comm==0.2.3 debugpy==1.8.22 jupyter_client==8.10.0 \
    jupyter_core==5.9.1 platformdirs==4.14.8 nest-asyncio2==1.7.4 pyzmq==27.3.0 tornado==6.6.1
du -sh .whl
