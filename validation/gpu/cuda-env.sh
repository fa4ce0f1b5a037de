# Sourced by validation/gpu/*.sh: the GPU machine's CUDA libraries and tools on the search paths
# (those that exist there: the toolkit's libraries and compute-sanitizer, Nsight Systems and
# Nsight Compute where installed, the CUDA 13 libraries of the torch environment last), and one
# rayon thread per core of that machine unless the caller chose.
for d in /usr/local/cuda/lib64 /usr/local/cuda-13.0/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin /opt/nvidia/nsight-systems/*/bin \
         /usr/local/cuda/nsight-systems-*/bin /opt/nvidia/nsight-compute/*; do
  [ -d "$d" ] && export PATH="$PATH:$d"
done
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-16}
