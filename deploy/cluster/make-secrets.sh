#!/bin/sh
# Credentials and certificates for deploy/cluster (docs/security.md), with openssl only:
#
#   sh deploy/cluster/make-secrets.sh [DIR]      # DIR: deploy/cluster/secrets by default
#
# A CA, a certificate for the NATS nodes (nats1..3, also used on their cluster routes), a client
# certificate for the robez replicas and the monitor user, and random passwords for robez's NATS user and
# the read-only monitor user. Nothing is overwritten: delete DIR to make new ones. For production, issue the
# certificates from your own CA and keep the files in your secret store; the file names are what
# docker-compose.yml mounts.
set -eu
dir=${1:-$(dirname "$0")/secrets}
if [ -e "$dir/ca.pem" ]; then
  echo "$dir already holds secrets; delete it to make new ones" >&2
  exit 1
fi
mkdir -p "$dir"
chmod 700 "$dir"
umask 077
cd "$dir"

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 \
  -subj "/O=robez/CN=robez NATS CA" -keyout ca.key -out ca.pem 2>/dev/null

issue() {  # issue NAME CN SAN: NAME.key + NAME.pem signed by the CA, for server and client use
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/O=robez/CN=$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm "$1.csr" "$1.ext"
}
issue server nats "DNS:nats1,DNS:nats2,DNS:nats3,DNS:localhost,IP:127.0.0.1"
issue client robez "DNS:robez"
rm -f ca.srl

password() { openssl rand -hex 24; }
robez=$(password)
printf 'ROBEZ_NATS_PASSWORD=%s\n' "$robez" > robez.env
printf 'ROBEZ_NATS_PASSWORD=%s\nNATS_MONITOR_PASSWORD=%s\n' "$robez" "$(password)" > nats.env
chmod 644 ca.pem server.pem client.pem
# The robez image runs as uid 10001, which must read its key through the bind mount.
chown 10001 client.key 2>/dev/null || chmod 644 client.key
echo "secrets in $dir: ca.pem, server.pem/.key (NATS), client.pem/.key (robez), nats.env, robez.env"
