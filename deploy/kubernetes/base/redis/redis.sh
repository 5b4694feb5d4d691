#!/bin/sh
# redis.sh server|sentinel: one pod of the redis StatefulSet (redis-0..2), a Redis server and a
# sentinel side by side. The master is whichever one the sentinels name; on a first start (no
# sentinel answers) it is redis-0. Every address is the pod's stable DNS name, announced as is
# (hostnames, not pod IPs, which change when a pod is rescheduled).
set -eu
NAME=pagedserve
ME="$POD_NAME.redis.$POD_NAMESPACE.svc"
master=""
for i in 0 1 2; do
  peer="redis-$i.redis.$POD_NAMESPACE.svc"
  [ "$peer" = "$ME" ] && [ "$1" = sentinel ] && continue
  master=$(timeout 3 redis-cli -h "$peer" -p 26379 --raw sentinel get-master-addr-by-name "$NAME" 2>/dev/null \
           | head -n 1) || master=""
  [ -n "$master" ] && break
done
[ -n "$master" ] || master="redis-0.redis.$POD_NAMESPACE.svc"
echo "redis.sh $1: I am $ME, master is $master"

if [ "$1" = server ]; then
  set -- --port 6379 --dir /data --appendonly yes --appendfsync everysec --save "" \
         --replica-announce-ip "$ME"
  [ "$master" = "$ME" ] || set -- "$@" --replicaof "$master" 6379
  exec redis-server "$@"
fi

# a sentinel rewrites its own config file: it lives on the pod's emptyDir
cat > /sentinel/sentinel.conf <<CONF
port 26379
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $ME
sentinel monitor $NAME $master 6379 2
sentinel down-after-milliseconds $NAME 5000
sentinel failover-timeout $NAME 30000
sentinel parallel-syncs $NAME 1
CONF
exec redis-server /sentinel/sentinel.conf --sentinel
