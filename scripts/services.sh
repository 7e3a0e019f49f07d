#!/usr/bin/env bash
# Make sure PostgreSQL (127.0.0.1:5432, trust auth, database `test`) and Redis
# (127.0.0.1:6379, no persistence) answer; start them if they are down, install them from
# Debian's packages if they are missing. Exit non-zero naming the one still unreachable.
set -uo pipefail

pg_ok() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && psql -h 127.0.0.1 -U postgres -d test -Atqc 'select 1' >/dev/null 2>&1; }
redis_ok() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }

if ! pg_ok; then
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "services: installing PostgreSQL from Debian's packages"
    as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq postgresql >/dev/null
  fi
  ver=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -1)
  if [ -n "$ver" ]; then
    conf=/etc/postgresql/$ver/main
    # trust auth on loopback, as on the development machines
    if ! grep -qE '^host\s+all\s+all\s+127\.0\.0\.1/32\s+trust' "$conf/pg_hba.conf" 2>/dev/null; then
      as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\nlocal all all trust' "$conf/pg_hba.conf"
    fi
    as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start 2>/dev/null \
      || as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main reload 2>/dev/null || true
    for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
    psql -h 127.0.0.1 -U postgres -Atqc "select 1 from pg_database where datname='test'" 2>/dev/null | grep -q 1 \
      || psql -h 127.0.0.1 -U postgres -qc 'create database test' >/dev/null 2>&1 || true
  fi
fi

if ! redis_ok; then
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "services: installing Redis from Debian's packages"
    as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq redis-server >/dev/null
  fi
  mkdir -p /tmp/lockgate-redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp/lockgate-redis --logfile /tmp/lockgate-redis/redis.log >/dev/null
  for _ in $(seq 1 30); do redis_ok && break; sleep 0.2; done
fi

rc=0
pg_ok || { echo "services: PostgreSQL is NOT reachable at 127.0.0.1:5432 (user postgres, database test)" >&2; rc=1; }
redis_ok || { echo "services: Redis is NOT reachable at 127.0.0.1:6379" >&2; rc=1; }
[ $rc = 0 ] && echo "services: PostgreSQL and Redis answer"
exit $rc
