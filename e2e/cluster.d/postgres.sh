# shellcheck shell=bash
# Sourced by e2e/cluster: a throwaway PostgreSQL (e2e/cluster postgres up|down|env|status).

# ---------------------------------------------------------------------------
# PostgreSQL for the history store tests (e2e/tests/history_stores.rs). A cluster of its
# own, thrown away at `down`: initdb without fsync, trust on loopback (listening there
# only), a free port. PostgreSQL refuses to run as root: as root it runs as the `postgres`
# system user the package creates, from a data directory that user can reach.
# ---------------------------------------------------------------------------
PG_DIR="$E2E_DIR/postgres"
PG_DB="agentrun"

pg_bindir() {
  local d
  for d in ${AGENTRUN_PG_BINDIR:-} $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [[ -x "$d/initdb" && -x "$d/pg_ctl" ]]; then echo "$d"; return 0; fi
  done
  if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
    dirname "$(command -v pg_ctl)"; return 0
  fi
  return 1
}

pg_install() {
  pg_bindir >/dev/null && return
  command -v apt-get >/dev/null || die "PostgreSQL is required (apt-get install postgresql)"
  log "installing postgresql (Debian package)"
  local sudo=(env DEBIAN_FRONTEND=noninteractive); [[ $(id -u) -eq 0 ]] || sudo=(sudo DEBIAN_FRONTEND=noninteractive)
  # The package would create and start a cluster of its own on 5432: the tests need none.
  "${sudo[@]}" mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" | "${sudo[@]}" tee /etc/postgresql-common/createcluster.d/agentrun-e2e.conf >/dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends postgresql >/dev/null \
    || { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq --no-install-recommends postgresql >/dev/null; } \
    || die "installing postgresql failed"
  pg_bindir >/dev/null || die "postgresql installed, but no initdb and pg_ctl under /usr/lib/postgresql/*/bin"
}

# Runs a PostgreSQL command as the user that owns the cluster.
pg_as() {
  if [[ $(id -u) -eq 0 ]]; then
    id postgres >/dev/null 2>&1 || die "no postgres system user to run PostgreSQL as (PostgreSQL refuses root)"
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

# The data directory: under PG_DIR, or (as root, when the postgres user cannot reach
# PG_DIR, e.g. a checkout under /root) a directory of its own under /tmp, noted in PG_DIR.
pg_data() { cat "$PG_DIR/data.path" 2>/dev/null; }

pg_healthy() {
  local data; data="$(pg_data)" || return 1
  [[ -n "$data" && -f "$data/postmaster.pid" && -f "$PG_DIR/port" ]] || return 1
  kill -0 "$(head -1 "$data/postmaster.pid")" 2>/dev/null || return 1
  "$(pg_bindir)/pg_isready" -q -h 127.0.0.1 -p "$(cat "$PG_DIR/port")" -U postgres -d postgres -t 2 2>/dev/null
}

pg_url() { echo "postgres://postgres@127.0.0.1:$(cat "$PG_DIR/port")/$PG_DB?sslmode=disable"; }
pg_env() {
  echo "export AGENTRUN_TEST_DATABASE_URL=$(pg_url)"
  echo "export AGENTRUN_TEST_DATABASE_CA=$PG_DIR/pki/ca.crt"
}

pg_up() {
  if pg_healthy; then
    log "reusing the PostgreSQL at $(pg_url)"
    pg_env
    return
  fi
  pg_install
  pg_down_quiet
  local bin started=$SECONDS port data
  bin="$(pg_bindir)"
  rm -rf "$PG_DIR"; mkdir -p "$PG_DIR"
  data="$PG_DIR/data"
  if [[ $(id -u) -eq 0 ]]; then
    mkdir -p "$data" && chown postgres: "$data" && chmod 700 "$data"
    if ! runuser -u postgres -- test -w "$data"; then
      rm -rf "$data"
      data="$(mktemp -d /tmp/agentrun-e2e-postgres.XXXXXX)"
      chown postgres: "$data" && chmod 700 "$data"
    fi
  fi
  echo "$data" > "$PG_DIR/data.path"
  port=$(free_port)
  echo "$port" > "$PG_DIR/port"
  pg_as "$bin/initdb" -D "$data" -U postgres --auth=trust --no-sync -E UTF8 --locale=C >"$PG_DIR/initdb.log" 2>&1 \
    || { cat "$PG_DIR/initdb.log" >&2; die "initdb failed"; }
  # TLS under a CA of its own, so the tests see the client verify the server
  # (AGENTRUN_TEST_DATABASE_CA); the clear stays allowed (sslmode=disable).
  local pki="$PG_DIR/pki"
  mkdir -p "$pki"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" -days 30 -subj "/CN=agentrun-e2e-postgres-ca" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$pki/server.key" -out "$pki/server.csr" -subj "/CN=127.0.0.1" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > "$pki/server.ext"
  openssl x509 -req -in "$pki/server.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 30 -extfile "$pki/server.ext" -out "$pki/server.crt" 2>/dev/null || die "issuing the PostgreSQL certificate failed"
  install -m 600 "$pki/server.key" "$data/server.key"
  install -m 644 "$pki/server.crt" "$data/server.crt"
  [[ $(id -u) -ne 0 ]] || chown postgres: "$data/server.key" "$data/server.crt"
  # Loopback only, no Unix socket, no durability: a cluster for tests, thrown away.
  cat >> "$data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = ''
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 50
ssl = on
CONF
  mkdir -p "$E2E_DIR/logs"
  # The server writes to the descriptor it inherits: the log needs no rights of its own.
  pg_as "$bin/pg_ctl" -D "$data" -w -t 30 start >"$E2E_DIR/logs/postgres.log" 2>&1 \
    || { tail -n 40 "$E2E_DIR/logs/postgres.log" >&2; pg_down_quiet; die "PostgreSQL did not start"; }
  pg_as "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres "$PG_DB" \
    || { pg_down_quiet; die "createdb $PG_DB failed"; }
  log "PostgreSQL $("$bin/postgres" --version | awk '{print $3}') up on 127.0.0.1:$port in $((SECONDS - started))s (data $data)"
  pg_env
}

pg_down_quiet() {
  local data; data="$(pg_data)" || return 0
  [[ -n "$data" && -d "$data" ]] || return 0
  if [[ -f "$data/postmaster.pid" ]]; then
    pg_as "$(pg_bindir)/pg_ctl" -D "$data" -m fast -w -t 30 stop >/dev/null 2>&1 || true
  fi
  rm -rf "$data"
  rm -f "$PG_DIR/data.path" "$PG_DIR/port"
}

pg_down() {
  pg_down_quiet
  log "PostgreSQL stopped and its cluster removed (log kept in $E2E_DIR/logs/postgres.log)"
}

pg_status() {
  if pg_healthy; then
    echo "postgres: up ($(pg_url))"
  else
    echo "postgres: not running (e2e/cluster postgres up)"; return 1
  fi
}
