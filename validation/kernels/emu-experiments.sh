#!/usr/bin/env bash
# The emulator tests of non-default kernel versions (experiments kept selectable by environment
# variables until issue 16 moves them out of the product): the real kernels/*.cu on the CPU
# emulator, compared with the CPU backend bit for bit. CI (.ci/run) runs every other mock test
# on the emulator; run this when you touch a non-default kernel.
#
#   validation/kernels/emu-experiments.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
validation/gpu/emu/build.sh "$PWD/target/emu"
TARFA_CUDA_EMU="$PWD/target/emu/libtarfa_emu.so" cargo test -p tarfa-cuda --lib -- \
    mock::tests::every_decode_kernel_version_gives_the_cpus_bits \
    mock::tests::the_second_row_kernels_give_the_cpus_bits
