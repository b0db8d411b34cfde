#!/usr/bin/env bash
# Installs what tests/cluster needs (Debian's slurm-wlm, munge, openmpi-bin) when it is missing and we are root with
# apt-get; otherwise says so and leaves the tests to skip with that reason. Never fails the caller (make test).
set -u
declare -A tool_package=([slurmctld]=slurm-wlm [slurmd]=slurm-wlm [srun]=slurm-wlm [munged]=munge [mpirun]=openmpi-bin)
missing=()
for tool in "${!tool_package[@]}"; do
  if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1; then
    missing+=("${tool_package[$tool]}")
  fi
done
[ "${#missing[@]}" -eq 0 ] && exit 0
packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "tests/cluster: $packages not installed and not root with apt-get: the SLURM / MPI tests will skip"
  exit 0
fi
echo "tests/cluster: installing $packages (apt-get)"
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086
if ! apt-get install -y -q --no-install-recommends $packages >/tmp/anytrain-cluster-apt.log 2>&1; then
  # a fresh image has no package lists yet
  apt-get update -q >>/tmp/anytrain-cluster-apt.log 2>&1
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $packages >>/tmp/anytrain-cluster-apt.log 2>&1 \
    || echo "tests/cluster: apt-get install failed (see /tmp/anytrain-cluster-apt.log): the SLURM / MPI tests will skip"
fi
exit 0
