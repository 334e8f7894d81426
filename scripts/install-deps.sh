#!/usr/bin/env bash
# Installs every Debian package morph needs to build and test. Idempotent: when all packages
# are present it changes nothing and does not touch the network.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libboost-dev libboost-system-dev
  libgoogle-glog-dev libgflags-dev
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev
  libgloo-dev
  nlohmann-json3-dev
  openmpi-bin libopenmpi-dev
  procps
  iproute2         # netns_test: hosts as network namespaces (ip netns, veth, bridge)
  prometheus  # promtool, for http_api_test (checks /metrics); 19 MB download
  clang-14 libclang-rt-14-dev libfuzzer-14-dev
  libopenblas-dev  # examples/gpt: matrix products
  fortunes-min     # examples/gpt: its training text (/usr/share/games/fortunes)
  gnuplot-nox      # make demo: the loss plot
  # Coordinator failover's tests (label ha) start private etcd clusters on loopback ports of
  # their own. Under systemd the package enables etcd.service on 127.0.0.1:2379 (ports the
  # tests never use); in containers policy-rc.d keeps it from starting at all.
  etcd-server

  # Slurm 22.05 for the slurm tests' private cluster (scripts/slurm-local.sh); nothing starts
  # on install. Never purge libmunge2 with them: Open MPI depends on it.
  slurmd slurmctld slurm-client munge
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

# etcd-server was not installed before: its system service is not ours to run (the tests start
# their own clusters), so it does not stay on 2379 on a systemd host.
if [[ " ${missing[*]} " == *" etcd-server "* ]] && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now etcd.service >/dev/null 2>&1 || true
fi
