#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager and kube-proxy 1.20.2 from Debian's
# `kubernetes` source package with Debian's own Go, once, into ~/.cache/kube-apiserver-1.20
# (KUBE_CACHE_DIR), and install etcd, iptables and openssl: what graceful's Kubernetes tests
# and `graceful demo --kubernetes` run (src/graceful/_demo/_kube.py).  Idempotent: a second
# run with the binaries built by this recipe returns at once.  9-13 min on 2 cores once,
# ~2.1 GB of scratch disk, 1.3 GB peak memory.  Root (or sudo) for apt-get.
#
# Run it OUTSIDE any network namespace: apt-get needs the machine's network.
# The recipe is the one of ../shared/tools/kube-apiserver/start-apiserver.sh (same cache
# and RECIPE stamp, so either reuses the other's build); the facts it relies on are there.
set -euo pipefail

CACHE_DIR=${KUBE_CACHE_DIR:-$HOME/.cache/kube-apiserver-1.20}
BIN=$CACHE_DIR/kube-apiserver
log() { echo "# tools/kube/build.sh: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# Write a deb-src entry for each configured deb entry (same URIs, suites, components, keys),
# read from the machine's own apt configuration (deb822 *.sources and one-line *.list files).
add_deb_src() {
  python3 - <<'PY' | as_root tee /etc/apt/sources.list.d/deb-src-twin.sources >/dev/null
import glob, re
out = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        lines = [l for l in stanza.splitlines() if l.strip() and not l.lstrip().startswith("#")]
        if any(re.fullmatch(r"Types:\s*(.*\s)?deb(\s.*)?", l) for l in lines):
            out.append("\n".join("Types: deb-src" if l.startswith("Types:") else l for l in lines))
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        text = open(path).read()
    except OSError:
        continue
    for line in text.splitlines():
        m = re.match(r"deb\s+(\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.+)", line)
        if m:
            out.append("Types: deb-src\nURIs: %s\nSuites: %s\nComponents: %s" % m.group(2, 3, 4))
print("\n\n".join(out))
PY
}

build_apiserver() {
  mkdir -p "$CACHE_DIR"
  exec 9>"$CACHE_DIR/.build.lock"
  flock 9                                   # parallel callers: one builds, the others wait
  if [ -x "$BIN" ]; then return 0; fi
  log "no $BIN: building kube-apiserver from Debian's kubernetes source package (~4.5 min on 2 idle cores, ~2.1 GB in \$TMPDIR)"
  if ! grep -rqsE '^(Types:.*deb-src|deb-src )' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    add_deb_src                             # apt-get source needs a deb-src twin of the deb entry
  fi
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    golang-go make rsync jq dpkg-dev etcd-server openssl curl ca-certificates \
    golang-github-modern-go-reflect2-dev iptables conntrack >/dev/null
  local src; src=$(mktemp -d "${TMPDIR:-/tmp}/kube-src.XXXXXX")
  ( cd "$src" && apt-get source -qq kubernetes 2>&1 | grep -v '^W: Download is performed unsandboxed' || true )
  local tree; tree=$(echo "$src"/kubernetes-*/)
  [ -f "$tree/build/root/Makefile" ] || { log "apt-get source kubernetes failed"; exit 1; }
  # The vendored github.com/modern-go/reflect2 v1.0.1 is broken under Go >= 1.18 (bookworm has
  # 1.19): any pretty-printed JSON response holding a map (every `curl` GET, any ?pretty=true)
  # kills the apiserver with "unexpected fault address 0x0 / fatal error: fault" in
  # reflect2.UnsafeIterate. Debian's reflect2 1.0.2 (the upstream fix) drops in as is.
  local r2=vendor/github.com/modern-go/reflect2
  rm -f "$tree/$r2"/*.go "$tree/$r2"/*.s
  cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go \
     /usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$tree/$r2/"
  # hack/lib/init.sh forces GO111MODULE=off and a private GOPATH/GOCACHE under _output/;
  # the KUBE_GIT_* variables only set what `--version` and /version report.
  ( cd "$tree" && env -u GOFLAGS -u GOPATH GOPROXY=off CGO_ENABLED=0 \
      KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20 KUBE_GIT_TREE_STATE=clean \
      make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-proxy" )
  # the controller manager (endpointslice controller) and kube-proxy, for end-to-end runs
  cp "$tree/_output/bin/kube-controller-manager" "$tree/_output/bin/kube-proxy" "$CACHE_DIR/"
  cp "$tree/_output/bin/kube-apiserver" "$BIN.tmp.$$"
  echo "$RECIPE" >"$CACHE_DIR/RECIPE"
  mv "$BIN.tmp.$$" "$BIN"
  rm -rf "$src"
  log "built $BIN ($("$BIN" --version))"
}

RECIPE="kubernetes 1.20.2 (Debian source) + reflect2 1.0.2; make WHAT=cmd/{kube-apiserver,kube-controller-manager,kube-proxy}"

if [ "$(cat "$CACHE_DIR/RECIPE" 2>/dev/null)" != "$RECIPE" ]; then
  rm -f "$BIN"
fi
for name in kube-controller-manager kube-proxy; do
  [ -x "$CACHE_DIR/$name" ] || rm -f "$BIN"
done
[ -x "$BIN" ] || build_apiserver
if ! command -v etcd >/dev/null || ! command -v iptables >/dev/null || ! command -v openssl >/dev/null; then
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    etcd-server iptables openssl ca-certificates >/dev/null
fi
log "ready: $("$BIN" --version) in $CACHE_DIR"
echo "$CACHE_DIR"
