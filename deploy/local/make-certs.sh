#!/usr/bin/env bash
# Makes what a pstrain cluster needs to run with TLS and tokens: a CA, a
# server certificate, worker, admin and Prometheus client certificates (for
# mTLS), and the tokens of the three roles. With openssl only.
#
#   deploy/local/make-certs.sh DIR [--name DNS_OR_IP]... [--days N] [--owner UID[:GID]]
#                              [--prometheus-owner UID[:GID]] [--force]
#
# DIR gets (keys and tokens mode 0600):
#   ca.pem ca-key.pem            the cluster's CA (keep ca-key.pem offline)
#   server.pem server-key.pem    every pstrain-server (serverAuth + clientAuth:
#                                server 0 calls the other shards with it);
#                                names: localhost, 127.0.0.1, ::1 and each --name
#   worker.pem worker-key.pem    pstrain-worker's client certificate, also for
#                                its HTTPS /metrics: names localhost, 127.0.0.1,
#                                ::1 and pstrain-worker only, so that a worker's
#                                key cannot pose as a server
#   admin.pem admin-key.pem      the CLI's client certificate
#   prometheus.pem prometheus-key.pem
#                                Prometheus' client certificate (clientAuth
#                                only): /metrics of a daemon run with
#                                --require-client-cert refuses a scraper
#                                without a certificate of this CA
#   tokens                       the servers' --token-file ("ROLE TOKEN" lines)
#   worker.token admin.token     the workers' --token-file and the CLI's
#                                PSTRAIN_TOKEN_FILE
# Existing files are kept (run again to add only what is missing, such as
# prometheus.pem in a DIR made before it existed); --force makes new ones.
# --owner hands the files to the user the daemons run as (the images' 10001
# for deploy/docker/compose.yaml, which mounts them read-only), and the
# Prometheus files to --prometheus-owner (default with --owner: 65534, the
# nobody Prometheus' images run as).
# For Kubernetes: deploy/k8s/secret.yaml turns DIR into the
# pstrain-server-credentials, pstrain-worker-credentials,
# pstrain-admin-credentials and pstrain-prometheus-credentials Secrets.
set -euo pipefail
usage() { sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
[[ $# -ge 1 ]] || usage
[[ $1 == -h || $1 == --help ]] && usage 0
DIR=$1
shift
NAMES=() DAYS=825 FORCE=0 OWNER="" PROMETHEUS_OWNER=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --name) NAMES+=("$2"); shift 2 ;;
    --days) DAYS=$2; shift 2 ;;
    --force) FORCE=1; shift ;;
    --owner) OWNER=$2; shift 2 ;;
    --prometheus-owner) PROMETHEUS_OWNER=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "make-certs: unknown argument $1" >&2; usage ;;
  esac
done
command -v openssl >/dev/null || { echo "make-certs: openssl is not installed (apt-get install openssl)" >&2; exit 1; }
mkdir -p "$DIR"
cd "$DIR"
umask 077
[[ -n $OWNER && -z $PROMETHEUS_OWNER ]] && PROMETHEUS_OWNER=65534:65534
hand_over() {  # --owner and --prometheus-owner
  [[ -z $OWNER ]] || chown "$OWNER" ./*.pem tokens ./*.token
  [[ -z $PROMETHEUS_OWNER || ! -e prometheus.pem ]] ||
    chown "$PROMETHEUS_OWNER" prometheus.pem prometheus-key.pem
}
# EC P-256: fast handshakes, small certificates.
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
san() {  # subjectAltName: loopback plus the given names (default: --name entries)
  local list="DNS:localhost,IP:127.0.0.1,IP:::1" n
  (($#)) || set -- "${NAMES[@]}"
  for n in "$@"; do
    if [[ $n =~ ^[0-9.]+$ || $n == *:* ]]; then list+=",IP:$n"; else list+=",DNS:$n"; fi
  done
  echo "$list"
}
sign() {  # sign NAME CN EXTENDED_KEY_USAGE [SAN]
  local name=$1 cn=$2 eku=$3 alt=${4:-} ext
  ext=$(mktemp)
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n $alt ]] && echo "subjectAltName=$alt"
  } >"$ext"
  key "$name-key.pem"
  openssl req -new -key "$name-key.pem" -subj "/O=pstrain/CN=$cn" -out "$name.csr" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
    -days "$DAYS" -sha256 -extfile "$ext" -out "$name.pem" 2>/dev/null
  rm -f "$name.csr" "$ext"
}

if [[ $FORCE == 0 && -s ca.pem && -s server.pem && -s tokens && -s worker.token && -s admin.token ]]; then
  if [[ -s prometheus.pem ]]; then
    echo "make-certs: $DIR already has a CA, certificates and tokens (--force to replace them)"
  else
    # A DIR made before the scraper had a certificate: sign one with its CA.
    [[ -s ca-key.pem ]] || { echo "make-certs: $DIR has no prometheus.pem and no ca-key.pem to sign one with (run where ca-key.pem is, or --force)" >&2; exit 1; }
    sign prometheus pstrain-prometheus clientAuth
    rm -f ca.srl
    chmod 0644 prometheus.pem
    echo "make-certs: added the Prometheus client certificate to $DIR"
  fi
  hand_over
  exit 0
fi

key ca-key.pem
openssl req -x509 -new -key ca-key.pem -subj "/O=pstrain/CN=pstrain cluster CA" -days "$DAYS" \
  -sha256 -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.pem 2>/dev/null
sign server pstrain-server serverAuth,clientAuth "$(san)"
sign worker pstrain-worker serverAuth,clientAuth "$(san pstrain-worker)"
sign admin pstrain-admin clientAuth
sign prometheus pstrain-prometheus clientAuth
rm -f ca.srl

token() { openssl rand -hex 32; }
ADMIN=$(token) WORKER=$(token) PEER=$(token)
{
  echo "# pstrain-server --token-file: ROLE TOKEN (made by deploy/local/make-certs.sh)"
  echo "peer $PEER"
  echo "admin $ADMIN"
  echo "worker $WORKER"
} >tokens
echo "$WORKER" >worker.token
echo "$ADMIN" >admin.token
chmod 0644 ca.pem server.pem worker.pem admin.pem prometheus.pem
hand_over
echo "make-certs: CA, server/worker/admin/prometheus certificates and tokens in $DIR (server names: $(san))"
