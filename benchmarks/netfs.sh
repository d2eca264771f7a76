#!/bin/sh
# A real network filesystem on this one host, as the source of benchmarks/stage.py --netfs:
# a one-brick GlusterFS volume, served by glusterd/glusterfsd over TCP and mounted over FUSE,
# so every read the client makes is a request over the network stack to the brick server.
#
#   benchmarks/netfs.sh up        # start glusterd, create + start the volume, mount it
#                                 # (a mount whose client died is unmounted and made again)
#   benchmarks/netfs.sh remount   # unmount and mount again: a cold client (no cached data)
#   benchmarks/netfs.sh down      # unmount, stop and delete the volume, stop glusterd
#   benchmarks/netfs.sh status    # exit 0 when mounted
#
# Each command is idempotent. Needs root, /dev/fuse and Debian's glusterfs-server and
# glusterfs-client (apt-get install glusterfs-server glusterfs-client); without them it exits 3
# with one line saying what is missing. The brick's data stays under NETFS_BRICK (its files
# are the benchmark's inputs, generated once): `down` stops the volume and keeps it and them
# for the next `up`; `down --purge` deletes the volume and the brick.
# Settings: NETFS_VOL (dsbench), NETFS_BRICK (/srv/datastore-netfs/brick),
# NETFS_MNT (/mnt/datastore-netfs), NETFS_HOST (this host's first non-loopback address:
# glusterd refuses a brick on a loopback address).
set -eu

VOL=${NETFS_VOL:-dsbench}
BRICK=${NETFS_BRICK:-/srv/datastore-netfs/brick}
MNT=${NETFS_MNT:-/mnt/datastore-netfs}

cannot() { echo "netfs: cannot run GlusterFS here: $*" >&2; exit 3; }

host() {
    if [ -n "${NETFS_HOST:-}" ]; then echo "$NETFS_HOST"; return; fi
    for a in $(hostname -I 2>/dev/null); do
        case $a in 127.*|::1|*:*) ;; *) echo "$a"; return ;; esac
    done
    cannot "no non-loopback IPv4 address for the brick (set NETFS_HOST)"
}

mounted() { grep -qs " $MNT fuse.glusterfs " /proc/self/mounts; }

# A mount whose client process died stays listed but answers "Transport endpoint is not
# connected": unmount it so that `up` mounts afresh.
unmount_dead() {
    if mounted && ! stat "$MNT/." >/dev/null 2>&1; then umount -l "$MNT"; fi
}

need() {
    [ "$(id -u)" = 0 ] || cannot "not root"
    [ -c /dev/fuse ] || cannot "no /dev/fuse"
    grep -qw fuse /proc/filesystems || cannot "the kernel has no FUSE"
    for t in glusterd gluster mount.glusterfs; do
        command -v "$t" >/dev/null 2>&1 ||
            cannot "no $t (apt-get install glusterfs-server glusterfs-client)"
    done
}

glusterd_up() {
    gluster --mode=script pool list >/dev/null 2>&1 || glusterd -p /run/glusterd.pid
    i=0
    until gluster --mode=script pool list >/dev/null 2>&1; do
        i=$((i + 1)); [ $i -le 50 ] || cannot "glusterd does not answer"; sleep 0.2
    done
}

do_mount() {
    mkdir -p "$MNT"
    mount -t glusterfs "localhost:/$VOL" "$MNT" || cannot "mount -t glusterfs localhost:/$VOL $MNT failed"
    i=0
    until mounted && stat -f "$MNT" >/dev/null 2>&1; do
        i=$((i + 1)); [ $i -le 50 ] || cannot "$MNT did not come up"; sleep 0.2
    done
}

up() {
    need
    glusterd_up
    if ! gluster --mode=script volume info "$VOL" >/dev/null 2>&1; then
        mkdir -p "$BRICK"
        gluster --mode=script volume create "$VOL" "$(host):$BRICK" force >/dev/null
    fi
    if ! gluster --mode=script volume status "$VOL" >/dev/null 2>&1; then
        gluster --mode=script volume start "$VOL" force >/dev/null
    fi
    unmount_dead
    mounted || do_mount
    echo "netfs: $VOL mounted at $MNT (GlusterFS over FUSE, brick $(host):$BRICK)"
}

case ${1:-} in
up) up ;;
remount)
    need
    if mounted; then umount "$MNT"; fi
    up >/dev/null
    ;;
down)
    if mounted; then umount "$MNT"; fi
    if command -v gluster >/dev/null 2>&1 && gluster --mode=script pool list >/dev/null 2>&1; then
        gluster --mode=script volume stop "$VOL" force >/dev/null 2>&1 || true
        if [ "${2:-}" = --purge ]; then
            gluster --mode=script volume delete "$VOL" >/dev/null 2>&1 || true
        fi
        pkill -F /run/glusterd.pid 2>/dev/null || true
    fi
    if [ "${2:-}" = --purge ]; then rm -rf "$BRICK"; fi
    echo "netfs: down"
    ;;
status) mounted ;;
*) echo "usage: $0 up|remount|down [--purge]|status" >&2; exit 2 ;;
esac
