#!/usr/bin/env bash
# The local harness: real Kafka (KRaft, from Apache's jars on Maven Central), Redis and
# Prometheus (Debian packages) on 127.0.0.1, for development, tests and benchmarks.
#
#   scripts/services.sh install   apt packages and the Kafka jars (cached in .cache/)
#   scripts/services.sh up        start whatever is not running, wait until each answers, print settings
#   scripts/services.sh down      stop what `up` started (by pid file)
#   scripts/services.sh status    exit 0 when all three answer
#   scripts/services.sh env       print the RANKMETER_* connection settings
#   scripts/services.sh cluster-up    start a Redis Cluster of three masters, print its settings
#   scripts/services.sh cluster-down  stop it (`down` stops it too)
#   scripts/services.sh cluster-env   print the RANKMETER_REDIS_* settings for the cluster
#   scripts/services.sh cluster-status  exit 0 when the cluster answers with cluster_state:ok
#   scripts/services.sh kafka-alt-up DIR PORT [CONTROLLER_PORT]  a private single-node broker
#       in DIR (for tests that stop it), print its bootstrap; `down` never touches it
#   scripts/services.sh kafka-alt-stop DIR   SIGTERM it, keeping its data
#   scripts/services.sh kafka-alt-start DIR  start it again on the same data and ports, wait
#
# Ports are fixed and non-standard so they do not collide with a developer's own servers;
# override with RANKMETER_HARNESS_{KAFKA,REDIS,PROMETHEUS}_PORT. The cluster's masters listen
# on RANKMETER_HARNESS_REDIS_CLUSTER_PORT (17001) and the two ports after it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${RANKMETER_HARNESS_DIR:-$ROOT/.services}
JARS=$ROOT/.cache/kafka-jars
KAFKA_PORT=${RANKMETER_HARNESS_KAFKA_PORT:-19092}
CONTROLLER_PORT=$((KAFKA_PORT + 1))
REDIS_PORT=${RANKMETER_HARNESS_REDIS_PORT:-16379}
PROMETHEUS_PORT=${RANKMETER_HARNESS_PROMETHEUS_PORT:-19090}
CLUSTER_PORT=${RANKMETER_HARNESS_REDIS_CLUSTER_PORT:-17001}
CLUSTER_PORTS=("$CLUSTER_PORT" $((CLUSTER_PORT + 1)) $((CLUSTER_PORT + 2)))
HOST=127.0.0.1

log() { echo "services: $*" >&2; }
die() { log "error: $*"; exit 1; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install() {
    local missing=()
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    command -v mvn >/dev/null || missing+=(maven)
    command -v curl >/dev/null || missing+=(curl)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} with apt-get"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    # Debian's packages start their own daemons on the standard ports; the harness runs its own.
    if [ -f "$JARS/.complete" ] && [ "$JARS/.complete" -nt "$ROOT/deploy/kafka/pom.xml" ]; then
        return
    fi
    log "resolving the Kafka broker jars from Maven Central into .cache/kafka-jars"
    rm -rf "$JARS"
    mvn -q -B -f "$ROOT/deploy/kafka/pom.xml" dependency:copy-dependencies \
        -DoutputDirectory="$JARS" -DincludeScope=runtime
    touch "$JARS/.complete"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

kafka_answers() { kafka_answers_in "$STATE/kafka" "$KAFKA_PORT"; }
kafka_answers_in() { (exec 3<>/dev/tcp/$HOST/$2) 2>/dev/null && grep -q "Kafka Server started" "$1/kafka.log" 2>/dev/null; }
redis_answers() { [ "$(redis-cli -h $HOST -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ]; }
prometheus_answers() { curl -sf "http://$HOST:$PROMETHEUS_PORT/-/ready" >/dev/null 2>&1; }

wait_for() { # name check-function seconds
    local deadline=$((SECONDS + $3))
    until $2; do
        [ $SECONDS -lt $deadline ] || die "$1 did not answer within $3 s (log in $STATE/$1/)"
        sleep 0.3
    done
}

start_kafka() { start_kafka_in "$STATE/kafka" "$KAFKA_PORT" "$CONTROLLER_PORT"; }

start_kafka_in() { # dir port controller-port
    local dir=$1 KAFKA_PORT=$2 CONTROLLER_PORT=$3
    if pid_alive "$dir/pid"; then return; fi
    mkdir -p "$dir"
    cat > "$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
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
    local cp="$JARS/*"
    if [ ! -f "$dir/data/meta.properties" ]; then
        java -cp "$cp" kafka.tools.StorageTool format --ignore-formatted \
            -t "$(java -cp "$cp" kafka.tools.StorageTool random-uuid 2>/dev/null)" \
            -c "$dir/server.properties" > "$dir/format.log" 2>&1 || die "kafka storage format failed: $(tail -1 "$dir/format.log")"
    fi
    : > "$dir/kafka.log"
    nohup java -Xms256m -Xmx1g -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$ROOT/deploy/kafka/log4j2.properties" \
        -cp "$cp" kafka.Kafka "$dir/server.properties" >> "$dir/kafka.log" 2>&1 &
    echo $! > "$dir/pid"
}

start_redis() {
    local dir=$STATE/redis
    if pid_alive "$dir/pid"; then return; fi
    mkdir -p "$dir"
    redis-server --bind $HOST --port "$REDIS_PORT" --dir "$dir" --save "" --appendonly no \
        --daemonize yes --pidfile "$dir/pid" --logfile "$dir/redis.log"
}

start_prometheus() {
    local dir=$STATE/prometheus
    if pid_alive "$dir/pid"; then return; fi
    mkdir -p "$dir/data"
    # Scrapes itself until a rankmeter target is added (tests write their own configs).
    cat > "$dir/prometheus.yml" <<EOF
global:
  scrape_interval: 5s
scrape_configs:
  - job_name: prometheus
    static_configs:
      - targets: ["$HOST:$PROMETHEUS_PORT"]
EOF
    nohup prometheus --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
        --web.listen-address="$HOST:$PROMETHEUS_PORT" --web.enable-lifecycle \
        > "$dir/prometheus.log" 2>&1 &
    echo $! > "$dir/pid"
}

print_env() {
    echo "RANKMETER_KAFKA_BOOTSTRAP_SERVERS=$HOST:$KAFKA_PORT"
    echo "RANKMETER_REDIS_URL=redis://$HOST:$REDIS_PORT/0"
    echo "RANKMETER_PROMETHEUS_URL=http://$HOST:$PROMETHEUS_PORT"
}

up() {
    install
    start_redis
    start_kafka
    start_prometheus
    wait_for redis redis_answers 20
    wait_for prometheus prometheus_answers 60
    wait_for kafka kafka_answers 120
    log "Kafka, Redis and Prometheus are up (state and logs in $STATE)"
    print_env
}

stop_one() { stop_pidfile "$1" "$STATE/$1/pid"; }

stop_pidfile() { # name pidfile
    local name=$1 pidfile=$2
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    local pid; pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { log "$name did not stop in 20 s; killing it"; kill -9 "$pid"; }
    rm -f "$pidfile"
    log "stopped $name"
}

down() {
    cluster_down
    stop_one prometheus
    stop_one kafka
    stop_one redis
    # Data is disposable: the next `up` starts from empty topics and an empty Redis.
    rm -rf "$STATE"
}

status() { redis_answers && kafka_answers && prometheus_answers; }

# Redis Cluster: three masters, no replicas (enough to spread the partitions' hash tags over
# three slot owners; failover is Redis's business, not rankmeter's).
cluster_info() { redis-cli -h $HOST -p "$1" cluster info 2>/dev/null | tr -d '\r'; }
cluster_ok() {
    local port
    for port in "${CLUSTER_PORTS[@]}"; do
        cluster_info "$port" | grep -q '^cluster_state:ok$' || return 1
    done
}
cluster_nodes_answer() {
    local port
    for port in "${CLUSTER_PORTS[@]}"; do
        [ "$(redis-cli -h $HOST -p "$port" ping 2>/dev/null)" = PONG ] || return 1
    done
}

# Only settings rankmeter reads (it refuses unknown RANKMETER_REDIS_* variables), so that
# `env $(scripts/services.sh cluster-env) rankmeter serve` runs against the cluster.
print_cluster_env() {
    echo "RANKMETER_REDIS_URL=redis://$HOST:$CLUSTER_PORT/0"
    echo "RANKMETER_REDIS_CLUSTER=true"
}

cluster_up() {
    command -v redis-server >/dev/null || install
    local port dir
    for port in "${CLUSTER_PORTS[@]}"; do
        dir=$STATE/redis-cluster/$port
        pid_alive "$dir/pid" && continue
        mkdir -p "$dir"
        # nodes.conf in the node's own dir: a restarted node rejoins with its slots.
        redis-server --bind $HOST --port "$port" --dir "$dir" --save "" --appendonly no \
            --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000 \
            --daemonize yes --pidfile "$dir/pid" --logfile "$dir/redis.log"
    done
    wait_for redis-cluster cluster_nodes_answer 20
    # Fresh nodes own no slots: join them once. Nodes that already form the cluster are left as they are.
    if cluster_info "$CLUSTER_PORT" | grep -q '^cluster_slots_assigned:0$'; then
        local nodes=()
        for port in "${CLUSTER_PORTS[@]}"; do nodes+=("$HOST:$port"); done
        redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes \
            > "$STATE/redis-cluster/create.log" 2>&1 \
            || die "redis-cli --cluster create failed: $(tail -3 "$STATE/redis-cluster/create.log")"
    fi
    wait_for redis-cluster cluster_ok 30
    log "Redis Cluster is up on ports ${CLUSTER_PORTS[*]} (state and logs in $STATE/redis-cluster)"
    print_cluster_env
}

cluster_down() {
    local port
    for port in "${CLUSTER_PORTS[@]}"; do stop_one "redis-cluster/$port"; done
    # Disposable like the rest: the next cluster-up creates a fresh cluster.
    rm -rf "$STATE/redis-cluster"
}

# A private broker (tests that stop and restart Kafka must not touch the shared one). Its
# ports are kept in DIR/ports so that kafka-alt-start brings it back where it was.
kafka_alt_up() {
    local dir=${1:?usage: kafka-alt-up DIR PORT [CONTROLLER_PORT]} port=${2:?usage: kafka-alt-up DIR PORT [CONTROLLER_PORT]}
    [ -f "$JARS/.complete" ] || install
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    echo "$port ${3:-$((port + 1))}" > "$dir/ports"
    kafka_alt_start "$dir"
    echo "RANKMETER_KAFKA_BOOTSTRAP_SERVERS=$HOST:$port"
}

kafka_alt_start() {
    local dir=${1:?usage: kafka-alt-start DIR} port controller
    [ -f "$dir/ports" ] || die "no private broker in $dir (kafka-alt-up first)"
    dir=$(cd "$dir" && pwd)
    read -r port controller < "$dir/ports"
    start_kafka_in "$dir" "$port" "$controller"
    alt_answers() { kafka_answers_in "$dir" "$port"; }
    wait_for "kafka ($dir)" alt_answers 120
}

kafka_alt_stop() { stop_pidfile "kafka ($1)" "${1:?usage: kafka-alt-stop DIR}/pid"; }

case "${1:-}" in
    install) install ;;
    up) up ;;
    down) down ;;
    status) status ;;
    env) print_env ;;
    cluster-up) cluster_up ;;
    cluster-down) cluster_down ;;
    cluster-env) print_cluster_env ;;
    cluster-status) cluster_ok ;;
    kafka-alt-up) kafka_alt_up "${@:2}" ;;
    kafka-alt-start) kafka_alt_start "${@:2}" ;;
    kafka-alt-stop) kafka_alt_stop "${@:2}" ;;
    *) echo "usage: $0 install|up|down|status|env|cluster-up|cluster-down|cluster-env|cluster-status|kafka-alt-up|kafka-alt-start|kafka-alt-stop" >&2; exit 2 ;;
esac
