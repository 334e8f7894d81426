#!/usr/bin/env bash
# Builds the `gpu` tests, the GPU benchmark and examples/gpt's gpt_nccl here and packs them with
# the non-system shared libraries they load into the git-ignored .gpu-bundle/ (< 64 MiB) for a
# machine lent a GPU: copy it there and run .gpu-bundle/run.sh (tests/gpu/run.sh), which prints
# NCCL's version first and writes its results under $OUT. The work is tests/gpu/bundle.sh's.
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/gpu/bundle.sh" "$@"
