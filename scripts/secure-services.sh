#!/usr/bin/env bash
# A second, secured harness on 127.0.0.1, next to scripts/services.sh (which it does not touch):
#   - an Apache Kafka broker (KRaft) whose only client listener is SASL_SSL with SCRAM-SHA-512,
#     certificates from the JDK's keytool (a throwaway CA and one server certificate);
#   - a Redis that speaks only TLS, with the default user disabled and an ACL user.
#
#   scripts/secure-services.sh up       generate what is missing, start what is not running, wait, print settings
#   scripts/secure-services.sh down     stop what `up` started (by pid file) and delete its state
#   scripts/secure-services.sh status   exit 0 when both answer (authenticated)
#   scripts/secure-services.sh env      print the RANKMETER_* settings a client needs
#
# State (passwords, certificates, data, logs) lives in .services-secure/, not under .services/:
# `scripts/services.sh down` deletes .services/ and would orphan these processes' pid files.
# Ports: RANKMETER_SECURE_{KAFKA,REDIS}_PORT (the controller listens on the Kafka port + 1).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${RANKMETER_SECURE_HARNESS_DIR:-$ROOT/.services-secure}
JARS=$ROOT/.cache/kafka-jars
KAFKA_PORT=${RANKMETER_SECURE_KAFKA_PORT:-19192}
CONTROLLER_PORT=$((KAFKA_PORT + 1))
REDIS_PORT=${RANKMETER_SECURE_REDIS_PORT:-16380}
HOST=127.0.0.1
TLS=$STATE/tls
SECRETS=$STATE/secrets.env
USER_NAME=rankmeter

log() { echo "secure-services: $*" >&2; }
die() { log "error: $*"; exit 1; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install() {
    # Java, redis-server, curl and the Kafka jars come from the plain harness's installer.
    "$ROOT/scripts/services.sh" install
    if ! command -v openssl >/dev/null || ! command -v keytool >/dev/null; then
        log "installing openssl and the JDK's keytool with apt-get"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
            openssl openjdk-17-jre-headless >/dev/null
    fi
}

# Letters and digits only: no character that needs quoting in a URL, in RANKMETER_KAFKA_CLIENT's
# k=v,k=v form or in a JAAS line; the leading letter keeps it a string there (not a number).
random_password() { echo "p$(head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24)"; }

make_secrets() {
    [ -f "$SECRETS" ] && return
    mkdir -p "$STATE"
    (umask 077
     { echo "KAFKA_PASSWORD=$(random_password)"
       echo "KAFKA_ADMIN_PASSWORD=$(random_password)"  # the broker's own inter-broker login
       echo "REDIS_PASSWORD=$(random_password)"
       echo "STORE_PASSWORD=$(random_password)"        # the PKCS12 key and trust stores
     } > "$SECRETS.tmp")
    mv "$SECRETS.tmp" "$SECRETS"
}

load_secrets() {
    [ -f "$SECRETS" ] || die "no secrets in $STATE: run '$0 up' first"
    # shellcheck disable=SC1090
    . "$SECRETS"
}

make_certificates() {
    [ -f "$TLS/.complete" ] && return
    rm -rf "$TLS"
    mkdir -p "$TLS"
    chmod 700 "$TLS"
    local kt=(keytool -noprompt -storetype PKCS12 -storepass "$STORE_PASSWORD")
    local san="SAN=dns:localhost,ip:$HOST"
    {
        # The CA: a self-signed certificate allowed to sign others (basic constraints CA:true).
        "${kt[@]}" -genkeypair -alias ca -keyalg RSA -keysize 2048 -validity 3650 \
            -dname "CN=rankmeter harness CA" -ext bc:c -keystore "$TLS/ca.p12"
        "${kt[@]}" -exportcert -rfc -alias ca -keystore "$TLS/ca.p12" -file "$TLS/ca.pem"
        # The server certificate, for 127.0.0.1 and localhost, signed by the CA. clientAuth too:
        # the broker presents it to its own controller listener (mutual TLS there).
        "${kt[@]}" -genkeypair -alias server -keyalg RSA -keysize 2048 -validity 825 \
            -dname "CN=localhost" -ext "$san" -keystore "$TLS/server.p12"
        "${kt[@]}" -certreq -alias server -keystore "$TLS/server.p12" -file "$TLS/server.csr"
        "${kt[@]}" -gencert -rfc -alias ca -keystore "$TLS/ca.p12" -validity 825 \
            -infile "$TLS/server.csr" -outfile "$TLS/server.pem" \
            -ext "$san" -ext ku:c=digitalSignature,keyEncipherment -ext eku=serverAuth,clientAuth
        "${kt[@]}" -importcert -alias ca -file "$TLS/ca.pem" -keystore "$TLS/server.p12"
        "${kt[@]}" -importcert -alias server -file "$TLS/server.pem" -keystore "$TLS/server.p12"
        "${kt[@]}" -importcert -alias ca -file "$TLS/ca.pem" -keystore "$TLS/truststore.p12"
        # Redis wants PEM: the private key comes out of the PKCS12 store with openssl.
        openssl pkcs12 -in "$TLS/server.p12" -passin "pass:$STORE_PASSWORD" -nocerts -nodes \
            -out "$TLS/server.key"
    } > "$TLS/keytool.log" 2>&1 || die "certificate generation failed: $(tail -3 "$TLS/keytool.log")"
    chmod 600 "$TLS/server.key"
    touch "$TLS/.complete"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

kafka_answers() { (exec 3<>/dev/tcp/$HOST/$KAFKA_PORT) 2>/dev/null && grep -q "Kafka Server started" "$STATE/kafka/kafka.log" 2>/dev/null; }
redis_answers() {
    # REDISCLI_AUTH rather than --pass: the password stays out of the process list.
    [ "$(REDISCLI_AUTH=$REDIS_PASSWORD redis-cli --tls --cacert "$TLS/ca.pem" -h $HOST -p "$REDIS_PORT" \
        --user $USER_NAME ping 2>/dev/null)" = PONG ]
}

wait_for() { # name check-function seconds
    local deadline=$((SECONDS + $3))
    until $2; do
        [ $SECONDS -lt $deadline ] || die "$1 did not answer within $3 s (log in $STATE/$1/)"
        sleep 0.3
    done
}

start_kafka() {
    local dir=$STATE/kafka
    if pid_alive "$dir/pid"; then return; fi
    mkdir -p "$dir"
    chmod 700 "$dir"  # server.properties holds the store and inter-broker passwords
    cat > "$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=SASL_SSL://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$CONTROLLER_PORT
advertised.listeners=SASL_SSL://$HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
# The controller cannot use SCRAM (its credentials live in the metadata it serves): mutual TLS there.
listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL
listener.name.controller.ssl.client.auth=required
inter.broker.listener.name=SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$KAFKA_ADMIN_PASSWORD";
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS/server.p12
ssl.keystore.password=$STORE_PASSWORD
ssl.key.password=$STORE_PASSWORD
ssl.truststore.type=PKCS12
ssl.truststore.location=$TLS/truststore.p12
ssl.truststore.password=$STORE_PASSWORD
log.dirs=$dir/data
num.partitions=4
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
EOF
    chmod 600 "$dir/server.properties"
    local cp="$JARS/*"
    if [ ! -f "$dir/data/meta.properties" ]; then
        # SCRAM credentials go into the metadata log at format time: no admin call needed later.
        java -cp "$cp" kafka.tools.StorageTool format --ignore-formatted \
            -t "$(java -cp "$cp" kafka.tools.StorageTool random-uuid 2>/dev/null)" \
            -c "$dir/server.properties" \
            --add-scram "SCRAM-SHA-512=[name=$USER_NAME,password=$KAFKA_PASSWORD]" \
            --add-scram "SCRAM-SHA-512=[name=admin,password=$KAFKA_ADMIN_PASSWORD]" \
            > "$dir/format.log" 2>&1 || die "kafka storage format failed: $(tail -1 "$dir/format.log")"
    fi
    : > "$dir/kafka.log"
    nohup java -Xms128m -Xmx512m -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$ROOT/deploy/kafka/log4j2.properties" \
        -cp "$cp" kafka.Kafka "$dir/server.properties" >> "$dir/kafka.log" 2>&1 &
    echo $! > "$dir/pid"
}

start_redis() {
    local dir=$STATE/redis
    if pid_alive "$dir/pid"; then return; fi
    mkdir -p "$dir"
    chmod 700 "$dir"
    # A config file rather than arguments: the ACL password stays out of the process list.
    (umask 077; cat > "$dir/redis.conf" <<EOF
bind $HOST
port 0
tls-port $REDIS_PORT
tls-cert-file $TLS/server.pem
tls-key-file $TLS/server.key
tls-ca-cert-file $TLS/ca.pem
tls-auth-clients no
dir $dir
save ""
appendonly no
daemonize yes
pidfile $dir/pid
logfile $dir/redis.log
user default off
user $USER_NAME on >$REDIS_PASSWORD ~* &* +@all
EOF
    )
    redis-server "$dir/redis.conf"
}

print_env() {
    load_secrets
    echo "RANKMETER_KAFKA_BOOTSTRAP_SERVERS=$HOST:$KAFKA_PORT"
    echo "RANKMETER_KAFKA_CLIENT=security_protocol=SASL_SSL,sasl_mechanism=SCRAM-SHA-512,sasl_plain_username=$USER_NAME,sasl_plain_password=$KAFKA_PASSWORD,ssl_cafile=$TLS/ca.pem"
    echo "RANKMETER_REDIS_URL=rediss://$USER_NAME:$REDIS_PASSWORD@$HOST:$REDIS_PORT/0?ssl_ca_certs=$TLS/ca.pem"
    echo "RANKMETER_SECURE_CA_FILE=$TLS/ca.pem"
}

up() {
    install
    make_secrets
    load_secrets
    make_certificates
    start_redis
    start_kafka
    wait_for redis redis_answers 20
    wait_for kafka kafka_answers 120
    log "SASL_SSL Kafka on $HOST:$KAFKA_PORT and TLS Redis on $HOST:$REDIS_PORT are up (state in $STATE)"
    print_env
}

stop_one() {
    local name=$1 pidfile=$STATE/$1/pid
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    local pid; pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { log "$name did not stop in 20 s; killing it"; kill -9 "$pid"; }
    rm -f "$pidfile"
    log "stopped $name"
}

down() {
    stop_one kafka
    stop_one redis
    # Data, passwords and certificates are disposable: the next `up` makes new ones.
    rm -rf "$STATE"
}

status() { [ -f "$SECRETS" ] && load_secrets && redis_answers && kafka_answers; }

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    env) print_env ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
