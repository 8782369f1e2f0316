#!/bin/bash
# Builds what a lent GPU machine without network needs for `real_engine.py --gpu` (issue 33): vLLM 0.24.0
# and the small wheels its import path takes (wheels.txt; the machine has Python 3.12 and torch 2.11.0+cu130,
# which vLLM 0.24.0 pins: a newer vLLM pins torch 2.13), and a redis-server with its libraries, cut into
# parts that each fit one call of the device tool (64 MiB with the working tree).
#
#   bash bench/engines/gpu_lease/bundle.sh DEST [FILE...]
#
# DEST: the checkout the device tool sends, whose .git/info/exclude ignores /.dev/; writes DEST/.dev/p1..pN.
# FILE: files of this tree (relative paths) to lay over the sent tree on the device (an overlay), for a
# tree that differs from DEST's. Then, one device call each, back to back (the machine keeps /tmp while warm):
#   carry .dev/p1: bash .dev/p1/dev.sh setup            (starts the extract and the model's writing)
#   carry .dev/pK: bash .dev/pK/dev.sh part K           (K = 2 .. N-1)
#   carry .dev/pN: bash .dev/pN/dev.sh part N; bash .dev/pN/dev.sh final      (warm-up, run 1)
#   carry .dev/pN: bash .dev/pN/dev.sh run2             (FILES=, LINES=, KV=, CASES= choose the run; final takes them too)
# Needs here: pip (PyPI), gzip, split, and /usr/bin/redis-server (Debian's; its libraries go along).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
DEST=$(cd "$1" && pwd)
shift
PART_MIB=${PART_MIB:-56}
WORK=$(mktemp -d /tmp/gpu-lease-XXXXXX)
trap 'rm -rf "$WORK"' EXIT

plat=(--python-version 3.12 --implementation cp --only-binary=:all:)
for n in $(seq 5 39); do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
       --platform linux_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$WORK/whl" -r "$HERE/wheels.txt"
python3 -m pip install -q --no-deps --no-index --no-compile "${plat[@]}" --target "$WORK/site" "$WORK"/whl/*.whl
# not on the path of a dense model on Hopper: the Rust front end (only with VLLM_RUST_FRONTEND_PATH), the
# Blackwell attention sources, DeepGEMM's extension for other Pythons
rm -rf "$WORK/site/vllm/vllm-rs" "$WORK/site/vllm/third_party/fmha_sm100"
rm -f "$WORK"/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
tar -C "$WORK/site" -cf - . | gzip -6 > "$WORK/site.tar.gz"

# redis-server: the binary is redis-check-rdb under redis-server's name (it picks its mode by that name),
# its libraries beside it for its process alone (LD_LIBRARY_PATH in the wrapper, not in the bench's)
mkdir -p "$WORK/redis/lib"
bin=$(readlink -f /usr/bin/redis-server)
cp "$bin" "$WORK/redis/redis-server"
for lib in $(ldd "$bin" | awk '/=>/ {print $3}'); do
  case $(basename "$lib") in libc.so.6|libm.so.6|libstdc++.so.6|libgcc_s.so.1) ;; *) cp -L "$lib" "$WORK/redis/lib/" ;; esac
done
cat > "$WORK/redis/redis-server.sh" <<'EOF'
#!/bin/sh
d=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/redis-server" "$@"
EOF
chmod +x "$WORK/redis/redis-server.sh"
tar -C "$WORK/redis" -czf "$WORK/redis.tar.gz" .

mkdir -p "$WORK/chunks"
split -b "${PART_MIB}M" -a 2 -d "$WORK/site.tar.gz" "$WORK/chunks/c"
n=$(ls "$WORK/chunks" | wc -l)
rm -rf "$DEST/.dev"
for k in $(seq 1 "$n"); do
  mkdir -p "$DEST/.dev/p$k"
  mv "$WORK/chunks/c$(printf %02d $((k - 1)))" "$DEST/.dev/p$k/c$k"
  sed "s/^NPARTS=\${NPARTS:-6}/NPARTS=\${NPARTS:-$n}/" "$HERE/dev.sh" > "$DEST/.dev/p$k/dev.sh"
done
cp "$WORK/redis.tar.gz" "$DEST/.dev/p$n/"
for f in "$@"; do
  mkdir -p "$DEST/.dev/p$n/overlay/$(dirname "$f")"
  cp "$ROOT/$f" "$DEST/.dev/p$n/overlay/$f"
done
du -sh "$DEST"/.dev/p*
# each call carries one part beside the working tree: 64 MiB in all
for d in "$DEST"/.dev/p*; do
  [ "$(du -sm "$d" | cut -f1)" -le 60 ] || echo "WARNING: $d is over 60 MiB: PART_MIB smaller"
done
